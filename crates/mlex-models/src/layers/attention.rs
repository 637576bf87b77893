//! The `attention` mixer: grouped-query attention with a growing KV cache
//! (Vaswani et al. 2017; GQA: Ainslie et al. 2023). Reference: mlx-lm
//! `models/llama.py`, `qwen3.py`, `qwen3_next.py`.
//!
//! Covers llama/qwen2/qwen3, Qwen3-Next/Qwen3.5 full attention (output
//! gate, partial rotary, pre-RoPE q/k norms), NemotronH `*` (no RoPE),
//! StableLM (attention product in float32) and DharaAR (canon convolutions
//! at A and B; q/k norms after RoPE; per-layer RoPE frequencies). The
//! block around it holds the norms, residuals and feed-forward.
//!
//! Phases: before the cache = [canon A], projections, [canon B], [q/k
//! norm]; `grow` = RoPE at the cache offset, [q/k norm], KV write, SDPA;
//! after the cache = [gate], o_proj.

use super::canon::{self, Canon, CanonOptions};
use super::rope::Rope;
use super::sdpa::{attend, quantized_attend, AttendPolicy};
use crate::block::size;
use mlex_cache::{KvCache, RotatingKvCache};
use mlex_core::cache::{Cache, KvRead};
use mlex_core::distributed::Split;
use mlex_core::error::{Error, Result};
use mlex_core::layer::{BuildCtx, Carry, Mixer, State, StateKind};
use mlex_core::nn::{FusedLinear, Linear, RmsNorm};
use mlex_core::params::{ParamId, Params};
use mlex_core::weights::WeightLoader;
use mlx_rs::{fast, ops, Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

/// Where q/k RMS norms apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    /// No q/k norms.
    None,
    /// Before RoPE (Qwen3, Qwen3-Next, Qwen3.5).
    PreRope,
    /// After RoPE (DharaAR).
    PostRope,
    /// Before RoPE, over the whole projection (all heads at once; OLMo 2).
    Full,
}

fn d_attn() -> String {
    "self_attn".into()
}
fn d_qk_norm() -> QkNorm {
    QkNorm::None
}
fn d_true() -> bool {
    true
}

/// Options of the `attention` kind: its sizes (named after the config keys
/// they usually come from), weight-name templates and switches.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionOptions {
    /// Residual width.
    pub hidden_size: i32,
    /// Query heads.
    pub num_attention_heads: i32,
    /// Key/value heads (default: as many as query heads).
    pub num_key_value_heads: Option<i32>,
    /// Head size (default: `hidden_size / num_attention_heads`).
    pub head_dim: Option<i32>,
    /// Epsilon of the q/k norms.
    #[serde(default = "crate::block::default_eps")]
    pub norm_eps: f64,
    /// Attention module name under the layer prefix.
    #[serde(default = "d_attn")]
    pub attn: String,
    /// Biases on q/k/v projections.
    #[serde(default)]
    pub qkv_bias: bool,
    /// Bias on the output projection.
    #[serde(default)]
    pub o_bias: bool,
    /// q/k norm placement.
    #[serde(default = "d_qk_norm")]
    pub qk_norm: QkNorm,
    /// `q_proj` also yields a sigmoid output gate (Qwen3-Next).
    #[serde(default)]
    pub gated: bool,
    /// Apply RoPE.
    #[serde(default = "d_true")]
    pub rope: bool,
    /// Rotate `pair-wise` (traditional) instead of halves.
    #[serde(default)]
    pub rope_traditional: bool,
    /// Fraction of head dims rotated (default 1).
    pub partial_rotary_factor: Option<f64>,
    /// RoPE base (default 10000).
    pub rope_theta: Option<f64>,
    /// RoPE scaling object (`type`/`rope_type` default, linear, llama3, mrope).
    pub rope_scaling: Option<Value>,
    /// Use the layer's `rotary_emb.inv_freq` tensor when present.
    #[serde(default)]
    pub rope_inv_freq: bool,
    /// Sliding window (rotating cache) size.
    pub sliding_window: Option<usize>,
    /// The attention scale (default `head_dim^-1/2`; Granite's
    /// `attention_multiplier`).
    pub scale: Option<f64>,
    /// Queries and keys in float32 for the attention product, its output
    /// cast back to the values' dtype (mlx-lm's StableLM); the cache keeps
    /// the model's dtype.
    #[serde(default)]
    pub attention_f32: bool,
    /// Canon convolutions (DharaAR): this mixer's positions A and B (the
    /// block takes C and D from the same option).
    pub canon: Option<CanonOptions>,
}

