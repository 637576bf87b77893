//! The building blocks every layer kind uses: (quantized) linear and
//! embedding layers, RMS norm and LayerNorm, depthwise causal convolution. Each holds
//! [`ParamId`]s and computes with a [`Params`] view, so the same code runs
//! eagerly and inside compiled segments.
//!
//! Numerics follow MLX's `mlx.nn` (which mlx-lm uses) operation by
//! operation, so that parity with mlx-lm holds to float rounding.

use crate::dispatch::DenseProduct;
use crate::distributed::{Shard, Split};
use crate::error::{Error, Result};
use crate::params::{ParamId, Params};
use crate::quant::QuantSpec;
use crate::weights::WeightLoader;
use mlx_rs::{ops, Array, Dtype};

/// Quantized weight storage of a linear or embedding layer.
#[derive(Clone, Debug)]
pub struct Quantized {
    /// Per-group scales.
    pub scales: ParamId,
    /// Per-group biases (affine mode).
    pub biases: ParamId,
    /// Group size and bits.
    pub spec: QuantSpec,
}

/// `y = x W^T + b`, dense or affine-quantized.
#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out, in]` (dense) or `[out, in * bits / 32]` packed `uint32`.
    pub weight: ParamId,
    /// Optional `[out]` bias.
    pub bias: Option<ParamId>,
    /// Present for quantized layers.
    pub quant: Option<Quantized>,
    /// Input features.
    pub in_features: i32,
    /// Output features.
    pub out_features: i32,
    /// How its product runs.
    pub product: Product,
    /// A row-parallel layer's group: its product is this rank's part of
    /// the sum over input columns, summed over the ranks before the bias
    /// is added ([`crate::distributed::Split::Input`]).
    pub reduce: Option<crate::distributed::Shard>,
}

/// Loads `{prefix}.weight` packed with `.scales`/`.biases` when
/// `{prefix}.scales` exists: `rows` leading dimensions (e.g. `[out]`, or
/// `[experts, out]`), `in_features` unpacked columns. `None` when the
/// tensor is not quantized.
pub fn load_quantized(
    ld: &mut WeightLoader,
    prefix: &str,
    rows: &[i32],
    in_features: i32,
) -> Result<Option<(ParamId, Quantized)>> {
    let scales_name = format!("{prefix}.scales");
    if !ld.has(&scales_name) {
        return Ok(None);
    }
    let spec = ld.quant_for(prefix).ok_or_else(|| Error::TensorMismatch {
        name: scales_name.clone(),
        file: "config.json".into(),
        expected: "a `quantization` entry in config.json for a quantized tensor".into(),
        found: "no quantization config".into(),
    })?;
    if in_features % spec.group_size != 0 || (in_features * spec.bits) % 32 != 0 {
        let part = match (ld.split(), ld.shard()) {
            (Some(crate::distributed::Split::Input), Some(shard)) => format!(
                " (this rank's part under --tp {}: the ranks must split whole quantization groups)",
                shard.size()
            ),
            _ => String::new(),
        };
        return Err(Error::Other(format!(
            "{prefix}: {in_features} input features do not fit group size {} at {} bits{part}",
            spec.group_size, spec.bits
        )));
    }
    let mut wshape = rows.to_vec();
    wshape.push(in_features * spec.bits / 32);
    let weight = ld.take_packed(&format!("{prefix}.weight"), &wshape)?;
    let mut gshape = rows.to_vec();
    gshape.push(in_features / spec.group_size);
    let scales = ld.take(&scales_name, &gshape)?;
    let biases = ld.take(&format!("{prefix}.biases"), &gshape)?;
    Ok(Some((
        weight,
        Quantized {
            scales,
            biases,
            spec,
        },
    )))
}

/// How a layer's products run, taken from the [`Dispatch`] when the layer
/// is loaded: the few-row kernel for the row counts it takes, and the
/// dequantized form of quantized products with float32 activations where
/// the backend needs it.
///
/// [`Dispatch`]: crate::dispatch::Dispatch
#[derive(Clone, Copy, Debug, Default)]
pub struct Product {
    few_rows: Option<(DenseProduct, (i32, i32))>,
    dequantize_f32: bool,
    reroute_half: bool,
    /// At most 64 ([`Dispatch::apply_env`](crate::dispatch::Dispatch::apply_env)):
    /// a byte keeps the mixture-of-experts layers small.
    gather_pairs: Option<u8>,
}

