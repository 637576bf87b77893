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
//!
//! A batched speculative round writes the same `T` columns for every row
//! and each row keeps its own accepted prefix ([`Cache::trim_rows`]): the
//! shared column moves by the most any row kept, and a row that kept fewer
//! leaves *holes*, columns inside its span that its mask hides and its
//! RoPE position does not count. Holes cost attention work and memory
//! until the batch squeezes them out (one gather, when a row's holes pass
//! a quarter of the columns) or the row leaves.

use crate::kv::KV_STEP;
use mlex_core::cache::{AttentionMask, Cache, CacheTensors, KvAccess};
use mlex_core::error::{Error, Result};
use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::{ops, Array, Dtype};
use std::collections::BTreeMap;

/// A left-padded key/value cache of `rows` slots.
#[derive(Clone, Debug)]
pub struct BatchKvCache {
    keys: Option<Array>,
    values: Option<Array>,
    left_pad: Vec<usize>,
    free: Vec<bool>,
    idx: usize,
    /// `[rows, capacity]` bool, true where a column inside a row's span is
    /// hidden from it (a rejected speculative token); `None` while no row
    /// has any.
    holes: Option<Array>,
    /// Per row, the columns of its holes (ascending; the host's copy of
    /// `holes`).
    hole_cols: Vec<Vec<usize>>,
}

/// A row squeezes its holes out once it has at least this many (and a
/// quarter of the columns).
const SQUEEZE_MIN_HOLES: usize = 64;

