//! Speculative decoding is plain decoding, faster: greedy output equals the
//! plain greedy output token for token on every architecture's f32 fixture
//! (TOML-defined ones included), for every drafter and k = 1..6, with
//! rejections forced at every draft position; and after a verify forward
//! keeps any prefix of its tokens, every cache holds what plain decode
//! steps over that prefix leave.

use mlex_core::model::{Model, ModelCache};
use mlex_generate::{
    DraftModel, Drafter, Flow, GenerateOptions, Generator, PromptLookup, SamplerConfig,
    ScriptedDrafter, Spoil,
};
use mlex_models::load::load;
use mlex_testkit::*;

fn opts(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        ..Default::default()
    }
}

fn model_of(f: &Fixture) -> Model {
    let registry = mlex_models::build_registry(&f.arch_paths()).unwrap();
    load(path_of(f).to_str().unwrap(), &registry).unwrap().model
}

/// Every f32 fixture that is not quantized: each architecture, each
/// layout (mlx, hf, gguf), the TOML-defined ones.
fn f32_fixtures() -> Vec<Fixture> {
    fixtures()
        .into_iter()
        .filter(|f| f.dtype == "float32" && f.quant.is_none())
        .collect()
}

/// A prompt with repeats, so that prompt lookup finds matches.
fn prompt(vocab: u32) -> Vec<u32> {
    let base = random_ids(7, 6, vocab);
    let mut p = base.clone();
    p.extend(&base[..4]);
    p.extend(random_ids(8, 3, vocab));
    p.extend(&base);
    p
}

fn run(
    g: &mut Generator,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Option<mlex_generate::SpecStats>) {
    let r = g
        .generate(prompt, &opts(n), &mut |_| Ok(Flow::Continue))
        .unwrap();
    (r.tokens, r.speculative)
}

#[test]
fn greedy_speculative_equals_plain_for_every_drafter_and_k() {
    let all = f32_fixtures();
    assert!(
        all.len() >= 30,
        "expected the f32 fixtures, found {}",
        all.len()
    );
    let n = 14;
    for f in &all {
        let model = model_of(f);
        let vocab = model.vocab_size() as u32;
        let p = prompt(vocab);
        // A sliding window that is full cannot take tokens back: there
        // every round is a plain step (olmo3's window is 8).
        let rolls_back = {
            let ids: Vec<i32> = p.iter().map(|&t| t as i32).collect();
            let mut c = model.make_cache(1).unwrap();
            prefill(&model, &mut c, &ids, None);
            c.can_take_back(7)
        };
        let mut g = Generator::new(model, true);
        let (plain, _) = run(&mut g, &p, n);
        let mut script = p.clone();
        script.extend(&plain);
        for k in 1..=6 {
            let d = ScriptedDrafter::new(script.clone(), vocab, Spoil::Cycle, k as u64);
            g.speculative = Some((Box::new(d), k));
            let (spec, stats) = run(&mut g, &p, n);
            let stats = stats.expect("speculative stats");
            assert_same_but_near_ties(
                &g.model,
                &p,
                &plain,
                &spec,
                &format!("{} scripted k={k}", f.name),
            );
            // The cycle spoils each position in turn, and once in k + 1
            // rounds nothing: accepted and rejected drafts both happened.
            if !rolls_back {
                assert_eq!(stats.rounds, 0, "{}: {stats:?}", f.name);
                continue;
            }
            assert!(stats.rounds > 0, "{}: no verify forward ran", f.name);
            assert!(
                stats.accepted < stats.proposed && (k == 1 || stats.accepted > 0),
                "{} k={k}: {stats:?}",
                f.name
            );
        }
        g.speculative = Some((Box::new(PromptLookup::default()), 3));
        let (spec, _) = run(&mut g, &p, n);
        assert_same_but_near_ties(&g.model, &p, &plain, &spec, &format!("{} lookup", f.name));
        for k in [2, 5] {
            let draft = Generator::new(model_of(f), true);
            let d = DraftModel::new(draft, vocab as usize, &f.name).unwrap();
            g.speculative = Some((Box::new(d), k));
            let (spec, stats) = run(&mut g, &p, n);
            assert_same_but_near_ties(
                &g.model,
                &p,
                &plain,
                &spec,
                &format!("{} draft k={k}", f.name),
            );
            // The model drafting for itself is accepted throughout.
            let stats = stats.unwrap();
            assert!(
                !rolls_back || stats.accepted > 0,
                "{} draft k={k}: {stats:?}",
                f.name
            );
        }
        g.speculative = None;
    }
}

