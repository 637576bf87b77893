//! An example of extending mlex from another crate, without changing mlex:
//!
//! - a new layer kind, `gated_mlp`: `x + sigmoid(gate) * up(norm(x))`, a
//!   stateless pre-norm block with its own weights;
//! - a new architecture, `toy_ext`, whose layers alternate the new kind
//!   with mlex's own `attention` kind.
//!
//! Both register with one macro each; linking this crate is enough for
//! `mlex_models::registry()` to show them. The crate's binary,
//! `mlex-example` (`src/main.rs`), is the whole `mlex` CLI in three lines
//! (`mlex_cli::main()`), so `mlex-example list` and `mlex-example generate`
//! see them too; the shipped `mlex` binary does not link this crate.

use mlex_core::arch::{Architecture, HeadPlan, LayerPlan, ModelPlan};
use mlex_core::cache::Cache;
use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlex_core::layer::{BuildCtx, Carry, Layer, LayerKind, StateKind};
use mlex_core::nn::{Linear, RmsNorm};
use mlex_core::params::{ParamId, Params};
use mlx_rs::{ops, Array, Dtype};
use serde_json::{json, Value};

/// The `gated_mlp` layer.
pub struct GatedMlp {
    norm: RmsNorm,
    up: Linear,
    gate: ParamId,
}

/// The `gated_mlp` kind.
pub struct GatedMlpKind;

impl LayerKind for GatedMlpKind {
    fn name(&self) -> &'static str {
        "gated_mlp"
    }
    fn state(&self) -> StateKind {
        StateKind::None
    }
    fn summary(&self) -> &'static str {
        "example: x + sigmoid(gate) * up(norm(x)) (registered from mlex-example-ext)"
    }
    fn build(&self, ctx: &mut BuildCtx<'_>) -> Result<Box<dyn Layer>> {
        let hidden = ctx.cfg_i32("hidden_size")?;
        Ok(Box::new(GatedMlp {
            norm: RmsNorm::load(ctx.weights, &ctx.path("norm"), hidden, 1e-6)?,
            up: Linear::load(ctx.weights, &ctx.path("up"), hidden, hidden, false)?,
            gate: ctx.weights.take(&ctx.path("gate"), &[hidden])?,
        }))
    }
}

impl Layer for GatedMlp {
    fn kind(&self) -> &str {
        "gated_mlp"
    }
    fn params(&self) -> Vec<ParamId> {
        let mut v = vec![self.norm.weight, self.gate];
        v.extend(self.up.params());
        v
    }
    fn grows(&self) -> bool {
        false
    }
    fn make_caches(&self, _batch: usize, _dtype: Dtype) -> Result<Vec<Box<dyn Cache>>> {
        Ok(Vec::new())
    }
    fn head(&self, p: &Params, x: &Array, _state: &mut [Array]) -> Result<Carry> {
        let y = self.up.forward(p, &self.norm.forward(p, x)?)?;
        let g = ops::sigmoid(p.get(self.gate)?)?;
        Ok(vec![ops::add(x, ops::multiply(&g, &y)?)?])
    }
}

/// The `toy_ext` architecture: `gated_mlp` and `attention` layers in turn.
pub struct ToyExt;

impl Architecture for ToyExt {
    fn name(&self) -> &str {
        "toy_ext"
    }
    fn summary(&self) -> &str {
        "example: gated_mlp and attention layers in turn (registered from mlex-example-ext)"
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let v = config.value();
        let int = |k: &str| v.get(k).and_then(Value::as_i64).unwrap_or(0) as i32;
        let layers = (0..int("num_hidden_layers"))
            .map(|i| LayerPlan {
                kind: if i % 2 == 0 { "gated_mlp" } else { "attention" }.to_owned(),
                prefix: format!("layers.{i}"),
                options: if i % 2 == 0 {
                    json!({})
                } else {
                    json!({"mlp": "none", "post_norm": null})
                },
            })
            .collect();
        Ok(ModelPlan {
            vocab_size: int("vocab_size"),
            hidden_size: int("hidden_size"),
            embed: "embed".into(),
            layers,
            final_norm: "norm".into(),
            norm_eps: 1e-6,
            head: HeadPlan::Tied,
            logit_softcap: None,
            max_context: None,
        })
    }
}

mlex_core::register_layer_kind!("gated_mlp", GatedMlpKind);
mlex_core::register_architecture!("toy_ext", ToyExt);