/// A built attention mixer.
pub struct Attention {
    /// q (with the gate when `gated`), k and v: one product.
    qkv: FusedLinear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    qk_norm: QkNorm,
    gated: bool,
    rope: Option<Rope>,
    inv_freq: Option<ParamId>,
    canon_a: Option<Canon>,
    canon_b: Option<[Canon; 3]>,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    kernel: i32,
    scale: f32,
    window: Option<usize>,
    attention_f32: bool,
    /// How [`attend`] takes the calls MLX's fused attention serves badly.
    attend_policy: AttendPolicy,
    /// [`Dispatch::dequantize_kv_reads`](mlex_core::dispatch::Dispatch).
    dequantize_kv_reads: bool,
    hidden: i32,
    /// Under --tp (a full-width q/k norm sums its squares over the ranks).
    shard: Option<mlex_core::distributed::Shard>,
}

mlex_core::register_mixer_kind! {
    /// The registered `attention` mixer kind.
    kind AttentionKind = "attention" {
        options: AttentionOptions,
        state: StateKind::Growing,
        summary: "GQA attention with KV cache; RoPE variants, q/k norms, output gate, sliding window, canon A/B",
        build: Attention::build,
    }
}

impl Attention {
    fn build(ctx: &mut BuildCtx<'_>, o: &AttentionOptions) -> Result<Self> {
        let hidden = size(ctx, "attention", "hidden_size", o.hidden_size)?;
        let n_heads = size(
            ctx,
            "attention",
            "num_attention_heads",
            o.num_attention_heads,
        )?;
        let n_kv_heads = match o.num_key_value_heads {
            Some(n) => size(ctx, "attention", "num_key_value_heads", n)?,
            None => n_heads,
        };
        if n_heads % n_kv_heads != 0 {
            return Err(ctx.config.error(
                "num_key_value_heads",
                format!(
                    "{n_heads} attention heads are not a multiple of {n_kv_heads} key/value heads"
                ),
            ));
        }
        let head_dim = match o.head_dim {
            Some(d) => size(ctx, "attention", "head_dim", d)?,
            None if hidden % n_heads == 0 => hidden / n_heads,
            None => {
                return Err(ctx.config.error(
                    "num_attention_heads",
                    format!(
                    "{n_heads} heads do not divide hidden_size {hidden} (and there is no head_dim)"
                ),
                ))
            }
        };
        // Under --tp each rank keeps whole heads: its share of the query
        // heads and of the key/value heads they read. With fewer key/value
        // heads than ranks, `kv_copies` consecutive ranks share each one
        // (as Megatron-LM replicates them).
        let (n_heads, n_kv_heads, kv_copies) = match ctx.weights.shard() {
            None => (n_heads, n_kv_heads, 1),
            Some(shard) => {
                let n = shard.size() as i32;
                let refuse = |what: String| {
                    Err(Error::Other(format!(
                        "--tp {n}: attention of layer {} ({}) cannot be split: {what}",
                        ctx.index, ctx.prefix
                    )))
                };
                if n_heads % n != 0 {
                    return refuse(format!(
                        "{n_heads} query heads do not split into {n} equal parts"
                    ));
                }
                if n_kv_heads % n == 0 {
                    (n_heads / n, n_kv_heads / n, 1)
                } else if n % n_kv_heads == 0 {
                    (n_heads / n, 1, (n / n_kv_heads) as usize)
                } else {
                    return refuse(format!(
                        "{n_kv_heads} key/value heads neither split into {n} equal parts nor \
                         divide {n} ranks"
                    ));
                }
            }
        };
        let eps = o.norm_eps as f32;
        let attn_prefix = ctx.path(&o.attn);
        let a = |n: &str| format!("{attn_prefix}.{n}");
        let q_out = n_heads * head_dim * if o.gated { 2 } else { 1 };
        let kv_out = n_kv_heads * head_dim;
        let shared = [a("k_proj"), a("v_proj"), a("k_norm")];
        let shared: Vec<&str> = shared.iter().map(String::as_str).collect();
        let qkv = ctx.weights.with_split(Split::Output, |ld| {
            ld.with_copies(&shared, kv_copies, |ld| {
                FusedLinear::load(
                    ld,
                    &[
                        (&a("q_proj"), q_out),
                        (&a("k_proj"), kv_out),
                        (&a("v_proj"), kv_out),
                    ],
                    hidden,
                    o.qkv_bias,
                )
            })
        })?;
        let o_proj = ctx.weights.with_split(Split::Input, |ld| {
            Linear::load(ld, &a("o_proj"), n_heads * head_dim, hidden, o.o_bias)
        })?;
        // Per head, or over the whole projection.
        let (q_width, k_width) = match o.qk_norm {
            QkNorm::Full => (n_heads * head_dim, n_kv_heads * head_dim),
            _ => (head_dim, head_dim),
        };
        // A full-width norm's weights split with the heads (its mean
        // square is summed over the ranks, `norm_full_width`); a per-head
        // norm is whole on every rank.
        let (q_norm, k_norm) = match o.qk_norm {
            QkNorm::None => (None, None),
            qk => {
                let load = |ld: &mut WeightLoader| -> Result<_> {
                    Ok((
                        Some(RmsNorm::load(ld, &a("q_norm"), q_width, eps)?),
                        Some(RmsNorm::load(ld, &a("k_norm"), k_width, eps)?),
                    ))
                };
                if qk == QkNorm::Full {
                    ctx.weights.with_split(Split::Leading, |ld| {
                        ld.with_copies(&shared, kv_copies, load)
                    })?
                } else {
                    load(ctx.weights)?
                }
            }
        };
        let inv_freq_name = a("rotary_emb.inv_freq");
        let inv_freq = if o.rope && o.rope_inv_freq && ctx.weights.has(&inv_freq_name) {
            Some(ctx.weights.take(&inv_freq_name, &[head_dim / 2])?)
        } else {
            None
        };
        let rope = if o.rope {
            let partial = o.partial_rotary_factor.unwrap_or(1.0);
            let dims = (head_dim as f64 * partial) as i32;
            let base = o.rope_theta.unwrap_or(10000.0) as f32;
            let scaling = o.rope_scaling.clone();
            Some(Rope::from_scaling(
                ctx.config,
                dims,
                base,
                o.rope_traditional,
                scaling.as_ref(),
            )?)
        } else {
            None
        };
        let (mut canon_a, mut canon_b, mut kernel) = (None, None, 0);
        if let Some(c) = CanonOptions::enabled(&o.canon, ctx)? {
            kernel = c.kernel;
            if c.set.contains('A') {
                canon_a = Some(Canon::load(
                    ctx.weights,
                    &ctx.path("canon_a.conv"),
                    hidden,
                    &c,
                )?);
            }
            if c.set.contains('B') {
                // Depthwise over the q/k/v channels: split with the heads.
                let shared = [a("canon_b_k.conv"), a("canon_b_v.conv")];
                let shared: Vec<&str> = shared.iter().map(String::as_str).collect();
                canon_b = Some(ctx.weights.with_split(Split::Leading, |ld| {
                    ld.with_copies(&shared, kv_copies, |ld| {
                        Ok([
                            Canon::load(ld, &a("canon_b_q.conv"), n_heads * head_dim, &c)?,
                            Canon::load(ld, &a("canon_b_k.conv"), n_kv_heads * head_dim, &c)?,
                            Canon::load(ld, &a("canon_b_v.conv"), n_kv_heads * head_dim, &c)?,
                        ])
                    })
                })?);
            }
        }
        Ok(Self {
            qkv,
            o_proj,
            q_norm,
            k_norm,
            qk_norm: o.qk_norm,
            gated: o.gated,
            rope,
            inv_freq,
            canon_a,
            canon_b,
            n_heads,
            n_kv_heads,
            head_dim,
            kernel,
            scale: o.scale.map_or((head_dim as f32).powf(-0.5), |s| s as f32),
            window: o.sliding_window,
            attention_f32: o.attention_f32,
            attend_policy: AttendPolicy::of(ctx.weights.dispatch()),
            dequantize_kv_reads: ctx.weights.dispatch().dequantize_kv_reads,
            hidden,
            shard: ctx.weights.shard().cloned(),
        })
    }

