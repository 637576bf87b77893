//! Fixed-size caches: recurrent state and convolution windows.
//!
//! These never grow with the sequence, so they pass through compiled decode
//! segments as plain inputs and outputs. They cannot be trimmed (the state
//! after token `t` does not reveal the state after `t - 1`); prefix reuse
//! restores snapshots instead (see [`crate::prompt`]).
//!
//! | kind          | arrays                                                     |
//! |---------------|------------------------------------------------------------|
//! | `gated_delta` | conv window `[B, K-1, C]`, recurrent state `[B, Hv, Dv, Dk]` (f32) |
//! | `mamba2`      | conv window `[B, K-1, C]`, SSM state `[B, H, Dh, Ds]` (f32) |
//! | `conv_window` | one window `[B, K-1, C_i]` per canon position (A, B(q,k,v), C, D) |

use mlex_core::cache::{Cache, CacheTensors};
use mlex_core::error::{Error, Result};
use mlex_core::layer::State;
use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::{ops, Array, Dtype};
use std::collections::BTreeMap;

/// A cache of fixed-size arrays.
#[derive(Clone, Debug)]
pub struct StateCache {
    kind: &'static str,
    arrays: Vec<Array>,
    names: Vec<String>,
    offset: usize,
}

/// Shape and dtype of one state array.
#[derive(Clone, Debug)]
pub struct StateSpec {
    /// Name used when saving (`conv`, `state`, `A`, `Bq`, ...).
    pub name: String,
    /// Shape.
    pub shape: Vec<i32>,
    /// Dtype.
    pub dtype: Dtype,
}

impl StateSpec {
    /// A spec.
    pub fn new(name: &str, shape: &[i32], dtype: Dtype) -> Self {
        Self {
            name: name.to_owned(),
            shape: shape.to_vec(),
            dtype,
        }
    }
}

impl StateCache {
    /// Zero-filled state of the given kind and specs.
    pub fn zeros(kind: &'static str, specs: &[StateSpec]) -> Result<Self> {
        let mut arrays = Vec::with_capacity(specs.len());
        for s in specs {
            arrays.push(ops::zeros_dtype(&s.shape, s.dtype)?);
        }
        Ok(Self {
            kind,
            arrays,
            names: specs.iter().map(|s| s.name.clone()).collect(),
            offset: 0,
        })
    }

    /// A recurrent mixer's caches (`kind`: `gated_delta`, `mamba2`): its
    /// conv window `[B, K-1, C]` in the activations' `dtype` and its state
    /// `[B, ...state]` in float32 (Gated DeltaNet `[Hv, Dv, Dk]`, Mamba2
    /// `[H, Dh, Ds]`).
    pub fn recurrent(
        kind: &'static str,
        batch: usize,
        (kernel, conv_dim): (i32, i32),
        state: [i32; 3],
        dtype: Dtype,
    ) -> Result<Self> {
        let b = batch as i32;
        let [s0, s1, s2] = state;
        Self::zeros(
            kind,
            &[
                StateSpec::new("conv", &[b, kernel - 1, conv_dim], dtype),
                StateSpec::new("state", &[b, s0, s1, s2], Dtype::Float32),
            ],
        )
    }

    /// Convolution windows, one per `(name, channels)`, each `[B, K-1, C]`.
    pub fn conv_windows(
        batch: usize,
        kernel: i32,
        windows: &[(&str, i32)],
        dtype: Dtype,
    ) -> Result<Self> {
        let specs: Vec<StateSpec> = windows
            .iter()
            .map(|(n, c)| StateSpec::new(n, &[batch as i32, kernel - 1, *c], dtype))
            .collect();
        Self::zeros("conv_window", &specs)
    }

    /// Rebuilds a saved cache of `kind`.
    pub fn from_tensors(kind: &'static str, t: &CacheTensors) -> Result<Self> {
        let names: Vec<String> = t
            .meta
            .get("names")
            .map(|s| s.split(',').map(str::to_owned).collect())
            .ok_or_else(|| Error::Cache("saved state cache lacks `names`".into()))?;
        let arrays = names
            .iter()
            .map(|n| {
                t.arrays
                    .get(n)
                    .cloned()
                    .ok_or_else(|| Error::Cache(format!("saved state cache lacks array `{n}`")))
            })
            .collect::<Result<Vec<_>>>()?;
        let offset = t
            .meta
            .get("offset")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Error::Cache("saved state cache lacks `offset`".into()))?;
        Ok(Self {
            kind,
            arrays,
            names,
            offset,
        })
    }
}

