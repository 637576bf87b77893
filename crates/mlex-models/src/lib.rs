//! # mlex-models
//!
//! The architectures, blocks and mixers of mlex. Every built-in
//! architecture is a spec (`architectures/<model_type>.toml`, [`spec`])
//! embedded at build time. A layer is a [`block`] (norms, residuals, a
//! feed-forward) around a mixer from [`layers`], each registered with
//! [`mlex_core::register_mixer_kind!`]. A new architecture, hybrid or not,
//! is one more spec file: no Rust.
//!
//! [`registry()`] gives every registered layer kind and architecture, the
//! built-in specs and those named by `$MLEX_ARCH_PATH`;
//! [`load::load`] finds and loads a model (directory, `.gguf`, or a Hugging
//! Face repo id in the local cache).
#![deny(missing_docs)]

pub mod block;
pub mod gguf;
mod gguf_file;
pub mod layers;
pub mod load;
pub mod quantize;
mod sanitize;
pub mod save;
pub mod spec;

use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use spec::SpecArchitecture;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// Adds the architecture spec in `text` (from `file`) to `registry`: one
/// architecture per `model_type` it serves.
pub fn add_toml_architecture(registry: &mut Registry, text: &str, file: &Path) -> Result<()> {
    for arch in SpecArchitecture::parse(text, file, registry)? {
        registry.add_architecture(Arc::new(arch), file.display().to_string())?;
    }
    Ok(())
}

/// Reads a TOML architecture file (or every `*.toml` in a directory).
pub fn add_toml_path(registry: &mut Registry, path: &Path) -> Result<()> {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| Error::io(path, e))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .collect();
        v.sort();
        v
    } else {
        vec![path.to_owned()]
    };
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(|e| Error::io(&f, e))?;
        add_toml_architecture(registry, &text, &f)?;
    }
    Ok(())
}

/// Builds a registry: everything registered in linked crates, the bundled
/// TOML architectures, then `extra` TOML files or directories.
pub fn build_registry(extra: &[PathBuf]) -> Result<Registry> {
    let mut r = Registry::from_inventory()?;
    for (name, text) in spec::BUILTIN {
        add_toml_architecture(&mut r, text, Path::new(name))?;
    }
    for p in extra {
        add_toml_path(&mut r, p)?;
    }
    Ok(r)
}

/// The backend policy of this process: the loaded backend's defaults, the
/// `MLEX_` variables ([`mlex_core::dispatch::Dispatch::from_env`]) and this
/// workspace's kernels. The command line may change it before loading.
pub fn dispatch() -> Result<mlex_core::dispatch::Dispatch> {
    Ok(mlex_kernels::with_kernels(
        mlex_core::dispatch::Dispatch::from_env()?,
    ))
}

/// The process-wide registry: [`build_registry`] with the paths in
/// `$MLEX_ARCH_PATH` (separated like `$PATH`).
pub fn registry() -> Result<&'static Registry> {
    static REGISTRY: OnceLock<std::result::Result<Registry, String>> = OnceLock::new();
    REGISTRY
        .get_or_init(|| {
            let extra = mlex_core::dispatch::arch_path();
            build_registry(&extra).map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Other(e.clone()))
}
