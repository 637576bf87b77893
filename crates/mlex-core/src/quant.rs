//! How a checkpoint is quantized: MLX affine quantization, a default
//! `(group_size, bits)` and per-module overrides, exactly as mlx-lm writes
//! them into `config.json`:
//!
//! ```json
//! "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
//!                  "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
//!                  "lm_head": false}
//! ```

use crate::config::ModelConfig;
use crate::error::Result;
use serde_json::Value;
use std::collections::BTreeMap;

/// One module's quantization.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    /// Elements per scale/bias group.
    pub group_size: i32,
    /// Bits per weight: 2, 3, 4, 5, 6 or 8.
    pub bits: i32,
}

impl QuantSpec {
    /// Checks that MLX's affine quantization supports this spec.
    pub fn validate(&self, what: &str, cfg: &ModelConfig) -> Result<()> {
        if ![2, 3, 4, 5, 6, 8].contains(&self.bits) {
            return Err(cfg.error(
                what,
                format!("unsupported bits {} (2, 3, 4, 5, 6 or 8)", self.bits),
            ));
        }
        if ![32, 64, 128].contains(&self.group_size) {
            return Err(cfg.error(
                what,
                format!("unsupported group_size {} (32, 64 or 128)", self.group_size),
            ));
        }
        Ok(())
    }
}

/// The quantization of a whole checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Quantization {
    /// The default for every quantized module.
    pub default: Option<QuantSpec>,
    /// Per-module overrides; `None` means "not quantized".
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl Quantization {
    /// Reads `quantization` (or HF's `quantization_config`) from a config.
    pub fn from_config(cfg: &ModelConfig) -> Result<Self> {
        let key = if cfg.value().get("quantization").is_some() {
            "quantization"
        } else {
            "quantization_config"
        };
        let Some(q) = cfg.value().get(key) else {
            return Ok(Self::default());
        };
        let Some(obj) = q.as_object() else {
            return Err(cfg.error(key, "expected an object"));
        };
        let spec_of = |v: &Value, path: &str| -> Result<Option<QuantSpec>> {
            match v {
                Value::Bool(false) => Ok(None),
                Value::Object(o) => {
                    let get = |k: &str, d: i64| o.get(k).and_then(Value::as_i64).unwrap_or(d);
                    if let Some(mode) = o.get("mode").and_then(Value::as_str) {
                        if mode != "affine" {
                            return Err(cfg.error(
                                path,
                                format!(
                                    "quantization mode `{mode}` is not supported (affine only)"
                                ),
                            ));
                        }
                    }
                    let s = QuantSpec {
                        group_size: get("group_size", 64) as i32,
                        bits: get("bits", 4) as i32,
                    };
                    s.validate(path, cfg)?;
                    Ok(Some(s))
                }
                _ => Err(cfg.error(path, "expected an object or false")),
            }
        };
        let default = spec_of(q, key)?;
        let mut overrides = BTreeMap::new();
        for (k, v) in obj {
            if v.is_object() || v.is_boolean() {
                overrides.insert(k.clone(), spec_of(v, &format!("{key}.{k}"))?);
            }
        }
        Ok(Self { default, overrides })
    }

    /// The spec for the module at `path` (e.g. `model.layers.0.mlp.gate`).
    pub fn for_module(&self, path: &str) -> Option<QuantSpec> {
        if let Some(o) = self.overrides.get(path) {
            return o.clone();
        }
        // Projections fused at load (`a.q_proj+k_proj+v_proj`, see
        // `nn::fused_name`) are stored alike, so the first part's entry is
        // theirs (mlx-lm's mixed recipes give every module its own).
        match path.split_once('+') {
            Some((first, _)) => self.for_module(first),
            None => self.default.clone(),
        }
    }

    /// True when nothing is quantized.
    pub fn is_none(&self) -> bool {
        self.default.is_none() && self.overrides.values().all(Option::is_none)
    }
}
