//! `mlex inspect`: architecture, layer plan with kinds, the decode segment
//! schedule, parameters, quantization and dtype.

use crate::args::{Format, InspectArgs};
use crate::session::load_model;
use mlex_compile::Schedule;
use mlex_core::error::Result;
use mlex_core::registry::Registry;
use mlex_models::load::ModelSource;
use serde_json::json;

pub fn run(a: InspectArgs, registry: &Registry) -> Result<()> {
    let loaded = load_model(&a.model, registry)?;
    let m = &loaded.model;
    let arch = registry.architecture(&m.arch)?;
    let grows: Vec<bool> = m.layers.iter().map(|s| s.layer.grows()).collect();
    let schedule = Schedule::new(&grows);
    let q = &m.quantization;
    let quant = match &q.default {
        None if q.is_none() => "none".to_owned(),
        None => format!("{} per-module overrides", q.overrides.len()),
        Some(s) => {
            let n = q.overrides.len();
            format!(
                "{}-bit affine, group {}{}",
                s.bits,
                s.group_size,
                if n > 0 {
                    format!(" (+{n} overrides)")
                } else {
                    String::new()
                }
            )
        }
    };
    let caches = m.make_cache(1)?;
    let layers: Vec<_> = m
        .layers
        .iter()
        .zip(&caches.layers)
        .enumerate()
        .map(|(i, (s, c))| {
            json!({
                "index": i,
                "kind": s.kind,
                "prefix": s.prefix,
                "describe": s.layer.describe(),
                "caches": c.iter().map(|c| c.kind()).collect::<Vec<_>>(),
            })
        })
        .collect();
    let source = match &loaded.source {
        ModelSource::Dir(p) => format!("{} (directory)", p.display()),
        ModelSource::Gguf(p) => format!("{} (gguf)", p.display()),
    };
    let info = json!({
        "architecture": m.arch,
        "summary": arch.summary(),
        "source": source,
        "dtype": format!("{:?}", m.dtype).to_lowercase(),
        "parameters": m.num_parameters(),
        "weight_bytes": m.params.nbytes(),
        "tensors": m.params.len(),
        "quantization": quant,
        "vocab_size": m.vocab_size(),
        "max_context": m.max_context,
        "layers": layers,
        "segments": schedule.num_segments(),
        "grow_phases": grows.iter().filter(|g| **g).count(),
        "schedule": schedule.render(),
        "fingerprint": loaded.fingerprint,
    });
    if a.format == Format::Json {
        println!("{info}");
        return Ok(());
    }
    println!("architecture  {} — {}", m.arch, arch.summary());
    println!("source        {source}");
    println!("dtype         {}", info["dtype"].as_str().unwrap_or(""));
    println!(
        "parameters    {} ({} tensors, {:.1} MB)",
        m.num_parameters(),
        m.params.len(),
        m.params.nbytes() as f64 / 1e6
    );
    println!("quantization  {quant}");
    println!("vocabulary    {}", m.vocab_size());
    if let Some(c) = m.max_context {
        println!("context       {c}");
    }
    println!("layers ({}):", m.layers.len());
    for l in &layers {
        println!(
            "  {:>3}  {:<12} {:<28} {}  [{}]",
            l["index"],
            l["kind"].as_str().unwrap_or(""),
            l["prefix"].as_str().unwrap_or(""),
            l["describe"].as_str().unwrap_or(""),
            l["caches"]
                .as_array()
                .map(|v| v
                    .iter()
                    .filter_map(|c| c.as_str())
                    .collect::<Vec<_>>()
                    .join(", "))
                .unwrap_or_default()
        );
    }
    println!(
        "decode step   {} compiled segments, {} eager grow phases",
        schedule.num_segments(),
        info["grow_phases"]
    );
    println!("  {}", schedule.render());
    Ok(())
}
