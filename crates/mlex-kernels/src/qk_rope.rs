//! The query/key preparation of a decode step in one launch: the per-head
//! RMS norms of q and k (Qwen3's `q_norm`/`k_norm`, when the layer has them)
//! and the rotary embedding of both at each row's position.
//!
//! As ops this is four MLX kernels a layer (`rms_norm` twice, `rope`
//! twice), each a graph node the host builds and a CUDA graph node the GPU
//! launches: on the H200 a Qwen3-0.6B-like decode token spends 56 rope and
//! 56 small-norm launches of its 453 (`docs/BENCHMARKS.md`). [`apply`] is
//! one custom CUDA kernel (`qk_rope.cu`) computing what `fast::rms_norm`
//! then `fast::rope` compute, with the same roundings (the normalised value
//! rounded to the dtype before the weight, the angle as
//! `(scale * position) * inv_freq`); its test holds it to that ops form.
//! CUDA only: elsewhere the layer runs the ops.

use crate::cuda::{CudaKernel, OutputSpec, TemplateArg};
use mlex_core::error::{Error, Result};
use mlx_rs::{Array, Dtype};
use std::cell::RefCell;
use std::collections::HashMap;

const SOURCE: &str = include_str!("qk_rope.cu");

/// The largest head size the kernel takes (its rows are staged in shared
/// memory, four per block).
pub const MAX_HEAD_DIM: i32 = 512;

/// The rotation: as `fast::rope`'s arguments.
#[derive(Clone, Debug)]
pub struct Rotation {
    /// Rotated dims (even, at most the head size).
    pub dims: i32,
    /// Rotate consecutive pairs instead of halves.
    pub traditional: bool,
    /// Inverse frequency of each rotated pair (`dims / 2`).
    pub inv_freq: Vec<f32>,
    /// Position scale.
    pub scale: f32,
}

impl Rotation {
    /// The rotation `fast::rope` computes from a frequency `base`:
    /// `inv_freq[i] = 2^(-(i / (dims / 2)) log2 base)`, in f32 as MLX does.
    pub fn from_base(dims: i32, traditional: bool, base: f32, scale: f32) -> Rotation {
        let half = (dims / 2).max(1) as f32;
        let lb = base.log2();
        Rotation {
            dims,
            traditional,
            inv_freq: (0..dims / 2)
                .map(|i| (-(i as f32 / half) * lb).exp2())
                .collect(),
            scale,
        }
    }

    /// The rotation `fast::rope` computes from explicit periods `freqs`
    /// (`inv_freq = 1 / freqs`).
    pub fn from_periods(dims: i32, traditional: bool, freqs: &[f32], scale: f32) -> Rotation {
        Rotation {
            dims,
            traditional,
            inv_freq: freqs.iter().map(|f| (1.0 / *f as f64) as f32).collect(),
            scale,
        }
    }
}

/// The q and k RMS norms: weights `[D]` and their epsilon.
#[derive(Clone, Copy)]
pub struct QkNorms<'a> {
    /// Query norm weight.
    pub q: &'a Array,
    /// Key norm weight.
    pub k: &'a Array,
    /// Epsilon.
    pub eps: f32,
}

/// Whether [`apply`] takes a layer of this head size, rotation and norm
/// epsilon (a layer checks once and runs the ops otherwise).
pub fn supported(head_dim: i32, rotation: &Rotation, eps: Option<f32>) -> bool {
    let eps_ok = eps.is_none_or(|e| eps_pico(e).is_some());
    (1..=MAX_HEAD_DIM).contains(&head_dim)
        && rotation.dims > 0
        && rotation.dims % 2 == 0
        && rotation.dims <= head_dim
        && rotation.inv_freq.len() == (rotation.dims / 2) as usize
        && eps_ok
}

/// The epsilon in units of 1e-12 when that is exact enough (MLX's template
/// arguments are integers).
pub(crate) fn eps_pico(eps: f32) -> Option<i32> {
    let p = (eps as f64 * 1e12).round();
    ((1.0..=i32::MAX as f64).contains(&p) && ((p * 1e-12 - eps as f64) / eps as f64).abs() < 1e-6)
        .then_some(p as i32)
}