impl BatchKvCache {
    /// An empty cache of `rows` free slots.
    pub fn new(rows: usize) -> Self {
        Self {
            keys: None,
            values: None,
            left_pad: vec![0; rows],
            free: vec![true; rows],
            idx: 0,
            holes: None,
            hole_cols: vec![Vec::new(); rows],
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

    /// Tokens held by row `r` (its holes not counted).
    pub fn row_len(&self, r: usize) -> usize {
        self.idx - self.left_pad[r] - self.hole_cols[r].len()
    }

    /// Columns inside row `r`'s span that it does not see.
    pub fn holes(&self, r: usize) -> usize {
        self.hole_cols[r].len()
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
        let mut nh = match &self.holes {
            Some(_) => Some(ops::zeros_dtype(&[rows, cap as i32], Dtype::Bool)?),
            None => None,
        };
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            if kept > 0 {
                let (from, to) = (shift as i32, (shift + kept) as i32);
                let (a, b) = (drop as i32, self.idx as i32);
                nk.try_index_mut((.., .., from..to, ..), k.try_index((.., .., a..b, ..))?)?;
                nv.try_index_mut((.., .., from..to, ..), v.try_index((.., .., a..b, ..))?)?;
                if let (Some(h), Some(nh)) = (&self.holes, nh.as_mut()) {
                    nh.try_index_mut((.., from..to), h.try_index((.., a..b))?)?;
                }
            }
        }
        self.keys = Some(nk);
        self.values = Some(nv);
        self.holes = nh;
        for p in &mut self.left_pad {
            *p = (*p).max(drop) - drop + shift;
        }
        for cols in &mut self.hole_cols {
            cols.retain(|&c| c >= drop);
            for c in cols.iter_mut() {
                *c = *c - drop + shift;
            }
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
        self.clear_holes(row)?;
        Ok(())
    }

    /// Row `row` has no holes from now on.
    fn clear_holes(&mut self, row: usize) -> Result<()> {
        if !self.hole_cols[row].is_empty() {
            if let Some(h) = self.holes.as_mut() {
                let r = row as i32;
                let width = h.shape()[1];
                h.try_index_mut(r..r + 1, ops::zeros_dtype(&[1, width], Dtype::Bool)?)?;
            }
        }
        self.hole_cols[row].clear();
        if self.hole_cols.iter().all(Vec::is_empty) {
            self.holes = None;
        }
        Ok(())
    }

    /// Drops the last `drop[r]` of the columns just written from row `r`
    /// (see the module docs): the shared column goes back by the fewest
    /// dropped, and the rest become holes of the rows that dropped more.
    fn trim_each(&mut self, drop: &[usize]) -> Result<()> {
        if drop.len() != self.rows() {
            return Err(Error::Cache(format!(
                "{} counts to drop for a batch of {} rows",
                drop.len(),
                self.rows()
            )));
        }
        let fewest = drop.iter().copied().min().unwrap_or(0);
        let most = drop.iter().copied().max().unwrap_or(0);
        if most > self.idx {
            return Err(Error::Cache(format!(
                "cannot drop {most} of {} columns",
                self.idx
            )));
        }
        self.idx -= fewest;
        // Holes at the dropped columns go (a later write reuses them).
        let idx = self.idx;
        if self.hole_cols.iter().flatten().any(|&c| c >= idx) {
            for cols in &mut self.hole_cols {
                cols.retain(|&c| c < idx);
            }
            if let Some(h) = self.holes.as_mut() {
                let width = h.shape()[1] - idx as i32;
                let z = ops::zeros_dtype(&[self.left_pad.len() as i32, width], Dtype::Bool)?;
                h.try_index_mut((.., idx as i32..), z)?;
            }
        }
        if most == fewest {
            return Ok(());
        }
        // Columns idx - (most - fewest) .. idx: row r hides the last
        // drop[r] - fewest of them.
        let width = most - fewest;
        let mut block = Vec::with_capacity(self.rows() * width);
        for (r, &d) in drop.iter().enumerate() {
            let hidden = if self.free[r] { 0 } else { d - fewest };
            block.extend((0..width).map(|j| j >= width - hidden));
            let first = self.idx - hidden;
            self.hole_cols[r].extend(first..self.idx);
        }
        let cap = self.capacity() as i32;
        let holes = match self.holes.take() {
            Some(h) => h,
            None => ops::zeros_dtype(&[self.rows() as i32, cap], Dtype::Bool)?,
        };
        let mut holes = holes;
        let (a, b) = ((self.idx - width) as i32, self.idx as i32);
        holes.try_index_mut(
            (.., a..b),
            Array::from_slice(&block, &[self.rows() as i32, width as i32]),
        )?;
        self.holes = Some(holes);
        let worst = self.hole_cols.iter().map(Vec::len).max().unwrap_or(0);
        if worst >= SQUEEZE_MIN_HOLES && 4 * worst >= self.idx {
            self.squeeze()?;
        }
        Ok(())
    }

    /// Moves every row's visible columns together, right-aligned at the
    /// shared column (one gather of the buffers): no holes are left.
    fn squeeze(&mut self) -> Result<()> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(());
        };
        let rows = self.rows();
        let mut spans: Vec<Vec<i32>> = Vec::with_capacity(rows);
        for r in 0..rows {
            let from = self.pad(r);
            let holes = &self.hole_cols[r];
            spans.push(
                (from..self.idx)
                    .filter(|c| holes.binary_search(c).is_err())
                    .map(|c| c as i32)
                    .collect(),
            );
        }
        let width = spans.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let new_cap = (width + 1).div_ceil(KV_STEP) * KV_STEP;
        // Row r: its columns right-aligned, column 0 repeated in front
        // (masked by the new left pad).
        let mut idx = Vec::with_capacity(rows * new_cap);
        for span in &spans {
            idx.extend(std::iter::repeat_n(0, width - span.len()));
            idx.extend(span);
            idx.extend(std::iter::repeat_n(0, new_cap - width));
        }
        let idx = Array::from_slice(&idx, &[rows as i32, 1, new_cap as i32, 1]);
        let nk = k.take_along_axis(&idx, 2)?;
        let nv = v.take_along_axis(&idx, 2)?;
        for (r, span) in spans.iter().enumerate() {
            if !self.free[r] {
                self.left_pad[r] = width - span.len();
            }
        }
        for r in 0..rows {
            if self.free[r] {
                self.left_pad[r] = width;
            }
        }
        self.keys = Some(nk);
        self.values = Some(nv);
        self.idx = width;
        self.holes = None;
        self.hole_cols = vec![Vec::new(); rows];
        Ok(())
    }