fn states(cache: &ModelCache) -> Vec<(String, Vec<f32>, Vec<i32>)> {
    let mut out = Vec::new();
    for (li, layer) in cache.layers.iter().enumerate() {
        for (ci, c) in layer.iter().enumerate() {
            let t = c.to_tensors();
            for (name, a) in t.arrays {
                // Growing caches hold spare rows past their offset.
                let a = if c.grows() {
                    use mlx_rs::ops::indexing::TryIndexOp;
                    a.try_index((.., .., ..c.offset() as i32, ..)).unwrap()
                } else {
                    a
                };
                out.push((
                    format!("layer {li} cache {ci} {name}"),
                    to_f32(&a),
                    a.shape().to_vec(),
                ));
            }
            out.push((
                format!("layer {li} cache {ci} offset"),
                vec![c.offset() as f32],
                vec![1],
            ));
        }
    }
    out
}

#[test]
fn a_verify_forward_keeps_the_state_plain_steps_reach_at_every_position() {
    let names = [
        "qwen3_5-f32",
        "qwen3_next-f32",
        "nemotron_h-f32",
        "dhara-f32",
        "hybrid_mix-f32",
        "llama-f32",
        "olmo3-f32",
    ];
    for name in names {
        let f = fixture(name);
        let model = model_of(&f);
        let vocab = model.vocab_size() as u32;
        // Short, so that a sliding window (olmo3's 8) can take the tokens
        // back.
        let p: Vec<i32> = prompt(vocab)[..2].iter().map(|&t| t as i32).collect();
        let mut base = model.make_cache(1).unwrap();
        prefill(&model, &mut base, &p, None);
        let next: Vec<i32> = random_ids(3, 5, vocab).iter().map(|&t| t as i32).collect();
        for kept in 1..=next.len() {
            let mut spec = base.clone();
            let (_, pos) = model.verify(&tokens(&next), &mut spec).unwrap();
            spec.commit(pos, kept).unwrap();
            let mut plain = base.clone();
            for &t in &next[..kept] {
                model.forward_last(&tokens(&[t]), &mut plain).unwrap();
            }
            let (a, b) = (states(&spec), states(&plain));
            assert_eq!(a.len(), b.len());
            for ((na, va, sa), (_, vb, sb)) in a.iter().zip(&b) {
                assert_eq!(sa, sb, "{name} kept {kept}: {na} shape");
                // Rows of one product against one row at a time: equal up
                // to the BLAS kernel's summation order.
                assert_close(va, vb, 1e-5, &format!("{name} kept {kept}: {na}"));
            }
            // And the next token's logits agree.
            let probe = tokens(&[next[0]]);
            let la = to_f32(&model.forward_last(&probe, &mut spec).unwrap());
            let lb = to_f32(&model.forward_last(&probe, &mut plain).unwrap());
            assert_close(&la, &lb, 1e-4, &format!("{name} kept {kept}: next logits"));
        }
    }
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused_naming_the_option() {
    let f = fixture("llama-f32");
    let draft = Generator::new(model_of(&f), false);
    let vocab = draft.model.vocab_size() as usize;
    let err = DraftModel::new(draft, vocab + 1, "small-model")
        .err()
        .expect("refused")
        .to_string();
    assert_mentions(&err, &["--draft-model", "small-model"]);
}

#[test]
fn prompt_lookup_proposes_what_followed_the_latest_match() {
    let l = PromptLookup::new(3, 1);
    // "1 2 3 9 ... 1 2 3 7 ... 1 2 3": the latest earlier "1 2 3" was
    // followed by 7.
    let ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3];
    assert_eq!(l.lookup(&ctx, 2), vec![7, 8]);
    // The latest match with a full continuation: [4, 4] at the end was
    // last seen at 3..5, which has only one token after it.
    assert_eq!(l.lookup(&[4, 4, 4, 4, 4], 2), vec![4, 4]);
    // No 3-gram or 2-gram match: the 1-gram "5" was followed by 1.
    assert_eq!(l.lookup(&[5, 1, 4, 4, 6, 5], 3), vec![1, 4, 4]);
    assert!(l.lookup(&[1, 2, 3], 4).is_empty());
}

