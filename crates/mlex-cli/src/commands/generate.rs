//! `mlex generate`.

use crate::args::{Format, GenerateArgs};
use crate::session::{generate_options, tokenizer_for};
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_generate::{Flow, Message, TextStream};
use serde_json::json;
use std::io::{Read, Write};

pub fn run(a: GenerateArgs, registry: &Registry) -> Result<()> {
    let loaded = crate::session::load_for(&a.model, Some(&a.speculative), registry)?;
    let vocab = loaded.model.vocab_size() as usize;
    let tokenizer = match (&a.prompt_ids, tokenizer_for(&loaded)) {
        (Some(_), t) => t.ok(),
        (None, t) => Some(t?),
    };
    let prompt = prompt_ids(&a, tokenizer.as_ref())?;
    let opts = generate_options(&a.sampling, tokenizer.as_ref(), vocab)?;
    let (mut generator, cache_file) = crate::session::decoder(loaded, &a, registry)?;
    let stream = a.format == Format::Text;
    let mut text_stream = tokenizer
        .as_ref()
        .map(|t| TextStream::new(t, a.sampling.stop.clone()));
    let mut stdout = std::io::stdout().lock();
    let shard = generator.model.dispatch.tensor_parallel.clone();
    let mut decide = |t: u32| -> Result<Flow> {
        if crate::interrupt::requested() {
            return Ok(Flow::Stop);
        }
        let Some(ts) = text_stream.as_mut() else {
            return Ok(Flow::Continue);
        };
        let pushed = ts.push(t)?;
        if stream && !pushed.text.is_empty() {
            let _ = stdout.write_all(pushed.text.as_bytes());
            let _ = stdout.flush();
        }
        Ok(if pushed.stop {
            Flow::Stop
        } else {
            Flow::Continue
        })
    };
    // Under --tp every rank stops at the same token (an interrupt reaches
    // the ranks at different moments).
    let mut on_token = |t: u32| crate::tp::agreed(shard.as_ref(), decide(t)?);
    let (g, interrupted) =
        crate::interrupt::generating(|| generator.generate(&prompt, &opts, &mut on_token));
    let g = g?;
    if let Some(file) = &cache_file {
        file.save(&generator)?;
    }
    let finish = if interrupted {
        "interrupted"
    } else {
        g.finish.as_str()
    };
    let rest = match text_stream.as_mut() {
        Some(ts) => ts.finish(g.finish)?,
        None => String::new(),
    };
    let text = text_stream
        .as_ref()
        .map(|ts| ts.text().to_owned())
        .unwrap_or_default();
    if stream {
        stdout
            .write_all(rest.as_bytes())
            .map_err(|e| Error::io("<stdout>", e))?;
        writeln!(stdout).map_err(|e| Error::io("<stdout>", e))?;
        eprintln!("{}", summary(&g, generator.is_compiled()));
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
            "speculative": g.speculative.as_ref().map(speculative_json),
        });
        writeln!(stdout, "{out}").map_err(|e| Error::io("<stdout>", e))?;
    }
    Ok(())
}

/// A speculative generation's counters for JSON output: acceptance per
/// draft position, mean accepted length and the time split.
pub fn speculative_json(s: &mlex_generate::SpecStats) -> serde_json::Value {
    let per_position: Vec<f64> = s
        .accepted_at
        .iter()
        .zip(&s.proposed_at)
        .map(|(&a, &p)| a as f64 / p.max(1) as f64)
        .collect();
    json!({
        "drafter": s.drafter,
        "draft_tokens": s.draft_tokens,
        "rounds": s.rounds,
        "plain_steps": s.plain_steps,
        "proposed": s.proposed,
        "accepted": s.accepted,
        "acceptance": s.acceptance(),
        "acceptance_per_position": per_position,
        "mean_accepted_length": s.mean_accepted_length(),
        "draft_s": s.draft_s,
        "verify_s": s.verify_s,
        "commit_s": s.commit_s,
    })
}

/// The text-mode summary line: speeds, memory, decode mode, and what a
/// drafter achieved.
fn summary(g: &mlex_generate::Generation, compiled: bool) -> String {
    let mut line = format!(
        "prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s | peak memory {:.3} GB | {}",
        g.prompt_tokens,
        g.prefill_tok_s(),
        g.tokens.len(),
        g.decode_tok_s(),
        g.peak_memory_bytes as f64 / 1e9,
        if compiled { "compiled" } else { "eager" }
    );
    if let Some(s) = &g.speculative {
        line.push_str(&format!(
            " | {}: {:.0}% of drafts accepted, {:.2} tokens a verify",
            s.drafter,
            100.0 * s.acceptance(),
            s.mean_accepted_length()
        ));
    }
    line
}

/// The prompt's token ids: `--prompt-ids`, or `--prompt` (`-`: stdin)
/// through the chat template.
fn prompt_ids(a: &GenerateArgs, tokenizer: Option<&mlex_generate::Tokenizer>) -> Result<Vec<u32>> {
    Ok(match (&a.prompt_ids, &a.prompt) {
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
            let tok = tokenizer.expect("loaded above");
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
    })
}
