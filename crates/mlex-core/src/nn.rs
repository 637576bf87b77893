//! The building blocks every layer kind uses: (quantized) linear and
//! embedding layers, RMS norm, depthwise causal convolution. Each holds
//! [`ParamId`]s and computes with a [`Params`] view, so the same code runs
//! eagerly and inside compiled segments.
//!
//! Numerics follow MLX's `mlx.nn` (which mlx-lm uses) operation by
//! operation, so that parity with mlx-lm holds to float rounding.

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
        return Err(Error::Other(format!(
            "{prefix}: {in_features} input features do not fit group size {} at {} bits",
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

/// A dense `x @ w^T` that beats MLX's matmul for some shapes on some
/// backend: `Ok(None)` hands the product back to MLX. Installed by a kernels
/// crate (`mlex_kernels::skinny::install`), so this crate holds no kernels.
pub type DenseMatmul = fn(x: &Array, w: &Array) -> Result<Option<Array>>;

static DENSE_MATMUL: std::sync::OnceLock<DenseMatmul> = std::sync::OnceLock::new();

/// Installs the process's [`DenseMatmul`] (the first call wins).
pub fn set_dense_matmul_override(f: DenseMatmul) {
    let _ = DENSE_MATMUL.set(f);
}

/// `x @ w^T` for a dense `[out, in]` weight, through the installed
/// [`DenseMatmul`] when it takes the shape.
pub fn dense_matmul(x: &Array, w: &Array) -> Result<Array> {
    match dense_override(x, w)? {
        Some(y) => Ok(y),
        None => Ok(ops::matmul(x, w.t())?),
    }
}

/// The installed [`DenseMatmul`]'s product, when there is one and it takes
/// the shape.
fn dense_override(x: &Array, w: &Array) -> Result<Option<Array>> {
    match DENSE_MATMUL.get() {
        Some(f) => f(x, w),
        None => Ok(None),
    }
}

/// True when a quantized product with activations `x` must run on the
/// dequantized weight: MLX's CUDA backend (0.32) has quantized-matmul
/// kernels for float32 activations only at some shapes and none for a
/// gathered (MoE) product, and a GGUF checkpoint's float32 norms make the
/// activations float32. The dequantized product is exact (the CPU's
/// numbers) and costs a dequantization of the weight per call.
pub fn dequantize_for_product(x: &Array) -> bool {
    x.dtype() == Dtype::Float32 && crate::device::default_is_cuda_gpu()
}

/// `x @ dequantize(w)^T` for an affine-quantized `[out, in]` weight, with
/// MLX's quantized kernel where the backend has one for `x`'s dtype (see
/// [`dequantize_for_product`]).
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    spec: &QuantSpec,
) -> Result<Array> {
    if dequantize_for_product(x) {
        let dense = ops::dequantize(w, scales, biases, spec.group_size, spec.bits)?;
        return Ok(ops::matmul(x, dense.as_dtype(x.dtype())?.t())?);
    }
    Ok(ops::quantized_matmul(
        x,
        w,
        scales,
        biases,
        true,
        spec.group_size,
        spec.bits,
    )?)
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
        Ok(Self {
            weight,
            bias,
            quant,
            in_features,
            out_features,
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
        let w = p.get(self.weight)?;
        match &self.quant {
            None => match self.bias {
                // mlx.nn.Linear uses addmm when it has a bias.
                Some(b) => match dense_override(x, w)? {
                    Some(y) => Ok(ops::add(&y, p.get(b)?)?),
                    None => Ok(ops::addmm(p.get(b)?, x, w.t(), 1.0, 1.0)?),
                },
                None => dense_matmul(x, w),
            },
            Some(q) => {
                let y = quantized_matmul(x, w, p.get(q.scales)?, p.get(q.biases)?, &q.spec)?;
                match self.bias {
                    Some(b) => Ok(ops::add(&y, p.get(b)?)?),
                    None => Ok(y),
                }
            }
        }
    }
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
}

impl Embedding {
    /// Loads `{prefix}.weight` (quantized when `{prefix}.scales` exists).
    pub fn load(ld: &mut WeightLoader, prefix: &str, vocab: i32, dim: i32) -> Result<Self> {
        let (weight, quant) = match load_quantized(ld, prefix, &[vocab], dim)? {
            Some((w, q)) => (w, Some(q)),
            None => (ld.take(&format!("{prefix}.weight"), &[vocab, dim])?, None),
        };
        Ok(Self {
            weight,
            quant,
            vocab,
            dim,
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

    /// Looks up `ids` (any integer shape) → `[..., dim]`.
    pub fn forward(&self, p: &Params, ids: &Array) -> Result<Array> {
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
        match &self.quant {
            None => dense_matmul(x, w),
            Some(q) => quantized_matmul(x, w, p.get(q.scales)?, p.get(q.biases)?, &q.spec),
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
