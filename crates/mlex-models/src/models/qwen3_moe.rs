//! `qwen3_moe`: Qwen3 MoE — qwen3 attention with sparse MoE blocks
//! (softmax router, top-k, SwiGLU experts) on every `decoder_sparse_step`-th
//! layer not listed in `mlp_only_layers`. Reference: mlx-lm
//! `models/qwen3_moe.py`.

use super::qwen3::qwen3_rope;
use super::{decoder_plan, drop_tied_head, stack_experts};
use mlex_core::arch::{Architecture, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlex_core::weights::WeightMap;
use serde::Deserialize;
use serde_json::{json, Value};

/// `config.json` of a qwen3_moe model.
#[derive(Debug, Deserialize)]
pub struct Qwen3MoeConfig {
    /// Residual width.
    pub hidden_size: i32,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Norm epsilon.
    pub rms_norm_eps: f32,
    /// Vocabulary.
    pub vocab_size: i32,
    /// Experts.
    pub num_experts: i32,
    /// MoE every this many layers.
    pub decoder_sparse_step: i64,
    /// Layers that keep a dense MLP.
    #[serde(default)]
    pub mlp_only_layers: Vec<i64>,
    /// Context limit.
    pub max_position_embeddings: Option<usize>,
    /// Tied output head.
    pub tie_word_embeddings: bool,
    /// RoPE base.
    pub rope_theta: Option<f64>,
    /// RoPE scaling.
    pub rope_scaling: Option<Value>,
    /// Nested RoPE settings.
    pub rope_parameters: Option<Value>,
}

/// The `qwen3_moe` architecture.
pub struct Qwen3Moe;

impl Architecture for Qwen3Moe {
    fn name(&self) -> &str {
        "qwen3_moe"
    }
    fn summary(&self) -> &str {
        "Qwen3 MoE: qwen3 attention + softmax top-k SwiGLU experts"
    }
    fn config_keys(&self) -> Vec<String> {
        super::config_keys::<Qwen3MoeConfig>()
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let c: Qwen3MoeConfig = config.parse()?;
        let (theta, scaling) = qwen3_rope(
            config,
            c.rope_theta,
            c.rope_scaling.as_ref(),
            c.rope_parameters.as_ref(),
        )?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let moe = !c.mlp_only_layers.contains(&(i as i64))
                    && c.num_experts > 0
                    && (i as i64 + 1) % c.decoder_sparse_step.max(1) == 0;
                let o = json!({
                    "qk_norm": "pre_rope",
                    "rope_theta": theta,
                    "rope_scaling": scaling,
                    "mlp": if moe { "qwen_moe" } else { "swiglu" },
                });
                ("attention".to_owned(), o)
            })
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
        let v = config.value();
        drop_tied_head(config, weights, false)?;
        let experts = v.get("num_experts").and_then(Value::as_u64).unwrap_or(0) as usize;
        let layers = v
            .get("num_hidden_layers")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        for l in 0..layers {
            stack_experts(
                weights,
                &format!("model.layers.{l}.mlp"),
                experts,
                &[
                    ("up_proj", "up_proj"),
                    ("down_proj", "down_proj"),
                    ("gate_proj", "gate_proj"),
                ],
            )?;
        }
        Ok(())
    }
}

mlex_core::register_architecture!("qwen3_moe", Qwen3Moe);
