//! Quantized keys and values: mlx-lm's `QuantizedKVCache` with the switch
//! its `generate_step` makes (`maybe_quantize_kv_cache`).
//!
//! A [`QuantizedKvCache`] starts as a full-precision [`KvCache`]. At the
//! first write after it has seen [`KvQuantization::start`] tokens it
//! quantizes what it holds (`mx.quantize` of the whole buffer, as
//! `KVCache.to_quantized`) and from then on stores each step's keys and
//! values as MLX's affine triples (packed `uint32`, scales, biases),
//! pre-allocated in [`KV_STEP`]-token steps. mlx-lm makes the switch after
//! every forward whose cache has `offset >= start`; switching at the start
//! of the next write is the same thing, since one forward writes each cache
//! once. Attention reads the triples through [`KvAccess::update_and_read`]
//! and multiplies with `quantized_matmul` (`mlex_models`' `sdpa`).

use crate::kv::{full_cache_mask, meta_usize, prefix, KvCache, KV_STEP};
use mlex_core::cache::{AttentionMask, Cache, CacheTensors, KvAccess, KvQuantization, KvRead};
use mlex_core::error::{Error, Result};
use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::{ops, Array, Dtype};
use std::collections::BTreeMap;

/// A KV cache that quantizes its keys and values after
/// [`KvQuantization::start`] tokens.
#[derive(Clone, Debug)]
pub struct QuantizedKvCache {
    q: KvQuantization,
    /// Before the switch: the full-precision cache.
    dense: Option<KvCache>,
    /// After it: keys and values as (packed, scales, biases).
    keys: Option<[Array; 3]>,
    values: Option<[Array; 3]>,
    offset: usize,
}

fn quantize(a: &Array, q: &KvQuantization) -> Result<[Array; 3]> {
    let (w, s, b) = ops::quantize(a, q.group_size, q.bits)?;
    Ok([w, s, b])
}

fn rows(a: &Array) -> usize {
    a.shape()[2] as usize
}

fn triple_prefix(t: &[Array; 3], n: usize) -> Result<[Array; 3]> {
    Ok([prefix(&t[0], n)?, prefix(&t[1], n)?, prefix(&t[2], n)?])
}

impl QuantizedKvCache {
    /// An empty cache that quantizes as `q` says.
    pub fn new(q: KvQuantization) -> Self {
        Self::from_kv(KvCache::new(), q)
    }

    /// `kv` (full precision so far), to be quantized as `q` says.
    pub fn from_kv(kv: KvCache, q: KvQuantization) -> Self {
        let offset = KvAccess::offset(&kv);
        Self {
            q,
            dense: Some(kv),
            keys: None,
            values: None,
            offset,
        }
    }

    /// True once keys and values are stored quantized.
    pub fn is_quantized(&self) -> bool {
        self.dense.is_none()
    }

    /// The quantization it applies.
    pub fn quantization(&self) -> KvQuantization {
        self.q
    }

    /// Rebuilds a cache saved with [`Cache::to_tensors`].
    pub fn from_tensors(t: &CacheTensors) -> Result<Self> {
        let q = KvQuantization::new(
            meta_usize(&t.meta, "bits")? as i32,
            meta_usize(&t.meta, "group_size")? as i32,
            meta_usize(&t.meta, "start")?,
        )?;
        if t.meta.get("quantized").map(String::as_str) != Some("1") {
            return Ok(Self::from_kv(KvCache::from_tensors(t)?, q));
        }
        let triple = |name: &str| -> Result<Option<[Array; 3]>> {
            let part = |i: usize| t.arrays.get(&format!("{name}.{i}")).cloned();
            Ok(match (part(0), part(1), part(2)) {
                (Some(a), Some(b), Some(c)) => Some([a, b, c]),
                (None, None, None) => None,
                _ => {
                    return Err(Error::Cache(format!(
                        "saved quantized cache lacks part of `{name}`"
                    )))
                }
            })
        };
        Ok(Self {
            q,
            dense: None,
            keys: triple("keys")?,
            values: triple("values")?,
            offset: meta_usize(&t.meta, "offset")?,
        })
    }

