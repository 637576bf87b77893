//! The gated delta rule over a sequence: the token-by-token recurrence (the
//! reference, and what one decode step runs) and the chunked WY form that
//! prefill runs (`chunked.rs`, with its derivation).
//!
//! Per token `t` and value head, with the state `S` of `[Dv, Dk]`:
//! `S_t = g_t S_{t-1} (I - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ`, `y_t = S_t q_t`
//! (Yang, Kautz, Hatamizadeh, *Gated Delta Networks*, arXiv 2412.06464;
//! reference implementations: mlx-lm `models/gated_delta.py`, and the
//! flash-linear-attention `chunk_gated_delta_rule` with its PyTorch
//! reference `naive_chunk_gated_delta_rule`).
//!

mod chunked;

pub use chunked::chunked;
use mlex_core::error::{Error, Result};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use std::cell::RefCell;

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

/// [`sequence`] over `seq` in pieces of at most `piece` tokens (a multiple
/// of the chunk), each handed to MLX as it is built while the host waits
/// for the one before (`Dispatch::layer_sync_rows`): the same result with
/// one piece's intermediates alive at a time instead of the whole
/// sequence's (on the H100 a 4,096-token scan of the Qwen3.5-like bench
/// model held 2 GB).
pub fn sequence_in_pieces(
    seq: Sequence<'_>,
    state: &Array,
    method: Method,
    piece: usize,
) -> Result<Output> {
    let len = seq.q.shape()[1] as usize;
    if len <= piece.max(1) {
        return sequence(seq, state, method, false);
    }
    let mut s = state.clone();
    let mut ys = Vec::new();
    let mut in_flight: Option<Array> = None;
    for start in (0..len).step_by(piece) {
        let range = start as i32..(start + piece).min(len) as i32;
        let cut = |x: &Array| x.try_index((.., range.clone()));
        let (q, k, v, log_g, beta) = (
            cut(seq.q)?,
            cut(seq.k)?,
            cut(seq.v)?,
            cut(seq.log_g)?,
            cut(seq.beta)?,
        );
        let part = Sequence {
            q: &q,
            k: &k,
            v: &v,
            log_g: &log_g,
            beta: &beta,
        };
        let out = sequence(part, &s, method, false)?;
        mlx_rs::transforms::async_eval([&out.y, &out.state])?;
        if let Some(before) = in_flight.replace(out.state.clone()) {
            before.eval()?;
        }
        s = out.state;
        ys.push(out.y);
    }
    Ok(Output {
        y: ops::concatenate(&ys, 1)?,
        state: s,
        boundaries: Vec::new(),
    })
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

/// One layer's inputs to the rule's gates and projections, for
/// [`prepare`], [`decode_ops`], [`decode_fused`] and [`steps_fused`].
#[derive(Clone, Copy)]
pub struct LayerInputs<'a> {
    /// The convolved projection `[B, L, 2 Hk Dk + H Dv]`.
    pub conv: &'a Array,
    /// The decay input `[B, L, H]`.
    pub a: &'a Array,
    /// The write-strength input `[B, L, H]`.
    pub b: &'a Array,
    /// `A_log` `[H]`.
    pub a_log: &'a Array,
    /// `dt_bias` `[H]`.
    pub dt_bias: &'a Array,
}

/// Splits the convolved projection `conv` `[B, L, 2 Hk Dk + H Dv]` into
/// q, k, v, normalises q and k as mlx-lm's `normalize_qk` does (RMS norm
/// with `eps = 1e-6 / Dk`, then `Dk^-1` for q and `Dk^-1/2` for k, i.e. unit
/// L2 norm for k), and makes the gates from `a`, `b` `[B, L, H]`:
/// `log g = -exp(A_log) softplus(a + dt_bias)`, `beta = sigmoid(b)`.
pub fn prepare(x: LayerInputs<'_>, heads: Heads) -> Result<Prepared> {
    let (conv, a, b, a_log, dt_bias) = (x.conv, x.a, x.b, x.a_log, x.dt_bias);
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
pub fn decode_ops(x: LayerInputs<'_>, state: &Array, heads: Heads) -> Result<(Array, Array)> {
    let p = prepare(x, heads)?;
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
pub fn decode_fused(x: LayerInputs<'_>, state: &Array, heads: Heads) -> Result<(Array, Array)> {
    crate::cuda::one_token_step("fused gated delta decode", x.conv, state, || {
        steps_fused(x, state, heads, false)
    })
}

/// [`decode_ops`] over `T` consecutive tokens (`conv` `[B, T, C]`, `a`, `b`
/// `[B, T, H]`) in one launch of the same kernel, the state carried in
/// registers from one token to the next: y `[B, T, H, Dv]` and, with
/// `keep_all`, the state after every token `[T, B, H, Dv, Dk]` (a
/// speculative verify), else after the last `[1, B, H, Dv, Dk]`. Each
/// token's arithmetic is the decode step's, so the states equal `T`
/// chained [`decode_fused`] calls bit for bit. CUDA only; check
/// [`fused_decode_supported`] first.
pub fn steps_fused(
    x: LayerInputs<'_>,
    state: &Array,
    heads: Heads,
    keep_all: bool,
) -> Result<(Array, Array)> {
    let (conv, a, b, a_log, dt_bias) = (x.conv, x.a, x.b, x.a_log, x.dt_bias);
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
            OutputSpec::new(&[bsz, t, nv, dv], dtype),
            OutputSpec::new(&[kept, bsz, nv, dv, dk], Dtype::Float32),
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
