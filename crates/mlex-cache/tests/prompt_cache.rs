//! Prefix reuse on real (random-weight) models: a hybrid restores the
//! recurrent state of a shared prefix exactly, an attention-only model
//! trims, the LRU bounds hold, and saved caches refuse another model.

use mlex_cache::{PromptCache, StateSnapshot};
use mlex_core::model::{Model, ModelCache};
use mlex_testkit::*;

fn load(name: &str) -> (Model, Vec<i32>) {
    let f = fixture(name);
    let registry = mlex_models::registry().unwrap();
    let loaded = mlex_models::load::load(path_of(&f).to_str().unwrap(), registry).unwrap();
    (loaded.model, reference(&f).prompt)
}

fn u32s(v: &[i32]) -> Vec<u32> {
    v.iter().map(|&t| t as u32).collect()
}

/// Cache after `tokens`.
fn run(model: &Model, tokens_: &[i32]) -> ModelCache {
    let mut c = model.make_cache(1).unwrap();
    model.forward_last(&tokens(tokens_), &mut c).unwrap();
    c
}

/// Logits of `rest` continuing from `cache`, vs a fresh full forward of
/// `full`: max relative difference.
fn continue_vs_full(model: &Model, mut cache: ModelCache, rest: &[i32], full: &[i32]) -> f32 {
    let a = to_f32(&model.forward_last(&tokens(rest), &mut cache).unwrap());
    let mut fresh = model.make_cache(1).unwrap();
    let b = to_f32(&model.forward_last(&tokens(full), &mut fresh).unwrap());
    let (d, m) = max_diff(&a, &b);
    d / m.max(1.0)
}

#[test]
fn hybrid_prefix_restores_recurrent_state_exactly() {
    let (model, prompt) = load("qwen3_5-f32");
    assert!(
        !model.make_cache(1).unwrap().is_trimmable(),
        "qwen3_5 keeps recurrent state"
    );
    let mut pc = PromptCache::new(4, 1 << 30);
    let a = &prompt[..16];
    pc.insert(
        &u32s(a),
        run(&model, a),
        vec![(8, StateSnapshot::of(&run(&model, &a[..8])))],
    );

    // A longer prompt sharing all of `a`: restore after 16, compute 3.
    let mut b = a.to_vec();
    b.extend([7, 8, 9]);
    let hit = pc.lookup(&u32s(&b)).expect("prefix found");
    assert_eq!(hit.reused, 16);
    assert!(continue_vs_full(&model, hit.cache, &b[16..], &b) < 1e-5);

    // Sharing only 12 tokens: the latest snapshot at or before 12 is 8.
    let mut c = a[..12].to_vec();
    c.extend([1, 2, 3]);
    let hit = pc.lookup(&u32s(&c)).expect("shorter prefix found");
    assert_eq!(hit.reused, 8);
    assert!(continue_vs_full(&model, hit.cache, &c[8..], &c) < 1e-5);

    // The same prompt again: everything but the last token is reused.
    let hit = pc.lookup(&u32s(a)).expect("exact prompt");
    assert_eq!(
        hit.reused, 8,
        "the last token must be recomputed; the latest snapshot before it is 8"
    );
    // Nothing shared: no hit.
    assert!(pc.lookup(&[a[0] as u32 + 1, 5, 6]).is_none());
}

#[test]
fn attention_only_prefix_is_trimmed() {
    let (model, prompt) = load("llama-f32");
    let mut pc = PromptCache::new(4, 1 << 30);
    let a = &prompt[..16];
    pc.insert(&u32s(a), run(&model, a), vec![]);
    let mut c = a[..10].to_vec();
    c.extend([3, 4]);
    let hit = pc.lookup(&u32s(&c)).expect("trimmed hit");
    assert_eq!(hit.reused, 10);
    assert_eq!(hit.cache.offset(), 10);
    assert!(continue_vs_full(&model, hit.cache, &c[10..], &c) < 1e-5);
}

