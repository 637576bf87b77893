//! What mlex reads from files a user hands it, one harness per format, each
//! taking arbitrary bytes and required never to panic: bad input is an
//! error (`mlex_core::error::Error`) naming the file. The cargo-fuzz targets in
//! `fuzz/` (nightly) call these; `tests/corpus.rs` replays every input
//! saved under `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/` on
//! stable, so whatever fuzzing found stays fixed.

#![deny(missing_docs)]

use mlex_generate::{ChatTemplate, Message, Tokenizer};
use std::path::{Path, PathBuf};

/// A scratch file holding `data`, removed on drop.
struct Scratch {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn scratch(name: &str, data: &[u8]) -> Scratch {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join(name);
    std::fs::write(&path, data).expect("a scratch file");
    Scratch { _dir: dir, path }
}

/// A harness: arbitrary bytes in, no panic out.
pub type Harness = fn(&[u8]);

/// Every harness, by target name.
pub const TARGETS: &[(&str, Harness)] = &[
    ("gguf_header", gguf_header),
    ("safetensors_header", safetensors_header),
    ("safetensors_index", safetensors_index),
    ("config_json", config_json),
    ("tokenizer_json", tokenizer_json),
    ("chat_template", chat_template),
    ("arch_toml", arch_toml),
    ("model_output", model_output),
];

/// Text a model writes (the server reads it for tool calls in every format
/// and splits off its reasoning), fed in pieces of one, three and 64
/// characters, as a streamed answer arrives cut anywhere.
pub fn model_output(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let tools = vec![mlex_generate::ToolDef {
        name: "f".into(),
        parameters: serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}),
    }];
    let chars: Vec<char> = text.chars().collect();
    for step in [1, 3, 64] {
        for format in mlex_generate::ToolFormat::ALL {
            let mut stream = mlex_generate::ToolCallStream::new(format, tools.clone());
            for piece in chars.chunks(step) {
                let _ = stream.push(&piece.iter().collect::<String>());
            }
            let _ = stream.finish();
            let _ = format.parse(&text, &tools);
        }
        for start in [false, true] {
            let mut split = mlex_generate::ReasoningSplit::new(start);
            for piece in chars.chunks(step) {
                let _ = split.push(&piece.iter().collect::<String>());
            }
            let _ = split.finish();
        }
    }
}

/// A TOML architecture file (`mlex --arch-file`, `$MLEX_ARCH_PATH`),
/// parsed and checked against the registry (`mlex_models::build_registry`).
pub fn arch_toml(data: &[u8]) {
    let f = scratch("arch.toml", data);
    let Ok(registry) = mlex_models::build_registry(std::slice::from_ref(&f.path)) else {
        return;
    };
    // A spec that parses is planned against a config that has every key the
    // built-ins read, so that planning's rules (patterns, MoE choice, value
    // maps, gates) meet fuzzed specs too.
    let config = mlex_core::config::ModelConfig::new(
        serde_json::json!({
            "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
            "layer_norm_epsilon": 1e-5, "vocab_size": 256, "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5, "tie_word_embeddings": true, "num_experts": 4,
            "decoder_sparse_step": 2, "mlp_only_layers": [0], "full_attention_interval": 3,
            "hybrid_override_pattern": "M*E", "layer_types": ["full_attention", "sliding_attention"],
            "sliding_window": 8, "layer_norm_eps": 1e-5, "use_qkv_bias": true,
            "text_config": {"hidden_size": 64}
        }),
        f.path.clone(),
    );
    let file = f.path.display().to_string();
    for item in registry.list().into_iter().filter(|l| l.origin == file) {
        if let Ok(arch) = registry.architecture(&item.name) {
            if let Ok(text) = arch.text_config(&config) {
                let _ = arch.plan(&text);
            }
        }
    }
}

/// A GGUF file end to end (`mlex_models::gguf::load`): header and
/// metadata checks, every tensor's conversion (K-quants included) and the
/// synthesized config.
pub fn gguf_header(data: &[u8]) {
    let f = scratch("model.gguf", data);
    let _ = mlex_models::gguf::load(&f.path);
}

/// Safetensors header validation (`mlex_core::weights::validate_safetensors`).
pub fn safetensors_header(data: &[u8]) {
    let f = scratch("model.safetensors", data);
    let _ = mlex_core::weights::validate_safetensors(&f.path);
}

/// A sharded checkpoint's `model.safetensors.index.json`
/// (`mlex_models::load::load_weights`), beside two small valid shards that
/// it may or may not describe.
pub fn safetensors_index(data: &[u8]) {
    let f = scratch("model.safetensors.index.json", data);
    let dir = f.path.parent().expect("a scratch directory");
    for (i, name) in ["a.weight", "b.weight"].iter().enumerate() {
        let shard = dir.join(format!("model-0000{}-of-00002.safetensors", i + 1));
        let header = format!(r#"{{"{name}":{{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}}}"#);
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[0; 8]);
        std::fs::write(shard, bytes).expect("a scratch shard");
    }
    let _ = mlex_models::load::load_weights(dir);
}

/// `config.json` parsing and every registered architecture's plan for it.
pub fn config_json(data: &[u8]) {
    let f = scratch("config.json", data);
    let Ok(config) = mlex_core::config::ModelConfig::from_file(&f.path) else {
        return;
    };
    let Ok(registry) = mlex_models::registry() else {
        return;
    };
    for entry in registry.list() {
        if entry.what == "architecture" {
            if let Ok(arch) = registry.architecture(&entry.name) {
                let _ = arch.plan(&config);
            }
        }
    }
}

/// `tokenizer.json` loading (`Tokenizer::from_dir`) and a round trip.
pub fn tokenizer_json(data: &[u8]) {
    let f = scratch("tokenizer.json", data);
    let dir: &Path = f.path.parent().expect("in a directory");
    if let Ok(t) = Tokenizer::from_dir(dir) {
        if let Ok(ids) = t.encode("Hello, world! Grüße 東京", false) {
            let _ = t.decode(&ids);
        }
    }
}

/// Chat-template compilation and rendering of a short conversation.
pub fn chat_template(data: &[u8]) {
    let Ok(source) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(t) = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())) {
        let messages = [
            Message::new("system", "be brief"),
            Message::new("user", "hi"),
            Message::new("assistant", "hello"),
            Message::new("user", "and?"),
        ];
        let _ = t.render(&messages, true);
    }
}
