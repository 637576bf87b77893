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
//! build. Which row counts take it is [`Dispatch::ops_attention_rows`]
//! (CUDA only by default; Metal's vector kernel takes a few causal rows).
//!
//! [`Dispatch::ops_attention_rows`]: mlex_core::dispatch::Dispatch::ops_attention_rows

use mlex_core::cache::AttentionMask;
use mlex_core::error::Result;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::{fast, ops, Array};

/// Attention of `q` `[B, Hq, T, D]` over `keys`/`values` `[B, Hkv, L, D]`
/// (`Hq` a multiple of `Hkv`) under `mask`; a causal call of a row count
/// in `ops_rows` over a longer cache (`T < L`) runs as ops.
pub fn attend(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: &AttentionMask,
    ops_rows: Option<(i32, i32)>,
) -> Result<Array> {
    let (t, l) = (q.shape()[2], keys.shape()[2]);
    Ok(match mask {
        AttentionMask::Causal
            if t < l && ops_rows.is_some_and(|(lo, hi)| (lo..=hi).contains(&t)) =>
        {
            causal_ops(q, keys, values, scale)?
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
        AttentionMask::Array(m) => {
            fast::scaled_dot_product_attention(q, keys, values, scale, m, None)?
        }
    })
}

/// The ops form of causal attention with the queries aligned to the last
/// keys (query `i` of `T` sees keys `0..=L - T + i`).
pub fn causal_ops(q: &Array, keys: &Array, values: &Array, scale: f32) -> Result<Array> {
    let s = q.shape().to_vec();
    let (b, hq, t, d) = (s[0], s[1], s[2], s[3]);
    let (hkv, l) = (keys.shape()[1], keys.shape()[2]);
    let rep = hq / hkv;
    // Grouped heads: [B, Hkv, rep, T, D] against [B, Hkv, 1, L, D].
    let q = ops::reshape(
        &ops::multiply(q, Array::from_f32(scale).as_dtype(q.dtype())?)?,
        &[b, hkv, rep, t, d],
    )?;
    let k = ops::expand_dims(keys, 2)?;
    let v = ops::expand_dims(values, 2)?;
    let scores = ops::matmul(&q, &k.swap_axes(-1, -2)?)?;
    let rows = ops::add(&ops::arange::<_, i32>(0, t, None)?, Array::from_int(l - t))?;
    let cols = ops::arange::<_, i32>(0, l, None)?;
    let visible = ops::ge(&ops::expand_dims(&rows, 1)?, &ops::expand_dims(&cols, 0)?)?;
    let floor = Array::from_f32(f32::NEG_INFINITY).as_dtype(scores.dtype())?;
    let scores = ops::select(&visible, &scores, &floor)?;
    let p = ops::softmax_axis(&scores, -1, true)?;
    let o = ops::matmul(&p, &v)?;
    Ok(ops::reshape(&o, &[b, hq, t, d])?)
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
            let via = attend(&q, &k, &v, 0.3, &AttentionMask::Causal, Some((2, 32))).unwrap();
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
}
