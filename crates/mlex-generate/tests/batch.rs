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
        ..Default::default()
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

/// `prompts` decoded together, at most `rows` at a time (prompt `i` with
/// `max_tokens(i)`): each one's tokens, in order.
fn batched(g: &mut Generator, prompts: &[Vec<u32>], rows: usize) -> Vec<Vec<u32>> {
    let mut b = BatchGenerator::new(g, rows).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        b.submit(p.clone(), opts(max_tokens(i)));
    }
    let got = b.run(&mut |_, _| Ok(Flow::Continue)).unwrap();
    got.into_iter().map(|(_, r)| r.unwrap().tokens).collect()
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
        "stablelm-f32",
        // Not olmo3-f32: sliding-window (rotating) caches do not batch yet,
        // and the batched engine says so (`a rotating_kv cache cannot be
        // split into batch rows`).
        "olmo2-f32",
        "granite-f32",
        "smollm3-f32",
        "phi3-f32",
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
        "model_type = \"batched_toml_hybrid\"\nextends = \"qwen3_next\"\nsummary = \"test\"\n\n[layers]\npattern = [\"gated_delta\", \"gated_delta\", \"gated_delta\", \"attention\"]\n",
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
    let got = batched(&mut g, &ps, 3);
    for (i, tokens) in got.into_iter().enumerate() {
        assert_eq!(tokens, want[i], "prompt {i}");
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
        for (i, tokens) in batched(&mut g, &ps, 4).into_iter().enumerate() {
            total += 1;
            if tokens == want[i] {
                same += 1;
                continue;
            }
            let k = tokens
                .iter()
                .zip(&want[i])
                .position(|(a, b)| a != b)
                .expect("same length, different tokens");
            let mut ctx = ps[i].clone();
            ctx.extend(&want[i][..k]);
            let m = margin(&g, &ctx, want[i][k], tokens[k]);
            report.push(format!(
                "{name} prompt {i}: diverges at token {k} ({} vs {}), logit gap {m:.4}",
                want[i][k], tokens[k]
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

/// A generator of fixture `name` with the prompt cache on, a checkpoint
/// every 16 tokens; the vocabulary size.
fn checkpointing(name: &str) -> (Generator, u32) {
    let mut g = generator(&fixture(name), true);
    g.checkpoint_every = 16;
    let vocab = g.model.vocab_size() as u32;
    (g, vocab)
}

/// Batched requests that use the prompt cache: the second of two prompts
/// sharing 40 tokens restores the deepest checkpoint before token 40 (every
/// 16 here) and computes only the rest, on a hybrid and on an attention-only
/// model, and both equal cold one-at-a-time runs.
#[test]
fn batched_requests_reuse_a_shared_prefix_through_the_prompt_cache() {
    for name in ["qwen3_5-f32", "llama-f32"] {
        let (mut g, vocab) = checkpointing(name);
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

/// Requests the prompt cache covers to within a few tokens feed the rest
/// through the batched decode steps (no prefill of their own): a repeated
/// prompt (one token left: hybrids restore the checkpoint one token before
/// the earlier prompt's end) sampled with a seed, and a prompt extending a
/// cached one by two tokens with a repetition penalty, joining while a
/// fresh greedy prompt decodes, equal cold one-at-a-time runs with the same
/// options, on a hybrid and an attention model.
#[test]
fn prompt_tails_fed_through_the_batch_equal_cold_runs() {
    for name in ["qwen3_5-f32", "llama-f32"] {
        let (mut g, vocab) = checkpointing(name);
        // 50 tokens: 49, where the repeat restores, is no multiple of 16.
        let a = random_ids(81, 50, vocab);
        let mut longer = a.clone();
        longer.extend(random_ids(82, 2, vocab));
        let fresh = random_ids(83, 21, vocab);
        let sampled = GenerateOptions {
            sampler: SamplerConfig {
                temp: 0.8,
                seed: Some(5),
                ..SamplerConfig::default()
            },
            ..opts(12)
        };
        let penalised = GenerateOptions {
            sampler: SamplerConfig {
                repetition_penalty: 1.3,
                ..SamplerConfig::default()
            },
            ..opts(12)
        };
        let cases = [
            (a.clone(), sampled.clone()),
            (longer.clone(), penalised.clone()),
            (fresh.clone(), opts(12)),
        ];
        let want: Vec<Vec<u32>> = cases
            .iter()
            .map(|(p, o)| {
                g.generate(p, o, &mut |_| Ok(Flow::Continue))
                    .unwrap()
                    .tokens
            })
            .collect();
        let cached = |o: &GenerateOptions| GenerateOptions {
            use_prompt_cache: true,
            ..o.clone()
        };
        let mut e = BatchGenerator::new(&mut g, 4).unwrap();
        e.submit(a.clone(), cached(&opts(1)));
        e.run(&mut |_, _| Ok(Flow::Continue)).unwrap();
        let computed_before = e.stats().prefill_tokens;
        let f_id = e.submit(fresh.clone(), opts(12));
        // Two decode steps, then the cached ones join.
        let mut got = Vec::new();
        for _ in 0..2 {
            got.extend(e.step(&mut |_, _| Ok(Flow::Continue)).unwrap());
        }
        let a_id = e.submit(a.clone(), cached(&sampled));
        let l_id = e.submit(longer.clone(), cached(&penalised));
        got.extend(e.run(&mut |_, _| Ok(Flow::Continue)).unwrap());
        let out = |id: SeqId| {
            got.iter()
                .find(|(i, _)| *i == id)
                .map(|(_, r)| r.as_ref().unwrap().clone())
                .unwrap()
        };
        let (ra, rl, rf) = (out(a_id), out(l_id), out(f_id));
        assert_eq!(rf.tokens, want[2], "{name}: fresh");
        assert_eq!(
            ra.tokens, want[0],
            "{name}: repeated prompt, seeded sampling"
        );
        assert_eq!(
            rl.tokens, want[1],
            "{name}: extended prompt, repetition penalty"
        );
        // The repeat restores 49 tokens, the extension the whole cached
        // prompt; each computes only its tail.
        assert_eq!((ra.reused_tokens, rl.reused_tokens), (49, 50), "{name}");
        assert_eq!(
            e.stats().prefill_tokens - computed_before,
            fresh.len() + 1 + 2,
            "{name}"
        );
        // Both tails went through the decode steps, not a prefill.
        assert_eq!(e.stats().tail_tokens, 1 + 2, "{name}");
    }
}

/// Max |a - b| over two arrays of one shape, in f32, relative to the
/// largest |b| (or to 1, when that is smaller).
fn array_diff(a: &mlx_rs::Array, b: &mlx_rs::Array) -> f32 {
    assert_eq!(a.shape(), b.shape(), "shapes differ");
    let (d, m) = max_diff(&to_f32(a), &to_f32(b));
    d / m.max(1.0)
}

/// The largest difference between the per-layer cache states of two
/// batch-1 caches, with the layer and state index where it is.
fn state_diff(a: &mlex_core::model::ModelCache, b: &mlex_core::model::ModelCache) -> (f32, String) {
    let mut worst = (0f32, String::from("none"));
    for (l, (ca, cb)) in a.layers.iter().zip(&b.layers).enumerate() {
        for (k, (x, y)) in ca.iter().zip(cb).enumerate() {
            let (tx, ty) = (x.to_tensors(), y.to_tensors());
            assert_eq!(
                tx.arrays.keys().collect::<Vec<_>>(),
                ty.arrays.keys().collect::<Vec<_>>(),
                "layer {l} cache {k}: tensor names"
            );
            for (s, u) in &tx.arrays {
                let d = array_diff(u, &ty.arrays[s]);
                if d > worst.0 || worst.1 == "none" {
                    worst = (d, format!("layer {l} cache {k} ({}) {s}", x.kind()));
                }
            }
        }
    }
    worst
}

/// A difference measured now or, lazily, after the whole graph is built.
type Measure = Box<dyn Fn() -> (f32, String)>;

/// The checks of one model and mode; failures go to `bad`.
struct Checks<'a> {
    label: String,
    lazy: bool,
    pending: Vec<(String, Measure)>,
    bad: &'a mut Vec<String>,
}

impl Checks<'_> {
    fn check(&mut self, what: &str, f: Measure) {
        self.pending.push((what.to_owned(), f));
        if !self.lazy {
            self.finish();
        }
    }

    /// Measures what is pending, the latest first (the batched decode
    /// before the states it was built from, as the engine evaluates).
    fn finish(&mut self) {
        while let Some((what, f)) = self.pending.pop() {
            let (d, at) = f();
            eprintln!("{}: {what}: {d:.2e} {at}", self.label);
            if d > 1e-4 {
                self.bad
                    .push(format!("{}: {what} differs by {d:.2e} {at}", self.label));
            }
        }
    }
}

/// The building blocks of a batched join, one at a time, on every f32
/// architecture: a one-token and a seven-token prompt fed as one `[2, 1]`
/// forward, a row selected out of that batch, the longer row continued on
/// its own, both written into batch caches and decoded together. The
/// one-token row must equal the same prompt run alone at each step: its
/// logits, every layer's cache tensors, and the next decode step's logits.
/// Checked twice: evaluating after each step, and building the whole graph
/// first and evaluating the batched decode before anything else, as the
/// engine does. On CUDA this holds with `MLX_ENABLE_TF32=0` (at most
/// 3.4e-5 relative on the H200): by default MLX runs float32 products of
/// two or more rows in TF32 (one row stays float32), which moves these
/// logits by up to 9e-2 (`docs/runs/h200-batch-tf32-2026-12-01.log`).
#[test]
fn a_row_taken_out_of_a_batched_forward_equals_its_own_forward() {
    use mlex_cache::BatchKvCache;
    use mlex_core::model::ModelCache;
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::Array;
    let mut bad = Vec::new();
    for name in EACH_KIND_F32 {
        let f = fixture(name);
        let registry = mlex_models::registry().unwrap();
        let model = load(path_of(&f).to_str().unwrap(), registry).unwrap().model;
        let vocab = model.vocab_size() as u32;
        let short = random_ids(3, 1, vocab);
        let long = random_ids(1, 7, vocab);
        let ids = |v: &[u32]| v.iter().map(|&t| t as i32).collect::<Vec<i32>>();

        // Alone: each prompt prefilled, then one decode step.
        let mut alone = model.make_cache(1).unwrap();
        let l1 = model
            .forward_last(&tokens(&ids(&short)), &mut alone)
            .unwrap();
        let t1 = argmax(&to_f32(&l1));
        let alone_prefilled = alone.clone();
        let l2 = model.forward_last(&tokens(&[t1]), &mut alone).unwrap();
        let mut c = model.make_cache(1).unwrap();
        let tl = argmax(&to_f32(
            &model.forward_last(&tokens(&ids(&long)), &mut c).unwrap(),
        ));

        for lazy in [false, true] {
            let mode = if lazy { "lazy" } else { "step by step" };
            let mut checks = Checks {
                label: format!("{name} ({mode})"),
                lazy,
                pending: Vec::new(),
                bad: &mut bad,
            };
            let mut check = |what: &str, f: Measure| checks.check(what, f);

            // Stage one of the staircase: both prompts' first tokens.
            let mut both = model.make_cache(2).unwrap();
            let x = Array::from_slice(&[short[0] as i32, long[0] as i32], &[2, 1]);
            let lb = model.forward_last(&x, &mut both).unwrap();
            let (row0, want) = (lb.try_index(0..1).unwrap(), l1.clone());
            check(
                "[2,1] forward logits, row 0",
                Box::new(move || (array_diff(&row0, &want), String::new())),
            );
            let mut single = both.clone();
            for c in single.layers.iter_mut().flatten() {
                c.select_rows(&[0]).unwrap();
            }
            let (a, b) = (single.clone(), alone_prefilled.clone());
            check("selected row 0 state", Box::new(move || state_diff(&a, &b)));
            for c in both.layers.iter_mut().flatten() {
                c.select_rows(&[1]).unwrap();
            }
            // The longer prompt goes on alone: stage two.
            let rest = Array::from_slice(&ids(&long[1..]), &[1, 6]);
            model.forward_last(&rest, &mut both).unwrap();
            let (a, b) = (single.clone(), alone_prefilled.clone());
            check(
                "selected row 0 state after stage two",
                Box::new(move || state_diff(&a, &b)),
            );
            let mut copy = single.clone();
            let ls = model.forward_last(&tokens(&[t1]), &mut copy).unwrap();
            let want = l2.clone();
            check(
                "decode from the selected row",
                Box::new(move || (array_diff(&ls, &want), String::new())),
            );

            // Both written into batch caches (the long prompt in row 0) and
            // decoded together.
            let mut layers = Vec::new();
            for slot in &model.layers {
                let mut caches = slot.layer.make_caches(2, model.dtype).unwrap();
                for c in caches.iter_mut().filter(|c| c.grows()) {
                    *c = Box::new(BatchKvCache::new(2));
                }
                layers.push(caches);
            }
            let mut batch = ModelCache { layers };
            for (bc, (lc, sc)) in batch
                .layers
                .iter_mut()
                .zip(both.layers.iter().zip(&single.layers))
            {
                for (b, (l, s)) in bc.iter_mut().zip(lc.iter().zip(sc)) {
                    b.write_row(0, l.as_ref()).unwrap();
                    b.write_row(1, s.as_ref()).unwrap();
                }
            }
            let x = Array::from_slice(&[tl, t1], &[2, 1]);
            let lb = model.forward_last(&x, &mut batch).unwrap();
            let (row1, want) = (lb.try_index(1..2).unwrap(), l2.clone());
            check(
                "batched decode, row 1",
                Box::new(move || (array_diff(&row1, &want), String::new())),
            );
            checks.finish();
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}
