//! `dhara_ar`: DharaAR (e.g. `codelion/dhara-250m`) — a LLaMA-3-style GQA
//! decoder with Canon layers (Allen-Zhu, *Physics of Language Models,
//! Part 4.1*): causal depthwise convolutions at A (normed attention input),
//! B (q, k, v after projection), C (normed MLP input) and D (MLP inner
//! activation); per-head q/k RMS norms after RoPE; logits soft-capped as
//! `c * tanh(logits / c)`. No mlx-lm model exists: checked against an
//! independent NumPy reference (`xtask/py/dhara_ref.py`).
//!
//! RoPE uses each layer's stored `rotary_emb.inv_freq` when the checkpoint
//! has it (the original model's frequencies need not follow `rope_theta`),
//! else `rope_theta`.

use super::{conv_to_mlx, decoder_plan, drop_tied_head};
use mlex_core::arch::{Architecture, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlex_core::weights::WeightMap;
use serde::Deserialize;
use serde_json::{json, Value};

fn d_eps() -> f32 {
    1e-6
}
fn d_theta() -> f64 {
    8_000_000.0
}
fn d_true() -> bool {
    true
}
fn d_softcap() -> f32 {
    30.0
}
fn d_set() -> String {
    "ABCD".into()
}
fn d_kernel() -> i32 {
    4
}

/// `config.json` of a dhara_ar model.
#[derive(Debug, Deserialize)]
pub struct DharaConfig {
    /// Residual width.
    pub hidden_size: i32,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Vocabulary.
    pub vocab_size: i32,
    /// Norm epsilon.
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    /// RoPE base (when no `inv_freq` is stored).
    #[serde(default = "d_theta")]
    pub rope_theta: f64,
    /// Tied head.
    #[serde(default = "d_true")]
    pub tie_word_embeddings: bool,
    /// q/k norms after RoPE.
    #[serde(default = "d_true")]
    pub use_qk_norm: bool,
    /// Soft-cap the logits.
    #[serde(default = "d_true")]
    pub use_logit_softcap: bool,
    /// Soft-cap value.
    #[serde(default = "d_softcap")]
    pub logit_softcap: f32,
    /// Canon positions.
    #[serde(default = "d_set")]
    pub canon_set: String,
    /// Canon kernel width.
    #[serde(default = "d_kernel")]
    pub canon_kernel: i32,
    /// `x + conv(x)`.
    #[serde(default = "d_true")]
    pub canon_residual: bool,
    /// SiLU after the convolution.
    #[serde(default)]
    pub canon_activation: bool,
    /// Context limit.
    pub max_position_embeddings: Option<usize>,
}

/// The `dhara_ar` architecture.
pub struct DharaAr;

impl Architecture for DharaAr {
    fn name(&self) -> &str {
        "dhara_ar"
    }
    fn summary(&self) -> &str {
        "DharaAR: GQA decoder with Canon convolutions (A, B, C, D), post-RoPE q/k norms, logit soft-cap"
    }
    fn config_keys(&self) -> Vec<String> {
        super::config_keys::<DharaConfig>()
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let c: DharaConfig = config.parse()?;
        let set: String = c.canon_set.to_uppercase();
        if let Some(bad) = set.chars().find(|ch| !"ABCD".contains(*ch)) {
            return Err(config.error(
                "canon_set",
                format!("unknown canon position `{bad}` (A, B, C, D)"),
            ));
        }
        let canon = (!set.is_empty()).then(|| {
            json!({
                "set": set,
                "kernel": c.canon_kernel,
                "residual": c.canon_residual,
                "activation": c.canon_activation,
            })
        });
        let o = json!({
            "qk_norm": if c.use_qk_norm { "post_rope" } else { "none" },
            "rope_theta": c.rope_theta,
            "rope_scaling": Value::Null,
            "rope_inv_freq": true,
            "canon": canon,
        });
        let layers = (0..c.num_hidden_layers)
            .map(|_| ("attention".to_owned(), o.clone()))
            .collect();
        let mut plan = decoder_plan(
            "model",
            "lm_head",
            c.vocab_size,
            c.hidden_size,
            c.rms_norm_eps,
            c.tie_word_embeddings,
            layers,
            c.max_position_embeddings,
        );
        if c.use_logit_softcap && c.logit_softcap > 0.0 {
            plan.logit_softcap = Some(c.logit_softcap);
        }
        Ok(plan)
    }
    fn sanitize(&self, config: &ModelConfig, weights: &mut WeightMap) -> Result<()> {
        // PyTorch Conv1d weights [C, 1, K] → MLX [C, K, 1].
        conv_to_mlx(weights, ".conv.weight")?;
        drop_tied_head(config, weights, true)?;
        Ok(())
    }
}

mlex_core::register_architecture!("dhara_ar", DharaAr);
