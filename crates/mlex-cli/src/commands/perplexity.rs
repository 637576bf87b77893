//! `mlex perplexity`: the model's perplexity on a text, computed as
//! `mlx_lm.perplexity` computes it (`mlx_lm/perplexity.py`): every
//! document encoded (an end token appended unless it ends with one), the
//! documents joined, cut into windows of `--context` tokens; one forward
//! over each window but its last token, the cross-entropy of every next
//! token in float32; the perplexity is `exp` of their mean, its standard
//! error `ppl * std / sqrt(n)` (the delta method). Windows apart by
//! default, as mlx-lm's; with `--stride S` below the context they overlap
//! and each after the first scores only its last `S` tokens, so that every
//! token is scored once with up to `context - S` tokens before it. Unlike
//! mlx-lm the documents keep their file order (it shuffles them).

use crate::args::{Format, PerplexityArgs};
use crate::session::{load_with, tokenizer_for};
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use serde_json::{json, Value};
use std::time::Instant;

/// The documents of `path`: a `.jsonl` file's `text` fields, or the whole
/// of any other file.
fn documents(path: &std::path::Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    if path.extension().is_none_or(|e| e != "jsonl") {
        return Ok(vec![text]);
    }
    let mut docs = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: Value = serde_json::from_str(line).map_err(|e| Error::Config {
            file: path.to_owned(),
            key: format!("line {}", i + 1),
            message: e.to_string(),
        })?;
        let t = v
            .get("text")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Config {
                file: path.to_owned(),
                key: format!("line {}", i + 1),
                message: "no string `text` field".into(),
            })?;
        docs.push(t.to_owned());
    }
    Ok(docs)
}

/// The windows to score: (start, first scored target within the window).
fn windows(n: usize, context: usize, stride: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start + context <= n {
        // Targets are positions 1..context of the window; a window after
        // the first scores the last `stride` of them.
        let first = if start == 0 {
            1
        } else {
            (context - stride).max(1)
        };
        out.push((start, first));
        start += stride;
    }
    out
}

pub fn run(a: PerplexityArgs, registry: &Registry) -> Result<()> {
    let context = a.context as usize;
    let stride = a.stride.map(|s| s as usize).unwrap_or(context);
    if stride > context {
        return Err(Error::invalid(
            "--stride",
            format!("{stride} is longer than --context {context}"),
        ));
    }
    a.model.refuse_kv_options("mlex perplexity")?;
    let docs = documents(&a.data)?;
    let loaded = load_with(&a.model, registry)?;
    let tok = tokenizer_for(&loaded)?;
    let model = &loaded.model;
    let mut tokens: Vec<u32> = Vec::new();
    for d in &docs {
        let mut ids = tok.encode(d, tok.add_bos)?;
        if let Some(eos) = tok.eos_id {
            if ids.last() != Some(&eos) {
                ids.push(eos);
            }
        }
        tokens.extend(ids);
    }
    let mut wins = windows(tokens.len(), context, stride);
    if a.num_samples > 0 {
        wins.truncate(a.num_samples as usize);
    }
    if wins.is_empty() {
        return Err(Error::invalid(
            "--data",
            format!(
                "{} holds {} tokens, fewer than one window of --context {context}",
                a.data.display(),
                tokens.len()
            ),
        ));
    }
    let started = Instant::now();
    let mut losses: Vec<f64> = Vec::new();
    for batch in wins.chunks(a.batch as usize) {
        let rows = batch.len() as i32;
        let mut ids = Vec::with_capacity(batch.len() * context);
        for &(s, _) in batch {
            ids.extend(tokens[s..s + context].iter().map(|&t| t as i32));
        }
        let all = Array::from_slice(&ids, &[rows, context as i32]);
        let inputs = all.try_index((.., ..context as i32 - 1))?;
        let targets = all.try_index((.., 1..))?;
        let mut cache = model.make_cache(batch.len())?;
        let logits = model
            .forward(&inputs, &mut cache)?
            .as_dtype(Dtype::Float32)?;
        let lse = logits.logsumexp_axis(-1, false)?;
        let picked = ops::indexing::take_along_axis(&logits, &ops::expand_dims(&targets, -1)?, -1)?
            .squeeze_axes(&[-1])?;
        let ce = ops::subtract(&lse, &picked)?;
        ce.eval()?;
        let ce = ce.as_slice::<f32>();
        let width = context - 1;
        for (r, &(_, first)) in batch.iter().enumerate() {
            // Target j of the window is its position j + 1.
            losses.extend(
                ce[r * width + first - 1..(r + 1) * width]
                    .iter()
                    .map(|&x| x as f64),
            );
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let n = losses.len() as f64;
    let mean = losses.iter().sum::<f64>() / n;
    let var = losses.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    let ppl = mean.exp();
    let se = ppl * var.sqrt() / n.sqrt();
    let peak = mlex_core::device::peak_memory()?;
    match a.format {
        Format::Json => println!(
            "{}",
            json!({
                "perplexity": ppl, "standard_error": se, "mean_loss": mean,
                "windows": wins.len(), "context": context, "stride": stride,
                "scored_tokens": losses.len(), "tokens": tokens.len(),
                "seconds": seconds, "tokens_per_second": losses.len() as f64 / seconds,
                "peak_memory_bytes": peak,
            })
        ),
        Format::Text => {
            println!("Perplexity: {ppl:.3} ± {se:.3}");
            eprintln!(
                "{} windows of {context} tokens (stride {stride}), {} tokens scored in {seconds:.2} s ({:.0} tok/s), peak memory {:.2} GB",
                wins.len(),
                losses.len(),
                losses.len() as f64 / seconds,
                peak as f64 / 1e9
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::windows;

    #[test]
    fn windows_apart_or_overlapping_score_every_token_once() {
        assert_eq!(windows(10, 4, 4), vec![(0, 1), (4, 1)]);
        // Stride 2: after the first, each window scores its last 2 targets.
        let w = windows(10, 4, 2);
        assert_eq!(w, vec![(0, 1), (2, 2), (4, 2), (6, 2)]);
        let mut scored = Vec::new();
        for (s, first) in w {
            scored.extend((first..4).map(|j| s + j));
        }
        assert_eq!(scored, (1..10).collect::<Vec<_>>());
    }
}
