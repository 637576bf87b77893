//! GGUF tensors on their way to the weight map, read on demand.
//!
//! A [`Tensor`] is either read already or still only its place in the file
//! with the row and column reorders llama.cpp's layout needs undone
//! ([`Tensor::rows`], [`Tensor::column_blocks`]). [`Tensor::put`] hands a
//! lazy one to the [`WeightMap`] as a [`PartReader`]: the model loader
//! reads it whole, or, on a `--tp` rank, only the file rows and blocks of
//! its part (mapped back through the reorders), so a rank reads about
//! 1/N of a GGUF file as it does of safetensors. A quantized tensor's
//! packed weights, scales and biases come from the same blocks: the last
//! part decoded is kept for the next of the three.

use super::bad;
use crate::gguf_file::{self, GgmlType, TensorData, TensorInfo};
use mlex_core::error::{Error, Result};
use mlex_core::weights::{PartReader, WeightMap};
use mlx_rs::{ops, Array, Dtype};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A GGUF tensor: read, or still in the file ([`Lazy`]).
#[derive(Clone, Debug)]
pub(super) enum Tensor {
    Ready(TensorData),
    Lazy(Lazy),
}

/// A tensor of the file not read yet, and the reorders to apply.
#[derive(Clone, Debug)]
pub(super) struct Lazy {
    src: Arc<Source>,
    /// Row `i` of the output-row axis (the second-to-last) is file row
    /// `rows[i]`.
    rows: Option<Arc<Vec<i32>>>,
    /// Column `j` of the last axis is file column `cols[j]` (whole
    /// quantization groups for a quantized type).
    cols: Option<Arc<Vec<i32>>>,
}

/// Per axis, the file indices to read in output order (`None`: all).
type Selection = Vec<Option<Vec<i32>>>;

#[derive(Debug)]
struct Source {
    path: PathBuf,
    info: TensorInfo,
    last: Mutex<Option<(Selection, TensorData)>>,
}

/// The bits of a type that becomes MLX affine weights (group 32), and
/// whether its scales are float16 (else float32).
fn affine(ty: GgmlType) -> Option<(i32, bool)> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => Some((4, true)),
        GgmlType::Q8_0 => Some((8, true)),
        GgmlType::Q4K => Some((4, false)),
        GgmlType::Q5K => Some((5, false)),
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::Q6K => None,
    }
}

/// The dtype a type that stays dense becomes.
fn dense_dtype(ty: GgmlType) -> Dtype {
    match ty {
        GgmlType::F32 => Dtype::Float32,
        GgmlType::Bf16 => Dtype::Bfloat16,
        _ => Dtype::Float16,
    }
}

/// The index list of a selection axis: `sel` through `map` (either may be
/// absent: all, or no reorder).
fn through(sel: Option<Vec<i32>>, map: Option<&Arc<Vec<i32>>>) -> Option<Vec<i32>> {
    match (sel, map) {
        (s, None) => s,
        (None, Some(m)) => Some(m.to_vec()),
        (Some(s), Some(m)) => Some(s.iter().map(|&i| m[i as usize]).collect()),
    }
}

/// An error naming tensor `name` when `idx` is not rows of its output axis
/// (the second-to-last; the only axis of a 1-D tensor), or with `whole`,
/// not a reordering of every row: MLX's gather does not check.
fn check_rows(shape: &[i32], idx: &[i32], whole: bool, name: &str, path: &Path) -> Result<()> {
    let n = shape[shape.len().saturating_sub(2).min(shape.len() - 1)];
    if idx.iter().any(|&i| i < 0 || i >= n) || (whole && idx.len() != n as usize) {
        return Err(bad(
            path,
            format!(
                "tensor `{name}` has {n} rows along its output axis (shape {shape:?}); the metadata's head counts and sizes need {}",
                idx.len()
            ),
        ));
    }
    Ok(())
}

/// The columns of blocks of `width` in the order `perm`: block `b` is
/// block `perm[b]`.
fn spread(perm: &[i32], width: i32) -> Vec<i32> {
    perm.iter()
        .flat_map(|&p| (0..width).map(move |d| p * width + d))
        .collect()
}

/// Runs of consecutive values: `(first, count)`.
fn runs(v: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &x in v {
        match out.last_mut() {
            Some((s, n)) if *s + *n == x => *n += 1,
            _ => out.push((x, 1)),
        }
    }
    out
}

