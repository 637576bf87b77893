//! `qwen3`: Qwen3 dense — llama layout with per-head q/k RMS norms before
//! RoPE and no biases. Reference: mlx-lm `models/qwen3.py`.

use super::{decoder_plan, drop_tied_head};
use mlex_core::arch::{Architecture, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlex_core::weights::WeightMap;
use serde::Deserialize;
use serde_json::{json, Value};

/// `config.json` of a qwen3 model.
#[derive(Debug, Deserialize)]
pub struct Qwen3Config {
    /// Residual width.
    pub hidden_size: i32,
    /// Layers.
    pub num_hidden_layers: usize,
    /// MLP width.
    pub intermediate_size: i32,
    /// Query heads.
    pub num_attention_heads: i32,
    /// Norm epsilon.
    pub rms_norm_eps: f32,
    /// Vocabulary.
    pub vocab_size: i32,
    /// Context limit.
    pub max_position_embeddings: Option<usize>,
    /// Tied output head (required, as in mlx-lm).
    pub tie_word_embeddings: bool,
    /// RoPE base (or inside `rope_parameters`).
    pub rope_theta: Option<f64>,
    /// RoPE scaling (or `rope_parameters`).
    pub rope_scaling: Option<Value>,
    /// transformers ≥ 5 nests the RoPE settings here.
    pub rope_parameters: Option<Value>,
}

/// RoPE options shared by qwen3 and qwen3_moe: `rope_theta`/`rope_scaling`
/// or their `rope_parameters` nesting.
pub(crate) fn qwen3_rope(
    config: &ModelConfig,
    theta: Option<f64>,
    scaling: Option<&Value>,
    params: Option<&Value>,
) -> Result<(f64, Option<Value>)> {
    let theta = theta
        .or_else(|| {
            params
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
        })
        .ok_or_else(|| config.error("rope_theta", "missing from the model config"))?;
    let scaling = scaling.cloned().or_else(|| params.cloned());
    Ok((theta, scaling))
}

/// The `qwen3` architecture.
pub struct Qwen3;

impl Architecture for Qwen3 {
    fn name(&self) -> &str {
        "qwen3"
    }
    fn summary(&self) -> &str {
        "Qwen3 dense: GQA attention with q/k norms + SwiGLU MLP"
    }
    fn config_keys(&self) -> Vec<String> {
        super::config_keys::<Qwen3Config>()
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let c: Qwen3Config = config.parse()?;
        let (theta, scaling) = qwen3_rope(
            config,
            c.rope_theta,
            c.rope_scaling.as_ref(),
            c.rope_parameters.as_ref(),
        )?;
        let o = json!({"qk_norm": "pre_rope", "rope_theta": theta, "rope_scaling": scaling});
        let layers = (0..c.num_hidden_layers)
            .map(|_| ("attention".to_owned(), o.clone()))
            .collect();
        Ok(decoder_plan(
            "model",
            "lm_head",
            c.vocab_size,
            c.hidden_size,
            c.rms_norm_eps,
            c.tie_word_embeddings,
            layers,
            c.max_position_embeddings,
        ))
    }
    fn sanitize(&self, config: &ModelConfig, weights: &mut WeightMap) -> Result<()> {
        drop_tied_head(config, weights, false)?;
        Ok(())
    }
}

mlex_core::register_architecture!("qwen3", Qwen3);
