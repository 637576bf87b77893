//! `qwen2`: Qwen2/Qwen2.5 — the llama layout with q/k/v biases and a
//! 1e6 RoPE base. Reference: mlx-lm `models/qwen2.py`.

use super::{decoder_plan, drop_tied_head};
use mlex_core::arch::{Architecture, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlex_core::weights::WeightMap;
use serde::Deserialize;
use serde_json::json;

fn d_theta() -> f64 {
    1_000_000.0
}
fn d_true() -> bool {
    true
}

/// `config.json` of a qwen2 model.
#[derive(Debug, Deserialize)]
pub struct Qwen2Config {
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
    /// RoPE base.
    #[serde(default = "d_theta")]
    pub rope_theta: f64,
    /// Traditional RoPE.
    #[serde(default)]
    pub rope_traditional: bool,
    /// Tied output head.
    #[serde(default = "d_true")]
    pub tie_word_embeddings: bool,
}

/// The `qwen2` architecture.
pub struct Qwen2;

impl Architecture for Qwen2 {
    fn name(&self) -> &str {
        "qwen2"
    }
    fn summary(&self) -> &str {
        "Qwen2/2.5: GQA attention with q/k/v biases + SwiGLU MLP"
    }
    fn config_keys(&self) -> Vec<String> {
        super::config_keys::<Qwen2Config>()
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let c: Qwen2Config = config.parse()?;
        let o = json!({
            "qkv_bias": true,
            "rope_theta": c.rope_theta,
            "rope_traditional": c.rope_traditional,
        });
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
        drop_tied_head(config, weights, true)?;
        Ok(())
    }
}

mlex_core::register_architecture!("qwen2", Qwen2);
