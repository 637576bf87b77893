//! `qwen3_next`: Qwen3-Next — a hybrid of Gated DeltaNet layers and gated
//! full-attention layers (every `full_attention_interval`-th), each followed
//! by a dense MLP or a MoE with a gated shared expert. Reference: mlx-lm
//! `models/qwen3_next.py`.

use super::{conv_to_mlx, decoder_plan, drop_tied_head, drop_where, norm_plus_one, stack_experts};
use mlex_core::arch::{Architecture, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlex_core::weights::WeightMap;
use serde::Deserialize;
use serde_json::{json, Value};

fn d_interval() -> usize {
    4
}

/// `config.json` of a qwen3_next model (sizes of the linear-attention
/// layers are read by the `gated_delta` kind).
#[derive(Debug, Deserialize)]
pub struct Qwen3NextConfig {
    /// Residual width.
    pub hidden_size: i32,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Norm epsilon.
    pub rms_norm_eps: f32,
    /// Vocabulary.
    pub vocab_size: i32,
    /// Experts (0: dense).
    pub num_experts: i32,
    /// MoE every this many layers.
    pub decoder_sparse_step: i64,
    /// Dense-MLP layers.
    #[serde(default)]
    pub mlp_only_layers: Vec<i64>,
    /// RoPE base.
    pub rope_theta: f64,
    /// Rotated fraction of the head dim.
    pub partial_rotary_factor: f64,
    /// Context limit.
    pub max_position_embeddings: Option<usize>,
    /// Tied head.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Attention biases.
    #[serde(default)]
    pub attention_bias: bool,
    /// RoPE scaling.
    pub rope_scaling: Option<Value>,
    /// Every n-th layer is full attention.
    #[serde(default = "d_interval")]
    pub full_attention_interval: usize,
    /// How the checkpoint stores the linear-attention input projections.
    #[serde(default)]
    pub linear_attention_projections: Projections,
}

/// The linear-attention input projections of a Qwen3-Next checkpoint.
#[derive(Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Projections {
    /// Hugging Face's `in_proj_qkvz` and `in_proj_ba`, grouped per key head.
    #[default]
    Fused,
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (Qwen3.5's
    /// layout; what llama.cpp's GGUF files hold since January 2026).
    Split,
}

/// The `qwen3_next` architecture.
pub struct Qwen3Next;

impl Architecture for Qwen3Next {
    fn name(&self) -> &str {
        "qwen3_next"
    }
    fn summary(&self) -> &str {
        "Qwen3-Next hybrid: Gated DeltaNet + gated attention (every 4th), MLP or MoE with shared expert"
    }
    fn config_keys(&self) -> Vec<String> {
        super::config_keys::<Qwen3NextConfig>()
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let c: Qwen3NextConfig = config.parse()?;
        let layout = match c.linear_attention_projections {
            Projections::Fused => "qwen3_next",
            Projections::Split => "qwen3_5",
        };
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let moe = !c.mlp_only_layers.contains(&(i as i64))
                    && c.num_experts > 0
                    && (i as i64 + 1) % c.decoder_sparse_step.max(1) == 0;
                let mlp = if moe { "qwen_moe" } else { "swiglu" };
                if (i + 1) % c.full_attention_interval.max(1) != 0 {
                    (
                        "gated_delta".to_owned(),
                        json!({"layout": layout, "mlp": mlp}),
                    )
                } else {
                    (
                        "attention".to_owned(),
                        json!({
                            "gated": true,
                            "qk_norm": "pre_rope",
                            "qkv_bias": c.attention_bias,
                            "o_bias": c.attention_bias,
                            "partial_rotary_factor": c.partial_rotary_factor,
                            "rope_theta": c.rope_theta,
                            "rope_scaling": c.rope_scaling,
                            "mlp": mlp,
                        }),
                    )
                }
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
        // Like mlx-lm: only a checkpoint with per-expert MoE tensors is in
        // the Hugging Face layout that needs translating.
        let moe_layers: Vec<String> = weights
            .names()
            .into_iter()
            .filter(|k| {
                k.starts_with("model.layers.") && k.ends_with(".mlp.experts.0.up_proj.weight")
            })
            .map(|k| k.trim_end_matches(".experts.0.up_proj.weight").to_owned())
            .collect();
        if moe_layers.is_empty() {
            return Ok(());
        }
        let v = config.value();
        drop_where(weights, |n| n.contains("mtp."))?;
        drop_tied_head(config, weights, false)?;
        let experts = v.get("num_experts").and_then(Value::as_u64).unwrap_or(0) as usize;
        for prefix in &moe_layers {
            stack_experts(
                weights,
                prefix,
                experts,
                &[
                    ("up_proj", "up_proj"),
                    ("down_proj", "down_proj"),
                    ("gate_proj", "gate_proj"),
                ],
            )?;
        }
        conv_to_mlx(weights, "conv1d.weight")?;
        norm_plus_one(
            weights,
            &[
                ".input_layernorm.weight",
                ".post_attention_layernorm.weight",
                "model.norm.weight",
                ".q_norm.weight",
                ".k_norm.weight",
            ],
        )
    }
}

mlex_core::register_architecture!("qwen3_next", Qwen3Next);
