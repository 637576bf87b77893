//! `mlex chat`: multi-turn chat on stdin. Each turn renders the whole
//! conversation with the chat template; the prompt cache restores the
//! previous turn's state, so only the new tokens are prefilled.

use crate::args::{ChatArgs, Format};
use crate::session::{generate_options, tokenizer_for};
use mlex_core::distributed::Shard;
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_generate::{Flow, Message, TextStream};
use serde_json::json;
use std::io::{BufRead, IsTerminal, Write};

pub fn run(a: ChatArgs, registry: &Registry) -> Result<()> {
    let loaded = crate::session::load_for(&a.model, Some(&a.speculative), registry)?;
    let vocab = loaded.model.vocab_size() as usize;
    let tokenizer = tokenizer_for(&loaded)?;
    let opts = generate_options(&a.sampling, Some(&tokenizer), vocab)?;
    let (mut generator, cache_file) = crate::session::decoder(loaded, &a, registry)?;
    let shard = generator.model.dispatch.tensor_parallel.clone();
    let interactive = std::io::stdin().is_terminal();
    let json = a.format == Format::Json;
    let system: Vec<Message> = a.system.iter().map(|s| Message::new("system", s)).collect();
    let mut history = system.clone();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    if interactive {
        eprintln!("mlex chat: /reset clears the conversation, /quit exits");
    }
    let mut turn = 0;
    loop {
        if interactive {
            eprint!(">>> ");
            let _ = std::io::stderr().flush();
        }
        let Some(line) = next_line(&stdin, shard.as_ref())? else {
            break;
        };
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                history = system.clone();
                if !json {
                    eprintln!("(conversation cleared)");
                }
                continue;
            }
            _ => {}
        }
        history.push(Message::new("user", line));
        let prompt = tokenizer.chat_ids(&history, true)?;
        let mut text_stream = TextStream::new(&tokenizer, a.sampling.stop.clone());
        let mut on_token = |t: u32| -> Result<Flow> {
            if shard.is_none() && crate::interrupt::requested() {
                return Ok(Flow::Stop);
            }
            let pushed = text_stream.push(t)?;
            if !json && !pushed.text.is_empty() {
                let _ = out.write_all(pushed.text.as_bytes());
                let _ = out.flush();
            }
            // Under --tp every rank stops at the same token: a stop string
            // is seen alike, an interrupt by whichever rank got it.
            let stop = match &shard {
                Some(shard) => shard.any(pushed.stop || crate::interrupt::requested())?,
                None => pushed.stop,
            };
            Ok(if stop { Flow::Stop } else { Flow::Continue })
        };
        // Ctrl-C cuts this reply short and the chat goes on; at the prompt
        // it exits (see `interrupt`).
        let (g, interrupted) =
            crate::interrupt::generating(|| generator.generate(&prompt, &opts, &mut on_token));
        let g = g?;
        if let Some(file) = &cache_file {
            file.save(&generator)?;
        }
        crate::interrupt::reset();
        let rest = text_stream.finish(g.finish)?;
        let text = text_stream.text().to_owned();
        turn += 1;
        if json {
            let obj = json!({
                "turn": turn,
                "text": text,
                "prompt_tokens": g.prompt_tokens,
                "reused_prompt_tokens": g.reused_tokens,
                "prefilled_tokens": g.prompt_tokens - g.reused_tokens,
                "generated_tokens": g.tokens.len(),
                "prefill_tok_s": g.prefill_tok_s(),
                "decode_tok_s": g.decode_tok_s(),
                "finish_reason": if interrupted { "interrupted" } else { g.finish.as_str() },
            });
            writeln!(out, "{obj}").map_err(|e| Error::io("<stdout>", e))?;
        } else {
            let _ = out.write_all(rest.as_bytes());
            writeln!(out).map_err(|e| Error::io("<stdout>", e))?;
            if interactive {
                eprintln!(
                    "[{} prompt tokens ({} reused), {} generated, {:.1} tok/s]",
                    g.prompt_tokens,
                    g.reused_tokens,
                    g.tokens.len(),
                    g.decode_tok_s()
                );
            }
        }
        history.push(Message::new("assistant", &text));
    }
    Ok(())
}

/// The next line of input (`None`: its end): read from stdin, and under
/// --tp read by rank 0 and shared with the others (whose stdin is empty).
fn next_line(stdin: &std::io::Stdin, shard: Option<&Shard>) -> Result<Option<String>> {
    let read = || -> Result<Option<String>> {
        let mut line = String::new();
        let n = stdin
            .lock()
            .read_line(&mut line)
            .map_err(|e| Error::io("<stdin>", e))?;
        Ok((n > 0).then_some(line))
    };
    let Some(shard) = shard else {
        return read();
    };
    // Rank 0's line as [1, bytes...], or [0] at the end of its input.
    let mine: Vec<i32> = match shard.rank() {
        0 => match read()? {
            Some(line) => std::iter::once(1)
                .chain(line.bytes().map(i32::from))
                .collect(),
            None => vec![0],
        },
        _ => Vec::new(),
    };
    let shared = shard.share_from_first(&mine)?;
    match shared.split_first() {
        Some((1, bytes)) => {
            let bytes: Vec<u8> = bytes.iter().map(|&b| b as u8).collect();
            Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
        }
        _ => Ok(None),
    }
}
