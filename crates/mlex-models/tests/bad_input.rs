//! Bad input gives a clear error naming the file, key or tensor — never a
//! panic or an abort inside MLX — and TOML-defined hybrids build without
//! Rust code.

use mlex_core::error::Error;
use mlex_testkit::*;
use mlx_rs::Array;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A writable copy of a fixture directory.
fn copy_fixture(name: &str) -> (tempfile::TempDir, PathBuf) {
    let f = fixture(name);
    let src = path_of(&f);
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join(name);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    (dir, dst)
}

fn load_err(path: &Path) -> Error {
    let registry = mlex_models::registry().unwrap();
    match mlex_models::load::load(path.to_str().unwrap(), registry) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => e,
    }
}

fn rewrite_weights(path: &Path, f: impl FnOnce(&mut HashMap<String, Array>)) {
    let file = path.join("model.safetensors");
    let mut t = Array::load_safetensors(&file).unwrap();
    f(&mut t);
    std::fs::remove_file(&file).unwrap();
    Array::save_safetensors(t.iter().map(|(k, v)| (k.as_str(), v)), None, &file).unwrap();
    // Keep the index in step, so that the error is the one under test.
    let index = path.join("model.safetensors.index.json");
    if index.exists() {
        let map: serde_json::Map<String, serde_json::Value> = t
            .keys()
            .map(|k| (k.clone(), "model.safetensors".into()))
            .collect();
        let v = serde_json::json!({ "metadata": {}, "weight_map": map });
        std::fs::write(&index, v.to_string()).unwrap();
    }
}

/// Edits the `weight_map` of a sharded fixture's index.
fn edit_index(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let index = dir.join("model.safetensors.index.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    f(v["weight_map"].as_object_mut().unwrap());
    std::fs::write(&index, v.to_string()).unwrap();
}

#[test]
fn an_index_out_of_step_with_its_shards_is_named() {
    let shard = |n: u32| format!("model-0000{n}-of-00003.safetensors");
    let mapped_to = |dir: &Path, n: u32| -> Vec<String> {
        let index = dir.join("model.safetensors.index.json");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(index).unwrap()).unwrap();
        let mut names: Vec<String> = v["weight_map"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(_, f)| f.as_str() == Some(shard(n).as_str()))
            .map(|(k, _)| k.clone())
            .collect();
        names.sort();
        names
    };

    // A shard in the directory that the index leaves out.
    let (_d, dir) = copy_fixture("llama-f32-sharded");
    let third = mapped_to(&dir, 3);
    edit_index(&dir, |m| m.retain(|k, _| !third.contains(k)));
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &["index.json", &shard(3), "does not name"]);

    // A tensor of a shard that the index does not map.
    let (_d, dir) = copy_fixture("llama-f32-sharded");
    let name = mapped_to(&dir, 2)[0].clone();
    edit_index(&dir, |m| {
        m.remove(&name);
    });
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &["index.json", &name, &shard(2)]);

    // The index maps a tensor to the wrong shard.
    let (_d, dir) = copy_fixture("llama-f32-sharded");
    let name = mapped_to(&dir, 1)[0].clone();
    edit_index(&dir, |m| {
        m.insert(name.clone(), shard(2).into());
    });
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &["index.json", &name, &shard(1)]);

    // The index maps a tensor that its shard does not hold.
    let (_d, dir) = copy_fixture("llama-f32-sharded");
    let name = mapped_to(&dir, 1)[0].clone();
    let file = dir.join(shard(1));
    let mut t = Array::load_safetensors(&file).unwrap();
    t.remove(&name);
    std::fs::remove_file(&file).unwrap();
    Array::save_safetensors(t.iter().map(|(k, v)| (k.as_str(), v)), None, &file).unwrap();
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &["index.json", &name, &shard(1), "does not hold"]);

    // A name that leaves the directory is refused, not opened.
    let (_d, dir) = copy_fixture("llama-f32-sharded");
    let name = mapped_to(&dir, 1)[0].clone();
    edit_index(&dir, |m| {
        m.insert(name.clone(), "../model-00001-of-00003.safetensors".into());
    });
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &["index.json", "not a file name"]);

    // Another series of shards beside (a variant with its own index) is
    // not this index's business.
    let (_d, dir) = copy_fixture("llama-f32-sharded");
    std::fs::copy(
        dir.join(shard(1)),
        dir.join("model.fp16-00001-of-00002.safetensors"),
    )
    .unwrap();
    let registry = mlex_models::registry().unwrap();
    mlex_models::load::load(dir.to_str().unwrap(), registry).unwrap();
}

