//! The chunked WY form of the gated delta rule, which prefill runs (the
//! recurrence it must equal is [`super::recurrent`]).
//!
//! Split the sequence into chunks of `C` tokens; let `γ_i` be the cumulative
//! log decay inside a chunk. Then, per chunk, with
//! `A_ij = beta_i (k_i · k_j) e^{γ_i - γ_j}` for `i > j` (strictly lower
//! triangular) and `T = (I + A)⁻¹` (the UT transform):
//! `U = T (beta ⊙ V)`, `W = T (beta e^γ ⊙ K)`,
//! `V' = U - W Sᵀ` (the delta-corrected values),
//! `Y = (e^γ ⊙ Q) Sᵀ + (Q Kᵀ ⊙ D) V'` with `D_ij = e^{γ_i - γ_j}`, `i ≥ j`,
//! `S ← e^{γ_C} S + V'ᵀ (e^{γ_C - γ} ⊙ K)`.
//! Everything but the last update is parallel over all chunks; only
//! `V'` and `S` run chunk after chunk (two matrix products each).
//!
//! `T` is found by recursive doubling: with `Inv` the inverse restricted to
//! the diagonal blocks of size `b`, `Inv ← Inv - Inv E Inv` where `E` holds
//! the entries of `A` in the lower off-diagonal `b`-blocks of each `2b`
//! block. That is `log2 C` dependent steps, and unlike the nilpotent series
//! `(I - A)(I + A²)(I + A⁴)…` no intermediate is larger than the inverse
//! itself (the series' powers of `A` overflow f32 when keys in a chunk are
//! nearly parallel, which real checkpoints produce).
//!
//! All of the chunked arithmetic runs in f32; decays are formed as
//! `exp(γ_i - γ_j)` of a masked difference, so no term exceeds 1.

use super::{heads_ratio, repeat_heads, Output, Sequence};
use mlex_core::error::{Error, Result};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use std::cell::RefCell;
use std::collections::HashMap;

