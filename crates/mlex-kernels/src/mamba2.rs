//! The Mamba2 SSM decode step (Dao, Gu, *Transformers are SSMs*, 2024;
//! reference: mlx-lm `models/mamba2.py` / `ssm.py`): per head `h` with
//! state `S` of `[Dh, N]`, `dt = clip(softplus(dt_raw + dt_bias))`,
//! `S ← exp(-exp(A_log) dt) S + dt x Bᵀ`, `y = S C + D x`, B and C shared
//! by the heads of a group. Prefill stays in the layer's chunked SSD form.

use crate::cuda::{CudaKernel, OutputSpec, TemplateArg};
use mlex_core::error::{Error, Result};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};

/// The sizes of a Mamba2 mixer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    /// Heads `H`.
    pub heads: i32,
    /// Head size `Dh`.
    pub head_dim: i32,
    /// B/C groups `G` (`H` a multiple of it).
    pub groups: i32,
    /// State size `N`.
    pub state_dim: i32,
    /// The clip range of `dt`.
    pub dt_limit: (f32, f32),
}

impl Shape {
    /// Channels of the convolved projection: `H Dh + 2 G N`.
    pub fn conv_dim(&self) -> i32 {
        self.heads * self.head_dim + 2 * self.groups * self.state_dim
    }
}

/// What one step reads: the token inputs and the per-head parameters.
#[derive(Clone, Copy)]
pub struct Inputs<'a> {
    /// The convolved projection `[B, T, H Dh + 2 G N]` (x, B, C after the
    /// convolution).
    pub conv: &'a Array,
    /// The raw `dt` `[B, T, H]`.
    pub dt: &'a Array,
    /// `[H]`.
    pub dt_bias: &'a Array,
    /// `[H]`.
    pub a_log: &'a Array,
    /// The skip `D`, `[H]`.
    pub d: &'a Array,
}

/// One decode token in plain ops (`T` = 1), `state` `[B, H, Dh, N]` →
/// (y `[B, 1, H, Dh]` in conv's dtype, new state, f32).
pub fn decode_ops(p: Inputs<'_>, state: &Array, shape: Shape) -> Result<(Array, Array)> {
    let (conv, dt) = (p.conv, p.dt);
    let b = conv.shape()[0];
    let (h, dh, g, n) = (shape.heads, shape.head_dim, shape.groups, shape.state_dim);
    let dt_limit = shape.dt_limit;
    let inner = h * dh;
    let parts = ops::split_at_indices(conv, &[inner, inner + g * n], -1)?;
    let x = ops::reshape(&parts[0], &[b, h, dh])?;
    let bm = ops::reshape(&parts[1], &[b, g, 1, n])?;
    let cm = ops::reshape(&parts[2], &[b, g, 1, n])?;
    let r = h / g;
    let rep = |m: &Array| -> Result<Array> {
        let e = ops::broadcast_to(m.expand_dims(2)?, &[b, g, r, 1, n])?;
        Ok(ops::reshape(&e, &[b, h, 1, n])?)
    };
    let (bm, cm) = (rep(&bm)?, rep(&cm)?);
    let dt = ops::add(dt.try_index((.., 0))?.as_dtype(Dtype::Float32)?, p.dt_bias)?;
    let dt = ops::clip(mlex_core::nn::softplus(&dt)?, (dt_limit.0, dt_limit.1))?; // [B, H]
    let a = ops::negative(ops::exp(p.a_log.as_dtype(Dtype::Float32)?)?)?;
    let da = ops::exp(ops::multiply(&dt, &a)?)?;
    let dtx = ops::multiply(dt.expand_dims(-1)?, &x)?; // [B, H, Dh]
    let next = ops::add(
        ops::multiply(da.expand_dims(-1)?.expand_dims(-1)?, state)?,
        ops::multiply(dtx.expand_dims(-1)?, &bm)?,
    )?;
    let y = ops::multiply(&next, &cm)?.sum_axis(-1, false)?; // [B, H, Dh]
    let skip = ops::multiply(&x, ops::reshape(p.d, &[1, h, 1])?)?;
    let y = ops::add(&y, &skip)?.as_dtype(conv.dtype())?;
    Ok((y.expand_dims(1)?, next))
}

