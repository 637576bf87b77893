//! The subcommands.

mod batch;
mod bench;
mod chat;
mod convert;
mod env;
mod generate;
mod inspect;
mod list;
mod logits;
mod perplexity;
mod plan;
mod serve;

use crate::args::{Cli, Command, DeviceArg};
use mlex_core::error::Result;
use mlex_core::registry::Registry;

/// Runs the parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    if let Some(d) = cli.device {
        let device = match d {
            DeviceArg::Cpu => mlx_rs::Device::cpu(),
            DeviceArg::Gpu => {
                let gpu = mlx_rs::Device::gpu();
                if mlex_core::device::runtime_info()?.gpu_count == 0 {
                    return Err(mlex_core::error::Error::invalid(
                        "--device",
                        "gpu requested, but the loaded MLX library has no GPU backend",
                    ));
                }
                gpu
            }
        };
        mlx_rs::Device::set_default(&device);
    }
    let tp = tensor_parallel(&cli.command)?;
    if let crate::tp::Role::Launch(n) = crate::tp::role(tp) {
        return crate::tp::launch(n);
    }
    let registry =
        || -> Result<Registry> { mlex_models::build_registry(&registry_paths(&cli.arch_files)) };
    match cli.command {
        Command::Generate(a) => match a.prompts_file.clone() {
            Some(file) => batch::run(a, &file, &registry()?),
            None => generate::run(a, &registry()?),
        },
        Command::Chat(a) => chat::run(a, &registry()?),
        Command::Bench(a) => bench::run(a, &registry()?),
        Command::Inspect(a) => inspect::run(a, &registry()?),
        Command::List(a) => list::run(a, &registry()?),
        Command::Logits(a) => logits::run(a, &registry()?),
        Command::Serve(a) => serve::run(a, registry_paths(&cli.arch_files)),
        Command::Env(a) => env::run(a),
        Command::Convert(a) => convert::run(a, &registry()?),
        Command::Perplexity(a) => perplexity::run(a, &registry()?),
    }
}

/// The command's `--tp` (every command that loads a model runs split).
fn tensor_parallel(command: &Command) -> Result<u32> {
    Ok(match command {
        Command::Generate(a) => a.model.tp,
        Command::Bench(a) => a.model.tp,
        Command::Logits(a) => a.tp,
        Command::Chat(a) => a.model.tp,
        Command::Serve(a) => a.model.tp,
        Command::Perplexity(a) => a.model.tp,
        _ => 1,
    })
}

/// `--arch-file` paths plus `$MLEX_ARCH_PATH`.
fn registry_paths(cli: &[std::path::PathBuf]) -> Vec<std::path::PathBuf> {
    let mut v = mlex_core::dispatch::arch_path();
    v.extend(cli.iter().cloned());
    v
}
