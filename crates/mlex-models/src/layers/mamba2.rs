//! The `mamba2` layer kind: a pre-norm Mamba2 mixer (Dao & Gu, *Transformers
//! are SSMs*, 2024) as in NemotronH's `M` layers. Reference: mlx-lm
//! `models/nemotron_h.py` and `models/ssm.py` (`ssm_attn`, the chunked SSD
//! form that mlx-lm runs on every non-Metal device, also for one token).
//!
//! State: conv window `[B, K-1, C]` and SSM state `[B, H, Dh, Ds]` (f32).

use crate::block::{group_split, size};
use mlex_cache::{conv_window_into, StateCache};
use mlex_core::cache::Cache;
use mlex_core::distributed::Split;
use mlex_core::error::{Error, Result};
use mlex_core::layer::{BuildCtx, Carry, Mixer, State, StateKind};
use mlex_core::nn::{silu, softplus, swiglu, DepthwiseConv, Linear};
use mlex_core::params::{ParamId, Params};
use mlex_kernels::mamba2;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{fast, ops, Array, Dtype};
use serde::Deserialize;

/// SSD chunk length (mlx-lm's `step`).
const CHUNK: i32 = 256;

fn d_mixer() -> String {
    "mixer".into()
}
fn d_one() -> i32 {
    1
}
fn d_true() -> bool {
    true
}

/// Options of the `mamba2` kind: its sizes (named after the config keys
/// they usually come from) and weight names.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mamba2Options {
    /// Residual width.
    pub hidden_size: i32,
    /// SSM heads.
    pub mamba_num_heads: i32,
    /// SSM head size.
    pub mamba_head_dim: i32,
    /// SSM state size.
    pub ssm_state_size: i32,
    /// Convolution width.
    pub conv_kernel: i32,
    /// B/C groups (divide the heads).
    #[serde(default = "d_one")]
    pub n_groups: i32,
    /// Biases on the in/out projections.
    #[serde(default)]
    pub mamba_proj_bias: bool,
    /// Bias on the convolution.
    #[serde(default = "d_true")]
    pub use_conv_bias: bool,
    /// The clip range of `dt` (default: none).
    pub time_step_limit: Option<Vec<f64>>,
    /// Epsilon of the gated, grouped RMS norm.
    #[serde(default = "crate::block::default_eps")]
    pub norm_eps: f64,
    /// Mixer name.
    #[serde(default = "d_mixer")]
    pub mixer: String,
}

/// A built Mamba2 mixer.
pub struct Mamba2 {
    eps: f32,
    in_proj: Linear,
    conv: DepthwiseConv,
    dt_bias: ParamId,
    a_log: ParamId,
    d: ParamId,
    gate_norm: ParamId,
    out_proj: Linear,
    heads: i32,
    head_dim: i32,
    state_dim: i32,
    groups: i32,
    kernel: i32,
    dt_limit: (f32, f32),
    /// One-token steps as one CUDA kernel (the dispatch's `fused_decode`).
    fused_decode: bool,
    /// Under --tp with fewer groups than ranks: the ranks this one shares
    /// its group with.
    group_share: Option<GroupShare>,
}

/// A B/C group held by `copies` consecutive ranks (each with its part of
/// the group's heads): the gated norm's mean square is summed over them.
struct GroupShare {
    shard: mlex_core::distributed::Shard,
    copies: usize,
}

impl GroupShare {
    /// RMS-normalizes `y` (`[..., width]`, this rank's part of one group)
    /// over the whole group: each rank's sum of squares goes to its group's
    /// slot of a vector summed over all ranks.
    fn rms_norm(&self, y: &Array, eps: f32) -> Result<Array> {
        let groups = (self.shard.size() / self.copies) as i32;
        let mine = (self.shard.rank() / self.copies) as i32;
        let yf = y.as_dtype(mlx_rs::Dtype::Float32)?;
        let squares = ops::square(&yf)?.sum_axis(-1, true)?;
        let slot: Vec<f32> = (0..groups).map(|g| f32::from(g == mine)).collect();
        let slot = Array::from_slice(&slot, &[groups]);
        let slots = ops::multiply(&squares, &slot)?;
        // Back out of the slots: the others' are multiplied by zero.
        let total = ops::multiply(&self.shard.all_sum(&slots)?, &slot)?.sum_axis(-1, true)?;
        let width = (y.shape()[y.ndim() - 1] as usize * self.copies) as f32;
        let mean = ops::divide(&total, Array::from_f32(width))?;
        let scale = ops::rsqrt(&ops::add(&mean, Array::from_f32(eps))?)?;
        Ok(ops::multiply(&yf, &scale)?.as_dtype(y.dtype())?)
    }
}

