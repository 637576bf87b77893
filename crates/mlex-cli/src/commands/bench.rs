//! `mlex bench`: prefill and decode speed on random prompt ids.

use crate::args::{BenchArgs, Format};
use crate::session::load_with;
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_generate::{Flow, GenerateOptions, Generator, SamplerConfig};
use serde_json::json;

mod batched;

use batched::run_batch;

/// Deterministic pseudo-random ids in `[0, vocab)`.
fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    prompt_ids_seeded(n, vocab, 0)
}

/// Deterministic pseudo-random ids in `[0, vocab)`, one stream per seed.
fn prompt_ids_seeded(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let state = 0x9e3779b97f4a7c15 ^ seed.wrapping_mul(0xbf58476d1ce4e5b9);
    mlex_core::ids::lcg_ids(state, n, vocab as u64)
}

pub fn run(a: BenchArgs, registry: &Registry) -> Result<()> {
    if a.batch.is_some() {
        a.model.refuse_kv_options("--batch")?;
    }
    if a.prompt_len == 0 || a.gen < 2 {
        return Err(Error::invalid(
            "--prompt-len/--gen",
            "need a prompt of at least 1 token and at least 2 generated tokens",
        ));
    }
    let loaded = crate::session::load_for(&a.model, Some(&a.speculative), registry)?;
    // What loading read from files (later reads add the ring's traffic).
    let load_read = mlex_core::device::MemoryReport::now()?.read;
    let vocab = loaded.model.vocab_size() as usize;
    let arch = loaded.model.arch.clone();
    // With --json-schema every sequence is held to it and ends where it
    // does (at the tokenizer's end tokens).
    let constrained = match &a.json_schema {
        Some(path) => Some(grammar_for(path, &loaded, vocab)?),
        None => None,
    };
    let mut g = crate::session::generator(loaded.model, &a.model);
    let prompt = prompt_ids(a.prompt_len, vocab);
    let opts = |n: usize| GenerateOptions {
        max_tokens: n,
        sampler: SamplerConfig::default(),
        stop_ids: constrained
            .as_ref()
            .map(|(_, _, stops)| stops.clone())
            .unwrap_or_default(),
        use_prompt_cache: false,
        constraint: constrained
            .as_ref()
            .map(|(engine, grammar, _)| engine.compile(grammar).expect("compiled once before")),
        ..Default::default()
    };
    if let Some(n) = a.batch {
        return run_batch(&a, registry, &mut g, (&arch, n as usize), vocab, &opts);
    }
    if let Some(n) = a.shared_prefix {
        return run_shared_prefix(&a, &mut g, &arch, n as usize, vocab);
    }
    if let Some(acc) = a.draft_acceptance {
        return run_draft_acceptance(&a, registry, &mut g, &arch, acc, &prompt, &opts);
    }
    if a.verify_cost {
        return run_verify_cost(&a, &mut g, &arch, &prompt);
    }
    crate::session::speculative(&mut g, &a.speculative, &a.model, registry, false)?;
    // Warm-up: compiles the decode segments and warms the allocator.
    g.generate(&prompt, &opts(a.gen.min(8)), &mut |_| Ok(Flow::Continue))?;
    let mut best: Option<mlex_generate::Generation> = None;
    let (mut peak, mut prefill_peak) = (0, 0);
    for _ in 0..a.repeats.max(1) {
        let r = g.generate(&prompt, &opts(a.gen), &mut |_| Ok(Flow::Continue))?;
        peak = peak.max(r.peak_memory_bytes);
        prefill_peak = prefill_peak.max(r.prefill_peak_memory_bytes);
        best = Some(match best {
            Some(b) if b.decode_tok_s() >= r.decode_tok_s() => b,
            _ => r,
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
        print_kv_form(&g.model);
        println!("peak memory    {:.3} GB", peak as f64 / 1e9);
    }
    let out = report(
        &a,
        &arch,
        &g,
        json!({
            "prompt_tokens": r.prompt_tokens,
            "generated_tokens": r.tokens.len(),
            "prefill_tok_s": r.prefill_tok_s(),
            "decode_tok_s": r.decode_tok_s(),
            "ttft_s": r.prefill_s,
            "peak_memory_bytes": peak,
            "prefill_peak_memory_bytes": prefill_peak,
            "kv_quantization": g.model.kv_quantization.map(|q| json!({
                "bits": q.bits, "group_size": q.group_size, "start": q.start,
            })),
            "max_kv_size": g.model.max_kv_size,
            // This rank's weights (all of them on one device).
            "weight_bytes": g.model.params.nbytes(),
            "load_read_bytes": load_read,
            "collective": collective_cost(&g.model)?,
            "speculative": r.speculative.as_ref().map(super::generate::speculative_json),
        }),
    )?;
    if a.format == Format::Json {
        println!("{out}");
    }
    Ok(())
}

/// The KV cache's form (`--kv-bits`, `--max-kv-size`), when not the default.
fn print_kv_form(m: &mlex_core::model::Model) {
    if let Some(q) = m.kv_quantization {
        println!(
            "kv cache       {}-bit, groups of {}, from token {}",
            q.bits, q.group_size, q.start
        );
    }
    if let Some(max) = m.max_kv_size {
        println!("kv window      {max} tokens (rotating)");
    }
}

/// The median and the range of `v`.
fn spread(v: &[f64]) -> serde_json::Value {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    json!({
        "median": s.get(s.len() / 2).copied().unwrap_or(0.0),
        "min": s.first().copied().unwrap_or(0.0),
        "max": s.last().copied().unwrap_or(0.0),
    })
}

/// `--draft-acceptance`: plain decode against speculative decoding whose
/// drafter is right with probability `acc` per token.
fn run_draft_acceptance(
    a: &BenchArgs,
    registry: &Registry,
    g: &mut Generator,
    arch: &str,
    acc: f64,
    prompt: &[u32],
    opts: &dyn Fn(usize) -> GenerateOptions,
) -> Result<()> {
    if !(0.0..=1.0).contains(&acc) {
        return Err(Error::invalid(
            "--draft-acceptance",
            format!("{acc} is outside 0..=1"),
        ));
    }
    let k = mlex_generate::check_draft_tokens(a.speculative.draft_tokens)?;
    let mtp = a.speculative.mtp;
    if mtp && !a.force_acceptance {
        return Err(Error::invalid(
            "--mtp",
            "with --draft-acceptance needs --force-acceptance (a random head's own acceptance means nothing)",
        ));
    }
    let vocab = g.model.vocab_size() as u32;
    // Warm-up, and the script: the model's own greedy continuation.
    let plain0 = g.generate(prompt, &opts(a.gen), &mut |_| Ok(Flow::Continue))?;
    let mut script = prompt.to_vec();
    script.extend(&plain0.tokens);
    let oracle = || -> Result<Generator> {
        let loaded = load_with(&a.model, registry)?;
        Ok(crate::session::generator(loaded.model, &a.model))
    };
    let drafter = |seed: u64| -> Result<Box<dyn mlex_generate::Drafter>> {
        use mlex_generate::{ScriptedDrafter, Spoil};
        if mtp {
            // The head drafts for real (its time counts); the coins decide.
            return Ok(Box::new(mlex_generate::ForcedKeep::new(
                Box::new(mlex_generate::MtpDrafter::new()),
                acc,
                seed,
            )));
        }
        Ok(Box::new(if a.force_acceptance {
            ScriptedDrafter::new(
                script.clone(),
                vocab,
                Spoil::Forced { acceptance: acc },
                seed,
            )
        } else {
            ScriptedDrafter::new(
                script.clone(),
                vocab,
                Spoil::Random { acceptance: acc },
                seed,
            )
            .with_oracle(oracle()?)
        }))
    };
    g.speculative = Some((drafter(0)?, k));
    g.generate(prompt, &opts(a.gen.min(16)), &mut |_| Ok(Flow::Continue))?;
    let (mut plain, mut spec, mut peak_plain, mut peak_spec) = (Vec::new(), Vec::new(), 0, 0);
    let mut same = 0;
    let mut last = None;
    for i in 0..a.repeats.max(1) {
        g.speculative = None;
        let r = g.generate(prompt, &opts(a.gen), &mut |_| Ok(Flow::Continue))?;
        plain.push(r.decode_tok_s());
        peak_plain = peak_plain.max(r.peak_memory_bytes);
        g.speculative = Some((drafter(i as u64 + 1)?, k));
        let r = g.generate(prompt, &opts(a.gen), &mut |_| Ok(Flow::Continue))?;
        // In low precision the output may leave the plain one at a near
        // tie (the verify forward rounds its products differently); the
        // bench-only drafter's time (its oracle's) is not counted.
        same += usize::from(r.tokens == plain0.tokens);
        // The scripted drafter's time is the bench's; an MTP head's is real.
        let draft_s = match mtp {
            true => 0.0,
            false => r.speculative.as_ref().map_or(0.0, |s| s.draft_s),
        };
        spec.push((r.tokens.len() - 1) as f64 / (r.decode_s - draft_s).max(1e-9));
        peak_spec = peak_spec.max(r.peak_memory_bytes);
        last = r.speculative;
    }
    g.speculative = None;
    let ratios: Vec<f64> = spec.iter().zip(&plain).map(|(s, p)| s / p).collect();
    let fields = json!({
        "prompt_tokens": prompt.len(),
        "generated_tokens": a.gen,
        "draft_tokens": k,
        "draft_acceptance": acc,
        "forced_acceptance": a.force_acceptance,
        "plain_decode_tok_s": spread(&plain),
        "speculative_decode_tok_s": spread(&spec),
        "speedup": spread(&ratios),
        "plain_peak_memory_bytes": peak_plain,
        "peak_memory_bytes": peak_spec,
        "speculative": last.as_ref().map(super::generate::speculative_json),
        "runs_equal_to_plain": same,
    });
    let out = report(a, arch, g, fields)?;
    println!("{out}");
    Ok(())
}

/// `--verify-cost`: seconds of one verify forward over T tokens (T =
/// 1..=8) against one decode step, after the prompt.
fn run_verify_cost(a: &BenchArgs, g: &mut Generator, arch: &str, prompt: &[u32]) -> Result<()> {
    use mlx_rs::transforms::eval;
    use mlx_rs::Array;
    use std::time::Instant;
    let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    let mut base = g.model.make_cache(1)?;
    g.model
        .forward_last(&Array::from_slice(&ids, &[1, ids.len() as i32]), &mut base)?
        .eval()?;
    eval(base.arrays().iter())?;
    let repeats = a.repeats.max(3);
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?; // warm-up (and compilation)
        let mut v = Vec::new();
        for _ in 0..repeats {
            let t0 = Instant::now();
            f()?;
            v.push(t0.elapsed().as_secs_f64());
        }
        v.sort_by(|a, b| a.total_cmp(b));
        Ok(v[v.len() / 2])
    };
    let step_s = {
        let mut run = || -> Result<()> {
            let mut c = base.clone();
            let l = g.decode_step(&Array::from_slice(&[ids[0]], &[1, 1]), &mut c)?;
            l.eval()?;
            eval(c.arrays().iter())?;
            Ok(())
        };
        time(&mut run)?
    };
    let mut rows = Vec::new();
    for t in 1..=8usize {
        let cyc: Vec<i32> = (0..t).map(|i| ids[i % ids.len()]).collect();
        let x = Array::from_slice(&cyc, &[1, t as i32]);
        let mut run = || -> Result<()> {
            let mut c = base.clone();
            let (l, states) = g.verify(&x, &mut c)?;
            l.eval()?;
            c.commit(states, t)?;
            eval(c.arrays().iter())?;
            Ok(())
        };
        let s = time(&mut run)?;
        rows.push(json!({"tokens": t, "verify_s": s, "cost_in_steps": s / step_s}));
    }
    let fields = json!({
        "prompt_tokens": prompt.len(),
        "decode_step_s": step_s,
        "verify": rows,
        "peak_memory_bytes": mlex_core::device::peak_memory()?,
    });
    let out = report(a, arch, g, fields)?;
    println!("{out}");
    Ok(())
}

/// The grammar engine, the schema of `--json-schema` (checked by
/// compiling it once) and the end tokens.
fn grammar_for(
    path: &std::path::Path,
    loaded: &mlex_models::load::LoadedModel,
    vocab: usize,
) -> Result<(
    mlex_generate::Grammars,
    mlex_generate::Grammar,
    std::collections::BTreeSet<u32>,
)> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let schema: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::invalid("--json-schema", format!("{}: {e}", path.display())))?;
    let tok = crate::session::tokenizer_for(loaded)?;
    let engine = mlex_generate::Grammars::new(&tok, vocab)?;
    let grammar = mlex_generate::Grammar::JsonSchema(schema);
    engine
        .compile(&grammar)
        .map_err(|e| Error::invalid("--json-schema", format!("{}: {e}", path.display())))?;
    Ok((engine, grammar, tok.eos_ids.clone()))
}

