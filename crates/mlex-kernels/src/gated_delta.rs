//! The gated delta rule over a sequence: the token-by-token recurrence (the
//! reference, and what one decode step runs) and the chunked WY form that
//! prefill runs.
//!
//! Per token `t` and value head, with the state `S` of `[Dv, Dk]`:
//! `S_t = g_t S_{t-1} (I - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ`, `y_t = S_t q_t`
//! (Yang, Kautz, Hatamizadeh, *Gated Delta Networks*, arXiv 2412.06464;
//! reference implementations: mlx-lm `models/gated_delta.py`, and the
//! flash-linear-attention `chunk_gated_delta_rule` with its PyTorch
//! reference `naive_chunk_gated_delta_rule`).
//!
//! ## The chunked form
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

use mlex_core::error::{Error, Result};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use std::cell::RefCell;
use std::collections::HashMap;

/// One recurrence step: q, k `[B, Hk, Dk]`, v `[B, H, Dv]`, g, beta
/// `[B, H]` (g the decay factor, not its log), state `[B, H, Dv, Dk]` →
/// (y `[B, H, Dv]` in q's dtype, new state). `H` must be a multiple of `Hk`.
pub fn step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let r = heads_ratio(k.shape()[k.ndim() - 2], v.shape()[v.ndim() - 2])?;
    let (q, k) = (repeat_heads(q, r)?, repeat_heads(k, r)?);
    let decay = g.expand_dims(-1)?.expand_dims(-1)?;
    let state = ops::multiply(state, &decay)?;
    let k_row = k.expand_dims(-2)?;
    let kv_mem = ops::multiply(&state, &k_row)?.sum_axis(-1, false)?;
    let delta = ops::multiply(ops::subtract(v, &kv_mem)?, beta.expand_dims(-1)?)?;
    let state = ops::add(&state, ops::multiply(&k_row, delta.expand_dims(-1)?)?)?;
    let y = ops::multiply(&state, q.expand_dims(-2)?)?.sum_axis(-1, false)?;
    Ok((y.as_dtype(q.dtype())?, state))
}

/// The inputs of the rule over a sequence of `L` tokens.
#[derive(Clone, Copy)]
pub struct Sequence<'a> {
    /// Queries `[B, L, Hk, Dk]`, already normalised and scaled.
    pub q: &'a Array,
    /// Keys `[B, L, Hk, Dk]`, already normalised.
    pub k: &'a Array,
    /// Values `[B, L, H, Dv]`; `H` a multiple of `Hk`.
    pub v: &'a Array,
    /// Log decay `[B, L, H]` (≤ 0).
    pub log_g: &'a Array,
    /// Write strength `[B, L, H]`, in `(0, 1)`.
    pub beta: &'a Array,
}

/// The result of the rule over a sequence.
pub struct Output {
    /// Outputs `[B, L, H, Dv]` in the queries' dtype.
    pub y: Array,
    /// The state after the last token, `[B, H, Dv, Dk]`, f32.
    pub state: Array,
    /// When asked for: `(tokens consumed, state after them)` at every
    /// chunk boundary, ending with the last token.
    pub boundaries: Vec<(usize, Array)>,
}

/// How a sequence is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Token by token through the compiled [`step`].
    Recurrent,
    /// The chunked WY form with chunks of this many tokens (a power of two).
    Chunked {
        /// Tokens per chunk.
        chunk: usize,
    },
}

/// Token-by-token recurrence from `state`; boundaries every `boundary_every`
/// tokens when given (the reference for [`chunked`]).
pub fn recurrent(
    seq: Sequence<'_>,
    state: &Array,
    boundary_every: Option<usize>,
) -> Result<Output> {
    let len = seq.q.shape()[1];
    let g = ops::exp(seq.log_g)?;
    let mut s = state.clone();
    let mut ys = Vec::with_capacity(len as usize);
    let mut boundaries = Vec::new();
    for t in 0..len {
        let at = |x: &Array| -> Result<Array> { Ok(x.try_index((.., t))?) };
        let (y, next) = compiled_step(
            &at(seq.q)?,
            &at(seq.k)?,
            &at(seq.v)?,
            &at(&g)?,
            &at(seq.beta)?,
            &s,
        )?;
        ys.push(y);
        s = next;
        let done = (t + 1) as usize;
        if let Some(every) = boundary_every {
            if done.is_multiple_of(every.max(1)) || done == len as usize {
                boundaries.push((done, s.clone()));
            }
        }
    }
    Ok(Output {
        y: ops::stack(&ys, 1)?,
        state: s,
        boundaries,
    })
}

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

