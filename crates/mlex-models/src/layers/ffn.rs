//! Feed-forward blocks: SwiGLU and ReLU² MLPs, and mixture-of-experts
//! (Qwen's softmax top-k with an optional gated shared expert, NemotronH's
//! sigmoid group routing). Expert weights are stacked `[E, out, in]` and
//! applied with `gather_mm`/`gather_qmm`, as mlx-lm's `SwitchGLU`/`SwitchMLP`.

use mlex_core::distributed::{Shard, Split};
use mlex_core::error::{Error, Result};
use mlex_core::nn::{load_quantized, relu2, swiglu, FusedLinear, Linear, Product, Quantized};
use mlex_core::params::{ParamId, Params};
use mlex_core::weights::WeightLoader;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use serde::Deserialize;

/// Which feed-forward a block has (its `ffn` option).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnKind {
    /// No feed-forward: the block is a mixer and a residual.
    None,
    /// `down(silu(gate(x)) * up(x))`.
    #[default]
    Swiglu,
    /// `down(relu(up(x))^2)`.
    Relu2,
    /// Qwen's MoE: softmax top-k, optional gated shared expert.
    QwenMoe,
    /// NemotronH's MoE: sigmoid group routing, optional shared experts.
    NemotronMoe,
}

impl FfnKind {
    /// The option's spelling.
    pub fn name(self) -> &'static str {
        match self {
            FfnKind::None => "none",
            FfnKind::Swiglu => "swiglu",
            FfnKind::Relu2 => "relu2",
            FfnKind::QwenMoe => "qwen_moe",
            FfnKind::NemotronMoe => "nemotron_moe",
        }
    }
}

/// Experts' weights for one projection, `[E, out, in]`, dense or quantized.
#[derive(Clone, Debug)]
pub struct SwitchLinear {
    weight: ParamId,
    quant: Option<Quantized>,
    product: Product,
}

impl SwitchLinear {
    /// Loads `{prefix}.weight` of `[experts, out, in]` (or its packed form).
    pub fn load(
        ld: &mut WeightLoader,
        prefix: &str,
        experts: i32,
        input: i32,
        output: i32,
    ) -> Result<Self> {
        let product = ld.product();
        match load_quantized(ld, prefix, &[experts, output], input)? {
            Some((weight, q)) => Ok(Self {
                weight,
                quant: Some(q),
                product,
            }),
            None => Ok(Self {
                weight: ld.take(&format!("{prefix}.weight"), &[experts, output, input])?,
                quant: None,
                product,
            }),
        }
    }

    fn quantizable(&self) -> Option<ParamId> {
        self.quant.is_none().then_some(self.weight)
    }

    fn params(&self) -> Vec<ParamId> {
        let mut v = vec![self.weight];
        if let Some(q) = &self.quant {
            v.push(q.scales);
            v.push(q.biases);
        }
        v
    }

    /// `x` `[..., 1, in]` with expert `indices` `[..., k]` → `[..., k, 1, out]`.
    fn forward(&self, p: &Params, x: &Array, indices: &Array) -> Result<Array> {
        let w = p.get(self.weight)?;
        Ok(match &self.quant {
            None => ops::gather_mm(x, w.swap_axes(-1, -2)?, None, indices, false)?,
            Some(q) if self.product.dequantizes(x) => {
                let dense = ops::dequantize(
                    w,
                    p.get(q.scales)?,
                    p.get(q.biases)?,
                    q.spec.group_size,
                    q.spec.bits,
                )?
                .as_dtype(x.dtype())?;
                ops::gather_mm(x, dense.swap_axes(-1, -2)?, None, indices, false)?
            }
            Some(q) => {
                let gqmm = |x: &Array, indices: &Array| -> Result<Array> {
                    Ok(ops::gather_qmm(
                        x,
                        w,
                        p.get(q.scales)?,
                        p.get(q.biases)?,
                        None,
                        indices,
                        true,
                        q.spec.group_size,
                        q.spec.bits,
                        false,
                    )?)
                };
                let calls = |x: &Array| -> Result<Array> {
                    match experts_a_call(indices.shape(), self.product.gather_pairs()) {
                        Some(n) => by_expert_groups(x, indices, n, gqmm),
                        None => gqmm(x, indices),
                    }
                };
                match self.product.rerouted_input(x)? {
                    Some((x32, d)) => calls(&x32)?.as_dtype(d)?,
                    None => calls(x)?,
                }
            }
        })
    }
}

