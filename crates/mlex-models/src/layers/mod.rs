//! The registered mixers (the part of a [`crate::block`] between its
//! pre-norm and its residual), each one file with its own typed options
//! and cache kind, and the parts they share.
//!
//! | mixer         | computes                                                      |
//! |---------------|---------------------------------------------------------------|
//! | `attention`   | GQA attention, RoPE variants, q/k norms, output gate, sliding window, canon A/B |
//! | `gated_delta` | Gated DeltaNet (Qwen3-Next/Qwen3.5 layouts)                   |
//! | `mamba2`      | Mamba2 SSM (NemotronH `M`)                                    |
//!
//! Feed-forwards ([`ffn`]) are a typed enum of the block, not mixers.

pub mod attention;
pub mod canon;
pub mod ffn;
pub mod gated_delta;
pub mod mamba2;
pub mod rope;
pub mod sdpa;