    /// Channel counts of the canon windows, in state order.
    fn canon_windows(&self) -> Vec<(&'static str, i32)> {
        let mut w = Vec::new();
        if self.canon_a.is_some() {
            w.push(("A", self.hidden));
        }
        if self.canon_b.is_some() {
            w.push(("Bq", self.n_heads * self.head_dim));
            w.push(("Bk", self.n_kv_heads * self.head_dim));
            w.push(("Bv", self.n_kv_heads * self.head_dim));
        }
        w
    }

    /// Whether `head` hands q and k on as views of the fused q/k/v product
    /// (no pre-RoPE norm or canon convolution computes them anew).
    fn qk_are_views(&self) -> bool {
        matches!(self.qkv, FusedLinear::One { .. })
            && !matches!(self.qk_norm, QkNorm::PreRope | QkNorm::Full)
            && self.canon_b.is_none()
    }

    /// RMS norm over the whole projection (all heads). Under --tp the
    /// rank holds its heads' part: the squares are summed over the ranks.
    fn norm_full_width(&self, p: &Params, norm: &RmsNorm, x: &Array) -> Result<Array> {
        let Some(shard) = &self.shard else {
            return norm.forward(p, x);
        };
        let xf = x.as_dtype(Dtype::Float32)?;
        let squares = shard.all_sum(&ops::square(&xf)?.sum_axis(-1, true)?)?;
        let width = (x.shape()[x.ndim() - 1] as usize * shard.size()) as f32;
        let mean = ops::divide(&squares, Array::from_f32(width))?;
        let inv = ops::rsqrt(ops::add(&mean, Array::from_f32(norm.eps))?)?;
        let y = ops::multiply(&xf, &inv)?.as_dtype(x.dtype())?;
        Ok(ops::multiply(&y, p.get(norm.weight)?)?)
    }

