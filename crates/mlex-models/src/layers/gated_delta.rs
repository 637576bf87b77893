//! The `gated_delta` layer kind: Gated DeltaNet linear attention
//! (Yang, Kautz, Hatamizadeh, *Gated Delta Networks*, 2024) as used by
//! Qwen3-Next and Qwen3.5, followed by a post-norm MLP or MoE. Reference:
//! mlx-lm `models/qwen3_next.py`, `qwen3_5.py`, `gated_delta.py`.
//!
//! Per token `t`, per value head (state `S` of `[Dv, Dk]`, kept in f32):
//! `S = S * g_t; kv = S k_t; S = S + k_t ⊗ (v_t - kv) * beta_t; y_t = S q_t`,
//! with `g = exp(-exp(A_log) * softplus(a + dt_bias))`, `beta = sigmoid(b)`,
//! q/k L2-normalised (q also scaled by `Dk^-1/2`), after a causal depthwise
//! convolution over the concatenated q, k, v projections.
//!
//! State: conv window `[B, K-1, C]` and recurrent state `[B, Hv, Dv, Dk]`;
//! fixed size, so the whole layer is one pure phase.

use super::ffn::Ffn;
use super::{ffn_spec, layer_norm, size, FfnSizes};
use mlex_cache::{conv_window_step, StateCache};
use mlex_core::cache::Cache;
use mlex_core::config::parse_value;
use mlex_core::error::Result;
use mlex_core::layer::{BuildCtx, Carry, Layer, LayerKind, StateKind};
use mlex_core::nn::{silu, DepthwiseConv, FusedLinear, Linear, Norm, NormKind, RmsNorm};
use mlex_core::params::{ParamId, Params};
use mlex_kernels::{gated_delta, Dispatch};
use mlx_rs::{ops, Array, Dtype};
use serde::Deserialize;

fn d_mixer() -> String {
    "linear_attn".into()
}
fn d_layout() -> String {
    "qwen3_5".into()
}
fn d_input_norm() -> String {
    "input_layernorm".into()
}
fn d_post_norm() -> Option<String> {
    Some("post_attention_layernorm".into())
}
fn d_mlp() -> String {
    "swiglu".into()
}
fn d_mlp_prefix() -> String {
    "mlp".into()
}

/// Options of the `gated_delta` kind: its sizes (named after the config
/// keys they usually come from), weight names and feed-forward.
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
    /// Epsilon of the layer's norms.
    #[serde(default = "super::default_eps")]
    pub norm_eps: f64,
    /// Input and post norms: `rms` (default) or `layer_norm` (the mixer's
    /// gated norm is always RMS).
    #[serde(default)]
    pub norm_type: NormKind,
    /// Feed-forward sizes (when `mlp` is not `none`).
    #[serde(default)]
    pub ffn_sizes: FfnSizes,
    /// Mixer module name.
    #[serde(default = "d_mixer")]
    pub mixer: String,
    /// `qwen3_5` (separate in_proj_qkv/z/b/a) or `qwen3_next` (fused
    /// in_proj_qkvz/ba, grouped per key head).
    #[serde(default = "d_layout")]
    pub layout: String,
    /// Input norm name.
    #[serde(default = "d_input_norm")]
    pub input_norm: String,
    /// Post norm name (`null`: no MLP part).
    #[serde(default = "d_post_norm")]
    pub post_norm: Option<String>,
    /// Feed-forward kind (`swiglu`, `qwen_moe`, `none`).
    #[serde(default = "d_mlp")]
    pub mlp: String,
    /// Feed-forward module name.
    #[serde(default = "d_mlp_prefix")]
    pub mlp_prefix: String,
}

/// The input projections, one product in either layout: Qwen3.5's
/// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, or Qwen3-Next's
/// `in_proj_qkvz`, `in_proj_ba` (grouped per key head).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    Qwen35,
    Qwen3Next,
}

