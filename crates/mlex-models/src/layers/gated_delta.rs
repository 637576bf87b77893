//! The `gated_delta` mixer: Gated DeltaNet linear attention
//! (Yang, Kautz, Hatamizadeh, *Gated Delta Networks*, 2024) as used by
//! Qwen3-Next and Qwen3.5. Reference:
//! mlx-lm `models/qwen3_next.py`, `qwen3_5.py`, `gated_delta.py`.
//!
//! Per token `t`, per value head (state `S` of `[Dv, Dk]`, kept in f32):
//! `S = S * g_t; kv = S k_t; S = S + k_t ⊗ (v_t - kv) * beta_t; y_t = S q_t`,
//! with `g = exp(-exp(A_log) * softplus(a + dt_bias))`, `beta = sigmoid(b)`,
//! q/k L2-normalised (q also scaled by `Dk^-1/2`), after a causal depthwise
//! convolution over the concatenated q, k, v projections.
//!
//! State: conv window `[B, K-1, C]` and recurrent state `[B, Hv, Dv, Dk]`;
//! fixed size, so the whole mixer is one pure phase.

use crate::block::{group_split, size};
use mlex_cache::{conv_window_into, StateCache};
use mlex_core::cache::Cache;
use mlex_core::dispatch::Dispatch;
use mlex_core::distributed::Split;
use mlex_core::error::{Error, Result};
use mlex_core::layer::{BuildCtx, Carry, Mixer, State, StateKind};
use mlex_core::nn::{silu, DepthwiseConv, FusedLinear, Linear, RmsNorm};
use mlex_core::params::{ParamId, Params};
use mlex_kernels::{gated_delta, gated_delta_method};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use serde::Deserialize;

fn d_mixer() -> String {
    "linear_attn".into()
}
/// Options of the `gated_delta` mixer: its sizes (named after the config
/// keys they usually come from) and weight names.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatedDeltaOptions {
    /// Residual width.
    pub hidden_size: i32,
    /// Value heads.
    pub linear_num_value_heads: i32,
    /// Key heads (divide the value heads).
    pub linear_num_key_heads: i32,
    /// Key head size.
    pub linear_key_head_dim: i32,
    /// Value head size.
    pub linear_value_head_dim: i32,
    /// Short convolution width.
    pub linear_conv_kernel_dim: i32,
    /// Epsilon of the gated RMS norm.
    #[serde(default = "crate::block::default_eps")]
    pub norm_eps: f64,
    /// Mixer module name.
    #[serde(default = "d_mixer")]
    pub mixer: String,
    /// `qwen3_5` (separate in_proj_qkv/z/b/a, the default) or
    /// `qwen3_next` (fused in_proj_qkvz/ba, grouped per key head).
    #[serde(default)]
    pub layout: Layout,
}

/// The input projections, one product in either layout: Qwen3.5's
/// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, or Qwen3-Next's
/// `in_proj_qkvz`, `in_proj_ba` (grouped per key head).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum Layout {
    /// Separate projections.
    #[default]
    #[serde(rename = "qwen3_5")]
    Qwen35,
    /// Fused projections, grouped per key head.
    #[serde(rename = "qwen3_next")]
    Qwen3Next,
}

/// A built Gated DeltaNet mixer.
pub struct GatedDelta {
    layout: Layout,
    proj: FusedLinear,
    conv: DepthwiseConv,
    dt_bias: ParamId,
    a_log: ParamId,
    norm: RmsNorm,
    out_proj: Linear,
    /// The backend policy it was built with (fused decode, chunk size).
    dispatch: Dispatch,
    nk: i32,
    nv: i32,
    dk: i32,
    dv: i32,
    kernel: i32,
}

mlex_core::register_mixer_kind! {
    /// The registered `gated_delta` mixer kind.
    kind GatedDeltaKind = "gated_delta" {
        options: GatedDeltaOptions,
        state: StateKind::Fixed,
        summary: "Gated DeltaNet (Qwen3-Next / Qwen3.5 layouts), conv window + f32 recurrent state",
        build: GatedDelta::build,
    }
}

