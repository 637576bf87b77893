//! Decoder layers and the kinds that build them.
//!
//! Most layers are *blocks* (`mlex_models::block`): a pre-norm, a [`Mixer`]
//! (attention, Gated DeltaNet, Mamba2, ...), a residual, a pre-norm, a
//! feed-forward and a residual. Mixers are registered by name
//! ([`crate::register_mixer_kind!`]) and built from their own typed
//! options; a [`LayerKind`] builds a whole layer (the block itself, or a
//! layer of a downstream crate that is not a block).
//!
//! A [`Layer`] (and a [`Mixer`]) runs in up to three phases so that the
//! decode step can be cut at growing-cache writes (see `mlex-compile`):
//!
//! 1. [`Layer::before_cache`]: pure; everything before the growing-cache
//!    write (norm, projections, q/k norms). For a layer without a growing
//!    cache this is the whole layer.
//! 2. [`Layer::grow`]: eager; RoPE at the cache offset, the KV write, SDPA.
//! 3. [`Layer::after_cache`]: pure; everything after (output projection,
//!    residual, feed-forward).
//!
//! Pure phases read weights through [`Params`] and thread the layer's
//! fixed-size state ([`State`], the concatenated [`Cache::state`] of its
//! non-growing caches) explicitly, so they can be traced by MLX's compiler
//! with state and weights as inputs. Eager forward passes (prefill, tests)
//! call the same three phases in order, so compiled and eager decode share
//! one implementation.

use crate::cache::Cache;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::params::{ParamId, Params};
use crate::registry::Registry;
use crate::weights::WeightLoader;
use mlx_rs::{Array, Dtype};
use serde_json::Value;

/// Values passed between the phases of one layer (e.g. the residual and
/// q/k/v after the head).
pub type Carry = Vec<Array>;

/// The fixed-size state a layer's pure phases read and write: the
/// concatenated [`Cache::state`] of its non-growing caches, in order.
///
/// A run over `T` tokens normally leaves the state after the last token.
/// A *verify* run of speculative decoding ([`State::per_position`]) leaves
/// every array with a leading axis of `T` entries, the state after each
/// position, so that accepting `n` of the tokens picks entry `n - 1` with
/// no second forward (see `ARCHITECTURE.md`, "Speculative decoding").
/// Write state through [`State::set`] and it does the right thing in both
/// modes.
pub struct State<'a> {
    arrays: &'a mut [Array],
    per_position: bool,
}

impl<'a> State<'a> {
    /// The state after the last token only (prefill and decode).
    pub fn new(arrays: &'a mut [Array]) -> Self {
        Self {
            arrays,
            per_position: false,
        }
    }

    /// The state after every position (a verify forward).
    pub fn per_position(arrays: &'a mut [Array]) -> Self {
        Self {
            arrays,
            per_position: true,
        }
    }

    /// True when every array must leave with one entry per position.
    pub fn keeps_positions(&self) -> bool {
        self.per_position
    }

    /// The first `mid` arrays and the rest, in the same mode.
    pub fn split_at(&mut self, mid: usize) -> (State<'_>, State<'_>) {
        let (a, b) = self.arrays.split_at_mut(mid);
        (
            State {
                arrays: a,
                per_position: self.per_position,
            },
            State {
                arrays: b,
                per_position: self.per_position,
            },
        )
    }

    /// Writes array `i` from the states after each of the `T` positions
    /// (in order): all of them stacked on a new leading axis when
    /// [`State::keeps_positions`], else the last.
    pub fn set(&mut self, i: usize, mut after_each: Vec<Array>) -> Result<()> {
        let slot = self
            .arrays
            .get_mut(i)
            .ok_or_else(|| Error::Other(format!("layer state has no array {i}")))?;
        *slot = if self.per_position {
            mlx_rs::ops::stack(&after_each, 0)?
        } else {
            after_each
                .pop()
                .ok_or_else(|| Error::Other("a state update over no positions".into()))?
        };
        Ok(())
    }

    /// Writes array `i` from `stacked`, the states after each of the `T`
    /// positions already on a leading axis (`[T, ...]`, as a kernel that
    /// loops the positions writes them): kept whole when
    /// [`State::keeps_positions`], else its last entry.
    pub fn set_positions(&mut self, i: usize, stacked: Array) -> Result<()> {
        let per_position = self.per_position;
        let slot = self
            .arrays
            .get_mut(i)
            .ok_or_else(|| Error::Other(format!("layer state has no array {i}")))?;
        *slot = if per_position {
            stacked
        } else {
            let t = *stacked
                .shape()
                .first()
                .ok_or_else(|| Error::Other("a state update over no positions".into()))?;
            if t == 0 {
                return Err(Error::Other("a state update over no positions".into()));
            }
            position_entry(&stacked, t as usize - 1)?
        };
        Ok(())
    }
}

