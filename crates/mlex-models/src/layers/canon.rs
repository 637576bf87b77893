//! Canon layers (Allen-Zhu, *Physics of Language Models, Part 4.1*): a
//! causal depthwise 1-D convolution over time mixing each channel with its
//! previous `K - 1` values, optionally followed by SiLU and added back to
//! its input. DharaAR places them at A (the normed input of attention),
//! B (q, k, v after projection), C (the normed input of the MLP) and D (the
//! MLP's inner activation). Their windows are fixed-size state. A and B
//! belong to the attention mixer, C and D to the block around it; both
//! take the same `canon` option and use their own positions.

use mlex_cache::{conv_window_into, StateCache};
use mlex_core::cache::Cache;
use mlex_core::error::Result;
use mlex_core::layer::{BuildCtx, State};
use mlex_core::nn::{silu, DepthwiseConv};
use mlex_core::params::{ParamId, Params};
use mlex_core::weights::WeightLoader;
use mlx_rs::{ops, Array, Dtype};
use serde::Deserialize;

/// The `canon` option: which positions, and how each convolution works.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CanonOptions {
    /// Which positions, e.g. `ABCD`.
    pub set: String,
    /// Kernel width.
    pub kernel: i32,
    /// `x + f(conv(x))`.
    pub residual: bool,
    /// SiLU after the convolution.
    pub activation: bool,
}

impl CanonOptions {
    /// The options with `set` upper-cased; `None` for an empty set (no
    /// canon layers); an error naming the option for a letter outside
    /// A-D.
    pub fn checked(&self, ctx: &BuildCtx<'_>) -> Result<Option<CanonOptions>> {
        let set = self.set.to_uppercase();
        if let Some(bad) = set.chars().find(|ch| !"ABCD".contains(*ch)) {
            return Err(ctx.config.error(
                &format!("options of layer {}: canon.set", ctx.index),
                format!("unknown canon position `{bad}` (A, B, C, D)"),
            ));
        }
        Ok((!set.is_empty()).then(|| CanonOptions {
            set,
            ..self.clone()
        }))
    }

    /// A layer's `canon` option [`checked`](CanonOptions::checked): the
    /// options when it names positions.
    pub fn enabled(
        option: &Option<CanonOptions>,
        ctx: &BuildCtx<'_>,
    ) -> Result<Option<CanonOptions>> {
        Ok(option
            .as_ref()
            .map(|c| c.checked(ctx))
            .transpose()?
            .flatten())
    }
}

/// One canon convolution.
#[derive(Clone, Debug)]
pub struct Canon {
    /// The convolution (`[C, K, 1]` weight, optional bias).
    pub conv: DepthwiseConv,
    /// Add the input back.
    pub residual: bool,
    /// Apply SiLU to the convolution output.
    pub activation: bool,
}

impl Canon {
    /// Loads `{prefix}.weight` (and `.bias` when present).
    pub fn load(
        ld: &mut WeightLoader,
        prefix: &str,
        channels: i32,
        o: &CanonOptions,
    ) -> Result<Self> {
        let bias = ld.has(&format!("{prefix}.bias"));
        Ok(Self {
            conv: DepthwiseConv::load(ld, prefix, channels, o.kernel, bias)?,
            residual: o.residual,
            activation: o.activation,
        })
    }

    /// Weights read.
    pub fn params(&self) -> Vec<ParamId> {
        self.conv.params()
    }

    /// `x` `[B, T, C]`, reading and writing its window `[B, K-1, C]`,
    /// array `i` of the layer's state.
    pub fn forward(&self, p: &Params, x: &Array, state: &mut State<'_>, i: usize) -> Result<Array> {
        let padded = conv_window_into(state, i, x)?;
        let mut y = self.conv.forward(p, &padded)?;
        if self.activation {
            y = silu(&y)?;
        }
        if self.residual {
            y = ops::add(x, &y)?;
        }
        Ok(y)
    }
}

/// The cache of a layer's canon convolution windows, one per `(name,
/// channels)` in state order ([`StateCache::conv_windows`]); none when the
/// layer has no canon positions.
pub fn windows_cache(
    batch: usize,
    kernel: i32,
    windows: &[(&str, i32)],
    dtype: Dtype,
) -> Result<Option<Box<dyn Cache>>> {
    if windows.is_empty() {
        return Ok(None);
    }
    let cache = StateCache::conv_windows(batch, kernel, windows, dtype)?;
    Ok(Some(Box::new(cache)))
}