/// A built Gated DeltaNet layer.
pub struct GatedDelta {
    input_norm: Norm,
    layout: Layout,
    proj: FusedLinear,
    conv: DepthwiseConv,
    dt_bias: ParamId,
    a_log: ParamId,
    norm: RmsNorm,
    out_proj: Linear,
    post_norm: Option<Norm>,
    ffn: Option<Ffn>,
    nk: i32,
    nv: i32,
    dk: i32,
    dv: i32,
    kernel: i32,
}

/// The registered `gated_delta` kind.
pub struct GatedDeltaKind;

impl LayerKind for GatedDeltaKind {
    fn name(&self) -> &'static str {
        "gated_delta"
    }
    fn option_keys(&self) -> &'static [&'static str] {
        mlex_core::config::struct_fields::<GatedDeltaOptions>()
    }
    fn state(&self) -> StateKind {
        StateKind::Fixed
    }
    fn summary(&self) -> &'static str {
        "pre-norm Gated DeltaNet (Qwen3-Next / Qwen3.5 layouts), conv window + f32 recurrent state (+ MLP/MoE)"
    }
    fn build(&self, ctx: &mut BuildCtx<'_>) -> Result<Box<dyn Layer>> {
        let o: GatedDeltaOptions = parse_value(
            ctx.options,
            ctx.config.file(),
            &format!("options of layer {} (gated_delta)", ctx.index),
        )?;
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
        let eps = o.norm_eps as f32;
        let mixer_prefix = ctx.path(&o.mixer);
        let m = |n: &str| format!("{mixer_prefix}.{n}");
        let (key_dim, value_dim) = (nk * dk, nv * dv);
        let conv_dim = 2 * key_dim + value_dim;
        let input_norm = layer_norm(ctx, o.norm_type, &o.input_norm, hidden, eps)?;
        let (layout, parts) = match o.layout.as_str() {
            "qwen3_5" => (
                Layout::Qwen35,
                vec![
                    (m("in_proj_qkv"), conv_dim),
                    (m("in_proj_z"), value_dim),
                    (m("in_proj_b"), nv),
                    (m("in_proj_a"), nv),
                ],
            ),
            "qwen3_next" => (
                Layout::Qwen3Next,
                vec![
                    (m("in_proj_qkvz"), 2 * key_dim + 2 * value_dim),
                    (m("in_proj_ba"), 2 * nv),
                ],
            ),
            other => {
                return Err(ctx.config.error(
                    "layout",
                    format!("unknown gated_delta layout `{other}` (qwen3_5, qwen3_next)"),
                ))
            }
        };
        let parts: Vec<(&str, i32)> = parts.iter().map(|(n, w)| (n.as_str(), *w)).collect();
        let proj = FusedLinear::load(ctx.weights, &parts, hidden, false)?;
        let conv = DepthwiseConv::load(ctx.weights, &m("conv1d"), conv_dim, kernel, false)?;
        let dt_bias = ctx.weights.take(&m("dt_bias"), &[nv])?;
        let a_log = ctx.weights.take(&m("A_log"), &[nv])?;
        let norm = RmsNorm::load(ctx.weights, &m("norm"), dv, eps)?;
        let out_proj = Linear::load(ctx.weights, &m("out_proj"), value_dim, hidden, false)?;
        let (post_norm, ffn) = match (&o.post_norm, o.mlp.as_str()) {
            (Some(n), kind) if kind != "none" => {
                let spec = ffn_spec(ctx, "gated_delta", hidden, kind, false, &o.ffn_sizes)?;
                (
                    Some(layer_norm(ctx, o.norm_type, n, hidden, eps)?),
                    Some(Ffn::load(ctx.weights, &ctx.path(&o.mlp_prefix), &spec)?),
                )
            }
            _ => (None, None),
        };
        Ok(Box::new(GatedDelta {
            input_norm,
            layout,
            proj,
            conv,
            dt_bias,
            a_log,
            norm,
            out_proj,
            post_norm,
            ffn,
            nk,
            nv,
            dk,
            dv,
            kernel,
        }))
    }
}

