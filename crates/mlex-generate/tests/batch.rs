//! Batched generation equals one sequence at a time: for every
//! architecture on the f32 fixtures, prompts of different lengths, more
//! prompts than slots (so sequences join while others decode), and a
//! sequence cancelled mid-way; on bf16 and 4-bit, at least 90% of the
//! sequences are identical and the rest diverge only after a near-tie.

use mlex_generate::{
    BatchGenerator, Finish, Flow, GenerateOptions, Generator, SamplerConfig, SeqId,
};
use mlex_models::load::load;
use mlex_testkit::*;

fn opts(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampler: SamplerConfig::default(),
        stop_ids: Default::default(),
        use_prompt_cache: false,
    }
}

fn generator(f: &Fixture, compile: bool) -> Generator {
    let registry = mlex_models::registry().unwrap();
    let loaded = load(path_of(f).to_str().unwrap(), registry).unwrap();
    let mut g = Generator::new(loaded.model, compile);
    g.prefill_chunk = 64;
    g
}

/// Different lengths per prompt, so sequences leave at different steps.
fn max_tokens(i: usize) -> usize {
    6 + 3 * (i % 3)
}

fn one_at_a_time(g: &mut Generator, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            g.generate(p, &opts(max_tokens(i)), &mut |_| Ok(Flow::Continue))
                .unwrap()
                .tokens
        })
        .collect()
}

const LENGTHS: [usize; 6] = [7, 33, 1, 20, 33, 12];

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    LENGTHS
        .iter()
        .enumerate()
        .map(|(i, &n)| random_ids(i as u64 + 1, n, vocab))
        .collect()
}

#[test]
fn batched_greedy_equals_one_at_a_time_on_every_architecture() {
    let names = [
        "llama-f32",
        "qwen2-f32",
        "qwen3-f32",
        "qwen3_moe-f32",
        "qwen3_next-f32",
        "qwen3_next-moe-f32",
        "qwen3_5-f32",
        "qwen3_5_moe-f32",
        "nemotron_h-f32",
        "dhara-f32",
    ];
    for name in names {
        let f = fixture(name);
        for compile in [true, false] {
            let mut g = generator(&f, compile);
            let vocab = g.model.vocab_size() as u32;
            let ps = prompts(vocab);
            let want = one_at_a_time(&mut g, &ps);
            // 3 slots for 6 prompts: the last three join while others decode;
            // prompt 3 is cancelled after its fourth token.
            let mut b = BatchGenerator::new(&mut g, 3).unwrap();
            let ids: Vec<SeqId> = ps
                .iter()
                .enumerate()
                .map(|(i, p)| b.submit(p.clone(), opts(max_tokens(i))))
                .collect();
            let mut seen = vec![0usize; ps.len()];
            let mut joined_late = false;
            let mut out = Vec::new();
            while !b.is_idle() {
                let mut cancel = None;
                let (mut first, mut later) = (false, false);
                out.extend(
                    b.step(&mut |id, _| {
                        seen[id as usize] += 1;
                        if seen[id as usize] == 1 {
                            first = true;
                        } else {
                            later = true;
                        }
                        if id == ids[3] && seen[id as usize] == 4 {
                            cancel = Some(id);
                        }
                        Ok(Flow::Continue)
                    })
                    .unwrap(),
                );
                if let Some(id) = cancel {
                    b.cancel(id);
                }
                joined_late |= first && later;
                assert!(b.stats().peak_active <= 3);
                assert!(b.rows() <= 4, "{name}: the batch stays within its bucket");
            }
            out.sort_by_key(|(id, _)| *id);
            assert_eq!(out.len(), ps.len(), "{name}: every request finishes once");
            for (i, (id, r)) in out.into_iter().enumerate() {
                let r = r.unwrap();
                assert_eq!(id, ids[i]);
                if i == 3 {
                    assert_eq!(r.finish, Finish::Cancelled, "{name}");
                    assert_eq!(
                        r.tokens,
                        want[i][..4],
                        "{name} (compile {compile}): cancelled row"
                    );
                } else {
                    assert_eq!(r.finish, Finish::Length, "{name}");
                    assert_eq!(
                        r.tokens, want[i],
                        "{name} (compile {compile}): prompt {i} of {} tokens",
                        LENGTHS[i]
                    );
                }
            }
            assert!(joined_late, "{name}: some sequence joined mid-batch");
            assert_eq!(
                b.stats().peak_active,
                3,
                "{name}: three sequences decoded together"
            );
        }
    }
}

