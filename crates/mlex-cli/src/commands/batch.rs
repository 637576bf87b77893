//! `mlex generate --prompts-file FILE`: many prompts decoded together on the
//! batched engine, one output line per prompt as it finishes.

use crate::args::{Format, GenerateArgs};
use crate::session::{generate_options, tokenizer_for};
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_generate::{
    BatchGenerator, Finish, Flow, GenerateOptions, Message, SeqId, TextStream, Tokenizer,
};
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// A prompts-file line written as a JSON object: the prompt and the options
/// that override the command line's for this prompt only.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LineSpec {
    prompt: Option<String>,
    ids: Option<Vec<u32>>,
    max_tokens: Option<usize>,
    temp: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    seed: Option<u64>,
    stop: Option<Vec<String>>,
}

/// One prompt, ready for the engine.
struct Request {
    ids: Vec<u32>,
    opts: GenerateOptions,
    stops: Vec<String>,
}

/// The text of one sequence in flight (none without a tokenizer).
struct Output<'t> {
    index: usize,
    text: Option<TextStream<'t>>,
}

fn line_error(file: &Path, index: usize, msg: impl std::fmt::Display) -> Error {
    Error::Other(format!("{}:{}: {msg}", file.display(), index + 1))
}

/// Parses line `index` of the prompts file.
fn parse_line(
    a: &GenerateArgs,
    file: &Path,
    index: usize,
    line: &str,
    tokenizer: Option<&Tokenizer>,
    base: &GenerateOptions,
) -> Result<Request> {
    let trimmed = line.trim();
    let spec: LineSpec = if trimmed.starts_with('{') {
        serde_json::from_str(trimmed).map_err(|e| line_error(file, index, e))?
    } else if a.ids {
        let ids = trimmed
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u32>()
                    .map_err(|_| line_error(file, index, format!("`{s}` is not a token id")))
            })
            .collect::<Result<Vec<u32>>>()?;
        LineSpec {
            ids: Some(ids),
            ..Default::default()
        }
    } else {
        LineSpec {
            prompt: Some(line.to_owned()),
            ..Default::default()
        }
    };
    let ids = match (spec.ids, spec.prompt) {
        (Some(_), Some(_)) => {
            return Err(line_error(file, index, "give `prompt` or `ids`, not both"))
        }
        (Some(ids), None) => ids,
        (None, Some(text)) => {
            if text.trim().is_empty() {
                return Err(line_error(file, index, "the prompt is empty"));
            }
            let tok = tokenizer.ok_or_else(|| {
                line_error(file, index, "a text prompt needs the model's tokenizer")
            })?;
            let mut messages = Vec::new();
            if let Some(s) = &a.system {
                messages.push(Message::new("system", s));
            }
            messages.push(Message::new("user", &text));
            tok.chat_ids(&messages, !a.no_chat_template)?
        }
        (None, None) => return Err(line_error(file, index, "give `prompt` or `ids`")),
    };
    if ids.is_empty() {
        return Err(line_error(file, index, "the prompt is empty"));
    }
    let mut opts = base.clone();
    if let Some(n) = spec.max_tokens {
        if n == 0 {
            return Err(line_error(file, index, "`max_tokens` must be at least 1"));
        }
        opts.max_tokens = n;
    }
    let s = &mut opts.sampler;
    s.temp = spec.temp.unwrap_or(s.temp);
    s.top_p = spec.top_p.unwrap_or(s.top_p);
    s.top_k = spec.top_k.unwrap_or(s.top_k);
    s.min_p = spec.min_p.unwrap_or(s.min_p);
    s.repetition_penalty = spec.repetition_penalty.unwrap_or(s.repetition_penalty);
    s.seed = spec.seed.or(s.seed);
    Ok(Request {
        ids,
        opts,
        stops: spec.stop.unwrap_or_else(|| a.sampling.stop.clone()),
    })
}

