//! Compute kernels of the hybrid layers, each beside the plain form it must
//! equal, with the choice between them made here and nowhere else.
//!
//! - [`gated_delta`]: the gated delta rule of Gated DeltaNet layers
//!   (Qwen3-Next, Qwen3.5): the token-by-token recurrence and the chunked
//!   WY form for prefill; one decode token fused into one CUDA kernel.
//! - [`mamba2`]: the Mamba2 SSM decode step, plain and fused.
//! - [`skinny`]: dense products of a few rows (batched decode), one weight
//!   sweep for all rows.
//! - [`cuda`]: the wrapper over MLX's custom CUDA kernels.
//!
//! [`Dispatch`] picks the implementation for the loaded MLX backend (CPU,
//! CUDA, Metal) and the sequence length, from measurements recorded in
//! `docs/BENCHMARKS.md`.

#![deny(missing_docs)]

pub mod cuda;
pub mod gated_delta;
pub mod mamba2;
pub mod skinny;

use gated_delta::Method;
use mlex_core::device::Backend;
use std::sync::OnceLock;

/// The implementation choices for this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dispatch {
    /// The loaded backend.
    pub backend: Backend,
    /// Chunk size of the chunked gated delta rule; `None` runs every
    /// sequence token by token.
    pub gated_delta_chunk: Option<usize>,
    /// Sequences shorter than this run token by token (the chunked form's
    /// fixed cost only pays from a few tokens on).
    pub gated_delta_min_len: usize,
    /// Recurrent decode steps run as one custom kernel each
    /// ([`gated_delta::decode_fused`], [`mamba2::decode_fused`]) instead of
    /// a dozen ops (CUDA only).
    pub fused_decode: bool,
    /// Dense products whose row count is in this range run as
    /// [`skinny::matmul`] (CUDA only; `None`: MLX's matmul everywhere).
    pub skinny_rows: Option<(i32, i32)>,
}

impl Dispatch {
    /// The measured defaults of `backend`.
    ///
    /// Chunk sizes measured against the token loop (`docs/BENCHMARKS.md`):
    /// on the CPU small chunks win (the `C²` work per token is paid on
    /// cores, not hidden behind launches); on CUDA larger ones (fewer
    /// dependent steps). Metal takes the CUDA choice, untested here.
    pub fn for_backend(backend: Backend) -> Dispatch {
        let chunk = match backend {
            Backend::Cpu => 16,
            Backend::Cuda | Backend::Metal => 128,
        };
        let fused = backend == Backend::Cuda;
        Dispatch {
            backend,
            gated_delta_chunk: Some(chunk),
            gated_delta_min_len: 8,
            fused_decode: fused,
            skinny_rows: fused.then_some((2, 32)),
        }
    }

    /// The process's dispatch: the loaded backend's defaults, with
    /// `MLEX_GATED_DELTA_CHUNK` (a power of two, or `0` for the token loop)
    /// overriding the chunk size, `MLEX_FUSED_DECODE=0` turning the fused
    /// recurrent decode kernels off, and `MLEX_SKINNY_ROWS` (`0`, or `LO-HI`) the row range of
    /// the few-row matmul, for measurements.
    pub fn current() -> &'static Dispatch {
        static CURRENT: OnceLock<Dispatch> = OnceLock::new();
        CURRENT.get_or_init(|| {
            let backend = mlex_core::device::runtime_info()
                .map(|i| i.backend)
                .unwrap_or(Backend::Cpu);
            let mut d = Dispatch::for_backend(backend);
            if let Some(v) = std::env::var("MLEX_GATED_DELTA_CHUNK")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
            {
                match v {
                    0 => d.gated_delta_chunk = None,
                    v if v >= 2 && v.is_power_of_two() => d.gated_delta_chunk = Some(v),
                    v => eprintln!(
                        "mlex: MLEX_GATED_DELTA_CHUNK={v} is neither 0 nor a power of two; ignored"
                    ),
                }
            }
            if std::env::var("MLEX_FUSED_DECODE").is_ok_and(|v| v == "0") {
                d.fused_decode = false;
            }
            if let Ok(v) = std::env::var("MLEX_SKINNY_ROWS") {
                match parse_rows(&v) {
                    Some(r) => d.skinny_rows = r,
                    None => eprintln!(
                        "mlex: MLEX_SKINNY_ROWS={v} is neither 0 nor a range such as 2-64; ignored"
                    ),
                }
            }
            d
        })
    }

    /// How a gated delta sequence of `len` tokens is computed.
    pub fn gated_delta_method(&self, len: usize) -> Method {
        match self.gated_delta_chunk {
            Some(chunk) if len >= self.gated_delta_min_len => Method::Chunked { chunk },
            _ => Method::Recurrent,
        }
    }
}

/// `0` (off) or `LO-HI` with `1 <= LO <= HI <= 64`.
fn parse_rows(v: &str) -> Option<Option<(i32, i32)>> {
    if v.trim() == "0" {
        return Some(None);
    }
    let (lo, hi) = v.split_once('-')?;
    let (lo, hi): (i32, i32) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
    (1 <= lo && lo <= hi && hi <= 64).then_some(Some((lo, hi)))
}
