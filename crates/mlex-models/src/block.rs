//! The block: what almost every decoder layer is.
//!
//! ```text
//! x ─ mixer_norm ─ mixer ─ [post_mixer_norm] ─ [× residual_multiplier] ─ + ─ h
//! h ─ ffn_norm ─ [canon C] ─ ffn [canon D inside] ─ [post_ffn_norm] ─ [× m] ─ + ─ out
//! ```
//!
//! The mixer (attention, Gated DeltaNet, Mamba2, a downstream crate's) is
//! a registered [`MixerKind`](mlex_core::layer::MixerKind) built from its own
//! typed options; the feed-forward is a [`FfnKind`]. What real families vary
//! around the two is a block option here, never a switch inside a mixer:
//! norms before and after each part (OLMo 2 norms the outputs), a residual
//! multiplier (Granite), DharaAR's canon convolutions C and D around the
//! feed-forward. A block without a mixer (`mixer = null`) is a norm, a
//! feed-forward and a residual (NemotronH's `-` and `E` layers); one with
//! `ffn = "none"` is a mixer and a residual (NemotronH's `M` and `*`).
//!
//! Phases (see [`mlex_core::layer`]): a block's phases are its mixer's, with
//! the norm in front and the residuals and feed-forward after; a block whose
//! mixer keeps no growing cache is one pure phase.

use crate::layers::canon::{self, Canon, CanonOptions};
use crate::layers::ffn::{Ffn, FfnKind, FfnSpec};
use mlex_core::cache::Cache;
use mlex_core::distributed::Split;
use mlex_core::error::{Error, Result};
use mlex_core::layer::{BuildCtx, Carry, Layer, Mixer, State, StateKind};
use mlex_core::nn::{Norm, NormKind};
use mlex_core::params::{ParamId, Params};
use mlx_rs::{ops, Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

fn d_one() -> i32 {
    1
}
fn d_one_f() -> f64 {
    1.0
}
fn d_mixer_norm() -> Option<String> {
    Some("input_layernorm".into())
}
fn d_ffn_norm() -> Option<String> {
    Some("post_attention_layernorm".into())
}
fn d_ffn_prefix() -> String {
    "mlp".into()
}

/// A norm option: a module name, or `false` (TOML has no null) or `null`
/// for none.
#[derive(Deserialize)]
#[serde(untagged)]
enum NormRef {
    Name(String),
    Flag(bool),
}

fn norm_name<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<String>, D::Error> {
    match Option::<NormRef>::deserialize(d)? {
        None | Some(NormRef::Flag(false)) => Ok(None),
        Some(NormRef::Name(n)) => Ok(Some(n)),
        Some(NormRef::Flag(true)) => Err(serde::de::Error::custom(
            "expected a module name, or false for no norm",
        )),
    }
}

/// The default norm epsilon of the `norm_eps` options.
pub fn default_eps() -> f64 {
    1e-6
}

/// The feed-forward sizes of a block (option `ffn_sizes`), named after the
/// `config.json` keys they usually come from. Which fields a kind of
/// feed-forward needs: `swiglu`/`relu2` `intermediate_size`; `qwen_moe`
/// `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
/// `shared_expert_intermediate_size` (0: none), `norm_topk_prob`;
/// `nemotron_moe` `n_routed_experts`, `num_experts_per_tok`,
/// `moe_intermediate_size`, `moe_shared_expert_intermediate_size` (0:
/// none), `n_group`, `topk_group`, `norm_topk_prob`,
/// `routed_scaling_factor`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FfnSizes {
    /// Dense MLP inner width.
    #[serde(default)]
    pub intermediate_size: i32,
    /// Qwen MoE experts.
    #[serde(default)]
    pub num_experts: i32,
    /// Experts per token.
    #[serde(default)]
    pub num_experts_per_tok: i32,
    /// Per-expert inner width.
    #[serde(default)]
    pub moe_intermediate_size: i32,
    /// Qwen shared expert inner width (0: none).
    #[serde(default)]
    pub shared_expert_intermediate_size: i32,
    /// Renormalise the top-k scores.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// NemotronH experts.
    #[serde(default)]
    pub n_routed_experts: i32,
    /// NemotronH shared experts' inner width (0: none).
    #[serde(default)]
    pub moe_shared_expert_intermediate_size: i32,
    /// NemotronH routing groups.
    #[serde(default = "d_one")]
    pub n_group: i32,
    /// NemotronH groups kept.
    #[serde(default = "d_one")]
    pub topk_group: i32,
    /// NemotronH routed scaling factor.
    #[serde(default = "d_one_f")]
    pub routed_scaling_factor: f64,
}

