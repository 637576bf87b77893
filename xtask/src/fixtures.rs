//! `cargo xtask fixtures`: random-weight checkpoints and reference outputs
//! from mlx-lm (`xtask/py/fixtures.py`) and from the independent NumPy
//! DharaAR implementation (`xtask/py/dhara_ref.py`), written to
//! `target/fixtures`. Skipped when the scripts and pins are unchanged.

use crate::{assets, python, workspace_root};
use anyhow::{bail, Result};
use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// Where the fixtures go (the parity tests read it too).
pub fn fixtures_dir() -> PathBuf {
    workspace_root().join("target/fixtures")
}

/// Runs `xtask/py/fixtures.py` into `out` on the reference venv, with
/// OpenBLAS's kernels forced to `coretype` when given.
pub fn fixture_script(
    out: &std::path::Path,
    gguf: &std::path::Path,
    coretype: Option<&str>,
) -> Result<std::process::ExitStatus> {
    let qwen3 = assets::qwen3_tokenizer()?;
    let py = python::venv_python()?;
    let mut c = python::reference_command(&py);
    c.arg(workspace_root().join("xtask/py/fixtures.py"))
        .arg("--out")
        .arg(out)
        .arg("--smollm2-gguf")
        .arg(gguf)
        .arg("--qwen3-tokenizer")
        .arg(qwen3);
    if let Some(k) = coretype {
        c.env("OPENBLAS_CORETYPE", k);
    }
    Ok(c.status()?)
}

/// Makes the fixtures unless they are current; returns their folder.
pub fn fixtures() -> Result<PathBuf> {
    let root = workspace_root();
    let py_dir = root.join("xtask/py");
    let gguf = assets::smollm2_gguf()?;
    let mut h = Sha256::new();
    for f in [
        "fixtures.py",
        "gguf_hybrid.py",
        "mix_ref.py",
        "mtp_ref.py",
        "kvq_ref.py",
        "tool_fixture.py",
        "tool_schema.py",
        "dhara_ref.py",
        "requirements.txt",
    ] {
        h.update(std::fs::read(py_dir.join(f))?);
    }
    h.update(gguf.to_string_lossy().as_bytes());
    // The reference venv computes on the staged runtime's BLAS (the sums of
    // OpenBLAS and the reference BLAS round differently).
    h.update(
        crate::setup::blas_preload()
            .unwrap_or_else(|| "reference blas".into())
            .as_bytes(),
    );
    let key = format!("{:x}", h.finalize());
    let out = fixtures_dir();
    let stamp = out.join(".stamp");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == key) {
        return Ok(out);
    }
    let py = python::venv_python()?;
    // Made beside, then swapped in: a run killed midway leaves the old set
    // (or none, which the stamp check redoes), never a half-written one
    // that tests would read.
    // Per process: a second run must not wipe this one's folder midway.
    let partial = out.with_extension(format!("partial.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial)?;
    eprintln!(
        "xtask: making parity fixtures with mlx-lm into {}",
        out.display()
    );
    if !fixture_script(&partial, &gguf, None)?.success() {
        bail!("xtask/py/fixtures.py failed");
    }
    let status = python::reference_command(&py)
        .arg(py_dir.join("dhara_ref.py"))
        .arg("--out")
        .arg(&partial)
        .status()?;
    if !status.success() {
        bail!("xtask/py/dhara_ref.py failed");
    }
    std::fs::write(partial.join(".stamp"), key)?;
    let old = out.with_extension(format!("old.{}", std::process::id()));
    if out.exists() {
        std::fs::rename(&out, &old)?;
    }
    if let Err(e) = std::fs::rename(&partial, &out) {
        // Put the old set back rather than leave none.
        let _ = std::fs::rename(&old, &out);
        return Err(e.into());
    }
    let _ = std::fs::remove_dir_all(&old);
    Ok(out)
}
