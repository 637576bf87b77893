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
    let d = mlx_rs::ops::abs(mlx_rs::ops::subtract(&inc, &full).unwrap())
        .unwrap()
        .max(None)
        .unwrap()
        .as_dtype(Dtype::Float32)
        .unwrap()
        .try_item_exact::<f32>()
        .unwrap();
    assert!(d < 1e-4, "incremental vs full: {d}");
}
