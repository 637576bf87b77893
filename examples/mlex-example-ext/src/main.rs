//! `mlex-example`: the whole `mlex` command line, with this crate's
//! architecture and layer kind registered beside mlex's own.

use mlex_example_ext as _;

fn main() -> std::process::ExitCode {
    mlex_cli::main()
}