    /// Frees slot `row`: from the next step on it attends only to its own
    /// newest column (kept finite, ignored by the engine).
    pub fn free_row(&mut self, row: usize) {
        if let Some(f) = self.free.get_mut(row) {
            *f = true;
        }
        // Its holes no longer matter: it sees only the newest column.
        if row < self.rows() {
            let _ = self.clear_holes(row);
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
        if let Some(h) = &self.holes {
            let z = ops::zeros_dtype(&[n as i32, h.shape()[1]], Dtype::Bool)?;
            self.holes = Some(ops::concatenate(&[h, &z], 0)?);
        }
        self.left_pad.extend(std::iter::repeat_n(self.idx, n));
        self.free.extend(std::iter::repeat_n(true, n));
        self.hole_cols.extend(std::iter::repeat_n(Vec::new(), n));
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
        if n == 1 && self.holes.is_none() && (0..self.rows()).all(|r| self.pad(r) == 0) {
            return Ok(AttentionMask::None);
        }
        // Query i of row r (at column idx + i) sees columns left_pad[r]..=idx+i.
        let cols = ops::arange::<_, i32>(0, (self.idx + n) as i32, None)?;
        let cols = ops::reshape(&cols, &[1, 1, 1, -1])?;
        let mut visible = ops::ge(&cols, self.pad_array())?;
        if let Some(h) = &self.holes {
            let rows = self.rows() as i32;
            // Holes lie before `idx`; a window past the buffers' end (they
            // grow on the write, after this mask) has none beyond them.
            let upto = (self.idx + n).min(h.shape()[1] as usize) as i32;
            let mut seen = ops::logical_not(h.try_index((.., ..upto))?)?;
            let beyond = (self.idx + n) as i32 - upto;
            if beyond > 0 {
                let new = ops::ones_dtype(&[rows, beyond], Dtype::Bool)?;
                seen = ops::concatenate(&[&seen, &new], 1)?;
            }
            let seen = ops::reshape(&seen, &[rows, 1, 1, -1])?;
            visible = ops::logical_and(&visible, &seen)?;
        }
        if n == 1 {
            return Ok(AttentionMask::Array(visible));
        }
        let q = ops::arange::<_, i32>(self.idx as i32, (self.idx + n) as i32, None)?;
        let causal = ops::le(&cols, ops::reshape(&q, &[1, 1, -1, 1])?)?;
        Ok(AttentionMask::Array(ops::logical_and(&visible, &causal)?))
    }

    fn positions(&self) -> Result<Option<Array>> {
        let pos: Vec<i32> = (0..self.rows())
            .map(|r| (self.idx - self.pad(r)).saturating_sub(self.hole_cols[r].len()) as i32)
            .collect();
        Ok(Some(Array::from_slice(&pos, &[pos.len() as i32])))
    }
}

impl Cache for BatchKvCache {
    kv_cache_basics!("batch_kv", idx);
    kv_arrays!();
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
        let cols: Vec<Vec<usize>> = rows
            .iter()
            .map(|&r| self.hole_cols[r as usize].clone())
            .collect();
        self.left_pad = pads;
        self.free = free;
        self.hole_cols = cols;
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
        for cols in &mut self.hole_cols {
            cols.retain(|&c| c >= drop);
            for c in cols.iter_mut() {
                *c -= drop;
            }
        }
        if let Some(h) = self.holes.take() {
            let kept = h.take_axis(&idx, 0)?;
            if self.hole_cols.iter().any(|c| !c.is_empty()) {
                self.holes = Some(if drop > 0 {
                    kept.try_index((.., (drop as i32)..))?
                } else {
                    kept
                });
            }
        }
        for p in &mut self.left_pad {
            *p = (*p).max(drop) - drop;
        }
        self.idx -= drop;
        Ok(())
    }

    fn is_trimmable(&self) -> bool {
        true
    }

    fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.idx);
        match self.trim_each(&vec![n; self.rows()]) {
            Ok(()) => n,
            Err(_) => 0,
        }
    }

    fn trim_rows(&mut self, drop: &[usize]) -> Result<()> {
        self.trim_each(drop)
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
mod tests;