mlex_core::register_mixer_kind! {
    /// The registered `mamba2` mixer kind.
    kind Mamba2Kind = "mamba2" {
        options: Mamba2Options,
        state: StateKind::Fixed,
        summary: "Mamba2 (NemotronH M), conv window + f32 SSM state",
        build: Mamba2::build,
    }
}

impl Mamba2 {
    fn build(ctx: &mut BuildCtx<'_>, o: &Mamba2Options) -> Result<Self> {
        let sz = |name: &str, v: i32| size(ctx, "mamba2", name, v);
        let hidden = sz("hidden_size", o.hidden_size)?;
        let heads = sz("mamba_num_heads", o.mamba_num_heads)?;
        let head_dim = sz("mamba_head_dim", o.mamba_head_dim)?;
        let state_dim = sz("ssm_state_size", o.ssm_state_size)?;
        let kernel = sz("conv_kernel", o.conv_kernel)?;
        let groups = sz("n_groups", o.n_groups)?;
        if heads % groups != 0 {
            return Err(ctx.config.error(
                "n_groups",
                format!("{groups} groups do not divide mamba_num_heads {heads}"),
            ));
        }
        // Under --tp each rank keeps whole B/C groups and their heads, so
        // the grouped norm stays local. With fewer groups than ranks,
        // `group_copies` consecutive ranks share a group (its B/C rows) and
        // its norm sums its squares over them (`GroupShare`).
        let (groups, heads, group_copies) = group_split(ctx, groups, heads, true).map_err(|n| {
            Error::Other(format!(
                "--tp {n}: mamba2 of layer {} ({}) cannot be split: {groups} B/C groups \
                 (n_groups) neither split into {n} equal parts nor divide {n} ranks \
                 with {heads} heads (mamba_num_heads)",
                ctx.index, ctx.prefix
            ))
        })?;
        let group_share = (group_copies > 1).then(|| GroupShare {
            shard: ctx.weights.shard().cloned().expect("split"),
            copies: group_copies,
        });
        let eps = o.norm_eps as f32;
        let inner = heads * head_dim;
        let conv_dim = inner + 2 * groups * state_dim;
        let proj_bias = o.mamba_proj_bias;
        let dt_limit = match o.time_step_limit.as_deref() {
            Some([lo, hi]) => (*lo as f32, *hi as f32),
            _ => (0.0, f32::INFINITY),
        };
        let mixer_prefix = ctx.path(&o.mixer);
        let m = |n: &str| format!("{mixer_prefix}.{n}");
        let gn = groups * state_dim;
        // in_proj's rows are gate | x | B | C | dt and the conv channels
        // x | B | C: each segment splits by heads or groups.
        let ld = &mut *ctx.weights;
        let in_proj = ld.with_split(Split::Output, |ld| {
            let c = group_copies;
            let segments = [(inner, 1), (inner, 1), (gn, c), (gn, c), (heads, 1)];
            ld.with_shared_segments(&m("in_proj"), &segments, |ld| {
                Linear::load(
                    ld,
                    &m("in_proj"),
                    hidden,
                    inner + conv_dim + heads,
                    proj_bias,
                )
            })
        })?;
        let (conv, dt_bias, a_log, d, gate_norm) = ld.with_split(Split::Leading, |ld| {
            let c = group_copies;
            let segments = [(inner, 1), (gn, c), (gn, c)];
            let conv = ld.with_shared_segments(&m("conv1d"), &segments, |ld| {
                DepthwiseConv::load(ld, &m("conv1d"), conv_dim, kernel, o.use_conv_bias)
            })?;
            Ok((
                conv,
                ld.take(&m("dt_bias"), &[heads])?,
                ld.take(&m("A_log"), &[heads])?,
                ld.take(&m("D"), &[heads])?,
                ld.take(&m("norm.weight"), &[inner])?,
            ))
        })?;
        let out_proj = ld.with_split(Split::Input, |ld| {
            Linear::load(ld, &m("out_proj"), inner, hidden, proj_bias)
        })?;
        Ok(Mamba2 {
            eps,
            in_proj,
            conv,
            dt_bias,
            a_log,
            d,
            gate_norm,
            out_proj,
            heads,
            head_dim,
            state_dim,
            groups,
            kernel,
            dt_limit,
            fused_decode: ctx.weights.dispatch().fused_decode,
            group_share,
        })
    }
}