impl Cache for StateCache {
    fn kind(&self) -> &'static str {
        self.kind
    }
    fn offset(&self) -> usize {
        self.offset
    }
    fn grows(&self) -> bool {
        false
    }
    fn state(&self) -> Vec<Array> {
        self.arrays.clone()
    }
    fn set_state(&mut self, state: Vec<Array>) -> Result<()> {
        if state.len() != self.arrays.len() {
            return Err(Error::Cache(format!(
                "{} cache holds {} arrays, got {}",
                self.kind,
                self.arrays.len(),
                state.len()
            )));
        }
        for (old, new) in self.arrays.iter().zip(&state) {
            if old.shape() != new.shape() {
                return Err(Error::Cache(format!(
                    "{} state shape changed from {:?} to {:?}",
                    self.kind,
                    old.shape(),
                    new.shape()
                )));
            }
        }
        self.arrays = state;
        Ok(())
    }
    fn advance(&mut self, n: usize) {
        self.offset += n;
    }
    fn nbytes(&self) -> usize {
        self.arrays.iter().map(Array::nbytes).sum()
    }
    fn box_clone(&self) -> Box<dyn Cache> {
        Box::new(self.clone())
    }
    fn select_rows(&mut self, rows: &[i32]) -> Result<()> {
        let idx = Array::from_slice(rows, &[rows.len() as i32]);
        for a in &mut self.arrays {
            *a = a.take_axis(&idx, 0)?;
        }
        Ok(())
    }
    fn write_row(&mut self, row: usize, from: &dyn Cache) -> Result<()> {
        let src = from.state();
        if from.kind() != self.kind || src.len() != self.arrays.len() {
            return Err(Error::Cache(format!(
                "a `{}` batch row cannot take a `{}` cache",
                self.kind,
                from.kind()
            )));
        }
        let r = row as i32;
        for (dst, s) in self.arrays.iter_mut().zip(&src) {
            if s.shape()[0] != 1 || s.shape()[1..] != dst.shape()[1..] || r >= dst.shape()[0] {
                return Err(Error::Cache(format!(
                    "{} state {:?} does not fit row {row} of {:?}",
                    self.kind,
                    s.shape(),
                    dst.shape()
                )));
            }
            // A fresh array: the old one may be shared with a snapshot.
            let mut next = dst.clone();
            next.try_index_mut(r..r + 1, s)?;
            *dst = next;
        }
        Ok(())
    }
    fn add_rows(&mut self, n: usize) -> Result<()> {
        for a in &mut self.arrays {
            let mut shape = a.shape().to_vec();
            shape[0] = n as i32;
            let z = ops::zeros_dtype(&shape, a.dtype())?;
            *a = ops::concatenate(&[&*a, &z], 0)?;
        }
        Ok(())
    }
    fn to_tensors(&self) -> CacheTensors {
        CacheTensors {
            arrays: self
                .names
                .iter()
                .cloned()
                .zip(self.arrays.iter().cloned())
                .collect(),
            meta: BTreeMap::from([
                ("offset".to_owned(), self.offset.to_string()),
                ("names".to_owned(), self.names.join(",")),
            ]),
        }
    }
}

/// One step of a causal convolution window, pure (usable inside compiled
/// segments): given the window of the last `K-1` inputs `[B, K-1, C]` and
/// `T` new inputs `[B, T, C]`, returns the padded input the convolution
/// reads, `[B, K-1+T, C]`, and the new window (its last `K-1` rows).
///
/// After a prompt (`T` > `K-1`) the window is gathered into a buffer of its
/// own. A slice made contiguous may share its parent's buffer (MLX does so
/// when the parent is at most 16 KB larger), so at small widths each window
/// kept in a cache or a prompt-cache snapshot would hold the prompt's whole
/// padded input, uncounted by its byte size. One decode token keeps the
/// view: its parent is one row longer than the window.
pub fn conv_window_step(window: &Array, x: &Array) -> Result<(Array, Array)> {
    let keep = window.shape()[1];
    let padded = ops::concatenate(&[window, x], 1)?;
    let total = padded.shape()[1];
    let next = if total > 2 * keep {
        let rows = ops::arange::<_, i32>(total - keep, total, None)?;
        padded.take_axis(&rows, 1)?
    } else {
        padded.try_index((.., (total - keep).., ..))?.contiguous()?
    };
    Ok((padded, next))
}

/// The window of `keep` rows after each of the `T` new positions of a
/// padded input `[B, keep+T, C]`, as `[T, B, keep, C]`: the window after
/// position `j` (0-based) is rows `j+1 ..= j+keep`. A strided view of the
/// padded input (the windows overlap), not a gather: in a verify forward
/// that is one kernel fewer a recurrent layer, and what a commit keeps is
/// one entry of it, a few rows more than a decode step's window keeps.
pub fn windows_after_each(padded: &Array, keep: i32) -> Result<Array> {
    let s = padded.shape();
    let (b, len, c) = (s[0], s[1], s[2]);
    let t = len - keep;
    let (row, seq) = (c as i64, (len * c) as i64);
    // MLX flattens the input first (a copy only if it is not row-major),
    // so the strides are those of a row-major `[B, keep+T, C]`.
    Ok(ops::as_strided(
        padded,
        &[t, b, keep, c][..],
        &[row, seq, row, 1][..],
        c as usize,
    )?)
}

/// [`conv_window_step`] on array `i` of a layer's state: writes the new
/// window (or, in a verify run, the window after every position,
/// `[T, B, K-1, C]`) and returns the padded input the convolution reads.
pub fn conv_window_into(state: &mut State<'_>, i: usize, x: &Array) -> Result<Array> {
    let (padded, next) = conv_window_step(&state[i], x)?;
    if state.keeps_positions() {
        state.set_positions(i, windows_after_each(&padded, state[i].shape()[1])?)?;
    } else {
        state[i] = next;
    }
    Ok(padded)
}