/// Rows (all axes but the last) below which a half-precision quantized
/// product is rerouted to float32 (when the dispatch asks): decode and
/// verify forwards. A prefill's product keeps MLX's half-precision kernel:
/// the float32 one is 7x faster there too but holds a float32 temporary
/// of about the weight's dequantized size (docs/BENCHMARKS.md, 2026-12-07).
const REROUTED_ROWS: usize = 16;

impl Product {
    /// The products `d` chooses.
    pub fn of(d: &crate::dispatch::Dispatch) -> Self {
        Self {
            few_rows: d.few_row_product(),
            dequantize_f32: d.dequantize_f32_products,
            reroute_half: d.reroute_half_quantized,
            gather_pairs: d.gather_pairs.map(|n| n.min(u8::MAX as usize) as u8),
        }
    }

    /// The most (row, expert) pairs a quantized mixture-of-experts product
    /// gives MLX in one call ([`Dispatch::gather_pairs`]); `None`: one call.
    ///
    /// [`Dispatch::gather_pairs`]: crate::dispatch::Dispatch::gather_pairs
    pub fn gather_pairs(&self) -> Option<usize> {
        self.gather_pairs.map(usize::from)
    }

    /// The few-row kernel's product, when it takes the shape.
    fn few_rows(&self, x: &Array, w: &Array) -> Result<Option<Array>> {
        match self.few_rows {
            Some((f, rows)) => f(x, w, rows),
            None => Ok(None),
        }
    }

    /// `x @ w^T` for a dense `[out, in]` weight.
    pub fn dense(&self, x: &Array, w: &Array) -> Result<Array> {
        match self.few_rows(x, w)? {
            Some(y) => Ok(y),
            None => Ok(ops::matmul(x, w.t())?),
        }
    }

    /// True when a quantized product with activations `x` runs on the
    /// dequantized weight (see
    /// [`Dispatch::dequantize_f32_products`](crate::dispatch::Dispatch)).
    /// The dequantized product is exact (the CPU's numbers) and costs a
    /// dequantization of the weight per call.
    pub fn dequantizes(&self, x: &Array) -> bool {
        self.dequantize_f32 && x.dtype() == Dtype::Float32
    }

    /// Where a few rows of half-precision activations are rerouted (see
    /// [`Dispatch::reroute_half_quantized`](crate::dispatch::Dispatch)): `x`
    /// cast to float32 and the dtype the product is cast back to; `None`:
    /// the product takes `x` as it is.
    pub fn rerouted_input(&self, x: &Array) -> Result<Option<(Array, Dtype)>> {
        if !self.reroute_half || !matches!(x.dtype(), Dtype::Bfloat16 | Dtype::Float16) {
            return Ok(None);
        }
        let rows = x.size() / x.shape().last().map_or(1, |&n| n.max(1) as usize);
        if rows >= REROUTED_ROWS {
            return Ok(None);
        }
        Ok(Some((x.as_dtype(Dtype::Float32)?, x.dtype())))
    }

    /// `x @ dequantize(w)^T` for an affine-quantized `[out, in]` weight.
    pub fn quantized(
        &self,
        x: &Array,
        w: &Array,
        scales: &Array,
        biases: &Array,
        spec: &QuantSpec,
    ) -> Result<Array> {
        if self.dequantizes(x) {
            let dense = ops::dequantize(w, scales, biases, spec.group_size, spec.bits)?;
            return Ok(ops::matmul(x, dense.as_dtype(x.dtype())?.t())?);
        }
        let qmm = |x: &Array| {
            ops::quantized_matmul(x, w, scales, biases, true, spec.group_size, spec.bits)
        };
        Ok(match self.rerouted_input(x)? {
            Some((x32, d)) => qmm(&x32)?.as_dtype(d)?,
            None => qmm(x)?,
        })
    }
}