/// One cold/warm pair of `mlex bench --shared-prefix`.
struct PrefixPair {
    cold_s: f64,
    warm_s: f64,
    reused: usize,
    cache_bytes: usize,
    snapshot_bytes: usize,
    snapshots: usize,
}

/// Prompt `b` cold; then `a` into an empty prompt cache and `b` from it.
fn prefix_pair(g: &mut Generator, a: &[u32], b: &[u32]) -> Result<PrefixPair> {
    let once = |use_prompt_cache| GenerateOptions {
        max_tokens: 1,
        sampler: SamplerConfig::default(),
        stop_ids: Default::default(),
        use_prompt_cache,
        ..Default::default()
    };
    let cold = g.generate(b, &once(false), &mut |_| Ok(Flow::Continue))?;
    g.prompt_cache = mlex_cache::PromptCache::new(8, usize::MAX);
    g.generate(a, &once(true), &mut |_| Ok(Flow::Continue))?;
    let (cache_bytes, snapshot_bytes) = (g.prompt_cache.nbytes(), g.prompt_cache.snapshot_nbytes());
    let snapshots = g
        .prompt_cache
        .snapshot_boundaries()
        .iter()
        .map(Vec::len)
        .sum();
    let warm = g.generate(b, &once(true), &mut |_| Ok(Flow::Continue))?;
    g.prompt_cache = mlex_cache::PromptCache::new(8, usize::MAX);
    Ok(PrefixPair {
        cold_s: cold.prefill_s,
        warm_s: warm.prefill_s,
        reused: warm.reused_tokens,
        cache_bytes,
        snapshot_bytes,
        snapshots,
    })
}