/// `segsum(x)` of mlx-lm: `x` `[..., s]` → `[..., s, s]` with
/// `out[i, j] = sum(x[j+1..=i])` below the diagonal (cumsum of tril(-1)).
fn segsum(x: &Array) -> Result<Array> {
    let l = x.shape()[x.ndim() - 1];
    let mut shape = x.shape().to_vec();
    shape.push(l);
    let rep = ops::broadcast_to(x.expand_dims(-1)?, &shape)?;
    let tri = ops::tril(&rep, -1)?;
    Ok(tri.cumsum(-2, None, None)?)
}

impl Mamba2 {
    /// mlx-lm `ssm_attn`: x `[b, l, h, dh]`, dt `[b, l, h]` (raw),
    /// B, C `[b, l, g, n]`, state `[b, h, dh, n]`.
    fn ssm(
        &self,
        p: &Params,
        x: &Array,
        dt: &Array,
        bm: &Array,
        cm: &Array,
        state: &Array,
    ) -> Result<(Array, Array)> {
        let s = x.shape().to_vec();
        let (b, l, h, dh) = (s[0], s[1], s[2], s[3]);
        let (g, n) = (self.groups, self.state_dim);
        let repeats = h / g;
        let dt = ops::add(&dt.as_dtype(Dtype::Float32)?, p.get(self.dt_bias)?)?;
        let dt = ops::clip(softplus(&dt)?, (self.dt_limit.0, self.dt_limit.1))?;
        let a = ops::negative(ops::exp(p.get(self.a_log)?)?)?.as_dtype(dt.dtype())?;
        let dta = ops::multiply(&dt, ops::reshape(&a, &[1, 1, -1])?)?;
        let dtx = ops::multiply(ops::reshape(&dt, &[b, l, h, 1])?, x)?;
        let mut state = state.clone();
        let mut ys = Vec::new();
        let mut start = 0;
        while start < l {
            let end = (start + CHUNK).min(l);
            let cut = |a: &Array| -> Result<Array> { Ok(a.try_index((.., start..end))?) };
            let (dtx_c, dta_c, b_c, c_c) = (cut(&dtx)?, cut(&dta)?, cut(bm)?, cut(cm)?);
            let sl = end - start;
            let bt = b_c.transpose_axes(&[0, 2, 3, 1])?; // [b, g, n, s]
            let cb = ops::matmul(c_c.swap_axes(1, 2)?, &bt)?; // [b, g, s, s]
            let cb = repeat_axis1(&cb, repeats)?;
            let decay = ops::exp(segsum(&dta_c.swap_axes(1, 2)?)?)?; // [b, h, s, s]
            let sam = ops::tril(ops::multiply(&cb, &decay)?, 0)?;
            let y = ops::matmul(&sam, dtx_c.swap_axes(1, 2)?)?.swap_axes(1, 2)?; // [b, s, h, dh]
            let last = decay.try_index((.., .., (sl - 1)..sl, ..))?; // [b, h, 1, s]
            let last = last.transpose_axes(&[0, 3, 1, 2])?; // [b, s, h, 1]
            let b_rep = repeat_axis1(&bt, h / g)?.swap_axes(2, 3)?; // [b, h, s, n]
            let dtxdecay = ops::multiply(&dtx_c, &last)?
                .swap_axes(1, 2)?
                .swap_axes(2, 3)?; // [b, h, dh, s]
            let mut next = ops::matmul(&dtxdecay, &b_rep)?; // [b, h, dh, n]
            let cum = ops::exp(dta_c.cumsum(-2, None, None)?)?; // [b, s, h]
            let total = cum.try_index((.., (sl - 1)..sl, ..))?; // [b, 1, h]
            let total = ops::reshape(&total, &[b, h, 1, 1])?;
            next = ops::add(&next, ops::multiply(&total, &state)?)?;
            let c6 = ops::reshape(&c_c, &[b, sl, g, 1, n, 1])?;
            let st6 = ops::reshape(&state, &[b, 1, g, repeats, dh, n])?;
            let y_prev = ops::matmul(&st6, &c6)?; // [b, s, g, rep, dh, 1]
            let y_prev = ops::reshape(&ops::squeeze_axes(&y_prev, &[-1])?, &[b, sl, h, dh])?;
            let y = ops::add(&y, ops::multiply(cum.expand_dims(-1)?, &y_prev)?)?;
            ys.push(y.as_dtype(x.dtype())?);
            state = next;
            start = end;
        }
        let y = if ys.len() == 1 {
            ys.pop().expect("one chunk")
        } else {
            ops::concatenate(&ys, 1)?
        };
        let dskip = ops::reshape(p.get(self.d)?.as_dtype(x.dtype())?, &[1, 1, h, 1])?;
        Ok((ops::add(&y, ops::multiply(x, &dskip)?)?, state))
    }

