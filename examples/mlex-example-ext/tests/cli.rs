//! The example crate's own binary is the whole mlex CLI: `list` shows its
//! registrations beside mlex's, and `generate` runs its architecture from a
//! checkpoint on disk.

use assert_cmd::Command;
use mlex_testkit::RunExt;
use mlx_rs::Array;
use serde_json::{json, Value};
use std::collections::HashMap;

mod common;

fn cli() -> Command {
    Command::cargo_bin("mlex-example").unwrap()
}

#[test]
fn the_example_binary_lists_its_registrations() {
    let out = cli().args(["list", "--format", "json"]).ok_stdout();
    let text = String::from_utf8_lossy(&out);
    for name in ["toy_ext", "gated_mlp", "qwen3_5", "attention"] {
        assert!(
            text.contains(&format!("\"{name}\"")),
            "{name} missing from {text}"
        );
    }
    assert!(text.contains("mlex_example_ext"), "origins: {text}");
}

/// A toy_ext checkpoint on disk: hidden 32, vocabulary 50, 4 layers.
fn toy_checkpoint(dir: &std::path::Path) {
    let (hidden, vocab, layers) = (32, 50, 4);
    std::fs::write(
        dir.join("config.json"),
        json!({"model_type": "toy_ext", "hidden_size": hidden, "vocab_size": vocab,
               "num_hidden_layers": layers, "num_attention_heads": 4, "rms_norm_eps": 1e-6})
        .to_string(),
    )
    .unwrap();
    let tensors = common::toy_tensors(hidden, vocab, layers);
    Array::save_safetensors(
        tensors.iter().map(|(n, a)| (n.as_str(), a)),
        &HashMap::<String, String>::new(),
        dir.join("model.safetensors"),
    )
    .unwrap();
}

/// The JSON report of `mlex-example generate` on the checkpoint in `dir`
/// for the prompt 3,1,4,1,5, with `extra` arguments.
fn generate(dir: &std::path::Path, extra: &[&str]) -> Value {
    let out = cli()
        .args(["generate", "--prompt-ids", "3,1,4,1,5", "--format", "json"])
        .args(extra)
        .arg("--model")
        .arg(dir)
        .ok_stdout();
    mlex_testkit::last_json(&out)
}

#[test]
fn the_example_architecture_under_two_ranks_equals_one_device() {
    // mlex's attention layers split their heads; the example's own
    // `gated_mlp` runs whole on every rank (`unsharded` is None).
    let dir = tempfile::tempdir().unwrap();
    toy_checkpoint(dir.path());
    let logits = |tp: &str| -> Vec<f32> {
        let out = dir.path().join(format!("l{tp}.npy"));
        cli()
            .args([
                "logits",
                "--prompt-ids",
                "3,1,4,1,5,9,2,6",
                "--tp",
                tp,
                "--out",
            ])
            .arg(&out)
            .arg("--model")
            .arg(dir.path())
            .assert()
            .success();
        mlex_testkit::to_f32(&Array::load_numpy(&out).unwrap())
    };
    let (one, two) = (logits("1"), logits("2"));
    assert_eq!(one.len(), 8 * 50);
    let (diff, scale) = mlex_testkit::max_diff(&two, &one);
    assert!(
        diff <= 1e-5 * scale.max(1.0),
        "two ranks differ by {diff} (largest {scale})"
    );
    let ids = |tp: &str| {
        generate(
            dir.path(),
            &["--max-tokens", "8", "--temp", "0", "--tp", tp],
        )["token_ids"]
            .clone()
    };
    assert_eq!(ids("2"), ids("1"));
}

#[test]
fn the_example_binary_generates_with_its_architecture() {
    let dir = tempfile::tempdir().unwrap();
    toy_checkpoint(dir.path());
    let vocab = 50;
    let v = generate(dir.path(), &["--max-tokens", "6"]);
    let ids = v["token_ids"].as_array().unwrap();
    assert_eq!(ids.len(), 6, "{v}");
    assert!(
        ids.iter().all(|t| t.as_u64().unwrap() < vocab as u64),
        "{v}"
    );
}