#[test]
fn truncated_and_corrupt_safetensors_name_the_file() {
    let (_d, dir) = copy_fixture("llama-f32");
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &["model.safetensors", "not a valid safetensors"]);
    std::fs::write(&file, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all").unwrap();
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &["model.safetensors", "safetensors"]);
}

#[test]
fn missing_misshaped_and_unexpected_tensors_are_named() {
    let (_d, dir) = copy_fixture("llama-f32");
    rewrite_weights(&dir, |t| {
        t.remove("model.layers.1.mlp.up_proj.weight");
    });
    match load_err(&dir) {
        Error::MissingTensor { name, .. } => assert_eq!(name, "model.layers.1.mlp.up_proj.weight"),
        e => panic!("expected a missing tensor, got {e}"),
    }
    let (_d, dir) = copy_fixture("llama-f32");
    rewrite_weights(&dir, |t| {
        let w = t["model.layers.0.self_attn.k_proj.weight"].clone();
        let flat = mlx_rs::ops::reshape(&w, &[-1]).unwrap();
        t.insert(
            "model.layers.0.self_attn.k_proj.weight".into(),
            mlx_rs::ops::reshape(&flat, &[16, -1]).unwrap(),
        );
    });
    let e = load_err(&dir).to_string();
    assert_mentions(
        &e,
        &["model.layers.0.self_attn.k_proj.weight", "expected shape"],
    );
    assert!(e.contains("model.safetensors"), "{e}");
    let (_d, dir) = copy_fixture("llama-f32");
    rewrite_weights(&dir, |t| {
        t.insert(
            "model.layers.0.surprise.weight".into(),
            Array::from_slice(&[1f32], &[1]),
        );
    });
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &["unexpected tensor", "model.layers.0.surprise.weight"]);
}

#[test]
fn config_errors_name_the_file_and_key() {
    let (_d, dir) = copy_fixture("llama-f32");
    let cfg = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["model_type"] = "gpt9000".into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    let e = load_err(&dir).to_string();
    assert_mentions(
        &e,
        &["unknown model_type `gpt9000`", "config.json", "qwen3_next"],
    );

    v["model_type"] = "llama".into();
    v["hidden_size"] = "wide".into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &["config.json", "hidden_size"]);

    std::fs::write(&cfg, "{ \"model_type\": \"llama\", ").unwrap();
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &["config.json", "line"]);

    std::fs::remove_file(&cfg).unwrap();
    let e = load_err(&dir).to_string();
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn a_missing_shard_is_named() {
    let (_d, dir) = copy_fixture("llama-f32-sharded");
    let shard = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("-of-"))
        .expect("a shard");
    std::fs::remove_file(&shard).unwrap();
    let e = load_err(&dir).to_string();
    assert_mentions(
        &e,
        &[shard.file_name().unwrap().to_str().unwrap(), "index.json"],
    );
}

