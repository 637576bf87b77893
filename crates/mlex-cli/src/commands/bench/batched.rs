//! `mlex bench --batch N`: many sequences decoded together, plain and,
//! with a drafter, speculative batches alternating.

use super::{prompt_ids_seeded, spread};
use crate::args::{BenchArgs, Format};
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_generate::{Flow, GenerateOptions, Generator};
use serde_json::json;

/// One timed batch: `n` prompts of `--prompt-len` random ids, `--gen`
/// greedy tokens each, all submitted at once.
struct BatchRun {
    /// Over every sequence that drafted: rounds, proposed, accepted.
    drafted: (usize, usize, usize),
    wall_s: f64,
    prefill_s: f64,
    steps: usize,
    wait_s: f64,
    prompt_tokens: usize,
    generated: usize,
    peak: usize,
    mask_s: f64,
    masks: usize,
}

fn batch_once(
    g: &mut Generator,
    a: &BenchArgs,
    (n, gen): (usize, usize),
    vocab: usize,
    opts: &dyn Fn(usize) -> GenerateOptions,
    speculation: Option<mlex_generate::BatchSpeculation>,
) -> Result<BatchRun> {
    mlex_core::device::reset_peak_memory()?;
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| prompt_ids_seeded(a.prompt_len, vocab, i as u64 + 1))
        .collect();
    let start = std::time::Instant::now();
    let mut b = mlex_generate::BatchGenerator::new(g, n)?;
    if let Some(s) = speculation {
        b.speculate(s)?;
    }
    for p in prompts {
        b.submit(p, opts(gen));
    }
    let outs = b.run(&mut |_, _| Ok(Flow::Continue))?;
    let wall_s = start.elapsed().as_secs_f64();
    let mut drafted = (0, 0, 0);
    for (_, r) in &outs {
        match r {
            Err(e) => return Err(Error::Other(format!("a benchmark sequence failed: {e}"))),
            Ok(o) => {
                if let Some(s) = &o.speculative {
                    drafted.0 += s.rounds;
                    drafted.1 += s.proposed;
                    drafted.2 += s.accepted;
                }
            }
        }
    }
    let st = b.stats().clone();
    Ok(BatchRun {
        drafted,
        wall_s,
        prefill_s: st.prefill_time.as_secs_f64(),
        steps: st.steps,
        wait_s: st.wait_time.as_secs_f64(),
        prompt_tokens: st.prefill_tokens,
        generated: st.generated_tokens,
        peak: mlex_core::device::peak_memory()?,
        mask_s: st.mask_time.as_secs_f64(),
        masks: st.masks,
    })
}

/// The speculation of a speculative `mlex bench --batch` run (seed `seed`
/// for its drafters), whatever the batch size (the bench measures the
/// mechanism; `Dispatch::speculative_rows` is the engine's policy):
/// `--draft-acceptance A --force-acceptance` (a bench-only drafter whose
/// rounds keep a set share), or `--lookup` / `--draft-model`.
fn batch_speculation(
    a: &BenchArgs,
    g: &Generator,
    registry: &Registry,
    vocab: usize,
    seed: u64,
) -> Result<Option<mlex_generate::BatchSpeculation>> {
    let k = a.speculative.draft_tokens;
    let Some(acc) = a.draft_acceptance else {
        let s = crate::session::batch_speculation(g, &a.speculative, &a.model, registry)?;
        return Ok(s.map(|s| mlex_generate::BatchSpeculation {
            max_rows: usize::MAX,
            ..s
        }));
    };
    if !a.force_acceptance {
        return Err(Error::invalid(
            "--draft-acceptance",
            "with --batch it needs --force-acceptance (no script of each sequence's own continuation is kept)",
        ));
    }
    let mut next = seed;
    Ok(Some(mlex_generate::BatchSpeculation {
        make: Box::new(move || {
            next += 1;
            Ok(Box::new(mlex_generate::ScriptedDrafter::new(
                Vec::new(),
                vocab as u32,
                mlex_generate::Spoil::Forced { acceptance: acc },
                next,
            )) as Box<dyn mlex_generate::Drafter>)
        }),
        k: mlex_generate::check_draft_tokens(k)?,
        max_rows: usize::MAX,
    }))
}

