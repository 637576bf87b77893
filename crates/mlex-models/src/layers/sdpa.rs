//! Scaled dot-product attention over a KV cache: MLX's fused kernel, or
//! for a few query rows over a longer cache the ops form.
//!
//! Why the ops form: MLX's CUDA backend (0.32) sends a causal call of
//! several query rows to cuDNN, which builds an execution plan for every new
//! key length (some 20 ms each on the H200) and keeps them in an LRU that
//! aborts the process after 512 misses. A speculative verify forward has a
//! few rows and a key length that changes every round, so every round
//! missed: measured on the H200, a round with a rejected draft cost 12-43
//! ms against 4-10 ms for one that kept all (`docs/BENCHMARKS.md`). The ops
//! form is what MLX itself computes where no kernel applies (its
//! `scaled_dot_product_attention` fallback: scores, causal mask aligned to
//! the last key, precise softmax, weighted values), with no per-shape
//! build. On CUDA those calls now run as one kernel of ours
//! (`mlex_kernels::attention`, equal to the ops form) where it takes the
//! shapes: the ops form is a dozen launches a layer. Which row counts take
//! either is [`Dispatch::ops_attention_rows`] (CUDA only by default;
//! Metal's vector kernel takes a few causal rows).
//!
//! [`Dispatch::ops_attention_rows`]: mlex_core::dispatch::Dispatch::ops_attention_rows
//! [`Dispatch::attention_rows_kernel`]: mlex_core::dispatch::Dispatch::attention_rows_kernel
//! [`Dispatch::masked_attention_ops`]: mlex_core::dispatch::Dispatch::masked_attention_ops

use mlex_core::cache::{AttentionMask, KvQuantization};
use mlex_core::error::Result;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{fast, ops, Array, Dtype};

/// How [`attend`] computes the calls MLX's fused attention serves badly on
/// some backend (from the model's `Dispatch`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttendPolicy {
    /// Causal calls of this many query rows over a longer cache leave
    /// MLX's fused attention ([`Dispatch::ops_attention_rows`]).
    pub few_rows: Option<(i32, i32)>,
    /// ... for the one-launch kernel (`mlex_kernels::attention`) where it
    /// takes the shapes, else the ops form
    /// ([`Dispatch::attention_rows_kernel`]).
    pub few_rows_kernel: bool,
    /// An array mask of one sequence attends as ops in row blocks
    /// ([`masked_ops`]; [`Dispatch::masked_attention_ops`]).
    pub masked_as_ops: bool,
}

impl AttendPolicy {
    /// The choices of `d`.
    pub fn of(d: &mlex_core::dispatch::Dispatch) -> AttendPolicy {
        AttendPolicy {
            few_rows: d.ops_attention_rows,
            few_rows_kernel: d.attention_rows_kernel,
            masked_as_ops: d.masked_attention_ops,
        }
    }
}

/// Attention of `q` `[B, Hq, T, D]` over `keys`/`values` `[B, Hkv, L, D]`
/// (`Hq` a multiple of `Hkv`) under `mask`; a causal call of a row count
/// in `policy.few_rows` over a longer cache (`T < L`) runs as one kernel
/// or as ops, and so does an array mask of one sequence when
/// `policy.masked_as_ops` ([`masked_ops`]).
pub fn attend(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: &AttentionMask,
    policy: AttendPolicy,
) -> Result<Array> {
    let (t, l) = (q.shape()[2], keys.shape()[2]);
    Ok(match mask {
        AttentionMask::Causal
            if t < l
                && policy
                    .few_rows
                    .is_some_and(|(lo, hi)| (lo..=hi).contains(&t)) =>
        {
            if policy.few_rows_kernel
                && mlex_kernels::attention::causal_rows_supported(q, keys, values)
            {
                mlex_kernels::attention::causal_rows(q, keys, values, scale)?
            } else {
                causal_ops(q, keys, values, scale)?
            }
        }
        AttentionMask::None => {
            fast::scaled_dot_product_attention(q, keys, values, scale, None, None)?
        }
        AttentionMask::Causal => fast::scaled_dot_product_attention(
            q,
            keys,
            values,
            scale,
            ScaledDotProductAttentionMask::Causal,
            None,
        )?,
        AttentionMask::Array(m) if policy.masked_as_ops && leading_ones(m) => {
            masked_ops(q, keys, values, scale, m)?
        }
        AttentionMask::Array(m) => {
            fast::scaled_dot_product_attention(q, keys, values, scale, m, None)?
        }
    })
}

/// True when every axis of `m` before its last two is 1 (one mask for
/// every sequence and head).
fn leading_ones(m: &Array) -> bool {
    let s = m.shape();
    s[..s.len().saturating_sub(2)].iter().all(|&x| x == 1)
}

/// Query rows a masked attention call takes at once as ops
/// ([`masked_ops`]).
pub const MASKED_ROWS: i32 = 512;