/// Most MLX calls one expert product is cut into
/// ([`experts_a_call`]): each call costs a launch and the host's work.
const MAX_EXPERT_CALLS: usize = 4;

/// Experts a call for a product over `indices` of shape `[.., k]` when at
/// most `most_pairs` (row, expert) pairs may go in one call
/// ([`Dispatch::gather_pairs`](mlex_core::dispatch::Dispatch)): the `k`
/// experts in at most [`MAX_EXPERT_CALLS`] even groups; `None` for one call
/// (few enough pairs, no limit, or too many rows to cut that way).
fn experts_a_call(indices: &[i32], most_pairs: Option<usize>) -> Option<usize> {
    let most = most_pairs?;
    let k = *indices.last()? as usize;
    let pairs: usize = indices.iter().map(|&n| n.max(0) as usize).product();
    if pairs <= most || k < 2 {
        return None;
    }
    let fit = most / (pairs / k);
    if fit == 0 {
        return None;
    }
    let calls = k.div_ceil(fit);
    (calls <= MAX_EXPERT_CALLS).then(|| k.div_ceil(calls))
}

/// `product(x, indices)` in calls of `n` experts (the last may have fewer),
/// joined on the output's expert axis (`[.., k, 1, out]`). `x` is
/// `[.., 1, 1, in]` (one input for every expert) or `[.., k, 1, in]` (one a
/// pair, as the down projection's). Each pair's product is computed alone
/// either way: on the CPU the values are one call's, bit for bit; on CUDA
/// the cut calls take MLX's vector kernel, which may round its sums
/// otherwise than the tiled one.
fn by_expert_groups(
    x: &Array,
    indices: &Array,
    n: usize,
    product: impl Fn(&Array, &Array) -> Result<Array>,
) -> Result<Array> {
    let k = indices.shape()[indices.ndim() - 1];
    let cuts: Vec<i32> = (n as i32..k).step_by(n).collect();
    let groups = ops::split_at_indices(indices, &cuts, -1)?;
    let per_pair = x.ndim() >= 3 && x.shape()[x.ndim() - 3] == k;
    let inputs = if per_pair {
        ops::split_at_indices(x, &cuts, -3)?
    } else {
        vec![x.clone(); groups.len()]
    };
    let outs = inputs
        .iter()
        .zip(&groups)
        .map(|(x, i)| product(x, i))
        .collect::<Result<Vec<_>>>()?;
    Ok(ops::concatenate(&outs, -3)?)
}

/// Qwen-style MoE: softmax router, top-k, SwiGLU experts, optional shared
/// expert with a sigmoid gate.
#[derive(Clone, Debug)]
pub struct QwenMoe {
    gate: Linear,
    gate_proj: SwitchLinear,
    up_proj: SwitchLinear,
    down_proj: SwitchLinear,
    top_k: i32,
    norm_topk_prob: bool,
    shared: Option<(Box<Ffn>, Linear)>,
    /// Under --tp: the group the experts' partial outputs are summed over.
    reduce: Option<Shard>,
}

/// NemotronH MoE: sigmoid router with score-correction bias and group
/// selection, ReLU² experts, optional shared experts.
#[derive(Clone, Debug)]
pub struct NemotronMoe {
    gate_weight: ParamId,
    correction_bias: ParamId,
    fc1: SwitchLinear,
    fc2: SwitchLinear,
    top_k: i32,
    n_group: i32,
    topk_group: i32,
    norm_topk_prob: bool,
    routed_scaling: f32,
    shared: Option<Box<Ffn>>,
    /// Under --tp: the group the experts' partial outputs are summed over.
    reduce: Option<Shard>,
}

/// A feed-forward block.
#[derive(Clone, Debug)]
pub enum Ffn {
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu {
        /// Gate and up projections: one product.
        gate_up: FusedLinear,
        /// Down projection.
        down: Linear,
    },
    /// `down(relu(up(x))^2)`.
    Relu2 {
        /// Up projection.
        up: Linear,
        /// Down projection.
        down: Linear,
    },
    /// Qwen MoE.
    QwenMoe(QwenMoe),
    /// NemotronH MoE.
    NemotronMoe(NemotronMoe),
}