#[test]
fn prompt_lookup_stands_down_when_acceptance_stays_low() {
    let mut l = PromptLookup::default();
    let ctx = [1u32, 2, 3, 4, 5, 6, 7, 1, 2, 3];
    let sampler = mlex_generate::Sampler::new(SamplerConfig::default(), 8).unwrap();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(1);
    let mut propose = |l: &mut PromptLookup| {
        l.propose(mlex_generate::DraftRequest {
            context: &ctx,
            k: 3,
            sampler: &sampler,
            rng: &mut rng,
            model: None,
            hidden: None,
        })
        .unwrap()
        .tokens
        .len()
    };
    for _ in 0..PromptLookup::WINDOW {
        assert_eq!(propose(&mut l), 3);
        l.accepted(0).unwrap();
    }
    for _ in 0..PromptLookup::PAUSE {
        assert_eq!(propose(&mut l), 0, "stood down");
    }
    assert_eq!(propose(&mut l), 3, "tries again after the pause");
    // The loop takes a pause's rounds whole (and runs them pipelined).
    assert_eq!(l.take_idle_rounds(), 0, "not standing down");
    for _ in 0..PromptLookup::WINDOW {
        propose(&mut l);
        l.accepted(0).unwrap();
    }
    assert_eq!(l.take_idle_rounds(), PromptLookup::PAUSE);
    assert_eq!(l.take_idle_rounds(), 0, "handed over once");
    assert_eq!(propose(&mut l), 3, "the handed-over rounds count as passed");
}

/// A drafter that never proposes and stands down every other round for
/// three rounds: decode then mixes the pipelined stretches of a drafter
/// standing down with the plain step a round of an empty proposal.
struct Idle(usize);

impl Drafter for Idle {
    fn name(&self) -> &'static str {
        "idle"
    }
    fn propose(
        &mut self,
        _req: mlex_generate::DraftRequest<'_>,
    ) -> mlex_core::error::Result<mlex_generate::Draft> {
        Ok(mlex_generate::Draft::default())
    }
    fn accepted(&mut self, _n: usize) -> mlex_core::error::Result<()> {
        Ok(())
    }
    fn take_idle_rounds(&mut self) -> usize {
        self.0 += 1;
        if self.0 % 2 == 1 {
            3
        } else {
            0
        }
    }
}

/// Rounds a drafter stands down run as plain decode, pipelined: the same
/// tokens as plain decode, sampled ones included (the same draws in the
/// same order, penalties over the same history), to the last token of the
/// budget, on an attention, a Gated DeltaNet and a Mamba2 hybrid model.
#[test]
fn rounds_standing_down_decode_as_plain_decode_does() {
    for name in ["llama-f32", "qwen3_5-f32", "nemotron_h-f32"] {
        let f = fixture(name);
        let mut g = Generator::new(model_of(&f), true);
        let p = prompt(g.model.vocab_size() as u32);
        for (n, sampler) in [
            (23, SamplerConfig::default()),
            (
                30,
                SamplerConfig {
                    temp: 1.0,
                    repetition_penalty: 1.3,
                    seed: Some(5),
                    ..Default::default()
                },
            ),
        ] {
            let o = GenerateOptions {
                max_tokens: n,
                sampler,
                ..Default::default()
            };
            g.speculative = None;
            let plain = g.generate(&p, &o, &mut |_| Ok(Flow::Continue)).unwrap();
            g.speculative = Some((Box::new(Idle(0)), 3));
            let idle = g.generate(&p, &o, &mut |_| Ok(Flow::Continue)).unwrap();
            assert_eq!(idle.tokens, plain.tokens, "{name}, {n} tokens");
            let s = idle.speculative.expect("speculative stats");
            assert_eq!((s.rounds, s.plain_steps), (0, n - 1), "{name}: {s:?}");
        }
    }
}

