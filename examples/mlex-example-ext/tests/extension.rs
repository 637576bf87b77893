//! A crate outside mlex registers an architecture and a layer kind; the
//! registry lists them with their origin and builds a runnable model.

use mlex_compile::SegmentedDecoder;
use mlex_core::config::ModelConfig;
use mlex_core::model::Model;
use mlex_core::weights::WeightMap;
use mlx_rs::{Array, Dtype};
use serde_json::json;

// Link the example crate (its registrations come with it).
use mlex_example_ext as _;

mod common;

fn toy_weights(hidden: i32, vocab: i32, layers: i32) -> WeightMap {
    let mut w = WeightMap::new();
    let f = w.add_file("in-memory".into());
    for (name, a) in common::toy_tensors(hidden, vocab, layers) {
        w.insert(name, a, f);
    }
    w
}

#[test]
fn external_registrations_are_listed_with_their_origin() {
    let registry = mlex_models::registry().unwrap();
    let list = registry.list();
    let arch = list
        .iter()
        .find(|l| l.name == "toy_ext")
        .expect("toy_ext registered");
    assert_eq!(arch.what, "architecture");
    assert!(
        arch.origin.starts_with("mlex_example_ext"),
        "{}",
        arch.origin
    );
    let kind = list
        .iter()
        .find(|l| l.name == "gated_mlp")
        .expect("gated_mlp registered");
    assert_eq!(kind.what, "layer kind");
    assert!(kind.origin.starts_with("mlex_example_ext"));
    // Ours are still there.
    assert!(list.iter().any(|l| l.name == "qwen3_next"));
}

#[test]
fn the_external_architecture_builds_and_decodes() {
    let registry = mlex_models::registry().unwrap();
    let (hidden, vocab, layers) = (32, 50, 4);
    let config = ModelConfig::new(
        json!({"model_type": "toy_ext", "hidden_size": hidden, "vocab_size": vocab,
               "num_hidden_layers": layers, "num_attention_heads": 4, "rms_norm_eps": 1e-6}),
        "toy/config.json",
    );
    let arch = registry.architecture("toy_ext").unwrap();
    let model = Model::build(
        arch.as_ref(),
        &config,
        toy_weights(hidden, vocab, layers),
        registry,
        &mlex_models::dispatch().unwrap(),
    )
    .unwrap();
    assert_eq!(
        model
            .layers
            .iter()
            .map(|l| l.kind.as_str())
            .collect::<Vec<_>>(),
        ["gated_mlp", "attention", "gated_mlp", "attention"]
    );

    let prompt: Vec<i32> = vec![3, 1, 4, 1, 5, 9, 2, 6];
    let mut cache = model.make_cache(1).unwrap();
    let full = model
        .forward(&Array::from_slice(&prompt, &[1, 8]), &mut cache)
        .unwrap();
    assert_eq!(full.shape(), &[1, 8, vocab]);
    // Incremental (compiled) decode of the same tokens equals the full forward.
    let mut dec = SegmentedDecoder::new(&model);
    let mut cache = model.make_cache(1).unwrap();
    let mut rows = Vec::new();
    for t in &prompt {
        rows.push(
            dec.step(&model, &Array::from_slice(&[*t], &[1, 1]), &mut cache)
                .unwrap(),
        );
    }
    let inc = mlx_rs::ops::stack(&rows, 1).unwrap();
    let d = max_abs_diff(&inc, &full);
    assert!(d < 1e-4, "incremental vs full: {d}");
}

/// A toy_ema model: the toy_ext checkpoint with each `gated_mlp` layer's
/// tensors replaced by an `ema` layer's.
fn toy_ema_model(hidden: i32, vocab: i32, layers: i32) -> Model {
    let registry = mlex_models::registry().unwrap();
    let config = ModelConfig::new(
        json!({"model_type": "toy_ema", "hidden_size": hidden, "vocab_size": vocab,
               "num_hidden_layers": layers, "num_attention_heads": 4, "rms_norm_eps": 1e-6}),
        "toy/config.json",
    );
    let mut w = WeightMap::new();
    let f = w.add_file("in-memory".into());
    let mut n = 100;
    for (name, a) in common::toy_tensors(hidden, vocab, layers) {
        let even = |i: i32| name.starts_with(&format!("layers.{i}."));
        if (0..layers).step_by(2).any(even) {
            continue;
        }
        w.insert(name, a, f);
    }
    for i in (0..layers).step_by(2) {
        n += 1;
        let key = mlx_rs::random::key(n).unwrap();
        let decay = mlx_rs::random::normal::<f32>(&[hidden], None, None, &key).unwrap();
        let key = mlx_rs::random::key(n + 1000).unwrap();
        let out = mlx_rs::random::normal::<f32>(&[hidden, hidden], None, None, &key).unwrap();
        let out = mlx_rs::ops::multiply(&out, Array::from_f32(0.2)).unwrap();
        w.insert(format!("layers.{i}.decay"), decay, f);
        w.insert(format!("layers.{i}.out.weight"), out, f);
    }
    let arch = registry.architecture("toy_ema").unwrap();
    Model::build(
        arch.as_ref(),
        &config,
        w,
        registry,
        &mlex_models::dispatch().unwrap(),
    )
    .unwrap()
}

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    mlx_rs::ops::abs(mlx_rs::ops::subtract(a, b).unwrap())
        .unwrap()
        .max(None)
        .unwrap()
        .as_dtype(Dtype::Float32)
        .unwrap()
        .try_item_exact::<f32>()
        .unwrap()
}

