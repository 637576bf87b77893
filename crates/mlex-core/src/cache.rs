//! The object-safe cache trait that layers hand out.
//!
//! A layer's state between decode steps lives in one or more caches. Two
//! families exist and the difference shapes the whole engine:
//!
//! - **growing** caches (attention KV) gain a row per token; they are written
//!   eagerly between compiled segments ([`KvAccess`]) and can be trimmed.
//! - **fixed-size** caches (gated-delta conv window + recurrent state, Mamba2
//!   conv + SSM state, canon conv windows) hold a few arrays of constant
//!   shape; they pass *through* compiled segments as plain inputs/outputs
//!   ([`Cache::state`] / [`Cache::set_state`]) and cannot be trimmed, only
//!   snapshotted and restored.
//!
//! Cloning a cache clones array handles (MLX arrays are reference counted),
//! so copying a whole model's caches costs O(layers), not O(bytes).

use crate::error::Result;
use mlx_rs::Array;
use std::collections::BTreeMap;

/// What attention should mask when reading a growing cache.
#[derive(Clone, Debug)]
pub enum AttentionMask {
    /// No mask (single query over all keys).
    None,
    /// Causal, aligned to the last key (MLX's `"causal"` mode).
    Causal,
    /// An explicit boolean/additive mask.
    Array(Array),
}

/// Keys and values stored quantized (mlx-lm's `QuantizedKVCache`,
/// `--kv-bits`): a cache holds them in full precision until it has seen
/// `start` tokens, then quantizes what it holds and everything after,
/// `group_size` values of a head's row sharing a scale and a bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvQuantization {
    /// Bits a value: 2, 3, 4, 5, 6 or 8.
    pub bits: i32,
    /// Values per scale and bias: 32, 64 or 128 (must divide the head dim).
    pub group_size: i32,
    /// Tokens kept in full precision before the cache is quantized (as
    /// mlx-lm's `quantized_kv_start`, checked after each forward).
    pub start: usize,
}

impl KvQuantization {
    /// Checks the values against what MLX's affine quantization takes,
    /// naming the option (`--kv-bits`, `--kv-group-size`).
    pub fn new(bits: i32, group_size: i32, start: usize) -> Result<Self> {
        if ![2, 3, 4, 5, 6, 8].contains(&bits) {
            return Err(crate::error::Error::invalid(
                "--kv-bits",
                format!("{bits} is not one of 2, 3, 4, 5, 6, 8"),
            ));
        }
        if ![32, 64, 128].contains(&group_size) {
            return Err(crate::error::Error::invalid(
                "--kv-group-size",
                format!("{group_size} is not one of 32, 64, 128"),
            ));
        }
        Ok(Self {
            bits,
            group_size,
            start,
        })
    }
}

/// Tokens at the start of a sequence that a `--max-kv-size` window never
/// evicts (mlx-lm's `make_prompt_cache` keeps 4: attention sinks).
pub const KV_WINDOW_KEEP: usize = 4;

/// Checks a `--max-kv-size` window: it must hold more than the
/// [`KV_WINDOW_KEEP`] tokens it never evicts.
pub fn check_max_kv_size(max: usize) -> Result<usize> {
    if max <= KV_WINDOW_KEEP {
        return Err(crate::error::Error::invalid(
            "--max-kv-size",
            format!("{max} must be larger than the {KV_WINDOW_KEEP} first tokens a window keeps"),
        ));
    }
    Ok(max)
}

/// What attention reads from a growing cache after writing a step.
pub enum KvRead {
    /// Keys and values `[B, H, L, D]`.
    Dense {
        /// Keys.
        keys: Array,
        /// Values.
        values: Array,
    },
    /// Keys and values as MLX's quantized triples (packed `uint32` rows,
    /// scales, biases), for `quantized_matmul`.
    Quantized {
        /// Keys.
        keys: [Array; 3],
        /// Values.
        values: [Array; 3],
        /// How they were quantized.
        quantization: KvQuantization,
    },
}

/// Eager access to a growing key/value cache.
pub trait KvAccess {
    /// Tokens written so far (the RoPE offset of the next token).
    fn offset(&self) -> usize;
    /// Appends `keys`/`values` (`[B, H, T, D]`) and returns the keys and
    /// values attention should read.
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)>;
    /// The mask for `n` new queries against what `update_and_fetch` returns
    /// (call before the update).
    fn mask(&self, n: usize) -> Result<AttentionMask>;
    /// As [`KvAccess::update_and_fetch`], in the form the cache stores
    /// (quantized caches override it; attention reads through this).
    fn update_and_read(&mut self, keys: &Array, values: &Array) -> Result<KvRead> {
        let (keys, values) = self.update_and_fetch(keys, values)?;
        Ok(KvRead::Dense { keys, values })
    }
    /// Per-sequence RoPE positions of the next token, `[B]` int32, when the
    /// sequences of a batch sit at different positions (a batched cache);
    /// `None` when every row is at [`KvAccess::offset`].
    fn positions(&self) -> Result<Option<Array>> {
        Ok(None)
    }
}

/// Serialized form of one cache: named arrays plus string metadata.
#[derive(Clone, Debug, Default)]
pub struct CacheTensors {
    /// Arrays by name (e.g. `keys`, `values`, `state0`).
    pub arrays: BTreeMap<String, Array>,
    /// Everything else needed to rebuild the cache (offsets, sizes).
    pub meta: BTreeMap<String, String>,
}