#[test]
fn the_prompt_cache_after_speculative_decoding_restores_exactly() {
    // What a speculative generation records serves the next turn as a cold
    // prefill would: the caches it leaves hold exactly the tokens it says.
    for name in ["qwen3_5-f32", "nemotron_h-f32", "llama-f32"] {
        let f = fixture(name);
        let mut g = Generator::new(model_of(&f), true);
        g.checkpoint_every = 8;
        let vocab = g.model.vocab_size() as u32;
        let p = prompt(vocab);
        g.speculative = Some((Box::new(PromptLookup::default()), 4));
        let mut o = opts(12);
        o.use_prompt_cache = true;
        let first = g.generate(&p, &o, &mut |_| Ok(Flow::Continue)).unwrap();
        assert!(
            first.speculative.unwrap().rounds > 0,
            "{name}: no verify ran"
        );
        let mut next = p.clone();
        next.extend(&first.tokens);
        next.extend(random_ids(11, 3, vocab));
        let (warm, reused) = g.prompt_logits(&next, true).unwrap();
        assert!(reused > p.len(), "{name}: reused only {reused} tokens");
        let (cold, _) = g.prompt_logits(&next, false).unwrap();
        assert_close(
            &to_f32(&warm),
            &to_f32(&cold),
            1e-5,
            &format!("{name}: restored logits"),
        );
    }
}

/// The benchmarks' forced acceptance: every draft kept at 1, none at 0,
/// about the set share in between (rounds keep the drafts before the first
/// spoiled one: mean kept per round `sum_{i=1..k} a^i`), whatever the model
/// would have said; the output at acceptance 0 is the model's own.
#[test]
fn forced_acceptance_keeps_the_set_share_of_drafts() {
    let f = fixture("qwen3_5-f32");
    let mut g = Generator::new(model_of(&f), true);
    let vocab = g.model.vocab_size() as u32;
    let p = prompt(vocab);
    let (plain, _) = run(&mut g, &p, 24);
    let k = 3;
    let mut kept_per_round = Vec::new();
    for (seed, acceptance) in [(1u64, 1.0), (2, 0.0), (3, 0.7)] {
        let d = ScriptedDrafter::new(p.clone(), vocab, Spoil::Forced { acceptance }, seed);
        g.speculative = Some((Box::new(d), k));
        let (out, stats) = run(&mut g, &p, 400);
        let s = stats.expect("speculative stats");
        assert!(s.rounds > 20, "{s:?}");
        kept_per_round.push(s.accepted as f64 / s.rounds as f64);
        if acceptance == 0.0 {
            // Nothing kept: the plain output (a near tie may break apart
            // between a verify's and a step's products, as in the
            // exactness test).
            assert_same_but_near_ties(&g.model, &p, &plain, &out[..24], "forced acceptance 0");
        }
    }
    let expected = 0.7 + 0.49 + 0.343;
    assert!(
        (kept_per_round[0] - k as f64).abs() < 0.1,
        "{kept_per_round:?}"
    );
    assert_eq!(kept_per_round[1], 0.0);
    assert!(
        (kept_per_round[2] - expected).abs() < 0.25,
        "{kept_per_round:?} against {expected}"
    );
}

