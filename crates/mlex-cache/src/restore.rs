//! Rebuilding caches from their saved form, by kind name.

use crate::kv::{KvCache, RotatingKvCache};
use crate::state::StateCache;
use mlex_core::cache::{Cache, CacheTensors};
use mlex_core::error::{Error, Result};

/// Rebuilds a cache saved with [`Cache::to_tensors`] from its kind name.
pub fn cache_from_tensors(kind: &str, t: &CacheTensors) -> Result<Box<dyn Cache>> {
    Ok(match kind {
        "kv" | "concat_kv" => Box::new(KvCache::from_tensors(t)?),
        "rotating_kv" => Box::new(RotatingKvCache::from_tensors(t)?),
        "gated_delta" => Box::new(StateCache::from_tensors("gated_delta", t)?),
        "mamba2" => Box::new(StateCache::from_tensors("mamba2", t)?),
        "conv_window" => Box::new(StateCache::from_tensors("conv_window", t)?),
        other => {
            return Err(Error::Cache(format!(
                "unknown cache kind `{other}` in saved cache"
            )))
        }
    })
}