/// Median (the mean of the middle two for an even count), min and max.
fn median_range(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (median, v[0], v[n - 1])
}

/// `mlex bench --shared-prefix N`: time to first token of a prompt sharing
/// `N` tokens with the one before it, restored from the prompt cache, and
/// cold. Every pair uses new random prompts, so nothing is reused across
/// pairs; a first pair (not reported) compiles what both paths run.
fn run_shared_prefix(
    a: &BenchArgs,
    g: &mut Generator,
    arch: &str,
    shared: usize,
    vocab: usize,
) -> Result<()> {
    if shared >= a.prompt_len {
        return Err(Error::invalid(
            "--shared-prefix",
            format!(
                "{shared} must be shorter than --prompt-len {}",
                a.prompt_len
            ),
        ));
    }
    let prompts = |seed: u64| {
        let first = prompt_ids_seeded(a.prompt_len, vocab, 2 * seed + 100);
        let mut second = first[..shared].to_vec();
        let mut tail = prompt_ids_seeded(a.prompt_len - shared, vocab, 2 * seed + 101);
        // Exactly `shared` in common: the tail starts with another token.
        if tail[0] == first[shared] {
            tail[0] = (tail[0] + 1) % vocab as u32;
        }
        second.extend(tail);
        (first, second)
    };
    let (a0, b0) = prompts(0);
    prefix_pair(g, &a0, &b0)?;
    let mut pairs = Vec::new();
    for r in 0..a.repeats.max(1) {
        let (x, y) = prompts(r as u64 + 1);
        pairs.push(prefix_pair(g, &x, &y)?);
    }
    let cold = median_range(pairs.iter().map(|p| p.cold_s).collect());
    let warm = median_range(pairs.iter().map(|p| p.warm_s).collect());
    let p = &pairs[0];
    if a.format == Format::Text {
        println!("model          {} ({arch})", a.model.model);
        println!(
            "prompt         {} tokens, {shared} shared with the one before",
            a.prompt_len
        );
        println!(
            "cold           first token after {:.3} s ({:.3}-{:.3})",
            cold.0, cold.1, cold.2
        );
        println!(
            "warm           first token after {:.3} s ({:.3}-{:.3}), {} tokens reused",
            warm.0, warm.1, warm.2, p.reused
        );
        println!(
            "prompt cache   {:.1} MB for the first prompt, {:.1} MB of it in {} checkpoints",
            p.cache_bytes as f64 / 1e6,
            p.snapshot_bytes as f64 / 1e6,
            p.snapshots
        );
    }
    let fields = json!({
        "prompt_tokens": a.prompt_len,
        "shared_tokens": shared,
        "reused_tokens": p.reused,
        "pairs": pairs.len(),
        "ttft_cold_s": cold.0,
        "ttft_cold_range_s": [cold.1, cold.2],
        "ttft_warm_s": warm.0,
        "ttft_warm_range_s": [warm.1, warm.2],
        "prompt_cache_bytes": p.cache_bytes,
        "checkpoint_bytes": p.snapshot_bytes,
        "checkpoints": p.snapshots,
    });
    let out = report(a, arch, g, fields)?;
    if a.format == Format::Json {
        println!("{out}");
    }
    Ok(())
}