pub fn run(a: GenerateArgs, file: &Path, registry: &Registry) -> Result<()> {
    a.model.refuse_kv_options("--prompts-file")?;
    let content = std::fs::read_to_string(file).map_err(|e| Error::io(file, e))?;
    let loaded = crate::session::load_for(&a.model, Some(&a.speculative), registry)?;
    let vocab = loaded.model.vocab_size() as usize;
    let tokenizer = match tokenizer_for(&loaded) {
        Ok(t) => Some(t),
        Err(_) if a.ids => None,
        Err(e) => return Err(e),
    };
    let mut base = generate_options(&a.sampling, tokenizer.as_ref(), vocab)?;
    // Prefilled together (the staircase), not through the prompt cache.
    base.use_prompt_cache = false;
    let mut generator = crate::session::generator(loaded.model, &a.model);
    let mut stdout = std::io::stdout().lock();
    let json = a.format == Format::Json;
    let mut print = |index: usize, value: serde_json::Value, text: &str, finish: &str| {
        let _ = if json {
            writeln!(stdout, "{value}")
        } else {
            writeln!(stdout, "--- {index} ({finish}) ---\n{text}")
        };
        let _ = stdout.flush();
    };
    let speculation =
        crate::session::batch_speculation(&generator, &a.speculative, &a.model, registry)?;
    let mut engine = BatchGenerator::new(&mut generator, a.batch as usize)?;
    if let Some(s) = speculation {
        engine.speculate(s)?;
    }
    let mut outputs: BTreeMap<SeqId, Output> = BTreeMap::new();
    let mut failed = 0usize;
    let mut total = 0usize;
    for (index, line) in content.lines().enumerate() {
        total += 1;
        match parse_line(&a, file, index, line, tokenizer.as_ref(), &base) {
            Ok(r) => {
                let id = engine.submit(r.ids, r.opts);
                outputs.insert(
                    id,
                    Output {
                        index,
                        text: tokenizer.as_ref().map(|t| TextStream::new(t, r.stops)),
                    },
                );
            }
            Err(e) => {
                failed += 1;
                let msg = e.to_string();
                print(index, json!({"index": index, "error": msg}), &msg, "error");
            }
        }
    }
    let started = Instant::now();
    let mut interrupted = false;
    let (result, _) = crate::interrupt::generating(|| -> Result<()> {
        while !engine.is_idle() {
            if crate::interrupt::requested() && !interrupted {
                interrupted = true;
                for &id in outputs.keys() {
                    engine.cancel(id);
                }
            }
            let mut on_token = |id: SeqId, t: &mlex_generate::Emitted| -> Result<Flow> {
                let Some(o) = outputs.get_mut(&id) else {
                    return Ok(Flow::Continue);
                };
                let Some(ts) = o.text.as_mut() else {
                    return Ok(Flow::Continue);
                };
                Ok(if ts.push(t.id)?.stop {
                    Flow::Stop
                } else {
                    Flow::Continue
                })
            };
            for (id, r) in engine.step(&mut on_token)? {
                let Some(mut o) = outputs.remove(&id) else {
                    continue;
                };
                match r {
                    Ok(g) => {
                        let text = match o.text.as_mut() {
                            Some(ts) => {
                                ts.finish(g.finish)?;
                                ts.text().to_owned()
                            }
                            None => String::new(),
                        };
                        let finish = if interrupted && g.finish == Finish::Cancelled {
                            "interrupted"
                        } else {
                            g.finish.as_str()
                        };
                        print(
                            o.index,
                            json!({
                                "index": o.index,
                                "token_ids": g.tokens,
                                "text": text,
                                "finish_reason": finish,
                                "prompt_tokens": g.prompt_tokens,
                                "generated_tokens": g.tokens.len(),
                                "speculative": g.speculative.as_ref().map(super::generate::speculative_json),
                            }),
                            &text,
                            finish,
                        );
                    }
                    Err(e) => {
                        failed += 1;
                        let msg = format!(
                            "{}:{}: {}",
                            file.display(),
                            o.index + 1,
                            crate::for_the_command_line(&e)
                        );
                        print(
                            o.index,
                            json!({"index": o.index, "error": msg}),
                            &msg,
                            "error",
                        );
                    }
                }
            }
        }
        Ok(())
    });
    result?;
    let stats = engine.stats().clone();
    let wall = started.elapsed().as_secs_f64();
    eprintln!(
        "{total} prompts ({failed} failed), batch {}: {} prompt tokens, {} generated in {wall:.2} s ({:.1} tok/s overall), peak memory {:.3} GB",
        a.batch,
        stats.prefill_tokens,
        stats.generated_tokens,
        stats.generated_tokens as f64 / wall.max(1e-9),
        mlex_core::device::peak_memory()? as f64 / 1e9
    );
    if interrupted {
        // lib.rs exits 130 after Ctrl-C.
        eprintln!("interrupted");
        return Ok(());
    }
    if failed > 0 {
        return Err(Error::Other(format!(
            "{failed} of {total} prompts in {} failed (see their `error` lines)",
            file.display()
        )));
    }
    Ok(())
}