/// A near-tie: two tokens whose logits differ by less than 2^-5 of the
/// largest logit, eight bf16 steps (bf16 keeps 8 significant bits), well
/// within what a different matrix-product order changes after a few dozen
/// bf16 or 4-bit layers.
const NEAR_TIE: f32 = 1.0 / 32.0;

/// The gap between the logits of `a` and `b` after `tokens`, relative to
/// the largest logit (eager full forward of one sequence).
fn margin(g: &Generator, tokens: &[u32], a: u32, b: u32) -> f32 {
    let mut cache = g.model.make_cache(1).unwrap();
    let x: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    let logits = g
        .model
        .forward_last(
            &mlx_rs::Array::from_slice(&x, &[1, x.len() as i32]),
            &mut cache,
        )
        .unwrap();
    let l = to_f32(&logits);
    let top = l.iter().fold(0f32, |m, v| m.max(v.abs()));
    (l[a as usize] - l[b as usize]).abs() / top
}

/// A TOML-defined architecture (a pattern over the qwen3_next base that
/// matches the fixture's weights: three Gated DeltaNet layers, then
/// attention) batches like the built-ins, with no code of its own.
#[test]
fn a_toml_defined_hybrid_batches_like_the_built_ins() {
    let src = path_of(&fixture("qwen3_next-f32"));
    let dir = copy_with_config(&src, |v| v["model_type"] = "batched_toml_hybrid".into());
    let toml = dir.path().join("batched_toml_hybrid.toml");
    std::fs::write(
        &toml,
        "name = \"batched_toml_hybrid\"\nbase = \"qwen3_next\"\nsummary = \"test\"\n\n[layers]\npattern = [\"gated_delta\", \"gated_delta\", \"gated_delta\", \"attention\"]\n",
    )
    .unwrap();
    let registry = mlex_models::build_registry(&[toml]).unwrap();
    let loaded = load(dir.path().to_str().unwrap(), &registry).unwrap();
    assert_eq!(loaded.model.arch, "batched_toml_hybrid");
    let mut g = Generator::new(loaded.model, true);
    g.prefill_chunk = 64;
    let vocab = g.model.vocab_size() as u32;
    let ps = prompts(vocab);
    let want = one_at_a_time(&mut g, &ps);
    let mut b = BatchGenerator::new(&mut g, 3).unwrap();
    for (i, p) in ps.iter().enumerate() {
        b.submit(p.clone(), opts(max_tokens(i)));
    }
    let got = b.run(&mut |_, _| Ok(Flow::Continue)).unwrap();
    for (i, (_, r)) in got.into_iter().enumerate() {
        assert_eq!(r.unwrap().tokens, want[i], "prompt {i}");
    }
}

#[test]
fn batched_low_precision_mostly_equals_one_at_a_time_and_diverges_only_at_near_ties() {
    let names = [
        "llama-bf16",
        "qwen2-bf16",
        "qwen3-bf16",
        "qwen3_5-bf16",
        "qwen3_next-bf16",
        "nemotron_h-bf16",
        "llama-q4",
        "qwen3-q4",
        "qwen3_moe-q4",
        "qwen3_5-q4",
        "qwen3_next-q4",
        "nemotron_h-q4",
    ];
    let (mut total, mut same) = (0, 0);
    let mut report = Vec::new();
    for name in names {
        let f = fixture(name);
        let mut g = generator(&f, true);
        let vocab = g.model.vocab_size() as u32;
        let ps = prompts(vocab);
        let want = one_at_a_time(&mut g, &ps);
        let mut b = BatchGenerator::new(&mut g, 4).unwrap();
        for (i, p) in ps.iter().enumerate() {
            b.submit(p.clone(), opts(max_tokens(i)));
        }
        let got = b.run(&mut |_, _| Ok(Flow::Continue)).unwrap();
        drop(b);
        for (i, (_, r)) in got.into_iter().enumerate() {
            let r = r.unwrap();
            total += 1;
            if r.tokens == want[i] {
                same += 1;
                continue;
            }
            let k = r
                .tokens
                .iter()
                .zip(&want[i])
                .position(|(a, b)| a != b)
                .expect("same length, different tokens");
            let mut ctx = ps[i].clone();
            ctx.extend(&want[i][..k]);
            let m = margin(&g, &ctx, want[i][k], r.tokens[k]);
            report.push(format!(
                "{name} prompt {i}: diverges at token {k} ({} vs {}), logit gap {m:.4}",
                want[i][k], r.tokens[k]
            ));
            assert!(
                m < NEAR_TIE,
                "{name} prompt {i}: diverged at token {k} without a near-tie (gap {m})"
            );
        }
    }
    eprintln!("batched vs one at a time, bf16 and 4-bit: {same}/{total} identical");
    for line in &report {
        eprintln!("  {line}");
    }
    assert!(
        same * 10 >= total * 9,
        "{same}/{total} identical (want ≥ 90%)"
    );
}