/// `mlex bench --batch N`: aggregate throughput of `N` sequences decoded
/// together (wall time from submission to the last token, prefill
/// included, as mlx-lm's `BatchGenerator` is measured); with a drafter,
/// plain and speculative batches alternate (`--repeats` pairs).
pub(super) fn run_batch(
    a: &BenchArgs,
    registry: &Registry,
    g: &mut Generator,
    (arch, n): (&str, usize),
    vocab: usize,
    opts: &dyn Fn(usize) -> GenerateOptions,
) -> Result<()> {
    let speculative = batch_speculation(a, g, registry, vocab, 0)?.is_some();
    // Warm-up at the measured batch size: traces its bucket's segments.
    batch_once(g, a, (n, a.gen.min(4)), vocab, opts, None)?;
    if speculative {
        let s = batch_speculation(a, g, registry, vocab, 0)?;
        batch_once(g, a, (n, a.gen.min(16)), vocab, opts, s)?;
    }
    let mut best: Option<BatchRun> = None;
    let (mut plain, mut spec, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut last_spec = None;
    for r in 0..a.repeats.max(1) {
        let run = batch_once(g, a, (n, a.gen), vocab, opts, None)?;
        let plain_tok_s = run.generated as f64 / run.wall_s.max(1e-9);
        plain.push(plain_tok_s);
        if speculative {
            let s = batch_speculation(a, g, registry, vocab, 1000 * (r as u64 + 1))?;
            let sr = batch_once(g, a, (n, a.gen), vocab, opts, s)?;
            let tok_s = sr.generated as f64 / sr.wall_s.max(1e-9);
            spec.push(tok_s);
            ratios.push(tok_s / plain_tok_s);
            last_spec = Some(sr);
        }
        if best.as_ref().is_none_or(|b| run.wall_s < b.wall_s) {
            best = Some(run);
        }
    }
    let r = best.expect("at least one run");
    let decode_s = (r.wall_s - r.prefill_s).max(1e-9);
    let decoded = r.generated.saturating_sub(n);
    let out = super::report(
        a,
        arch,
        g,
        json!({
            "batch": n,
            "prompt_tokens": r.prompt_tokens,
            "generated_tokens": r.generated,
            "seconds": r.wall_s,
            "agg_tok_s": r.generated as f64 / r.wall_s.max(1e-9),
            "prefill_tok_s": r.prompt_tokens as f64 / r.prefill_s.max(1e-9),
            "decode_tok_s": decoded as f64 / decode_s,
            // Where a decode step's time goes: the rest of it is the host's
            // (graph building, bookkeeping) while the device runs ahead.
            "decode_steps": r.steps,
            "device_wait_s": r.wait_s,
            "peak_memory_bytes": r.peak,
            // With --json-schema: the host time grammar masks took.
            "grammar": a.json_schema.as_ref().map(|p| json!({
                "schema": p, "masks": r.masks, "mask_s": r.mask_s,
                "mask_ms_per_token": 1e3 * r.mask_s / (r.masks.max(1) as f64),
            })),
            // With a drafter: plain and speculative batches alternating.
            "speculative": last_spec.as_ref().map(|s| json!({
                "draft_tokens": a.speculative.draft_tokens,
                "draft_acceptance": a.draft_acceptance,
                "plain_agg_tok_s": spread(&plain),
                "speculative_agg_tok_s": spread(&spec),
                "speedup": spread(&ratios),
                "rounds": s.drafted.0,
                "proposed": s.drafted.1,
                "accepted": s.drafted.2,
                "decode_steps": s.steps,
                "peak_memory_bytes": s.peak,
            })),
        }),
    )?;
    if a.format == Format::Json {
        println!("{out}");
    } else {
        println!("model          {} ({arch})", a.model.model);
        println!(
            "batch          {n} sequences, {} + {} tokens each",
            a.prompt_len, a.gen
        );
        println!(
            "prefill        {} tokens, {:.1} tok/s",
            r.prompt_tokens,
            r.prompt_tokens as f64 / r.prefill_s.max(1e-9)
        );
        println!(
            "decode         {decoded} tokens, {:.1} tok/s",
            decoded as f64 / decode_s
        );
        println!(
            "overall        {} tokens in {:.3} s, {:.1} tok/s",
            r.generated,
            r.wall_s,
            r.generated as f64 / r.wall_s.max(1e-9)
        );
        println!("peak memory    {:.3} GB", r.peak as f64 / 1e9);
        if let Some(m) = spread(&ratios)["median"]
            .as_f64()
            .filter(|_| !ratios.is_empty())
        {
            println!("speculative    {m:.2}x the plain batch's overall tok/s (median)");
        }
    }
    Ok(())
}