/// Settings for [`Ffn::load`].
#[derive(Clone, Debug)]
pub struct FfnSpec {
    /// Which feed-forward (not [`FfnKind::None`]).
    pub kind: FfnKind,
    /// Residual width.
    pub hidden: i32,
    /// MLP inner width.
    pub intermediate: i32,
    /// Linear biases.
    pub bias: bool,
    /// Experts (MoE).
    pub experts: i32,
    /// Experts per token.
    pub top_k: i32,
    /// Per-expert inner width.
    pub moe_intermediate: i32,
    /// Renormalise the top-k scores.
    pub norm_topk_prob: bool,
    /// Shared expert inner width (0: none).
    pub shared_intermediate: i32,
    /// NemotronH routing groups.
    pub n_group: i32,
    /// NemotronH groups kept.
    pub topk_group: i32,
    /// NemotronH routed scaling factor.
    pub routed_scaling: f32,
}

/// This rank's part of an inner width under --tp (all of it on one
/// device); a width the ranks do not divide is an error naming it.
fn rank_width(ld: &WeightLoader, prefix: &str, width: i32, what: &str) -> Result<i32> {
    let Some(shard) = ld.shard() else {
        return Ok(width);
    };
    let n = shard.size() as i32;
    if width % n != 0 {
        return Err(Error::Other(format!(
            "{prefix}: {what}intermediate size {width} does not split into {n} equal parts (--tp {n})"
        )));
    }
    Ok(width / n)
}

impl Ffn {
    /// `None` when the feed-forward splits across `--tp` ranks (the MLPs);
    /// otherwise its kind.
    pub fn unsharded(&self) -> Option<String> {
        match self {
            Ffn::SwiGlu { .. } | Ffn::Relu2 { .. } | Ffn::QwenMoe(_) | Ffn::NemotronMoe(_) => None,
        }
    }