/// The chunked WY form (see the module docs) from `state`, with chunks of
/// `chunk` tokens (a power of two); `keep_boundaries` also returns the state
/// after every chunk. Any length works: the last chunk is padded with
/// tokens that leave the state unchanged (`beta = 0`, `g = 1`).
pub fn chunked(
    seq: Sequence<'_>,
    state: &Array,
    chunk: usize,
    keep_boundaries: bool,
) -> Result<Output> {
    if !chunk.is_power_of_two() || chunk < 2 {
        return Err(Error::invalid(
            "gated delta chunk",
            format!("{chunk} is not a power of two of at least 2"),
        ));
    }
    let c = chunk as i32;
    let qs = seq.q.shape();
    let (bsz, len, dk) = (qs[0], qs[1], qs[3]);
    let vs = seq.v.shape();
    let (h, dv) = (vs[2], vs[3]);
    let r = heads_ratio(qs[2], h)?;
    let out_dtype = seq.q.dtype();
    let f32 = |x: &Array| x.as_dtype(Dtype::Float32);
    let pad = (c - len % c) % c;
    let n = (len + pad) / c;
    // [B, L, H, D] -> [B, H, N, C, D], padded with zeros (beta = 0 and
    // log g = 0 make padded tokens no-ops on the state).
    let blocks = |x: &Array, heads_ratio: i32| -> Result<Array> {
        let x = repeat_heads(&f32(x)?, heads_ratio)?;
        let x = if pad > 0 {
            ops::pad(&x, &[(0, 0), (0, pad), (0, 0), (0, 0)], None, None)?
        } else {
            x
        };
        let d = x.shape()[3];
        Ok(ops::reshape(&x, &[bsz, n, c, h, d])?.transpose_axes(&[0, 3, 1, 2, 4])?)
    };
    let scalars = |x: &Array| -> Result<Array> {
        let x = f32(x)?;
        let x = if pad > 0 {
            ops::pad(&x, &[(0, 0), (0, pad), (0, 0)], None, None)?
        } else {
            x
        };
        Ok(ops::reshape(&x, &[bsz, n, c, h])?.transpose_axes(&[0, 3, 1, 2])?)
    };
    let q = blocks(seq.q, r)?;
    let k = blocks(seq.k, r)?;
    let v = blocks(seq.v, 1)?;
    let beta = scalars(seq.beta)?;
    let gamma = ops::cumsum(scalars(seq.log_g)?, -1, None, None)?; // [B,H,N,C]

    let masks = Masks::get(c)?;
    // e^{γ_i - γ_j} on and below the diagonal, 0 above.
    let diff = ops::subtract(gamma.expand_dims(-1)?, gamma.expand_dims(-2)?)?;
    let decay = ops::exp(ops::select(&masks.lower, &diff, &masks.neg_inf)?)?;
    let k_t = k.swap_axes(-1, -2)?;
    let k_beta = ops::multiply(&k, beta.expand_dims(-1)?)?;
    let a = ops::multiply(
        ops::multiply(ops::matmul(&k_beta, &k_t)?, &decay)?,
        &masks.strict,
    )?;
    let t = unit_lower_inverse(&a, &masks)?;
    let exp_gamma = ops::exp(&gamma)?.expand_dims(-1)?;
    let u = ops::matmul(&t, ops::multiply(&v, beta.expand_dims(-1)?)?)?; // [B,H,N,C,Dv]
    let w = ops::matmul(&t, ops::multiply(&k_beta, &exp_gamma)?)?; // [B,H,N,C,Dk]
    let qk = ops::multiply(ops::matmul(&q, &k_t)?, &decay)?; // [B,H,N,C,C]
    let q_decayed = ops::multiply(&q, &exp_gamma)?;
    let g_last = gamma.try_index((.., .., .., c - 1))?; // [B,H,N]
    let k_decayed = ops::multiply(
        &k,
        ops::exp(ops::subtract(g_last.expand_dims(-1)?, &gamma)?)?.expand_dims(-1)?,
    )?;
    let chunk_decay = ops::exp(&g_last)?.expand_dims(-1)?.expand_dims(-1)?; // [B,H,N,1,1]

    // The only sequential part: two products per chunk, over the state kept
    // transposed (`sT`, [.., Dk, Dv]) so that neither product needs a
    // transposed operand. Each per-chunk operand is one output of a single
    // split of a contiguous chunk-major copy, so a chunk costs three graph
    // nodes (two `addmm`, one multiply) instead of a dozen slices, swaps
    // and elementwise ops: the loop runs N times per layer and, at small
    // widths or on a GPU, a prefill pays per node (docs/BENCHMARKS.md).
    let chunks = |x: &Array| -> Result<Vec<Array>> {
        let mut axes: Vec<i32> = vec![2, 0, 1];
        axes.extend(3..x.ndim() as i32);
        let x = x.transpose_axes(&axes)?.contiguous()?; // [N, B, H, ...]
        Ok(ops::split_equal(&x, n, 0)?) // n x [1, B, H, ...]
    };
    let u_at = chunks(&u)?;
    let w_at = chunks(&w)?;
    let k_decayed_t_at = chunks(&k_decayed.swap_axes(-1, -2)?)?; // [1,B,H,Dk,C]
    let chunk_decay_at = chunks(&chunk_decay)?;
    // The chunks' leading axis of 1 from the start, so every start stacks
    // alike.
    let mut s_t = f32(state)?.swap_axes(-1, -2)?.expand_dims(0)?; // [1,B,H,Dk,Dv]
    let mut starts = Vec::with_capacity(n as usize);
    let mut corrected = Vec::with_capacity(n as usize);
    let mut boundaries = Vec::new();
    // The state leaves in its stored layout, [.., Dv, Dk], row-contiguous
    // (fused decode kernels read it as such).
    let stored = |s_t: &Array| -> Result<Array> {
        Ok(ops::squeeze_axes(&s_t.swap_axes(-1, -2)?, &[0])?.contiguous()?)
    };
    for i in 0..n as usize {
        // v_new = u - w sT
        let v_new = ops::addmm(&u_at[i], &w_at[i], &s_t, -1.0, 1.0)?; // [1,B,H,C,Dv]
        starts.push(s_t.clone());
        // sT = decay sT + k_decayedᵀ v_new
        s_t = ops::addmm(
            ops::multiply(&chunk_decay_at[i], &s_t)?,
            &k_decayed_t_at[i],
            &v_new,
            1.0,
            1.0,
        )?;
        corrected.push(v_new);
        if keep_boundaries {
            boundaries.push((((i as i32 + 1) * c).min(len) as usize, stored(&s_t)?));
        }
    }
    let starts_t = ops::concatenate(&starts, 0)?.transpose_axes(&[1, 2, 0, 3, 4])?; // [B,H,N,Dk,Dv]
    let v_new = ops::concatenate(&corrected, 0)?.transpose_axes(&[1, 2, 0, 3, 4])?; // [B,H,N,C,Dv]
    let y = ops::add(
        ops::matmul(&q_decayed, &starts_t)?,
        ops::matmul(&qk, &v_new)?,
    )?;
    let s = stored(&s_t)?;
    // [B,H,N,C,Dv] -> [B,L,H,Dv]
    let y = ops::reshape(y.transpose_axes(&[0, 2, 3, 1, 4])?, &[bsz, n * c, h, dv])?;
    let y = if pad > 0 {
        y.try_index((.., ..len))?
    } else {
        y
    };
    debug_assert_eq!(dk, s.shape()[3]);
    Ok(Output {
        y: y.as_dtype(out_dtype)?,
        state: s,
        boundaries,
    })
}

