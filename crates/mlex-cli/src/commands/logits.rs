//! `mlex logits`: one full forward, float32 logits of every position.

use crate::args::LogitsArgs;
use crate::session::load_model_mtp;
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlx_rs::{Array, Dtype};

pub fn run(a: LogitsArgs, registry: &Registry) -> Result<()> {
    if a.out.extension().is_none_or(|e| e != "npy") {
        return Err(Error::invalid(
            "--out",
            format!("{} must end in .npy", a.out.display()),
        ));
    }
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            return Err(Error::invalid(
                "--out",
                format!("folder {} does not exist", dir.display()),
            ));
        }
    }
    let mut dispatch = crate::session::dispatch(None)?;
    dispatch.tensor_parallel = crate::session::tensor_parallel(a.tp)?;
    let rank = dispatch.tensor_parallel.as_ref().map_or(0, |s| s.rank());
    let loaded = load_model_mtp(&a.model, registry, &dispatch, a.mtp)?;
    let model = &loaded.model;
    let vocab = model.vocab_size() as u32;
    if let Some(bad) = a.prompt_ids.iter().find(|&&t| t >= vocab) {
        return Err(Error::invalid(
            "--prompt-ids",
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        ));
    }
    if let Some(max) = model.max_context {
        if a.prompt_ids.len() > max {
            return Err(Error::PromptTooLong {
                len: a.prompt_ids.len(),
                max,
                hint: None,
            });
        }
    }
    let ids: Vec<i32> = a.prompt_ids.iter().map(|&t| t as i32).collect();
    let tokens = Array::from_slice(&ids, &[1, ids.len() as i32]);
    let mut cache = model.make_cache(1)?;
    let logits = if a.mtp {
        mtp_logits(model, &tokens, &mut cache)?
    } else {
        model.forward(&tokens, &mut cache)?
    };
    let logits = mlx_rs::ops::squeeze_axes(&logits.as_dtype(Dtype::Float32)?, &[0])?;
    logits.eval()?;
    if rank != 0 {
        // Every rank holds the same logits; rank 0 writes them.
        return Ok(());
    }
    logits
        .save_numpy(&a.out)
        .map_err(|e| Error::Other(format!("{}: {e}", a.out.display())))?;
    eprintln!("wrote {} {:?}", a.out.display(), logits.shape());
    Ok(())
}

/// The multi-token-prediction head's logits over `tokens` `[1, T]`: its
/// row j reads the trunk's normed state at j and token j + 1.
fn mtp_logits(
    model: &mlex_core::model::Model,
    tokens: &Array,
    cache: &mut mlex_core::model::ModelCache,
) -> Result<Array> {
    use mlx_rs::ops::indexing::TryIndexOp;
    let t = tokens.shape()[1];
    if t < 2 {
        return Err(Error::invalid(
            "--prompt-ids",
            "--mtp needs at least 2 prompt ids (the head reads a state and the token after it)",
        ));
    }
    let head = model
        .mtp
        .as_ref()
        .ok_or_else(|| Error::invalid("--mtp", "the model was loaded without its head"))?;
    let (_, normed, _) = model.verify_normed(tokens, cache)?;
    let mut caches = head.make_caches(model, 1)?;
    let hidden = normed.try_index((.., ..t - 1, ..))?;
    let next = tokens.try_index((.., 1..))?;
    Ok(model.mtp_rows(&hidden, &next, &mut caches)?.0)
}