thread_local! {
    /// Rotation tables by their bits, made once per thread (MLX arrays stay
    /// on their thread). An array made from host data lives in CUDA managed
    /// memory: made anew each step, its pages would migrate to the GPU at
    /// every launch (measured: +600 us of GPU time a Qwen3-0.6B-like token).
    static TABLES: RefCell<HashMap<Vec<u32>, Array>> = RefCell::new(HashMap::new());
}

/// The kernel's `rope` input: the inverse frequencies, then the scale.
fn rotation_table(rotation: &Rotation) -> Result<Array> {
    let mut table = rotation.inv_freq.clone();
    table.push(rotation.scale);
    let key: Vec<u32> = table.iter().map(|v| v.to_bits()).collect();
    TABLES.with(|t| {
        if let Some(found) = t.borrow().get(&key) {
            return Ok(found.clone());
        }
        let made = Array::from_slice(&table, &[table.len() as i32]);
        made.eval()?;
        t.borrow_mut().insert(key, made.clone());
        Ok(made)
    })
}

/// `rope(rms_norm(q, norms.q), positions)` and the same for `k`, in one
/// CUDA kernel: `q` `[B, Hq, L, D]` and `k` `[B, Hk, L, D]` of one float
/// dtype, `positions` int32 `[1]` (every row) or `[B]` (row `b`'s first
/// token), each token `l` of a row at its position plus `l`. Without
/// `norms` only the rotation. Check [`supported`] first.
pub fn apply(
    q: &Array,
    k: &Array,
    norms: Option<QkNorms<'_>>,
    positions: &Array,
    rotation: &Rotation,
) -> Result<(Array, Array)> {
    let bad = |what: String| Error::invalid("qk_rope", what);
    let (qs, ks) = (q.shape(), k.shape());
    if qs.len() != 4 || ks.len() != 4 || qs[0] != ks[0] || qs[2] != ks[2] || qs[3] != ks[3] {
        return Err(bad(format!(
            "q {qs:?} and k {ks:?} are not [B, H, L, D] of one B, L and D"
        )));
    }
    let (b, hq, l, d) = (qs[0], qs[1], qs[2], qs[3]);
    let hk = ks[1];
    let dtype = q.dtype();
    if !matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16) || k.dtype() != dtype {
        return Err(bad(format!(
            "q and k must share a float dtype ({:?}, {:?})",
            dtype,
            k.dtype()
        )));
    }
    let eps = norms.map(|n| n.eps);
    if !supported(d, rotation, eps) {
        return Err(bad(format!(
            "head size {d}, {} rotated dims or epsilon {eps:?} not supported",
            rotation.dims
        )));
    }
    let p = positions.shape();
    if positions.dtype() != Dtype::Int32 || p.len() != 1 || !(p[0] == 1 || p[0] == b) {
        return Err(bad(format!(
            "positions must be int32 [1] or [{b}], not {:?} {p:?}",
            positions.dtype()
        )));
    }
    let table = rotation_table(rotation)?;
    let (qw, kw, norm, eps) = match norms {
        Some(n) => {
            for (name, w) in [("q", n.q), ("k", n.k)] {
                if w.shape() != [d] {
                    return Err(bad(format!(
                        "the {name} norm weight is {:?}, not [{d}]",
                        w.shape()
                    )));
                }
            }
            (n.q, n.k, 1, eps_pico(n.eps).expect("checked by supported"))
        }
        None => (&table, &table, 0, 1),
    };
    let kernel = CudaKernel::cached(
        "mlex_qk_rope",
        &["q", "k", "qw", "kw", "pos", "rope"],
        &["qo", "ko"],
        SOURCE,
    )?;
    kernel.apply2(
        &[q, k, qw, kw, positions, &table],
        [
            OutputSpec {
                shape: qs.to_vec(),
                dtype,
            },
            OutputSpec {
                shape: ks.to_vec(),
                dtype,
            },
        ],
        &[
            ("T", TemplateArg::Dtype(dtype)),
            ("HQ", TemplateArg::Int(hq)),
            ("HK", TemplateArg::Int(hk)),
            ("L", TemplateArg::Int(l)),
            ("D", TemplateArg::Int(d)),
            ("DIMS", TemplateArg::Int(rotation.dims)),
            ("NORM", TemplateArg::Int(norm)),
            ("TRAD", TemplateArg::Int(i32::from(rotation.traditional))),
            ("EPS_PICO", TemplateArg::Int(eps)),
        ],
        (32, b * (hq + hk) * l, 1),
        (32, 4, 1),
    )
}
