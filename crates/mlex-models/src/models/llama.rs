//! `llama`: Llama 2/3 and the many checkpoints that share its layout
//! (SmolLM2, Mistral-style). Pre-norm GQA attention with RoPE (default,
//! linear or llama3 scaling) and a SwiGLU MLP; optional sliding-window
//! layers. Reference: mlx-lm `models/llama.py`.

use super::{decoder_plan, drop_tied_head, drop_where};
use mlex_core::arch::{Architecture, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlex_core::weights::WeightMap;
use serde::Deserialize;
use serde_json::{json, Value};

fn d_theta() -> f64 {
    10000.0
}
fn d_true() -> bool {
    true
}

/// `config.json` of a llama model.
#[derive(Debug, Deserialize)]
pub struct LlamaConfig {
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
    /// Biases on attention projections.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on MLP projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// RoPE base.
    #[serde(default = "d_theta")]
    pub rope_theta: f64,
    /// Traditional RoPE.
    #[serde(default)]
    pub rope_traditional: bool,
    /// RoPE scaling.
    pub rope_scaling: Option<Value>,
    /// Tied output head.
    #[serde(default = "d_true")]
    pub tie_word_embeddings: bool,
    /// Per-layer `full_attention` / `sliding_attention`.
    pub layer_types: Option<Vec<String>>,
    /// Sliding window size.
    pub sliding_window: Option<usize>,
}

/// The `llama` architecture.
pub struct Llama;

impl Architecture for Llama {
    fn name(&self) -> &str {
        "llama"
    }
    fn summary(&self) -> &str {
        "Llama family: GQA attention + SwiGLU MLP (RoPE default/linear/llama3, sliding layers)"
    }
    fn config_keys(&self) -> Vec<String> {
        super::config_keys::<LlamaConfig>()
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let c: LlamaConfig = config.parse()?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let sliding = c
                    .layer_types
                    .as_ref()
                    .and_then(|t| t.get(i))
                    .is_some_and(|t| t == "sliding_attention");
                let mut o = json!({
                    "qkv_bias": c.attention_bias,
                    "o_bias": c.attention_bias,
                    "mlp_bias": c.mlp_bias,
                    "rope_theta": c.rope_theta,
                    "rope_traditional": c.rope_traditional,
                });
                if sliding {
                    o["sliding_window"] = json!(c.sliding_window);
                }
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
        drop_where(weights, |n| n.contains("self_attn.rotary_emb.inv_freq"))?;
        drop_tied_head(config, weights, true)?;
        Ok(())
    }
}

mlex_core::register_architecture!("llama", Llama);
