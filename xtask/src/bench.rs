//! `cargo xtask bench-compare`: `mlex bench` and mlx-lm on the same
//! checkpoints, side by side in one run, written as a Markdown table.

use crate::{cargo, fixtures, python, workspace_root};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::process::Command;

fn last_json(out: &[u8]) -> Result<Value> {
    let text = String::from_utf8_lossy(out);
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .context("no JSON line in the output")?;
    Ok(serde_json::from_str(line)?)
}

/// Runs the comparison and prints the table (also written to
/// `target/bench-compare.md`).
pub fn compare(args: &[String]) -> Result<()> {
    let root = workspace_root();
    let fx = fixtures::fixtures()?;
    let py = python::venv_python()?;
    cargo(&["build", "--release", "-p", "mlex-cli"])?;
    let mlex = root.join("target/release/mlex");
    let repeats = args
        .iter()
        .position(|a| a == "--repeats")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
        .unwrap_or("2");
    let cases = [
        (
            "SmolLM2-135M-Instruct Q4 (export)",
            "smollm2-export",
            128,
            128,
        ),
        ("qwen3_5 tiny hybrid f32", "qwen3_5-f32", 128, 256),
        ("qwen3_5 tiny hybrid 4-bit", "qwen3_5-q4", 128, 256),
    ];
    let mut rows = Vec::new();
    for (label, name, p, n) in cases {
        let dir = fx.join(name);
        let (p, n) = (p.to_string(), n.to_string());
        let mut ours = Vec::new();
        for extra in [&[][..], &["--no-compile"][..]] {
            let out = Command::new(&mlex)
                .args([
                    "bench",
                    "--device",
                    "cpu",
                    "--format",
                    "json",
                    "--repeats",
                    repeats,
                ])
                .args(["--prompt-len", &p, "--gen", &n, "--model"])
                .arg(&dir)
                .args(extra)
                .output()?;
            if !out.status.success() {
                bail!(
                    "mlex bench on {name} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            ours.push(last_json(&out.stdout)?);
        }
        let out = python::reference_command(&py)
            .arg(root.join("xtask/py/mlxlm_bench.py"))
            .arg(&dir)
            .args(["--prompt-len", &p, "--gen", &n, "--repeats", repeats])
            .output()?;
        if !out.status.success() {
            bail!(
                "mlx-lm bench on {name} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let theirs = last_json(&out.stdout)?;
        let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
        rows.push(format!(
            "| {label} | {p}/{n} | {:.1} | {:.1} | {:.1} | **{:.2}×** | {:.1} | {:.1} | **{:.2}×** |",
            f(&ours[0], "decode_tok_s"),
            f(&ours[1], "decode_tok_s"),
            f(&theirs, "decode_tok_s"),
            f(&ours[0], "decode_tok_s") / f(&theirs, "decode_tok_s"),
            f(&ours[0], "prefill_tok_s"),
            f(&theirs, "prefill_tok_s"),
            f(&ours[0], "prefill_tok_s") / f(&theirs, "prefill_tok_s"),
        ));
        eprintln!("xtask: {label}: mlex {} | mlx-lm {}", ours[0], theirs);
    }
    let table = format!(
        "| model | prompt/gen | mlex decode tok/s (compiled) | mlex decode (eager) | mlx-lm decode tok/s | decode mlex / mlx-lm | mlex prefill tok/s | mlx-lm prefill tok/s | prefill mlex / mlx-lm |\n\
         |---|---|---|---|---|---|---|---|---|\n{}\n",
        rows.join("\n")
    );
    println!("{table}");
    std::fs::write(root.join("target/bench-compare.md"), &table)?;
    Ok(())
}
