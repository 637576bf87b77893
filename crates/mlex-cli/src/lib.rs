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
