//! A residual add and the RMS norm that follows it, in one launch: the
//! `h = x + attention(x)`, `rms_norm(h)` seam in the middle of every
//! pre-norm block.
//!
//! As ops that is two MLX kernels (a binary add, then `rms_norm`) and two
//! graph nodes the host builds each decode step; [`apply`] is one custom
//! CUDA kernel (`add_rms_norm.cu`) with MLX's roundings (the sum rounded to
//! the dtype, the normalised value rounded before the weight), held to the
//! ops form by its test. CUDA only, and only for a few rows ([`MAX_ROWS`]:
//! decode steps, and prompts that short): a long prefill's rows are many
//! and MLX's kernels serve them well.

use crate::cuda::{CudaKernel, OutputSpec, TemplateArg};
use crate::qk_rope::eps_pico;
use mlex_core::error::{Error, Result};
use mlx_rs::{Array, Dtype};

const SOURCE: &str = include_str!("add_rms_norm.cu");

/// The most rows (tokens of all sequences) a fused call takes.
pub const MAX_ROWS: i32 = 64;

/// Whether [`apply`] takes `x` (its dtype and row count) and this epsilon.
pub fn supported(x: &Array, eps: f32) -> bool {
    let s = x.shape();
    let rows: i32 = s.iter().rev().skip(1).product();
    matches!(x.dtype(), Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
        && !s.is_empty()
        && (1..=MAX_ROWS).contains(&rows)
        && eps_pico(eps).is_some()
}

/// `(x + y, rms_norm(x + y) * w)` for `x` and `y` `[..., H]` of one float
/// dtype and `w` `[H]`, in one CUDA kernel. Check [`supported`] first.
pub fn apply(x: &Array, y: &Array, w: &Array, eps: f32) -> Result<(Array, Array)> {
    let bad = |what: String| Error::invalid("add_rms_norm", what);
    let s = x.shape();
    if s != y.shape() || x.dtype() != y.dtype() {
        return Err(bad(format!(
            "x {s:?} {:?} and y {:?} {:?} differ",
            x.dtype(),
            y.shape(),
            y.dtype()
        )));
    }
    if !supported(x, eps) {
        return Err(bad(format!(
            "{s:?} {:?} with epsilon {eps} is not supported",
            x.dtype()
        )));
    }
    let hidden = s[s.len() - 1];
    if w.shape() != [hidden] {
        return Err(bad(format!(
            "the norm weight is {:?}, not [{hidden}]",
            w.shape()
        )));
    }
    let rows: i32 = s[..s.len() - 1].iter().product();
    let kernel = CudaKernel::cached("mlex_add_rms_norm", &["x", "y", "w"], &["h", "n"], SOURCE)?;
    let spec = OutputSpec {
        shape: s.to_vec(),
        dtype: x.dtype(),
    };
    kernel.apply2(
        &[x, y, w],
        [spec.clone(), spec],
        &[
            ("T", TemplateArg::Dtype(x.dtype())),
            ("H", TemplateArg::Int(hidden)),
            (
                "EPS_PICO",
                TemplateArg::Int(eps_pico(eps).expect("checked")),
            ),
        ],
        (256, rows, 1),
        (256, 1, 1),
    )
}