impl GatedDelta {
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

    fn mixer(&self, p: &Params, x: &Array, state: &mut [Array]) -> Result<Array> {
        let s = x.shape();
        let (bsz, len) = (s[0], s[1]);
        let (qkv, z, b, a) = self.project(p, x)?;
        let (padded, window) = conv_window_step(&state[0], &qkv)?;
        state[0] = window;
        let conv_out = silu(&self.conv.forward(p, &padded)?)?;
        let heads = gated_delta::Heads {
            key_heads: self.nk,
            value_heads: self.nv,
            key_dim: self.dk,
            value_dim: self.dv,
        };
        let (a_log, dt_bias) = (p.get(self.a_log)?, p.get(self.dt_bias)?);
        let dispatch = Dispatch::current();
        let out = if len == 1 {
            // One token (decode) is traced inside its compiled segment.
            let fused = dispatch.fused_decode && gated_delta::fused_decode_supported(heads);
            let step = if fused {
                gated_delta::decode_fused
            } else {
                gated_delta::decode_ops
            };
            let (y, next) = step(&conv_out, &a, &b, a_log, dt_bias, &state[1], heads)?;
            state[1] = next;
            y
        } else {
            let prepared = gated_delta::prepare(&conv_out, &a, &b, a_log, dt_bias, heads)?;
            let method = dispatch.gated_delta_method(len as usize);
            let res = gated_delta::sequence(prepared.sequence(), &state[1], method, false)?;
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

impl Layer for GatedDelta {
    fn kind(&self) -> &str {
        "gated_delta"
    }

    fn params(&self) -> Vec<ParamId> {
        let mut v = self.input_norm.params();
        v.extend([self.dt_bias, self.a_log, self.norm.weight]);
        v.extend(self.proj.params());
        v.extend(self.conv.params());
        v.extend(self.out_proj.params());
        if let Some(n) = &self.post_norm {
            v.extend(n.params());
        }
        if let Some(f) = &self.ffn {
            v.extend(f.params());
        }
        v
    }

    fn grows(&self) -> bool {
        false
    }

    fn quantizable(&self) -> Vec<ParamId> {
        let mut v = self.proj.quantizable();
        v.extend(self.out_proj.quantizable());
        if let Some(f) = &self.ffn {
            v.extend(f.quantizable());
        }
        v
    }

    fn make_caches(&self, batch: usize, dtype: Dtype) -> Result<Vec<Box<dyn Cache>>> {
        let conv_dim = 2 * self.nk * self.dk + self.nv * self.dv;
        Ok(vec![Box::new(StateCache::gated_delta(
            batch,
            self.kernel,
            conv_dim,
            self.nv,
            self.dv,
            self.dk,
            dtype,
        )?)])
    }

    fn head(&self, p: &Params, x: &Array, state: &mut [Array]) -> Result<Carry> {
        let mixed = self.mixer(p, &self.input_norm.forward(p, x)?, state)?;
        let out = match (&self.post_norm, &self.ffn) {
            (Some(n), Some(f)) => {
                let (h, m) = super::add_then_norm(p, n, x, &mixed)?;
                ops::add(&h, f.forward(p, &m, None)?)?
            }
            _ => ops::add(x, mixed)?,
        };
        Ok(vec![out])
    }

    fn describe(&self) -> String {
        format!(
            "gated_delta hk={} hv={} dk={} dv={} conv={}{}",
            self.nk,
            self.nv,
            self.dk,
            self.dv,
            self.kernel,
            match &self.ffn {
                Some(Ffn::QwenMoe(_)) => " + moe",
                Some(_) => " + mlp",
                None => "",
            }
        )
    }
}

mlex_core::register_layer_kind!("gated_delta", GatedDeltaKind);
