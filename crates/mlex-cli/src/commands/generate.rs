//! `mlex generate`.

use crate::args::{Format, GenerateArgs};
use crate::session::{compile, generate_options, load_with, open_prompt_cache, tokenizer_for};
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_generate::{cut_at_stop, shown_len, Flow, Generator, Message, StreamingDetokenizer};
use serde_json::json;
use std::io::{Read, Write};

pub fn run(a: GenerateArgs, registry: &Registry) -> Result<()> {
    let loaded = load_with(&a.model, registry)?;
    let vocab = loaded.model.vocab_size() as usize;
    let tokenizer = match (&a.prompt_ids, tokenizer_for(&loaded)) {
        (Some(_), t) => t.ok(),
        (None, t) => Some(t?),
    };
    let prompt: Vec<u32> = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(p)) => {
            let text = if p == "-" {
                let mut s = String::new();
                std::io::stdin()
                    .read_to_string(&mut s)
                    .map_err(|e| Error::io("<stdin>", e))?;
                s
            } else {
                p.clone()
            };
            let tok = tokenizer.as_ref().expect("loaded above");
            let mut messages = Vec::new();
            if let Some(s) = &a.system {
                messages.push(Message::new("system", s));
            }
            messages.push(Message::new("user", &text));
            tok.chat_ids(&messages, !a.no_chat_template)?
        }
        (None, None) => {
            return Err(Error::invalid(
                "--prompt",
                "give --prompt TEXT or --prompt-ids 1,2,3",
            ))
        }
    };
    let opts = generate_options(&a.sampling, tokenizer.as_ref(), vocab)?;
    let loaded_fingerprint = loaded.fingerprint.clone();
    let mut generator = Generator::with_policy(loaded.model, compile(&a.model));
    if let Some(n) = a.model.prefill_chunk {
        generator.prefill_chunk = n as usize;
    }
    generator.checkpoint_every = a.model.checkpoint_every;
    let cache_file = match &a.prompt_cache {
        Some(dir) => Some(open_prompt_cache(&mut generator, dir, &loaded_fingerprint)?),
        None => None,
    };
    let stream = a.format == Format::Text;
    let stops = a.sampling.stop.clone();
    let mut detok = tokenizer.as_ref().map(StreamingDetokenizer::new);
    let mut text = String::new();
    let mut shown = 0usize;
    let mut stdout = std::io::stdout().lock();
    let mut on_token = |t: u32| -> Result<Flow> {
        if crate::interrupt::requested() {
            return Ok(Flow::Stop);
        }
        let Some(d) = detok.as_mut() else {
            return Ok(Flow::Continue);
        };
        text.push_str(&d.push(t)?);
        if let Some(cut) = cut_at_stop(&text, &stops) {
            text.truncate(cut);
            if stream && cut > shown {
                let _ = stdout.write_all(&text.as_bytes()[shown..]);
            }
            shown = text.len();
            return Ok(Flow::Stop);
        }
        // Hold back what could still become a stop string.
        let safe = shown_len(&text, &stops);
        if stream && safe > shown {
            let _ = stdout.write_all(&text.as_bytes()[shown..safe]);
            let _ = stdout.flush();
            shown = safe;
        }
        Ok(Flow::Continue)
    };
    let (g, interrupted) =
        crate::interrupt::generating(|| generator.generate(&prompt, &opts, &mut on_token));
    let g = g?;
    if let Some(path) = &cache_file {
        generator.prompt_cache.save(path, &loaded_fingerprint)?;
    }
    let finish = if interrupted {
        "interrupted"
    } else {
        g.finish.as_str()
    };
    if let Some(d) = detok.as_mut() {
        if g.finish != mlex_generate::Finish::Stop {
            text.push_str(&d.finish()?);
        }
    }
    if stream {
        if text.len() > shown {
            stdout
                .write_all(&text.as_bytes()[shown..])
                .map_err(|e| Error::io("<stdout>", e))?;
        }
        writeln!(stdout).map_err(|e| Error::io("<stdout>", e))?;
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s | peak memory {:.3} GB | {}",
            g.prompt_tokens,
            g.prefill_tok_s(),
            g.tokens.len(),
            g.decode_tok_s(),
            g.peak_memory_bytes as f64 / 1e9,
            if generator.is_compiled() { "compiled" } else { "eager" }
        );
        if interrupted {
            eprintln!("interrupted");
        }
    } else {
        let out = json!({
            "token_ids": g.tokens,
            "text": text,
            "prompt_tokens": g.prompt_tokens,
            "reused_prompt_tokens": g.reused_tokens,
            "prompt_tokens_reused": g.reused_tokens,
            "prompt_tokens_computed": g.prompt_tokens - g.reused_tokens,
            "generated_tokens": g.tokens.len(),
            "prefill_tok_s": g.prefill_tok_s(),
            "decode_tok_s": g.decode_tok_s(),
            "ttft_s": g.prefill_s,
            "peak_memory_bytes": g.peak_memory_bytes,
            "finish_reason": finish,
            "compiled": generator.is_compiled(),
        });
        writeln!(stdout, "{out}").map_err(|e| Error::io("<stdout>", e))?;
    }
    Ok(())
}
