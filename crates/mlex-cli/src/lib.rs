//! The `mlex` command line as a library, so that a crate with its own
//! architectures and layer kinds (registered through `inventory`) gets the
//! whole CLI in a three-line `main`:
//!
//! ```no_run
//! use my_layers as _; // link the crate whose registrations should appear
//! fn main() -> std::process::ExitCode {
//!     mlex_cli::main()
//! }
//! # mod my_layers {}
//! ```

#![deny(missing_docs)]

mod args;
mod commands;
mod cpu_kernels;
mod interrupt;
mod session;
mod tp;

use clap::Parser;
use std::process::ExitCode;

/// Parses the process's arguments, runs the command and returns its exit
/// status (1 on an error, 130 after Ctrl-C, the error printed to stderr).
pub fn main() -> ExitCode {
    // A closed pipe (`mlex inspect | head`) ends the program quietly by
    // SIGPIPE, as for other Unix tools; Rust ignores SIGPIPE by default,
    // which turns the next print into a panic.
    #[cfg(unix)]
    // SAFETY: restoring a signal's default action before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // The environment is the process's: set before any thread starts.
    if let Some(dir) = kernel_cache_dir(|k| std::env::var_os(k)) {
        std::env::set_var(KERNEL_CACHE_VAR, dir);
    }
    cpu_kernels::use_own_folder();
    // Before any thread starts: SIGINT and SIGTERM are taken in every
    // phase from here on (see `interrupt`).
    interrupt::install();
    let cli = args::Cli::parse();
    let result = commands::run(cli);
    if let Err(e) = &result {
        if interrupt::requested() {
            // A terminal's Ctrl-C also reaches the compiler MLX's CPU
            // backend runs (same process group), and the failed kernel
            // build comes back as an error: the user asked to stop.
            eprintln!("interrupted ({})", for_the_command_line(e));
        } else {
            // A rank of a --tp group says which one it is.
            let rank = std::env::var("MLX_RANK")
                .map(|r| format!("[rank {r}] "))
                .unwrap_or_default();
            eprintln!("error: {rank}{}", for_the_command_line(e));
        }
    }
    match result {
        _ if interrupt::requested() => ExitCode::from(130),
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}

/// Where MLX's CUDA backend keeps the kernels it compiles at run time.
pub(crate) const KERNEL_CACHE_VAR: &str = "MLX_PTX_CACHE_DIR";

/// Where MLX's compiled CUDA kernels should go when the user has not said
/// (`var` reads the environment): `mlex/mlx-ptx/<MLX version>` under
/// `XDG_CACHE_HOME` or `~/.cache`; `None` when `MLX_PTX_CACHE_DIR` is set
/// or there is no home. Why: MLX compiles every kernel a model uses at its
/// first use (a fresh H100 took 85 s before the first token of a
/// Qwen3-Next-like MoE model, 3.6 s after; docs/BENCHMARKS.md) and keeps
/// them by default under the temporary directory, which many systems empty
/// at boot, so that wait came back after every reboot.
fn kernel_cache_dir(
    var: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Option<std::path::PathBuf> {
    if var(KERNEL_CACHE_VAR).is_some() {
        return None;
    }
    let base = var("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| {
            var("HOME")
                .filter(|h| !h.is_empty())
                .map(|h| std::path::PathBuf::from(h).join(".cache"))
        })?;
    Some(
        base.join("mlex")
            .join("mlx-ptx")
            .join(mlex_core::device::mlx_version()),
    )
}

/// The libraries name what was wrong in their own terms
/// (`SamplerConfig.top_p`, `model`); on the command line that is an option.
pub(crate) fn for_the_command_line(e: &mlex_core::error::Error) -> String {
    const OPTIONS: [(&str, &str); 11] = [
        ("SamplerConfig.temp", "--temp"),
        ("SamplerConfig.top_p", "--top-p"),
        ("SamplerConfig.top_k", "--top-k"),
        ("SamplerConfig.min_p", "--min-p"),
        ("SamplerConfig.repetition_penalty", "--repetition-penalty"),
        ("SamplerConfig.presence_penalty", "--presence-penalty"),
        ("SamplerConfig.frequency_penalty", "--frequency-penalty"),
        ("SamplerConfig.logit_bias", "--logit-bias"),
        ("model", "--model"),
        ("quantization", "--quantize"),
        ("host/port", "--host/--port"),
    ];
    match e {
        mlex_core::error::Error::InvalidArgument { name, message } => {
            match OPTIONS.iter().find(|(lib, _)| lib == name) {
                Some((_, option)) => format!("invalid {option}: {message}"),
                None => e.to_string(),
            }
        }
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn compiled_kernels_go_to_the_users_cache_unless_a_place_is_given() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let v = mlex_core::device::mlx_version();
        assert_eq!(
            kernel_cache_dir(env(&[("HOME", "/home/u")])).unwrap(),
            std::path::Path::new("/home/u/.cache/mlex/mlx-ptx").join(&v)
        );
        assert_eq!(
            kernel_cache_dir(env(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/c")])).unwrap(),
            std::path::Path::new("/c/mlex/mlx-ptx").join(&v)
        );
        assert_eq!(
            kernel_cache_dir(env(&[("HOME", "/home/u"), ("MLX_PTX_CACHE_DIR", "/mine")])),
            None
        );
        assert_eq!(kernel_cache_dir(env(&[])), None);
        assert_eq!(kernel_cache_dir(env(&[("HOME", "")])), None);
    }
}