impl Linear {
    /// Loads `{prefix}.weight` (+ `.bias`), quantized when `{prefix}.scales`
    /// exists.
    pub fn load(
        ld: &mut WeightLoader,
        prefix: &str,
        in_features: i32,
        out_features: i32,
        bias: bool,
    ) -> Result<Self> {
        let (weight, quant) = match load_quantized(ld, prefix, &[out_features], in_features)? {
            Some((w, q)) => (w, Some(q)),
            None => (
                ld.take(&format!("{prefix}.weight"), &[out_features, in_features])?,
                None,
            ),
        };
        let bias = if bias {
            Some(ld.take(&format!("{prefix}.bias"), &[out_features])?)
        } else {
            None
        };
        let reduce = match ld.split() {
            Some(crate::distributed::Split::Input) => ld.shard().cloned(),
            _ => None,
        };
        Ok(Self {
            weight,
            bias,
            quant,
            in_features,
            out_features,
            product: ld.product(),
            reduce,
        })
    }

    /// The weight, when it is dense (and so could be quantized).
    pub fn quantizable(&self) -> Option<ParamId> {
        self.quant.is_none().then_some(self.weight)
    }

    /// Every weight this layer reads.
    pub fn params(&self) -> Vec<ParamId> {
        let mut v = vec![self.weight];
        v.extend(self.bias);
        if let Some(q) = &self.quant {
            v.push(q.scales);
            v.push(q.biases);
        }
        v
    }

    /// Applies the layer to `x` (`[..., in]`).
    pub fn forward(&self, p: &Params, x: &Array) -> Result<Array> {
        let Some(shard) = &self.reduce else {
            return self.product_plus(p, x, self.bias);
        };
        // The bias once, after the parts are summed.
        let y = shard.all_sum(&self.product_plus(p, x, None)?)?;
        match self.bias {
            Some(b) => Ok(ops::add(&y, p.get(b)?)?),
            None => Ok(y),
        }
    }

    /// `x W^T` (this rank's part under --tp), plus `bias` when given.
    fn product_plus(&self, p: &Params, x: &Array, bias: Option<ParamId>) -> Result<Array> {
        let w = p.get(self.weight)?;
        match &self.quant {
            None => match bias {
                // mlx.nn.Linear uses addmm when it has a bias.
                Some(b) => match self.product.few_rows(x, w)? {
                    Some(y) => Ok(ops::add(&y, p.get(b)?)?),
                    None => Ok(ops::addmm(p.get(b)?, x, w.t(), 1.0, 1.0)?),
                },
                None => self.product.dense(x, w),
            },
            Some(q) => {
                let y =
                    self.product
                        .quantized(x, w, p.get(q.scales)?, p.get(q.biases)?, &q.spec)?;
                match bias {
                    Some(b) => Ok(ops::add(&y, p.get(b)?)?),
                    None => Ok(y),
                }
            }
        }
    }
}

/// Projections of one input (q/k/v, gate/up, a Gated DeltaNet's inputs)
/// kept as one matrix: their rows are concatenated at load, so one product
/// (one kernel, one read of the input) serves them all, and
/// [`FusedLinear::forward`] splits the result into views. Decode on a GPU
/// pays per kernel, and a batched product of a few rows costs about the
/// same at any width, so this removes launches (q/k/v 3 → 1, gate/up
/// 2 → 1, Qwen3.5's Gated DeltaNet inputs 4 → 1).
/// Parts stored differently (dense beside quantized, other quantization or
/// dtype) stay separate products, as does everything under
/// `Dispatch::fuse_projections` off. Every output element is the same dot
/// product; its last bits may differ where MLX picks another matmul kernel
/// for the wider product.
#[derive(Clone, Debug)]
pub enum FusedLinear {
    /// One matrix; `sizes` are the parts' output widths, in order.
    One {
        /// The concatenated layer, stored as `{fused_name}.weight`.
        linear: Linear,
        /// Output width of each part.
        sizes: Vec<i32>,
    },
    /// One layer per part.
    Parts(Vec<Linear>),
}

/// The store name of fused parts: `a.b.q_proj`, `a.b.k_proj` →
/// `a.b.q_proj+k_proj` (what [`FusedLinear::load`] also accepts from a
/// checkpoint, e.g. one quantized in memory).
pub fn fused_name(prefixes: &[&str]) -> String {
    let mut out = prefixes[0].to_owned();
    for p in &prefixes[1..] {
        out.push('+');
        out.push_str(p.rsplit('.').next().unwrap_or(p));
    }
    out
}