#[test]
fn a_downstream_cache_kind_round_trips_through_a_saved_prompt_cache() {
    use mlex_cache::PromptCache;
    use mlx_rs::ops::indexing::IndexOp;
    let (hidden, vocab, layers) = (32, 50, 4);
    let model = toy_ema_model(hidden, vocab, layers);
    let prompt: Vec<i32> = vec![3, 1, 4, 1, 5, 9, 2, 6];
    let mut cold = model.make_cache(1).unwrap();
    let full = model
        .forward(&Array::from_slice(&prompt, &[1, 8]), &mut cold)
        .unwrap();

    // The first six tokens' caches, saved to disk and loaded into a fresh
    // prompt cache: the `ema` state comes back through its registration.
    let mut cache = model.make_cache(1).unwrap();
    model
        .forward(&Array::from_slice(&prompt[..6], &[1, 6]), &mut cache)
        .unwrap();
    assert_eq!(cache.layers[0][0].kind(), "ema");
    let ids: Vec<u32> = prompt.iter().map(|&t| t as u32).collect();
    let mut saved = PromptCache::new(4, 1 << 30);
    saved.insert(&ids[..6], cache, Vec::new());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompt.safetensors");
    saved.save(&file, "toy").unwrap();
    let mut loaded = PromptCache::new(4, 1 << 30);
    loaded.load(&file, "toy").unwrap();
    let hit = loaded.lookup(&ids).expect("the saved prefix is found");
    assert_eq!(hit.reused, 6);
    assert_eq!(hit.cache.layers[0][0].kind(), "ema");
    let mut restored = hit.cache;
    let rest = model
        .forward(&Array::from_slice(&prompt[6..], &[1, 2]), &mut restored)
        .unwrap();
    let d = max_abs_diff(&rest, &full.index((.., 6.., ..)));
    assert!(d < 1e-5, "restored prefix vs cold prefill: {d}");
    // The state is not a no-op: from a fresh cache the same two tokens differ.
    let mut fresh = model.make_cache(1).unwrap();
    let other = model
        .forward(&Array::from_slice(&prompt[6..], &[1, 2]), &mut fresh)
        .unwrap();
    assert!(max_abs_diff(&other, &full.index((.., 6.., ..))) > 1e-3);
}

#[test]
fn cache_kinds_are_listed_with_their_origin() {
    let list = mlex_models::registry().unwrap().list();
    let ema = list
        .iter()
        .find(|l| l.what == "cache kind" && l.name == "ema")
        .expect("the ema cache kind is registered");
    assert!(ema.origin.starts_with("mlex_example_ext"), "{}", ema.origin);
    for ours in ["kv", "rotating_kv", "gated_delta", "mamba2", "conv_window"] {
        assert!(
            list.iter()
                .any(|l| l.what == "cache kind" && l.name == ours),
            "{ours}"
        );
    }
}

#[test]
fn the_stateful_downstream_kind_decodes_compiled_as_it_prefills() {
    let model = toy_ema_model(32, 50, 4);
    let prompt: Vec<i32> = vec![3, 1, 4, 1, 5, 9, 2, 6];
    let mut cache = model.make_cache(1).unwrap();
    let full = model
        .forward(&Array::from_slice(&prompt, &[1, 8]), &mut cache)
        .unwrap();
    let mut dec = SegmentedDecoder::new(&model);
    let mut cache = model.make_cache(1).unwrap();
    let rows: Vec<Array> = prompt
        .iter()
        .map(|t| {
            dec.step(&model, &Array::from_slice(&[*t], &[1, 1]), &mut cache)
                .unwrap()
        })
        .collect();
    let inc = mlx_rs::ops::stack(&rows, 1).unwrap();
    let d = max_abs_diff(&inc, &full);
    assert!(d < 1e-4, "compiled incremental vs full: {d}");
}
