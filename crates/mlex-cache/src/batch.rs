//! The key/value cache of a batch of sequences at different positions.
//!
//! [`BatchKvCache`] holds `rows` sequences (slots) in one buffer
//! `[rows, H, capacity, D]`, **left-padded**: every row's newest token sits
//! in the same column, so a decode step writes one column for the whole
//! batch with one `slice_update`, and SDPA reads one rectangle. Row `r`'s
//! tokens occupy columns `left_pad[r] .. idx`; attention masks the columns
//! before `left_pad[r]` and RoPE rotates row `r` at its own position
//! `idx - left_pad[r]` ([`KvAccess::positions`]), so every row computes
//! exactly what it would alone.
//!
//! Rows are slots: a sequence that leaves frees its row without copying the
//! buffer (the row then sees only its newest column, so its attention stays
//! finite while it idles); a new sequence is written into a free row. When
//! a newcomer is longer than `idx`, every row shifts right (one copy). The
//! columns every row masks are dropped when the batch is compacted
//! ([`BatchKvCache::select_rows`]). mlx-lm's `BatchKVCache` uses the same
//! left-padded layout but filters rows (a copy) on every departure.

use crate::kv::KV_STEP;
use mlex_core::cache::{AttentionMask, Cache, CacheTensors, KvAccess};
use mlex_core::error::{Error, Result};
use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::{ops, Array};
use std::collections::BTreeMap;

/// A left-padded key/value cache of `rows` slots.
#[derive(Clone, Debug)]
pub struct BatchKvCache {
    keys: Option<Array>,
    values: Option<Array>,
    left_pad: Vec<usize>,
    free: Vec<bool>,
    idx: usize,
}

impl BatchKvCache {
    /// An empty cache of `rows` free slots.
    pub fn new(rows: usize) -> Self {
        Self {
            keys: None,
            values: None,
            left_pad: vec![0; rows],
            free: vec![true; rows],
            idx: 0,
        }
    }

    /// Slots.
    pub fn rows(&self) -> usize {
        self.left_pad.len()
    }

    /// Columns written (the shared column of every row's next token).
    pub fn columns(&self) -> usize {
        self.idx
    }

    /// Tokens held by row `r`.
    pub fn row_len(&self, r: usize) -> usize {
        self.idx - self.left_pad[r]
    }

    fn capacity(&self) -> usize {
        self.keys
            .as_ref()
            .map(|k| k.shape()[2] as usize)
            .unwrap_or(0)
    }

    /// Columns at the front that every used row masks.
    fn masked_front(&self) -> usize {
        self.left_pad
            .iter()
            .zip(&self.free)
            .filter(|(_, f)| !**f)
            .map(|(p, _)| *p)
            .min()
            .unwrap_or(self.idx)
    }