/// Options of a block: its mixer by name with the mixer's own options, and
/// everything around it. Weight names are relative to the layer prefix.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockOptions {
    /// The registered mixer kind (`null`: a feed-forward-only block).
    pub mixer: Option<String>,
    /// The mixer's options (its kind's typed options struct).
    #[serde(default)]
    pub mixer_options: Value,
    /// Residual width.
    pub hidden_size: i32,
    /// Epsilon of the block's norms.
    #[serde(default = "default_eps")]
    pub norm_eps: f64,
    /// The block's norms: `rms` (default) or `layer_norm`.
    #[serde(default)]
    pub norm_type: NormKind,
    /// The norm before the mixer (`false`: none).
    #[serde(default = "d_mixer_norm", deserialize_with = "norm_name")]
    pub mixer_norm: Option<String>,
    /// A norm on the mixer's output before its residual add (OLMo 2).
    #[serde(default, deserialize_with = "norm_name")]
    pub post_mixer_norm: Option<String>,
    /// The feed-forward.
    #[serde(default)]
    pub ffn: FfnKind,
    /// The norm before the feed-forward (`false`: none).
    #[serde(default = "d_ffn_norm", deserialize_with = "norm_name")]
    pub ffn_norm: Option<String>,
    /// A norm on the feed-forward's output before its residual add (OLMo 2).
    #[serde(default, deserialize_with = "norm_name")]
    pub post_ffn_norm: Option<String>,
    /// The feed-forward's module name.
    #[serde(default = "d_ffn_prefix")]
    pub ffn_prefix: String,
    /// Biases in the feed-forward's projections.
    #[serde(default)]
    pub ffn_bias: bool,
    /// The feed-forward's sizes.
    #[serde(default)]
    pub ffn_sizes: FfnSizes,
    /// Scales each branch before its residual add (Granite's
    /// `residual_multiplier`).
    pub residual_multiplier: Option<f64>,
    /// Canon convolutions around the feed-forward (DharaAR): position C on
    /// the normed input, D on the SwiGLU's inner activation. Positions A
    /// and B belong to the attention mixer's `canon` option.
    pub canon: Option<CanonOptions>,
}

/// A size option: an integer from 1, else an error naming the option.
pub fn size(ctx: &BuildCtx<'_>, kind: &str, name: &str, v: i32) -> Result<i32> {
    mlex_core::config::count(i64::from(v)).map_err(|m| {
        ctx.config.error(
            &format!("options of layer {} ({kind}): {name}", ctx.index),
            m,
        )
    })
}

/// A rank's share of `groups` groups of `members` each (Gated DeltaNet's
/// key heads and the value heads that read them, Mamba2's B/C groups and
/// their SSM heads) under `ctx`'s `--tp` shard, as `(groups, members,
/// copies)`: whole groups a rank when the ranks divide them; else, where
/// `share` allows it, the ranks a multiple of the groups and the members
/// split evenly, one group held by `copies` consecutive ranks. `Err` with
/// the rank count when neither.
pub fn group_split(
    ctx: &BuildCtx<'_>,
    groups: i32,
    members: i32,
    share: bool,
) -> std::result::Result<(i32, i32, usize), i32> {
    let Some(shard) = ctx.weights.shard() else {
        return Ok((groups, members, 1));
    };
    let n = shard.size() as i32;
    if groups % n == 0 {
        Ok((groups / n, members / n, 1))
    } else if share && n % groups == 0 && members % n == 0 {
        Ok((1, members / n, (n / groups) as usize))
    } else {
        Err(n)
    }
}

