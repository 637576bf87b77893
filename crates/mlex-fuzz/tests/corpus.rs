//! Every saved fuzzing input, replayed on stable: the seeds in
//! `fuzz/corpus/<target>/` and what fuzzing found in
//! `fuzz/regressions/<target>/`. A harness that panics fails the test.

use std::path::{Path, PathBuf};

fn inputs(target: &str) -> Vec<PathBuf> {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut out = Vec::new();
    for dir in ["corpus", "regressions"] {
        if let Ok(entries) = std::fs::read_dir(fuzz.join(dir).join(target)) {
            out.extend(entries.map(|e| e.unwrap().path()).filter(|p| p.is_file()));
        }
    }
    out.sort();
    out
}

#[test]
fn every_saved_input_is_handled_without_a_panic() {
    for (target, harness) in mlex_fuzz::TARGETS {
        let files = inputs(target);
        assert!(!files.is_empty(), "no inputs for `{target}` in fuzz/corpus");
        for f in files {
            let data = std::fs::read(&f).unwrap();
            let run = std::panic::catch_unwind(|| harness(&data));
            assert!(run.is_ok(), "{target} panicked on {}", f.display());
        }
    }
}

/// The seeds are valid inputs: the harnesses' happy paths run too.
#[test]
fn the_seeds_are_accepted() {
    let seed = |t: &str, n: &str| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../fuzz/corpus/{t}/{n}"))
    };
    mlex_models::gguf::validate_gguf(&seed("gguf_header", "tiny.gguf")).unwrap();
    // The hybrid seeds convert whole, so mutations start inside those paths.
    for n in [
        "hybrid-qwen35moe.gguf",
        "hybrid-nemotron_h_moe.gguf",
        "hybrid-qwen3next-legacy.gguf",
    ] {
        let c = mlex_models::gguf::load(&seed("gguf_header", n)).unwrap();
        assert!(!c.weights.names().is_empty(), "{n}");
    }
    mlex_core::weights::validate_safetensors(&seed("safetensors_header", "tiny.safetensors"))
        .unwrap();
    // The index that describes the harness's two shards loads them both.
    let dir = tempfile::tempdir().unwrap();
    let index = std::fs::read(seed("safetensors_index", "valid.json")).unwrap();
    std::fs::write(dir.path().join("model.safetensors.index.json"), index).unwrap();
    for (i, name) in ["a.weight", "b.weight"].iter().enumerate() {
        let header = format!(r#"{{"{name}":{{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}}}"#);
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[0; 8]);
        let shard = dir
            .path()
            .join(format!("model-0000{}-of-00002.safetensors", i + 1));
        std::fs::write(shard, bytes).unwrap();
    }
    let w = mlex_models::load::load_weights(dir.path()).unwrap();
    assert_eq!(w.len(), 2);
}