/// Entry `i` of `a`'s leading axis (`[T, ...]` -> `[...]`) as a view: a
/// slice and a reshape, where indexing with an integer would gather (a
/// copy, and one more kernel a layer on every step).
pub fn position_entry(a: &Array, i: usize) -> Result<Array> {
    use mlx_rs::ops::indexing::TryIndexOp;
    let i = i as i32;
    let one = a.try_index(i..i + 1)?;
    Ok(mlx_rs::ops::reshape(&one, &a.shape()[1..])?)
}

impl std::ops::Deref for State<'_> {
    type Target = [Array];
    fn deref(&self) -> &[Array] {
        self.arrays
    }
}

impl std::ops::DerefMut for State<'_> {
    fn deref_mut(&mut self) -> &mut [Array] {
        self.arrays
    }
}

/// One built decoder layer.
pub trait Layer: Send + Sync {
    /// The layer kind's registered name.
    fn kind(&self) -> &str;

    /// Every weight the layer reads, in any phase.
    fn params(&self) -> Vec<ParamId>;

    /// True when the layer has a growing cache (and so a [`Layer::grow`]
    /// phase).
    fn grows(&self) -> bool;

    /// Fresh caches for `batch` sequences with activations of `dtype`. The
    /// growing cache, if any, comes first.
    fn make_caches(&self, batch: usize, dtype: Dtype) -> Result<Vec<Box<dyn Cache>>>;

    /// Phase 1 (pure): `x` is `[B, T, D]`.
    fn before_cache(&self, p: &Params, x: &Array, state: &mut State<'_>) -> Result<Carry>;

    /// Phase 2 (eager): reads/writes the growing cache. Layers that do not
    /// grow pass the carry through.
    fn grow(&self, _p: &Params, carry: Carry, _cache: &mut dyn Cache) -> Result<Carry> {
        Ok(carry)
    }

    /// Phase 3 (pure): returns the layer's output `[B, T, D]`.
    fn after_cache(&self, _p: &Params, carry: Carry, _state: &mut State<'_>) -> Result<Array> {
        carry
            .into_iter()
            .next()
            .ok_or_else(|| Error::Other("layer phase produced no output".into()))
    }

    /// The weights affine quantization may pack: dense linear and expert
    /// matrices (never norms, convolutions, or routers that are plain
    /// parameters). Used by `mlex_models::quantize`.
    fn quantizable(&self) -> Vec<ParamId> {
        Vec::new()
    }

    /// A one-line description for `mlex inspect`.
    fn describe(&self) -> String {
        self.kind().to_owned()
    }

    /// `None` when the layer was built split across the ranks of its
    /// loader's [`crate::distributed::Shard`] (or needs no splitting);
    /// otherwise the part that cannot be split, by name. A model is built
    /// under `--tp` only from layers that split, and the default names the
    /// kind, so a kind that does not know how to shard is named rather
    /// than run whole on every rank.
    fn unsharded(&self) -> Option<String> {
        Some(format!("layer kind `{}`", self.kind()))
    }
}

/// What state a layer kind keeps between tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateKind {
    /// No state (MLP-only, MoE).
    None,
    /// Fixed-size recurrent state (gated delta, Mamba2).
    Fixed,
    /// A cache that grows per token (attention).
    Growing,
    /// Both (attention with canon conv windows).
    GrowingAndFixed,
}

impl StateKind {
    /// True when the state grows per token.
    pub fn grows(self) -> bool {
        matches!(self, StateKind::Growing | StateKind::GrowingAndFixed)
    }
}

/// Everything a layer kind needs to build one layer.
pub struct BuildCtx<'a> {
    /// The (text) model config.
    pub config: &'a ModelConfig,
    /// The layer's index in the stack.
    pub index: usize,
    /// The layer's weight prefix, e.g. `model.layers.3`.
    pub prefix: String,
    /// Kind-specific options from the architecture or a TOML file
    /// (weight-name templates, feature switches).
    pub options: &'a Value,
    /// Where weights come from.
    pub weights: &'a mut WeightLoader,
    /// The registry, for the mixer kinds a block names.
    pub registry: &'a Registry,
}