impl Tensor {
    /// Tensor `info` of the GGUF file `path`, not read yet.
    pub(super) fn open(path: &Path, info: &TensorInfo) -> Tensor {
        Tensor::Lazy(Lazy {
            src: Arc::new(Source {
                path: path.to_owned(),
                info: info.clone(),
                last: Mutex::new(None),
            }),
            rows: None,
            cols: None,
        })
    }

    /// Its logical shape (unpacked).
    pub(super) fn shape(&self) -> Vec<i32> {
        match self {
            Tensor::Ready(t) => t.shape(),
            Tensor::Lazy(l) => l.shape(),
        }
    }

    /// The tensor, read (whole) if it was not.
    pub(super) fn ready(&self) -> Result<TensorData> {
        match self {
            Tensor::Ready(t) => Ok(t.clone()),
            Tensor::Lazy(l) => l.decode(&l.selection(None)),
        }
    }

    /// Float32 values.
    pub(super) fn dense(&self) -> Result<Array> {
        self.ready()?.dense()
    }

    /// A dense value transform (see [`TensorData::map`]).
    pub(super) fn map(&self, f: impl FnOnce(Array) -> Result<Array>) -> Result<Tensor> {
        Ok(Tensor::Ready(self.ready()?.map(f)?))
    }

    /// Gathers output rows (see [`TensorData::rows`]); a lazy matrix only
    /// notes the reorder.
    pub(super) fn rows(&self, idx: &[i32], whole: bool, name: &str, path: &Path) -> Result<Tensor> {
        let shape = self.shape();
        check_rows(&shape, idx, whole, name, path)?;
        match self {
            Tensor::Lazy(l) if shape.len() >= 2 => {
                let rows = through(Some(idx.to_vec()), l.rows.as_ref()).map(Arc::new);
                Ok(Tensor::Lazy(Lazy { rows, ..l.clone() }))
            }
            t => Ok(Tensor::Ready(t.ready()?.rows(idx, whole, name, path)?)),
        }
    }

    /// Permutes blocks of `block` input columns (see
    /// [`TensorData::column_blocks`]); a lazy one only notes the reorder
    /// when it moves whole quantization groups.
    pub(super) fn column_blocks(
        &self,
        perm: &[i32],
        block: i32,
        name: &str,
        path: &Path,
    ) -> Result<Tensor> {
        let shape = self.shape();
        let groups = |l: &Lazy| match affine(l.src.info.ty) {
            Some((bits, _)) => block % 32 == 0 && (block * bits) % 32 == 0,
            None => true,
        };
        match self {
            Tensor::Lazy(l)
                if shape.len() >= 2
                    && shape[shape.len() - 1] == perm.len() as i32 * block
                    && groups(l) =>
            {
                let cols = through(Some(spread(perm, block)), l.cols.as_ref()).map(Arc::new);
                Ok(Tensor::Lazy(Lazy { cols, ..l.clone() }))
            }
            t => Ok(Tensor::Ready(
                t.ready()?.column_blocks(perm, block, name, path)?,
            )),
        }
    }

    /// Puts the tensor into `weights` as `{module}.{suffix}`, or as
    /// `{module}.weight`, `.scales` and `.biases` when quantized: then its
    /// bits and group.
    pub(super) fn put(
        self,
        weights: &mut WeightMap,
        file: usize,
        module: &str,
        suffix: &str,
    ) -> Option<(i32, i32)> {
        match self {
            Tensor::Ready(TensorData::Dense(a)) => {
                weights.insert(format!("{module}.{suffix}"), a, file);
                None
            }
            Tensor::Ready(TensorData::Affine {
                weight,
                scales,
                biases,
                bits,
                group,
            }) => {
                weights.insert(format!("{module}.weight"), weight, file);
                weights.insert(format!("{module}.scales"), scales, file);
                weights.insert(format!("{module}.biases"), biases, file);
                Some((bits, group))
            }
            Tensor::Lazy(l) => {
                let shape = l.shape();
                let last = shape.len() - 1;
                let ty = l.src.info.ty;
                let mut part = |name: String, comp: Comp, dims: Vec<i32>, dtype: Dtype| {
                    let reader = Arc::new(Part {
                        lazy: l.clone(),
                        comp,
                    });
                    weights.insert_deferred(name, dims, dtype, reader, file);
                };
                let Some((bits, half)) = affine(ty) else {
                    part(
                        format!("{module}.{suffix}"),
                        Comp::Dense,
                        shape,
                        dense_dtype(ty),
                    );
                    return None;
                };
                let mut packed = shape.clone();
                packed[last] = shape[last] * bits / 32;
                let mut groups = shape.clone();
                groups[last] = shape[last] / 32;
                let sd = if half { Dtype::Float16 } else { Dtype::Float32 };
                part(
                    format!("{module}.weight"),
                    Comp::Weight(bits),
                    packed,
                    Dtype::Uint32,
                );
                part(format!("{module}.scales"), Comp::Scales, groups.clone(), sd);
                part(format!("{module}.biases"), Comp::Biases, groups, sd);
                Some((bits, 32))
            }
        }
    }
}

