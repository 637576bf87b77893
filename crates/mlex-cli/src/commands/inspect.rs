//! `mlex inspect`: architecture, where the checkpoint came from, layer plan
//! with kinds, the decode segment schedule, parameters, and the dtype and
//! quantization of every tensor group; with `--spec`, the resolved plan of
//! every block (`plan.rs`).

use crate::args::{Format, InspectArgs};
use crate::session::load_model;
use mlex_compile::Schedule;
use mlex_core::error::Result;
use mlex_core::registry::Registry;
use mlex_models::load::ModelSource;
use serde_json::json;

pub fn run(a: InspectArgs, registry: &Registry) -> Result<()> {
    let loaded = load_model(&a.model, registry, &crate::session::dispatch(None)?)?;
    let m = &loaded.model;
    let arch = registry.architecture(&m.arch)?;
    if a.spec {
        let plan = arch.plan(&m.config)?;
        match a.format {
            Format::Json => println!("{}", super::plan::to_json(m, &plan)),
            Format::Text => println!("{}", super::plan::render(m, arch.summary(), &plan)),
        }
        return Ok(());
    }
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
    let origin = loaded.origin.to_string();
    let groups = tensor_groups(&loaded);
    let info = json!({
        "architecture": m.arch,
        "summary": arch.summary(),
        "source": source,
        "origin": origin,
        "format": match &loaded.source {
            ModelSource::Dir(_) => "safetensors",
            ModelSource::Gguf(_) => "gguf",
        },
        "tensor_groups": groups.iter().map(|g| json!({
            "group": g.name,
            "tensors": g.tensors,
            "stored": g.stored,
            "file_types": g.file_types,
        })).collect::<Vec<_>>(),
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
    println!("origin        {origin}");
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
    println!("tensor groups ({}):", groups.len());
    for g in &groups {
        let file = if g.file_types.is_empty() {
            String::new()
        } else {
            format!("  (in the file: {})", g.file_types.join(", "))
        };
        println!("  {:<44} {:>4} × {}{file}", g.name, g.tensors, g.stored);
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

/// Tensors of one kind across layers (`model.layers.*.self_attn.q_proj`).
struct TensorGroup {
    name: String,
    tensors: usize,
    /// As loaded: `bf16`, or `4-bit affine, group 64 (bf16 scales)`.
    stored: String,
    /// GGUF only: the GGML types the file stored them in.
    file_types: Vec<String>,
}

/// A parameter's group: the module path with layer (and expert) indices
/// replaced by `*`, without the `.weight`/`.scales`/`.biases` suffix.
fn group_of(name: &str) -> String {
    let module = ["weight", "scales", "biases", "bias"]
        .iter()
        .find_map(|s| name.strip_suffix(&format!(".{s}")))
        .unwrap_or(name);
    module
        .split('.')
        .map(|p| {
            if p.chars().all(|c| c.is_ascii_digit()) {
                "*"
            } else {
                p
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// The parts of a fused module name (`a.q_proj+k_proj` → `a.q_proj`,
/// `a.k_proj`; see `mlex_core::nn::fused_name`); a plain name is its own.
fn unfused(module: &str) -> Vec<String> {
    let mut names = module.split('+');
    let first = names.next().unwrap_or(module);
    let parent = first.rsplit_once('.').map_or("", |(p, _)| p);
    std::iter::once(first.to_owned())
        .chain(names.map(|n| format!("{parent}.{n}")))
        .collect()
}

/// The dtype and quantization of every tensor group, with the GGML types
/// the file held for GGUF checkpoints.
fn tensor_groups(loaded: &mlex_models::load::LoadedModel) -> Vec<TensorGroup> {
    use std::collections::BTreeMap;
    let m = &loaded.model;
    let mut groups: BTreeMap<String, (usize, std::collections::BTreeSet<String>)> = BTreeMap::new();
    let by_name: std::collections::HashMap<&str, &mlx_rs::Array> = m.params.iter().collect();
    for (name, a) in m.params.iter() {
        if name.ends_with(".scales") || name.ends_with(".biases") {
            continue;
        }
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let dtype = format!("{:?}", a.dtype()).to_lowercase();
        // Projections fused at load (`...q_proj+k_proj+v_proj`) are shown
        // as the checkpoint's tensors; their parts are stored alike.
        let parts = unfused(module);
        let stored = match m.quantization.for_module(&parts[0]) {
            Some(q) if by_name.contains_key(format!("{module}.scales").as_str()) => {
                let scales = by_name
                    .get(format!("{module}.scales").as_str())
                    .map(|s| format!("{:?}", s.dtype()).to_lowercase())
                    .unwrap_or_default();
                format!(
                    "{}-bit affine, group {} ({scales} scales)",
                    q.bits, q.group_size
                )
            }
            _ => dtype,
        };
        for part in &parts {
            let g = groups.entry(group_of(part)).or_default();
            g.0 += 1;
            g.1.insert(stored.clone());
        }
    }
    let mut file_types: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    for (name, ty) in &loaded.gguf_tensor_types {
        file_types
            .entry(group_of(name))
            .or_default()
            .insert(ty.clone());
    }
    groups
        .into_iter()
        .map(|(name, (tensors, stored))| TensorGroup {
            file_types: file_types
                .get(&name)
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default(),
            name,
            tensors,
            stored: stored.into_iter().collect::<Vec<_>>().join(" / "),
        })
        .collect()
}