/// What one collective of a decode step costs on `model`'s group (none on
/// one device): the median
/// wall time of an evaluated `all_sum` of one token's hidden state (the
/// products' join, two a layer) and of an `all_gather` of the same, over
/// 50 calls after 5 to warm up.
fn collective_cost(model: &mlex_core::model::Model) -> Result<serde_json::Value> {
    let Some(shard) = &model.dispatch.tensor_parallel else {
        return Ok(serde_json::Value::Null);
    };
    let (hidden, dtype) = (model.embed.dim, model.dtype);
    let x = mlx_rs::Array::ones::<f32>(&[1, hidden])?.as_dtype(dtype)?;
    let median_us = |f: &dyn Fn() -> Result<mlx_rs::Array>| -> Result<f64> {
        let mut t = Vec::with_capacity(50);
        for i in 0..55 {
            let start = std::time::Instant::now();
            f()?.eval()?;
            if i >= 5 {
                t.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    };
    Ok(json!({
        "hidden": hidden,
        "all_sum_us": median_us(&|| shard.all_sum(&x))?,
        "all_gather_us": median_us(&|| shard.all_gather(&x))?,
    }))
}

/// A run's report for `bench --format json`: what ran where (model,
/// memory now, architecture, device, backend, dispatch, compiled), then
/// `fields`.
pub(super) fn report(
    a: &BenchArgs,
    arch: &str,
    g: &Generator,
    fields: serde_json::Value,
) -> Result<serde_json::Value> {
    let info = mlex_core::device::runtime_info()?;
    let mut out = json!({
        "model": a.model.model,
        "memory": mlex_core::device::MemoryReport::now()?.to_json(),
        "arch": arch,
        "device": info.default_device,
        "backend": info.backend.to_string(),
        "dispatch": g.model.dispatch.to_json(),
        "compiled": g.is_compiled(),
    });
    if let (Some(out), serde_json::Value::Object(fields)) = (out.as_object_mut(), fields) {
        out.extend(fields);
    }
    Ok(out)
}