/// Which array of a decoded tensor a weight-map entry is.
#[derive(Clone, Copy, Debug)]
enum Comp {
    Dense,
    /// Packed weights of these bits.
    Weight(i32),
    Scales,
    Biases,
}

impl Comp {
    fn pick(self, t: TensorData) -> Array {
        match (self, t) {
            (_, TensorData::Dense(a)) => a,
            (Comp::Scales, TensorData::Affine { scales, .. }) => scales,
            (Comp::Biases, TensorData::Affine { biases, .. }) => biases,
            (_, TensorData::Affine { weight, .. }) => weight,
        }
    }

    /// Elements of a run `(start, count)` of its last axis, if whole.
    fn elements(self, (start, n): (i32, i32)) -> Option<(i32, i32)> {
        let whole = |per: i32| Some((start * per, n * per));
        match self {
            Comp::Dense => Some((start, n)),
            Comp::Scales | Comp::Biases => whole(32),
            Comp::Weight(bits) if start % bits == 0 && n % bits == 0 => {
                Some((start / bits * 32, n / bits * 32))
            }
            Comp::Weight(_) => None,
        }
    }
}

/// One weight-map entry of a lazy tensor.
#[derive(Debug)]
struct Part {
    lazy: Lazy,
    comp: Comp,
}

impl PartReader for Part {
    fn read(&self, part: Option<(usize, &[(i32, i32)])>) -> Result<Array> {
        let l = &self.lazy;
        let sel = match part {
            None => l.selection(None),
            Some((axis, ranges)) => {
                let last = l.src.info.shape.len() - 1;
                let mut idx = Vec::new();
                for &r in ranges {
                    let (s, n) = if axis == last {
                        self.comp.elements(r).ok_or_else(|| {
                            Error::Other(format!(
                                "{}: a part of {r:?} packed words is not whole quantization groups",
                                l.src.info.name
                            ))
                        })?
                    } else {
                        r
                    };
                    idx.extend(s..s + n);
                }
                l.selection(Some((axis, idx)))
            }
        };
        Ok(self.comp.pick(l.decode(&sel)?))
    }
}

impl Lazy {
    fn shape(&self) -> Vec<i32> {
        let mut s = self.src.info.shape.clone();
        let n = s.len();
        if let (Some(r), true) = (&self.rows, n >= 2) {
            s[n - 2] = r.len() as i32;
        }
        if let Some(c) = &self.cols {
            s[n - 1] = c.len() as i32;
        }
        s
    }

    /// The file indices of the logical indices `part` (one axis; `None`:
    /// all) through the reorders.
    fn selection(&self, part: Option<(usize, Vec<i32>)>) -> Selection {
        let n = self.src.info.shape.len();
        let mut sel: Selection = vec![None; n];
        if let Some((axis, idx)) = part {
            sel[axis] = Some(idx);
        }
        if n >= 2 {
            sel[n - 2] = through(sel[n - 2].take(), self.rows.as_ref());
        }
        sel[n - 1] = through(sel[n - 1].take(), self.cols.as_ref());
        sel
    }

    /// The file indices `sel` decoded (the last selection decoded is kept).
    fn decode(&self, sel: &Selection) -> Result<TensorData> {
        let mut last = self.src.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, t)) = last.as_ref().filter(|(s, _)| s == sel) {
            return Ok(t.clone());
        }
        let t = self.src.read(sel)?;
        *last = Some((sel.clone(), t.clone()));
        Ok(t)
    }
}

