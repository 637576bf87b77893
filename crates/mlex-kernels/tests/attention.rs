//! The few-row causal attention kernel against an independent composition
//! of MLX ops in f32 (CUDA only): grouped heads, query rows 1-8, keys read
//! in place from a prefix of a larger buffer (as the KV cache hands them
//! over), and queries in a transposed layout.

mod common;

use common::{assert_on_cuda, max_rel, normal};
use mlex_kernels::attention::{causal_rows, causal_rows_supported};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};

/// Causal attention aligned to the last key, as ops in f32: scores, a mask
/// that hides key `j` from query `i` when `j > L - T + i`, softmax, values.
fn reference(q: &Array, k: &Array, v: &Array, scale: f32) -> Array {
    let f = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
    let (q, k, v) = (f(q), f(k), f(v));
    let (hq, t) = (q.shape()[1], q.shape()[2]);
    let (hkv, l) = (k.shape()[1], k.shape()[2]);
    let rep = hq / hkv;
    // Each query head reads key head h / rep.
    let idx: Vec<i32> = (0..hq).map(|h| h / rep).collect();
    let idx = Array::from_slice(&idx, &[hq]);
    let (k, v) = (k.take_axis(&idx, 1).unwrap(), v.take_axis(&idx, 1).unwrap());
    let scores = ops::multiply(
        ops::matmul(&q, k.swap_axes(-1, -2).unwrap()).unwrap(),
        Array::from_f32(scale),
    )
    .unwrap();
    let rows = ops::arange::<_, i32>(l - t, l, None).unwrap();
    let cols = ops::arange::<_, i32>(0, l, None).unwrap();
    let visible = ops::ge(
        ops::expand_dims(&rows, 1).unwrap(),
        ops::expand_dims(&cols, 0).unwrap(),
    )
    .unwrap();
    let scores = ops::select(&visible, &scores, Array::from_f32(f32::NEG_INFINITY)).unwrap();
    let p = ops::softmax_axis(&scores, -1, true).unwrap();
    ops::matmul(&p, &v).unwrap()
}

#[test]
#[ignore = "needs the CUDA backend: run on the GPU machine with --ignored"]
fn few_row_causal_attention_equals_ops_on_cuda() {
    assert_on_cuda();
    let cases = [
        // (B, Hq, Hkv, T, L, D)
        (1, 16, 8, 4, 133, 128),
        (2, 8, 2, 1, 40, 64),
        (1, 4, 4, 8, 9, 32),
        (3, 16, 8, 6, 700, 256),
    ];
    for (seed, &(b, hq, hkv, t, l, d)) in cases.iter().enumerate() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let s = seed as u64 * 10;
            let cast = |x: Array| x.as_dtype(dtype).unwrap();
            // Queries made as [B, T, Hq, D] and viewed as [B, Hq, T, D].
            let q = cast(normal(&[b, t, hq, d], s + 1))
                .transpose_axes(&[0, 2, 1, 3])
                .unwrap();
            // Keys and values: the first L rows of a buffer of L + 19.
            let kbuf = cast(normal(&[b, hkv, l + 19, d], s + 2));
            let vbuf = cast(normal(&[b, hkv, l + 19, d], s + 3));
            let k = kbuf.try_index((.., .., ..l, ..)).unwrap();
            let v = vbuf.try_index((.., .., ..l, ..)).unwrap();
            assert!(causal_rows_supported(&q, &k, &v));
            let scale = (d as f32).powf(-0.5);
            let got = causal_rows(&q, &k, &v, scale).unwrap();
            assert_eq!(got.shape(), [b, hq, t, d]);
            assert_eq!(got.dtype(), dtype);
            let want = reference(&q, &k, &v, scale);
            // The reference's f32 products run on CUDA as TF32 (about 3e-4
            // relative, `docs/BENCHMARKS.md`); the kernel's are f32.
            let limit = if dtype == Dtype::Float32 { 1e-3 } else { 1e-2 };
            let err = max_rel(&got, &want);
            assert!(
                err < limit,
                "B={b} Hq={hq} Hkv={hkv} T={t} L={l} D={d} {dtype:?}: {err}"
            );
        }
    }
}

/// Shapes the kernel does not take are refused before a launch (this runs
/// anywhere: the check reads shapes only).
#[test]
fn unsupported_shapes_are_refused() {
    let q = ops::zeros::<f32>(&[1, 4, 2, 48]).unwrap();
    let k = ops::zeros::<f32>(&[1, 2, 8, 48]).unwrap();
    assert!(!causal_rows_supported(&q, &k, &k), "D = 48");
    let q = ops::zeros::<f32>(&[1, 3, 2, 64]).unwrap();
    let k = ops::zeros::<f32>(&[1, 2, 8, 64]).unwrap();
    assert!(!causal_rows_supported(&q, &k, &k), "3 heads over 2");
    let q = ops::zeros::<f32>(&[1, 4, 9, 64]).unwrap();
    let k = ops::zeros::<f32>(&[1, 2, 8, 64]).unwrap();
    assert!(!causal_rows_supported(&q, &k, &k), "more rows than keys");
    let q = ops::zeros::<f32>(&[1, 4, 2, 64]).unwrap();
    let kb = ops::zeros::<f32>(&[1, 2, 8, 64])
        .unwrap()
        .as_dtype(Dtype::Bfloat16)
        .unwrap();
    assert!(!causal_rows_supported(&q, &kb, &kb), "mixed dtypes");
    let k = ops::zeros::<f32>(&[1, 2, 8, 64]).unwrap();
    assert!(causal_rows_supported(&q, &k, &k));
}
