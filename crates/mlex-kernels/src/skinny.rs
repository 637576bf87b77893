//! Dense `x @ w^T` for a few rows: the decode step of a batch.
//!
//! With 2-64 rows, MLX's CUDA matmul runs a GEMM tiled for large products
//! and costs 17-25 us per product even at 1024x1024 (measured on the H200),
//! so a batch of 8 decoded no faster than mlx-lm's one row per sequence. The
//! product is bandwidth-bound: [`matmul`] reads each weight once for all
//! rows in one custom CUDA kernel (`skinny_matmul.cu`, float accumulation),
//! one warp per output column. [`crate::with_kernels`] hands it to a
//! `Dispatch`, whose layers use it for the row counts `skinny_rows` allows;
//! elsewhere, and on the CPU, MLX's matmul runs unchanged.

use crate::cuda::{CudaKernel, OutputSpec, TemplateArg};
use mlex_core::error::Result;
use mlx_rs::{ops, Array, Dtype};

const SOURCE: &str = include_str!("skinny_matmul.cu");

/// `x @ w^T` with `x` `[..., K]` and `w` `[N, K]`, both bf16 or f16, on CUDA;
/// any leading shape of `x` whose row count (their product) `M` is within
/// `rows`. The kernel keeps its accumulators in registers, so it is compiled
/// per power of two at or above `M` (one variant per power of two in the
/// row range and dtype, five for the default 2-32 rows): compiling per
/// exact `M` cost a second for every new prompt
/// length, which a server meets all the time. `Ok(None)` when the kernel
/// does not apply (the caller uses MLX's matmul).
pub fn matmul_within(x: &Array, w: &Array, rows: (i32, i32)) -> Result<Option<Array>> {
    let dtype = w.dtype();
    if !matches!(dtype, Dtype::Bfloat16 | Dtype::Float16) || x.dtype() != dtype || w.ndim() != 2 {
        return Ok(None);
    }
    let (n, k) = (w.shape()[0], w.shape()[1]);
    let xs = x.shape();
    if xs.is_empty() || xs[xs.len() - 1] != k || k % 8 != 0 {
        return Ok(None);
    }
    let m: i32 = xs[..xs.len() - 1].iter().product();
    if m < rows.0 || m > rows.1 {
        return Ok(None);
    }
    let kernel = CudaKernel::cached("mlex_skinny_matmul", &["x", "w"], &["y"], SOURCE)?;
    let x2 = ops::reshape(x, &[m, k])?;
    let y = kernel
        .apply(
            &[&x2, w],
            &[OutputSpec {
                shape: vec![m, n],
                dtype,
            }],
            &[
                ("T", TemplateArg::Dtype(dtype)),
                ("M", TemplateArg::Int(row_bucket(m))),
            ],
            (32, n, 1),
            (32, 4, 1),
        )?
        .pop()
        .expect("one output");
    let mut shape = xs[..xs.len() - 1].to_vec();
    shape.push(n);
    Ok(Some(ops::reshape(&y, &shape)?))
}

/// The template row count for `m` rows: the power of two at or above it.
fn row_bucket(m: i32) -> i32 {
    (m.max(1) as u32).next_power_of_two() as i32
}

/// The largest rows x output columns the kernel takes in [`matmul`]: one
/// warp per column keeps every row's accumulator, so its cost grows with
/// both. Measured on the H200 against MLX's matmul (bf16, `skinny_sweep`,
/// `docs/BENCHMARKS.md`): 1.3-4.5x faster at 2-8 rows for 1,024-6,144
/// columns and at 16-32 rows up to 2,048 columns; slower beyond (6,144
/// columns at 32 rows 0.63x, the 151,936-column head at 4 rows 0.69x).
pub const MAX_ROWS_TIMES_COLUMNS: i32 = 65_536;

/// The fewest weights (columns x inner size) for which [`matmul`] takes a
/// product. Each launch of an MLX custom kernel costs host time on CUDA
/// that a small product does not win back: on a tiny Qwen3 (64-wide
/// layers) under the server's load test the kernel cut throughput from 109
/// to 60 requests/s (`docs/BENCHMARKS.md`), while every product of the
/// real-shape sweep (1,024 x 1,024 and up) gained.
pub const MIN_WEIGHTS: i64 = 1 << 20;

/// [`matmul_within`] for `rows`, at most [`MAX_ROWS_TIMES_COLUMNS`] rows x
/// columns and at least [`MIN_WEIGHTS`] weights (a
/// `mlex_core::dispatch::DenseProduct`).
pub fn matmul(x: &Array, w: &Array, rows: (i32, i32)) -> Result<Option<Array>> {
    let m: i32 = x.shape().iter().rev().skip(1).product();
    if w.ndim() != 2
        || row_bucket(m).saturating_mul(w.shape()[0]) > MAX_ROWS_TIMES_COLUMNS
        || (w.shape()[0] as i64) * (w.shape()[1] as i64) < MIN_WEIGHTS
    {
        return Ok(None);
    }
    matmul_within(x, w, rows)
}