/// The feed-forward of `kind` with sizes from `s`.
fn ffn_spec(
    ctx: &BuildCtx<'_>,
    hidden: i32,
    kind: FfnKind,
    bias: bool,
    s: &FfnSizes,
) -> Result<FfnSpec> {
    let need = |name: &str, v: i32| size(ctx, "block", &format!("ffn_sizes.{name}"), v);
    let intermediate = match kind {
        FfnKind::Swiglu | FfnKind::Relu2 => need("intermediate_size", s.intermediate_size)?,
        _ => s.intermediate_size,
    };
    let (experts, moe_intermediate, shared) = match kind {
        FfnKind::QwenMoe => (
            need("num_experts", s.num_experts)?,
            need("moe_intermediate_size", s.moe_intermediate_size)?,
            s.shared_expert_intermediate_size,
        ),
        FfnKind::NemotronMoe => (
            need("n_routed_experts", s.n_routed_experts)?,
            need("moe_intermediate_size", s.moe_intermediate_size)?,
            s.moe_shared_expert_intermediate_size,
        ),
        _ => (0, 0, 0),
    };
    Ok(FfnSpec {
        kind,
        hidden,
        intermediate,
        bias,
        experts,
        top_k: s.num_experts_per_tok,
        moe_intermediate,
        norm_topk_prob: s.norm_topk_prob,
        shared_intermediate: shared,
        n_group: s.n_group,
        topk_group: s.topk_group,
        routed_scaling: s.routed_scaling_factor as f32,
    })
}

/// A built block.
pub struct Block {
    mixer_norm: Option<Norm>,
    mixer: Option<Box<dyn Mixer>>,
    /// How many of the layer's state arrays are the mixer's (they come
    /// first; the block's canon windows follow).
    mixer_state: usize,
    post_mixer_norm: Option<Norm>,
    ffn_norm: Option<Norm>,
    ffn: Option<Ffn>,
    post_ffn_norm: Option<Norm>,
    residual_multiplier: Option<f32>,
    canon_c: Option<Canon>,
    canon_d: Option<Canon>,
    canon_kernel: i32,
    hidden: i32,
    intermediate: i32,
}

mlex_core::register_layer_kind! {
    /// The registered `block` layer kind.
    kind BlockKind = "block" {
        options: BlockOptions,
        state: StateKind::GrowingAndFixed,
        summary: "pre-norm mixer + residual, pre-norm feed-forward + residual; post-norms, residual multiplier, canon C/D",
        build: Block::build,
    }
}

fn load_norm(
    ctx: &mut BuildCtx<'_>,
    o: &BlockOptions,
    name: &Option<String>,
) -> Result<Option<Norm>> {
    match name {
        Some(n) => {
            let prefix = ctx.path(n);
            Ok(Some(Norm::load(
                o.norm_type,
                ctx.weights,
                &prefix,
                o.hidden_size,
                o.norm_eps as f32,
            )?))
        }
        None => Ok(None),
    }
}