    /// Loads the block under `prefix`.
    pub fn load(ld: &mut WeightLoader, prefix: &str, s: &FfnSpec) -> Result<Self> {
        let path = |n: &str| format!("{prefix}.{n}");
        // A mixture's shared expert, a dense feed-forward of `kind` at
        // `name`, when the mixture has one.
        let shared_expert = |ld: &mut WeightLoader, kind, name: &str| -> Result<Option<Box<Ffn>>> {
            if s.shared_intermediate <= 0 {
                return Ok(None);
            }
            let spec = FfnSpec {
                kind,
                intermediate: s.shared_intermediate,
                ..s.clone()
            };
            Ok(Some(Box::new(Ffn::load(ld, &path(name), &spec)?)))
        };
        // Under --tp an MLP's inner width is split: gate/up by their
        // output rows, down by its input columns (one sum over ranks).
        // Experts split the same way: each keeps its part of every
        // expert's inner width, the router stays whole.
        let inner = match s.kind {
            FfnKind::Swiglu | FfnKind::Relu2 => rank_width(ld, prefix, s.intermediate, "")?,
            _ => s.intermediate,
        };
        let moe_inner = match s.kind {
            FfnKind::QwenMoe | FfnKind::NemotronMoe => {
                rank_width(ld, prefix, s.moe_intermediate, "expert ")?
            }
            _ => s.moe_intermediate,
        };
        // The experts' matrix `switch_mlp.{name}`, split as `split` says:
        // into the inner width (`Output`) or out of it (`Input`).
        let experts = |ld: &mut WeightLoader, name: &str, split: Split| {
            let (from, to) = if split == Split::Input {
                (moe_inner, s.hidden)
            } else {
                (s.hidden, moe_inner)
            };
            let name = path(&format!("switch_mlp.{name}"));
            ld.with_split(split, |ld| {
                SwitchLinear::load(ld, &name, s.experts, from, to)
            })
        };
        let reduce = ld.shard().cloned();
        Ok(match s.kind {
            FfnKind::Swiglu => Ffn::SwiGlu {
                gate_up: ld.with_split(Split::Output, |ld| {
                    FusedLinear::load(
                        ld,
                        &[(&path("gate_proj"), inner), (&path("up_proj"), inner)],
                        s.hidden,
                        s.bias,
                    )
                })?,
                down: ld.with_split(Split::Input, |ld| {
                    Linear::load(ld, &path("down_proj"), inner, s.hidden, s.bias)
                })?,
            },
            FfnKind::Relu2 => Ffn::Relu2 {
                up: ld.with_split(Split::Output, |ld| {
                    Linear::load(ld, &path("up_proj"), s.hidden, inner, s.bias)
                })?,
                down: ld.with_split(Split::Input, |ld| {
                    Linear::load(ld, &path("down_proj"), inner, s.hidden, s.bias)
                })?,
            },
            FfnKind::QwenMoe => {
                let e = s.experts;
                let shared = match shared_expert(ld, FfnKind::Swiglu, "shared_expert")? {
                    Some(ffn) => Some((
                        ffn,
                        Linear::load(ld, &path("shared_expert_gate"), s.hidden, 1, false)?,
                    )),
                    None => None,
                };
                Ffn::QwenMoe(QwenMoe {
                    gate: Linear::load(ld, &path("gate"), s.hidden, e, false)?,
                    gate_proj: experts(ld, "gate_proj", Split::Output)?,
                    up_proj: experts(ld, "up_proj", Split::Output)?,
                    down_proj: experts(ld, "down_proj", Split::Input)?,
                    top_k: s.top_k,
                    norm_topk_prob: s.norm_topk_prob,
                    shared,
                    reduce,
                })
            }
            FfnKind::NemotronMoe => {
                let e = s.experts;
                let shared = shared_expert(ld, FfnKind::Relu2, "shared_experts")?;
                Ffn::NemotronMoe(NemotronMoe {
                    gate_weight: ld.take(&path("gate.weight"), &[e, s.hidden])?,
                    correction_bias: ld.take(&path("gate.e_score_correction_bias"), &[e])?,
                    fc1: experts(ld, "fc1", Split::Output)?,
                    fc2: experts(ld, "fc2", Split::Input)?,
                    top_k: s.top_k,
                    n_group: s.n_group.max(1),
                    topk_group: s.topk_group.max(1),
                    norm_topk_prob: s.norm_topk_prob,
                    routed_scaling: s.routed_scaling,
                    shared,
                    reduce,
                })
            }
            FfnKind::None => {
                return Err(Error::Other(format!(
                    "{prefix}: no feed-forward to load (ffn = \"none\")"
                )))
            }
        })
    }

    /// Every weight read.
    pub fn params(&self) -> Vec<ParamId> {
        match self {
            Ffn::SwiGlu { gate_up, down } => [gate_up.params(), down.params()].concat(),
            Ffn::Relu2 { up, down } => [up.params(), down.params()].concat(),
            Ffn::QwenMoe(m) => {
                let mut v = [
                    m.gate.params(),
                    m.gate_proj.params(),
                    m.up_proj.params(),
                    m.down_proj.params(),
                ]
                .concat();
                if let Some((f, g)) = &m.shared {
                    v.extend(f.params());
                    v.extend(g.params());
                }
                v
            }
            Ffn::NemotronMoe(m) => {
                let mut v = [
                    vec![m.gate_weight, m.correction_bias],
                    m.fc1.params(),
                    m.fc2.params(),
                ]
                .concat();
                if let Some(f) = &m.shared {
                    v.extend(f.params());
                }
                v
            }
        }
    }

    /// The weights quantization may pack (linear and expert matrices; not
    /// NemotronH's plain router).
    pub fn quantizable(&self) -> Vec<ParamId> {
        match self {
            Ffn::SwiGlu { gate_up, down } => {
                let mut v = gate_up.quantizable();
                v.extend(down.quantizable());
                v
            }
            Ffn::Relu2 { up, down } => [up, down].iter().filter_map(|l| l.quantizable()).collect(),
            Ffn::QwenMoe(m) => {
                let mut v: Vec<ParamId> = m.gate.quantizable().into_iter().collect();
                v.extend(
                    [&m.gate_proj, &m.up_proj, &m.down_proj]
                        .iter()
                        .filter_map(|s| s.quantizable()),
                );
                if let Some((f, g)) = &m.shared {
                    v.extend(f.quantizable());
                    v.extend(g.quantizable());
                }
                v
            }
            Ffn::NemotronMoe(m) => {
                let mut v: Vec<ParamId> = [&m.fc1, &m.fc2]
                    .iter()
                    .filter_map(|s| s.quantizable())
                    .collect();
                if let Some(f) = &m.shared {
                    v.extend(f.quantizable());
                }
                v
            }
        }
    }