/// The multi-token-prediction head drafts (`--mtp`): greedy output equals
/// plain, compiled and eager, for k = 1..6, and sampling runs the rule over
/// its distributions; on a random head acceptance means nothing, so the
/// rounds, not the rate, are checked.
#[test]
fn greedy_mtp_speculation_equals_plain() {
    let with = fixtures_where(|f| f.mtp_reference.is_some());
    assert_eq!(with.len(), 3, "two Hugging Face checkpoints and a GGUF");
    let dispatch = mlex_models::dispatch().unwrap();
    for f in &with {
        for compiled in [true, false] {
            let registry = mlex_models::registry().unwrap();
            let model = mlex_models::load::load_with_mtp(
                path_of(f).to_str().unwrap(),
                registry,
                &dispatch,
                true,
            )
            .unwrap()
            .model;
            let p = prompt(model.vocab_size() as u32);
            let mut g = Generator::new(model, compiled);
            let (plain, _) = run(&mut g, &p, 14);
            for k in 1..=6 {
                g.speculative = Some((Box::new(mlex_generate::MtpDrafter::new()), k));
                let (spec, stats) = run(&mut g, &p, 14);
                let stats = stats.expect("speculative stats");
                assert_eq!(stats.drafter, "mtp");
                assert!(stats.rounds > 0, "{}: no verify forward", f.name);
                assert_same_but_near_ties(
                    &g.model,
                    &p,
                    &plain,
                    &spec,
                    &format!("{} mtp k={k} compiled={compiled}", f.name),
                );
            }
            let sampled = GenerateOptions {
                sampler: SamplerConfig {
                    temp: 0.8,
                    seed: Some(3),
                    ..SamplerConfig::default()
                },
                ..opts(12)
            };
            g.speculative = Some((Box::new(mlex_generate::MtpDrafter::new()), 3));
            let r = g
                .generate(&p, &sampled, &mut |_| Ok(Flow::Continue))
                .unwrap();
            assert_eq!(r.tokens.len(), 12);
            assert!(r.speculative.unwrap().rounds > 0);
        }
    }
}

/// The MTP drafter puts each position's state beside the token after it,
/// and chains on its own states: its first two drafts are the reference's
/// (`xtask/py/mtp_ref.py`: the last row's argmax, then the chained row's).
#[test]
fn mtp_drafts_are_the_reference_heads() {
    let dispatch = mlex_models::dispatch().unwrap();
    for f in fixtures().into_iter().filter(|f| f.mtp_reference.is_some()) {
        let registry = mlex_models::registry().unwrap();
        let model = mlex_models::load::load_with_mtp(
            path_of(&f).to_str().unwrap(),
            registry,
            &dispatch,
            true,
        )
        .unwrap()
        .model;
        let r: std::collections::HashMap<String, mlx_rs::Array> =
            mlx_rs::Array::load_safetensors(fixtures_dir().join(f.mtp_reference.as_ref().unwrap()))
                .unwrap();
        let prompt: Vec<u32> = to_f32(&r["prompt"]).iter().map(|&x| x as u32).collect();
        let n = prompt.len() as i32 - 1;
        // The target holds prompt[..n]; prompt[n] is the token to verify.
        let ids: Vec<i32> = prompt[..n as usize].iter().map(|&t| t as i32).collect();
        let mut cache = model.make_cache(1).unwrap();
        let x = model.forward_hidden(&tokens(&ids), &mut cache).unwrap();
        let (_, normed) = model
            .output
            .forward_with_normed(&model.params.view(), &x)
            .unwrap();
        let sampler =
            mlex_generate::Sampler::new(SamplerConfig::default(), model.vocab_size() as usize)
                .unwrap();
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(1);
        let mut d = mlex_generate::MtpDrafter::new();
        let draft = d
            .propose(mlex_generate::DraftRequest {
                context: &prompt,
                k: 2,
                sampler: &sampler,
                rng: &mut rng,
                model: Some(&model),
                hidden: Some(&normed),
            })
            .unwrap();
        let chain = to_f32(&r["chain_token"])[0] as u32;
        let second = argmax(&to_f32(&r["chain_logits"])) as u32;
        assert_eq!(draft.tokens, vec![chain, second], "{}", f.name);
    }
}
