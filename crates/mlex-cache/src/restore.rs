//! The built-in cache kinds' registrations: how each is rebuilt from its
//! saved form ([`mlex_core::registry::restore_cache`] looks them up, with
//! any a downstream crate registers).

use crate::kv::{KvCache, RotatingKvCache};
use crate::quantized::QuantizedKvCache;
use crate::state::StateCache;
use mlex_core::cache::{Cache, CacheTensors};
use mlex_core::error::Result;

fn kv(t: &CacheTensors) -> Result<Box<dyn Cache>> {
    Ok(Box::new(KvCache::from_tensors(t)?))
}

// The naive concatenating cache saves what a plain one holds, and comes
// back as a plain one. The fixed-size states keep their kind's name.
#[rustfmt::skip]
mlex_core::register_cache_kind!(
    "kv", "attention keys and values, growing per token (step-allocated)", kv;
    "concat_kv", "keys and values concatenated each step (reference); restored as `kv`", kv;
    "quantized_kv", "attention keys and values, quantized after a number of tokens (--kv-bits)",
        |t| Ok(Box::new(QuantizedKvCache::from_tensors(t)?));
    "rotating_kv", "sliding-window keys and values (a ring of the last W tokens)",
        |t| Ok(Box::new(RotatingKvCache::from_tensors(t)?));
    "gated_delta", "Gated DeltaNet conv window and f32 recurrent state (fixed size)",
        |t| Ok(Box::new(StateCache::from_tensors("gated_delta", t)?));
    "mamba2", "Mamba2 conv window and f32 SSM state (fixed size)",
        |t| Ok(Box::new(StateCache::from_tensors("mamba2", t)?));
    "conv_window", "canon convolution windows (fixed size)",
        |t| Ok(Box::new(StateCache::from_tensors("conv_window", t)?));
);