    /// Applies the block. `inner` (if given) transforms the SwiGLU inner
    /// activation before `down` (DharaAR's canon D position).
    pub fn forward(
        &self,
        p: &Params,
        x: &Array,
        inner: Option<&mut dyn FnMut(Array) -> Result<Array>>,
    ) -> Result<Array> {
        match self {
            Ffn::SwiGlu { gate_up, down } => {
                let gu = gate_up.forward(p, x)?;
                let mut h = swiglu(&gu[0], &gu[1])?;
                if let Some(f) = inner {
                    h = f(h)?;
                }
                down.forward(p, &h)
            }
            Ffn::Relu2 { up, down } => down.forward(p, &relu2(&up.forward(p, x)?)?),
            Ffn::QwenMoe(m) => m.forward(p, x),
            Ffn::NemotronMoe(m) => m.forward(p, x),
        }
    }
}

/// `x` `[B, L, D]` → `[B, L, 1, 1, D]` for `gather_mm`.
fn expert_input(x: &Array) -> Result<Array> {
    let s = x.shape();
    let mut shape = s[..s.len() - 1].to_vec();
    shape.extend([1, 1, s[s.len() - 1]]);
    Ok(ops::reshape(x, &shape)?)
}

/// The experts' outputs `y` (`[.., top_k, 1, hidden]`) weighted by their
/// routing `weights` (`[.., top_k]`) and summed, in `y`'s dtype; summed over
/// the group's devices under `--tp` (each holds a slice of every expert's inner
/// width, so each output is partial).
fn weighted_sum(y: &Array, weights: &Array, reduce: Option<&Shard>) -> Result<Array> {
    let y = ops::squeeze_axes(y, &[-2])?;
    let dtype = y.dtype();
    let y = ops::multiply(&y, weights.expand_dims(-1)?)?
        .sum_axis(-2, false)?
        .as_dtype(dtype)?;
    Ok(match reduce {
        Some(shard) => shard.all_sum(&y)?,
        None => y,
    })
}

/// Indices of the `k` largest entries of the last axis (any order), as
/// `argpartition(x, kth=-k)[..., -k:]`.
fn top_k_indices(x: &Array, k: i32) -> Result<Array> {
    let n = x.shape()[x.ndim() - 1];
    let part = ops::argpartition_axis(x, n - k, -1)?;
    Ok(part.try_index((.., .., (n - k)..))?)
}

impl QwenMoe {
    fn forward(&self, p: &Params, x: &Array) -> Result<Array> {
        let gates = ops::softmax_axis(self.gate.forward(p, x)?, -1, true)?;
        let inds = top_k_indices(&gates, self.top_k)?;
        let mut scores = ops::indexing::take_along_axis(&gates, &inds, -1)?;
        if self.norm_topk_prob {
            scores = ops::divide(&scores, scores.sum_axis(-1, true)?)?;
        }
        let xe = expert_input(x)?;
        let up = self.up_proj.forward(p, &xe, &inds)?;
        let gate = self.gate_proj.forward(p, &xe, &inds)?;
        let y = self.down_proj.forward(p, &swiglu(&gate, &up)?, &inds)?;
        let mut y = weighted_sum(&y, &scores, self.reduce.as_ref())?;
        if let Some((shared, gate)) = &self.shared {
            let s = shared.forward(p, x, None)?;
            let g = ops::sigmoid(gate.forward(p, x)?)?;
            y = ops::add(&y, ops::multiply(&g, &s)?)?;
        }
        Ok(y)
    }
}