impl Source {
    /// Reads the rows and column blocks `sel` covers (nothing else of the
    /// file), decodes them, and keeps the selected columns in order.
    fn read(&self, sel: &Selection) -> Result<TensorData> {
        let info = &self.info;
        let n = info.shape.len();
        let (per, size) = info.ty.block();
        let (per, size) = (per as i64, size as i64);
        let cols = i64::from(info.shape[n - 1]);
        let row_blocks = cols / per;
        // The blocks to read (ascending) and each selected column's place
        // among their columns.
        let (blocks, places): (Vec<u64>, Option<Vec<i32>>) = match &sel[n - 1] {
            None => ((0..row_blocks as u64).collect(), None),
            Some(c) => {
                let mut b: Vec<u64> = c.iter().map(|&x| (i64::from(x) / per) as u64).collect();
                b.sort_unstable();
                b.dedup();
                let place = |x: i32| {
                    let at = b
                        .binary_search(&((i64::from(x) / per) as u64))
                        .expect("listed");
                    (at as i64 * per + i64::from(x) % per) as i32
                };
                let places: Vec<i32> = c.iter().map(|&x| place(x)).collect();
                let same = places.len() as i64 == b.len() as i64 * per
                    && places.iter().enumerate().all(|(i, &p)| p == i as i32);
                (b, (!same).then_some(places))
            }
        };
        let block_runs = runs(&blocks);
        let full = blocks.len() as i64 == row_blocks;
        // Flat rows over every axis but the last, in output order.
        let mut rows: Vec<u64> = vec![0];
        let mut shape = Vec::with_capacity(n);
        for (a, &dim) in info.shape[..n - 1].iter().enumerate() {
            let idx: Vec<i32> = sel[a].clone().unwrap_or_else(|| (0..dim).collect());
            shape.push(idx.len() as i32);
            rows = rows
                .iter()
                .flat_map(|&r| idx.iter().map(move |&i| r * dim as u64 + i as u64))
                .collect();
        }
        shape.push((blocks.len() as i64 * per) as i32);
        let row_bytes = (row_blocks * size) as u64;
        let kept = blocks.len() as u64 * size as u64;
        let mut raw = vec![0u8; rows.len() * kept as usize];
        let file = std::fs::File::open(&self.path).map_err(|e| Error::io(&self.path, e))?;
        let mut at = 0usize;
        let mut read = |from: u64, len: u64| -> Result<()> {
            let len = len as usize;
            file.read_exact_at(&mut raw[at..at + len], info.start + from)
                .map_err(|e| bad(&self.path, format!("tensor `{}`: {e}", info.name)))?;
            at += len;
            Ok(())
        };
        if full {
            for (r, count) in runs(&rows) {
                read(r * row_bytes, count * row_bytes)?;
            }
        } else {
            for &r in &rows {
                for &(b, count) in &block_runs {
                    read(r * row_bytes + b * size as u64, count * size as u64)?;
                }
            }
        }
        let part = TensorInfo {
            shape,
            start: 0,
            bytes: raw.len() as u64,
            ..info.clone()
        };
        let t = gguf_file::decode(&raw, &part, &self.path)?;
        match places {
            None => Ok(t),
            Some(p) => t.columns(&p, &info.name, &self.path),
        }
    }
}

fn indices(idx: &[i32]) -> Array {
    Array::from_slice(idx, &[idx.len() as i32])
}

impl TensorData {
    /// Its logical shape (unpacked).
    pub(super) fn shape(&self) -> Vec<i32> {
        match self {
            TensorData::Dense(a) => a.shape().to_vec(),
            TensorData::Affine { scales, group, .. } => {
                let mut s = scales.shape().to_vec();
                let last = s.len() - 1;
                s[last] *= group;
                s
            }
        }
    }

    /// Float32 values.
    fn dense(&self) -> Result<Array> {
        Ok(match self {
            TensorData::Dense(a) => a.as_dtype(Dtype::Float32)?,
            TensorData::Affine {
                weight,
                scales,
                biases,
                bits,
                group,
            } => {
                // Float32 scales: d * q of a Q8_0 block needs up to 18 bits,
                // more than float16 holds.
                let f32 = |a: &Array| a.as_dtype(Dtype::Float32);
                ops::dequantize(weight, f32(scales)?, Some(&f32(biases)?), *group, *bits)?
            }
        })
    }