impl FusedLinear {
    /// Loads the parts `{prefix}.weight` (+ `.bias`), each of `[out, in]`
    /// (or packed), as one matrix where they are stored alike (unless the
    /// loader's dispatch says otherwise); a checkpoint that already holds
    /// [`fused_name`] is read as it is.
    pub fn load(
        ld: &mut WeightLoader,
        parts: &[(&str, i32)],
        in_features: i32,
        bias: bool,
    ) -> Result<Self> {
        let fuse = ld.dispatch().fuse_projections;
        Self::load_with(ld, parts, in_features, bias, fuse)
    }

    /// [`FusedLinear::load`] with fusion chosen by `fuse` rather than the
    /// loader's dispatch.
    pub fn load_with(
        ld: &mut WeightLoader,
        parts: &[(&str, i32)],
        in_features: i32,
        bias: bool,
        fuse: bool,
    ) -> Result<Self> {
        let prefixes: Vec<&str> = parts.iter().map(|(p, _)| *p).collect();
        let sizes: Vec<i32> = parts.iter().map(|(_, n)| *n).collect();
        let total: i32 = sizes.iter().sum();
        let name = fused_name(&prefixes);
        if ld.has(&format!("{name}.weight")) {
            // Stored concatenated: under --tp each part's rows split on
            // their own (shared by as many ranks as its own would be).
            let segments: Vec<(i32, usize)> =
                parts.iter().map(|&(p, n)| (n, ld.copies_of(p))).collect();
            let linear = ld.with_shared_segments(&name, &segments, |ld| {
                Linear::load(ld, &name, in_features, total, bias)
            })?;
            return Ok(Self::One { linear, sizes });
        }
        let separate = |ld: &mut WeightLoader| -> Result<Self> {
            let layers = parts
                .iter()
                .map(|(p, n)| Linear::load(ld, p, in_features, *n, bias))
                .collect::<Result<Vec<_>>>()?;
            Ok(Self::Parts(layers))
        };
        if parts.len() < 2 || !fuse {
            return separate(ld);
        }
        // Fuse only parts stored alike; anything else (including a broken
        // checkpoint) loads part by part, which names what is wrong.
        let quant: Vec<Option<QuantSpec>> = prefixes
            .iter()
            .map(|p| {
                ld.has(&format!("{p}.scales"))
                    .then(|| ld.quant_for(p))
                    .flatten()
            })
            .collect();
        let scaled = prefixes
            .iter()
            .filter(|p| ld.has(&format!("{p}.scales")))
            .count();
        // Every tensor the parts hold, present with one dtype across them
        // (a concatenation would otherwise promote, e.g. float16 scales
        // beside float32 ones in a GGUF file).
        let alike = |suffix: &str| {
            let dtypes: Vec<Option<Dtype>> = prefixes
                .iter()
                .map(|p| ld.dtype_of(&format!("{p}.{suffix}")))
                .collect();
            dtypes[0].is_some() && dtypes.windows(2).all(|w| w[0] == w[1])
        };
        let same_quant = quant.windows(2).all(|w| w[0] == w[1]);
        let stored_alike = if quant[0].is_some() {
            scaled == parts.len()
                && same_quant
                && ["weight", "scales", "biases"].iter().all(|s| alike(s))
        } else {
            scaled == 0 && alike("weight")
        };
        let consistent = stored_alike && (!bias || alike("bias"));
        let fits = |spec: &QuantSpec| {
            in_features % spec.group_size == 0 && (in_features * spec.bits) % 32 == 0
        };
        if !consistent || quant[0].as_ref().is_some_and(|q| !fits(q)) {
            return separate(ld);
        }
        let cat = |ld: &mut WeightLoader, suffix: &str, cols: Option<i32>, float: bool| {
            let arrays = parts
                .iter()
                .map(|(p, n)| {
                    let shape = match cols {
                        Some(c) => vec![*n, c],
                        None => vec![*n],
                    };
                    ld.take_raw(&format!("{p}.{suffix}"), &shape, float)
                })
                .collect::<Result<Vec<_>>>()?;
            let joined = ops::concatenate(&arrays, 0)?;
            Ok::<_, Error>(ld.push_derived(&format!("{name}.{suffix}"), joined))
        };
        let (weight, q) = match &quant[0] {
            None => (cat(ld, "weight", Some(in_features), true)?, None),
            Some(spec) => {
                let weight = cat(ld, "weight", Some(in_features * spec.bits / 32), false)?;
                let groups = Some(in_features / spec.group_size);
                let q = Quantized {
                    scales: cat(ld, "scales", groups, true)?,
                    biases: cat(ld, "biases", groups, true)?,
                    spec: spec.clone(),
                };
                (weight, Some(q))
            }
        };
        let bias = if bias {
            Some(cat(ld, "bias", None, true)?)
        } else {
            None
        };
        Ok(Self::One {
            linear: Linear {
                weight,
                bias,
                quant: q,
                in_features,
                out_features: total,
                product: ld.product(),
                reduce: None,
            },
            sizes,
        })
    }