/// The hybrid case that differs on CUDA (a one-token prompt among longer
/// ones, qwen3_next f32), taken apart: the prompt alone in a batch of one,
/// with one longer prompt, with two, compiled and eager. Prints each
/// configuration's tokens against one at a time, then asserts.
#[test]
#[ignore = "diagnoses a CUDA-only difference: run on the GPU machine with --ignored"]
fn one_token_prompt_in_a_hybrid_batch_by_configuration() {
    let f = fixture("qwen3_next-f32");
    let mut bad = Vec::new();
    for compile in [true, false] {
        let mut g = generator(&f, compile);
        let vocab = g.model.vocab_size() as u32;
        let ps = prompts(vocab);
        let want = one_at_a_time(&mut g, &ps);
        for (label, group, slots) in [
            ("alone", vec![2], 1),
            ("with a 7-token prompt", vec![0, 2], 2),
            ("with 7 and 33 tokens", vec![0, 1, 2], 3),
            ("with 7 and 33 tokens, 4 slots", vec![0, 1, 2], 4),
        ] {
            let mut b = BatchGenerator::new(&mut g, slots).unwrap();
            for &i in &group {
                b.submit(ps[i].clone(), opts(max_tokens(i)));
            }
            let got = b.run(&mut |_, _| Ok(Flow::Continue)).unwrap();
            for ((_, r), &i) in got.iter().zip(&group) {
                let r = r.as_ref().unwrap();
                let ok = r.tokens == want[i];
                eprintln!(
                    "compile {compile} {label}: prompt {i} ({} tokens) {}",
                    LENGTHS[i],
                    if ok {
                        "same".to_owned()
                    } else {
                        format!("{:?} vs {:?}", r.tokens, want[i])
                    }
                );
                if !ok {
                    bad.push(format!("compile {compile} {label}: prompt {i}"));
                }
            }
        }
    }
    assert!(bad.is_empty(), "{bad:?}");
}

/// Batched requests that use the prompt cache: the second of two prompts
/// sharing 40 tokens restores the deepest checkpoint before token 40 (every
/// 16 here) and computes only the rest, on a hybrid and on an attention-only
/// model, and both equal cold one-at-a-time runs.
#[test]
fn batched_requests_reuse_a_shared_prefix_through_the_prompt_cache() {
    for name in ["qwen3_5-f32", "llama-f32"] {
        let f = fixture(name);
        let mut g = generator(&f, true);
        g.checkpoint_every = 16;
        let vocab = g.model.vocab_size() as u32;
        let shared = random_ids(77, 40, vocab);
        let mut a = shared.clone();
        a.extend(random_ids(78, 9, vocab));
        let mut b = shared.clone();
        b.extend(random_ids(79, 13, vocab));
        let want = one_at_a_time(&mut g, &[a.clone(), b.clone()]);
        let cached = |n| GenerateOptions {
            use_prompt_cache: true,
            ..opts(n)
        };
        let mut e = BatchGenerator::new(&mut g, 4).unwrap();
        e.submit(a.clone(), cached(max_tokens(0)));
        let first = e.run(&mut |_, _| Ok(Flow::Continue)).unwrap();
        e.submit(b.clone(), cached(max_tokens(1)));
        let second = e.run(&mut |_, _| Ok(Flow::Continue)).unwrap();
        let (ra, rb) = (first[0].1.as_ref().unwrap(), second[0].1.as_ref().unwrap());
        assert_eq!(ra.reused_tokens, 0, "{name}");
        assert_eq!(ra.tokens, want[0], "{name}");
        // Recurrent state restores at a checkpoint (32); KV trims anywhere (40).
        let expect = if name.starts_with("qwen3_5") { 32 } else { 40 };
        assert_eq!(rb.reused_tokens, expect, "{name}");
        assert_eq!(rb.tokens, want[1], "{name}");
    }
}