    /// Reallocates the buffers: drops the columns every used row masks
    /// (when `drop_masked`), leaves `shift` empty columns on the left, and
    /// makes room for `extra` more columns after the kept ones.
    fn relayout(
        &mut self,
        like_k: &Array,
        like_v: &Array,
        drop_masked: bool,
        shift: usize,
        extra: usize,
    ) -> Result<()> {
        let drop = if drop_masked { self.masked_front() } else { 0 };
        let kept = self.idx - drop;
        let need = shift + kept + extra;
        let cap = need.div_ceil(KV_STEP).max(1) * KV_STEP;
        let rows = self.rows() as i32;
        let zeros = |like: &Array| -> Result<Array> {
            let s = like.shape();
            Ok(ops::zeros_dtype(
                &[rows, s[1], cap as i32, s[3]],
                like.dtype(),
            )?)
        };
        let (mut nk, mut nv) = (zeros(like_k)?, zeros(like_v)?);
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            if kept > 0 {
                let (from, to) = (shift as i32, (shift + kept) as i32);
                let (a, b) = (drop as i32, self.idx as i32);
                nk.try_index_mut((.., .., from..to, ..), k.try_index((.., .., a..b, ..))?)?;
                nv.try_index_mut((.., .., from..to, ..), v.try_index((.., .., a..b, ..))?)?;
            }
        }
        self.keys = Some(nk);
        self.values = Some(nv);
        for p in &mut self.left_pad {
            *p = (*p).max(drop) - drop + shift;
        }
        self.idx = kept + shift;
        Ok(())
    }

    /// Writes one sequence's keys and values (`[1, H, L, D]`, its whole
    /// history) into slot `row`; its next token goes in the shared column.
    pub fn write_row(&mut self, row: usize, keys: &Array, values: &Array) -> Result<()> {
        if row >= self.rows() {
            return Err(Error::Cache(format!(
                "batch row {row} out of range ({} rows)",
                self.rows()
            )));
        }
        if keys.ndim() != 4 || keys.shape()[0] != 1 {
            return Err(Error::Cache(format!(
                "a batch row takes [1, H, L, D] keys, got {:?}",
                keys.shape()
            )));
        }
        let len = keys.shape()[2] as usize;
        // Row `row` is about to be replaced: it no longer holds columns.
        self.free[row] = true;
        let kept = self.idx - self.masked_front();
        // Joining is where the columns of departed sequences are dropped
        // (a copy, so only once a step's worth has piled up).
        let stale = kept + KV_STEP <= self.idx;
        if self.keys.is_none() || len > self.idx || self.idx + 1 > self.capacity() || stale {
            self.relayout(keys, values, true, len.saturating_sub(kept), 1)?;
        }
        let (from, to) = ((self.idx - len) as i32, self.idx as i32);
        let r = row as i32;
        self.keys
            .as_mut()
            .expect("allocated above")
            .try_index_mut((r..r + 1, .., from..to, ..), keys)?;
        self.values
            .as_mut()
            .expect("allocated above")
            .try_index_mut((r..r + 1, .., from..to, ..), values)?;
        self.left_pad[row] = self.idx - len;
        self.free[row] = false;
        Ok(())
    }

    /// Frees slot `row`: from the next step on it attends only to its own
    /// newest column (kept finite, ignored by the engine).
    pub fn free_row(&mut self, row: usize) {
        if let Some(f) = self.free.get_mut(row) {
            *f = true;
        }
    }

    /// Row `r`'s first visible column: a free row sees only the newest.
    fn pad(&self, r: usize) -> usize {
        if self.free[r] {
            self.idx
        } else {
            self.left_pad[r]
        }
    }

    /// Appends `n` free slots.
    pub fn add_rows(&mut self, n: usize) -> Result<()> {
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            let zk = {
                let s = k.shape();
                ops::zeros_dtype(&[n as i32, s[1], s[2], s[3]], k.dtype())?
            };
            let zv = {
                let s = v.shape();
                ops::zeros_dtype(&[n as i32, s[1], s[2], s[3]], v.dtype())?
            };
            self.keys = Some(ops::concatenate(&[k, &zk], 0)?);
            self.values = Some(ops::concatenate(&[v, &zv], 0)?);
        }
        self.left_pad.extend(std::iter::repeat_n(self.idx, n));
        self.free.extend(std::iter::repeat_n(true, n));
        Ok(())
    }

    fn pad_array(&self) -> Array {
        let pads: Vec<i32> = (0..self.rows()).map(|r| self.pad(r) as i32).collect();
        Array::from_slice(&pads, &[pads.len() as i32, 1, 1, 1])
    }
}