    /// Every weight read.
    pub fn params(&self) -> Vec<ParamId> {
        match self {
            Self::One { linear, .. } => linear.params(),
            Self::Parts(v) => v.iter().flat_map(Linear::params).collect(),
        }
    }

    /// The dense weights (which could be quantized).
    pub fn quantizable(&self) -> Vec<ParamId> {
        match self {
            Self::One { linear, .. } => linear.quantizable().into_iter().collect(),
            Self::Parts(v) => v.iter().filter_map(Linear::quantizable).collect(),
        }
    }

    /// The parts' outputs for `x` (`[..., in]`), in load order.
    pub fn forward(&self, p: &Params, x: &Array) -> Result<Vec<Array>> {
        match self {
            Self::One { linear, sizes } => {
                let y = linear.forward(p, x)?;
                let mut at = Vec::with_capacity(sizes.len() - 1);
                let mut end = 0;
                for n in &sizes[..sizes.len() - 1] {
                    end += n;
                    at.push(end);
                }
                Ok(ops::split_at_indices(&y, &at, -1)?)
            }
            Self::Parts(v) => v.iter().map(|l| l.forward(p, x)).collect(),
        }
    }
}

/// The ranks' logits `[..., vocab / size]` joined in rank order along the
/// last axis (MLX gathers along the first).
pub fn gather_vocab(shard: &Shard, x: &Array) -> Result<Array> {
    let last = x.ndim() as i32 - 1;
    let front = ops::move_axis(x, last, 0)?;
    Ok(ops::move_axis(&shard.all_gather(&front)?, 0, last)?)
}

/// Token embedding, dense or quantized, usable as a tied output head.
#[derive(Clone, Debug)]
pub struct Embedding {
    /// `[vocab, dim]` or packed.
    pub weight: ParamId,
    /// Present for quantized embeddings.
    pub quant: Option<Quantized>,
    /// Vocabulary size.
    pub vocab: i32,
    /// Embedding width.
    pub dim: i32,
    /// Multiplies the looked-up rows (Granite's `embedding_multiplier`);
    /// never the tied output head.
    pub scale: Option<f32>,
    /// How its product as a tied head runs.
    pub product: Product,
    /// Under --tp, when the ranks divide the vocabulary: this rank holds
    /// the rows `[rank * vocab / size, (rank + 1) * vocab / size)`; a
    /// lookup sums the ranks' rows (each rank's are zero but for its own
    /// ids) and a product gathers the ranks' logits.
    pub vocab_split: Option<Shard>,
}

impl Embedding {
    /// Loads `{prefix}.weight` (quantized when `{prefix}.scales` exists);
    /// under --tp split by vocabulary when the ranks divide it, whole on
    /// every rank otherwise.
    pub fn load(ld: &mut WeightLoader, prefix: &str, vocab: i32, dim: i32) -> Result<Self> {
        let vocab_split = ld
            .shard()
            .filter(|s| (vocab as usize).is_multiple_of(s.size()))
            .cloned();
        let rows = vocab / vocab_split.as_ref().map_or(1, |s| s.size() as i32);
        let load = |ld: &mut WeightLoader| -> Result<_> {
            Ok(match load_quantized(ld, prefix, &[rows], dim)? {
                Some((w, q)) => (w, Some(q)),
                None => (ld.take(&format!("{prefix}.weight"), &[rows, dim])?, None),
            })
        };
        let (weight, quant) = match vocab_split {
            Some(_) => ld.with_split(Split::Leading, load)?,
            None => load(ld)?,
        };
        Ok(Self {
            weight,
            quant,
            vocab,
            dim,
            scale: None,
            product: ld.product(),
            vocab_split,
        })
    }

