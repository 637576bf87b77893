//! # mlex-cache
//!
//! The caches layers hand out, all behind [`mlex_core::cache::Cache`]:
//!
//! - [`kv::KvCache`]: KV pre-allocated in 256-token steps, with trim;
//! - [`kv::RotatingKvCache`]: sliding window keeping the first N tokens;
//! - [`quantized::QuantizedKvCache`]: KV quantized after a number of
//!   tokens (`--kv-bits`, as mlx-lm's `QuantizedKVCache`);
//! - [`batch::BatchKvCache`]: the left-padded KV of a batch of sequences
//!   at different positions (continuous batching);
//! - [`state::StateCache`]: fixed-size state (gated-delta conv window +
//!   f32 recurrent state, Mamba2 conv + SSM state, canon conv windows);
//! - [`prompt::PromptCache`]: prefix reuse that works for hybrids through
//!   snapshots of recurrent state, with LRU bounds and safetensors files.
#![deny(missing_docs)]

/// The [`mlex_core::cache::Cache`] methods every key/value cache has alike:
/// its kind's name, its offset (the field named), that it grows, and its
/// [`mlex_core::cache::KvAccess`]; with `trimmable`, that it can always
/// drop tokens.
macro_rules! kv_cache_basics {
    ($kind:literal, $offset:ident, trimmable) => {
        kv_cache_basics!($kind, $offset);
        fn is_trimmable(&self) -> bool {
            true
        }
    };
    ($kind:literal, $offset:ident) => {
        fn kind(&self) -> &'static str {
            $kind
        }
        fn offset(&self) -> usize {
            self.$offset
        }
        fn grows(&self) -> bool {
            true
        }
        fn as_kv(&mut self) -> Option<&mut dyn mlex_core::cache::KvAccess> {
            Some(self)
        }
    };
}

/// `nbytes` and `box_clone` of a cache whose arrays are `keys` and `values`
/// (`Option<Array>`, the one `Clone`); with `in_order`, also `select_rows`
/// and `to_tensors` of one whose positions run in order from 0 to `offset`
/// (`kv.rs`'s helpers).
macro_rules! kv_arrays {
    () => {
        fn nbytes(&self) -> usize {
            self.keys.as_ref().map(Array::nbytes).unwrap_or(0)
                + self.values.as_ref().map(Array::nbytes).unwrap_or(0)
        }
        fn box_clone(&self) -> Box<dyn Cache> {
            Box::new(self.clone())
        }
    };
    (in_order) => {
        kv_arrays!();
        fn select_rows(&mut self, rows: &[i32]) -> Result<()> {
            select_kv_rows(&mut self.keys, &mut self.values, rows)
        }
        fn to_tensors(&self) -> CacheTensors {
            CacheTensors {
                arrays: kv_tensors(&self.keys, &self.values, self.offset),
                meta: BTreeMap::from([("offset".to_owned(), self.offset.to_string())]),
            }
        }
    };
}

mod batch;
mod kv;
mod prompt;
mod quantized;
mod restore;
mod state;

pub use batch::BatchKvCache;
pub use kv::{ConcatKvCache, KvCache, RotatingKvCache, KV_STEP};
pub use prompt::{PrefixHit, PromptCache, StateSnapshot};
pub use quantized::QuantizedKvCache;
pub use state::{conv_window_into, conv_window_step, windows_after_each, StateCache, StateSpec};