/// `(I + A)⁻¹` for `A` strictly lower triangular `[..., C, C]`, by recursive
/// doubling over diagonal blocks (see the module docs).
fn unit_lower_inverse(a: &Array, masks: &Masks) -> Result<Array> {
    let mut inv = masks.eye.clone();
    for level in &masks.levels {
        let e = ops::multiply(a, level)?;
        inv = ops::subtract(&inv, ops::matmul(ops::matmul(&inv, &e)?, &inv)?)?;
    }
    Ok(inv)
}

/// The constant masks of one chunk size.
#[derive(Clone)]
struct Masks {
    /// `i >= j`, bool.
    lower: Array,
    /// `i > j`, f32.
    strict: Array,
    /// The identity, f32.
    eye: Array,
    /// `-inf` (f32 scalar).
    neg_inf: Array,
    /// Per doubling level `b = 1, 2, 4, …, C/2`: `i`, `j` in the same
    /// `2b` block, `i` in its lower and `j` in its upper `b` half; f32.
    levels: Vec<Array>,
}

thread_local! {
    static MASKS: RefCell<HashMap<i32, Masks>> = RefCell::new(HashMap::new());
}

impl Masks {
    fn get(c: i32) -> Result<Masks> {
        MASKS.with(|m| {
            if let Some(found) = m.borrow().get(&c) {
                return Ok(found.clone());
            }
            let made = Masks::make(c)?;
            m.borrow_mut().insert(c, made.clone());
            Ok(made)
        })
    }

    fn make(c: i32) -> Result<Masks> {
        let grid = |f: &dyn Fn(i32, i32) -> bool| -> Vec<f32> {
            (0..c)
                .flat_map(|i| (0..c).map(move |j| (i, j)))
                .map(|(i, j)| if f(i, j) { 1.0 } else { 0.0 })
                .collect()
        };
        let arr = |v: Vec<f32>| Array::from_slice(&v, &[c, c]);
        let mut levels = Vec::new();
        let mut b = 1;
        while b < c {
            levels.push(arr(grid(&|i, j| {
                i / (2 * b) == j / (2 * b) && i / b > j / b
            })));
            b *= 2;
        }
        Ok(Masks {
            lower: ops::gt(arr(grid(&|i, j| i >= j)), Array::from_f32(0.5))?,
            strict: arr(grid(&|i, j| i > j)),
            eye: arr(grid(&|i, j| i == j)),
            neg_inf: Array::from_f32(f32::NEG_INFINITY),
            levels,
        })
    }
}