    /// Every weight this layer reads.
    pub fn params(&self) -> Vec<ParamId> {
        let mut v = vec![self.weight];
        if let Some(q) = &self.quant {
            v.push(q.scales);
            v.push(q.biases);
        }
        v
    }

    /// The table, when it is dense (and so could be quantized).
    pub fn quantizable(&self) -> Option<ParamId> {
        self.quant.is_none().then_some(self.weight)
    }

    /// The dtype of the embedding's output.
    pub fn dtype(&self, p: &Params) -> Result<Dtype> {
        Ok(match &self.quant {
            Some(q) => p.get(q.scales)?.dtype(),
            None => p.get(self.weight)?.dtype(),
        })
    }

    /// Looks up `ids` (any integer shape) → `[..., dim]`, times
    /// [`Embedding::scale`].
    pub fn forward(&self, p: &Params, ids: &Array) -> Result<Array> {
        let rows = self.lookup(p, ids)?;
        match self.scale {
            Some(s) => Ok(ops::multiply(&rows, scalar(s, rows.dtype())?)?),
            None => Ok(rows),
        }
    }

    fn lookup(&self, p: &Params, ids: &Array) -> Result<Array> {
        let Some(shard) = &self.vocab_split else {
            return self.lookup_rows(p, ids);
        };
        // This rank's rows for its own ids, zeros for the others', summed
        // over the ranks: every id is some one rank's, and x + 0 is x.
        let rows = self.vocab / shard.size() as i32;
        let first = rows * shard.rank() as i32;
        let local = ops::subtract(&ids.as_dtype(Dtype::Int32)?, Array::from_int(first))?;
        let mine = ops::logical_and(
            &ops::ge(&local, Array::from_int(0))?,
            &ops::lt(&local, Array::from_int(rows))?,
        )?;
        let clamped = ops::clip(&local, (0, rows - 1))?;
        let found = self.lookup_rows(p, &clamped)?;
        let zero = Array::from_f32(0.0).as_dtype(found.dtype())?;
        let kept = ops::select(&ops::expand_dims(&mine, -1)?, &found, &zero)?;
        shard.all_sum(&kept)
    }

    fn lookup_rows(&self, p: &Params, ids: &Array) -> Result<Array> {
        let w = p.get(self.weight)?;
        match &self.quant {
            None => Ok(w.take_axis(ids, 0)?),
            Some(q) => {
                let rows = w.take_axis(ids, 0)?;
                let s = p.get(q.scales)?.take_axis(ids, 0)?;
                let b = p.get(q.biases)?.take_axis(ids, 0)?;
                Ok(ops::dequantize(
                    &rows,
                    &s,
                    &b,
                    q.spec.group_size,
                    q.spec.bits,
                )?)
            }
        }
    }

    /// `x @ W^T`: the embedding as the output projection (tied heads).
    pub fn as_linear(&self, p: &Params, x: &Array) -> Result<Array> {
        let w = p.get(self.weight)?;
        let out = match &self.quant {
            None => self.product.dense(x, w)?,
            Some(q) => self
                .product
                .quantized(x, w, p.get(q.scales)?, p.get(q.biases)?, &q.spec)?,
        };
        match &self.vocab_split {
            Some(shard) => gather_vocab(shard, &out),
            None => Ok(out),
        }
    }
}

/// RMS normalisation over the last axis with a learned scale.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// `[dim]` scale.
    pub weight: ParamId,
    /// Epsilon added to the mean square.
    pub eps: f32,
}

impl RmsNorm {
    /// Loads `{prefix}.weight` of `[dim]`.
    pub fn load(ld: &mut WeightLoader, prefix: &str, dim: i32, eps: f32) -> Result<Self> {
        Ok(Self {
            weight: ld.take(&format!("{prefix}.weight"), &[dim])?,
            eps,
        })
    }

