//! Growing key/value caches for attention.
//!
//! - [`KvCache`]: pre-allocated in steps of 256 tokens (as mlx-lm's
//!   `KVCache`), written with `slice_update`; appending one token writes one
//!   row into a buffer MLX owns uniquely, so it never copies the cache.
//! - [`RotatingKvCache`]: a sliding window of `max_size` tokens that keeps
//!   the first `keep` tokens (attention sinks), as mlx-lm's
//!   `RotatingKVCache`.
//! - [`ConcatKvCache`]: the naive cache that concatenates every step; the
//!   reference for tests and the baseline for benchmarks.

use mlex_core::cache::{
    AttentionMask, Cache, CacheTensors, KvAccess, KvQuantization, KV_WINDOW_KEEP,
};
use mlex_core::error::{Error, Result};
use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::{ops, Array};
use std::collections::BTreeMap;

/// Growth step of [`KvCache`], in tokens (mlx-lm's value).
pub const KV_STEP: usize = 256;

fn seq_len(a: &Array) -> usize {
    a.shape()[2] as usize
}

fn zeros_like_rows(like: &Array, rows: usize) -> Result<Array> {
    let s = like.shape();
    Ok(ops::zeros_dtype(
        &[s[0], s[1], rows as i32, s[3]],
        like.dtype(),
    )?)
}

pub(crate) fn prefix(a: &Array, n: usize) -> Result<Array> {
    Ok(a.try_index((.., .., ..(n as i32), ..))?)
}

/// The mask for `n` queries over a cache that holds every past token: none
/// for one query, causal (aligned to the last key) for more.
pub(crate) fn full_cache_mask(n: usize) -> AttentionMask {
    if n == 1 {
        AttentionMask::None
    } else {
        AttentionMask::Causal
    }
}

/// KV caches keep no fixed-size state.
pub(crate) fn meta_usize(meta: &BTreeMap<String, String>, key: &str) -> Result<usize> {
    meta.get(key)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::Cache(format!("saved cache lacks `{key}`")))
}

fn kv_tensors(keys: &Option<Array>, values: &Option<Array>, n: usize) -> BTreeMap<String, Array> {
    let mut arrays = BTreeMap::new();
    if let (Some(k), Some(v)) = (keys, values) {
        if let (Ok(k), Ok(v)) = (prefix(k, n), prefix(v, n)) {
            arrays.insert("keys".to_owned(), k);
            arrays.insert("values".to_owned(), v);
        }
    }
    arrays
}

/// Keeps batch rows `rows` of a key/value pair.
fn select_kv_rows(
    keys: &mut Option<Array>,
    values: &mut Option<Array>,
    rows: &[i32],
) -> Result<()> {
    let idx = Array::from_slice(rows, &[rows.len() as i32]);
    for a in [keys, values].into_iter().flatten() {
        *a = a.take_axis(&idx, 0)?;
    }
    Ok(())
}

/// Pre-allocated KV cache, grown [`KV_STEP`] tokens at a time.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
}

impl KvCache {
    /// An empty cache (buffers are allocated on the first write).
    pub fn new() -> Self {
        Self::default()
    }

    /// Rows allocated.
    pub fn capacity(&self) -> usize {
        self.keys.as_ref().map(seq_len).unwrap_or(0)
    }

    /// Rebuilds a cache saved with [`Cache::to_tensors`].
    pub fn from_tensors(t: &CacheTensors) -> Result<Self> {
        let offset = meta_usize(&t.meta, "offset")?;
        Ok(Self {
            keys: t.arrays.get("keys").cloned(),
            values: t.arrays.get("values").cloned(),
            offset,
        })
    }

    /// The allocated key and value buffers (all of [`KvCache::capacity`]).
    pub(crate) fn buffers(&self) -> Option<(&Array, &Array)> {
        self.keys.as_ref().zip(self.values.as_ref())
    }
}

