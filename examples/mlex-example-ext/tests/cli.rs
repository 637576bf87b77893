//! The example crate's own binary is the whole mlex CLI: `list` shows its
//! registrations beside mlex's, and `generate` runs its architecture from a
//! checkpoint on disk.

use assert_cmd::Command;
use mlx_rs::Array;
use serde_json::{json, Value};
use std::collections::HashMap;

mod common;

fn cli() -> Command {
    Command::cargo_bin("mlex-example").unwrap()
}

#[test]
fn the_example_binary_lists_its_registrations() {
    let out = cli()
        .args(["list", "--format", "json"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8_lossy(&out);
    for name in ["toy_ext", "gated_mlp", "qwen3_5", "attention"] {
        assert!(
            text.contains(&format!("\"{name}\"")),
            "{name} missing from {text}"
        );
    }
    assert!(text.contains("mlex_example_ext"), "origins: {text}");
}

#[test]
fn the_example_binary_generates_with_its_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let (hidden, vocab, layers) = (32, 50, 4);
    std::fs::write(
        dir.path().join("config.json"),
        json!({"model_type": "toy_ext", "hidden_size": hidden, "vocab_size": vocab,
               "num_hidden_layers": layers, "num_attention_heads": 4, "rms_norm_eps": 1e-6})
        .to_string(),
    )
    .unwrap();
    let tensors = common::toy_tensors(hidden, vocab, layers);
    Array::save_safetensors(
        tensors.iter().map(|(n, a)| (n.as_str(), a)),
        &HashMap::<String, String>::new(),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let out = cli()
        .args([
            "generate",
            "--prompt-ids",
            "3,1,4,1,5",
            "--max-tokens",
            "6",
            "--format",
            "json",
            "--model",
        ])
        .arg(dir.path())
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let line = String::from_utf8_lossy(&out);
    let v: Value = serde_json::from_str(line.lines().last().unwrap()).unwrap();
    let ids = v["token_ids"].as_array().unwrap();
    assert_eq!(ids.len(), 6, "{v}");
    assert!(
        ids.iter().all(|t| t.as_u64().unwrap() < vocab as u64),
        "{v}"
    );
}