    /// Applies the norm.
    pub fn forward(&self, p: &Params, x: &Array) -> Result<Array> {
        Ok(mlx_rs::fast::rms_norm(
            x,
            Some(p.get(self.weight)?),
            self.eps,
        )?)
    }
}

/// Which normalisation a norm is: RMS (most decoder LLMs) or LayerNorm
/// (mean-centred, with a bias when the checkpoint has one: StableLM,
/// GPT-NeoX). An option of every layer kind with a pre-norm and of a spec's
/// `[model]` (its final norm), as `norm_type = "rms" | "layer_norm"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// `x / sqrt(mean(x^2) + eps) * w` (MLX `fast.rms_norm`).
    #[default]
    Rms,
    /// `(x - mean) / sqrt(var + eps) * w + b` (MLX `fast.layer_norm`, as
    /// `mlx.nn.LayerNorm`).
    LayerNorm,
}

/// LayerNorm over the last axis with a learned scale and an optional bias.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    /// `[dim]` scale.
    pub weight: ParamId,
    /// `[dim]` shift, when the checkpoint has `{prefix}.bias`.
    pub bias: Option<ParamId>,
    /// Epsilon added to the variance.
    pub eps: f32,
}

impl LayerNorm {
    /// Loads `{prefix}.weight` and, when present, `{prefix}.bias`, each of
    /// `[dim]`.
    pub fn load(ld: &mut WeightLoader, prefix: &str, dim: i32, eps: f32) -> Result<Self> {
        let bias_name = format!("{prefix}.bias");
        let bias = if ld.has(&bias_name) {
            Some(ld.take(&bias_name, &[dim])?)
        } else {
            None
        };
        Ok(Self {
            weight: ld.take(&format!("{prefix}.weight"), &[dim])?,
            bias,
            eps,
        })
    }

    /// Applies the norm.
    pub fn forward(&self, p: &Params, x: &Array) -> Result<Array> {
        let bias = match self.bias {
            Some(b) => Some(p.get(b)?),
            None => None,
        };
        Ok(mlx_rs::fast::layer_norm(
            x,
            Some(p.get(self.weight)?),
            bias,
            self.eps,
        )?)
    }
}

/// A layer's norm: RMS or LayerNorm, chosen by [`NormKind`].
#[derive(Clone, Debug)]
pub enum Norm {
    /// RMS norm.
    Rms(RmsNorm),
    /// LayerNorm.
    Layer(LayerNorm),
}

impl Norm {
    /// Loads the norm at `prefix` of `[dim]` as `kind`.
    pub fn load(
        kind: NormKind,
        ld: &mut WeightLoader,
        prefix: &str,
        dim: i32,
        eps: f32,
    ) -> Result<Self> {
        Ok(match kind {
            NormKind::Rms => Norm::Rms(RmsNorm::load(ld, prefix, dim, eps)?),
            NormKind::LayerNorm => Norm::Layer(LayerNorm::load(ld, prefix, dim, eps)?),
        })
    }

    /// Its weights.
    pub fn params(&self) -> Vec<ParamId> {
        match self {
            Norm::Rms(n) => vec![n.weight],
            Norm::Layer(n) => std::iter::once(n.weight).chain(n.bias).collect(),
        }
    }

    /// Applies the norm.
    pub fn forward(&self, p: &Params, x: &Array) -> Result<Array> {
        match self {
            Norm::Rms(n) => n.forward(p, x),
            Norm::Layer(n) => n.forward(p, x),
        }
    }
}

/// Depthwise causal 1-D convolution over time, as mlx-lm's hybrids use it:
/// weight `[channels, kernel, 1]` (MLX layout), input `[B, T + kernel - 1, C]`
/// already left-padded with the previous window.
#[derive(Clone, Debug)]
pub struct DepthwiseConv {
    /// `[channels, kernel, 1]`.
    pub weight: ParamId,
    /// Optional `[channels]` bias.
    pub bias: Option<ParamId>,
    /// Channels.
    pub channels: i32,
    /// Kernel width.
    pub kernel: i32,
}