#[test]
fn truncated_gguf_names_the_file() {
    let f = fixture("gguf-q4_0");
    let bytes = std::fs::read(path_of(&f)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cut.gguf");
    std::fs::write(&p, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let e = load_err(&p).to_string();
    assert_mentions(&e, &["cut.gguf", "GGUF"]);
    std::fs::write(&p, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let e = load_err(&p).to_string();
    assert!(e.contains("cut.gguf"), "{e}");
    std::fs::write(&p, b"not a gguf").unwrap();
    let e = load_err(&p).to_string();
    assert!(e.contains("cut.gguf"), "{e}");
}

/// GGUF headers whose counts, lengths, shapes and offsets were crafted to
/// overflow 64-bit arithmetic or claim more than the file holds: each is
/// an error naming the file (a panic in a debug build, or a wrapped check
/// in a release one, before the checks were checked).
#[test]
fn crafted_gguf_headers_are_errors() {
    fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b
    }
    fn tensor(b: &mut Vec<u8>, dims: &[u64], ty: u32, offset: u64) {
        b.extend(1u64.to_le_bytes());
        b.push(b'w');
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
    }
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    // A metadata key as long as the address space.
    let mut b = header(0, 1);
    b.extend((u64::MAX - 8).to_le_bytes());
    cases.push(("key length", b));
    // A string value of 2^64 - 1 bytes.
    let mut b = header(0, 1);
    b.extend(1u64.to_le_bytes());
    b.push(b'k');
    b.extend(8u32.to_le_bytes());
    b.extend(u64::MAX.to_le_bytes());
    cases.push(("string length", b));
    // Dimensions whose product overflows.
    let mut b = header(1, 0);
    tensor(&mut b, &[1 << 40, 1 << 40], 0, 0);
    cases.push(("element count", b));
    // Elements times bytes per element overflows.
    let mut b = header(1, 0);
    tensor(&mut b, &[1 << 62], 0, 0);
    cases.push(("byte size", b));
    // An offset that wraps past the end check.
    let mut b = header(1, 0);
    tensor(&mut b, &[4], 0, u64::MAX - 2);
    cases.push(("offset", b));
    // A tensor name longer than the file.
    let mut b = header(1, 0);
    b.extend(1_000_000u64.to_le_bytes());
    cases.push(("name length", b));
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("crafted.gguf");
    // Writes `bytes` as crafted.gguf: validating it must fail; the error.
    let refused = |what: &str, bytes: &[u8]| -> String {
        std::fs::write(&p, bytes).unwrap();
        mlex_models::gguf::validate_gguf(&p)
            .err()
            .unwrap_or_else(|| panic!("{what}: accepted"))
            .to_string()
    };
    for (what, bytes) in cases {
        let e = refused(what, &bytes);
        assert!(e.contains("crafted.gguf"), "{what}: {e}");
        let e = load_err(&p).to_string();
        assert!(e.contains("crafted.gguf"), "{what}: {e}");
    }
    // Well-formed descriptors that describe impossible tensors, each with
    // its data present in the file.
    fn named(b: &mut Vec<u8>, name: &str, dims: &[u64], ty: u32, offset: u64) {
        b.extend((name.len() as u64).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
    }
    let padded = |mut b: Vec<u8>| {
        b.resize(b.len().div_ceil(32) * 32 + 4096, 0);
        b
    };
    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    let mut b = header(2, 0);
    named(&mut b, "a", &[16], 0, 0);
    named(&mut b, "b", &[16], 0, 32);
    cases.push(("overlap", padded(b), "overlap"));
    let mut b = header(2, 0);
    named(&mut b, "a", &[8], 0, 0);
    named(&mut b, "a", &[8], 0, 64);
    cases.push(("duplicate", padded(b), "described twice"));
    let mut b = header(1, 0);
    named(&mut b, "a", &[0, 1 << 40], 0, 0);
    cases.push(("empty dimension", padded(b), "empty dimension"));
    let mut b = header(1, 0);
    named(&mut b, "a", &[1 << 16, 1 << 16], 8, 0);
    cases.push(("over 2^31 elements", padded(b), "at most 2^31"));
    for (what, bytes, says) in cases {
        let e = refused(what, &bytes);
        assert!(
            e.contains("crafted.gguf") && e.contains(says),
            "{what}: {e}"
        );
    }
}

#[test]
fn malformed_toml_architectures_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("mine.toml");
    let head = "model_type = \"x\"\nextends = ";
    // A case: the file after `model_type = "x"` and `extends = `, and what
    // the error names (the file's line and column first).
    let cases = [
        // The unclosed array is reported where the file ends.
        (
            "\"qwen3_next\"\n[layers]\npattern = [\"gated_delta\",\n",
            &["mine.toml:5:1"][..],
        ),
        (
            "\"qwen3_next\"\n[layers]\npattern = [\"warp_drive\"]\n",
            &["mine.toml:4:12", "warp_drive", "gated_delta"],
        ),
        (
            "\"nope\"\n[layers]\npattern = [\"attention\"]\n",
            &["mine.toml:2:11", "nope"],
        ),
        (
            "\"llama\"\ncolour = \"red\"\n[layers]\npattern = [\"attention\"]\n",
            &["mine.toml:3:1", "colour"],
        ),
        // An empty pattern points at the empty list.
        (
            "\"llama\"\n[layers]\npattern = []\n",
            &["mine.toml:4:11", "at least one"],
        ),
    ];
    for (rest, needles) in cases {
        std::fs::write(&p, format!("{head}{rest}")).unwrap();
        let e = mlex_models::build_registry(std::slice::from_ref(&p))
            .err()
            .unwrap_or_else(|| panic!("accepted: {rest}"))
            .to_string();
        assert_mentions(&e, needles);
    }
}

/// The text of `path`, relative to this crate's folder (its specs, the
/// workspace's examples).
fn crate_file(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

/// Asserts the checkpoint in `dir`, read with `registry`, is served as
/// `arch` and gives the full-prompt logits of fixture `f`'s mlx-lm
/// reference within 1e-4.
fn assert_reference_logits(
    dir: &Path,
    registry: &mlex_core::registry::Registry,
    f: &Fixture,
    arch: &str,
) {
    let loaded = mlex_models::load::load(dir.to_str().unwrap(), registry).unwrap();
    assert_eq!(loaded.model.arch, arch);
    let r = reference(f);
    let mut cache = loaded.model.make_cache(1).unwrap();
    let logits = loaded
        .model
        .forward(&tokens(&r.prompt), &mut cache)
        .unwrap();
    let what = format!("{arch} and the {} reference", f.name);
    assert_close(&to_f32(&logits), &to_f32(&r.logits_full), 1e-4, &what);
}

#[test]
fn a_toml_hybrid_runs_without_rust_code() {
    // Qwen3-Next weights served by a TOML-defined model_type that spells
    // out the layer pattern: the result must equal mlx-lm's reference.
    let f = fixture("qwen3_next-f32");
    let (_d, dir) = copy_fixture("qwen3_next-f32");
    let cfg = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["model_type"] = "my_hybrid".into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    // The registry with a spec file `file` serving `my_hybrid` as
    // Qwen3-Next with the layer pattern `pattern`.
    let with_spec = |file: &str, pattern: &str| {
        let toml = dir.join(file);
        let spec = "model_type = \"my_hybrid\"\nextends = \"qwen3_next\"\n[layers]\n";
        std::fs::write(&toml, format!("{spec}pattern = [{pattern}]\n")).unwrap();
        mlex_models::build_registry(&[toml]).unwrap()
    };
    let pattern = "\"gated_delta\", \"gated_delta\", \"gated_delta\", \"attention\"";
    let registry = with_spec("my_hybrid.toml", pattern);
    assert_reference_logits(&dir, &registry, &f, "my_hybrid");
    // A pattern that does not match the weights fails strictly.
    let registry = with_spec("wrong.toml", "\"attention\"");
    let e = match mlex_models::load::load(dir.to_str().unwrap(), &registry) {
        Ok(_) => panic!("wrong pattern loaded"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("model.layers.0"), "{e}");
}

#[test]
fn qwen3_5_text_serves_a_flat_text_only_checkpoint() {
    // The qwen3_5 fixture rewritten as a text-only Hugging Face checkpoint:
    // flat config with model_type qwen3_5_text, weights under `model.` and
    // `lm_head`. Same weights, so mlx-lm's qwen3_5 reference applies.
    let f = fixture("qwen3_5-f32");
    let (_d, dir) = copy_fixture("qwen3_5-f32");
    let cfg = dir.join("config.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    let mut text = v["text_config"].clone();
    text["model_type"] = "qwen3_5_text".into();
    std::fs::write(&cfg, text.to_string()).unwrap();
    rewrite_weights(&dir, |t| {
        let old = std::mem::take(t);
        for (k, a) in old {
            let k = k
                .strip_prefix("language_model.")
                .map(str::to_owned)
                .unwrap_or(k);
            t.insert(k, a);
        }
    });
    let registry = mlex_models::registry().unwrap();
    assert_reference_logits(&dir, registry, &f, "qwen3_5_text");
}

/// Counts and sizes out of range (zero heads, a head count that does not
/// divide the width, groups that do not divide the heads, a negative width)
/// and a missing key name the key; none divides by zero.
#[test]
fn out_of_range_counts_in_config_json_name_the_key() {
    // A case: the fixture, its config edits (`key=value`, or `key=` to
    // remove the key), and what the error says; it names the first key.
    #[rustfmt::skip]
    let cases = [
        ("llama-f32",      "num_key_value_heads=3000000000",  "from 1 to 2147483647"),
        ("nemotron_h-f32", "mamba_head_dim=",                 "missing"),
        ("llama-f32",      "num_attention_heads=0",           "from 1"),
        ("llama-f32",      "num_key_value_heads=0",           "from 1"),
        ("llama-f32",      "num_key_value_heads=3",           "multiple"),
        ("llama-f32",      "num_attention_heads=5 num_key_value_heads=5 head_dim=", "do not divide"),
        ("llama-f32",      "hidden_size=-64",                 "from 1"),
        ("llama-f32",      "hidden_size=",                    "missing"),
        ("qwen3_next-f32", "linear_num_key_heads=0",          "from 1"),
        ("nemotron_h-f32", "n_groups=0",                      "from 1"),
        ("nemotron_h-f32", "n_groups=3",                      "do not divide"),
    ];
    for (name, edits, says) in cases {
        let edits: Vec<(&str, &str)> = edits
            .split(' ')
            .map(|e| e.split_once('=').unwrap())
            .collect();
        let dir = copy_with_config(&path_of(&fixture(name)), |v| {
            let config = v.as_object_mut().unwrap();
            for &(k, value) in &edits {
                match value.parse::<i64>() {
                    Ok(n) => config.insert(k.into(), n.into()),
                    Err(_) => config.remove(k),
                };
            }
        });
        let key = edits[0].0;
        let e = load_err(dir.path()).to_string();
        assert!(
            e.contains("config.json") && e.contains(key) && e.contains(says),
            "{name}, {key}: {e}"
        );
    }
}

/// Hand-written safetensors headers: a header length past the end of the
/// file, a shape that claims more bytes than its offsets hold, overlapping
/// offsets, and an integer weight where a float one belongs. Each names
/// the file, and the tensor where there is one.
#[test]
fn crafted_safetensors_headers_and_wrong_dtypes_are_named() {
    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend(header.as_bytes());
        b.extend(std::iter::repeat_n(0u8, data));
        b
    }
    let (_d, dir) = copy_fixture("llama-f32");
    let path = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        std::fs::remove_file(&index).unwrap();
    }
    let cases: [(&str, Vec<u8>, Option<&str>); 3] = [
        (
            "a header longer than the file",
            {
                let mut b = (1u64 << 40).to_le_bytes().to_vec();
                b.extend(b"{}");
                b
            },
            None,
        ),
        (
            "a shape larger than its bytes",
            file(
                r#"{"w":{"dtype":"F32","shape":[1000000,1000000],"data_offsets":[0,16]}}"#,
                16,
            ),
            Some("`w`"),
        ),
        (
            "overlapping offsets",
            file(
                r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#,
                24,
            ),
            Some("`b`"),
        ),
    ];
    for (what, bytes, tensor) in cases {
        std::fs::write(&path, bytes).unwrap();
        let e = mlex_core::weights::validate_safetensors(&path)
            .err()
            .unwrap_or_else(|| panic!("{what}: accepted"))
            .to_string();
        assert!(e.contains("model.safetensors"), "{what}: {e}");
        if let Some(t) = tensor {
            assert!(e.contains(t), "{what}: {e}");
        }
        let e = load_err(&dir).to_string();
        eprintln!("{what}: {e}");
        assert!(e.contains("model.safetensors"), "{what}: {e}");
    }

    // An integer tensor where the model expects floats.
    let (_d2, dir) = copy_fixture("llama-f32");
    let name = "model.layers.0.self_attn.k_proj.weight";
    rewrite_weights(&dir, |t| {
        let w = t[name].as_dtype(mlx_rs::Dtype::Int32).unwrap();
        t.insert(name.to_owned(), w);
    });
    let e = load_err(&dir).to_string();
    assert_mentions(&e, &[name, "floating-point", "model.safetensors"]);
}

#[test]
fn hybrid_gguf_metadata_that_contradicts_itself_names_the_key() {
    for (fixture_name, key) in [
        ("gguf-nemotron_h-q8_0", "nemotron_h.attention.head_count_kv"),
        ("gguf-qwen3_5-q8_0", "qwen35.ssm.time_step_rank"),
    ] {
        let model = path_of(&fixture(fixture_name));
        let short = key.split_once('.').unwrap().1;
        let p = model.with_file_name(format!("broken-{short}.gguf"));
        let e = load_err(&p).to_string();
        assert!(
            e.contains(&format!("broken-{short}.gguf")) && e.contains(key),
            "{fixture_name}: {e}"
        );
    }
}

/// Broken specs fail with where and what: an undeclared `$param` (with the
/// declared ones), an option the layer kind lacks (with its options), a
/// layer pattern that does not cover the config's layer
/// count, a config value of the wrong type (naming the key), a value a map
/// does not know (listing those it does), and a weight template that
/// matches no tensor (with the nearest names the checkpoint has).
#[test]
fn broken_specs_say_where_and_what() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.toml");
    let base = crate_file("../../examples/specs/hybrid_mix.toml");
    let build = |text: &str| {
        std::fs::write(&p, text).unwrap();
        mlex_models::build_registry(std::slice::from_ref(&p))
    };
    // The error of a spec that must not build.
    let refused = |text: &str| build(text).err().expect("the spec built").to_string();
    // Undeclared parameter: located, and the declared ones listed.
    let e = refused(&base.replace("\"$rope_theta\"", "\"$rope_base\""));
    assert_mentions(&e, &["bad.toml:", "rope_base", "rope_theta"]);
    // An option the kind does not have: located, with the kind's options.
    let e = refused(&base.replace("gated = true", "gatd = true"));
    assert_mentions(&e, &["bad.toml:", "no option `gatd`", "gated"]);
    // Block options: an unknown one is located and the block's listed (a
    // mixer's option put in the block says where it goes); a block naming
    // an unregistered mixer, a [blocks.X] no layer is called, and a mixer
    // set for every block are errors too.
    let e = refused(&base.replace("[blocks.mamba2]\n", "[blocks.mamba2]\ngated = true\n"));
    assert_mentions(
        &e,
        &[
            "bad.toml:",
            "blocks.mamba2.gated",
            "ffn_norm",
            "[kinds.<mixer>]",
        ],
    );
    let e = refused(&base.replace("[blocks.mamba2]\n", "[blocks.mamba2]\nmixer = \"mamba3\"\n"));
    assert_mentions(&e, &["mamba3", "blocks.mamba2.mixer", "gated_delta"]);
    let e = refused(&base.replace("[blocks.mamba2]", "[blocks.mamba]"));
    assert_mentions(&e, &["blocks.mamba", "no layer of the pattern"]);
    let e = refused(&base.replace("[block]\n", "[block]\nmixer = \"attention\"\n"));
    assert!(e.contains("block.mixer"), "{e}");
    // The specs below parse; their errors come when a checkpoint is read.
    let f = fixture("hybrid_mix-f32");
    let load_with = |text: &str, edit: &dyn Fn(&mut serde_json::Value)| -> String {
        let registry = build(text).unwrap();
        let model = copy_with_config(&path_of(&f), edit);
        match mlex_models::load::load(model.path().to_str().unwrap(), &registry) {
            Ok(_) => panic!("loaded"),
            Err(e) => e.to_string(),
        }
    };
    let e = load_with(&base, &|v| v["layer_pattern"] = "GMAGM".into());
    assert_mentions(&e, &["layer_pattern", "5 layers", "says 6"]);
    let e = load_with(&base, &|v| v["rope_theta"] = "ten thousand".into());
    assert_mentions(&e, &["config.json", "rope_theta", "expected a number"]);
    let e = load_with(&base, &|v| v["layer_pattern"] = "GMXGMA".into());
    assert_mentions(&e, &["unknown layer `X` at position 2", "known: A, G, M"]);
    // A norm option that is neither a name nor false, and a logit scale of
    // 0, are named when a checkpoint is read.
    let e = load_with(
        &base.replace("mixer_norm = \"norm\"", "mixer_norm = true"),
        &|_| {},
    );
    assert_mentions(&e, &["mixer_norm", "a module name, or false"]);
    let e = load_with(
        &base.replace("[model]\n", "[model]\nlogits_scaling = 0.0\n"),
        &|_| {},
    );
    assert_mentions(&e, &["logits_scaling", "other than 0"]);
    // A weight-name template off by one part: the tensor is named, with the
    // checkpoint's nearest names.
    let e = load_with(
        &base.replace("[kinds.mamba2]", "[kinds.mamba2]\nmixer = \"ssm\""),
        &|_| {},
    );
    assert_mentions(
        &e,
        &[
            "missing tensor `model.layers.1.ssm.",
            "model.layers.1.mixer.",
        ],
    );
}

#[test]
fn a_bad_norm_type_and_unsupported_stablelm_variants_are_named() {
    // An unknown norm in a spec: located, with the choices.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad_norm.toml");
    let base = crate_file("architectures/stablelm.toml")
        .replace("model_type = \"stablelm\"", "model_type = \"stablelm_bad\"");
    std::fs::write(
        &p,
        base.replace(
            "norm_type = \"layer_norm\"\nmax_context",
            "norm_type = \"batch_norm\"\nmax_context",
        ),
    )
    .unwrap();
    let e = mlex_models::build_registry(std::slice::from_ref(&p))
        .err()
        .expect("an unknown norm_type is an error")
        .to_string();
    assert_mentions(&e, &["bad_norm.toml:", "batch_norm", "layer_norm"]);
    // StableLM-2-12B's parallel residual and per-head q/k LayerNorm are
    // refused, naming the key, rather than computed wrongly.
    let f = fixture("stablelm-f32");
    for key in ["use_parallel_residual", "qk_layernorm"] {
        let model = copy_with_config(&path_of(&f), |v| v[key] = true.into());
        let e = load_err(model.path()).to_string();
        assert!(
            e.contains("config.json") && e.contains(key) && e.contains("unsupported value true"),
            "{key}: {e}"
        );
    }
}

/// The spec file that serves `model_type`: a built-in one, or one in the
/// fixture's own spec folder.
fn spec_text_for(f: &Fixture, model_type: &str) -> String {
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("architectures")];
    dirs.extend(f.arch_paths());
    for d in dirs {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                let text = std::fs::read_to_string(&p).unwrap();
                let t: toml::Table = toml::from_str(&text).unwrap();
                let serves = t.get("model_type").and_then(|v| v.as_str()) == Some(model_type)
                    || t.get("also").and_then(|a| a.as_array()).is_some_and(|a| {
                        a.iter().any(|x| {
                            x.get("model_type").and_then(|v| v.as_str()) == Some(model_type)
                        })
                    });
                if serves {
                    return text;
                }
            }
        }
    }
    panic!("no spec serves {model_type}")
}

