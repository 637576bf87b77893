//! `nemotron_h`: NVIDIA Nemotron-H — a hybrid stack described by a pattern
//! string: `M` Mamba2 mixers, `*` attention (no RoPE), `-` ReLU² MLPs and
//! `E` mixture-of-experts layers, each pre-norm with a residual. Reference:
//! mlx-lm `models/nemotron_h.py`.

use super::{conv_to_mlx, drop_where, stack_experts};
use mlex_core::arch::{Architecture, HeadPlan, LayerPlan, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlex_core::weights::WeightMap;
use serde::Deserialize;
use serde_json::{json, Value};

/// `config.json` of a nemotron_h model (mixer sizes are read by the kinds).
#[derive(Debug, Deserialize)]
pub struct NemotronHConfig {
    /// Residual width.
    pub hidden_size: i32,
    /// Vocabulary.
    pub vocab_size: i32,
    /// Norm epsilon.
    pub layer_norm_epsilon: f32,
    /// Attention biases.
    #[serde(default)]
    pub attention_bias: bool,
    /// Layer pattern (string or list of one-character strings).
    pub hybrid_override_pattern: Option<Value>,
    /// Block types by name (alternative to the pattern).
    pub layers_block_type: Option<Vec<String>>,
    /// Same, newer name.
    pub layer_types: Option<Vec<String>>,
    /// Context limit.
    pub max_position_embeddings: Option<usize>,
    /// Experts (for `E` layers).
    pub n_routed_experts: Option<usize>,
}

/// The layer pattern as characters.
fn pattern(config: &ModelConfig, c: &NemotronHConfig) -> Result<Vec<char>> {
    if let Some(p) = &c.hybrid_override_pattern {
        return match p {
            Value::String(s) => Ok(s.chars().collect()),
            Value::Array(a) => Ok(a
                .iter()
                .filter_map(Value::as_str)
                .flat_map(str::chars)
                .collect()),
            _ => Err(config.error("hybrid_override_pattern", "expected a string or a list")),
        };
    }
    let Some(types) = c.layers_block_type.as_ref().or(c.layer_types.as_ref()) else {
        return Err(config.error(
            "hybrid_override_pattern",
            "the config must have layers_block_type or hybrid_override_pattern to describe the layer stack",
        ));
    };
    types
        .iter()
        .map(|t| match t.as_str() {
            "full_attention" | "attention" => Ok('*'),
            "linear_attention" | "mamba" | "conv" => Ok('M'),
            "moe" => Ok('E'),
            "mlp" => Ok('-'),
            other => Err(config.error(
                "layers_block_type",
                format!("unsupported block type `{other}`"),
            )),
        })
        .collect()
}

/// The `nemotron_h` architecture.
pub struct NemotronH;

impl Architecture for NemotronH {
    fn name(&self) -> &str {
        "nemotron_h"
    }
    fn summary(&self) -> &str {
        "Nemotron-H hybrid: pattern of Mamba2 (M), attention (*), ReLU² MLP (-) and MoE (E) layers"
    }
    fn config_keys(&self) -> Vec<String> {
        super::config_keys::<NemotronHConfig>()
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let c: NemotronHConfig = config.parse()?;
        let layers = pattern(config, &c)?
            .into_iter()
            .enumerate()
            .map(|(i, ch)| {
                let (kind, options) = match ch {
                    'M' => ("mamba2", json!({})),
                    '*' => (
                        "attention",
                        json!({
                            "input_norm": "norm",
                            "attn": "mixer",
                            "post_norm": null,
                            "mlp": "none",
                            "rope": false,
                            "qkv_bias": c.attention_bias,
                            "o_bias": c.attention_bias,
                            "eps_key": "layer_norm_epsilon",
                        }),
                    ),
                    '-' => ("mlp", json!({"ffn": "relu2"})),
                    'E' => ("moe", json!({"ffn": "nemotron_moe"})),
                    other => {
                        return Err(config.error(
                            "hybrid_override_pattern",
                            format!("unknown layer `{other}` at position {i} (M, *, -, E)"),
                        ))
                    }
                };
                Ok(LayerPlan {
                    kind: kind.to_owned(),
                    prefix: format!("backbone.layers.{i}"),
                    options,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ModelPlan {
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            embed: "backbone.embeddings".into(),
            layers,
            final_norm: "backbone.norm_f".into(),
            norm_eps: c.layer_norm_epsilon,
            head: HeadPlan::Linear("lm_head".into()),
            logit_softcap: None,
            max_context: c.max_position_embeddings,
        })
    }
    fn sanitize(&self, config: &ModelConfig, weights: &mut WeightMap) -> Result<()> {
        drop_where(weights, |n| n.starts_with("mtp."))?;
        conv_to_mlx(weights, "conv1d.weight")?;
        let c: NemotronHConfig = config.parse()?;
        let n = pattern(config, &c)?.len();
        let experts = c.n_routed_experts.unwrap_or(0);
        for l in 0..n {
            stack_experts(
                weights,
                &format!("backbone.layers.{l}.mixer"),
                experts,
                &[("down_proj", "fc2"), ("up_proj", "fc1")],
            )?;
        }
        Ok(())
    }
}

mlex_core::register_architecture!("nemotron_h", NemotronH);