impl DepthwiseConv {
    /// Loads `{prefix}.weight` (`[C, K, 1]`) and optionally `.bias`.
    pub fn load(
        ld: &mut WeightLoader,
        prefix: &str,
        channels: i32,
        kernel: i32,
        bias: bool,
    ) -> Result<Self> {
        let weight = ld.take(&format!("{prefix}.weight"), &[channels, kernel, 1])?;
        let bias = if bias {
            Some(ld.take(&format!("{prefix}.bias"), &[channels])?)
        } else {
            None
        };
        Ok(Self {
            weight,
            bias,
            channels,
            kernel,
        })
    }

    /// Every weight this layer reads.
    pub fn params(&self) -> Vec<ParamId> {
        let mut v = vec![self.weight];
        v.extend(self.bias);
        v
    }

    /// Valid convolution of a padded input: `[B, T + K - 1, C]` → `[B, T, C]`.
    pub fn forward(&self, p: &Params, padded: &Array) -> Result<Array> {
        let y = ops::conv1d(padded, p.get(self.weight)?, 1, 0, 1, self.channels)?;
        match self.bias {
            Some(b) => Ok(ops::add(&y, p.get(b)?)?),
            None => Ok(y),
        }
    }
}

/// `silu(x) = x * sigmoid(x)`.
pub fn silu(x: &Array) -> Result<Array> {
    Ok(ops::multiply(x, ops::sigmoid(x)?)?)
}

/// `silu(gate) * x`, as mlx-lm's `swiglu`.
pub fn swiglu(gate: &Array, x: &Array) -> Result<Array> {
    Ok(ops::multiply(silu(gate)?, x)?)
}

/// `relu(x)^2`, as `mlx.nn.relu2`.
pub fn relu2(x: &Array) -> Result<Array> {
    let r = ops::maximum(x, Array::from_f32(0.0).as_dtype(x.dtype())?)?;
    Ok(ops::square(&r)?)
}

/// `log(1 + exp(x))`, as `mlx.nn.softplus` (`logaddexp(x, 0)`).
pub fn softplus(x: &Array) -> Result<Array> {
    Ok(ops::logaddexp(
        x,
        Array::from_f32(0.0).as_dtype(x.dtype())?,
    )?)
}

/// A scalar of `dtype`.
pub fn scalar(v: f32, dtype: Dtype) -> Result<Array> {
    Ok(Array::from_f32(v).as_dtype(dtype)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Backend;
    use crate::dispatch::Dispatch;

    /// The rerouted route is taken for a few rows of half-precision
    /// activations only, and is the float32 quantized product cast back.
    #[test]
    fn half_precision_quantized_products_reroute_a_few_rows_only() {
        let w = mlx_rs::random::normal::<f32>(&[256, 128], None, None, None)
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let (wq, s, b) = ops::quantize(&w, 64, 4).unwrap();
        let spec = QuantSpec {
            group_size: 64,
            bits: 4,
        };
        let mut d = Dispatch::for_backend(Backend::Cpu, false);
        let plain = Product::of(&d);
        d.reroute_half_quantized = true;
        let rerouted = Product::of(&d);
        let qmm = |x: &Array| ops::quantized_matmul(x, &wq, &s, &b, true, 64, 4).unwrap();
        for rows in [1, 4, REROUTED_ROWS as i32] {
            let x = mlx_rs::random::normal::<f32>(&[rows, 128], None, None, None)
                .unwrap()
                .as_dtype(Dtype::Bfloat16)
                .unwrap();
            let half = qmm(&x);
            let f32_route = qmm(&x.as_dtype(Dtype::Float32).unwrap())
                .as_dtype(Dtype::Bfloat16)
                .unwrap();
            // The two routes round differently (else this test could not
            // tell them apart).
            assert!(!f32_route.eq_values(&half).unwrap());
            let y = rerouted.quantized(&x, &wq, &s, &b, &spec).unwrap();
            let want = if (rows as usize) < REROUTED_ROWS {
                &f32_route
            } else {
                &half
            };
            assert!(y.eq_values(want).unwrap(), "{rows} rows");
            assert_eq!(y.dtype(), Dtype::Bfloat16);
            let y = plain.quantized(&x, &wq, &s, &b, &spec).unwrap();
            assert!(y.eq_values(&half).unwrap(), "{rows} rows, plain");
        }
    }
}
