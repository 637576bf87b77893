//! Prefix reuse at any divergence point: a prompt that shares `d` tokens
//! with an earlier one restores the deepest recurrent-state checkpoint at or
//! before `d` (any `d` for attention-only models, whose KV caches trim
//! anywhere), re-feeds the rest, and continues exactly as a cold prefill:
//! logits at the last prompt token within 1e-5 (f32) and the same greedy
//! tokens, on every architecture.

use mlex_generate::{Flow, GenerateOptions, Generator};
use mlex_models::load::load;
use mlex_testkit::*;

fn opts(max_tokens: usize, use_prompt_cache: bool) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        use_prompt_cache,
        ..Default::default()
    }
}

fn generator(f: &Fixture, checkpoint_every: usize) -> Generator {
    let registry = mlex_models::registry().unwrap();
    let loaded = load(path_of(f).to_str().unwrap(), registry).unwrap();
    let mut g = Generator::new(loaded.model, false);
    g.checkpoint_every = checkpoint_every;
    // Prefill steps that do not line up with the checkpoints.
    g.prefill_chunk = 100;
    g
}

fn run(g: &mut Generator, prompt: &[u32], n: usize, cached: bool) -> mlex_generate::Generation {
    g.generate(prompt, &opts(n, cached), &mut |_| Ok(Flow::Continue))
        .unwrap()
}

/// `base[..d]` followed by other tokens, `len` in all.
fn diverging(base: &[u32], d: usize, len: usize, vocab: u32) -> Vec<u32> {
    let mut q = base[..d].to_vec();
    let mut tail = random_ids(1000 + d as u64, len - d, vocab);
    if tail[0] == base[d] {
        tail[0] = (tail[0] + 1) % vocab;
    }
    q.extend(tail);
    q
}

#[test]
fn a_prompt_diverging_anywhere_continues_as_a_cold_prefill() {
    let all = fixtures();
    let names = [
        "qwen3_5-f32",
        "qwen3_5_moe-f32",
        "qwen3_next-f32",
        "qwen3_next-moe-f32",
        "nemotron_h-f32",
        "dhara-f32",
        "llama-f32",
        "qwen2-f32",
        "qwen3-f32",
        "qwen3_moe-f32",
        "stablelm-f32",
        // Not olmo3-f32: its sliding-window (rotating) caches have dropped
        // the start of the prompt, so no prefix of it is reused (its cold
        // and warm runs agree; there is no reuse to check).
        "olmo2-f32",
        "granite-f32",
        "smollm3-f32",
        "phi3-f32",
    ];
    let c = 64;
    for name in names {
        let f = all
            .iter()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("fixture {name}"));
        let mut warm = generator(f, c);
        let vocab = warm.model.vocab_size() as u32;
        let recurrent = warm.model.make_cache(1).unwrap().has_fixed_state();
        let base = random_ids(7, 300, vocab);
        // Inside the first chunk (token 1), inside a chunk, on a chunk
        // boundary, just past one, and at the last token (where the
        // checkpoint one token before the earlier prompt's end serves).
        for d in [1, 37, 64, 130, 299] {
            warm.prompt_cache = mlex_cache::PromptCache::new(8, 1 << 30);
            run(&mut warm, &base, 2, true);
            let q = diverging(&base, d, 300, vocab);
            let mut cold = generator(f, c);
            // Logits at the last prompt token, restored against cold.
            let (restored, reused) = warm.prompt_logits(&q, true).unwrap();
            let (fresh, _) = cold.prompt_logits(&q, false).unwrap();
            let (diff, scale) = max_diff(&to_f32(&restored), &to_f32(&fresh));
            assert!(
                diff / scale.max(1.0) <= 1e-5,
                "{name}, divergence at {d}: logits differ by {diff} (largest {scale}), {reused} reused"
            );
            eprintln!(
                "{name}, divergence at {d}: {reused} reused, logits within {:.1e}",
                diff / scale.max(1.0)
            );
            let got = run(&mut warm, &q, 8, true);
            let want = run(&mut cold, &q, 8, false);
            assert_eq!(got.tokens, want.tokens, "{name}, divergence at {d}");
            // Recurrent state restores at a checkpoint: every `c` tokens,
            // and one token before the end of the earlier prompt.
            let deepest = if !recurrent || d == base.len() - 1 {
                d
            } else {
                d / c * c
            };
            assert_eq!(got.reused_tokens, deepest, "{name}, divergence at {d}");
            assert!(got.prompt_tokens - got.reused_tokens < 300 - d + c);
        }
    }
}

/// The case: two 1,000-token prompts that share their first 700
/// tokens, on a hybrid, checkpoints every 256: the second computes at most
/// 300 + 256 tokens and answers as a cold run does.
#[test]
fn a_shared_700_token_prefix_is_not_recomputed() {
    let all = fixtures();
    let f = all
        .iter()
        .find(|f| f.name == "qwen3_5-f32")
        .expect("qwen3_5-f32");
    let mut warm = generator(f, 256);
    let vocab = warm.model.vocab_size() as u32;
    let first = random_ids(3, 1000, vocab);
    run(&mut warm, &first, 4, true);
    let second = diverging(&first, 700, 1000, vocab);
    let got = run(&mut warm, &second, 8, true);
    let want = run(&mut generator(f, 256), &second, 8, false);
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.reused_tokens, 512);
    assert!(got.prompt_tokens - got.reused_tokens <= 300 + 256);
}
