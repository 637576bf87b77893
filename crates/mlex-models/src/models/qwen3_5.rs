//! `qwen3_5` (and `qwen3_5_text`, `qwen3_5_moe`): Qwen3.5 — the Qwen3-Next
//! hybrid with separate Gated DeltaNet projections, RoPE settings under
//! `rope_parameters`, text settings nested under `text_config` (the
//! multimodal wrapper's vision weights are dropped), and optional MoE on
//! every layer. Reference: mlx-lm `models/qwen3_5.py`, `qwen3_5_moe.py`.

use super::{conv_to_mlx, decoder_plan, drop_prefix, drop_where, has_torch_conv, norm_plus_one};
use mlex_core::arch::{Architecture, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::{Error, Result};
use mlex_core::weights::WeightMap;
use mlx_rs::ops::indexing::TryIndexOp;
use serde::Deserialize;
use serde_json::{json, Value};

/// The text config after defaults (what the layers read).
#[derive(Debug, Deserialize)]
pub struct Qwen35TextConfig {
    /// Residual width.
    pub hidden_size: i32,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Norm epsilon.
    pub rms_norm_eps: f32,
    /// Vocabulary.
    pub vocab_size: i32,
    /// Context limit.
    pub max_position_embeddings: Option<usize>,
    /// Tied head.
    pub tie_word_embeddings: bool,
    /// Attention biases.
    pub attention_bias: bool,
    /// Every n-th layer is full attention.
    pub full_attention_interval: usize,
    /// Experts (0: dense MLPs).
    pub num_experts: i32,
    /// RoPE settings.
    pub rope_parameters: Value,
}

/// One of the Qwen3.5 `model_type`s.
pub struct Qwen35 {
    name: &'static str,
}

/// mlx-lm `TextModelArgs` defaults, filled in where the config is silent.
fn with_defaults(mut text: Value) -> Value {
    let defaults = [
        ("hidden_size", json!(4096)),
        ("intermediate_size", json!(14336)),
        ("num_hidden_layers", json!(32)),
        ("num_attention_heads", json!(32)),
        ("rms_norm_eps", json!(1e-6)),
        ("vocab_size", json!(151936)),
        ("num_key_value_heads", json!(8)),
        ("max_position_embeddings", json!(131072)),
        ("linear_num_value_heads", json!(64)),
        ("linear_num_key_heads", json!(16)),
        ("linear_key_head_dim", json!(192)),
        ("linear_value_head_dim", json!(128)),
        ("linear_conv_kernel_dim", json!(4)),
        ("tie_word_embeddings", json!(false)),
        ("attention_bias", json!(false)),
        ("full_attention_interval", json!(4)),
        ("num_experts", json!(0)),
        ("num_experts_per_tok", json!(0)),
        ("decoder_sparse_step", json!(1)),
        ("shared_expert_intermediate_size", json!(0)),
        ("moe_intermediate_size", json!(0)),
        ("norm_topk_prob", json!(true)),
        (
            "rope_parameters",
            json!({"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 100000, "partial_rotary_factor": 0.25}),
        ),
    ];
    if let Some(obj) = text.as_object_mut() {
        for (k, v) in defaults {
            if obj.get(k).is_none_or(Value::is_null) {
                obj.insert(k.to_owned(), v);
            }
        }
        if obj.get("head_dim").is_none_or(Value::is_null) {
            let h = obj["hidden_size"].as_i64().unwrap_or(0);
            let n = obj["num_attention_heads"].as_i64().unwrap_or(1).max(1);
            obj.insert("head_dim".into(), json!(h / n));
        }
    }
    text
}

impl Architecture for Qwen35 {
    fn name(&self) -> &str {
        self.name
    }
    fn summary(&self) -> &str {
        match self.name {
            "qwen3_5_moe" => "Qwen3.5 MoE hybrid: Gated DeltaNet + gated attention, MoE with shared expert",
            "qwen3_5_text" => "Qwen3.5 text-only hybrid (flat config)",
            _ => "Qwen3.5 hybrid: Gated DeltaNet + gated attention (every 4th), text from the multimodal wrapper",
        }
    }
    fn text_config(&self, config: &ModelConfig) -> Result<ModelConfig> {
        let text = config
            .value()
            .get("text_config")
            .cloned()
            .unwrap_or_else(|| config.value().clone());
        if !text.is_object() {
            return Err(config.error("text_config", "expected an object"));
        }
        Ok(ModelConfig::new(with_defaults(text), config.file()))
    }
    fn config_keys(&self) -> Vec<String> {
        // Read from `text_config` when the config has one.
        let mut keys = super::config_keys::<Qwen35TextConfig>();
        keys.push("text_config".to_owned());
        keys
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let c: Qwen35TextConfig = config.parse()?;
        let rp = &c.rope_parameters;
        let partial = rp
            .get("partial_rotary_factor")
            .and_then(Value::as_f64)
            .unwrap_or(0.25);
        let theta = rp
            .get("rope_theta")
            .and_then(Value::as_f64)
            .unwrap_or(100000.0);
        let mut scaling = rp.clone();
        if let Some(o) = scaling.as_object_mut() {
            if !o.contains_key("type") {
                if let Some(t) = o.remove("rope_type") {
                    o.insert("type".into(), t);
                }
            }
        }
        let mlp = if c.num_experts > 0 {
            "qwen_moe"
        } else {
            "swiglu"
        };
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                if (i + 1) % c.full_attention_interval.max(1) != 0 {
                    (
                        "gated_delta".to_owned(),
                        json!({"layout": "qwen3_5", "mlp": mlp}),
                    )
                } else {
                    (
                        "attention".to_owned(),
                        json!({
                            "gated": true,
                            "qk_norm": "pre_rope",
                            "qkv_bias": c.attention_bias,
                            "o_bias": c.attention_bias,
                            "partial_rotary_factor": partial,
                            "rope_theta": theta,
                            "rope_scaling": scaling,
                            "mlp": mlp,
                        }),
                    )
                }
            })
            .collect();
        Ok(decoder_plan(
            "language_model.model",
            "language_model.lm_head",
            c.vocab_size,
            c.hidden_size,
            c.rms_norm_eps,
            c.tie_word_embeddings,
            layers,
            c.max_position_embeddings,
        ))
    }
    fn sanitize(&self, config: &ModelConfig, weights: &mut WeightMap) -> Result<()> {
        weights.rename_all(|k| {
            if k.starts_with("vision_tower") || k.starts_with("model.visual") {
                None
            } else if let Some(rest) = k.strip_prefix("model.language_model") {
                Some(format!("language_model.model{rest}"))
            } else if k.starts_with("language_model.") {
                Some(k.to_owned())
            } else {
                Some(format!("language_model.{k}"))
            }
        })?;
        let text = self.text_config(config)?;
        let layers = text.value()["num_hidden_layers"].as_u64().unwrap_or(0);
        for l in 0..layers {
            split_gate_up(weights, &format!("language_model.model.layers.{l}.mlp"))?;
        }
        let unsanitized = has_torch_conv(weights, "conv1d.weight");
        drop_where(weights, |n| n.contains("mtp."))?;
        if text.value()["tie_word_embeddings"]
            .as_bool()
            .unwrap_or(false)
        {
            drop_prefix(weights, "language_model.lm_head")?;
        }
        conv_to_mlx(weights, "conv1d.weight")?;
        if unsanitized {
            norm_plus_one(
                weights,
                &[
                    ".input_layernorm.weight",
                    ".post_attention_layernorm.weight",
                    "model.norm.weight",
                    ".q_norm.weight",
                    ".k_norm.weight",
                ],
            )?;
        }
        Ok(())
    }
}

/// HF Qwen3.5-MoE stores experts fused: `experts.gate_up_proj` `[E, 2I, H]`
/// and `experts.down_proj`; split into `switch_mlp.{gate,up,down}_proj`.
fn split_gate_up(weights: &mut WeightMap, prefix: &str) -> Result<()> {
    let key = format!("{prefix}.experts.gate_up_proj");
    let Some((gate_up, file)) = weights.remove(&key) else {
        return Ok(());
    };
    let mid = gate_up.shape()[gate_up.ndim() - 2] / 2;
    weights.insert(
        format!("{prefix}.switch_mlp.gate_proj.weight"),
        gate_up.try_index((.., ..mid, ..))?,
        file,
    );
    weights.insert(
        format!("{prefix}.switch_mlp.up_proj.weight"),
        gate_up.try_index((.., mid.., ..))?,
        file,
    );
    let down = format!("{prefix}.experts.down_proj");
    let (d, f) = weights.remove(&down).ok_or_else(|| Error::MissingTensor {
        name: down.clone(),
        files: weights.files().to_vec(),
    })?;
    weights.insert(format!("{prefix}.switch_mlp.down_proj.weight"), d, f);
    Ok(())
}

mlex_core::register_architecture!("qwen3_5", Qwen35 { name: "qwen3_5" });
mlex_core::register_architecture!(
    "qwen3_5_text",
    Qwen35 {
        name: "qwen3_5_text"
    }
);
mlex_core::register_architecture!(
    "qwen3_5_moe",
    Qwen35 {
        name: "qwen3_5_moe"
    }
);
