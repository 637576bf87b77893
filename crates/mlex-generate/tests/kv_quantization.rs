//! The generation paths under a quantized KV cache (`--kv-bits`) and under
//! a bounded KV window (`--max-kv-size`) keep their invariants: compiled
//! decode equals eager, greedy speculative decoding equals plain (standing
//! down to plain steps once a window would wrap), and a prompt-cache hit
//! gives the logits of a cold prefill in the same pieces. (That the caches themselves equal
//! mlx-lm's is `crates/mlex-models/tests/kv_quantization.rs`.)

use mlex_core::cache::KvQuantization;
use mlex_core::model::Model;
use mlex_generate::{Flow, GenerateOptions, Generator, ScriptedDrafter, Spoil};
use mlex_testkit::*;

/// How the attention caches are made.
#[derive(Clone, Copy, Debug)]
enum Kv {
    /// From the second prefill piece on: every path below meets keys that
    /// were written quantized and keys quantized after the fact.
    Quantized,
    /// 20 tokens: the 10-token prompt fits, decoding wraps the ring.
    Window,
}

fn model_of(f: &Fixture, kv: Kv) -> Model {
    let registry = mlex_models::build_registry(&f.arch_paths()).unwrap();
    let mut m = mlex_models::load::load(path_of(f).to_str().unwrap(), &registry)
        .unwrap()
        .model;
    match kv {
        Kv::Quantized => m.kv_quantization = Some(KvQuantization::new(4, 32, 6).unwrap()),
        Kv::Window => m.max_kv_size = Some(20),
    }
    m
}

fn greedy_tokens(g: &mut Generator, prompt: &[u32], n: usize) -> Vec<u32> {
    let o = GenerateOptions {
        max_tokens: n,
        ..Default::default()
    };
    g.generate(prompt, &o, &mut |_| Ok(Flow::Continue))
        .unwrap()
        .tokens
}

#[test]
fn compiled_speculative_and_restored_paths_agree_under_kv_bits_and_windows() {
    for (name, kv) in ["llama-kvq-f32", "qwen3_5-kvq-f32", "nemotron_h-kvq-f32"]
        .into_iter()
        .flat_map(|n| [(n, Kv::Quantized), (n, Kv::Window)])
    {
        let f = fixture(name);
        let name = format!("{name} {kv:?}");
        let vocab = model_of(&f, kv).vocab_size() as u32;
        let p = random_ids(3, 10, vocab);
        let mut eager = Generator::new(model_of(&f, kv), false);
        let mut compiled = Generator::new(model_of(&f, kv), true);
        assert!(compiled.is_compiled(), "{name}: compiled decode");
        let plain = greedy_tokens(&mut eager, &p, 16);
        assert_eq!(
            greedy_tokens(&mut compiled, &p, 16),
            plain,
            "{name}: compiled != eager"
        );
        let kind = match kv {
            Kv::Quantized => "quantized_kv",
            Kv::Window => "rotating_kv",
        };
        let made = compiled.model.make_cache(1).unwrap().holds_kind(kind);
        assert!(made, "{name}: no {kind} cache");

        let mut script = p.clone();
        script.extend(&plain);
        compiled.speculative = Some((
            Box::new(ScriptedDrafter::new(script, vocab, Spoil::Cycle, 3)),
            3,
        ));
        let r = compiled
            .generate(
                &p,
                &GenerateOptions {
                    max_tokens: 16,
                    ..Default::default()
                },
                &mut |_| Ok(Flow::Continue),
            )
            .unwrap();
        assert_eq!(r.tokens, plain, "{name}: speculative != plain");
        let s = r.speculative.unwrap();
        assert!(s.rounds > 0 && s.accepted < s.proposed, "{name}: {s:?}");
        if let Kv::Window = kv {
            // Rounds that would wrap the ring cannot be taken back.
            assert!(
                s.plain_steps > 0,
                "{name}: no plain steps once the window filled: {s:?}"
            );
        }
        compiled.speculative = None;

        // Which keys a token attended to in full precision depends on the
        // prefill pieces (as in mlx-lm), so a hit is held to a cold run in
        // its own pieces: the restored prefix in one forward, then the
        // rest (mlx-lm's schedule, `prompt[:-1]` then the last token). With
        // checkpoints only at the prompt's end, the prefix's keys were
        // written in one piece by the run that saved them too.
        compiled.checkpoint_every = 0;
        let o = GenerateOptions {
            max_tokens: 8,
            use_prompt_cache: true,
            ..Default::default()
        };
        compiled
            .generate(&p, &o, &mut |_| Ok(Flow::Continue))
            .unwrap();
        let (hit, reused) = compiled.prompt_logits(&p, true).unwrap();
        assert_eq!(reused, p.len() - 1, "{name}: reused");
        let ids: Vec<i32> = p.iter().map(|&t| t as i32).collect();
        let m = &compiled.model;
        let mut cold = m.make_cache(1).unwrap();
        m.forward_hidden(&tokens(&ids[..reused]), &mut cold)
            .unwrap();
        let cold = m.forward_last(&tokens(&ids[reused..]), &mut cold).unwrap();
        let (d, scale) = max_diff(&to_f32(&hit), &to_f32(&cold));
        assert!(
            d <= 1e-5 * scale.max(1.0),
            "{name}: a prompt-cache hit differs by {d}"
        );
    }
}
