//! `mlex`: run hybrid language models on MLX.

mod args;
mod commands;
mod interrupt;
mod session;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // A closed pipe (`mlex inspect | head`) ends the program quietly by
    // SIGPIPE, as for other Unix tools; Rust ignores SIGPIPE by default,
    // which turns the next print into a panic.
    #[cfg(unix)]
    // SAFETY: restoring a signal's default action before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = args::Cli::parse();
    let result = commands::run(cli);
    if let Err(e) = &result {
        eprintln!("error: {e}");
    }
    match result {
        _ if interrupt::requested() => ExitCode::from(130),
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}