impl KvAccess for KvCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let prev = self.offset;
        let t = seq_len(keys);
        if self.keys.is_none() || prev + t > self.capacity() {
            let n_steps = t.div_ceil(KV_STEP);
            let new_k = zeros_like_rows(keys, n_steps * KV_STEP)?;
            let new_v = zeros_like_rows(values, n_steps * KV_STEP)?;
            match (self.keys.take(), self.values.take()) {
                (Some(mut k), Some(mut v)) => {
                    if !prev.is_multiple_of(KV_STEP) {
                        k = prefix(&k, prev)?;
                        v = prefix(&v, prev)?;
                    }
                    self.keys = Some(ops::concatenate(&[k, new_k], 2)?);
                    self.values = Some(ops::concatenate(&[v, new_v], 2)?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
        }
        self.offset += t;
        let (p, o) = (prev as i32, self.offset as i32);
        let k = self.keys.as_mut().expect("allocated above");
        k.try_index_mut((.., .., p..o, ..), keys)?;
        let v = self.values.as_mut().expect("allocated above");
        v.try_index_mut((.., .., p..o, ..), values)?;
        let (k, v) = (k.clone(), v.clone());
        if self.offset < seq_len(&k) {
            Ok((prefix(&k, self.offset)?, prefix(&v, self.offset)?))
        } else {
            Ok((k, v))
        }
    }

    fn mask(&self, n: usize) -> Result<AttentionMask> {
        Ok(full_cache_mask(n))
    }
}

impl Cache for KvCache {
    kv_cache_basics!("kv", offset, trimmable);
    fn with_max_kv_size(&self, max: usize) -> Option<Box<dyn Cache>> {
        Some(Box::new(RotatingKvCache::new(max, KV_WINDOW_KEEP)))
    }
    fn with_kv_quantization(&self, q: KvQuantization) -> Option<Box<dyn Cache>> {
        Some(Box::new(crate::quantized::QuantizedKvCache::from_kv(
            self.clone(),
            q,
        )))
    }
    fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }
    kv_arrays!(in_order);
}

/// The naive cache: concatenates keys/values every step (copies the whole
/// cache each token). A reference and a benchmark baseline.
#[derive(Clone, Debug, Default)]
pub struct ConcatKvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
}

impl ConcatKvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }
}

impl KvAccess for ConcatKvCache {
    fn offset(&self) -> usize {
        self.offset
    }
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let (k, v) = match (self.keys.take(), self.values.take()) {
            (Some(k), Some(v)) => (
                ops::concatenate(&[&k, keys], 2)?,
                ops::concatenate(&[&v, values], 2)?,
            ),
            _ => (keys.clone(), values.clone()),
        };
        self.offset = seq_len(&k);
        self.keys = Some(k.clone());
        self.values = Some(v.clone());
        Ok((k, v))
    }
    fn mask(&self, n: usize) -> Result<AttentionMask> {
        Ok(full_cache_mask(n))
    }
}

impl Cache for ConcatKvCache {
    kv_cache_basics!("concat_kv", offset, trimmable);
    fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            if let (Ok(k), Ok(v)) = (prefix(k, self.offset), prefix(v, self.offset)) {
                self.keys = Some(k);
                self.values = Some(v);
            }
        }
        n
    }
    kv_arrays!(in_order);
}

/// Sliding-window KV cache: at most `max_size` tokens, the first `keep` of
/// which are never evicted. Single-token writes rotate in place; multi-token
/// writes re-linearise and trim (mlx-lm's `RotatingKVCache` semantics).
#[derive(Clone, Debug)]
pub struct RotatingKvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
    max_size: usize,
    keep: usize,
    idx: usize,
}

impl RotatingKvCache {
    /// A window of `max_size` tokens keeping the first `keep`.
    pub fn new(max_size: usize, keep: usize) -> Self {
        assert!(keep < max_size, "keep must be smaller than the window");
        Self {
            keys: None,
            values: None,
            offset: 0,
            max_size,
            keep,
            idx: 0,
        }
    }

    /// Rebuilds a cache saved with [`Cache::to_tensors`] (saved in temporal
    /// order).
    pub fn from_tensors(t: &CacheTensors) -> Result<Self> {
        let keys = t.arrays.get("keys").cloned();
        let idx = keys.as_ref().map(seq_len).unwrap_or(0);
        Ok(Self {
            values: t.arrays.get("values").cloned(),
            keys,
            offset: meta_usize(&t.meta, "offset")?,
            max_size: meta_usize(&t.meta, "max_size")?,
            keep: meta_usize(&t.meta, "keep")?,
            idx,
        })
    }

    fn trim_front(&self, trim: usize, v: &Array, append: Option<&Array>) -> Result<Array> {
        let mut parts = Vec::new();
        if trim > 0 {
            parts.push(v.try_index((.., .., ..(self.keep as i32), ..))?);
            parts.push(v.try_index((.., .., ((trim + self.keep) as i32).., ..))?);
        } else {
            parts.push(v.clone());
        }
        if let Some(a) = append {
            parts.push(a.clone());
        }
        Ok(ops::concatenate(&parts, 2)?)
    }

    fn temporal_order(&self, v: &Array) -> Result<Array> {
        let len = seq_len(v);
        if self.idx == len {
            Ok(v.clone())
        } else if self.idx < self.offset {
            let (keep, idx) = (self.keep as i32, self.idx as i32);
            Ok(ops::concatenate(
                &[
                    v.try_index((.., .., ..keep, ..))?,
                    v.try_index((.., .., idx.., ..))?,
                    v.try_index((.., .., keep..idx, ..))?,
                ],
                2,
            )?)
        } else {
            prefix(v, self.idx)
        }
    }

