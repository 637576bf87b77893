//! `cargo xtask`: everything the repository needs beyond `cargo build`, with
//! no tools but cargo (and, for the reference fixtures, the system Python).
//!
//! - `setup`: system packages, the pinned MLX wheel, the mlx-c source.
//! - `test`: setup, format and lint checks, reference fixtures, the test
//!   suite, and `blas-kernels`.
//! - `blas-kernels`: the fixtures' self-checks and the parity tests under
//!   OpenBLAS kernels other than this CPU's (as on another CPU).
//! - `demo [PROMPT]`: generation on the bundled default model.
//! - `fixtures`: random-weight checkpoints and reference outputs from mlx-lm.
//! - `bench-compare`: `mlex bench` and mlx-lm side by side, one process each.
//! - `bench-vs-mlxlm [ARGS]`: mlex vs mlx-lm, alternating runs, median ratios.
//! - `cuda-bundle`: the `mlex` binary and what it loads, for a CUDA machine.
//! - `plot [DATA] [PNG]`: the benchmark plot of `docs/BENCHMARKS.md`.

mod assets;
mod bench;
mod bench_vs;
mod blas_kernels;
mod bundle;
mod download;
mod fixtures;
mod plot;
mod python;
mod setup;

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  setup          install what building mlex needs (idempotent; offline once done)
  test           setup, cargo fmt --check, clippy -D warnings, fixtures, the whole test suite,
                 then blas-kernels
  blas-kernels   the fixture script and the parity tests again under OpenBLAS kernels this CPU
                 runs but did not pick (OPENBLAS_CORETYPE), as on another CPU
  fixtures       make the parity fixtures with mlx-lm (and the NumPy DharaAR reference)
  demo [PROMPT]  answer PROMPT with the bundled default model (SmolLM2-135M-Instruct)
  codegen        regenerate docs/architectures.md from the registry (a test checks it is fresh)
  bench-compare  mlex bench and mlx-lm side by side on the same checkpoints (CPU)
  bench-vs-mlxlm [ARGS]
                 mlex vs mlx-lm, alternating fresh runs, median ratios per shape/weights/prompt
                 (tiny shapes on the CPU; ARGS go to xtask/py/bench_vs_mlxlm.py, e.g. --pairs 2;
                 writes target/bench-vs-mlxlm.{md,json})
  cuda-bundle    the release mlex binary + runtime + mlex-cuda-env.sh + bench-vs-mlxlm.sh in
                 target/cuda-bundle
  plot [DATA] [PNG]
                 draw prefill and decode tok/s against prompt length from a points file
                 (default docs/data/h200-2026-12-01-points.json -> docs/bench-h200.png)
";

fn main() {
    if let Err(e) = run() {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first() else {
        eprint!("{USAGE}");
        bail!("no command given");
    };
    let rest = &args[1..];
    match cmd.as_str() {
        "setup" => setup::setup().map(|_| ()),
        "test" => test(rest),
        "bench-compare" => bench::compare(rest),
        "bench-vs-mlxlm" => bench_vs::bench_vs_mlxlm(rest),
        "cuda-bundle" => bundle::cuda_bundle(rest).map(|_| ()),
        "plot" => plot::plot(rest),
        "fixtures" => fixtures::fixtures().map(|p| eprintln!("xtask: fixtures in {}", p.display())),
        "blas-kernels" => blas_kernels::blas_kernels(),
        "demo" => demo(rest),
        "codegen" => codegen(),
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            eprint!("{USAGE}");
            bail!("unknown command `{other}`")
        }
    }
}

/// The workspace root (the folder above `xtask/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Runs `cargo ARGS` in the workspace root, failing on a non-zero exit.
pub fn cargo(args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("xtask: $ cargo {}", args.join(" "));
    let status = Command::new(cargo)
        .args(args)
        .current_dir(workspace_root())
        .status()?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

fn test(_args: &[String]) -> Result<()> {
    setup::setup()?;
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    fixtures::fixtures()?;
    cargo(&["test", "--workspace"])?;
    blas_kernels::blas_kernels()?;
    Ok(())
}

/// docs/architectures.md, from `mlex list --markdown` (the registry of the
/// shipped binary, without `$MLEX_ARCH_PATH`).
fn codegen() -> Result<()> {
    setup::setup()?;
    cargo(&["build", "-p", "mlex-cli"])?;
    let target = target_dir();
    let mlex = target.join("debug/mlex");
    let out = Command::new(&mlex)
        .args(["list", "--markdown"])
        .env_remove("MLEX_ARCH_PATH")
        .output()
        .with_context(|| format!("cannot run {}", mlex.display()))?;
    if !out.status.success() {
        bail!(
            "`mlex list --markdown` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let file = workspace_root().join("docs/architectures.md");
    std::fs::write(&file, &out.stdout)?;
    eprintln!("xtask: wrote {}", file.display());
    Ok(())
}

/// Cargo's target folder (`CARGO_TARGET_DIR`, or `target`): cargo runs in
/// the workspace root, so a relative one is from there.
fn target_dir() -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| "target".into(), PathBuf::from);
    workspace_root().join(dir)
}

fn demo(args: &[String]) -> Result<()> {
    setup::setup()?;
    let model = assets::smollm2_gguf()?;
    let prompt = if args.is_empty() {
        "What is the capital of France?".to_owned()
    } else {
        args.join(" ")
    };
    // cargo's own progress (not `run --quiet`): on a fresh machine the
    // release build takes minutes, and a silent terminal looks hung.
    eprintln!("xtask: building mlex (release)");
    cargo(&["build", "--release", "-p", "mlex-cli"])?;
    eprintln!("xtask: asking SmolLM2-135M-Instruct: {prompt}");
    let target = target_dir();
    let mlex = target.join("release/mlex");
    let status = Command::new(&mlex)
        .args(["generate", "--model"])
        .arg(&model)
        .args(["--prompt", &prompt, "--max-tokens", "256"])
        .status()
        .with_context(|| format!("cannot run {}", mlex.display()))?;
    if !status.success() {
        bail!("`{} generate` failed ({status})", mlex.display());
    }
    Ok(())
}
