//! `mlex bench`: prefill and decode speed on random prompt ids.

use crate::args::{BenchArgs, Format};
use crate::session::{compile, load_with};
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_generate::{Flow, GenerateOptions, Generator, SamplerConfig};
use serde_json::json;

/// Deterministic pseudo-random ids in `[0, vocab)`.
fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    let mut s: u64 = 0x9e3779b97f4a7c15;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

pub fn run(a: BenchArgs, registry: &Registry) -> Result<()> {
    if a.prompt_len == 0 || a.gen < 2 {
        return Err(Error::invalid(
            "--prompt-len/--gen",
            "need a prompt of at least 1 token and at least 2 generated tokens",
        ));
    }
    let loaded = load_with(&a.model, registry)?;
    let vocab = loaded.model.vocab_size() as usize;
    let arch = loaded.model.arch.clone();
    let mut g = Generator::with_policy(loaded.model, compile(&a.model));
    if let Some(n) = a.model.prefill_chunk {
        g.prefill_chunk = n as usize;
    }
    g.checkpoint_every = a.model.checkpoint_every;
    let prompt = prompt_ids(a.prompt_len, vocab);
    let opts = |n: usize| GenerateOptions {
        max_tokens: n,
        sampler: SamplerConfig::default(),
        stop_ids: Default::default(),
        use_prompt_cache: false,
    };
    // Warm-up: compiles the decode segments and warms the allocator.
    g.generate(&prompt, &opts(a.gen.min(8)), &mut |_| Ok(Flow::Continue))?;
    let mut best: Option<mlex_generate::Generation> = None;
    let mut peak = 0;
    for _ in 0..a.repeats.max(1) {
        let r = g.generate(&prompt, &opts(a.gen), &mut |_| Ok(Flow::Continue))?;
        peak = peak.max(r.peak_memory_bytes);
        best = Some(match best {
            None => r,
            Some(b) => {
                if r.decode_tok_s() > b.decode_tok_s() {
                    r
                } else {
                    b
                }
            }
        });
    }
    let r = best.expect("at least one run");
    let info = mlex_core::device::runtime_info()?;
    if a.format == Format::Text {
        println!("model          {} ({arch})", a.model.model);
        println!(
            "device         {} ({})",
            info.default_device,
            info.gpu_name.clone().unwrap_or_else(|| "cpu".into())
        );
        println!(
            "decode         {}",
            if g.is_compiled() {
                "compiled segments"
            } else {
                "eager"
            }
        );
        println!(
            "prompt         {} tokens, {:.1} tok/s",
            r.prompt_tokens,
            r.prefill_tok_s()
        );
        println!(
            "generation     {} tokens, {:.1} tok/s",
            r.tokens.len(),
            r.decode_tok_s()
        );
        println!("peak memory    {:.3} GB", peak as f64 / 1e9);
    }
    let out = json!({
        "model": a.model.model,
        "arch": arch,
        "device": info.default_device,
        "backend": info.backend.to_string(),
        "compiled": g.is_compiled(),
        "prompt_tokens": r.prompt_tokens,
        "generated_tokens": r.tokens.len(),
        "prefill_tok_s": r.prefill_tok_s(),
        "decode_tok_s": r.decode_tok_s(),
        "peak_memory_bytes": peak,
    });
    if a.format == Format::Json {
        println!("{out}");
    }
    Ok(())
}
