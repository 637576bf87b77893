//! An example of extending mlex from another crate, without changing mlex:
//!
//! - a new layer kind, `gated_mlp`: `x + sigmoid(gate) * up(norm(x))`, a
//!   stateless pre-norm block with its own weights;
//! - a new architecture, `toy_ext`, whose layers alternate the new kind
//!   with mlex's own `attention` kind.
//!
//! - a stateful layer kind, `ema`: `x + out(h_t)` with the per-channel
//!   moving average `h_t = a * h_{t-1} + (1 - a) * x_t`, `a = sigmoid(decay)`,
//!   whose state lives in a cache kind of its own, `ema`, registered with
//!   [`mlex_core::register_cache_kind!`] so that a saved prompt cache
//!   restores it;
//! - `toy_ema`, whose layers alternate `ema` and `attention`.
//!
//! Each registers with one macro (a layer kind's defines its kind from
//! its typed options and build function); linking this crate is enough for
//! `mlex_models::registry()` to show them. The crate's binary,
//! `mlex-example` (`src/main.rs`), is the whole `mlex` CLI in three lines
//! (`mlex_cli::main()`), so `mlex-example list` and `mlex-example generate`
//! see them too; the shipped `mlex` binary does not link this crate.

#![deny(missing_docs)]

use mlex_cache::StateCache;
use mlex_cache::StateSpec;
use mlex_core::arch::{Architecture, HeadPlan, LayerPlan, ModelPlan};
use mlex_core::cache::Cache;
use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlex_core::layer::{BuildCtx, Carry, Layer, State, StateKind};
use mlex_core::nn::{Linear, RmsNorm};
use mlex_core::params::{ParamId, Params};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array, Dtype};
use serde_json::{json, Value};

/// The `gated_mlp` layer.
pub struct GatedMlp {
    norm: RmsNorm,
    up: Linear,
    gate: ParamId,
}

/// The options of this crate's kinds: none (they read their sizes from
/// the config), and a spec that gives one is refused naming it.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoOptions {}

mlex_core::register_layer_kind! {
    /// The `gated_mlp` kind.
    kind GatedMlpKind = "gated_mlp" {
        options: NoOptions,
        state: StateKind::None,
        summary: "example: x + sigmoid(gate) * up(norm(x)) (registered from mlex-example-ext)",
        build: GatedMlp::build,
    }
}