fn heads_ratio(key_heads: i32, value_heads: i32) -> Result<i32> {
    if key_heads <= 0 || value_heads % key_heads != 0 {
        return Err(Error::invalid(
            "gated delta heads",
            format!("{value_heads} value heads are not a multiple of {key_heads} key heads"),
        ));
    }
    Ok(value_heads / key_heads)
}

/// Repeats each head `r` times along axis -2 (`mx.repeat(x, r, -2)`).
pub fn repeat_heads(x: &Array, r: i32) -> Result<Array> {
    if r == 1 {
        return Ok(x.clone());
    }
    let s = x.shape().to_vec();
    let e = x.expand_dims(-2)?;
    let mut target = s.clone();
    target.insert(s.len() - 1, r);
    let b = ops::broadcast_to(&e, &target)?;
    let mut out = s;
    let n = out.len();
    out[n - 2] *= r;
    Ok(ops::reshape(&b, &out)?)
}

type StepFn = Box<dyn FnMut(&[Array]) -> std::result::Result<Vec<Array>, mlx_rs::error::Exception>>;

thread_local! {
    /// [`step`] compiled once per thread (MLX keys its traces by input
    /// shapes), as mlx-lm compiles `_gated_delta_step_ops`: the token loop
    /// then runs a few fused kernels per token instead of a dozen ops.
    static COMPILED_STEP: RefCell<Option<StepFn>> = const { RefCell::new(None) };
}

/// [`step`] through the thread's compiled function.
pub fn compiled_step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    COMPILED_STEP.with(|cell| {
        let mut slot = cell.borrow_mut();
        let f = slot.get_or_insert_with(|| {
            Box::new(mlx_rs::transforms::compile::compile(
                |a: &[Array]| -> std::result::Result<Vec<Array>, mlx_rs::error::Exception> {
                    let (y, s) = step(&a[0], &a[1], &a[2], &a[3], &a[4], &a[5])?;
                    Ok(vec![y, s])
                },
                false,
            ))
        });
        let mut out = f(&[
            q.clone(),
            k.clone(),
            v.clone(),
            g.clone(),
            beta.clone(),
            state.clone(),
        ])?;
        let s = out.pop().expect("two outputs");
        let y = out.pop().expect("two outputs");
        Ok((y, s))
    })
}

/// Token interval of the boundaries that [`Method::Recurrent`] reports.
pub const RECURRENT_BOUNDARY_EVERY: usize = 64;

/// The rule over `seq` from `state` by `method`; `keep_boundaries` also
/// returns intermediate states (after every chunk, or every
/// [`RECURRENT_BOUNDARY_EVERY`] tokens for the recurrence).
pub fn sequence(
    seq: Sequence<'_>,
    state: &Array,
    method: Method,
    keep_boundaries: bool,
) -> Result<Output> {
    match method {
        Method::Recurrent => recurrent(
            seq,
            state,
            keep_boundaries.then_some(RECURRENT_BOUNDARY_EVERY),
        ),
        Method::Chunked { chunk } => chunked(seq, state, chunk, keep_boundaries),
    }
}

/// The head layout of a Gated DeltaNet layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    /// Query/key heads `Hk`.
    pub key_heads: i32,
    /// Value heads `H` (a multiple of `Hk`).
    pub value_heads: i32,
    /// Query/key head size `Dk`.
    pub key_dim: i32,
    /// Value head size `Dv`.
    pub value_dim: i32,
}