    /// The group size must divide the head dim: said before MLX is asked.
    fn check_head_dim(&self, keys: &Array, values: &Array) -> Result<()> {
        for (what, a) in [("key", keys), ("value", values)] {
            let d = a.shape()[3];
            if d % self.q.group_size != 0 {
                return Err(Error::invalid(
                    "--kv-group-size",
                    format!(
                        "{} does not divide the attention {what} head dim {d}",
                        self.q.group_size
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `KVCache.to_quantized`: the whole buffer, its unwritten tail too.
    fn switch(&mut self) -> Result<()> {
        let Some(dense) = self.dense.take() else {
            return Ok(());
        };
        if let Some((k, v)) = dense.buffers() {
            self.keys = Some(quantize(k, &self.q)?);
            self.values = Some(quantize(v, &self.q)?);
        }
        self.offset = KvAccess::offset(&dense);
        Ok(())
    }

    /// `QuantizedKVCache.update_and_fetch`.
    fn write_quantized(&mut self, keys: &Array, values: &Array) -> Result<KvRead> {
        let prev = self.offset;
        let t = rows(keys);
        let capacity = self.keys.as_ref().map(|k| rows(&k[0])).unwrap_or(0);
        if self.keys.is_none() || prev + t > capacity {
            let steps = t.div_ceil(KV_STEP) * KV_STEP;
            let fresh = |a: &Array| -> Result<[Array; 3]> {
                // A zero block quantizes to zero packed values, zero scales
                // and zero biases: the layout `init_quant` allocates.
                let per = 32 / self.q.bits;
                let d = a.shape()[3];
                let s = a.shape();
                Ok([
                    ops::zeros_dtype(&[s[0], s[1], steps as i32, d / per], Dtype::Uint32)?,
                    ops::zeros_dtype(
                        &[s[0], s[1], steps as i32, d / self.q.group_size],
                        a.dtype(),
                    )?,
                    ops::zeros_dtype(
                        &[s[0], s[1], steps as i32, d / self.q.group_size],
                        a.dtype(),
                    )?,
                ])
            };
            let (nk, nv) = (fresh(keys)?, fresh(values)?);
            match (self.keys.take(), self.values.take()) {
                (Some(mut k), Some(mut v)) => {
                    if !prev.is_multiple_of(KV_STEP) {
                        k = triple_prefix(&k, prev)?;
                        v = triple_prefix(&v, prev)?;
                    }
                    let grow = |old: [Array; 3], new: [Array; 3]| -> Result<[Array; 3]> {
                        let [a, b, c] = old;
                        let [x, y, z] = new;
                        Ok([
                            ops::concatenate(&[a, x], 2)?,
                            ops::concatenate(&[b, y], 2)?,
                            ops::concatenate(&[c, z], 2)?,
                        ])
                    };
                    self.keys = Some(grow(k, nk)?);
                    self.values = Some(grow(v, nv)?);
                }
                _ => {
                    self.keys = Some(nk);
                    self.values = Some(nv);
                }
            }
        }
        self.offset += t;
        let (p, o) = (prev as i32, self.offset as i32);
        let (qk, qv) = (quantize(keys, &self.q)?, quantize(values, &self.q)?);
        let (k, v) = (
            self.keys.as_mut().expect("allocated above"),
            self.values.as_mut().expect("allocated above"),
        );
        for i in 0..3 {
            k[i].try_index_mut((.., .., p..o, ..), &qk[i])?;
            v[i].try_index_mut((.., .., p..o, ..), &qv[i])?;
        }
        let (k, v) = (k.clone(), v.clone());
        let (keys, values) = if self.offset < rows(&k[0]) {
            (
                triple_prefix(&k, self.offset)?,
                triple_prefix(&v, self.offset)?,
            )
        } else {
            (k, v)
        };
        Ok(KvRead::Quantized {
            keys,
            values,
            quantization: self.q,
        })
    }

    fn dequantized(&self, t: &[Array; 3]) -> Result<Array> {
        Ok(ops::dequantize(
            &t[0],
            &t[1],
            &t[2],
            self.q.group_size,
            self.q.bits,
        )?)
    }
}

impl KvAccess for QuantizedKvCache {
    fn offset(&self) -> usize {
        self.offset
    }

    /// Keys and values in full precision (dequantized after the switch),
    /// for readers other than attention.
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        match self.update_and_read(keys, values)? {
            KvRead::Dense { keys, values } => Ok((keys, values)),
            KvRead::Quantized { keys, values, .. } => {
                Ok((self.dequantized(&keys)?, self.dequantized(&values)?))
            }
        }
    }

    fn update_and_read(&mut self, keys: &Array, values: &Array) -> Result<KvRead> {
        self.check_head_dim(keys, values)?;
        if self.offset > 0 && self.offset >= self.q.start {
            self.switch()?;
        }
        match self.dense.as_mut() {
            Some(d) => {
                let r = d.update_and_read(keys, values);
                self.offset = KvAccess::offset(d);
                r
            }
            None => self.write_quantized(keys, values),
        }
    }

    fn mask(&self, n: usize) -> Result<AttentionMask> {
        Ok(full_cache_mask(n))
    }
}

impl Cache for QuantizedKvCache {
    kv_cache_basics!("quantized_kv", offset, trimmable);
    fn trim(&mut self, n: usize) -> usize {
        let n = match self.dense.as_mut() {
            Some(d) => d.trim(n),
            None => n.min(self.offset),
        };
        self.offset -= n;
        n
    }
    fn nbytes(&self) -> usize {
        let triple = |t: &Option<[Array; 3]>| t.iter().flatten().map(Array::nbytes).sum::<usize>();
        self.dense.as_ref().map(Cache::nbytes).unwrap_or(0)
            + triple(&self.keys)
            + triple(&self.values)
    }
    fn box_clone(&self) -> Box<dyn Cache> {
        Box::new(self.clone())
    }
    fn select_rows(&mut self, rows: &[i32]) -> Result<()> {
        if let Some(d) = self.dense.as_mut() {
            return d.select_rows(rows);
        }
        let idx = Array::from_slice(rows, &[rows.len() as i32]);
        for t in [&mut self.keys, &mut self.values].into_iter().flatten() {
            for a in t.iter_mut() {
                *a = a.take_axis(&idx, 0)?;
            }
        }
        Ok(())
    }
    fn to_tensors(&self) -> CacheTensors {
        let mut meta = BTreeMap::from([
            ("bits".to_owned(), self.q.bits.to_string()),
            ("group_size".to_owned(), self.q.group_size.to_string()),
            ("start".to_owned(), self.q.start.to_string()),
            (
                "quantized".to_owned(),
                u8::from(self.is_quantized()).to_string(),
            ),
        ]);
        if let Some(d) = &self.dense {
            let mut t = d.to_tensors();
            t.meta.append(&mut meta);
            return t;
        }
        let mut arrays = BTreeMap::new();
        for (name, t) in [("keys", &self.keys), ("values", &self.values)] {
            if let Some(t) = t {
                for (i, a) in t.iter().enumerate() {
                    if let Ok(a) = a.try_index((.., .., ..(self.offset as i32), ..)) {
                        arrays.insert(format!("{name}.{i}"), a);
                    }
                }
            }
        }
        meta.insert("offset".to_owned(), self.offset.to_string());
        CacheTensors { arrays, meta }
    }
}
