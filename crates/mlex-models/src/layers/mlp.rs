//! The `mlp` and `moe` layer kinds: a pre-norm feed-forward block with a
//! residual and no mixer (NemotronH `-` and `E` layers). Stateless.

use super::ffn::Ffn;
use super::{ffn_spec, size, FfnSizes};
use mlex_core::cache::Cache;
use mlex_core::config::parse_value;
use mlex_core::error::Result;
use mlex_core::layer::{BuildCtx, Carry, Layer, LayerKind, StateKind};
use mlex_core::nn::{Norm, NormKind};
use mlex_core::params::{ParamId, Params};
use mlx_rs::{ops, Array, Dtype};
use serde::Deserialize;

fn d_norm() -> String {
    "norm".into()
}
fn d_prefix() -> String {
    "mixer".into()
}
/// Options of the `mlp`/`moe` kinds.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FfnLayerOptions {
    /// Residual width.
    pub hidden_size: i32,
    /// Epsilon of the norm.
    #[serde(default = "super::default_eps")]
    pub norm_eps: f64,
    /// The norm: `rms` (default) or `layer_norm`.
    #[serde(default)]
    pub norm_type: NormKind,
    /// Feed-forward sizes.
    #[serde(default)]
    pub ffn_sizes: FfnSizes,
    /// Norm name.
    #[serde(default = "d_norm")]
    pub norm: String,
    /// Feed-forward module name.
    #[serde(default = "d_prefix")]
    pub prefix: String,
    /// Feed-forward kind (`relu2`/`swiglu` for `mlp`, `nemotron_moe`/`qwen_moe` for `moe`).
    #[serde(default)]
    pub ffn: Option<String>,
    /// Biases in the projections.
    #[serde(default)]
    pub bias: bool,
}

/// A pre-norm feed-forward layer.
pub struct FfnLayer {
    kind: &'static str,
    norm: Norm,
    ffn: Ffn,
}

fn build(ctx: &mut BuildCtx<'_>, kind: &'static str, default_ffn: &str) -> Result<Box<dyn Layer>> {
    let o: FfnLayerOptions = parse_value(
        ctx.options,
        ctx.config.file(),
        &format!("options of layer {} ({kind})", ctx.index),
    )?;
    let hidden = size(ctx, kind, "hidden_size", o.hidden_size)?;
    let eps = o.norm_eps as f32;
    let ffn_kind = o.ffn.clone().unwrap_or_else(|| default_ffn.to_owned());
    let spec = ffn_spec(ctx, kind, hidden, &ffn_kind, o.bias, &o.ffn_sizes)?;
    Ok(Box::new(FfnLayer {
        kind,
        norm: super::layer_norm(ctx, o.norm_type, &o.norm, hidden, eps)?,
        ffn: Ffn::load(ctx.weights, &ctx.path(&o.prefix), &spec)?,
    }))
}

/// The registered `mlp` kind.
pub struct MlpKind;

impl LayerKind for MlpKind {
    fn name(&self) -> &'static str {
        "mlp"
    }
    fn option_keys(&self) -> &'static [&'static str] {
        mlex_core::config::struct_fields::<FfnLayerOptions>()
    }
    fn state(&self) -> StateKind {
        StateKind::None
    }
    fn summary(&self) -> &'static str {
        "pre-norm MLP only (NemotronH -), stateless"
    }
    fn build(&self, ctx: &mut BuildCtx<'_>) -> Result<Box<dyn Layer>> {
        build(ctx, "mlp", "relu2")
    }
}

/// The registered `moe` kind.
pub struct MoeKind;

impl LayerKind for MoeKind {
    fn name(&self) -> &'static str {
        "moe"
    }
    fn option_keys(&self) -> &'static [&'static str] {
        mlex_core::config::struct_fields::<FfnLayerOptions>()
    }
    fn state(&self) -> StateKind {
        StateKind::None
    }
    fn summary(&self) -> &'static str {
        "pre-norm mixture of experts only (NemotronH E), stateless"
    }
    fn build(&self, ctx: &mut BuildCtx<'_>) -> Result<Box<dyn Layer>> {
        build(ctx, "moe", "nemotron_moe")
    }
}

impl Layer for FfnLayer {
    fn kind(&self) -> &str {
        self.kind
    }
    fn params(&self) -> Vec<ParamId> {
        let mut v = self.norm.params();
        v.extend(self.ffn.params());
        v
    }
    fn grows(&self) -> bool {
        false
    }
    fn quantizable(&self) -> Vec<ParamId> {
        self.ffn.quantizable()
    }
    fn make_caches(&self, _batch: usize, _dtype: Dtype) -> Result<Vec<Box<dyn Cache>>> {
        Ok(Vec::new())
    }
    fn head(&self, p: &Params, x: &Array, _state: &mut [Array]) -> Result<Carry> {
        let y = self.ffn.forward(p, &self.norm.forward(p, x)?, None)?;
        Ok(vec![ops::add(x, &y)?])
    }
    fn describe(&self) -> String {
        match &self.ffn {
            Ffn::SwiGlu { .. } => "mlp swiglu".into(),
            Ffn::Relu2 { .. } => "mlp relu2".into(),
            Ffn::QwenMoe(_) => "moe (qwen routing)".into(),
            Ffn::NemotronMoe(_) => "moe (nemotron routing)".into(),
        }
    }
}

mlex_core::register_layer_kind!("mlp", MlpKind);
mlex_core::register_layer_kind!("moe", MoeKind);