    /// Gathers output rows (the second-to-last axis; the only axis of a
    /// 1-D tensor): row `i` of the result is row `idx[i]`. With `whole`,
    /// `idx` must be a reordering of every row (else a subset). An index
    /// past the end is an error naming the tensor: MLX's gather does not
    /// check.
    fn rows(&self, idx: &[i32], whole: bool, name: &str, path: &Path) -> Result<TensorData> {
        let shape = self.shape();
        check_rows(&shape, idx, whole, name, path)?;
        let ix = indices(idx);
        self.each(|a, _| Ok(a.take_axis(&ix, (a.ndim() as i32 - 2).max(0))?))
    }

    /// Permutes blocks of `block` input columns (the last axis): block `b`
    /// of the result is block `perm[b]`.
    fn column_blocks(
        &self,
        perm: &[i32],
        block: i32,
        name: &str,
        path: &Path,
    ) -> Result<TensorData> {
        let shape = self.shape();
        if shape.len() < 2 || shape[shape.len() - 1] != perm.len() as i32 * block {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}` has shape {shape:?}; the metadata's value heads need {} input columns",
                    perm.len() as i32 * block
                ),
            ));
        }
        match self {
            TensorData::Affine { bits, group, .. }
                if block % group != 0 || (block * bits) % 32 != 0 =>
            {
                Ok(TensorData::Dense(
                    self.dense()?.take_axis(indices(&spread(perm, block)), -1)?,
                ))
            }
            _ => self.each(|a, c| {
                let width = match c {
                    Comp::Dense => block,
                    Comp::Weight(bits) => block * bits / 32,
                    Comp::Scales | Comp::Biases => block / 32,
                };
                Ok(a.take_axis(indices(&spread(perm, width)), -1)?)
            }),
        }
    }

    /// Each of its arrays through `f` (which is told which it is).
    fn each(&self, f: impl Fn(&Array, Comp) -> Result<Array>) -> Result<TensorData> {
        Ok(match self {
            TensorData::Dense(a) => TensorData::Dense(f(a, Comp::Dense)?),
            TensorData::Affine {
                weight,
                scales,
                biases,
                bits,
                group,
            } => TensorData::Affine {
                weight: f(weight, Comp::Weight(*bits))?,
                scales: f(scales, Comp::Scales)?,
                biases: f(biases, Comp::Biases)?,
                bits: *bits,
                group: *group,
            },
        })
    }

    /// A dense value transform (norms, `A_log`, convs are float32 in
    /// llama.cpp's files; a quantized one is dequantized first).
    fn map(&self, f: impl FnOnce(Array) -> Result<Array>) -> Result<TensorData> {
        Ok(TensorData::Dense(f(self.dense()?)?))
    }

    /// Keeps the columns `places` (of the last axis, in that order): whole
    /// quantization groups for an affine tensor.
    fn columns(self, places: &[i32], name: &str, path: &Path) -> Result<TensorData> {
        match &self {
            TensorData::Dense(a) => Ok(TensorData::Dense(a.take_axis(indices(places), -1)?)),
            &TensorData::Affine { bits, group, .. } => {
                let whole = places.len() as i32 % group == 0
                    && places.chunks(group as usize).all(|g| {
                        g[0] % group == 0
                            && g.iter().enumerate().all(|(i, &p)| p == g[0] + i as i32)
                    });
                if !whole {
                    return Err(bad(
                        path,
                        format!("tensor `{name}`: a part that is not whole quantization groups"),
                    ));
                }
                let g: Vec<i32> = places
                    .iter()
                    .step_by(group as usize)
                    .map(|&p| p / group)
                    .collect();
                let words: Vec<i32> = g
                    .iter()
                    .flat_map(|&x| (0..bits).map(move |w| x * bits + w))
                    .collect();
                self.each(|a, c| {
                    let keep = if matches!(c, Comp::Weight(_)) {
                        &words
                    } else {
                        &g
                    };
                    Ok(a.take_axis(indices(keep), -1)?)
                })
            }
        }
    }
}
