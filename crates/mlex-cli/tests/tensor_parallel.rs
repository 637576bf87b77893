//! `--tp`: two ranks over loopback (MLX's ring backend, two processes of
//! the `mlex` binary started by its own launcher) against one device, on
//! f32 fixtures of every built-in architecture, GGUF files, quantized
//! weights and the TOML-only specs; and the errors a split run gives.

use assert_cmd::Command;
use mlex_testkit::*;
use serde_json::Value;
use std::path::PathBuf;

fn mlex(f: &Fixture) -> Command {
    let mut c = Command::cargo_bin("mlex").unwrap();
    c.env_remove("MLEX_ARCH_PATH");
    // A rank's environment comes from the launcher only.
    for v in ["MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE"] {
        c.env_remove(v);
    }
    for p in f.arch_paths() {
        c.arg("--arch-file").arg(p);
    }
    c
}

fn ids_arg(ids: &[i32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The fixture's model: its directory, or the one GGUF file in it.
fn model_path(f: &Fixture) -> PathBuf {
    let dir = path_of(f);
    let gguf = dir.join("model.gguf");
    if f.layout == "gguf" && gguf.exists() {
        gguf
    } else {
        dir
    }
}

/// `mlex logits` of the reference prompt on `tp` ranks.
fn logits(f: &Fixture, prompt: &[i32], tp: u32) -> Vec<f32> {
    logits_with(f, prompt, tp, &[])
}

/// [`logits`] with `extra` arguments (`--mtp`: the head's logits).
fn logits_with(f: &Fixture, prompt: &[i32], tp: u32, extra: &[&str]) -> Vec<f32> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("l.npy");
    mlex(f)
        .args(["logits", "--model"])
        .arg(model_path(f))
        .args([
            "--prompt-ids",
            &ids_arg(prompt),
            "--tp",
            &tp.to_string(),
            "--out",
        ])
        .arg(&out)
        .args(extra)
        .assert()
        .success();
    to_f32(&mlx_rs::Array::load_numpy(&out).unwrap())
}

/// Greedy token ids of `mlex generate` on `tp` ranks.
fn greedy_ids(f: &Fixture, prompt: &[i32], tp: u32, extra: &[&str]) -> Vec<i64> {
    greedy_json(f, prompt, tp, extra)["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect()
}

/// The JSON report of a greedy `mlex generate` of 16 tokens on `tp` ranks.
fn greedy_json(f: &Fixture, prompt: &[i32], tp: u32, extra: &[&str]) -> Value {
    let out = mlex(f)
        .args(["generate", "--model"])
        .arg(model_path(f))
        .args(["--prompt-ids", &ids_arg(prompt), "--max-tokens", "16"])
        .args(["--temp", "0", "--ignore-eos", "--format", "json", "--tp"])
        .arg(tp.to_string())
        .args(extra)
        .ok_stdout();
    last_json(&out)
}

/// Two ranks give one device's greedy tokens (compiled and eager) and its
/// logits within 1e-5 of the largest (the ranks sum their products' parts
/// in another order, so the last bits differ).
fn two_ranks_equal_one_device(names: &[&str]) {
    ranks_equal_one_device(names, 2);
}

/// [`two_ranks_equal_one_device`] on `ranks` ranks.
fn ranks_equal_one_device(names: &[&str], ranks: u32) {
    for name in names {
        let f = fixture(name);
        let r = reference(&f);
        let one = logits(&f, &r.prompt, 1);
        let split = logits(&f, &r.prompt, ranks);
        assert_close(
            &split,
            &one,
            1e-5,
            &format!("{name} on {ranks} ranks: logits"),
        );
        for extra in [&[][..], &["--no-compile"][..]] {
            let want = greedy_ids(&f, &r.prompt, 1, extra);
            assert_eq!(
                greedy_ids(&f, &r.prompt, ranks, extra),
                want,
                "{name} on {ranks} ranks {extra:?}"
            );
        }
    }
}

#[test]
fn two_ranks_equal_one_device_on_dense_architectures() {
    two_ranks_equal_one_device(&[
        "llama-f32",
        "qwen2-f32",
        "qwen3-f32",
        "mistral-f32",
        "granite-f32",
        "stablelm-f32",
        "smollm3-f32",
        "phi3-f32",
        "olmo2-f32",
        "olmo3-f32",
        "dhara-f32",
    ]);
}

#[test]
fn two_ranks_equal_one_device_on_hybrids() {
    two_ranks_equal_one_device(&[
        "qwen3_5-f32",
        "qwen3_next-f32",
        "nemotron_h-f32",
        "hybrid_mix-f32",
    ]);
}

#[test]
fn two_ranks_equal_one_device_on_moe_gguf_and_quantized_weights() {
    two_ranks_equal_one_device(&[
        "qwen3_moe-f32",
        "qwen3_5_moe-f32",
        "qwen3_next-moe-f32",
        "qwen2_moe-f32",
        "gguf-qwen3_5-f32",
        "gguf-nemotron_h-f32",
        "gguf-qwen3_next-f32",
        "llama-q4-g32",
        // A rank decodes only its rows and blocks of a quantized GGUF
        // tensor; a split through a Q4_K block of 256 keeps its groups.
        "gguf-qwen3_5-q4_k",
        "gguf-nemotron_h-q8_0",
    ]);
}

#[test]
fn four_ranks_share_the_key_value_heads_and_equal_one_device() {
    // Every fixture has 2 key/value heads (Qwen3.5's Gated DeltaNet 2 key
    // heads, Mamba2 2 B/C groups): on 4 ranks each is held by 2 ranks,
    // beside the rank's own query (value, SSM) heads; a Mamba2 group's
    // gated norm sums its squares over its 2 ranks. Fused q/k/v in the checkpoint (phi3), a
    // full-width k norm summed over ranks (olmo2), canon B over the k/v
    // channels (dhara), MoE, GGUF and 4-bit weights; the embedding (tied
    // or not) and an untied head (phi3, olmo2) split by vocabulary.
    ranks_equal_one_device(
        &[
            "qwen3-f32",
            "phi3-f32",
            "olmo2-f32",
            "dhara-f32",
            "qwen3_5-f32",
            "qwen3_5_moe-f32",
            "gguf-qwen3_5-f32",
            "llama-q4-g32",
            "nemotron_h-f32",
        ],
        4,
    );
}

#[test]
fn quantizing_a_split_model_equals_one_device_or_names_the_tensor() {
    // olmo2-f32's untied head splits by vocabulary and is quantized like
    // the rest; on 4 ranks o_proj keeps 16 of its 64 columns, not a
    // whole group of 32.
    let f = fixture("olmo2-f32");
    let r = reference(&f);
    let q = ["--quantize", "4", "--group-size", "32"];
    let want = greedy_ids(&f, &r.prompt, 1, &q);
    assert_eq!(greedy_ids(&f, &r.prompt, 2, &q), want);
    let err = failure(
        &f,
        "generate --prompt-ids 1,2 --tp 4 --quantize 4 --group-size 32",
    );
    assert!(
        err.contains("o_proj.weight` has 16 columns on a rank of --tp 4"),
        "{err}"
    );
}

/// `bench --format json` of `f` on `tp` ranks with `extra` (rank 0's
/// report).
fn bench(f: &Fixture, tp: u32, extra: &[&str]) -> Value {
    let out = mlex(f)
        .args([
            "bench",
            "--prompt-len",
            "8",
            "--gen",
            "4",
            "--format",
            "json",
            "--model",
        ])
        .arg(model_path(f))
        .args(["--tp", &tp.to_string()])
        .args(extra)
        .ok_stdout();
    last_json(&out)
}

#[test]
fn each_rank_holds_its_part_of_the_split_weights() {
    // qwen3_5-f32: the tied embedding splits by vocabulary (256 rows, 128
    // a rank), the layers by heads; what stays whole on every rank is the
    // norms and the per-head q/k norms, a few kB.
    let f = fixture("qwen3_5-f32");
    let one = bench(&f, 1, &[]);
    let two = bench(&f, 2, &[]);
    assert_eq!(two["dispatch"]["tensor_parallel"]["size"], 2);
    assert_eq!(two["dispatch"]["tensor_parallel"]["backend"], "ring");
    assert!(one["dispatch"]["tensor_parallel"].is_null());
    let (w1, w2) = (
        one["weight_bytes"].as_f64().unwrap(),
        two["weight_bytes"].as_f64().unwrap(),
    );
    assert!(
        (w2 - w1 / 2.0).abs() < 0.02 * w1,
        "rank 0 holds {w2} bytes of {w1}"
    );
    // And it read no more than that from the checkpoint: one device reads
    // its weights and a few kB besides (config, tokenizer, /proc); a rank
    // reads its part and the same few kB, not the whole tensors it cuts.
    let read = |v: &Value| v["load_read_bytes"].as_f64().expect("read bytes on Linux");
    let (r1, r2) = (read(&one), read(&two));
    let besides = r1 - w1;
    assert!(
        r2 < w2 + besides + 0.1 * (w1 - w2),
        "rank 0 read {r2} bytes for {w2} of weights (one device: {r1} for {w1})"
    );
}

#[test]
fn each_rank_reads_about_its_part_of_a_gguf_file() {
    // A GGUF tensor is read on demand: a rank reads the rows and blocks of
    // its part (through llama.cpp's row reorders), not the whole tensor.
    // Both ranks read the header and the tensors they keep whole (norms,
    // convs: a larger share of these tiny files than of real ones), so a
    // rank reads a little over half of the file; reading whole tensors
    // and cutting them afterwards reads all of it.
    for name in [
        "gguf-qwen3_5-f32",
        "gguf-qwen3_5-q4_k",
        "gguf-nemotron_h-q8_0",
        "gguf-llama-spm-q8_0",
    ] {
        let f = fixture(name);
        let size = std::fs::metadata(model_path(&f)).unwrap().len() as f64;
        let read = |v: &Value| v["load_read_bytes"].as_f64().expect("read bytes on Linux");
        let (r1, r2) = (read(&bench(&f, 1, &[])), read(&bench(&f, 2, &[])));
        // What one device reads besides the file (config, /proc): every rank reads it too.
        let besides = r1 - size;
        assert!(
            r2 - besides < 0.7 * size,
            "{name}: rank 0 read {r2} bytes of a {size}-byte file (one device: {r1})"
        );
    }
}

#[test]
fn the_mtp_head_under_two_ranks_equals_one_device_and_its_reference() {
    // The head's layers split as the trunk's do (`fc` and its norms stay
    // whole): its logits on two ranks match the composed reference
    // (`xtask/py/mtp_ref.py`) as one device's do and one device's own, and
    // drafting with it under --tp gives one device's tokens and rounds.
    for name in [
        "qwen3_5-mtp-hf",
        "qwen3_next-mtp-hf",
        "gguf-qwen3_5-mtp-f32",
    ] {
        let f = fixture(name);
        let r: std::collections::HashMap<String, mlx_rs::Array> = mlx_rs::Array::load_safetensors(
            fixtures_dir().join(f.mtp_reference.as_ref().expect("an MTP fixture")),
        )
        .unwrap();
        let prompt: Vec<i32> = to_f32(&r["prompt"]).iter().map(|&t| t as i32).collect();
        let want = to_f32(&r["mtp_logits"]);
        let one = logits_with(&f, &prompt, 1, &["--mtp"]);
        let two = logits_with(&f, &prompt, 2, &["--mtp"]);
        assert_close(
            &two,
            &want,
            1e-4,
            &format!("{name}: 2 ranks and the reference"),
        );
        assert_close(&two, &one, 1e-5, &format!("{name}: 2 ranks and one device"));
        let run = |tp: u32| greedy_json(&f, &prompt, tp, &["--mtp"]);
        let (a, b) = (run(1), run(2));
        assert_eq!(a["token_ids"], b["token_ids"], "{name}");
        assert_eq!(b["speculative"]["drafter"], "mtp", "{name}");
        for k in ["rounds", "proposed", "accepted"] {
            assert_eq!(a["speculative"][k], b["speculative"][k], "{name}: {k}");
        }
    }
    // In a batch too (`--prompts-file`): each row drafts from its own states.
    let f = fixture("qwen3_5-mtp-hf");
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("p.txt");
    std::fs::write(&prompts, "1 2 3 4 5\n7 8 9\n10 11 12 13 14 15\n").unwrap();
    let rows = |tp: u32| -> Vec<(Value, Value)> {
        let out = mlex(&f)
            .env("MLEX_SPECULATIVE_ROWS", "8")
            .args([
                "generate",
                "--mtp",
                "--ids",
                "--max-tokens",
                "12",
                "--format",
                "json",
            ])
            .args(["--tp", &tp.to_string(), "--prompts-file"])
            .arg(&prompts)
            .arg("--model")
            .arg(model_path(&f))
            .ok_stdout();
        let mut v: Vec<Value> = String::from_utf8_lossy(&out)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        v.sort_by_key(|x| x["index"].as_u64());
        v.iter()
            .map(|x| (x["token_ids"].clone(), x["speculative"]["rounds"].clone()))
            .collect()
    };
    let one = rows(1);
    assert_eq!(one.len(), 3);
    assert_eq!(rows(2), one);
}

#[test]
fn speculative_lookup_and_a_draft_model_under_two_ranks_equal_one_device() {
    let f = fixture("qwen3_5-f32");
    let r = reference(&f);
    let want = greedy_ids(&f, &r.prompt, 1, &[]);
    assert_eq!(greedy_ids(&f, &r.prompt, 2, &["--lookup"]), want);
    // A dense draft model of the same vocabulary, split as the target is.
    let draft = model_path(&fixture("qwen3-f32"));
    let args = ["--draft-model", draft.to_str().unwrap()];
    let one = greedy_json(&f, &r.prompt, 1, &args);
    let two = greedy_json(&f, &r.prompt, 2, &args);
    assert_eq!(two["token_ids"], one["token_ids"]);
    let ids: Vec<i64> = one["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect();
    assert_eq!(ids, want);
    assert_eq!(two["speculative"]["drafter"], "draft-model");
    for k in ["rounds", "proposed", "accepted"] {
        assert_eq!(two["speculative"][k], one["speculative"][k], "{k}");
    }
}

/// The stderr of a failing run of `args` (words between spaces).
fn failure(f: &Fixture, args: &str) -> String {
    failure_with(f, &[], &args.split_whitespace().collect::<Vec<_>>())
}

/// The stderr of a failing run of `args` with `envs` set.
fn failure_with(f: &Fixture, envs: &[(&str, &std::ffi::OsStr)], args: &[&str]) -> String {
    let out = mlex(f)
        .envs(envs.iter().copied())
        .args(args)
        .arg("--model")
        .arg(model_path(f))
        .assert()
        .failure()
        .get_output()
        .clone();
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn ranks_that_cannot_split_a_layer_fail_naming_it_and_the_rank() {
    // 4 query heads do not split three ways: every rank says so, the
    // launcher names the rank that failed first and stops the others.
    let f = fixture("llama-f32");
    let err = failure(&f, "generate --prompt-ids 1,2 --tp 3");
    assert!(err.contains("4 query heads do not split into 3"), "{err}");
    assert!(err.contains("[rank "), "{err}");
    assert!(err.contains("the other ranks were stopped"), "{err}");
    // Whole quantization groups only.
    let f = fixture("llama-q4");
    let err = failure(&f, "generate --prompt-ids 1,2 --tp 2 --weights stored");
    assert_mentions(&err, &["o_proj", "--tp 2"]);
    // 2 Mamba2 groups neither split three ways nor divide 3 ranks;
    // Qwen3-Next's projections interleave key and value heads.
    let err = failure(
        &fixture("nemotron_h-f32"),
        "generate --prompt-ids 1,2 --tp 3",
    );
    assert!(
        err.contains("2 B/C groups (n_groups) neither split into 3"),
        "{err}"
    );
    let err = failure(
        &fixture("qwen3_next-f32"),
        "generate --prompt-ids 1,2 --tp 4",
    );
    assert!(err.contains("Qwen3-Next layout"), "{err}");
}

/// The JSON turns of `mlex chat` on `tp` ranks fed `input`, without
/// their speeds.
fn chat_turns(f: &Fixture, input: &str, tp: u32) -> Vec<Value> {
    let out = mlex(f)
        .args([
            "chat",
            "--format",
            "json",
            "--max-tokens",
            "24",
            "--stop",
            "Rome",
        ])
        .args(["--tp", &tp.to_string(), "--model"])
        .arg(path_of(f))
        .write_stdin(input)
        .ok_stdout();
    String::from_utf8_lossy(&out)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            o.retain(|k, _| !k.ends_with("tok_s"));
            v
        })
        .collect()
}

#[test]
fn chat_under_three_ranks_equals_one_device() {
    // SmolLM2-135M (9 heads, 3 key/value heads): rank 0 reads each line
    // and shares it; the prompt cache carries turns over; a stop string
    // ends turn 2 on every rank; /reset and the end of input likewise.
    let f = fixture("smollm2-gguf");
    let input = "What is the capital of France?\nAnd of Italy?\n/reset\nHi\n";
    let want = chat_turns(&f, input, 1);
    assert_eq!(want.len(), 3);
    assert_eq!(want[1]["finish_reason"], "stop", "{want:?}");
    assert_eq!(chat_turns(&f, input, 3), want);
}

#[test]
fn perplexity_and_batched_bench_under_ranks_equal_one_device() {
    let f = fixture("smollm2-gguf");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("text.txt");
    std::fs::write(
        &data,
        "The quick brown fox jumps over the lazy dog. ".repeat(30),
    )
    .unwrap();
    let ppl = |tp: u32| -> f64 {
        let out = mlex(&f)
            .args([
                "perplexity",
                "--context",
                "96",
                "--format",
                "json",
                "--data",
            ])
            .arg(&data)
            .args(["--tp", &tp.to_string(), "--model"])
            .arg(path_of(&f))
            .ok_stdout();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["windows"], 3, "{v}");
        v["perplexity"].as_f64().unwrap()
    };
    let (one, three) = (ppl(1), ppl(3));
    assert!((three - one).abs() <= 1e-5 * one, "{three} vs {one}");
    // A batched bench runs split, with rank 0's report.
    let v = bench(&fixture("qwen3_5-f32"), 2, &["--batch", "3"]);
    assert_eq!(v["dispatch"]["tensor_parallel"]["size"], 2, "{v}");
}

#[test]
fn a_rank_whose_port_is_in_use_fails_naming_it() {
    let f = fixture("llama-f32");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts.json");
    std::fs::write(
        &hosts,
        format!(r#"[["127.0.0.1:{port}"], ["127.0.0.1:1"]]"#),
    )
    .unwrap();
    let err = failure_with(
        &f,
        &[
            ("MLX_RANK", std::ffi::OsStr::new("0")),
            ("MLX_HOSTFILE", hosts.as_os_str()),
        ],
        &["generate", "--prompt-ids", "1,2", "--tp", "2"],
    );
    assert!(
        err.contains(&format!(
            "rank 0's address 127.0.0.1:{port} cannot be bound"
        )),
        "{err}"
    );
    drop(taken);
}

#[test]
fn a_rank_with_a_hostfile_that_lies_fails_naming_it() {
    let f = fixture("llama-f32");
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts.json");
    std::fs::write(&hosts, r#"[["127.0.0.1:1"]]"#).unwrap();
    let args = ["generate", "--prompt-ids", "1,2", "--tp", "2"];
    let rank = std::ffi::OsStr::new("0");
    let err = failure_with(
        &f,
        &[("MLX_RANK", rank), ("MLX_HOSTFILE", hosts.as_os_str())],
        &args,
    );
    assert_mentions(&err, &["MLX_HOSTFILE", "lists 1 ranks"]);
    let err = failure_with(&f, &[("MLX_RANK", rank)], &args);
    assert_mentions(&err, &["MLX_HOSTFILE", "not set"]);
}

/// `generate --format json` lines of `args` on `tp` ranks, by `index` for a
/// prompts file (one line otherwise): `(token_ids, reused_prompt_tokens)`.
fn runs(f: &Fixture, tp: u32, args: &[&str]) -> Vec<(Value, Value)> {
    let out = mlex(f)
        .args(["generate", "--model"])
        .arg(model_path(f))
        .args(["--temp", "0", "--ignore-eos", "--format", "json", "--tp"])
        .arg(tp.to_string())
        .args(args)
        .ok_stdout();
    let mut lines: Vec<Value> = String::from_utf8_lossy(&out)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    lines.sort_by_key(|v| v["index"].as_u64());
    lines
        .into_iter()
        .map(|v| (v["token_ids"].clone(), v["reused_prompt_tokens"].clone()))
        .collect()
}

#[test]
fn batched_decoding_under_two_ranks_equals_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("p.txt");
    std::fs::write(&prompts, "1,2,3\n4,5,6,7,8\n9,10\n11,12,13,14,15,16,17\n").unwrap();
    for name in ["qwen3_5-f32", "nemotron_h-f32", "llama-f32"] {
        let f = fixture(name);
        let args = [
            "--prompts-file",
            prompts.to_str().unwrap(),
            "--ids",
            "--batch",
            "2",
            "--max-tokens",
            "10",
        ];
        let one = runs(&f, 1, &args);
        assert_eq!(one.len(), 4, "{name}");
        assert_eq!(runs(&f, 2, &args), one, "{name}");
    }
}

#[test]
fn a_prefix_restored_under_two_ranks_equals_a_cold_prefill_on_one_device() {
    let f = fixture("qwen3_5-f32");
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().to_str().unwrap();
    let first: Vec<String> = (1..=40).map(|t| t.to_string()).collect();
    let longer = format!("{},77,78,79", first.join(","));
    let cached = |ids: &str, n: &str| {
        runs(
            &f,
            2,
            &[
                "--prompt-ids",
                ids,
                "--max-tokens",
                n,
                "--prompt-cache",
                cache,
            ],
        )
    };
    cached(&first.join(","), "4");
    // Each rank keeps its own file: its caches hold its heads.
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(files, 2);
    let warm = cached(&longer, "8");
    assert_eq!(warm[0].1, 40, "the 40-token prefix is restored");
    let cold = runs(&f, 1, &["--prompt-ids", &longer, "--max-tokens", "8"]);
    assert_eq!(warm[0].0, cold[0].0);
}
