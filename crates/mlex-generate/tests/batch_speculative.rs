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
    let sampler = SamplerConfig {
        repetition_penalty: penalty,
        ..Default::default()
    };
    GenerateOptions {
        max_tokens,
        sampler,
        ..Default::default()
    }
}

/// Prompts of these lengths, prompt `i` asking for `9 + 4 * (i % 3)` tokens.
const LENGTHS: [usize; 6] = [7, 33, 1, 20, 33, 12];

/// Prompts whose windows cross 256 columns (`mlex_cache::kv::KV_STEP`, where
/// the batch cache's buffers end and grow) after rows have kept different
/// counts, asking for 24 tokens more.
const LONG: [usize; 3] = [240, 236, 238];

/// Each prompt's plain output one at a time (prompt `i` with `opts(i)`),
/// and the prompt followed by it: the script a drafter can follow.
fn plain_runs(
    g: &mut Generator,
    ps: &[Vec<u32>],
    opts: impl Fn(usize) -> GenerateOptions,
) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let want: Vec<Vec<u32>> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let r = g.generate(p, &opts(i), &mut |_| Ok(Flow::Continue));
            r.unwrap().tokens
        })
        .collect();
    let scripts = ps
        .iter()
        .zip(&want)
        .map(|(p, w)| [p.as_slice(), w.as_slice()].concat())
        .collect();
    (want, scripts)
}

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
    let (want, scripts) = plain_runs(&mut g, &ps, |i| opts(max_tokens(i), penalty));
    // Requests are admitted in the order they were submitted: the i-th
    // drafter made serves prompt i. Every third row drafts nothing.
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
    for name in EACH_KIND_F32
        .into_iter()
        .chain(["olmo2-f32", "granite-f32", "phi3-f32"])
    {
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

/// Runs the MTP drafter it wraps on every proposal and records what it
/// drafted (the context's length and the tokens), but proposes `script`'s
/// continuation instead, spoiled at the second position of every third
/// context length: so rounds keep one, two or all drafts, and the head
/// must take in several committed positions' states at a time.
struct Steered {
    inner: mlex_generate::MtpDrafter,
    script: Vec<u32>,
    vocab: u32,
    log: Log,
}

impl Drafter for Steered {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn wants_hidden(&self) -> bool {
        self.inner.wants_hidden()
    }
    fn propose(&mut self, req: DraftRequest<'_>) -> mlex_core::error::Result<Draft> {
        let n = req.context.len();
        let mut d = self.inner.propose(req)?;
        self.log.borrow_mut().push((n, d.tokens.clone()));
        let end = (n + d.tokens.len()).min(self.script.len());
        d.tokens = self.script[n.min(end)..end].to_vec();
        if n.is_multiple_of(3) && d.tokens.len() > 1 {
            d.tokens[1] = (d.tokens[1] + 1) % self.vocab;
        }
        Ok(d)
    }
    fn accepted(&mut self, n: usize) -> mlex_core::error::Result<()> {
        self.inner.accepted(n)
    }
}

type Log = Rc<std::cell::RefCell<Vec<(usize, Vec<u32>)>>>;

/// The fixture `f`'s model, loaded with its multi-token-prediction head.
fn with_head(f: &Fixture) -> mlex_core::model::Model {
    let dispatch = mlex_models::dispatch().unwrap();
    let registry = mlex_models::registry().unwrap();
    mlex_models::load::load_with_mtp(path_of(f).to_str().unwrap(), registry, &dispatch, true)
        .unwrap()
        .model
}

/// Of the drafts in `a` and `b` made at the same context length: how many
/// positions agree, and how many were compared.
fn agreement(a: &[(usize, Vec<u32>)], b: &[(usize, Vec<u32>)]) -> (usize, usize) {
    let (mut same, mut compared) = (0, 0);
    for (n, tokens) in a {
        if let Some((_, t)) = b.iter().find(|(m, _)| m == n) {
            let k = t.len().min(tokens.len());
            compared += k;
            same += t[..k]
                .iter()
                .zip(&tokens[..k])
                .filter(|(x, y)| x == y)
                .count();
        }
    }
    (same, compared)
}

/// The multi-token-prediction head drafts in the batch (`--mtp` under
/// `--prompts-file` and `mlex serve`): each row reads its own hidden
/// states, kept through plain steps and rounds. Greedy output equals plain
/// one sequence at a time on the two Hugging Face checkpoints and the GGUF
/// with a head, beside rows that draft nothing and rows that ask for the
/// prompt cache (MTP rows prefill on their own); and, with its proposals
/// steered onto the plain output so that rounds keep several tokens, each
/// row's head drafts what it drafts for that sequence alone at the same
/// context (near ties aside), which a row reading another row's or a
/// shifted position's states would not give.
#[test]
fn batched_mtp_drafts_from_each_rows_own_states_and_equals_plain() {
    let with = fixtures_where(|f| f.mtp_reference.is_some());
    assert_eq!(with.len(), 3, "two Hugging Face checkpoints and a GGUF");
    for f in &with {
        let model = with_head(f);
        let vocab = model.vocab_size() as u32;
        let mut g = Generator::new(model, true);
        let ps: Vec<Vec<u32>> = [9usize, 21, 4, 15, 30]
            .iter()
            .enumerate()
            .map(|(i, &n)| random_ids(i as u64 + 40, n, vocab))
            .collect();
        let row_opts = |i: usize| GenerateOptions {
            use_prompt_cache: i == 1 || i == 2,
            ..opts(10 + 3 * (i % 2), 1.0)
        };
        let (want, scripts) = plain_runs(&mut g, &ps, |i| GenerateOptions {
            use_prompt_cache: false,
            ..row_opts(i)
        });
        let steered = move |script: &Vec<u32>, log: &Log| Steered {
            inner: mlex_generate::MtpDrafter::new(),
            script: script.clone(),
            vocab,
            log: log.clone(),
        };
        let mut alone: Vec<Log> = Vec::new();
        for (i, p) in ps.iter().enumerate() {
            let log = Log::default();
            g.speculative = Some((Box::new(steered(&scripts[i], &log)), 3));
            let plain_opts = GenerateOptions {
                use_prompt_cache: false,
                ..row_opts(i)
            };
            let r = g
                .generate(p, &plain_opts, &mut |_| Ok(Flow::Continue))
                .unwrap();
            let what = format!("{} prompt {i} alone", f.name);
            assert_same_but_near_ties(&g.model, p, &want[i], &r.tokens, &what);
            assert!(r.speculative.unwrap().accepted > 0);
            alone.push(log);
        }
        g.speculative = None;
        let logs: Vec<Log> = ps.iter().map(|_| Log::default()).collect();
        let made = Rc::new(Cell::new(0usize));
        let (counter, row_logs) = (made.clone(), logs.clone());
        let make = Box::new(move || -> mlex_core::error::Result<Box<dyn Drafter>> {
            let i = counter.get();
            counter.set(i + 1);
            Ok(if i == 3 {
                Box::new(Silent)
            } else {
                Box::new(steered(&scripts[i], &row_logs[i]))
            })
        });
        let mut b = BatchGenerator::new(&mut g, 3).unwrap();
        b.speculate(BatchSpeculation {
            make,
            k: 3,
            max_rows: 8,
        })
        .unwrap();
        for (i, p) in ps.iter().enumerate() {
            b.submit(p.clone(), row_opts(i));
        }
        let out = b.run(&mut |_, _| Ok(Flow::Continue)).unwrap();
        drop(b);
        assert_eq!(made.get(), ps.len(), "{}: a drafter per request", f.name);
        let (mut same, mut compared) = (0, 0);
        for (i, (_, r)) in out.into_iter().enumerate() {
            let r = r.unwrap();
            let what = format!("{} batched mtp prompt {i}", f.name);
            assert_same_but_near_ties(&g.model, &ps[i], &want[i], &r.tokens, &what);
            let s = r.speculative.expect("every row drafts or stands by");
            if i == 3 {
                assert_eq!(s.proposed, 0, "{what}");
                continue;
            }
            assert_eq!(s.drafter, "mtp", "{what}");
            assert!(s.accepted > s.rounds, "{what}: rounds kept several tokens");
            let (s, c) = agreement(&logs[i].borrow(), &alone[i].borrow());
            same += s;
            compared += c;
        }
        assert!(
            compared >= 20,
            "{}: {compared} drafts at shared contexts",
            f.name
        );
        assert!(
            same * 10 >= compared * 9,
            "{}: {same} of {compared} batched drafts are the head's alone",
            f.name
        );
    }
}