impl Heads {
    /// Channels of the convolved projection: `2 Hk Dk + H Dv`.
    pub fn conv_dim(&self) -> i32 {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// The rule's inputs made from one layer's projections.
pub struct Prepared {
    /// `[B, L, Hk, Dk]`, L2-normalised and scaled by `Dk^-1/2`.
    pub q: Array,
    /// `[B, L, Hk, Dk]`, L2-normalised.
    pub k: Array,
    /// `[B, L, H, Dv]`.
    pub v: Array,
    /// `[B, L, H]`, f32.
    pub log_g: Array,
    /// `[B, L, H]`.
    pub beta: Array,
}

impl Prepared {
    /// The rule's view of these inputs.
    pub fn sequence(&self) -> Sequence<'_> {
        Sequence {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            log_g: &self.log_g,
            beta: &self.beta,
        }
    }
}

/// Splits the convolved projection `conv` `[B, L, 2 Hk Dk + H Dv]` into
/// q, k, v, normalises q and k as mlx-lm's `normalize_qk` does (RMS norm
/// with `eps = 1e-6 / Dk`, then `Dk^-1` for q and `Dk^-1/2` for k, i.e. unit
/// L2 norm for k), and makes the gates from `a`, `b` `[B, L, H]`:
/// `log g = -exp(A_log) softplus(a + dt_bias)`, `beta = sigmoid(b)`.
pub fn prepare(
    conv: &Array,
    a: &Array,
    b: &Array,
    a_log: &Array,
    dt_bias: &Array,
    heads: Heads,
) -> Result<Prepared> {
    let s = conv.shape();
    let (bsz, len) = (s[0], s[1]);
    let Heads {
        key_heads: nk,
        value_heads: nv,
        key_dim: dk,
        value_dim: dv,
    } = heads;
    let key_total = nk * dk;
    let parts = ops::split_at_indices(conv, &[key_total, 2 * key_total], -1)?;
    let q = ops::reshape(&parts[0], &[bsz, len, nk, dk])?;
    let k = ops::reshape(&parts[1], &[bsz, len, nk, dk])?;
    let v = ops::reshape(&parts[2], &[bsz, len, nv, dv])?;
    let inv = (dk as f64).powf(-0.5);
    let rms_eps = (1e-6 * inv * inv) as f32;
    let q = ops::multiply(
        Array::from_f32((inv * inv) as f32).as_dtype(q.dtype())?,
        mlx_rs::fast::rms_norm(&q, None, rms_eps)?,
    )?;
    let k = ops::multiply(
        Array::from_f32(inv as f32).as_dtype(k.dtype())?,
        mlx_rs::fast::rms_norm(&k, None, rms_eps)?,
    )?;
    let beta = ops::sigmoid(b)?;
    let softplus = mlex_core::nn::softplus(&ops::add(a, dt_bias)?)?;
    let log_g = ops::multiply(
        ops::negative(ops::exp(a_log.as_dtype(Dtype::Float32)?)?)?,
        &softplus,
    )?;
    Ok(Prepared {
        q,
        k,
        v,
        log_g,
        beta,
    })
}

/// One decode token in plain ops: `conv` `[B, 1, C]`, `a`, `b` `[B, 1, H]`,
/// `state` `[B, H, Dv, Dk]` → (y `[B, 1, H, Dv]`, new state). The
/// reference for [`decode_fused`].
pub fn decode_ops(
    conv: &Array,
    a: &Array,
    b: &Array,
    a_log: &Array,
    dt_bias: &Array,
    state: &Array,
    heads: Heads,
) -> Result<(Array, Array)> {
    let p = prepare(conv, a, b, a_log, dt_bias, heads)?;
    let at = |x: &Array| -> Result<Array> { Ok(x.try_index((.., 0))?) };
    let g = ops::exp(&p.log_g)?;
    let (y, next) = step(
        &at(&p.q)?,
        &at(&p.k)?,
        &at(&p.v)?,
        &at(&g)?,
        &at(&p.beta)?,
        state,
    )?;
    Ok((y.expand_dims(1)?, next))
}

/// Whether [`decode_fused`] supports this layout: the kernel maps one warp
/// to a state row and `Dk / 32` columns to each lane, rows in fours.
pub fn fused_decode_supported(heads: Heads) -> bool {
    heads.key_dim % 32 == 0
        && heads.key_dim <= 512
        && heads.value_dim % 4 == 0
        && heads.key_heads > 0
        && heads.value_heads % heads.key_heads == 0
}

/// [`decode_ops`] as one custom CUDA kernel (`gated_delta_decode.cu`):
/// split, q/k normalisation, gates and the state update in one launch.
/// CUDA only; check [`fused_decode_supported`] first.
pub fn decode_fused(
    conv: &Array,
    a: &Array,
    b: &Array,
    a_log: &Array,
    dt_bias: &Array,
    state: &Array,
    heads: Heads,
) -> Result<(Array, Array)> {
    if conv.shape().get(1) != Some(&1) {
        return Err(Error::invalid(
            "fused gated delta decode",
            format!("conv {:?} is not one token", conv.shape()),
        ));
    }
    let (y, states) = steps_fused(conv, a, b, a_log, dt_bias, state, heads, false)?;
    Ok((y, ops::reshape(&states, state.shape())?))
}

/// [`decode_ops`] over `T` consecutive tokens (`conv` `[B, T, C]`, `a`, `b`
/// `[B, T, H]`) in one launch of the same kernel, the state carried in
/// registers from one token to the next: y `[B, T, H, Dv]` and, with
/// `keep_all`, the state after every token `[T, B, H, Dv, Dk]` (a
/// speculative verify), else after the last `[1, B, H, Dv, Dk]`. Each
/// token's arithmetic is the decode step's, so the states equal `T`
/// chained [`decode_fused`] calls bit for bit. CUDA only; check
/// [`fused_decode_supported`] first.
#[allow(clippy::too_many_arguments)]
pub fn steps_fused(
    conv: &Array,
    a: &Array,
    b: &Array,
    a_log: &Array,
    dt_bias: &Array,
    state: &Array,
    heads: Heads,
    keep_all: bool,
) -> Result<(Array, Array)> {
    use crate::cuda::{CudaKernel, OutputSpec, TemplateArg};
    if !fused_decode_supported(heads) {
        return Err(Error::invalid(
            "fused gated delta decode",
            format!("unsupported head layout {heads:?} (Dk a multiple of 32, Dv of 4)"),
        ));
    }
    let Heads {
        key_heads: nk,
        value_heads: nv,
        key_dim: dk,
        value_dim: dv,
    } = heads;
    let (bsz, t) = match conv.shape() {
        [bsz, t, c] if *c == heads.conv_dim() && *t >= 1 => (*bsz, *t),
        other => {
            return Err(Error::invalid(
                "fused gated delta decode",
                format!("conv {other:?} does not match {heads:?}"),
            ))
        }
    };
    if state.shape() != [bsz, nv, dv, dk] || a.shape() != [bsz, t, nv] || b.shape() != [bsz, t, nv]
    {
        return Err(Error::invalid(
            "fused gated delta decode",
            format!(
                "a {:?} / b {:?} / state {:?} do not match conv {:?} and {heads:?}",
                a.shape(),
                b.shape(),
                state.shape(),
                conv.shape()
            ),
        ));
    }
    let kernel = CudaKernel::cached(
        "mlex_gated_delta_steps",
        &["conv", "a", "b", "a_log", "dt_bias", "state"],
        &["y", "state_out"],
        include_str!("gated_delta_decode.cu"),
    )?;
    let dtype = conv.dtype();
    let state = state.as_dtype(Dtype::Float32)?;
    let kept = if keep_all { t } else { 1 };
    kernel.apply2(
        &[conv, a, b, a_log, dt_bias, &state],
        [
            OutputSpec {
                shape: vec![bsz, t, nv, dv],
                dtype,
            },
            OutputSpec {
                shape: vec![kept, bsz, nv, dv, dk],
                dtype: Dtype::Float32,
            },
        ],
        &[
            ("InT", TemplateArg::Dtype(dtype)),
            ("Hk", TemplateArg::Int(nk)),
            ("H", TemplateArg::Int(nv)),
            ("Dk", TemplateArg::Int(dk)),
            ("Dv", TemplateArg::Int(dv)),
            ("KeepAll", TemplateArg::Int(i32::from(keep_all))),
        ],
        (32, dv, bsz * nv),
        (32, 4, 1),
    )
}
