//! # mlex-compile
//!
//! Compiled decode segments. The single-token decode graph is split at
//! growing-cache writes ([`schedule`]): a KV cache gains a row every token
//! and cannot be written inside an MLX compiled function. Recurrent state
//! passes through each compiled segment explicitly, weights enter as inputs
//! (never frozen constants), and traces are rebuilt when the weight
//! structure changes ([`trace`], [`decoder`]).
#![deny(missing_docs)]

mod decoder;
mod schedule;
mod trace;

pub use decoder::{CompilePolicy, SegmentedDecoder};
pub use schedule::{Phase, Schedule, Step};
pub use trace::CompiledTrace;
