//! Causal attention of a few query rows over a longer KV cache, the rows of
//! a speculative verify forward, in one CUDA launch (`attention_rows.cu`).
//!
//! MLX's CUDA backend (0.32) sends such a call to cuDNN, which builds an
//! execution plan per key length (some 20 ms each on the H200, a new length
//! every round with a rejection), and the ops form that replaced it
//! (`mlex_models::layers::sdpa::causal_ops`) costs about a dozen launches a
//! layer, which a verify forward over 2-8 tokens pays in every attention
//! layer (`docs/BENCHMARKS.md`). This kernel reads the cache's prefix in
//! place (no copy of the keys), one block per query row with an online
//! softmax in float, as flash decoding does; it must equal the ops form
//! (`crates/mlex-kernels/tests/attention.rs`, on the GPU).

use crate::cuda::{CudaKernel, OutputSpec, TemplateArg};
use mlex_core::error::Result;
use mlx_rs::{Array, Dtype};

const SOURCE: &str = include_str!("attention_rows.cu");

/// Warps a block: each takes every `WARPS`-th run of four keys.
const WARPS: i32 = 8;

/// Whether [`causal_rows`] takes `q` `[B, Hq, T, D]` over `keys`/`values`
/// `[B, Hkv, L, D]`: one dtype among f32, bf16 and f16, `D` a multiple of 32
/// up to 256, `Hq` a multiple of `Hkv`, and `T <= L`.
pub fn causal_rows_supported(q: &Array, keys: &Array, values: &Array) -> bool {
    let (qs, ks, vs) = (q.shape(), keys.shape(), values.shape());
    if qs.len() != 4 || ks.len() != 4 || ks != vs {
        return false;
    }
    let d = qs[3];
    matches!(q.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && keys.dtype() == q.dtype()
        && values.dtype() == q.dtype()
        && d % 32 == 0
        && d <= 256
        && ks[3] == d
        && qs[0] == ks[0]
        && ks[1] > 0
        && qs[1] % ks[1] == 0
        && qs[2] >= 1
        && qs[2] <= ks[2]
}

/// Causal attention of `q` `[B, Hq, T, D]` over `keys`/`values`
/// `[B, Hkv, L, D]` with the queries aligned to the last keys (query `i`
/// sees keys `0..=L - T + i`), scores scaled by `scale`: `[B, Hq, T, D]`
/// in `q`'s dtype. CUDA only; check [`causal_rows_supported`] first.
pub fn causal_rows(q: &Array, keys: &Array, values: &Array, scale: f32) -> Result<Array> {
    let qs = q.shape().to_vec();
    let kernel = CudaKernel::cached_with_layout(
        "mlex_attention_rows",
        &["q", "k", "v", "scale"],
        &["o"],
        SOURCE,
        false,
    )?;
    let scale = Array::from_slice(&[scale], &[1]);
    let out = kernel.apply(
        &[q, keys, values, &scale],
        &[OutputSpec {
            shape: qs.clone(),
            dtype: q.dtype(),
        }],
        &[
            ("InT", TemplateArg::Dtype(q.dtype())),
            ("D", TemplateArg::Int(qs[3])),
            ("W", TemplateArg::Int(WARPS)),
        ],
        (32 * WARPS, qs[2], qs[0] * qs[1]),
        (32 * WARPS, 1, 1),
    )?;
    Ok(out.into_iter().next().expect("one output"))
}