impl KvAccess for BatchKvCache {
    fn offset(&self) -> usize {
        self.idx
    }

    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let t = keys.shape()[2] as usize;
        if keys.shape()[0] as usize != self.rows() {
            return Err(Error::Cache(format!(
                "batched cache of {} rows written with {} rows",
                self.rows(),
                keys.shape()[0]
            )));
        }
        if self.keys.is_none() || self.idx + t > self.capacity() {
            // Keep every column: the mask and positions of this step were
            // taken before the write.
            self.relayout(keys, values, false, 0, t)?;
        }
        let (p, o) = (self.idx as i32, (self.idx + t) as i32);
        self.idx += t;
        let k = self.keys.as_mut().expect("allocated above");
        k.try_index_mut((.., .., p..o, ..), keys)?;
        let v = self.values.as_mut().expect("allocated above");
        v.try_index_mut((.., .., p..o, ..), values)?;
        Ok((
            k.try_index((.., .., ..o, ..))?,
            v.try_index((.., .., ..o, ..))?,
        ))
    }

    fn mask(&self, n: usize) -> Result<AttentionMask> {
        if n == 1 && (0..self.rows()).all(|r| self.pad(r) == 0) {
            return Ok(AttentionMask::None);
        }
        // Query i of row r (at column idx + i) sees columns left_pad[r]..=idx+i.
        let cols = ops::arange::<_, i32>(0, (self.idx + n) as i32, None)?;
        let cols = ops::reshape(&cols, &[1, 1, 1, -1])?;
        let visible = ops::ge(&cols, self.pad_array())?;
        if n == 1 {
            return Ok(AttentionMask::Array(visible));
        }
        let q = ops::arange::<_, i32>(self.idx as i32, (self.idx + n) as i32, None)?;
        let causal = ops::le(&cols, ops::reshape(&q, &[1, 1, -1, 1])?)?;
        Ok(AttentionMask::Array(ops::logical_and(&visible, &causal)?))
    }

    fn positions(&self) -> Result<Option<Array>> {
        let pos: Vec<i32> = (0..self.rows())
            .map(|r| (self.idx - self.pad(r)) as i32)
            .collect();
        Ok(Some(Array::from_slice(&pos, &[pos.len() as i32])))
    }
}