    fn heads(&self, x: &Array, heads: i32) -> Result<Array> {
        let s = x.shape();
        Ok(ops::reshape(x, &[s[0], s[1], heads, self.head_dim])?)
    }

    fn apply_rope(&self, p: &Params, x: &Array, at: &RopeAt) -> Result<Array> {
        let Some(rope) = &self.rope else {
            return Ok(x.clone());
        };
        match (self.inv_freq, at) {
            (Some(id), at) => {
                let freqs = ops::reciprocal(p.get(id)?)?;
                Ok(match at {
                    RopeAt::Offset(o) => {
                        fast::rope(x, rope.dims, rope.traditional, None, 1.0, *o as i32, &freqs)?
                    }
                    RopeAt::Rows(pos) => {
                        fast::rope_dynamic(x, rope.dims, rope.traditional, None, 1.0, pos, &freqs)?
                    }
                })
            }
            (None, RopeAt::Offset(o)) => rope.apply(x, *o),
            (None, RopeAt::Rows(pos)) => rope.apply_at(x, pos),
        }
    }
}

/// Where RoPE starts: one offset for the whole batch, or one per row.
enum RopeAt {
    Offset(usize),
    Rows(Array),
}

/// Index of the next canon window in the layer's state.
struct StateCursor(usize);

impl StateCursor {
    fn canon(
        &mut self,
        p: &Params,
        c: Option<&Canon>,
        x: Array,
        state: &mut State<'_>,
    ) -> Result<Array> {
        match c {
            None => Ok(x),
            Some(c) => {
                let y = c.forward(p, &x, state, self.0)?;
                self.0 += 1;
                Ok(y)
            }
        }
    }
}

impl Mixer for Attention {
    fn kind(&self) -> &str {
        "attention"
    }