impl BuildCtx<'_> {
    /// `{prefix}.{name}`.
    pub fn path(&self, name: &str) -> String {
        if name.is_empty() {
            self.prefix.clone()
        } else if self.prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// An integer config key (required).
    pub fn cfg_i32(&self, key: &str) -> Result<i32> {
        self.config
            .value()
            .get(key)
            .and_then(Value::as_i64)
            .map(|v| v as i32)
            .ok_or_else(|| {
                self.config
                    .error(key, "missing or not an integer (needed by this layer kind)")
            })
    }
}

/// A kind of decoder layer, registered by name, that builds layers from
/// config keys, options and weights.
pub trait LayerKind: Send + Sync {
    /// The registered name (`attention`, `gated_delta`, `mamba2`, ...).
    fn name(&self) -> &'static str;

    /// What it keeps between tokens.
    fn state(&self) -> StateKind;

    /// One line for `mlex list`.
    fn summary(&self) -> &'static str;

    /// The option names its options struct takes (empty: not checked), so
    /// that a spec's `[kinds.<kind>]` table is checked when it is read and
    /// `docs/architectures.md` lists them; [`crate::config::struct_fields`]
    /// gives them for a serde struct.
    fn option_keys(&self) -> &'static [&'static str] {
        &[]
    }

    /// Builds one layer.
    fn build(&self, ctx: &mut BuildCtx<'_>) -> Result<Box<dyn Layer>>;
}

/// One built token mixer: the part of a block between its pre-norm and its
/// residual (attention, Gated DeltaNet, Mamba2, ...). It runs in the same
/// three phases as a [`Layer`], on the normed input, and returns what the
/// block adds to the residual. It owns its caches and their state.
pub trait Mixer: Send + Sync {
    /// The mixer kind's registered name.
    fn kind(&self) -> &str;

    /// Every weight the mixer reads.
    fn params(&self) -> Vec<ParamId>;

    /// True when the mixer has a growing cache (and so a
    /// [`Mixer::grow`] phase).
    fn grows(&self) -> bool;

    /// Fresh caches for `batch` sequences; the growing cache, if any,
    /// comes first.
    fn make_caches(&self, batch: usize, dtype: Dtype) -> Result<Vec<Box<dyn Cache>>>;

    /// How many arrays the states of its fixed-size caches hold together
    /// (its part of the layer's `state`).
    fn state_len(&self) -> usize;

    /// Phase 1 (pure): `x` is the normed input `[B, T, D]`.
    fn before_cache(&self, p: &Params, x: &Array, state: &mut State<'_>) -> Result<Carry>;

    /// Phase 2 (eager): reads/writes the growing cache.
    fn grow(&self, _p: &Params, carry: Carry, _cache: &mut dyn Cache) -> Result<Carry> {
        Ok(carry)
    }

    /// Phase 3 (pure): the mixer's output `[B, T, D]` (before the
    /// residual).
    fn after_cache(&self, _p: &Params, carry: Carry, _state: &mut State<'_>) -> Result<Array> {
        carry
            .into_iter()
            .next()
            .ok_or_else(|| Error::Other("mixer phase produced no output".into()))
    }

    /// The weights affine quantization may pack.
    fn quantizable(&self) -> Vec<ParamId> {
        Vec::new()
    }

    /// A one-line description for `mlex inspect`.
    fn describe(&self) -> String {
        self.kind().to_owned()
    }

    /// `None` when the mixer was built split across the ranks of its
    /// loader's [`crate::distributed::Shard`]; otherwise what cannot be
    /// split (see [`Layer::unsharded`]).
    fn unsharded(&self) -> Option<String> {
        Some(format!("mixer kind `{}`", self.kind()))
    }
}

/// A kind of mixer, registered by name, that builds mixers from its typed
/// options (`ctx.options`) and weights under the block's mixer prefix.
pub trait MixerKind: Send + Sync {
    /// The registered name (`attention`, `gated_delta`, `mamba2`, ...).
    fn name(&self) -> &'static str;

    /// What it keeps between tokens.
    fn state(&self) -> StateKind;

    /// One line for `mlex list`.
    fn summary(&self) -> &'static str;

    /// The option names its options struct takes (see
    /// [`LayerKind::option_keys`]).
    fn option_keys(&self) -> &'static [&'static str] {
        &[]
    }

    /// Builds one mixer; `ctx.prefix` is the layer's prefix.
    fn build(&self, ctx: &mut BuildCtx<'_>) -> Result<Box<dyn Mixer>>;
}