/// Whether [`decode_fused`] supports these sizes (one warp per state row,
/// `N / 32` columns a lane, rows in fours).
pub fn fused_decode_supported(shape: Shape) -> bool {
    shape.state_dim % 32 == 0
        && shape.state_dim <= 512
        && shape.head_dim % 4 == 0
        && shape.groups > 0
        && shape.heads % shape.groups == 0
}

/// [`decode_ops`] as one custom CUDA kernel (`mamba2_decode.cu`). CUDA
/// only; check [`fused_decode_supported`] first.
pub fn decode_fused(p: Inputs<'_>, state: &Array, shape: Shape) -> Result<(Array, Array)> {
    crate::cuda::one_token_step("fused mamba2 decode", p.conv, state, || {
        steps_fused(p, state, shape, false)
    })
}

/// [`decode_ops`] over `T` consecutive tokens in one launch of the same
/// kernel, the state carried in registers from one token to the next: y `[B, T, H, Dh]` and, with
/// `keep_all`, the state after every token `[T, B, H, Dh, N]` (a
/// speculative verify), else after the last `[1, B, H, Dh, N]`. Each
/// token's arithmetic is the decode step's, so the states equal `T`
/// chained [`decode_fused`] calls bit for bit. CUDA only; check
/// [`fused_decode_supported`] first.
pub fn steps_fused(
    p: Inputs<'_>,
    state: &Array,
    shape: Shape,
    keep_all: bool,
) -> Result<(Array, Array)> {
    let (conv, dt) = (p.conv, p.dt);
    let (h, dh, g, n) = (shape.heads, shape.head_dim, shape.groups, shape.state_dim);
    let dt_limit = shape.dt_limit;
    let (b, t) = match conv.shape() {
        [b, t, c] if *c == shape.conv_dim() && *t >= 1 => (*b, *t),
        other => {
            return Err(Error::invalid(
                "fused mamba2 decode",
                format!("conv {other:?} does not fit {shape:?}"),
            ))
        }
    };
    if !fused_decode_supported(shape) || dt.shape() != [b, t, h] || state.shape() != [b, h, dh, n] {
        return Err(Error::invalid(
            "fused mamba2 decode",
            format!(
                "conv {:?} / dt {:?} / state {:?} do not fit {shape:?}",
                conv.shape(),
                dt.shape(),
                state.shape()
            ),
        ));
    }
    let kernel = CudaKernel::cached(
        "mlex_mamba2_steps",
        &["conv", "dt", "dt_bias", "a_log", "d", "limits", "state"],
        &["y", "state_out"],
        include_str!("mamba2_decode.cu"),
    )?;
    let dtype = conv.dtype();
    let limits = Array::from_slice(&[dt_limit.0, dt_limit.1], &[2]);
    let state = state.as_dtype(Dtype::Float32)?;
    let kept = if keep_all { t } else { 1 };
    kernel.apply2(
        &[conv, dt, p.dt_bias, p.a_log, p.d, &limits, &state],
        [
            OutputSpec::new(&[b, t, h, dh], dtype),
            OutputSpec::new(&[kept, b, h, dh, n], Dtype::Float32),
        ],
        &[
            ("InT", TemplateArg::Dtype(dtype)),
            ("H", TemplateArg::Int(h)),
            ("G", TemplateArg::Int(g)),
            ("Dh", TemplateArg::Int(dh)),
            ("N", TemplateArg::Int(n)),
            ("KeepAll", TemplateArg::Int(i32::from(keep_all))),
        ],
        (32, dh, b * h),
        (32, 4, 1),
    )
}
