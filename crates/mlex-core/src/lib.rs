//! # mlex-core
//!
//! The contracts of the mlex engine and the machinery every architecture
//! shares:
//!
//! - [`arch::Architecture`]: a `model_type` (sanitize + layer plan);
//! - [`layer::LayerKind`] / [`layer::Layer`]: one kind of decoder layer, run
//!   in head/grow/tail phases so decode can be compiled in segments;
//! - [`cache::Cache`]: the object-safe cache trait layers hand out;
//! - [`registry::Registry`]: architectures and layer kinds on `inventory`;
//! - [`weights`], [`config`], [`quant`]: strict loading with errors that
//!   name the file, key or tensor;
//! - [`params`]: weights by id, so compiled traces take them as inputs;
//! - [`model::Model`]: the generic decoder every architecture builds;
//! - [`error::Error`]: the one error type (MLX exceptions included).
#![deny(missing_docs)]

pub mod arch;
pub mod cache;
pub mod config;
pub mod device;
pub mod dispatch;
pub mod distributed;
pub mod error;
pub mod ids;
pub mod layer;
pub mod model;
pub mod mtp;
pub mod nn;
pub mod params;
pub mod quant;
pub mod registry;
pub mod weights;

/// Re-exported for the registration macros.
pub use inventory;
/// Re-exported so dependents use the same mlx-rs.
pub use mlx_rs;
