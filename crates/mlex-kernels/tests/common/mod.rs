//! Helpers shared by the kernel tests.
#![allow(dead_code)]

use mlx_rs::{ops, random, Array, Dtype};

/// Standard normal values of `shape` from a fixed `seed`.
pub fn normal(shape: &[i32], seed: u64) -> Array {
    random::normal::<f32>(shape, None, None, Some(&random::key(seed).unwrap())).unwrap()
}

/// The largest absolute difference, in f32.
pub fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let (a, b) = (
        a.as_dtype(Dtype::Float32).unwrap(),
        b.as_dtype(Dtype::Float32).unwrap(),
    );
    ops::abs(ops::subtract(&a, &b).unwrap())
        .unwrap()
        .max(None)
        .unwrap()
        .item_exact::<f32>()
}

/// The largest difference relative to the largest magnitude of `b` (at
/// least 1).
pub fn max_rel(a: &Array, b: &Array) -> f32 {
    let m = ops::abs(b.as_dtype(Dtype::Float32).unwrap())
        .unwrap()
        .max(None)
        .unwrap()
        .item_exact::<f32>();
    max_abs_diff(a, b) / m.max(1.0)
}

/// Fails unless MLX runs on CUDA: the kernel tests that call it check CUDA
/// kernels and must not pass by running elsewhere.
pub fn assert_on_cuda() {
    assert_eq!(
        mlex_core::device::runtime_info().unwrap().backend,
        mlex_core::device::Backend::Cuda,
        "this test checks the CUDA kernel and must run where MLX has CUDA"
    );
}