    /// The decode kernels' inputs: the token inputs with this layer's
    /// per-head parameters.
    fn inputs<'a>(
        &self,
        p: &'a Params,
        conv: &'a Array,
        dt: &'a Array,
    ) -> Result<mamba2::Inputs<'a>> {
        Ok(mamba2::Inputs {
            conv,
            dt,
            dt_bias: p.get(self.dt_bias)?,
            a_log: p.get(self.a_log)?,
            d: p.get(self.d)?,
        })
    }

    fn mixer(&self, p: &Params, x: &Array, state: &mut State<'_>) -> Result<Array> {
        let s = x.shape();
        let (bsz, len) = (s[0], s[1]);
        let inner = self.heads * self.head_dim;
        let conv_dim = inner + 2 * self.groups * self.state_dim;
        let proj = self.in_proj.forward(p, x)?;
        let parts = ops::split_at_indices(&proj, &[inner, inner + conv_dim], -1)?;
        let (gate, conv_in, dt) = (&parts[0], &parts[1], &parts[2]);
        let padded = conv_window_into(state, 0, conv_in)?;
        let conv_out = silu(&self.conv.forward(p, &padded)?)?;
        let shape = mamba2::Shape {
            heads: self.heads,
            head_dim: self.head_dim,
            groups: self.groups,
            state_dim: self.state_dim,
            dt_limit: self.dt_limit,
        };
        let gn = self.groups * self.state_dim;
        // One run of the SSM over `x`'s positions from state `s`.
        let ssm = |conv_out: &Array, dt: &Array, s: &Array| -> Result<(Array, Array)> {
            let n = conv_out.shape()[1];
            if n == 1 && self.fused_decode && mamba2::fused_decode_supported(shape) {
                // One token on CUDA: the whole SSM step in one kernel.
                return mamba2::decode_fused(self.inputs(p, conv_out, dt)?, s, shape);
            }
            // The SSD form for any length, as mlx-lm's `ssm_attn` runs it
            // off Metal (decode included), so low-precision rounding matches.
            let cs = ops::split_at_indices(conv_out, &[inner, inner + gn], -1)?;
            let hs = ops::reshape(&cs[0], &[bsz, n, self.heads, self.head_dim])?;
            let bm = ops::reshape(&cs[1], &[bsz, n, self.groups, self.state_dim])?;
            let cm = ops::reshape(&cs[2], &[bsz, n, self.groups, self.state_dim])?;
            self.ssm(p, &hs, dt, &bm, &cm, s)
        };
        let fused = self.fused_decode && mamba2::fused_decode_supported(shape);
        let y = if state.keeps_positions() && len > 1 && fused {
            // A verify run on CUDA: the decode kernel over every position
            // in one launch, keeping the state after each.
            let inputs = self.inputs(p, &conv_out, dt)?;
            let (y, states) = mamba2::steps_fused(inputs, &state[1], shape, true)?;
            state.set_positions(1, states)?;
            y
        } else if state.keeps_positions() && len > 1 {
            // A verify run: the decode step per position, keeping the
            // state after each.
            let mut ys = Vec::with_capacity(len as usize);
            let mut after = Vec::with_capacity(len as usize);
            let mut s = state[1].clone();
            for t in 0..len {
                let at = |x: &Array| -> Result<Array> { Ok(x.try_index((.., t..t + 1))?) };
                let (y, next) = ssm(&at(&conv_out)?, &at(dt)?, &s)?;
                ys.push(y);
                after.push(next.clone());
                s = next;
            }
            state.set(1, after)?;
            ops::concatenate(&ys, 1)?
        } else {
            let (y, next) = ssm(&conv_out, dt, &state[1])?;
            state.set(1, vec![next])?;
            y
        };
        let y = ops::reshape(&y, &[bsz, len, inner])?;
        // Gated, grouped RMS norm (MambaRMSNormGated).
        let y = swiglu(gate, &y)?;
        let normed = match &self.group_share {
            Some(share) => share.rms_norm(&y, self.eps)?,
            None => {
                let grouped = ops::unflatten(&y, -1, &[-1, inner / self.groups])?;
                fast::rms_norm(&grouped, None, self.eps)?.flatten(-2, -1)?
            }
        };
        let normed = ops::multiply(p.get(self.gate_norm)?, normed)?;
        self.out_proj.forward(p, &normed)
    }
}