/// Attention under an array mask (a `--max-kv-size` window's prefill) as
/// ops, [`MASKED_ROWS`] query rows at a time: rows are independent, so the
/// blocks give one call's result in bounded memory. On CUDA, MLX's
/// attention under an array mask keeps a `[H, T, L]` buffer of every call
/// until the whole forward has run (30 GB for a 28-layer model at a
/// 4,096-token step over a 4,096-token window, `docs/BENCHMARKS.md`).
pub fn masked_ops(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: &Array,
) -> Result<Array> {
    let t = q.shape()[2];
    let n = mask.ndim();
    // A [T, L] mask, or one whose leading axes are 1.
    let m = ops::reshape(mask, &mask.shape()[n.saturating_sub(2)..])?;
    let mut parts = Vec::new();
    for a in (0..t).step_by(MASKED_ROWS as usize) {
        let b = (a + MASKED_ROWS).min(t);
        let qb = q.try_index((.., .., a..b, ..))?;
        let mb = if m.shape()[0] == t {
            m.try_index((a..b, ..))?
        } else {
            m.clone()
        };
        parts.push(visible_ops(&qb, keys, values, scale, &mb)?);
    }
    Ok(ops::concatenate(&parts, 2)?)
}

/// Attention as ops where `visible` (`[T, L]`: bool, or added to the
/// scores) says which keys each query sees; grouped heads broadcast.
fn visible_ops(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    visible: &Array,
) -> Result<Array> {
    let s = q.shape().to_vec();
    let (b, hq, t, d) = (s[0], s[1], s[2], s[3]);
    let hkv = keys.shape()[1];
    let rep = hq / hkv;
    // Grouped heads: [B, Hkv, rep, T, D] against [B, Hkv, 1, L, D].
    let q = ops::reshape(
        &ops::multiply(q, Array::from_f32(scale).as_dtype(q.dtype())?)?,
        &[b, hkv, rep, t, d],
    )?;
    let k = ops::expand_dims(keys, 2)?;
    let v = ops::expand_dims(values, 2)?;
    let scores = ops::matmul(&q, &k.swap_axes(-1, -2)?)?;
    let scores = if visible.dtype() == Dtype::Bool {
        let floor = Array::from_f32(f32::NEG_INFINITY).as_dtype(scores.dtype())?;
        ops::select(visible, &scores, &floor)?
    } else {
        ops::add(&scores, visible)?
    };
    let p = ops::softmax_axis(&scores, -1, true)?;
    let o = ops::matmul(&p, &v)?;
    Ok(ops::reshape(&o, &[b, hq, t, d])?)
}

/// The ops form of causal attention with the queries aligned to the last
/// keys (query `i` of `T` sees keys `0..=L - T + i`).
pub fn causal_ops(q: &Array, keys: &Array, values: &Array, scale: f32) -> Result<Array> {
    let visible = causal_visible(q.shape()[2], keys.shape()[2])?;
    visible_ops(q, keys, values, scale, &visible)
}

/// `[T, L]` bool: query `i` of `T` sees keys `0..=L - T + i` (aligned to
/// the last key).
fn causal_visible(t: i32, l: i32) -> Result<Array> {
    let rows = ops::arange::<_, i32>(l - t, l, None)?;
    let cols = ops::arange::<_, i32>(0, l, None)?;
    Ok(ops::ge(
        &ops::expand_dims(&rows, 1)?,
        &ops::expand_dims(&cols, 0)?,
    )?)
}

/// The most negative finite value of `dtype` (NumPy's `finfo(dtype).min`,
/// what mlx-lm fills masked scores with).
fn finfo_min(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Bfloat16 => -3.389_531_4e38,
        Dtype::Float16 => -65_504.0,
        _ => f32::MIN,
    }
}

