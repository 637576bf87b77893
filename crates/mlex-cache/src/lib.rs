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
pub use state::{conv_window_into, conv_window_step, StateCache, StateSpec};