/// `mx.repeat(x, r, axis=1)` for a 4-D array.
fn repeat_axis1(x: &Array, r: i32) -> Result<Array> {
    if r == 1 {
        return Ok(x.clone());
    }
    let s = x.shape().to_vec();
    let e = x.expand_dims(2)?;
    let b = ops::broadcast_to(&e, &[s[0], s[1], r, s[2], s[3]])?;
    Ok(ops::reshape(&b, &[s[0], s[1] * r, s[2], s[3]])?)
}

impl Mixer for Mamba2 {
    fn kind(&self) -> &str {
        "mamba2"
    }

    fn params(&self) -> Vec<ParamId> {
        let mut v = vec![self.dt_bias, self.a_log, self.d, self.gate_norm];
        v.extend(self.in_proj.params());
        v.extend(self.conv.params());
        v.extend(self.out_proj.params());
        v
    }

    fn grows(&self) -> bool {
        false
    }

    fn unsharded(&self) -> Option<String> {
        // Built for its rank's groups and heads (the refusal is in `build`).
        None
    }

    fn state_len(&self) -> usize {
        2
    }

    fn quantizable(&self) -> Vec<ParamId> {
        [&self.in_proj, &self.out_proj]
            .iter()
            .filter_map(|l| l.quantizable())
            .collect()
    }

    fn make_caches(&self, batch: usize, dtype: Dtype) -> Result<Vec<Box<dyn Cache>>> {
        let conv_dim = self.heads * self.head_dim + 2 * self.groups * self.state_dim;
        let state = [self.heads, self.head_dim, self.state_dim];
        let c = StateCache::recurrent("mamba2", batch, (self.kernel, conv_dim), state, dtype)?;
        Ok(vec![Box::new(c)])
    }

    fn before_cache(&self, p: &Params, x: &Array, state: &mut State<'_>) -> Result<Carry> {
        Ok(vec![self.mixer(p, x, state)?])
    }

    fn describe(&self) -> String {
        format!(
            "mamba2 heads={} dh={} ds={} groups={} conv={}",
            self.heads, self.head_dim, self.state_dim, self.groups, self.kernel
        )
    }
}
