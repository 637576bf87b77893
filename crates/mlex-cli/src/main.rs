//! `mlex`: run hybrid language models on MLX.

fn main() -> std::process::ExitCode {
    mlex_cli::main()
}