impl NemotronMoe {
    fn forward(&self, p: &Params, x: &Array) -> Result<Array> {
        let gates = ops::matmul(x, p.get(self.gate_weight)?.t())?;
        let orig = ops::sigmoid(gates.as_dtype(Dtype::Float32)?)?;
        let mut scores = ops::add(&orig, p.get(self.correction_bias)?)?;
        if self.n_group > 1 {
            // Keep the `topk_group` groups with the best two-expert sums.
            let s = scores.shape().to_vec();
            let grouped = ops::unflatten(&scores, -1, &[self.n_group, -1])?;
            let top2 = ops::indexing::topk_axis(&grouped, 2, -1)?.sum_axis(-1, true)?;
            let k = self.n_group - self.topk_group;
            let drop = ops::argpartition_axis(&top2, k - 1, -2)?.try_index((.., .., ..k, ..))?;
            let zeros = ops::zeros_like(&drop)?.as_dtype(grouped.dtype())?;
            let zeros = ops::broadcast_to(
                &zeros,
                &[drop.shape()[0], drop.shape()[1], k, grouped.shape()[3]],
            )?;
            let drop = ops::broadcast_to(&drop, zeros.shape())?;
            let kept = ops::indexing::put_along_axis(&grouped, &drop, &zeros, -2)?;
            scores = ops::reshape(&kept, &s)?;
        }
        let inds = ops::argpartition_axis(ops::negative(&scores)?, self.top_k - 1, -1)?
            .try_index((.., .., ..self.top_k))?;
        let mut w = ops::indexing::take_along_axis(&orig, &inds, -1)?;
        if self.top_k > 1 && self.norm_topk_prob {
            let denom = ops::add(w.sum_axis(-1, true)?, Array::from_f32(1e-20))?;
            w = ops::divide(&w, &denom)?;
        }
        w = ops::multiply(&w, Array::from_f32(self.routed_scaling))?;
        let xe = expert_input(x)?;
        let h = relu2(&self.fc1.forward(p, &xe, &inds)?)?;
        let mut y = weighted_sum(&self.fc2.forward(p, &h, &inds)?, &w, self.reduce.as_ref())?;
        if let Some(shared) = &self.shared {
            y = ops::add(&y, shared.forward(p, x, None)?)?;
        }
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_products_are_cut_only_where_few_rows_take_many_experts() {
        // One row (a decode step): Qwen3-Next's 10 experts in two calls of
        // 5, Qwen3.5-MoE's 8 in two of 4; 6 fit one call.
        assert_eq!(experts_a_call(&[1, 1, 10], Some(7)), Some(5));
        assert_eq!(experts_a_call(&[1, 1, 8], Some(7)), Some(4));
        assert_eq!(experts_a_call(&[1, 1, 6], Some(7)), None);
        // Two rows of 10: 3 a call (6 pairs), four calls.
        assert_eq!(experts_a_call(&[2, 1, 10], Some(7)), Some(3));
        // A prefill or a fuller batch: one call.
        assert_eq!(experts_a_call(&[1, 128, 10], Some(7)), None);
        assert_eq!(experts_a_call(&[8, 1, 6], Some(7)), None);
        // No limit (the CPU), or one expert a row.
        assert_eq!(experts_a_call(&[1, 1, 10], None), None);
        assert_eq!(experts_a_call(&[9, 1, 1], Some(7)), None);
        // 16 experts at most 7 a call: three calls of 6, 6 and 4.
        assert_eq!(experts_a_call(&[1, 1, 16], Some(7)), Some(6));
    }

    #[test]
    fn cut_products_join_in_expert_order() {
        // product = the input plus its expert's index: the joined result
        // must keep every pair where one call puts it.
        let add = |x: &Array, i: &Array| -> Result<Array> {
            let i = i
                .as_dtype(Dtype::Float32)?
                .expand_dims(-1)?
                .expand_dims(-1)?;
            Ok(ops::add(x, &i)?)
        };
        let indices = Array::from_slice(&[3u32, 1, 4, 0, 2], &[1, 1, 5]);
        let shared = ops::zeros::<f32>(&[1, 1, 1, 1, 2]).unwrap();
        let per_pair = ops::reshape(
            Array::from_slice(&[0f32, 1., 10., 11., 20., 21., 30., 31., 40., 41.], &[10]),
            &[1, 1, 5, 1, 2],
        )
        .unwrap();
        for x in [&shared, &per_pair] {
            let whole = add(x, &indices).unwrap();
            for n in 1..5 {
                let cut = by_expert_groups(x, &indices, n, add).unwrap();
                assert_eq!(cut.shape(), whole.shape());
                assert_eq!(cut.as_slice::<f32>(), whole.as_slice::<f32>(), "n = {n}");
            }
        }
    }
}
