//! Compute kernels of the hybrid layers, each beside the plain form it must
//! equal, with the choice between them made here and nowhere else.
//!
//! - [`gated_delta`]: the gated delta rule of Gated DeltaNet layers
//!   (Qwen3-Next, Qwen3.5): the token-by-token recurrence and the chunked
//!   WY form for prefill; one decode token fused into one CUDA kernel.
//! - [`mamba2`]: the Mamba2 SSM decode step, plain and fused.
//! - [`skinny`]: dense products of a few rows (batched decode), one weight
//!   sweep for all rows.
//! - [`attention`]: causal attention of a few query rows over a KV cache
//!   (a speculative verify), one launch.
//! - [`cuda`]: the wrapper over MLX's custom CUDA kernels.
//!
//! Which implementation runs is `mlex_core::dispatch::Dispatch`'s choice
//! (per backend and sequence length, from measurements recorded in
//! `docs/BENCHMARKS.md`); [`with_kernels`] gives it this crate's kernels.

#![deny(missing_docs)]

pub mod attention;
pub mod cuda;
pub mod gated_delta;
pub mod mamba2;
pub mod skinny;

use mlex_core::dispatch::Dispatch;

/// `d` with this crate's kernels filled in (the few-row product; the
/// recurrent decode kernels are chosen by `d.fused_decode` where the layers
/// run).
pub fn with_kernels(mut d: Dispatch) -> Dispatch {
    d.dense_product = Some(skinny::matmul);
    d
}

/// How a gated delta sequence of `len` tokens is computed under `d`.
pub fn gated_delta_method(d: &Dispatch, len: usize) -> gated_delta::Method {
    match d.gated_delta_chunk {
        Some(chunk) if len >= d.gated_delta_min_len => gated_delta::Method::Chunked { chunk },
        _ => gated_delta::Method::Recurrent,
    }
}
