//! `cargo xtask bench-vs-mlxlm`: mlex against mlx-lm on the same
//! random-weight checkpoints, alternating fresh processes of each engine
//! (`xtask/py/bench_vs_mlxlm.py`), with per-case median ratios.
//!
//! Locally it builds `mlex` in release, makes the tiny-scale checkpoints
//! (`xtask/py/make_bench_models.py`) into `target/bench-models` when they
//! are missing or out of date, and runs the orchestrator on the CPU with the
//! reference venv's Python, writing `target/bench-vs-mlxlm.{md,json}`. The
//! arguments are passed to the orchestrator after these defaults, so they
//! override them (`--pairs 2`, `--shapes qwen3_5`, `--scale real`, ...).
//! On a GPU machine the same orchestrator runs from the CUDA bundle through
//! `bench-vs-mlxlm.sh`.

use crate::{cargo, python, setup, workspace_root};
use anyhow::{bail, Result};

/// The value of `--name VALUE` or `--name=VALUE` in `args` (the last one).
fn arg_value<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let mut found = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == name {
            found = it.next().map(String::as_str);
        } else if let Some(v) = a.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            found = Some(v);
        }
    }
    found
}

/// Runs the sweep; `args` go to `bench_vs_mlxlm.py` (see its `--help`).
pub fn bench_vs_mlxlm(args: &[String]) -> Result<()> {
    let root = workspace_root();
    setup::setup()?;
    let py = python::venv_python()?;
    cargo(&["build", "--release", "-p", "mlex-cli"])?;
    let mlex = root.join("target/release/mlex");
    let models = root.join("target/bench-models");
    let scale = arg_value(args, "--scale").unwrap_or("tiny");

    let mut make = python::reference_command(&py);
    make.arg(root.join("xtask/py/make_bench_models.py"))
        .arg(&models)
        .args(["--scale", scale]);
    if let Some(shapes) = arg_value(args, "--shapes") {
        make.args(["--shapes", shapes]);
    }
    if !make.status()?.success() {
        bail!(
            "making the benchmark checkpoints in {} failed",
            models.display()
        );
    }

    let status = python::reference_command(&py)
        .arg(root.join("xtask/py/bench_vs_mlxlm.py"))
        .arg("--mlex")
        .arg(&mlex)
        .arg("--models")
        .arg(&models)
        .args(["--device", "cpu", "--scale", "tiny", "--out"])
        .arg(root.join("target/bench-vs-mlxlm"))
        .args(args)
        .status()?;
    if !status.success() {
        bail!("xtask/py/bench_vs_mlxlm.py failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::arg_value;

    #[test]
    fn finds_the_last_value_in_both_spellings() {
        let args: Vec<String> = [
            "--pairs",
            "2",
            "--scale",
            "real",
            "--scale=tiny",
            "--shapes",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(arg_value(&args, "--scale"), Some("tiny"));
        assert_eq!(arg_value(&args, "--pairs"), Some("2"));
        assert_eq!(arg_value(&args, "--shapes"), None);
        assert_eq!(arg_value(&args, "--gen"), None);
    }
}
