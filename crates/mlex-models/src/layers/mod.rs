//! The registered layer kinds: every decoder layer of every architecture is
//! one of these, configured by options (weight-name templates, switches)
//! and config keys. This is what lets a TOML file compose a new hybrid.
//!
//! | kind          | layer                                                        |
//! |---------------|--------------------------------------------------------------|
//! | `attention`   | pre-norm GQA attention (+ MLP/MoE), RoPE variants, q/k norms, output gate, sliding window, canon convs |
//! | `gated_delta` | pre-norm Gated DeltaNet (Qwen3-Next/Qwen3.5 layouts) + MLP/MoE |
//! | `mamba2`      | pre-norm Mamba2 mixer (NemotronH `M`)                         |
//! | `mlp`         | pre-norm MLP only (NemotronH `-`)                             |
//! | `moe`         | pre-norm MoE only (NemotronH `E`)                             |

pub mod attention;
pub mod canon;
pub mod ffn;
pub mod gated_delta;
pub mod mamba2;
pub mod mlp;
pub mod rope;

use ffn::FfnSpec;
use mlex_core::error::Result;
use mlex_core::layer::BuildCtx;
use serde_json::Value;

/// The feed-forward spec of a layer: `kind` from options, sizes from config
/// keys (`intermediate_size`, `num_experts`, `num_experts_per_tok`,
/// `moe_intermediate_size`, `norm_topk_prob`, `shared_expert_intermediate_size`,
/// NemotronH's `n_routed_experts`, `n_group`, `topk_group`,
/// `routed_scaling_factor`, `moe_shared_expert_intermediate_size`).
pub fn ffn_spec(ctx: &BuildCtx<'_>, kind: &str, bias: bool) -> Result<FfnSpec> {
    let cfg = ctx.config.value();
    let int = |k: &str| cfg.get(k).and_then(Value::as_i64).map(|v| v as i32);
    let hidden = ctx.cfg_count("hidden_size")?;
    let intermediate = match kind {
        "swiglu" | "relu2" => ctx.cfg_count("intermediate_size")?,
        _ => int("intermediate_size").unwrap_or(0),
    };
    let (experts, moe_intermediate, shared) = match kind {
        "qwen_moe" => (
            ctx.cfg_count("num_experts")?,
            ctx.cfg_count("moe_intermediate_size")?,
            int("shared_expert_intermediate_size").unwrap_or(0),
        ),
        "nemotron_moe" => (
            ctx.cfg_count("n_routed_experts")?,
            ctx.cfg_count("moe_intermediate_size")?,
            if cfg.get("n_shared_experts").is_some_and(|v| !v.is_null()) {
                ctx.cfg_i32("moe_shared_expert_intermediate_size")?
            } else {
                0
            },
        ),
        _ => (0, 0, 0),
    };
    Ok(FfnSpec {
        kind: kind.to_owned(),
        hidden,
        intermediate,
        bias,
        experts,
        top_k: int("num_experts_per_tok").unwrap_or(0),
        moe_intermediate,
        norm_topk_prob: ctx.cfg_bool_or("norm_topk_prob", false),
        shared_intermediate: shared,
        n_group: int("n_group").unwrap_or(1),
        topk_group: int("topk_group").unwrap_or(1),
        routed_scaling: ctx.cfg_f64_or("routed_scaling_factor", 1.0) as f32,
    })
}

/// The norm epsilon under config key `key` (default 1e-6).
pub fn norm_eps(ctx: &BuildCtx<'_>, key: &str) -> f32 {
    ctx.cfg_f64_or(key, 1e-6) as f32
}
