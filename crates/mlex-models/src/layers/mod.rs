//! The registered layer kinds: every decoder layer of every architecture is
//! one of these, configured by one typed options struct per kind (sizes,
//! weight-name templates, switches) that an architecture spec fills from
//! its typed parameters. The kinds read no config keys themselves.
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
use mlex_core::nn::Norm;
use mlex_core::params::Params;
use mlx_rs::{ops, Array};
use serde::Deserialize;

fn d_one() -> i32 {
    1
}
fn d_one_f() -> f64 {
    1.0
}
fn d_eps() -> f64 {
    1e-6
}

/// The feed-forward sizes of a layer (option `ffn_sizes` of the kinds with a
/// feed-forward part), named after the `config.json` keys they usually come
/// from. Which fields a kind of feed-forward needs: `swiglu`/`relu2`
/// `intermediate_size`; `qwen_moe` `num_experts`, `num_experts_per_tok`,
/// `moe_intermediate_size`, `shared_expert_intermediate_size` (0: none),
/// `norm_topk_prob`; `nemotron_moe` `n_routed_experts`,
/// `num_experts_per_tok`, `moe_intermediate_size`,
/// `moe_shared_expert_intermediate_size` (0: none), `n_group`,
/// `topk_group`, `norm_topk_prob`, `routed_scaling_factor`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FfnSizes {
    /// Dense MLP inner width.
    #[serde(default)]
    pub intermediate_size: i32,
    /// Qwen MoE experts.
    #[serde(default)]
    pub num_experts: i32,
    /// Experts per token.
    #[serde(default)]
    pub num_experts_per_tok: i32,
    /// Per-expert inner width.
    #[serde(default)]
    pub moe_intermediate_size: i32,
    /// Qwen shared expert inner width (0: none).
    #[serde(default)]
    pub shared_expert_intermediate_size: i32,
    /// Renormalise the top-k scores.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// NemotronH experts.
    #[serde(default)]
    pub n_routed_experts: i32,
    /// NemotronH shared experts' inner width (0: none).
    #[serde(default)]
    pub moe_shared_expert_intermediate_size: i32,
    /// NemotronH routing groups.
    #[serde(default = "d_one")]
    pub n_group: i32,
    /// NemotronH groups kept.
    #[serde(default = "d_one")]
    pub topk_group: i32,
    /// NemotronH routed scaling factor.
    #[serde(default = "d_one_f")]
    pub routed_scaling_factor: f64,
}

/// A size option: an integer from 1, else an error naming the option.
pub fn size(ctx: &BuildCtx<'_>, kind: &str, name: &str, v: i32) -> Result<i32> {
    mlex_core::config::count(i64::from(v)).map_err(|m| {
        ctx.config.error(
            &format!("options of layer {} ({kind}): {name}", ctx.index),
            m,
        )
    })
}

/// The feed-forward spec of a layer: `kind` from options, sizes from the
/// layer's [`FfnSizes`].
pub fn ffn_spec(
    ctx: &BuildCtx<'_>,
    layer_kind: &str,
    hidden: i32,
    kind: &str,
    bias: bool,
    s: &FfnSizes,
) -> Result<FfnSpec> {
    let need = |name: &str, v: i32| size(ctx, layer_kind, &format!("ffn.{name}"), v);
    let intermediate = match kind {
        "swiglu" | "relu2" => need("intermediate_size", s.intermediate_size)?,
        _ => s.intermediate_size,
    };
    let (experts, moe_intermediate, shared) = match kind {
        "qwen_moe" => (
            need("num_experts", s.num_experts)?,
            need("moe_intermediate_size", s.moe_intermediate_size)?,
            s.shared_expert_intermediate_size,
        ),
        "nemotron_moe" => (
            need("n_routed_experts", s.n_routed_experts)?,
            need("moe_intermediate_size", s.moe_intermediate_size)?,
            s.moe_shared_expert_intermediate_size,
        ),
        _ => (0, 0, 0),
    };
    Ok(FfnSpec {
        kind: kind.to_owned(),
        hidden,
        intermediate,
        bias,
        experts,
        top_k: s.num_experts_per_tok,
        moe_intermediate,
        norm_topk_prob: s.norm_topk_prob,
        shared_intermediate: shared,
        n_group: s.n_group,
        topk_group: s.topk_group,
        routed_scaling: s.routed_scaling_factor as f32,
    })
}

/// The layer's norm called `name` (under the layer prefix) of `[dim]`, as
/// the kind's `norm_type` option says.
pub fn layer_norm(
    ctx: &mut BuildCtx<'_>,
    kind: mlex_core::nn::NormKind,
    name: &str,
    dim: i32,
    eps: f32,
) -> Result<mlex_core::nn::Norm> {
    let prefix = ctx.path(name);
    mlex_core::nn::Norm::load(kind, ctx.weights, &prefix, dim, eps)
}

/// The default norm epsilon of the kinds' `norm_eps` option.
pub fn default_eps() -> f64 {
    d_eps()
}

/// `(x + y, norm(x + y))`: the residual add in the middle of a pre-norm
/// block and the norm that reads it.
pub fn add_then_norm(p: &Params, norm: &Norm, x: &Array, y: &Array) -> Result<(Array, Array)> {
    let h = ops::add(x, y)?;
    let m = norm.forward(p, &h)?;
    Ok((h, m))
}
