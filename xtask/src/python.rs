//! The Python environment of the reference side: a venv with mlx-lm (the
//! reference implementation) and the packages the fixture scripts use,
//! pinned in `xtask/py/requirements.txt`, kept in the shared cache and
//! rebuilt only when the pins change.

use crate::download::cache_dir;
use crate::workspace_root;
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn python_ok(py: &str) -> bool {
    Command::new(py)
        .args([
            "-c",
            "import sys, venv, ensurepip; assert sys.version_info >= (3, 10)",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn system_python() -> Result<String> {
    for py in ["python3", "python"] {
        if python_ok(py) {
            return Ok(py.to_owned());
        }
    }
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false);
    if root
        && Command::new("apt-get")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok()
    {
        eprintln!("xtask: installing python3, python3-venv and python3-pip with apt-get");
        let ok = Command::new("apt-get")
            .args(["update", "-qq"])
            .status()?
            .success()
            && Command::new("apt-get")
                .args([
                    "install",
                    "-y",
                    "-qq",
                    "python3",
                    "python3-venv",
                    "python3-pip",
                ])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()?
                .success();
        if ok && python_ok("python3") {
            return Ok("python3".into());
        }
    }
    bail!("the fixtures need Python ≥ 3.10 with venv; install python3 and python3-venv (apt-get install python3 python3-venv python3-pip)")
}

/// The venv's python, creating and filling the venv when the pins changed.
pub fn venv_python() -> Result<PathBuf> {
    let req = workspace_root().join("xtask/py/requirements.txt");
    let pins = std::fs::read(&req).with_context(|| format!("reading {}", req.display()))?;
    let key = format!("{:x}", Sha256::digest(&pins));
    let dir = cache_dir().join(format!("pyenv-{}", &key[..12]));
    let py = dir.join("bin/python");
    let stamp = dir.join(".complete");
    if stamp.exists() && py.exists() {
        return Ok(py);
    }
    let system = system_python()?;
    eprintln!("xtask: creating the reference venv in {}", dir.display());
    let _ = std::fs::remove_dir_all(&dir);
    let status = Command::new(&system)
        .args(["-m", "venv"])
        .arg(&dir)
        .status()?;
    if !status.success() {
        bail!("`{system} -m venv {}` failed", dir.display());
    }
    let status = Command::new(&py)
        .args([
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(&req)
        .status()?;
    if !status.success() {
        bail!(
            "installing {} into the venv failed (is PyPI reachable?)",
            req.display()
        );
    }
    std::fs::write(&stamp, &key)?;
    Ok(py)
}

/// A command running the reference venv's `py` on the same BLAS as the
/// staged mlex runtime (OpenBLAS through `LD_PRELOAD`, unless
/// `MLEX_BLAS=reference`), so parity and speed compare like for like.
pub fn reference_command(py: &std::path::Path) -> Command {
    let mut c = Command::new(py);
    if let Some(pre) = crate::setup::blas_preload() {
        c.env("LD_PRELOAD", pre);
    }
    c
}
