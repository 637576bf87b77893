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

/// Asserts a fused decode step's output and state (`fused`) against the
/// ops form's (`ops`): the same shape and dtype, values within 1e-4 of the
/// largest for f32 inputs and 2e-2 for bf16 (`dtype`); `what` names the
/// case.
pub fn assert_step_close(ops: &(Array, Array), fused: &(Array, Array), dtype: Dtype, what: &str) {
    let ((y0, n0), (y1, n1)) = (ops, fused);
    assert_eq!(y1.shape(), y0.shape(), "{what}");
    assert_eq!(y1.dtype(), y0.dtype(), "{what}");
    let limit = if dtype == Dtype::Float32 { 1e-4 } else { 2e-2 };
    let (dy, ds) = (max_rel(y1, y0), max_rel(n1, n0));
    assert!(
        dy < limit && ds < limit,
        "{what}: y differs by {dy}, state by {ds}"
    );
}

/// Asserts a verify kernel's output and state at one position (`kept`)
/// against one ops decode step (`ops`, as [`assert_step_close`]) and bit
/// for bit against one fused decode step (`decoded`).
pub fn assert_kept_state(
    kept: &(Array, Array),
    ops: &(Array, Array),
    decoded: &(Array, Array),
    dtype: Dtype,
    what: &str,
) {
    assert_step_close(ops, kept, dtype, &format!("{what} against the ops form"));
    let (dy, ds) = (max_rel(&kept.0, &decoded.0), max_rel(&kept.1, &decoded.1));
    assert_eq!(
        (dy, ds),
        (0.0, 0.0),
        "{what}: y and state against the decode step"
    );
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
