//! Writing a loaded model as an MLX-community checkpoint, the layout
//! `mlx_lm.convert` writes (`mlx_lm/utils.py`, `save_model` and
//! `save_config`) and mlx-lm and mlex load:
//!
//! - the weights under their mlx-lm names (the names the store keeps
//!   after `sanitize`, projections unfused) in safetensors shards of at most
//!   `shard_bytes` (mlx-lm: 5 GiB), `model.safetensors` when one is enough,
//!   else `model-0000i-of-0000N.safetensors`, each with metadata
//!   `{"format": "mlx"}`;
//! - `model.safetensors.index.json` always: `metadata.total_size`,
//!   `metadata.total_parameters` (a packed matrix counted unpacked) and the
//!   `weight_map`, sorted by name;
//! - `config.json`, keys sorted, with the `quantization` block (and its
//!   copy `quantization_config`) of the model's quantization, or without
//!   both when it has none.
//!
//! The model's own config is the text part a multimodal wrapper lifts
//! (Qwen3.5's `text_config`), so the caller hands over the whole one.

use mlex_core::error::{Error, Result};
use mlex_core::model::Model;
use mlex_core::quant::{QuantSpec, Quantization};
use mlx_rs::Array;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// mlx-lm's shard size.
pub const SHARD_BYTES: usize = 5 << 30;

/// What [`save`] wrote.
#[derive(Clone, Debug)]
pub struct Saved {
    /// The weight files, in order.
    pub files: Vec<String>,
    /// Bytes of weights.
    pub total_size: usize,
    /// Parameters, packed ones counted unpacked.
    pub total_parameters: usize,
}

fn spec_json(s: &QuantSpec) -> Value {
    json!({"group_size": s.group_size, "bits": s.bits, "mode": "affine"})
}

/// `config.json`'s `quantization` block of `q` (`None`: not quantized).
pub fn quantization_json(q: &Quantization) -> Option<Value> {
    if q.is_none() {
        return None;
    }
    let mut m = Map::new();
    if let Some(d) = &q.default {
        if let Value::Object(o) = spec_json(d) {
            m.extend(o);
        }
    }
    for (k, v) in &q.overrides {
        m.insert(
            k.clone(),
            v.as_ref().map(spec_json).unwrap_or(Value::Bool(false)),
        );
    }
    Some(Value::Object(m))
}

/// Parameters in `name`'s tensor, a packed matrix counted unpacked.
fn parameters(name: &str, a: &Array, q: &Quantization) -> usize {
    let n = a.size();
    match name.strip_suffix(".weight") {
        Some(m) if a.dtype() == mlx_rs::Dtype::Uint32 => match q.for_module(m) {
            Some(s) => n * 32 / s.bits as usize,
            None => n,
        },
        _ => n,
    }
}

/// Writes `model`'s weights and `config` (the checkpoint's whole
/// `config.json`, a multimodal wrapper's included, with the model's
/// quantization put in) into `dir` (which must exist and hold no
/// checkpoint).
pub fn save(model: &Model, config: &Value, dir: &Path, shard_bytes: usize) -> Result<Saved> {
    let tensors: Vec<(&str, &Array)> = model.params.iter().collect();
    if let Some((n, _)) = tensors.iter().find(|(n, _)| n.contains('+')) {
        return Err(Error::Other(format!(
            "`{n}` is a fused projection: load with projections apart to save"
        )));
    }
    // Greedy in store order, as save_model fills its shards.
    let mut shards: Vec<Vec<(&str, &Array)>> = vec![Vec::new()];
    let mut size = 0usize;
    for (name, a) in &tensors {
        let b = a.nbytes();
        if size + b > shard_bytes && !shards.last().expect("one").is_empty() {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("one").push((name, a));
        size += b;
    }
    let n = shards.len();
    let meta: HashMap<String, String> = [("format".to_owned(), "mlx".to_owned())].into();
    let mut weight_map = BTreeMap::new();
    let mut files = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = if n == 1 {
            "model.safetensors".to_owned()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        };
        let path = dir.join(&file);
        Array::save_safetensors(shard.iter().map(|(k, a)| (*k, *a)), &meta, &path)
            .map_err(|e| Error::Other(format!("writing {}: {e}", path.display())))?;
        for (k, _) in shard {
            weight_map.insert(k.to_string(), json!(file));
        }
        files.push(file);
    }
    let total_size: usize = tensors.iter().map(|(_, a)| a.nbytes()).sum();
    let total_parameters: usize = tensors
        .iter()
        .filter(|(k, _)| !k.ends_with(".scales") && !k.ends_with(".biases"))
        .map(|(k, a)| parameters(k, a, &model.quantization))
        .sum();
    let index = json!({
        "metadata": {"total_size": total_size, "total_parameters": total_parameters},
        "weight_map": weight_map,
    });
    write_json(&dir.join("model.safetensors.index.json"), &index)?;
    let mut config = config.clone();
    if let Some(o) = config.as_object_mut() {
        o.remove("quantization");
        o.remove("quantization_config");
        if let Some(q) = quantization_json(&model.quantization) {
            o.insert("quantization".into(), q.clone());
            o.insert("quantization_config".into(), q);
        }
    }
    write_json(&dir.join("config.json"), &sorted(config))?;
    Ok(Saved {
        files,
        total_size,
        total_parameters,
    })
}

/// `value` with every object's keys sorted (mlx-lm's `sort_keys`).
fn sorted(value: Value) -> Value {
    match value {
        Value::Object(o) => {
            let mut keys: Vec<(String, Value)> = o.into_iter().collect();
            keys.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(keys.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Array(a) => Value::Array(a.into_iter().map(sorted).collect()),
        v => v,
    }
}

/// Writes `v` as JSON indented by four spaces, as mlx-lm does.
pub fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut out = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    serde::Serialize::serialize(v, &mut ser)
        .map_err(|e| Error::Other(format!("{}: {e}", path.display())))?;
    out.push(b'\n');
    std::fs::write(path, out).map_err(|e| Error::io(path, e))
}