/// Every parameter a spec (with the ones of the spec it `extends`)
/// declares as a `count` (an integer from 1), with the config key it reads
/// first.
fn count_keys(f: &Fixture, spec: &str) -> Vec<String> {
    let t: toml::Table = toml::from_str(spec).unwrap();
    let mut params = match t.get("extends").and_then(|b| b.as_str()) {
        Some(base) => toml::from_str::<toml::Table>(&spec_text_for(f, base)).unwrap()["params"]
            .as_table()
            .cloned()
            .unwrap_or_default(),
        None => toml::Table::new(),
    };
    for (k, v) in t
        .get("params")
        .and_then(|p| p.as_table())
        .into_iter()
        .flatten()
    {
        params.insert(k.clone(), v.clone());
    }
    let mut keys = Vec::new();
    for (name, p) in &params {
        match p {
            toml::Value::String(ty) if ty == "count" => keys.push(name.clone()),
            toml::Value::Table(full)
                if full.get("type").and_then(|v| v.as_str()) == Some("count") =>
            {
                let key = full
                    .get("keys")
                    .and_then(|k| k.as_array())
                    .and_then(|k| k.first())
                    .or_else(|| full.get("key"))
                    .and_then(|k| k.as_str())
                    .unwrap_or(name.as_str());
                keys.push(key.to_owned());
            }
            _ => {}
        }
    }
    keys
}