/// One cache of one layer.
pub trait Cache: Send {
    /// The registered kind name (`kv`, `rotating_kv`, `gated_delta`, ...).
    fn kind(&self) -> &'static str;

    /// Tokens this cache has seen.
    fn offset(&self) -> usize;

    /// True for caches that gain a row per token.
    fn grows(&self) -> bool;

    /// The fixed-size state arrays (empty, the default, for growing caches).
    fn state(&self) -> Vec<Array> {
        Vec::new()
    }

    /// Replaces the fixed-size state (same count and shapes as
    /// [`Cache::state`]); the default takes only an empty state.
    fn set_state(&mut self, state: Vec<Array>) -> Result<()> {
        if state.is_empty() {
            Ok(())
        } else {
            Err(crate::error::Error::Cache(format!(
                "a `{}` cache has no fixed-size state, got {} arrays",
                self.kind(),
                state.len()
            )))
        }
    }

    /// Records that `n` tokens went through (fixed-size caches; growing
    /// caches count in `update_and_fetch`, and keep this no-op default).
    fn advance(&mut self, _n: usize) {}

    /// A cache in place of this one that quantizes its keys and values as
    /// `q` asks, where its kind can (the full-attention KV cache); `None`,
    /// the default, keeps this one.
    fn with_kv_quantization(&self, _q: KvQuantization) -> Option<Box<dyn Cache>> {
        None
    }

    /// A cache in place of this empty one that keeps at most `max` tokens,
    /// rotating (`--max-kv-size`, as mlx-lm's `RotatingKVCache` with
    /// [`KV_WINDOW_KEEP`] tokens always kept), where its kind is unbounded
    /// (the full-attention KV cache); `None`, the default, keeps this one.
    fn with_max_kv_size(&self, _max: usize) -> Option<Box<dyn Cache>> {
        None
    }

    /// Eager KV access (growing caches only).
    fn as_kv(&mut self) -> Option<&mut dyn KvAccess> {
        None
    }

    /// True when [`Cache::trim`] can drop the last tokens exactly.
    fn is_trimmable(&self) -> bool {
        false
    }

    /// True when, after taking `n` more tokens, [`Cache::trim`] could
    /// drop them exactly (a speculative round of `n` tokens asks first).
    fn trimmable_after(&self, _n: usize) -> bool {
        self.is_trimmable()
    }

    /// Drops the last `n` tokens; returns how many were dropped.
    fn trim(&mut self, _n: usize) -> usize {
        0
    }

    /// Drops the last `drop[r]` tokens of batch row `r` (a batched
    /// speculative verify: every row wrote the same tokens, each keeps its
    /// own accepted prefix). The default serves a cache whose rows all drop
    /// the same count ([`Cache::trim`]); other counts are an error naming
    /// the kind.
    fn trim_rows(&mut self, drop: &[usize]) -> Result<()> {
        match drop.first() {
            None => Ok(()),
            Some(&n) if drop.iter().all(|&d| d == n) => {
                if self.trim(n) == n {
                    Ok(())
                } else {
                    Err(crate::error::Error::Cache(format!(
                        "a `{}` cache cannot drop {n} tokens",
                        self.kind()
                    )))
                }
            }
            Some(_) => Err(crate::error::Error::Cache(format!(
                "a `{}` cache cannot drop a different count of tokens from each batch row",
                self.kind()
            ))),
        }
    }

    /// Bytes held (logical, for cache budgets).
    fn nbytes(&self) -> usize;

    /// An O(1) copy sharing the arrays.
    fn box_clone(&self) -> Box<dyn Cache>;

    /// The arrays and metadata to save this cache.
    fn to_tensors(&self) -> CacheTensors;

    /// Keeps only the batch rows `rows`, in that order (the batched engine
    /// splits a batched prefill into its sequences with this). Every array
    /// of a cache holds the batch on axis 0. Kinds that cannot be batched
    /// keep the default, an error naming the kind.
    fn select_rows(&mut self, _rows: &[i32]) -> Result<()> {
        Err(crate::error::Error::Cache(format!(
            "a `{}` cache cannot be split into batch rows",
            self.kind()
        )))
    }

    /// Writes the one sequence held by `from` (a cache of the same layer
    /// for batch 1, e.g. from that sequence's prefill) into batch row
    /// `row`, replacing what the row held. Kinds that cannot be batched keep
    /// the default, an error naming the kind.
    fn write_row(&mut self, _row: usize, from: &dyn Cache) -> Result<()> {
        Err(crate::error::Error::Cache(format!(
            "a `{}` cache cannot take a sequence into a batch row (from a `{}` cache)",
            self.kind(),
            from.kind()
        )))
    }

    /// Marks batch row `row` unused: what it computes from now on is
    /// ignored, and must stay finite. Fixed-size state needs nothing.
    fn free_row(&mut self, _row: usize) {}

    /// Appends `n` unused batch rows.
    fn add_rows(&mut self, _n: usize) -> Result<()> {
        Err(crate::error::Error::Cache(format!(
            "a `{}` cache cannot grow its batch",
            self.kind()
        )))
    }
}

impl Clone for Box<dyn Cache> {
    fn clone(&self) -> Self {
        self.box_clone()
    }
}