impl GatedDelta {
    fn build(ctx: &mut BuildCtx<'_>, o: &GatedDeltaOptions) -> Result<Self> {
        let sz = |name: &str, v: i32| size(ctx, "gated_delta", name, v);
        let hidden = sz("hidden_size", o.hidden_size)?;
        let nv = sz("linear_num_value_heads", o.linear_num_value_heads)?;
        let nk = sz("linear_num_key_heads", o.linear_num_key_heads)?;
        let dk = sz("linear_key_head_dim", o.linear_key_head_dim)?;
        let dv = sz("linear_value_head_dim", o.linear_value_head_dim)?;
        let kernel = sz("linear_conv_kernel_dim", o.linear_conv_kernel_dim)?;
        if nv % nk != 0 {
            return Err(ctx.config.error(
                "linear_num_value_heads",
                format!("{nv} value heads are not a multiple of {nk} key heads"),
            ));
        }
        // Under --tp each rank keeps whole key heads and the value heads
        // that read them (value head h reads key head h / (nv / nk)). With
        // fewer key heads than ranks (Qwen3.5's layout, whose q/k rows are
        // not interleaved with v), `k_copies` consecutive ranks share each.
        let qwen35 = o.layout == Layout::Qwen35;
        let (nk, nv, k_copies) = group_split(ctx, nk, nv, qwen35).map_err(|n| {
            Error::Other(format!(
                "--tp {n}: gated_delta of layer {} ({}) cannot be split: {nk} key heads \
                 (linear_num_key_heads) do not split into {n} equal parts{}",
                ctx.index,
                ctx.prefix,
                if qwen35 {
                    ""
                } else {
                    " (the Qwen3-Next layout interleaves them with the value heads)"
                }
            ))
        })?;
        let eps = o.norm_eps as f32;
        let mixer_prefix = ctx.path(&o.mixer);
        let m = |n: &str| format!("{mixer_prefix}.{n}");
        let (key_dim, value_dim) = (nk * dk, nv * dv);
        let conv_dim = 2 * key_dim + value_dim;
        let (layout, parts) = match o.layout {
            Layout::Qwen35 => (
                Layout::Qwen35,
                vec![
                    (m("in_proj_qkv"), conv_dim),
                    (m("in_proj_z"), value_dim),
                    (m("in_proj_b"), nv),
                    (m("in_proj_a"), nv),
                ],
            ),
            Layout::Qwen3Next => (
                Layout::Qwen3Next,
                vec![
                    (m("in_proj_qkvz"), 2 * key_dim + 2 * value_dim),
                    (m("in_proj_ba"), 2 * nv),
                ],
            ),
        };
        let parts: Vec<(&str, i32)> = parts.iter().map(|(n, w)| (n.as_str(), *w)).collect();
        // The conv channels (and Qwen3.5's in_proj_qkv rows) are q | k | v:
        // each segment splits by heads. Qwen3-Next's projections are
        // grouped per key head and split as they are.
        let qkv_segments = [(key_dim, k_copies), (key_dim, k_copies), (value_dim, 1)];
        let ld = &mut *ctx.weights;
        let proj = ld.with_split(Split::Output, |ld| {
            ld.with_shared_segments(&m("in_proj_qkv"), &qkv_segments, |ld| {
                FusedLinear::load(ld, &parts, hidden, false)
            })
        })?;
        let (conv, dt_bias, a_log) = ld.with_split(Split::Leading, |ld| {
            let conv = ld.with_shared_segments(&m("conv1d"), &qkv_segments, |ld| {
                DepthwiseConv::load(ld, &m("conv1d"), conv_dim, kernel, false)
            })?;
            Ok((
                conv,
                ld.take(&m("dt_bias"), &[nv])?,
                ld.take(&m("A_log"), &[nv])?,
            ))
        })?;
        let norm = RmsNorm::load(ld, &m("norm"), dv, eps)?;
        let out_proj = ld.with_split(Split::Input, |ld| {
            Linear::load(ld, &m("out_proj"), value_dim, hidden, false)
        })?;
        Ok(GatedDelta {
            layout,
            proj,
            conv,
            dt_bias,
            a_log,
            norm,
            out_proj,
            dispatch: ctx.weights.dispatch().clone(),
            nk,
            nv,
            dk,
            dv,
            kernel,
        })
    }

    /// Splits the projections into (qkv `[B,S,C]`, z `[B,S,Hv,Dv]`,
    /// b `[B,S,Hv]`, a `[B,S,Hv]`).
    fn project(&self, p: &Params, x: &Array) -> Result<(Array, Array, Array, Array)> {
        let s = x.shape();
        let (bsz, len) = (s[0], s[1]);
        let out = self.proj.forward(p, x)?;
        match self.layout {
            Layout::Qwen35 => Ok((
                out[0].clone(),
                ops::reshape(&out[1], &[bsz, len, self.nv, self.dv])?,
                out[2].clone(),
                out[3].clone(),
            )),
            Layout::Qwen3Next => {
                let (nk, dk, nv, dv) = (self.nk, self.dk, self.nv, self.dv);
                let r = nv / nk;
                let mixed = ops::reshape(&out[0], &[bsz, len, nk, -1])?;
                let parts = ops::split_at_indices(&mixed, &[dk, 2 * dk, 2 * dk + r * dv], -1)?;
                let mixed_ba = ops::reshape(&out[1], &[bsz, len, nk, -1])?;
                let ba_parts = ops::split_at_indices(&mixed_ba, &[r], -1)?;
                let flat = |a: &Array| ops::reshape(a, &[bsz, len, -1]);
                let v = ops::reshape(&parts[2], &[bsz, len, -1, dv])?;
                let qkv = ops::concatenate(&[flat(&parts[0])?, flat(&parts[1])?, flat(&v)?], -1)?;
                Ok((
                    qkv,
                    ops::reshape(&parts[3], &[bsz, len, -1, dv])?,
                    ops::reshape(&ba_parts[0], &[bsz, len, nv])?,
                    ops::reshape(&ba_parts[1], &[bsz, len, nv])?,
                ))
            }
        }
    }