    fn params(&self) -> Vec<ParamId> {
        let mut v = self.qkv.params();
        v.extend(self.o_proj.params());
        for n in [&self.q_norm, &self.k_norm].into_iter().flatten() {
            v.push(n.weight);
        }
        v.extend(self.inv_freq);
        if let Some(c) = &self.canon_a {
            v.extend(c.params());
        }
        if let Some(b) = &self.canon_b {
            for c in b {
                v.extend(c.params());
            }
        }
        v
    }

    fn grows(&self) -> bool {
        true
    }

    fn unsharded(&self) -> Option<String> {
        // Built for its rank's heads (the refusals are in `build`).
        None
    }

    fn state_len(&self) -> usize {
        self.canon_windows().len()
    }

    fn quantizable(&self) -> Vec<ParamId> {
        let mut v = self.qkv.quantizable();
        v.extend(self.o_proj.quantizable());
        v
    }

    fn make_caches(&self, batch: usize, dtype: Dtype) -> Result<Vec<Box<dyn Cache>>> {
        let kv: Box<dyn Cache> = match self.window {
            Some(w) => Box::new(RotatingKvCache::new(w, 0)),
            None => Box::new(KvCache::new()),
        };
        let mut out = vec![kv];
        let windows = self.canon_windows();
        out.extend(canon::windows_cache(batch, self.kernel, &windows, dtype)?);
        Ok(out)
    }

    fn before_cache(&self, p: &Params, x: &Array, state: &mut State<'_>) -> Result<Carry> {
        let mut cur = StateCursor(0);
        let h = cur.canon(p, self.canon_a.as_ref(), x.clone(), state)?;
        let (mut q, mut k, mut v) = match <[Array; 3]>::try_from(self.qkv.forward(p, &h)?) {
            Ok([q, k, v]) => (q, k, v),
            Err(_) => return Err(Error::Other("attention: q/k/v split".into())),
        };
        let mut gate = None;
        if self.gated {
            let s = q.shape().to_vec();
            let both = ops::reshape(&q, &[s[0], s[1], self.n_heads, 2 * self.head_dim])?;
            let parts = ops::split_equal(&both, 2, -1)?;
            q = ops::reshape(&parts[0], &[s[0], s[1], self.n_heads * self.head_dim])?;
            gate = Some(ops::reshape(
                &parts[1],
                &[s[0], s[1], self.n_heads * self.head_dim],
            )?);
        }
        if let Some([bq, bk, bv]) = &self.canon_b {
            q = cur.canon(p, Some(bq), q, state)?;
            k = cur.canon(p, Some(bk), k, state)?;
            v = cur.canon(p, Some(bv), v, state)?;
        }
        if self.qk_norm == QkNorm::Full {
            q = self.norm_full_width(p, self.q_norm.as_ref().expect("loaded"), &q)?;
            k = self.norm_full_width(p, self.k_norm.as_ref().expect("loaded"), &k)?;
        }
        if self.qk_are_views() && x.shape()[0] * x.shape()[1] > 1 {
            // Several rows of q and k as views of the fused q/k/v product
            // have a row stride wider than their heads, and MLX's CUDA
            // backend mishandles that layout on its way through RoPE and
            // attention: llama-f32 and qwen2-f32 missed mlx-lm's logits by
            // 10+ on the H200, and matched within 1e-5 with the projections
            // apart. Copies give them the layout of separate projections.
            // (One row is contiguous as it is.)
            q = q.contiguous()?;
            k = k.contiguous()?;
        }
        let mut q = self.heads(&q, self.n_heads)?;
        let mut k = self.heads(&k, self.n_kv_heads)?;
        let v = self.heads(&v, self.n_kv_heads)?;
        if self.qk_norm == QkNorm::PreRope {
            q = self.q_norm.as_ref().expect("loaded").forward(p, &q)?;
            k = self.k_norm.as_ref().expect("loaded").forward(p, &k)?;
        }
        let t = |a: &Array| -> Result<Array> { Ok(a.transpose_axes(&[0, 2, 1, 3])?) };
        let mut carry = vec![t(&q)?, t(&k)?, t(&v)?];
        carry.extend(gate);
        Ok(carry)
    }