impl GatedMlp {
    fn build(ctx: &mut BuildCtx<'_>, _: &NoOptions) -> Result<Self> {
        let hidden = ctx.cfg_i32("hidden_size")?;
        Ok(GatedMlp {
            norm: RmsNorm::load(ctx.weights, &ctx.path("norm"), hidden, 1e-6)?,
            up: Linear::load(ctx.weights, &ctx.path("up"), hidden, hidden, false)?,
            gate: ctx.weights.take(&ctx.path("gate"), &[hidden])?,
        })
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
    /// Under `--tp` this layer runs whole on every rank: its weights are
    /// loaded outside the loader's split scopes (so every rank holds all of
    /// them) and its input is the same on every rank, so its output is too.
    /// A kind that splits its weights takes them in a split scope instead
    /// and sums its row-split product over the ranks (mlex's `attention`).
    fn unsharded(&self) -> Option<String> {
        None
    }
    fn before_cache(&self, p: &Params, x: &Array, _state: &mut State<'_>) -> Result<Carry> {
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
            .map(|i| {
                if i % 2 == 0 {
                    LayerPlan {
                        name: "gated_mlp".into(),
                        kind: "gated_mlp".into(),
                        prefix: format!("layers.{i}"),
                        options: json!({}),
                    }
                } else {
                    // A block around mlex's attention mixer, with no
                    // feed-forward; the mixer takes its sizes as options.
                    let eps = v
                        .get("rms_norm_eps")
                        .and_then(Value::as_f64)
                        .unwrap_or(1e-6);
                    LayerPlan {
                        name: "attention".into(),
                        kind: "block".into(),
                        prefix: format!("layers.{i}"),
                        options: json!({
                            "mixer": "attention",
                            "mixer_options": {
                                "hidden_size": int("hidden_size"),
                                "num_attention_heads": int("num_attention_heads"),
                            },
                            "hidden_size": int("hidden_size"),
                            "norm_eps": eps,
                            "ffn": "none",
                        }),
                    }
                }
            })
            .collect();
        Ok(ModelPlan {
            vocab_size: int("vocab_size"),
            hidden_size: int("hidden_size"),
            embed: "embed".into(),
            layers,
            final_norm: "norm".into(),
            norm_eps: 1e-6,
            norm_type: mlex_core::nn::NormKind::Rms,
            head: HeadPlan::Tied,
            logit_softcap: None,
            embedding_multiplier: None,
            logits_scaling: None,
            max_context: None,
            mtp: None,
        })
    }
}

/// The `ema` layer: a per-channel exponential moving average, mixed back
/// through a linear map.
pub struct Ema {
    hidden: i32,
    decay: ParamId,
    out: Linear,
}

mlex_core::register_layer_kind! {
    /// The `ema` kind.
    kind EmaKind = "ema" {
        options: NoOptions,
        state: StateKind::Fixed,
        summary: "example: x + out(h), h a per-channel moving average of x kept in an `ema` cache (registered from mlex-example-ext)",
        build: Ema::build,
    }
}

impl Ema {
    fn build(ctx: &mut BuildCtx<'_>, _: &NoOptions) -> Result<Self> {
        let hidden = ctx.cfg_i32("hidden_size")?;
        Ok(Ema {
            hidden,
            decay: ctx.weights.take(&ctx.path("decay"), &[hidden])?,
            out: Linear::load(ctx.weights, &ctx.path("out"), hidden, hidden, false)?,
        })
    }
}

impl Layer for Ema {
    fn kind(&self) -> &str {
        "ema"
    }
    fn params(&self) -> Vec<ParamId> {
        let mut v = vec![self.decay];
        v.extend(self.out.params());
        v
    }
    fn grows(&self) -> bool {
        false
    }
    /// Whole on every rank, its state too (see `GatedMlp`'s).
    fn unsharded(&self) -> Option<String> {
        None
    }
    fn make_caches(&self, batch: usize, _dtype: Dtype) -> Result<Vec<Box<dyn Cache>>> {
        let spec = StateSpec::new("h", &[batch as i32, self.hidden], Dtype::Float32);
        Ok(vec![Box::new(StateCache::zeros("ema", &[spec])?)])
    }
    fn before_cache(&self, p: &Params, x: &Array, state: &mut State<'_>) -> Result<Carry> {
        let a = ops::sigmoid(p.get(self.decay)?)?;
        let one_minus = ops::subtract(Array::from_f32(1.0), &a)?;
        let mut h = state[0].clone();
        let mut ys = Vec::new();
        for t in 0..x.shape()[1] {
            let xt = x.index((.., t, ..)).as_dtype(Dtype::Float32)?;
            h = ops::add(ops::multiply(&a, &h)?, ops::multiply(&one_minus, &xt)?)?;
            ys.push(h.clone());
        }
        let hs = ops::stack(&ys, 1)?.as_dtype(x.dtype())?;
        // The state after each position is each output (a verify run of
        // speculative decoding keeps them all).
        state.set(0, ys)?;
        Ok(vec![ops::add(x, self.out.forward(p, &hs)?)?])
    }
}

/// The `toy_ema` architecture: `ema` and `attention` layers in turn.
pub struct ToyEma;

impl Architecture for ToyEma {
    fn name(&self) -> &str {
        "toy_ema"
    }
    fn summary(&self) -> &str {
        "example: ema and attention layers in turn (registered from mlex-example-ext)"
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let mut plan = ToyExt.plan(config)?;
        for (i, l) in plan.layers.iter_mut().enumerate() {
            if i % 2 == 0 {
                l.kind = "ema".to_owned();
            }
        }
        Ok(plan)
    }
}

mlex_core::register_architecture!("toy_ext", ToyExt);
mlex_core::register_architecture!("toy_ema", ToyEma);
// Without this, a prompt cache saved with an `ema` layer could not be
// loaded: the cache kind names the constructor that rebuilds it.
mlex_core::register_cache_kind!(
    "ema",
    "example: the ema layer's moving average (registered from mlex-example-ext)",
    |t| Ok(Box::new(StateCache::from_tensors("ema", t)?))
);