impl Cache for BatchKvCache {
    fn kind(&self) -> &'static str {
        "batch_kv"
    }
    fn offset(&self) -> usize {
        self.idx
    }
    fn grows(&self) -> bool {
        true
    }
    fn as_kv(&mut self) -> Option<&mut dyn KvAccess> {
        Some(self)
    }
    fn nbytes(&self) -> usize {
        self.keys.as_ref().map(Array::nbytes).unwrap_or(0)
            + self.values.as_ref().map(Array::nbytes).unwrap_or(0)
    }
    fn box_clone(&self) -> Box<dyn Cache> {
        Box::new(self.clone())
    }
    fn to_tensors(&self) -> CacheTensors {
        let mut arrays = BTreeMap::new();
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            arrays.insert("keys".to_owned(), k.clone());
            arrays.insert("values".to_owned(), v.clone());
        }
        let pads: Vec<String> = self.left_pad.iter().map(|p| p.to_string()).collect();
        CacheTensors {
            arrays,
            meta: BTreeMap::from([
                ("idx".to_owned(), self.idx.to_string()),
                ("left_pad".to_owned(), pads.join(",")),
            ]),
        }
    }

    /// Keeps slots `rows` and drops the columns that every kept row masks.
    fn select_rows(&mut self, rows: &[i32]) -> Result<()> {
        let mut pads = Vec::with_capacity(rows.len());
        let mut free = Vec::with_capacity(rows.len());
        for &r in rows {
            if r < 0 || r as usize >= self.rows() {
                return Err(Error::Cache(format!(
                    "batch row {r} out of range ({} rows)",
                    self.rows()
                )));
            }
            pads.push(self.left_pad[r as usize]);
            free.push(self.free[r as usize]);
        }
        self.left_pad = pads;
        self.free = free;
        let drop = self.masked_front();
        let idx = Array::from_slice(rows, &[rows.len() as i32]);
        for a in [&mut self.keys, &mut self.values].into_iter().flatten() {
            let kept = a.take_axis(&idx, 0)?;
            *a = if drop > 0 {
                kept.try_index((.., .., (drop as i32).., ..))?
            } else {
                kept
            };
        }
        for p in &mut self.left_pad {
            *p = (*p).max(drop) - drop;
        }
        self.idx -= drop;
        Ok(())
    }

    fn write_row(&mut self, row: usize, from: &dyn Cache) -> Result<()> {
        let t = from.to_tensors();
        match (t.arrays.get("keys"), t.arrays.get("values")) {
            (Some(k), Some(v)) if from.kind() == "kv" || from.kind() == "concat_kv" => {
                BatchKvCache::write_row(self, row, k, v)
            }
            _ => Err(Error::Cache(format!(
                "a batch row takes a `kv` cache holding tokens, not a `{}` cache",
                from.kind()
            ))),
        }
    }

    fn free_row(&mut self, row: usize) {
        BatchKvCache::free_row(self, row)
    }

    fn add_rows(&mut self, n: usize) -> Result<()> {
        BatchKvCache::add_rows(self, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(len: usize, base: f32) -> Array {
        let data: Vec<f32> = (0..len * 2).map(|i| base + i as f32).collect();
        Array::from_slice(&data, &[1, 1, len as i32, 2])
    }

    fn row(c: &BatchKvCache, r: usize) -> Vec<f32> {
        let (k, _) = (c.keys.clone().unwrap(), ());
        let from = c.pad(r) as i32;
        let part = k
            .try_index((r as i32..r as i32 + 1, .., from..c.idx as i32, ..))
            .unwrap();
        part.as_slice::<f32>().to_vec()
    }

    #[test]
    fn rows_keep_their_own_history_through_joins_shifts_and_compaction() {
        let mut c = BatchKvCache::new(3);
        c.write_row(0, &seq(2, 0.0), &seq(2, 0.0)).unwrap();
        // A longer newcomer shifts row 0 right.
        c.write_row(2, &seq(4, 100.0), &seq(4, 100.0)).unwrap();
        assert_eq!((c.columns(), c.row_len(0), c.row_len(2)), (4, 2, 4));
        assert_eq!(row(&c, 0), seq(2, 0.0).as_slice::<f32>());
        assert_eq!(row(&c, 2), seq(4, 100.0).as_slice::<f32>());
        let pos = c.positions().unwrap().unwrap();
        assert_eq!(pos.as_slice::<i32>(), &[2, 0, 4]);
        // One decode step for all rows.
        let step = Array::from_slice(&[7f32, 7., 8., 8., 9., 9.], &[3, 1, 1, 2]);
        c.update_and_fetch(&step, &step).unwrap();
        assert_eq!(row(&c, 0), [0., 1., 2., 3., 7., 7.]);
        assert_eq!(c.positions().unwrap().unwrap().as_slice::<i32>()[2], 5);
        // Row 2 leaves; compaction keeps row 0 and drops the columns it masks.
        BatchKvCache::free_row(&mut c, 2);
        c.select_rows(&[0]).unwrap();
        assert_eq!((c.rows(), c.columns(), c.row_len(0)), (1, 3, 3));
        assert_eq!(row(&c, 0), [0., 1., 2., 3., 7., 7.]);
        assert!(matches!(c.mask(1).unwrap(), AttentionMask::None));
    }

    #[test]
    fn the_mask_hides_each_rows_padding_only() {
        let mut c = BatchKvCache::new(2);
        c.write_row(0, &seq(1, 0.0), &seq(1, 0.0)).unwrap();
        c.write_row(1, &seq(3, 0.0), &seq(3, 0.0)).unwrap();
        let AttentionMask::Array(m) = c.mask(1).unwrap() else {
            panic!("a padded batch needs a mask")
        };
        assert_eq!(m.shape(), &[2, 1, 1, 4]);
        let m: Vec<bool> = m.as_slice::<bool>().to_vec();
        assert_eq!(m, [false, false, true, true, true, true, true, true]);
    }
}