#[test]
fn bounded_by_entries_and_bytes() {
    let (model, prompt) = load("llama-f32");
    let mut pc = PromptCache::new(2, 1 << 30);
    for i in 0..3 {
        let p: Vec<i32> = std::iter::once(i)
            .chain(prompt[1..6].iter().copied())
            .collect();
        pc.insert(&u32s(&p), run(&model, &p), vec![]);
    }
    assert_eq!(pc.len(), 2);
    let first: Vec<u32> = u32s(&[0, prompt[1], prompt[2], 9]);
    assert!(
        pc.lookup(&first).is_none(),
        "the least recently used entry went first"
    );
    let one = run(&model, &prompt[..6]).nbytes();
    let mut small = PromptCache::new(10, one + one / 2);
    small.insert(&u32s(&prompt[..6]), run(&model, &prompt[..6]), vec![]);
    small.insert(
        &u32s(&[1, 2, 3, 4, 5, 6]),
        run(&model, &[1, 2, 3, 4, 5, 6]),
        vec![],
    );
    assert_eq!(small.len(), 1);
    assert!(small.nbytes() <= one + one / 2);
}

#[test]
fn save_and_load_with_fingerprint() {
    let f = fixture("nemotron_h-f32");
    let registry = mlex_models::registry().unwrap();
    let loaded = mlex_models::load::load(path_of(&f).to_str().unwrap(), registry).unwrap();
    let (model, prompt) = (&loaded.model, reference(&f).prompt);
    let mut pc = PromptCache::new(4, 1 << 30);
    let half = prompt.len() / 2;
    pc.insert(
        &u32s(&prompt),
        run(model, &prompt),
        vec![(half, StateSnapshot::of(&run(model, &prompt[..half])))],
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache.safetensors");
    pc.save(&path, &loaded.fingerprint).unwrap();

    let mut back = PromptCache::new(4, 1 << 30);
    back.load(&path, &loaded.fingerprint).unwrap();
    let mut b = prompt.clone();
    b.push(42);
    let hit = back.lookup(&u32s(&b)).expect("restored entry");
    assert_eq!(hit.reused, prompt.len());
    assert!(continue_vs_full(model, hit.cache, &b[prompt.len()..], &b) < 1e-5);
    // The saved snapshot (a recurrent model) restores too.
    let mut c = prompt[..half].to_vec();
    c.push(7);
    let hit = back.lookup(&u32s(&c)).expect("snapshot restored");
    assert_eq!(hit.reused, half);
    assert!(continue_vs_full(model, hit.cache, &c[half..], &c) < 1e-5);

    let err = PromptCache::new(4, 1 << 30)
        .load(&path, "llama-0123456789abcdef")
        .unwrap_err()
        .to_string();
    assert!(err.contains("another model"), "{err}");
    std::fs::write(&path, b"not a safetensors file").unwrap();
    let err = PromptCache::new(4, 1 << 30)
        .load(&path, &loaded.fingerprint)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cache.safetensors"), "{err}");
}

/// Over its byte budget, an entry thins its checkpoints from the oldest,
/// every other one at a time, and keeps the newest: sparse for old context,
/// dense for recent.
#[test]
fn checkpoints_thin_from_the_oldest_under_a_byte_budget() {
    let (model, prompt) = load("qwen3_5-f32");
    let n = 16.min(prompt.len());
    let snaps: Vec<(usize, StateSnapshot)> = (1..8)
        .map(|i| (2 * i, StateSnapshot::of(&run(&model, &prompt[..2 * i]))))
        .collect();
    let one_snapshot = {
        let mut probe = PromptCache::new(1, usize::MAX);
        let full = run(&model, &prompt[..n]);
        let bare = full.nbytes();
        probe.insert(
            &u32s(&prompt[..n]),
            full,
            vec![(2, StateSnapshot::of(&run(&model, &prompt[..2])))],
        );
        probe.nbytes() - bare
    };
    let full = run(&model, &prompt[..n]);
    let budget = full.nbytes() + 4 * one_snapshot;
    let mut pc = PromptCache::new(4, budget);
    pc.insert(&u32s(&prompt[..n]), full, snaps);
    assert_eq!(pc.snapshot_boundaries(), vec![vec![4, 8, 12, 14]]);
    assert!(pc.nbytes() <= budget);
}