impl Block {
    fn build(ctx: &mut BuildCtx<'_>, o: &BlockOptions) -> Result<Self> {
        let hidden = size(ctx, "block", "hidden_size", o.hidden_size)?;
        let mixer_norm = match &o.mixer {
            Some(_) => load_norm(ctx, o, &o.mixer_norm)?,
            None => None,
        };
        let mixer = match &o.mixer {
            Some(name) => {
                let kind = ctx.registry.mixer_kind(name).ok_or_else(|| {
                    ctx.config.error(
                        &format!("options of layer {} (block): mixer", ctx.index),
                        format!("no mixer kind `{name}` is registered"),
                    )
                })?;
                let options = o.mixer_options.clone();
                let mut mctx = BuildCtx {
                    config: ctx.config,
                    index: ctx.index,
                    prefix: ctx.prefix.clone(),
                    options: &options,
                    weights: ctx.weights,
                    registry: ctx.registry,
                };
                Some(kind.build(&mut mctx)?)
            }
            None => None,
        };
        let post_mixer_norm = load_norm(ctx, o, &o.post_mixer_norm)?;
        let (ffn_norm, ffn, post_ffn_norm, intermediate) = match o.ffn {
            FfnKind::None => (None, None, None, 0),
            kind => {
                let spec = ffn_spec(ctx, hidden, kind, o.ffn_bias, &o.ffn_sizes)?;
                let norm = load_norm(ctx, o, &o.ffn_norm)?;
                let ffn = Ffn::load(ctx.weights, &ctx.path(&o.ffn_prefix), &spec)?;
                let post = load_norm(ctx, o, &o.post_ffn_norm)?;
                (norm, Some(ffn), post, spec.intermediate)
            }
        };
        let mut block = Self {
            mixer_norm,
            mixer_state: mixer.as_ref().map_or(0, |m| m.state_len()),
            mixer,
            post_mixer_norm,
            ffn_norm,
            ffn,
            post_ffn_norm,
            residual_multiplier: o.residual_multiplier.map(|m| m as f32),
            canon_c: None,
            canon_d: None,
            canon_kernel: 0,
            hidden,
            intermediate,
        };
        if let Some(c) = CanonOptions::enabled(&o.canon, ctx)? {
            block.canon_kernel = c.kernel;
            if c.set.contains('C') {
                let name = ctx.path("canon_c.conv");
                block.canon_c = Some(Canon::load(ctx.weights, &name, hidden, &c)?);
            }
            if c.set.contains('D') {
                if !matches!(block.ffn, Some(Ffn::SwiGlu { .. })) {
                    return Err(ctx.config.error("canon_set", "canon D needs a SwiGLU MLP"));
                }
                let name = format!("{}.canon_d.conv", ctx.path(&o.ffn_prefix));
                // Over the MLP's inner channels: under --tp, this rank's
                // part of them (the SwiGLU split its inner width).
                let ranks = ctx.weights.shard().map_or(1, |s| s.size() as i32);
                block.intermediate = intermediate / ranks;
                let width = block.intermediate;
                block.canon_d = Some(
                    ctx.weights
                        .with_split(Split::Leading, |ld| Canon::load(ld, &name, width, &c))?,
                );
            }
        }
        Ok(block)
    }

    /// The block's own conv windows (canon C, D), in state order.
    fn canon_windows(&self) -> Vec<(&'static str, i32)> {
        let mut w = Vec::new();
        if self.canon_c.is_some() {
            w.push(("C", self.hidden));
        }
        if self.canon_d.is_some() {
            w.push(("D", self.intermediate));
        }
        w
    }

    fn scaled(&self, y: Array) -> Result<Array> {
        Ok(match self.residual_multiplier {
            Some(m) => ops::multiply(&y, Array::from_f32(m).as_dtype(y.dtype())?)?,
            None => y,
        })
    }

    /// Everything after the mixer's output `o` (`None`: no mixer): its
    /// residual add, then the feed-forward part. `state` is the block's own
    /// part of the layer state.
    fn finish(
        &self,
        p: &Params,
        x: &Array,
        o: Option<Array>,
        state: &mut State<'_>,
    ) -> Result<Array> {
        let h = match o {
            None => x.clone(),
            Some(o) => {
                let o = match &self.post_mixer_norm {
                    Some(n) => n.forward(p, &o)?,
                    None => o,
                };
                ops::add(x, self.scaled(o)?)?
            }
        };
        let Some(ffn) = &self.ffn else {
            return Ok(h);
        };
        let m = match &self.ffn_norm {
            Some(n) => n.forward(p, &h)?,
            None => h.clone(),
        };
        let mut next = 0;
        let m = match &self.canon_c {
            Some(c) => {
                let y = c.forward(p, &m, state, next)?;
                next += 1;
                y
            }
            None => m,
        };
        let y = match &self.canon_d {
            None => ffn.forward(p, &m, None)?,
            Some(d) => {
                let mut hook =
                    |inner: Array| -> Result<Array> { d.forward(p, &inner, state, next) };
                ffn.forward(p, &m, Some(&mut hook))?
            }
        };
        let y = match &self.post_ffn_norm {
            Some(n) => n.forward(p, &y)?,
            None => y,
        };
        Ok(ops::add(&h, self.scaled(y)?)?)
    }

    fn norm_params(&self) -> Vec<ParamId> {
        [
            &self.mixer_norm,
            &self.post_mixer_norm,
            &self.ffn_norm,
            &self.post_ffn_norm,
        ]
        .into_iter()
        .flatten()
        .flat_map(|n| n.params())
        .collect()
    }
}

fn first(carry: &Carry) -> Result<Array> {
    carry
        .first()
        .cloned()
        .ok_or_else(|| Error::Other("block carry is empty".into()))
}

impl Layer for Block {
    fn kind(&self) -> &str {
        "block"
    }