    fn update_concat(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        match (self.keys.take(), self.values.take()) {
            (Some(k), Some(v)) => {
                let k = self.temporal_order(&k)?;
                let v = self.temporal_order(&v)?;
                self.idx = seq_len(&k);
                let trim = (self.idx + 1).saturating_sub(self.max_size);
                self.keys = Some(self.trim_front(trim, &k, Some(keys))?);
                self.values = Some(self.trim_front(trim, &v, Some(values))?);
            }
            _ => {
                self.keys = Some(keys.clone());
                self.values = Some(values.clone());
            }
        }
        self.offset += seq_len(keys);
        let k = self.keys.clone().expect("set above");
        self.idx = seq_len(&k);
        Ok((k, self.values.clone().expect("set above")))
    }

    fn update_in_place(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let s = seq_len(keys);
        let prev = self.offset;
        let cap = self.keys.as_ref().map(seq_len).unwrap_or(0);
        if self.keys.is_none() || (prev >= cap && cap < self.max_size) {
            let new_size = KV_STEP.min(self.max_size - prev);
            let new_k = zeros_like_rows(keys, new_size)?;
            let new_v = zeros_like_rows(values, new_size)?;
            match (self.keys.take(), self.values.take()) {
                (Some(k), Some(v)) => {
                    self.keys = Some(ops::concatenate(&[k, new_k], 2)?);
                    self.values = Some(ops::concatenate(&[v, new_v], 2)?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
            self.idx = prev;
        }
        let cap = self.keys.as_ref().map(seq_len).unwrap_or(0);
        if cap > self.max_size {
            let trim = cap - self.max_size;
            let k = self.keys.take().expect("allocated");
            let v = self.values.take().expect("allocated");
            self.keys = Some(self.trim_front(trim, &k, None)?);
            self.values = Some(self.trim_front(trim, &v, None)?);
            self.idx = self.max_size;
        }
        if self.idx == self.max_size {
            self.idx = self.keep;
        }
        let (a, b) = (self.idx as i32, (self.idx + s) as i32);
        self.keys
            .as_mut()
            .expect("allocated")
            .try_index_mut((.., .., a..b, ..), keys)?;
        self.values
            .as_mut()
            .expect("allocated")
            .try_index_mut((.., .., a..b, ..), values)?;
        self.offset += s;
        self.idx += s;
        let k = self.keys.clone().expect("allocated");
        let v = self.values.clone().expect("allocated");
        if self.offset < seq_len(&k) {
            Ok((prefix(&k, self.offset)?, prefix(&v, self.offset)?))
        } else {
            Ok((k, v))
        }
    }

    fn causal_window_mask(&self, n: usize, offset: usize) -> Result<Array> {
        // mask[i, j] = (offset + i >= j) && (offset + i < j + window)
        let rows: Vec<i32> = (offset..offset + n).map(|v| v as i32).collect();
        let cols: Vec<i32> = (0..offset + n).map(|v| v as i32).collect();
        let l = Array::from_slice(&rows, &[n as i32, 1]);
        let r = Array::from_slice(&cols, &[1, (offset + n) as i32]);
        let causal = ops::ge(&l, &r)?;
        let window = ops::lt(&l, ops::add(&r, Array::from_int(self.max_size as i32))?)?;
        Ok(ops::logical_and(&causal, &window)?)
    }
}

impl KvAccess for RotatingKvCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        if seq_len(keys) == 1 {
            self.update_in_place(keys, values)
        } else {
            self.update_concat(keys, values)
        }
    }

    fn mask(&self, n: usize) -> Result<AttentionMask> {
        if n == 1 {
            return Ok(AttentionMask::None);
        }
        let offset = (self.max_size - 1).min(self.offset);
        if offset + n > self.max_size {
            Ok(AttentionMask::Array(self.causal_window_mask(n, offset)?))
        } else {
            Ok(AttentionMask::Causal)
        }
    }
}

impl Cache for RotatingKvCache {
    kv_cache_basics!("rotating_kv", offset);
    fn is_trimmable(&self) -> bool {
        self.offset < self.max_size
    }
    fn trimmable_after(&self, n: usize) -> bool {
        // Until the ring is full nothing has been overwritten.
        self.offset + n < self.max_size
    }
    fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        self.idx -= n.min(self.idx);
        n
    }
    kv_arrays!();
    fn to_tensors(&self) -> CacheTensors {
        let mut arrays = BTreeMap::new();
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            if let (Ok(k), Ok(v)) = (self.temporal_order(k), self.temporal_order(v)) {
                let n = seq_len(&k).min(self.offset);
                if let (Ok(k), Ok(v)) = (prefix(&k, n), prefix(&v, n)) {
                    arrays.insert("keys".to_owned(), k);
                    arrays.insert("values".to_owned(), v);
                }
            }
        }
        CacheTensors {
            arrays,
            meta: BTreeMap::from([
                ("offset".to_owned(), self.offset.to_string()),
                ("max_size".to_owned(), self.max_size.to_string()),
                ("keep".to_owned(), self.keep.to_string()),
            ]),
        }
    }
}