    fn grow(&self, p: &Params, carry: Carry, cache: &mut dyn Cache) -> Result<Carry> {
        let mut it = carry.into_iter();
        let (q, k, v) = match (it.next(), it.next(), it.next()) {
            (Some(q), Some(k), Some(v)) => (q, k, v),
            _ => return Err(Error::Other("attention carry is incomplete".into())),
        };
        let gate = it.next();
        let kv = cache
            .as_kv()
            .ok_or_else(|| Error::Cache("attention needs a KV cache".into()))?;
        let at = match kv.positions()? {
            Some(rows) => RopeAt::Rows(rows),
            None => RopeAt::Offset(kv.offset()),
        };
        let mut q = self.apply_rope(p, &q, &at)?;
        let mut k = self.apply_rope(p, &k, &at)?;
        if self.qk_norm == QkNorm::PostRope {
            q = self.q_norm.as_ref().expect("loaded").forward(p, &q)?;
            k = self.k_norm.as_ref().expect("loaded").forward(p, &k)?;
        }
        let n = q.shape()[2] as usize;
        let mask = kv.mask(n)?;
        let (keys, values) = match kv.update_and_read(&k, &v)? {
            KvRead::Dense { keys, values } => (keys, values),
            KvRead::Quantized {
                keys,
                values,
                quantization: g,
            } if self.dequantize_kv_reads => {
                let dq =
                    |t: &[Array; 3]| ops::dequantize(&t[0], &t[1], &t[2], g.group_size, g.bits);
                (dq(&keys)?, dq(&values)?)
            }
            KvRead::Quantized {
                keys,
                values,
                quantization,
            } => {
                let q = if self.attention_f32 {
                    q.as_dtype(Dtype::Float32)?
                } else {
                    q
                };
                let o = quantized_attend(&q, &keys, &values, self.scale, &mask, &quantization)?;
                let o = if self.attention_f32 {
                    o.as_dtype(v.dtype())?
                } else {
                    o
                };
                let mut out = vec![o];
                out.extend(gate);
                return Ok(out);
            }
        };
        let out_dtype = values.dtype();
        let (q, keys) = if self.attention_f32 {
            (q.as_dtype(Dtype::Float32)?, keys.as_dtype(Dtype::Float32)?)
        } else {
            (q, keys)
        };
        let o = attend(&q, &keys, &values, self.scale, &mask, self.attend_policy)?;
        let o = if self.attention_f32 {
            o.as_dtype(out_dtype)?
        } else {
            o
        };
        let mut out = vec![o];
        out.extend(gate);
        Ok(out)
    }

    fn after_cache(&self, p: &Params, carry: Carry, _state: &mut State<'_>) -> Result<Array> {
        let mut it = carry.into_iter();
        let o = it
            .next()
            .ok_or_else(|| Error::Other("attention carry is incomplete".into()))?;
        let gate = it.next();
        let s = o.shape().to_vec();
        // `o` is `[B, heads, T, head_dim]`.
        let mut o = ops::reshape(o.transpose_axes(&[0, 2, 1, 3])?, &[s[0], s[2], -1])?;
        if let Some(g) = gate {
            o = ops::multiply(&o, ops::sigmoid(&g)?)?;
        }
        self.o_proj.forward(p, &o)
    }

    fn describe(&self) -> String {
        let mut parts = vec![format!(
            "attention h={} kv={} d={}",
            self.n_heads, self.n_kv_heads, self.head_dim
        )];
        if self.gated {
            parts.push("gated".into());
        }
        match self.qk_norm {
            QkNorm::PreRope => parts.push("qk-norm".into()),
            QkNorm::PostRope => parts.push("qk-norm(post-rope)".into()),
            QkNorm::Full => parts.push("qk-norm(full width)".into()),
            QkNorm::None => {}
        }
        if let Some(r) = &self.rope {
            if r.dims != self.head_dim {
                parts.push(format!("rope {}/{}", r.dims, self.head_dim));
            }
        } else {
            parts.push("no-rope".into());
        }
        if let Some(w) = self.window {
            parts.push(format!("window {w}"));
        }
        if self.kernel > 0 {
            parts.push(format!("canon A/B k={}", self.kernel));
        }
        parts.join(", ")
    }
}