    fn params(&self) -> Vec<ParamId> {
        let mut v = self.norm_params();
        if let Some(m) = &self.mixer {
            v.extend(m.params());
        }
        if let Some(f) = &self.ffn {
            v.extend(f.params());
        }
        for c in [&self.canon_c, &self.canon_d].into_iter().flatten() {
            v.extend(c.params());
        }
        v
    }

    fn grows(&self) -> bool {
        self.mixer.as_ref().is_some_and(|m| m.grows())
    }

    fn quantizable(&self) -> Vec<ParamId> {
        let mut v = self.mixer.as_ref().map_or(Vec::new(), |m| m.quantizable());
        if let Some(f) = &self.ffn {
            v.extend(f.quantizable());
        }
        v
    }

    fn make_caches(&self, batch: usize, dtype: Dtype) -> Result<Vec<Box<dyn Cache>>> {
        let mut out = match &self.mixer {
            Some(m) => m.make_caches(batch, dtype)?,
            None => Vec::new(),
        };
        let windows = self.canon_windows();
        out.extend(canon::windows_cache(
            batch,
            self.canon_kernel,
            &windows,
            dtype,
        )?);
        Ok(out)
    }

    fn before_cache(&self, p: &Params, x: &Array, state: &mut State<'_>) -> Result<Carry> {
        let (mut mixer_state, mut own) = state.split_at(self.mixer_state);
        let Some(mixer) = &self.mixer else {
            return Ok(vec![self.finish(p, x, None, &mut own)?]);
        };
        let h = match &self.mixer_norm {
            Some(n) => n.forward(p, x)?,
            None => x.clone(),
        };
        let carry = mixer.before_cache(p, &h, &mut mixer_state)?;
        if mixer.grows() {
            let mut out = Vec::with_capacity(carry.len() + 1);
            out.push(x.clone());
            out.extend(carry);
            return Ok(out);
        }
        let o = mixer.after_cache(p, carry, &mut mixer_state)?;
        Ok(vec![self.finish(p, x, Some(o), &mut own)?])
    }

    fn grow(&self, p: &Params, carry: Carry, cache: &mut dyn Cache) -> Result<Carry> {
        let Some(mixer) = &self.mixer else {
            return Ok(carry);
        };
        let x = first(&carry)?;
        let rest = mixer.grow(p, carry.into_iter().skip(1).collect(), cache)?;
        let mut out = Vec::with_capacity(rest.len() + 1);
        out.push(x);
        out.extend(rest);
        Ok(out)
    }

    fn after_cache(&self, p: &Params, carry: Carry, state: &mut State<'_>) -> Result<Array> {
        let x = first(&carry)?;
        match &self.mixer {
            Some(mixer) if mixer.grows() => {
                let (mut mixer_state, mut own) = state.split_at(self.mixer_state);
                let o =
                    mixer.after_cache(p, carry.into_iter().skip(1).collect(), &mut mixer_state)?;
                self.finish(p, &x, Some(o), &mut own)
            }
            // The whole block ran before the cache.
            _ => Ok(x),
        }
    }

    fn unsharded(&self) -> Option<String> {
        if let Some(part) = self.mixer.as_ref().and_then(|m| m.unsharded()) {
            return Some(part);
        }
        self.ffn.as_ref().and_then(Ffn::unsharded)
    }

    fn describe(&self) -> String {
        let mixer = self.mixer.as_ref().map(|m| m.describe());
        let ffn = match &self.ffn {
            Some(Ffn::SwiGlu { .. }) => Some("swiglu"),
            Some(Ffn::Relu2 { .. }) => Some("relu2"),
            Some(Ffn::QwenMoe(_)) => Some("moe (qwen routing)"),
            Some(Ffn::NemotronMoe(_)) => Some("moe (nemotron routing)"),
            None => None,
        };
        let mut parts: Vec<String> = mixer.into_iter().collect();
        if let Some(f) = ffn {
            parts.push(format!("+ {f}"));
        }
        if self.canon_kernel > 0 {
            parts.push(format!("canon C/D k={}", self.canon_kernel));
        }
        if let Some(m) = self.residual_multiplier {
            parts.push(format!("residual ×{m}"));
        }
        parts.join(", ")
    }
}