/// Attention over quantized keys and values (mlx-lm's
/// `quantized_scaled_dot_product_attention`): the queries scaled, scores
/// and weighted values by `quantized_matmul`, grouped heads as a broadcast
/// axis, a causal mask aligned to the last key, precise softmax.
pub fn quantized_attend(
    q: &Array,
    keys: &[Array; 3],
    values: &[Array; 3],
    scale: f32,
    mask: &AttentionMask,
    quantization: &KvQuantization,
) -> Result<Array> {
    let s = q.shape().to_vec();
    let (b, hq, t, d) = (s[0], s[1], s[2], s[3]);
    let hkv = keys[0].shape()[1];
    let rep = hq / hkv;
    let mut q = ops::multiply(q, Array::from_f32(scale).as_dtype(q.dtype())?)?;
    let grouped = |t: &[Array; 3]| -> Result<Vec<Array>> {
        t.iter()
            .map(|a| {
                Ok(if rep > 1 {
                    ops::expand_dims(a, -3)?
                } else {
                    a.clone()
                })
            })
            .collect()
    };
    let (k, v) = (grouped(keys)?, grouped(values)?);
    if rep > 1 {
        q = ops::reshape(&q, &[b, hkv, rep, t, d])?;
    }
    let (g, bits) = (quantization.group_size, quantization.bits);
    let mut scores = ops::quantized_matmul(&q, &k[0], &k[1], &k[2], true, g, bits)?;
    let floor = || Array::from_f32(finfo_min(scores.dtype())).as_dtype(scores.dtype());
    match mask {
        AttentionMask::None => {}
        AttentionMask::Causal => {
            let n = scores.shape().len();
            let (ql, kl) = (scores.shape()[n - 2], scores.shape()[n - 1]);
            scores = ops::select(&causal_visible(ql, kl)?, &scores, &floor()?)?;
        }
        AttentionMask::Array(m) => {
            let m = if rep > 1 && m.ndim() > 3 {
                ops::expand_dims(m, -3)?
            } else {
                m.clone()
            };
            scores = if m.dtype() == Dtype::Bool {
                ops::select(&m, &scores, &floor()?)?
            } else {
                ops::add(&scores, &m)?
            };
        }
    }
    let p = ops::softmax_axis(&scores, -1, true)?;
    let o = ops::quantized_matmul(&p, &v[0], &v[1], &v[2], false, g, bits)?;
    Ok(if rep > 1 {
        ops::reshape(&o, &[b, hq, t, d])?
    } else {
        o
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(shape: &[i32], seed: u64) -> Array {
        let key = mlx_rs::random::key(seed).unwrap();
        mlx_rs::random::normal::<f32>(shape, None, None, &key).unwrap()
    }

    fn values(a: &Array) -> Vec<f32> {
        a.eval().unwrap();
        a.as_slice::<f32>().to_vec()
    }

    /// The ops form equals MLX's fused causal attention (grouped heads,
    /// a few rows over a longer cache), and `attend` takes it only for the
    /// row counts it is given.
    #[test]
    fn causal_ops_equals_mlx_attention() {
        for (t, l, hq, hkv) in [(4, 9, 4, 2), (2, 3, 2, 2), (7, 40, 6, 2), (5, 5, 2, 1)] {
            let q = random(&[2, hq, t, 8], 1);
            let k = random(&[2, hkv, l, 8], 2);
            let v = random(&[2, hkv, l, 8], 3);
            let want = fast::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                0.3,
                ScaledDotProductAttentionMask::Causal,
                None,
            )
            .unwrap();
            let got = causal_ops(&q, &k, &v, 0.3).unwrap();
            let (a, b) = (values(&got), values(&want));
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-5, "T={t} L={l}: {worst}");
            let policy = AttendPolicy {
                few_rows: Some((2, 32)),
                ..AttendPolicy::default()
            };
            let via = attend(&q, &k, &v, 0.3, &AttentionMask::Causal, policy).unwrap();
            assert_eq!(values(&via), a, "T={t} L={l}: attend");
        }
        // A wrong alignment (queries at the first keys) would differ.
        let q = random(&[1, 2, 3, 8], 4);
        let k = random(&[1, 2, 9, 8], 5);
        let v = random(&[1, 2, 9, 8], 6);
        let full = fast::scaled_dot_product_attention(&q, &k, &v, 0.3, None, None).unwrap();
        let causal = causal_ops(&q, &k, &v, 0.3).unwrap();
        assert_ne!(values(&full), values(&causal));
    }

    /// An array-masked call of more than [`MASKED_ROWS`] rows, as ops in
    /// row blocks, equals MLX's one call (a window mask, grouped heads).
    #[test]
    fn masked_row_blocks_equal_one_call() {
        let (t, l) = (MASKED_ROWS + 77, MASKED_ROWS + 200);
        let q = random(&[1, 4, t, 8], 7);
        let k = random(&[1, 2, l, 8], 8);
        let v = random(&[1, 2, l, 8], 9);
        let rows = ops::add(
            ops::arange::<_, i32>(0, t, None).unwrap(),
            Array::from_int(l - t),
        )
        .unwrap();
        let rows = ops::expand_dims(&rows, 1).unwrap();
        let cols = ops::expand_dims(ops::arange::<_, i32>(0, l, None).unwrap(), 0).unwrap();
        let causal = ops::ge(&rows, &cols).unwrap();
        let window = ops::lt(&rows, ops::add(&cols, Array::from_int(100)).unwrap()).unwrap();
        let mask = ops::logical_and(&causal, &window).unwrap();
        let want = fast::scaled_dot_product_attention(&q, &k, &v, 0.3, &mask, None).unwrap();
        let mask = AttentionMask::Array(mask);
        let as_ops = AttendPolicy {
            masked_as_ops: true,
            ..AttendPolicy::default()
        };
        let got = attend(&q, &k, &v, 0.3, &mask, as_ops).unwrap();
        assert_eq!(got.shape(), want.shape());
        let worst = values(&got)
            .iter()
            .zip(&values(&want))
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "{worst}");
        let fused = attend(&q, &k, &v, 0.3, &mask, AttendPolicy::default()).unwrap();
        assert_eq!(
            values(&fused),
            values(&want),
            "MLX's own call without the switch"
        );
    }
}
