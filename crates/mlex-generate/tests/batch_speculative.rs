//! Speculative decoding in the batch is plain decoding one sequence at a
//! time: greedy output equals each prompt's own plain greedy output on
//! every batchable architecture's f32 fixture, with rows whose scripted
//! drafts are rejected at every position in turn beside rows that draft
//! nothing (so rows keep different counts every round and the batch KV
//! cache holds holes), prompts of different lengths, more prompts than
//! slots (sequences join and leave mid-batch), greedy with and without a
//! repetition penalty (the batch-wide argmax and each row's own rule),
//! and windows that cross the end of the batch cache's buffers.

use mlex_generate::{
    BatchGenerator, BatchSpeculation, Draft, DraftRequest, Drafter, Flow, GenerateOptions,
    Generator, SamplerConfig, ScriptedDrafter, Spoil,
};
use mlex_models::load::load;
use mlex_testkit::*;
use std::cell::Cell;
use std::rc::Rc;

fn opts(max_tokens: usize, penalty: f32) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampler: SamplerConfig {
            repetition_penalty: penalty,
            ..SamplerConfig::default()
        },
        stop_ids: Default::default(),
        use_prompt_cache: false,
        ..Default::default()
    }
}

/// Prompts of these lengths, prompt `i` asking for `9 + 4 * (i % 3)` tokens.
const LENGTHS: [usize; 6] = [7, 33, 1, 20, 33, 12];

/// Prompts whose windows cross 256 columns (`mlex_cache::kv::KV_STEP`, where
/// the batch cache's buffers end and grow) after rows have kept different
/// counts, asking for 24 tokens more.
const LONG: [usize; 3] = [240, 236, 238];

/// A drafter that never proposes.
struct Silent;

impl Drafter for Silent {
    fn name(&self) -> &'static str {
        "silent"
    }
    fn propose(&mut self, _req: DraftRequest<'_>) -> mlex_core::error::Result<Draft> {
        Ok(Draft::default())
    }
    fn accepted(&mut self, _n: usize) -> mlex_core::error::Result<()> {
        Ok(())
    }
}

fn check(name: &str, k: usize, penalty: f32) {
    check_lengths(name, k, penalty, &LENGTHS, |i| 9 + 4 * (i % 3));
}

fn check_lengths(
    name: &str,
    k: usize,
    penalty: f32,
    lengths: &[usize],
    max_tokens: fn(usize) -> usize,
) {
    let f = fixture(name);
    let registry = mlex_models::registry().unwrap();
    let model = load(path_of(&f).to_str().unwrap(), registry).unwrap().model;
    let vocab = model.vocab_size() as u32;
    let mut g = Generator::new(model, true);
    g.prefill_chunk = 64;
    let ps: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| random_ids(i as u64 + 11, n, vocab))
        .collect();
    let want: Vec<Vec<u32>> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            g.generate(p, &opts(max_tokens(i), penalty), &mut |_| {
                Ok(Flow::Continue)
            })
            .unwrap()
            .tokens
        })
        .collect();
    // Requests are admitted in the order they were submitted: the i-th
    // drafter made serves prompt i. Every third row drafts nothing.
    let scripts: Vec<Vec<u32>> = ps
        .iter()
        .zip(&want)
        .map(|(p, w)| [p.as_slice(), w.as_slice()].concat())
        .collect();
    let made = Rc::new(Cell::new(0usize));
    let counter = made.clone();
    let make = Box::new(move || -> mlex_core::error::Result<Box<dyn Drafter>> {
        let i = counter.get();
        counter.set(i + 1);
        Ok(if i % 3 == 2 {
            Box::new(Silent)
        } else {
            Box::new(ScriptedDrafter::new(
                scripts[i].clone(),
                vocab,
                Spoil::Cycle,
                i as u64,
            ))
        })
    });
    let mut b = BatchGenerator::new(&mut g, 3).unwrap();
    b.speculate(BatchSpeculation {
        make,
        k,
        max_rows: 8,
    })
    .unwrap();
    for (i, p) in ps.iter().enumerate() {
        b.submit(p.clone(), opts(max_tokens(i), penalty));
    }
    let out = b.run(&mut |_, _| Ok(Flow::Continue)).unwrap();
    let steps = b.stats().steps;
    drop(b);
    assert_eq!(made.get(), ps.len(), "{name}: a drafter per request");
    let mut accepted = 0;
    let mut rounds = 0;
    for (i, (_, r)) in out.into_iter().enumerate() {
        let r = r.unwrap();
        let what = format!("{name} k={k} penalty {penalty} prompt {i}");
        assert_same_but_near_ties(&g.model, &ps[i], &want[i], &r.tokens, &what);
        let s = r.speculative.expect("every row drafts or stands by");
        if i % 3 == 2 {
            assert_eq!(s.proposed, 0, "{what}");
        } else {
            accepted += s.accepted;
            rounds += s.rounds;
            assert!(
                s.accepted < s.proposed,
                "{what}: the cycle rejects some drafts"
            );
        }
    }
    assert!(accepted > 0 && rounds > 0, "{name}: drafts were accepted");
    let total: usize = want.iter().map(Vec::len).sum();
    assert!(
        steps < total / 3 + 8,
        "{name}: {steps} batch steps for {total} tokens in rows of three: rounds kept several tokens"
    );
}

#[test]
fn batched_speculative_greedy_equals_plain_one_at_a_time() {
    for name in [
        "llama-f32",
        "qwen3-f32",
        "qwen3_moe-f32",
        "qwen3_next-f32",
        "qwen3_5-f32",
        "nemotron_h-f32",
        "dhara-f32",
        "olmo2-f32",
        "granite-f32",
        "phi3-f32",
    ] {
        check(name, 3, 1.0);
    }
}

#[test]
fn each_row_judges_by_its_own_rule_under_a_penalty_and_other_k() {
    for name in ["qwen3_5-f32", "nemotron_h-f32", "llama-f32"] {
        check(name, 1, 1.3);
        check(name, 5, 1.3);
    }
}

#[test]
fn windows_past_the_batch_caches_buffers_equal_plain() {
    for name in ["qwen3_5-f32", "llama-f32"] {
        check_lengths(name, 3, 1.0, &LONG, |_| 24);
    }
}