    fn mixer(&self, p: &Params, x: &Array, state: &mut State<'_>) -> Result<Array> {
        let s = x.shape();
        let (bsz, len) = (s[0], s[1]);
        let (qkv, z, b, a) = self.project(p, x)?;
        let padded = conv_window_into(state, 0, &qkv)?;
        let conv_out = silu(&self.conv.forward(p, &padded)?)?;
        let heads = gated_delta::Heads {
            key_heads: self.nk,
            value_heads: self.nv,
            key_dim: self.dk,
            value_dim: self.dv,
        };
        let (a_log, dt_bias) = (p.get(self.a_log)?, p.get(self.dt_bias)?);
        let whole = gated_delta::LayerInputs {
            conv: &conv_out,
            a: &a,
            b: &b,
            a_log,
            dt_bias,
        };
        let dispatch = &self.dispatch;
        let fused = dispatch.fused_decode && gated_delta::fused_decode_supported(heads);
        let out = if fused && (len == 1 || state.keeps_positions()) {
            // One token (decode, traced inside its compiled segment), or a
            // verify run's tokens in one launch of the same kernel, which
            // keeps the state after each position: the one decode reaches.
            let keep_all = state.keeps_positions();
            let (y, states) = gated_delta::steps_fused(whole, &state[1], heads, keep_all)?;
            state.set_positions(1, states)?;
            y
        } else if len == 1 || state.keeps_positions() {
            // The ops form of the same step, per position.
            let mut ys = Vec::with_capacity(len as usize);
            let mut after = Vec::with_capacity(len as usize);
            let mut s = state[1].clone();
            for t in 0..len {
                let at = |x: &Array| -> Result<Array> {
                    Ok(if len == 1 {
                        x.clone()
                    } else {
                        x.try_index((.., t..t + 1))?
                    })
                };
                let (conv, a, b) = (at(&conv_out)?, at(&a)?, at(&b)?);
                let x = gated_delta::LayerInputs {
                    conv: &conv,
                    a: &a,
                    b: &b,
                    ..whole
                };
                let (y, next) = gated_delta::decode_ops(x, &s, heads)?;
                ys.push(y);
                after.push(next.clone());
                s = next;
            }
            state.set(1, after)?;
            if len == 1 {
                ys.swap_remove(0)
            } else {
                ops::concatenate(&ys, 1)?
            }
        } else {
            let prepared = gated_delta::prepare(whole, heads)?;
            let method = gated_delta_method(dispatch, len as usize);
            let chunk = match method {
                gated_delta::Method::Chunked { chunk } => Some(chunk),
                gated_delta::Method::Recurrent => None,
            };
            let res = match dispatch.scan_piece_of(chunk, bsz as usize, len as usize) {
                Some(piece) => {
                    gated_delta::sequence_in_pieces(prepared.sequence(), &state[1], method, piece)?
                }
                None => gated_delta::sequence(prepared.sequence(), &state[1], method, false)?,
            };
            state[1] = res.state;
            res.y
        };
        // Gated RMS norm: silu(z) * rms_norm(out), in f32, back to out's dtype.
        let normed = self.norm.forward(p, &out)?;
        let gated = ops::multiply(
            silu(&z.as_dtype(Dtype::Float32)?)?,
            normed.as_dtype(Dtype::Float32)?,
        )?
        .as_dtype(out.dtype())?;
        self.out_proj
            .forward(p, &ops::reshape(&gated, &[bsz, len, -1])?)
    }
}

impl Mixer for GatedDelta {
    fn kind(&self) -> &str {
        "gated_delta"
    }

    fn params(&self) -> Vec<ParamId> {
        let mut v = vec![self.dt_bias, self.a_log, self.norm.weight];
        v.extend(self.proj.params());
        v.extend(self.conv.params());
        v.extend(self.out_proj.params());
        v
    }

    fn grows(&self) -> bool {
        false
    }

    fn unsharded(&self) -> Option<String> {
        // Built for its rank's heads (the refusal is in `build`).
        None
    }

    fn state_len(&self) -> usize {
        2
    }

    fn quantizable(&self) -> Vec<ParamId> {
        let mut v = self.proj.quantizable();
        v.extend(self.out_proj.quantizable());
        v
    }

    fn make_caches(&self, batch: usize, dtype: Dtype) -> Result<Vec<Box<dyn Cache>>> {
        let conv_dim = 2 * self.nk * self.dk + self.nv * self.dv;
        let state = [self.nv, self.dv, self.dk];
        let c = StateCache::recurrent("gated_delta", batch, (self.kernel, conv_dim), state, dtype)?;
        Ok(vec![Box::new(c)])
    }

    fn before_cache(&self, p: &Params, x: &Array, state: &mut State<'_>) -> Result<Carry> {
        Ok(vec![self.mixer(p, x, state)?])
    }

    fn describe(&self) -> String {
        format!(
            "gated_delta hk={} hv={} dk={} dv={} conv={}",
            self.nk, self.nv, self.dk, self.dv, self.kernel,
        )
    }
}