/// In every spec (the built-ins, DharaAR and a TOML-only hybrid), a count
/// that must be positive given as 0 or -1 is an error naming `config.json`
/// and the key; `num_hidden_layers = -1` used to surface as "unexpected
/// tensors `model.layers.0...`".
#[test]
fn non_positive_counts_name_config_json_and_the_key_in_every_spec() {
    let mut fixtures: Vec<Fixture> = Vec::new();
    for f in mlex_testkit::fixtures() {
        let plain = f.dtype == "float32" && f.quant.is_none() && f.layout == "mlx";
        if plain && !fixtures.iter().any(|g| g.arch == f.arch) {
            fixtures.push(f);
        }
    }
    for want in [
        "llama",
        "qwen2",
        "qwen3_5",
        "nemotron_h",
        "stablelm",
        "dhara_ar",
        "hybrid_mix",
    ] {
        assert!(
            fixtures.iter().any(|f| f.arch == want),
            "no float32 fixture of {want}"
        );
    }
    let mut checked = 0;
    for f in &fixtures {
        let src = path_of(f);
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap())
                .unwrap();
        let spec = spec_text_for(f, &f.arch);
        let nested = toml::from_str::<toml::Table>(&spec)
            .unwrap()
            .get("text_config")
            .and_then(|v| v.as_str())
            .filter(|k| config.get(*k).is_some())
            .map(str::to_owned);
        let keys = count_keys(f, &spec);
        assert!(
            keys.iter().any(|k| k == "num_hidden_layers") || f.arch == "nemotron_h",
            "{}: num_hidden_layers is not a count",
            f.arch
        );
        let registry = mlex_models::build_registry(&f.arch_paths()).unwrap();
        for key in keys {
            let holder = |v: &serde_json::Value| match &nested {
                Some(n) => v[n.as_str()].clone(),
                None => v.clone(),
            };
            if key.contains('.') || holder(&config).get(&key).is_none() {
                continue;
            }
            for bad in [0i64, -1] {
                let dir = copy_with_config(&src, |v| match &nested {
                    Some(n) => v[n.as_str()][key.as_str()] = bad.into(),
                    None => v[key.as_str()] = bad.into(),
                });
                let e = match mlex_models::load::load(dir.path().to_str().unwrap(), &registry) {
                    Ok(_) => panic!("{}: {key} = {bad} loaded", f.name),
                    Err(e) => e.to_string(),
                };
                assert!(
                    e.contains("config.json") && e.contains(&key) && e.contains("from 1"),
                    "{}: {key} = {bad}: {e}",
                    f.name
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 40, "only {checked} cases");
}

/// A spec that `extends` another holds only what differs: a partial
/// `[model]` and `[kinds.<kind>]` merge into the base's, its `[[sanitize]]`
/// steps run after the base's (so the base's tie-dependent `lm_head` drop
/// still happens), and `replace = [...]` replaces what it names instead.
#[test]
fn extends_merges_tables_and_appends_sanitize_steps() {
    let f = fixture("qwen2-f32");
    let r = reference(&f);
    // The checkpoint under another prefix, with the tied head stored too
    // (as many Hugging Face files of tied models have it).
    let (_d, dir) = copy_fixture("qwen2-f32");
    std::fs::remove_file(dir.join("model.safetensors.index.json")).ok();
    rewrite_weights(&dir, |t| {
        let renamed: HashMap<String, Array> = t
            .drain()
            .map(|(k, v)| (k.replacen("model.", "transformer.", 1), v))
            .collect();
        *t = renamed;
        let embed = t["transformer.embed_tokens.weight"].clone();
        t.insert("lm_head.weight".into(), embed);
    });
    let cfg = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["model_type"] = "qwen2_renamed".into();
    std::fs::write(&cfg, v.to_string()).unwrap();

    let specs = tempfile::tempdir().unwrap();
    let spec = specs.path().join("qwen2_renamed.toml");
    let logits_with = |text: &str| -> Result<Vec<f32>, String> {
        std::fs::write(&spec, text).unwrap();
        let registry =
            mlex_models::build_registry(std::slice::from_ref(&spec)).map_err(|e| e.to_string())?;
        let loaded =
            mlex_models::load::load(dir.to_str().unwrap(), &registry).map_err(|e| e.to_string())?;
        let mut cache = loaded.model.make_cache(1).unwrap();
        let out = loaded
            .model
            .forward(&tokens(&r.prompt), &mut cache)
            .unwrap();
        Ok(to_f32(&out))
    };
    let head = "model_type = \"qwen2_renamed\"\nextends = \"qwen2\"\n";
    let rename = "[[sanitize]]\nrename_prefix = [\"transformer.\", \"model.\"]\n";

    // One field of [model]; the base's lm_head drop, then this file's rename.
    let got = logits_with(&format!("{head}[model]\nmax_context = 2048\n{rename}")).unwrap();
    assert_close(
        &got,
        &to_f32(&r.logits_full),
        1e-4,
        "extended spec and mlx-lm's qwen2",
    );

    // A kind option changed, the rest of the kind's options kept.
    let changed = logits_with(&format!(
        "{head}{rename}[kinds.attention]\nrope_theta = 10.0\n"
    ))
    .unwrap();
    let (d, _) = max_diff(&changed, &got);
    assert!(d > 1e-3, "rope_theta in [kinds.attention] was not applied");

    // `replace` drops the base's steps: the stored head is then unexpected.
    let e = logits_with(&format!("{head}replace = [\"sanitize\"]\n{rename}")).unwrap_err();
    assert!(e.contains("lm_head.weight"), "{e}");
    // Without this file's rename nothing is found where the spec looks.
    let e = logits_with(head).unwrap_err();
    assert!(
        e.contains("model.embed_tokens") || e.contains("transformer."),
        "{e}"
    );

    // `replace` naming what the base lacks, or without `extends`.
    let e = logits_with(&format!("{head}replace = \"sanitize\"\n")).unwrap_err();
    assert_mentions(&e, &["replace", "list"]);
    let e = logits_with(&format!("{head}replace = [\"kinds.mamba2\"]\n")).unwrap_err();
    assert_mentions(&e, &["qwen2_renamed.toml", "kinds.mamba2", "qwen2"]);
    let base = crate_file("architectures/qwen2.toml").replace(
        "model_type = \"qwen2\"",
        "model_type = \"qwen2_renamed\"\nreplace = [\"sanitize\"]",
    );
    let e = logits_with(&base).unwrap_err();
    assert_mentions(&e, &["replace", "extends"]);
}
