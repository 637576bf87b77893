//! Rotary position embedding variants, as mlx-lm's `initialize_rope`:
//! `default`/`linear` (MLX's `fast.rope` with a position scale), `freq_factors`
//! (a GGUF's `rope_freqs` tensor, per-pair period factors), `llama3`
//! (custom frequencies), and `mrope` on text-only input (plain RoPE).

use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlx_rs::{fast, Array};
use serde_json::Value;

/// A RoPE as applied to `[B, H, T, D]` queries/keys.
#[derive(Clone, Debug)]
pub struct Rope {
    /// Rotated feature dims (≤ head dim).
    pub dims: i32,
    /// Rotate consecutive pairs instead of halves.
    pub traditional: bool,
    /// Frequency base (unused with explicit `freqs`).
    pub base: f32,
    /// Position scale.
    pub scale: f32,
    /// Explicit frequencies (`llama3` scaling), `[dims / 2]`.
    pub freqs: Option<Vec<f32>>,
}

impl Rope {
    /// Applies the rotation at position `offset`.
    pub fn apply(&self, x: &Array, offset: usize) -> Result<Array> {
        let freqs = self
            .freqs
            .as_ref()
            .map(|f| Array::from_slice(f, &[f.len() as i32]));
        Ok(match &freqs {
            Some(f) => fast::rope(x, self.dims, self.traditional, None, 1.0, offset as i32, f)?,
            None => fast::rope(
                x,
                self.dims,
                self.traditional,
                self.base,
                self.scale,
                offset as i32,
                None,
            )?,
        })
    }

    /// Applies the rotation with a position per batch row: `positions` is
    /// `[B]` int32, row `b` starting at `positions[b]` (a batch whose
    /// sequences sit at different positions).
    pub fn apply_at(&self, x: &Array, positions: &Array) -> Result<Array> {
        let freqs = self
            .freqs
            .as_ref()
            .map(|f| Array::from_slice(f, &[f.len() as i32]));
        Ok(match &freqs {
            Some(f) => fast::rope_dynamic(x, self.dims, self.traditional, None, 1.0, positions, f)?,
            None => fast::rope_dynamic(
                x,
                self.dims,
                self.traditional,
                self.base,
                self.scale,
                positions,
                None,
            )?,
        })
    }

    /// Builds the RoPE for `dims` rotated dims from `base` and an optional
    /// `rope_scaling` object (HF/mlx-lm conventions).
    pub fn from_scaling(
        cfg: &ModelConfig,
        dims: i32,
        base: f32,
        traditional: bool,
        scaling: Option<&Value>,
    ) -> Result<Self> {
        let mut rope = Rope {
            dims,
            traditional,
            base,
            scale: 1.0,
            freqs: None,
        };
        let Some(sc) = scaling.filter(|v| v.is_object()) else {
            return Ok(rope);
        };
        let kind = sc
            .get("type")
            .or_else(|| sc.get("rope_type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let num = |k: &str, d: f64| sc.get(k).and_then(Value::as_f64).unwrap_or(d);
        match kind {
            "default" | "mrope" => {}
            "linear" => {
                let factor = sc
                    .get("factor")
                    .and_then(Value::as_f64)
                    .ok_or_else(|| cfg.error("rope_scaling.factor", "missing for linear RoPE"))?;
                rope.scale = (1.0 / factor) as f32;
            }
            "llama3" => {
                let factor = sc
                    .get("factor")
                    .and_then(Value::as_f64)
                    .ok_or_else(|| cfg.error("rope_scaling.factor", "missing for llama3 RoPE"))?;
                let low = num("low_freq_factor", 1.0);
                let high = num("high_freq_factor", 4.0);
                let old = num("original_max_position_embeddings", 8192.0);
                let low_wav = old / low;
                let high_wav = old / high;
                let freqs = (0..dims)
                    .step_by(2)
                    .map(|i| {
                        let f = (base as f64).powf(i as f64 / dims as f64);
                        let wav = 2.0 * std::f64::consts::PI * f;
                        let f = if wav > low_wav { f * factor } else { f };
                        let medium = wav > high_wav && wav < low_wav;
                        if medium {
                            let smooth = (old / wav - low) / (high - low);
                            (f / ((1.0 - smooth) / factor + smooth)) as f32
                        } else {
                            f as f32
                        }
                    })
                    .collect();
                rope.freqs = Some(freqs);
            }
            "freq_factors" => {
                // From a GGUF's `rope_freqs` tensor: each rotated pair's
                // period is stretched by its factor (llama.cpp divides the
                // angle by it).
                let factors: Vec<f64> = sc
                    .get("factors")
                    .and_then(Value::as_array)
                    .map(|v| v.iter().filter_map(Value::as_f64).collect())
                    .ok_or_else(|| {
                        cfg.error("rope_scaling.factors", "missing for freq_factors RoPE")
                    })?;
                if factors.len() != (dims as usize).div_ceil(2) {
                    return Err(cfg.error(
                        "rope_scaling.factors",
                        format!(
                            "{} factors for {dims} rotated dims (expected {})",
                            factors.len(),
                            (dims as usize).div_ceil(2)
                        ),
                    ));
                }
                rope.freqs = Some(
                    (0..dims)
                        .step_by(2)
                        .zip(&factors)
                        .map(|(i, f)| ((base as f64).powf(i as f64 / dims as f64) * f) as f32)
                        .collect(),
                );
            }
            other => {
                return Err(cfg.error(
                    "rope_scaling.type",
                    format!(
                        "RoPE scaling `{other}` is not supported (default, linear, llama3, mrope, freq_factors)"
                    ),
                ))
            }
        }
        Ok(rope)
    }
}
