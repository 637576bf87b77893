//! `mlex serve`.

use crate::args::ServeArgs;
use crate::session::{load_for, tokenizer_for};
use mlex_core::error::Result;
use mlex_server::{Loaded, ServeConfig};
use std::path::PathBuf;
use std::time::Duration;

pub fn run(a: ServeArgs, arch_paths: Vec<PathBuf>) -> Result<()> {
    a.model.refuse_kv_options("mlex serve")?;
    let model_id = a.served_model_name.clone().unwrap_or_else(|| {
        let trimmed = a.model.model.trim_end_matches('/');
        trimmed.rsplit('/').next().unwrap_or(trimmed).to_owned()
    });
    let cfg = ServeConfig {
        host: a.host.clone(),
        port: a.port,
        batch: a.batch as usize,
        max_queue: a.max_queue,
        api_key: a.api_key.clone(),
        model_id,
        default_max_tokens: a.default_max_tokens as usize,
        shutdown_timeout: Duration::from_secs(a.shutdown_timeout),
        prompt_cache_bytes: a.prompt_cache_bytes,
    };
    let model_args = a.model.clone();
    let spec_args = a.speculative.clone();
    // The model lives on the engine thread: MLX arrays and compiled traces
    // stay on the thread that made them.
    let load = Box::new(move || -> Result<Loaded> {
        let registry = mlex_models::build_registry(&arch_paths)?;
        let loaded = load_for(&model_args, Some(&spec_args), &registry)?;
        let tokenizer = tokenizer_for(&loaded)?;
        let generator = crate::session::generator(loaded.model, &model_args);
        let speculation =
            crate::session::batch_speculation(&generator, &spec_args, &model_args, &registry)?;
        Ok(Loaded {
            generator,
            tokenizer,
            speculation,
        })
    });
    if crate::tp::follower() {
        // A rank other than 0 of --tp: no HTTP, the engine in lockstep.
        let loaded = load()?;
        return crate::interrupt::following(|| {
            mlex_server::follow(loaded, cfg.batch, cfg.prompt_cache_bytes)
        });
    }
    let stop = mlex_server::Shutdown::default();
    let on_signal = stop.clone();
    crate::interrupt::serving(
        move || on_signal.request(),
        || mlex_server::serve(cfg, load, stop),
    )
}
