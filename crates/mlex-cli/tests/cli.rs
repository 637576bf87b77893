//! End-to-end tests of every `mlex` subcommand on tiny fixtures, and of
//! `generate` and `chat` on SmolLM2-135M-Instruct.

use assert_cmd::Command;
use mlex_testkit::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn mlex() -> Command {
    let mut c = Command::cargo_bin("mlex").unwrap();
    c.env_remove("MLEX_ARCH_PATH");
    c
}

fn fixture_path(name: &str) -> PathBuf {
    path_of(&fixture(name))
}

/// The report of `mlex inspect --format json` on `model`.
fn inspect_json(model: &Path) -> Value {
    let out = mlex()
        .args(["inspect", "--format", "json", "--model"])
        .arg(model)
        .ok_stdout();
    last_json(&out)
}

/// `mlex ARGS --model MODEL` fails, and its error names each of `names`.
fn refused(model: &Path, args: &[&str], names: &[&str]) {
    let a = mlex()
        .args(args)
        .arg("--model")
        .arg(model)
        .assert()
        .failure();
    let e = String::from_utf8_lossy(&a.get_output().stderr);
    assert!(
        !e.contains("panicked"),
        "`mlex {}` panicked: {e}",
        args.join(" ")
    );
    for name in names {
        assert!(
            e.contains(name),
            "`mlex {}` names no `{name}`: {e}",
            args.join(" ")
        );
    }
}

fn ids_arg(ids: &[i32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn help_has_examples_for_every_subcommand() {
    let out = mlex().arg("--help").ok_stdout();
    let text = String::from_utf8_lossy(&out);
    for sub in [
        "generate", "chat", "bench", "inspect", "list", "logits", "env",
    ] {
        assert!(text.contains(sub), "--help lists {sub}");
        let out = mlex().args([sub, "--help"]).ok_stdout();
        let t = String::from_utf8_lossy(&out);
        assert!(
            t.contains("Examples:") && t.contains(&format!("mlex {sub}")),
            "{sub} --help has examples:\n{t}"
        );
    }
}

#[test]
fn list_shows_architectures_and_kinds_with_origins() {
    let out = mlex().args(["list", "--format", "json"]).ok_stdout();
    let v = last_json(&out);
    let items = v["registered"].as_array().unwrap();
    for name in [
        "llama",
        "qwen2",
        "qwen3",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_text",
        "nemotron_h",
        "dhara_ar",
        "stablelm",
    ] {
        let it = items
            .iter()
            .find(|i| i["name"] == name)
            .unwrap_or_else(|| panic!("{name} listed"));
        assert_eq!(it["what"], "architecture");
        // Built from its spec file; the Qwen3.5 variants share one.
        let file = name.strip_suffix("_text").unwrap_or(name);
        assert_eq!(it["origin"], format!("architectures/{file}.toml"), "{name}");
    }
    for (name, what) in [
        ("attention", "mixer kind"),
        ("gated_delta", "mixer kind"),
        ("mamba2", "mixer kind"),
        ("block", "layer kind"),
    ] {
        assert!(
            items.iter().any(|i| i["name"] == name && i["what"] == what),
            "{name}"
        );
    }
    let toml = tempfile::NamedTempFile::with_suffix(".toml").unwrap();
    std::fs::write(
        toml.path(),
        "model_type = \"mine\"\nextends = \"llama\"\n[layers]\npattern = [\"attention\"]\n",
    )
    .unwrap();
    let out = mlex()
        .args(["list", "--arch-file"])
        .arg(toml.path())
        .ok_stdout();
    let text = String::from_utf8_lossy(&out);
    assert!(
        text.contains("mine") && text.contains(toml.path().file_name().unwrap().to_str().unwrap()),
        "{text}"
    );
}

#[test]
fn inspect_shows_plan_schedule_and_weights() {
    let p = fixture_path("qwen3_next-q4");
    let v = inspect_json(&p);
    assert_eq!(v["architecture"], "qwen3_next");
    let kinds: Vec<&str> = v["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["gated_delta", "gated_delta", "gated_delta", "attention"]
    );
    assert_eq!(v["segments"], 2);
    assert_eq!(v["schedule"], "[E B0 A0 B1 A1 B2 A2 B3] G3 [A3 L]");
    assert!(v["quantization"]
        .as_str()
        .unwrap()
        .starts_with("4-bit affine, group 64"));
    assert!(v["parameters"].as_u64().unwrap() > 0);
    assert_eq!(v["origin"], "local");
    let groups = v["tensor_groups"].as_array().unwrap();
    let stored = |g: &str| {
        groups
            .iter()
            .find(|x| x["group"] == g)
            .unwrap_or_else(|| panic!("no group {g} in {groups:?}"))["stored"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(stored("model.layers.*.mlp.gate_proj").starts_with("4-bit affine, group 64"));
    assert_eq!(stored("model.norm"), "bfloat16");
    let out = mlex().args(["inspect", "--model"]).arg(&p).ok_stdout();
    let text = String::from_utf8_lossy(&out);
    assert_mentions(&text, &["gated_delta", "decode step"]);
}

#[test]
fn inspect_spec_shows_each_block_once_with_its_mixer_options_and_weights() {
    let p = fixture_path("qwen3_next-q4");
    let run = |format: &str| {
        mlex()
            .args(["inspect", "--spec", "--format", format, "--model"])
            .arg(&p)
            .ok_stdout()
    };
    let text = String::from_utf8_lossy(&run("text")).to_string();
    // Three Gated DeltaNet blocks read alike; the fourth layer is attention.
    for line in [
        "layers 0-2 (gated_delta, at model.layers.{i}):",
        "  h   = x + gated_delta(input_layernorm(x))",
        "  out = h + swiglu[mlp](post_attention_layernorm(h))",
        "layer 3 (attention, at model.layers.{i}):",
        "    gated = true",
        "    qk_norm = pre_rope",
        "    layout = qwen3_next",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "no line {line:?} in\n{text}"
        );
    }
    assert!(
        text.contains("self_attn.q_proj+k_proj+v_proj.weight"),
        "{text}"
    );
    let v = last_json(&run("json"));
    let groups = v["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{v}");
    assert_eq!(groups[0]["layers"], serde_json::json!([0, 1, 2]));
    assert_eq!(groups[1]["options"]["mixer"], "attention");
    assert_eq!(groups[1]["options"]["mixer_options"]["gated"], true);
}

#[test]
fn logits_match_the_reference() {
    let f = fixture("llama-f32");
    let r = reference(&f);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("l.npy");
    mlex()
        .args(["logits", "--model"])
        .arg(path_of(&f))
        .args(["--prompt-ids", &ids_arg(&r.prompt), "--out"])
        .arg(&out)
        .assert()
        .success();
    let got = mlx_rs::Array::load_numpy(&out).unwrap();
    assert_eq!(got.shape(), &[r.prompt.len() as i32, 256]);
    let (d, m) = max_diff(&to_f32(&got), &to_f32(&r.logits_full));
    assert!(d <= 1e-4 * m.max(1.0), "{d}");
}

#[test]
fn generate_json_matches_mlx_lm_greedy_tokens() {
    for name in ["qwen3_5-f32", "nemotron_h-f32"] {
        let f = fixture(name);
        let r = reference(&f);
        for compile in [true, false] {
            let mut cmd = mlex();
            cmd.args(["generate", "--model"]).arg(path_of(&f)).args([
                "--prompt-ids",
                &ids_arg(&r.prompt),
                "--max-tokens",
                "32",
                "--temp",
                "0",
                "--format",
                "json",
            ]);
            if !compile {
                cmd.arg("--no-compile");
            }
            let v = last_json(&cmd.ok_stdout());
            let ids: Vec<i32> = v["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_i64().unwrap() as i32)
                .collect();
            assert_eq!(ids, r.greedy, "{name} compile={compile}");
            assert_eq!(v["prompt_tokens"], r.prompt.len());
            assert_eq!(v["generated_tokens"], 32);
            assert_eq!(v["compiled"], compile);
            for k in ["prefill_tok_s", "decode_tok_s", "ttft_s"] {
                assert!(v[k].as_f64().unwrap() > 0.0, "{k}");
            }
            assert!(v.get("text").is_some());
        }
    }
}

#[test]
fn bench_reports_speed_and_memory() {
    let p = fixture_path("qwen3_5-q4");
    let out = mlex()
        .args([
            "bench",
            "--prompt-len",
            "16",
            "--gen",
            "8",
            "--format",
            "json",
            "--model",
        ])
        .arg(&p)
        .ok_stdout();
    let v = last_json(&out);
    assert!(v["prefill_tok_s"].as_f64().unwrap() > 0.0);
    assert!(v["decode_tok_s"].as_f64().unwrap() > 0.0);
    // Time to the first token is the prefill's: computed tokens over it
    // give the prefill rate.
    let ttft = v["ttft_s"].as_f64().unwrap();
    let computed = v["prompt_tokens"].as_f64().unwrap();
    assert!(ttft > 0.0);
    assert!((computed / ttft / v["prefill_tok_s"].as_f64().unwrap() - 1.0).abs() < 1e-6);
    assert!(v["peak_memory_bytes"].as_u64().unwrap() > 0);
    // The prefill's peak holds the weights and is part of the whole run's.
    let prefill_peak = v["prefill_peak_memory_bytes"].as_u64().unwrap();
    assert!(prefill_peak > v["weight_bytes"].as_u64().unwrap(), "{v}");
    assert!(
        prefill_peak <= v["peak_memory_bytes"].as_u64().unwrap(),
        "{v}"
    );
    // Where the memory is: MLX's counters (peak at least what is live)
    // and, on Linux, the process's resident set.
    let m = &v["memory"];
    let (peak, active) = (m["mlx_peak_bytes"].as_u64(), m["mlx_active_bytes"].as_u64());
    assert!(peak.unwrap() > 0 && peak >= active, "{v}");
    assert!(m["mlx_cache_bytes"].as_u64().is_some(), "{v}");
    if cfg!(target_os = "linux") {
        let (rss, hwm) = (m["rss_bytes"].as_u64(), m["rss_peak_bytes"].as_u64());
        assert!(rss.unwrap() > 0 && hwm >= rss, "{v}");
    }
    assert_eq!(v["generated_tokens"], 8);
}

/// Each running `mlex` compiles MLX's CPU kernels in a folder no other
/// running one holds: two sharing a folder loaded each other's
/// half-written libraries ("file too short").
#[test]
fn a_running_mlex_keeps_its_cpu_kernel_folder_to_itself() {
    use std::os::fd::AsRawFd;
    let tmp = tempfile::tempdir().unwrap();
    let env = || {
        let out = mlex()
            .args(["env", "--format", "json"])
            .env("TMPDIR", tmp.path())
            .ok_stdout();
        last_json(&out)
    };
    let v = env();
    let folder = |n: u32| {
        tmp.path()
            .join(format!("mlex-cpu-{n}"))
            .join("mlx")
            .join(v["mlx_version"].as_str().unwrap())
            .join("cpu")
    };
    assert_eq!(v["cpu_kernels"], folder(0).to_str().unwrap());
    // This test holds the first folder's lock, as a running mlex does.
    let held = std::fs::File::open(tmp.path().join("mlex-cpu-0.lock")).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    let locked = unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(locked, 0);
    assert_eq!(env()["cpu_kernels"], folder(1).to_str().unwrap());
    drop(held);
    assert_eq!(env()["cpu_kernels"], folder(0).to_str().unwrap());
}

#[test]
fn env_reports_the_runtime() {
    let out = mlex().args(["env", "--format", "json"]).ok_stdout();
    let v = last_json(&out);
    assert!(v["mlx_version"].as_str().unwrap().starts_with("0.32"));
    assert_eq!(v["matmul_check"]["ok"], true);
    assert!(v["libmlx"].as_str().unwrap_or("").contains("libmlx"));
    // MLX's compiled kernels: under the user's cache, or where asked.
    let home = tempfile::tempdir().unwrap();
    let out = mlex()
        .args(["env", "--format", "json"])
        .env("HOME", home.path())
        .env_remove("XDG_CACHE_HOME")
        .env_remove("MLX_PTX_CACHE_DIR")
        .ok_stdout();
    let v = last_json(&out);
    let expected = home
        .path()
        .join(".cache/mlex/mlx-ptx")
        .join(v["mlx_version"].as_str().unwrap());
    assert_eq!(v["kernel_cache"], expected.to_str().unwrap());
    let out = mlex()
        .args(["env", "--format", "json"])
        .env("MLX_PTX_CACHE_DIR", "/elsewhere")
        .ok_stdout();
    assert_eq!(last_json(&out)["kernel_cache"], "/elsewhere");
}

#[test]
fn bad_options_and_inputs_are_clear_errors() {
    let p = fixture_path("llama-f32");
    for (opt, val) in [
        ("--top-p", "1.5"),
        ("--temp", "-1"),
        ("--min-p", "2"),
        ("--repetition-penalty", "0"),
        ("--logit-bias", "9999=1"),
    ] {
        let e = mlex()
            .args([
                "generate",
                "--prompt-ids",
                "1,2,3",
                &format!("{opt}={val}"),
                "--model",
            ])
            .arg(&p)
            .failed_stderr();
        assert!(e.contains(opt) && e.starts_with("error:"), "{opt}: {e}");
        assert!(!e.contains("panicked"), "{e}");
    }
    let out = mlex()
        .args(["generate", "--prompt-ids", "1", "--model", "/no/such/model"])
        .failed_stderr();
    assert!(out.contains("/no/such/model"));
    // A prompt longer than the context.
    let dir = copy_with_config(&p, |v| v["max_position_embeddings"] = 8.into());
    let long = ["generate", "--prompt-ids", "1,2,3,4,5,6,7,8,9,10"];
    refused(dir.path(), &long, &["exceeds the context of 8"]);
    let out = mlex()
        .args(["generate", "--model"])
        .arg(dir.path())
        .args(["--prompt", "hello"])
        .failed_stderr();
    assert!(out.contains("tokenizer.json"));
}

#[test]
fn a_repo_id_resolves_from_the_local_hugging_face_cache() {
    let p = fixture_path("llama-q4");
    let home = tempfile::tempdir().unwrap();
    let repo = home.path().join("hub/models--acme--tiny-llama");
    let snap = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();
    for e in std::fs::read_dir(&p).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), snap.join(e.file_name())).unwrap();
    }
    let out = mlex()
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .args(["inspect", "--format", "json", "--model", "acme/tiny-llama"])
        .ok_stdout();
    assert_eq!(last_json(&out)["architecture"], "llama");
    let out = mlex()
        .env("HF_HOME", home.path())
        .env("HF_HUB_OFFLINE", "1")
        .args(["inspect", "--model", "acme/absent"])
        .failed_stderr();
    assert!(out.contains("Hugging Face cache"));
}

#[test]
fn inspect_gives_each_gguf_tensor_group_its_file_type_and_what_it_became() {
    for (fixture, ggml, stored) in [
        ("gguf-q8_0", "Q8_0", "8-bit affine, group 32"),
        ("gguf-q4_1", "Q4_1", "4-bit affine, group 32"),
        ("gguf-f16", "F16", "float16"),
    ] {
        let p = fixture_path(fixture);
        let v = inspect_json(&p);
        assert_eq!(v["format"], "gguf");
        let groups = v["tensor_groups"].as_array().unwrap();
        let q = groups
            .iter()
            .find(|g| g["group"] == "model.layers.*.self_attn.q_proj")
            .unwrap_or_else(|| panic!("{fixture}: no q_proj group in {groups:?}"));
        assert_eq!(q["file_types"], serde_json::json!([ggml]), "{fixture}");
        assert!(
            q["stored"].as_str().unwrap().starts_with(stored),
            "{fixture}: {q}"
        );
        let norm = groups
            .iter()
            .find(|g| g["group"] == "model.layers.*.input_layernorm")
            .unwrap();
        assert_eq!(norm["file_types"], serde_json::json!(["F32"]), "{fixture}");
    }
}

/// `mlex` with the test environment's Hugging Face variables removed and
/// `envs` set instead.
fn mlex_with_hub_env(envs: &[(&str, &std::ffi::OsStr)]) -> Command {
    let mut c = mlex();
    c.env_remove("HF_HUB_CACHE")
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE");
    for (k, v) in envs {
        c.env(k, v);
    }
    c
}

fn greedy_ids(model: &std::ffi::OsStr, envs: &[(&str, &std::ffi::OsStr)]) -> Vec<u64> {
    let out = mlex_with_hub_env(envs)
        .args([
            "generate",
            "--prompt-ids",
            "1,2,3,4",
            "--max-tokens",
            "8",
            "--temp",
            "0",
            "--format",
            "json",
            "--model",
        ])
        .arg(model)
        .ok_stdout();
    last_json(&out)["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

#[test]
fn a_repo_id_downloads_from_hf_endpoint_and_answers_as_the_local_copy() {
    let p = fixture_path("llama-q4");
    let hub = mlex_testkit::hub::FakeHub::start();
    let files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&p)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().is_file())
        .map(|e| {
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    hub.add_repo("acme/tiny", files.clone(), None);
    hub.add_repo("acme/gated", files, Some("hf_secret"));
    let home = tempfile::tempdir().unwrap();
    let endpoint = std::ffi::OsString::from(&hub.url);
    let envs = [
        ("HF_HOME", home.path().as_os_str()),
        ("HF_ENDPOINT", endpoint.as_os_str()),
    ];
    let inspect = |model: &str, envs: &[(&str, &std::ffi::OsStr)]| {
        mlex_with_hub_env(envs)
            .args(["inspect", "--format", "json", "--model", model])
            .assert()
    };
    let first = last_json(&inspect("acme/tiny", &envs).success().get_output().stdout);
    assert_eq!(
        first["origin"],
        "downloaded from the Hugging Face Hub: acme/tiny@main"
    );
    let second = last_json(&inspect("acme/tiny", &envs).success().get_output().stdout);
    assert_eq!(second["origin"], "Hugging Face cache: acme/tiny@main");
    assert_eq!(
        greedy_ids(std::ffi::OsStr::new("acme/tiny"), &envs),
        greedy_ids(p.as_os_str(), &[])
    );
    let out = inspect("acme/gated", &envs)
        .failure()
        .get_output()
        .stderr
        .clone();
    let e = String::from_utf8_lossy(&out);
    assert_mentions(&e, &["acme/gated", "401", "HF_TOKEN"]);
    assert!(!e.contains("panicked"), "{e}");
    let token = std::ffi::OsString::from("hf_secret");
    let with_token = [envs[0], envs[1], ("HF_TOKEN", token.as_os_str())];
    let v = last_json(
        &inspect("acme/gated", &with_token)
            .success()
            .get_output()
            .stdout,
    );
    assert_eq!(v["architecture"], "llama");
}

fn smollm2() -> PathBuf {
    fixture_path("smollm2-gguf")
}

#[test]
fn smollm2_answers_paris() {
    let g = smollm2();
    // `mlex generate` on the model with `args` (a prompt first).
    let generate = |args: &[&str]| {
        let mut c = mlex();
        c.arg("generate").args(args).arg("--model").arg(&g);
        c
    };
    let paris = "What is the capital of France?";
    let out = generate(&["--prompt", paris, "--max-tokens", "40", "--format", "json"]).ok_stdout();
    let v = last_json(&out);
    assert!(v["text"].as_str().unwrap().contains("Paris"), "{v}");
    assert_eq!(v["finish_reason"], "eos");
    // Text mode streams the answer to stdout.
    let out = generate(&["--prompt", paris, "--max-tokens", "40"])
        .assert()
        .success()
        .get_output()
        .clone();
    assert!(String::from_utf8_lossy(&out.stdout).contains("Paris"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tok/s"));
    // A stop string cuts the text before it.
    let out = generate(&["--prompt", paris, "--stop", "Paris", "--format", "json"]).ok_stdout();
    let v = last_json(&out);
    assert_eq!(v["finish_reason"], "stop");
    assert!(!v["text"].as_str().unwrap().contains("Paris"));
    // Same seed, same sampled output.
    let sample = |seed: &str| {
        let story = ["--prompt", "Tell me a story.", "--max-tokens", "12"];
        let sampling = ["--temp", "0.9", "--top-p", "0.95", "--seed", seed];
        let out = generate(&[&story[..], &sampling, &["--format", "json"]].concat()).ok_stdout();
        last_json(&out)["token_ids"].clone()
    };
    assert_eq!(sample("3"), sample("3"));
}

/// The JSON turns of `mlex chat --format json --max-tokens max_tokens` of
/// model `m` given `stdin`.
fn chat_turns(m: &std::path::Path, max_tokens: &str, stdin: &str) -> Vec<Value> {
    let out = mlex()
        .args([
            "chat",
            "--format",
            "json",
            "--max-tokens",
            max_tokens,
            "--model",
        ])
        .arg(m)
        .write_stdin(stdin)
        .ok_stdout();
    String::from_utf8_lossy(&out)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn chat_second_turn_prefills_only_new_tokens() {
    let g = smollm2();
    let stdin = "What is the capital of France?\nAnd of Italy?\n/quit\nnot read\n";
    let turns = chat_turns(&g, "30", stdin);
    assert_eq!(turns.len(), 2, "/quit ends the chat");
    let (t1, t2) = (&turns[0], &turns[1]);
    assert!(t1["text"].as_str().unwrap().contains("Paris"));
    assert_eq!(t1["reused_prompt_tokens"], 0);
    // Everything turn 1 fed the model (its prompt and every generated token;
    // the pipelined loop had already fed the final end-of-turn token) is
    // reused; only the new tokens are computed.
    assert_eq!(t1["finish_reason"], "eos");
    let fed = t1["prompt_tokens"].as_u64().unwrap() + t1["generated_tokens"].as_u64().unwrap();
    assert_eq!(
        t2["reused_prompt_tokens"].as_u64().unwrap(),
        fed,
        "{t1}\n{t2}"
    );
    let new = t2["prompt_tokens"].as_u64().unwrap() - fed;
    assert_eq!(t2["prefilled_tokens"].as_u64().unwrap(), new);
    assert!(new < 20, "only the new turn is prefilled ({new} tokens)");

    // /reset starts over: the same first question again.
    let turns = chat_turns(&g, "8", "Hi\n/reset\nHi\n");
    assert_eq!(turns.len(), 2);
    assert_eq!(turns[0]["prompt_tokens"], turns[1]["prompt_tokens"]);
}

/// A reader that goes away (`mlex list | head -0`) ends mlex quietly: by
/// SIGPIPE or with status 0, never a panic.
#[test]
fn a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    for args in [&["list"][..], &["list", "--format", "json"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = std::process::Command::new(assert_cmd::cargo::cargo_bin("mlex"))
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
            "{args:?}: {:?} {err}",
            out.status
        );
    }
}

/// A negative number for a numeric option is an error naming the option,
/// not "unexpected argument".
#[test]
fn negative_numbers_name_their_option() {
    for (opt, val) in [("--max-tokens", "-5"), ("--top-k", "-1"), ("--seed", "-3")] {
        let e = mlex()
            .args([
                "generate",
                "--prompt-ids",
                "1",
                "--model",
                "/no/such/model",
                opt,
                val,
            ])
            .failed_stderr();
        assert!(e.contains(opt) && e.contains(val), "{opt} {val}: {e}");
        assert!(!e.contains("unexpected argument"), "{opt} {val}: {e}");
    }
    let out = mlex()
        .args(["bench", "--model", "/no/such/model", "--gen", "-2"])
        .failed_stderr();
    assert!(out.contains("--gen"));
}

/// Ctrl-C during generation stops it after the current token, prints the
/// text so far and the summary line, and exits 130.
#[test]
fn sigint_during_generation_prints_the_summary_and_exits_130() {
    use std::io::Read;
    let g = smollm2();
    // The end-of-text ids are biased away so that only the interrupt ends it.
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("mlex"))
        .args([
            "generate",
            "--prompt",
            "Tell me a very long story.",
            "--max-tokens",
            "5000",
        ])
        .args([
            "--logit-bias",
            "0=-100",
            "--logit-bias",
            "2=-100",
            "--model",
        ])
        .arg(&g)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    // Generation has started once text streams.
    stdout.read_exact(&mut first).unwrap();
    // SAFETY: signalling our own child by its pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert_mentions(&err, &["generation:", "interrupted"]);
    assert!(!err.contains("panicked"), "{err}");
}

/// `--prompt-cache DIR` carries recurrent-state checkpoints across runs: a
/// later run whose prompt shares 30 tokens restores the checkpoint at 24
/// (every 8) and answers as a cold run; a truncated file or one saved for
/// another model is an error naming it.
#[test]
fn prompt_cache_dir_reuses_a_prefix_across_runs() {
    let p = fixture_path("qwen3_5-f32");
    let other = fixture_path("nemotron_h-f32");
    let first: Vec<i32> = (0..40).map(|i| (i * 7 + 3) % 200).collect();
    let mut second = first[..30].to_vec();
    second.extend((0..10).map(|i| (i * 11 + 5) % 200 + 1));
    let dir = tempfile::tempdir().unwrap();
    let gen = |model: &PathBuf, ids: &[i32], cache: Option<&std::path::Path>| {
        let mut c = mlex();
        c.args([
            "generate",
            "--format",
            "json",
            "--max-tokens",
            "4",
            "--checkpoint-every",
            "8",
        ])
        .args(["--prompt-ids", &ids_arg(ids), "--model"])
        .arg(model);
        if let Some(d) = cache {
            c.arg("--prompt-cache").arg(d);
        }
        c.output().unwrap()
    };
    let out = gen(&p, &first, Some(dir.path()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(last_json(&out.stdout)["prompt_tokens_reused"], 0);
    let out = gen(&p, &second, Some(dir.path()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let warm = last_json(&out.stdout);
    assert_eq!(warm["prompt_tokens_reused"], 24, "{warm}");
    assert_eq!(warm["prompt_tokens_computed"], 16, "{warm}");
    let cold = last_json(&gen(&p, &second, None).stdout);
    assert_eq!(warm["token_ids"], cold["token_ids"]);

    let files: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(
        files.len(),
        1,
        "one file per model, no temporary left: {files:?}"
    );
    let file = &files[0];
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    // Truncated.
    let bytes = std::fs::read(file).unwrap();
    std::fs::write(file, &bytes[..bytes.len() / 2]).unwrap();
    let out = gen(&p, &second, Some(dir.path()));
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains(&name) && !e.contains("panicked"), "{e}");
    // Saved for another model, under this model's name.
    let elsewhere = tempfile::tempdir().unwrap();
    assert!(gen(&other, &first, Some(elsewhere.path())).status.success());
    let theirs = std::fs::read_dir(elsewhere.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::copy(&theirs, file).unwrap();
    let out = gen(&p, &second, Some(dir.path()));
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains(&name) && e.contains("another model"), "{e}");
}

/// The options added for prefill and prefix reuse reject bad values with
/// an error naming the option or the path.
#[test]
fn prefill_and_prompt_cache_options_reject_bad_values() {
    let p = fixture_path("llama-f32");
    let chunk = ["generate", "--prompt-ids", "1,2", "--prefill-chunk", "0"];
    refused(&p, &chunk, &["--prefill-chunk"]);
    // A file where the prompt-cache directory should be.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let e = mlex()
        .args(["generate", "--prompt-ids", "1,2", "--prompt-cache"])
        .arg(&file)
        .arg("--model")
        .arg(&p)
        .failed_stderr();
    assert!(e.contains("not-a-dir") && !e.contains("panicked"), "{e}");
}

/// The JSON lines of a `--prompts-file` run, by `index`.
fn lines_by_index(out: &[u8]) -> std::collections::BTreeMap<u64, Value> {
    String::from_utf8_lossy(out)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["index"].as_u64().unwrap(), v)
        })
        .collect()
}

fn single_greedy(model: &std::path::Path, ids: &str, max_tokens: &str) -> Value {
    let out = mlex()
        .args(["generate", "--format", "json", "--max-tokens", max_tokens])
        .args(["--prompt-ids", ids, "--model"])
        .arg(model)
        .ok_stdout();
    last_json(&out)["token_ids"].clone()
}

#[test]
fn a_prompts_file_decodes_together_and_fails_only_its_bad_lines() {
    // A copy with a context of 24 tokens, so one line can exceed it.
    let src = fixture_path("qwen3-f32");
    let dir = copy_with_config(&src, |v| v["max_position_embeddings"] = 24.into());
    let long: Vec<String> = (1..=30).map(|i| i.to_string()).collect();
    let lines = [
        "1,2,3,4,5".to_owned(),
        String::new(),
        "7 8 9".to_owned(),
        long.join(","),
        r#"{"ids": [3, 4], "max_tokens": 3, "temp": -1}"#.to_owned(),
        r#"{"ids": [5, 6, 7], "bogus": true}"#.to_owned(),
        r#"{"ids": [10, 11, 12, 13, 14, 15], "max_tokens": 4}"#.to_owned(),
        "1,2,x".to_owned(),
        "20,21,22,23,24,25,26,27,28".to_owned(),
    ];
    let file = dir.path().join("prompts.txt");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let out = mlex()
        .args(["generate", "--ids", "--batch", "2", "--max-tokens", "6"])
        .args(["--format", "json", "--prompts-file"])
        .arg(&file)
        .arg("--model")
        .arg(dir.path())
        .assert()
        .failure()
        .get_output()
        .clone();
    let got = lines_by_index(&out.stdout);
    assert_eq!(got.len(), lines.len(), "one line per prompt");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("5 of 9 prompts"), "{stderr} {got:?}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let name = file.display().to_string();
    for (i, key) in [
        (1, "empty"),
        (3, "exceeds the context of 24"),
        (4, "--temp"),
        (5, "bogus"),
        (7, "`x` is not a token id"),
    ] {
        let e = got[&i]["error"]
            .as_str()
            .unwrap_or_else(|| panic!("line {i}: {}", got[&i]));
        assert!(e.contains(key), "line {i}: {e}");
        assert!(
            e.contains(&format!("{name}:{}", i + 1)),
            "line {i} names its line: {e}"
        );
    }
    // The good lines equal one-at-a-time greedy runs.
    for (i, ids, n) in [
        (0, "1,2,3,4,5", "6"),
        (2, "7,8,9", "6"),
        (6, "10,11,12,13,14,15", "4"),
        (8, "20,21,22,23,24,25,26,27,28", "6"),
    ] {
        let v = &got[&i];
        assert_eq!(
            v["token_ids"],
            single_greedy(dir.path(), ids, n),
            "line {i}"
        );
        assert_eq!(v["finish_reason"], "length", "line {i}");
        assert!(v.get("text").is_some());
    }
}

#[test]
fn prompts_file_text_lines_use_the_chat_template_and_their_own_stops() {
    let g = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompts.txt");
    std::fs::write(
        &file,
        "What is the capital of France?\n{\"prompt\": \"What is the capital of France?\", \"stop\": [\"Paris\"]}\n",
    )
    .unwrap();
    let out = mlex()
        .args([
            "generate",
            "--max-tokens",
            "20",
            "--format",
            "json",
            "--prompts-file",
        ])
        .arg(&file)
        .arg("--model")
        .arg(&g)
        .ok_stdout();
    let got = lines_by_index(&out);
    let plain = got[&0]["text"].as_str().unwrap();
    assert!(plain.contains("Paris"), "{plain}");
    let stopped = got[&1]["text"].as_str().unwrap();
    assert_eq!(got[&1]["finish_reason"], "stop");
    assert!(
        !stopped.contains("Paris") && plain.starts_with(stopped),
        "{stopped}"
    );
}

#[test]
fn bench_batch_reports_aggregate_throughput() {
    let p = fixture_path("qwen3_5-f32");
    let out = mlex()
        .args(["bench", "--batch", "3", "--prompt-len", "12", "--gen", "5"])
        .args(["--format", "json", "--model"])
        .arg(&p)
        .ok_stdout();
    let v = last_json(&out);
    assert_eq!(v["batch"], 3);
    assert_eq!(v["generated_tokens"], 15);
    assert_eq!(v["prompt_tokens"], 36);
    for k in ["agg_tok_s", "prefill_tok_s", "decode_tok_s", "seconds"] {
        assert!(v[k].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
}

/// `bench --shared-prefix`: the warm prompt restores the deepest
/// checkpoint at or before the shared length, and the checkpoints' bytes
/// are part of the prompt cache's.
#[test]
fn bench_shared_prefix_reports_cold_and_warm_time_to_first_token() {
    let p = fixture_path("qwen3_5-f32");
    let out = mlex()
        .args(["bench", "--prompt-len", "300", "--shared-prefix", "200"])
        .args(["--checkpoint-every", "64", "--repeats", "2"])
        .args(["--format", "json", "--model"])
        .arg(&p)
        .ok_stdout();
    let v = last_json(&out);
    assert_eq!(v["shared_tokens"], 200);
    assert_eq!(v["reused_tokens"], 192, "{v}");
    assert_eq!(v["pairs"], 2);
    // Checkpoints at 64, 128, 192, 256 and 299 (one before the end, which
    // is the entry itself).
    assert_eq!(v["checkpoints"], 5, "{v}");
    let (cache, snaps) = (
        v["prompt_cache_bytes"].as_u64().unwrap(),
        v["checkpoint_bytes"].as_u64().unwrap(),
    );
    assert!(snaps > 0 && snaps < cache, "{v}");
    for k in ["ttft_cold_s", "ttft_warm_s"] {
        assert!(v[k].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
    refused(
        &p,
        &["bench", "--prompt-len", "300", "--shared-prefix", "300"],
        &["--shared-prefix"],
    );
}

#[test]
fn batch_and_serve_flags_reject_bad_values_clearly() {
    let p = fixture_path("qwen3-f32");
    // A prompts file that is not there names the file.
    refused(
        &p,
        &[
            "generate",
            "--ids",
            "--prompts-file",
            "/no/such/prompts.txt",
        ],
        &["/no/such/prompts.txt"],
    );
    // Zero slots, for generate and bench.
    for args in [
        vec!["generate", "--prompts-file", "x.txt", "--batch", "0"],
        vec!["bench", "--batch", "0"],
        vec!["serve", "--batch", "0"],
    ] {
        refused(&p, &args, &["--batch"]);
    }
    // A port already taken names the address.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let address = format!("127.0.0.1:{port}");
    let smollm2 = fixture_path("smollm2-gguf");
    refused(&smollm2, &["serve", "--port", &port], &[&address, "--port"]);
}

/// Bad checkpoints through the binary: each exits non-zero with `error:`
/// and the file, key or tensor at fault, never a panic. Also prompt ids
/// outside the vocabulary.
#[test]
fn bad_checkpoints_fail_the_binary_with_the_culprit_named() {
    let src = fixture_path("llama-f32");
    let mut cases: Vec<(&str, tempfile::TempDir, Vec<&str>)> = Vec::new();
    cases.push((
        "zero heads",
        copy_with_config(&src, |v| v["num_attention_heads"] = 0.into()),
        vec!["config.json", "num_attention_heads"],
    ));
    cases.push((
        "unknown model_type",
        copy_with_config(&src, |v| v["model_type"] = "gpt9000".into()),
        vec!["config.json", "gpt9000", "qwen3_next"],
    ));
    let truncated = copy_with_config(&src, |_| {});
    let weights = truncated.path().join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    cases.push(("truncated weights", truncated, vec!["model.safetensors"]));
    let missing = copy_with_config(&src, |_| {});
    let index = missing.path().join("model.safetensors.index.json");
    if index.exists() {
        std::fs::remove_file(&index).unwrap();
    }
    let t = mlx_rs::Array::load_safetensors(missing.path().join("model.safetensors")).unwrap();
    let kept: Vec<(&str, &mlx_rs::Array)> = t
        .iter()
        .filter(|(k, _)| !k.ends_with("layers.1.self_attn.k_proj.weight"))
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    // Written beside, then moved: the loaded arrays still read the old file.
    let tmp = missing.path().join("new.safetensors");
    mlx_rs::Array::save_safetensors(kept, None, &tmp).unwrap();
    drop(t);
    std::fs::rename(&tmp, missing.path().join("model.safetensors")).unwrap();
    cases.push((
        "missing tensor",
        missing,
        vec!["layers.1.self_attn.k_proj.weight"],
    ));
    bad_weight_files(&src, &mut cases);
    bad_configs(&src, &mut cases);
    bad_shard_sets(&mut cases);
    for (what, dir, named) in &cases {
        let e = mlex()
            .args(["generate", "--prompt-ids", "1,2,3", "--model"])
            .arg(dir.path())
            .failed_stderr();
        assert!(
            e.starts_with("error:") && !e.contains("panicked"),
            "{what}: {e}"
        );
        for n in named {
            assert!(e.contains(n), "{what}: `{n}` not named in {e}");
        }
    }
    bad_gguf_and_tokenizers();
    let e = mlex()
        .args(["generate", "--prompt-ids", "1,99999", "--model"])
        .arg(&src)
        .failed_stderr();
    assert!(
        e.starts_with("error:") && e.contains("99999") && e.contains("outside the vocabulary"),
        "{e}"
    );
}

type BadCase = (&'static str, tempfile::TempDir, Vec<&'static str>);

/// A safetensors file from a raw JSON header and data bytes.
fn raw_safetensors(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// A copy of `src` whose `model.safetensors` is `edit`ed (the index, if
/// any, is dropped so that the weights file alone is under test).
fn copy_with_weights(
    src: &Path,
    edit: impl FnOnce(&mut std::collections::HashMap<String, mlx_rs::Array>),
) -> tempfile::TempDir {
    let dir = copy_with_config(src, |_| {});
    let index = dir.path().join("model.safetensors.index.json");
    if index.exists() {
        std::fs::remove_file(&index).unwrap();
    }
    let file = dir.path().join("model.safetensors");
    let mut t = mlx_rs::Array::load_safetensors(&file).unwrap();
    edit(&mut t);
    let tmp = dir.path().join("new.safetensors");
    mlx_rs::Array::save_safetensors(t.iter().map(|(k, v)| (k.as_str(), v)), None, &tmp).unwrap();
    drop(t);
    std::fs::rename(&tmp, &file).unwrap();
    dir
}

/// Weight files that are not what their header says, or hold the wrong
/// tensors.
fn bad_weight_files(src: &Path, cases: &mut Vec<BadCase>) {
    let weights_file = |edit: &dyn Fn(&Path)| {
        let dir = copy_with_config(src, |_| {});
        let index = dir.path().join("model.safetensors.index.json");
        if index.exists() {
            std::fs::remove_file(&index).unwrap();
        }
        edit(&dir.path().join("model.safetensors"));
        dir
    };
    cases.push((
        "a header that is not JSON",
        weights_file(&|p| raw_safetensors(p, "not json at all", &[])),
        vec!["model.safetensors"],
    ));
    cases.push((
        "a header claiming an absurd size",
        weights_file(&|p| {
            raw_safetensors(
                p,
                r#"{"w":{"dtype":"F32","shape":[1000000,1000000],"data_offsets":[0,4]}}"#,
                &[0; 4],
            )
        }),
        vec!["model.safetensors", "`w`"],
    ));
    cases.push((
        "overlapping offsets",
        weights_file(&|p| {
            raw_safetensors(
                p,
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                &[0; 12],
            )
        }),
        vec!["model.safetensors"],
    ));
    cases.push((
        "a mis-shaped tensor",
        copy_with_weights(src, |t| {
            let w = &t["model.layers.0.self_attn.k_proj.weight"];
            let flat = mlx_rs::ops::reshape(w, &[-1]).unwrap();
            let bad = mlx_rs::ops::reshape(&flat, &[16, -1]).unwrap();
            t.insert("model.layers.0.self_attn.k_proj.weight".into(), bad);
        }),
        vec![
            "model.layers.0.self_attn.k_proj.weight",
            "model.safetensors",
        ],
    ));
    cases.push((
        "an extra tensor",
        copy_with_weights(src, |t| {
            let one = mlx_rs::Array::from_slice(&[1f32], &[1]);
            t.insert("model.layers.0.surprise.weight".into(), one);
        }),
        vec!["model.layers.0.surprise.weight"],
    ));
    cases.push((
        "an integer weight",
        copy_with_weights(src, |t| {
            let w = t["model.norm.weight"]
                .as_dtype(mlx_rs::Dtype::Int32)
                .unwrap();
            t.insert("model.norm.weight".into(), w);
        }),
        vec!["model.norm.weight", "model.safetensors"],
    ));
}

/// `config.json` missing, unreadable, or with a value of the wrong type or
/// shape.
fn bad_configs(src: &Path, cases: &mut Vec<BadCase>) {
    let no_config = copy_with_config(src, |_| {});
    std::fs::remove_file(no_config.path().join("config.json")).unwrap();
    cases.push(("no config.json", no_config, vec!["config.json"]));
    let not_json = copy_with_config(src, |_| {});
    std::fs::write(not_json.path().join("config.json"), "{ \"model_type\": ").unwrap();
    cases.push(("config.json not JSON", not_json, vec!["config.json"]));
    cases.push((
        "a key of the wrong type",
        copy_with_config(src, |v| v["hidden_size"] = "wide".into()),
        vec!["config.json", "hidden_size"],
    ));
    cases.push((
        "key/value heads that do not divide the heads",
        copy_with_config(src, |v| v["num_key_value_heads"] = 3.into()),
        vec!["config.json", "num_key_value_heads"],
    ));
}

/// Sharded checkpoints whose index and shards disagree.
fn bad_shard_sets(cases: &mut Vec<BadCase>) {
    let sharded = fixture_path("llama-f32-sharded");
    let shard3 = "model-00003-of-00003.safetensors";
    let gone = copy_with_config(&sharded, |_| {});
    std::fs::remove_file(gone.path().join(shard3)).unwrap();
    cases.push((
        "an index naming a shard that is not there",
        gone,
        vec![shard3, "model.safetensors.index.json"],
    ));
    let stale = copy_with_config(&sharded, |_| {});
    let index = stale.path().join("model.safetensors.index.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    v["weight_map"]
        .as_object_mut()
        .unwrap()
        .retain(|_, f| f.as_str() != Some(shard3));
    std::fs::write(&index, v.to_string()).unwrap();
    cases.push((
        "a shard left out of the index",
        stale,
        vec![shard3, "model.safetensors.index.json"],
    ));
}

/// GGUF files cut short or with crafted counts, and broken tokenizer files
/// and chat templates, through the binary.
fn bad_gguf_and_tokenizers() {
    let fail = |args: &[&str], model: &Path| -> String {
        let e = mlex().args(args).arg("--model").arg(model).failed_stderr();
        assert!(e.starts_with("error:") && !e.contains("panicked"), "{e}");
        e
    };
    let ids = ["generate", "--prompt-ids", "1,2,3"];
    let dir = tempfile::tempdir().unwrap();
    let gguf = std::fs::read(fixture_path("gguf-f32")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &gguf[..gguf.len() / 3]).unwrap();
    let e = fail(&ids, &cut);
    assert!(e.contains("cut.gguf"), "{e}");
    // Version 3, 2^62 tensors, no metadata.
    let mut crafted = b"GGUF".to_vec();
    crafted.extend_from_slice(&3u32.to_le_bytes());
    crafted.extend_from_slice(&(1u64 << 62).to_le_bytes());
    crafted.extend_from_slice(&0u64.to_le_bytes());
    let crafted_path = dir.path().join("crafted.gguf");
    std::fs::write(&crafted_path, crafted).unwrap();
    let e = fail(&ids, &crafted_path);
    assert!(e.contains("crafted.gguf"), "{e}");

    let chat = fixture_path("qwen3-chat");
    let corrupt = copy_with_config(&chat, |_| {});
    std::fs::write(corrupt.path().join("tokenizer.json"), "{\"model\": 7").unwrap();
    let e = fail(&["generate", "--prompt", "hello"], corrupt.path());
    assert!(e.contains("tokenizer.json"), "{e}");
    let template = copy_with_config(&chat, |_| {});
    let tc = template.path().join("tokenizer_config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    v["chat_template"] = "{{ raise_exception('no system prompts here') }}".into();
    std::fs::write(&tc, v.to_string()).unwrap();
    let e = fail(&["generate", "--prompt", "hello"], template.path());
    assert_mentions(&e, &["tokenizer_config.json", "chat_template"]);
}

/// docs/architectures.md is what `mlex list --markdown` prints now.
#[test]
fn the_generated_architecture_docs_are_fresh() {
    let out = mlex()
        .args(["list", "--markdown"])
        .env_remove("MLEX_ARCH_PATH")
        .ok_stdout();
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/architectures.md");
    let committed = std::fs::read_to_string(&file).unwrap_or_default();
    assert!(
        committed == String::from_utf8_lossy(&out),
        "{} is stale: run `cargo xtask codegen`",
        file.display()
    );
}

/// A model_type no Rust code knows runs from its spec file alone, given
/// with `--arch-dir` or `$MLEX_ARCH_PATH`; without it the error says how to
/// add one. Its greedy tokens are those of the reference (mlx-lm's layer
/// modules composed in `xtask/py/mix_ref.py`).
#[test]
fn a_spec_file_serves_a_new_hybrid() {
    let f = fixture("hybrid_mix-f32");
    let model = path_of(&f);
    let r = reference(&f);
    let specs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/specs");
    let prompt = ids_arg(&r.prompt);
    let e = mlex()
        .args(["generate", "--model"])
        .arg(&model)
        .args(["--prompt-ids", &prompt, "--max-tokens", "4", "--temp", "0"])
        .failed_stderr();
    assert_mentions(&e, &["unknown model_type `hybrid_mix`", "--arch-dir"]);
    let want: Vec<i64> = r.greedy[..8].iter().map(|&t| t as i64).collect();
    for how in ["--arch-dir", "MLEX_ARCH_PATH"] {
        let mut c = mlex();
        if how == "--arch-dir" {
            c.arg("--arch-dir").arg(&specs);
        } else {
            c.env("MLEX_ARCH_PATH", &specs);
        }
        let out = c
            .args(["generate", "--model"])
            .arg(&model)
            .args(["--prompt-ids", &prompt, "--max-tokens", "8", "--temp", "0"])
            .args(["--format", "json"])
            .ok_stdout();
        let got: Vec<i64> = last_json(&out)["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert_eq!(got, want, "{how}");
    }
    let out = mlex()
        .args(["list", "--format", "json", "--arch-dir"])
        .arg(&specs)
        .ok_stdout();
    let v = last_json(&out);
    let it = v["registered"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "hybrid_mix")
        .cloned()
        .expect("hybrid_mix listed");
    assert!(
        it["origin"].as_str().unwrap().ends_with("hybrid_mix.toml"),
        "{it}"
    );
    // A spec path that does not exist is named.
    let missing = specs.join("no-such-dir");
    let e = mlex()
        .arg("--arch-dir")
        .arg(&missing)
        .arg("list")
        .failed_stderr();
    assert_mentions(&e, &["no-such-dir", "No such file"]);
}

#[test]
fn speculative_flags_give_the_plain_output_and_report_acceptance() {
    let m = fixture_path("qwen3_5-f32");
    let ids = "5,6,7,8,9,10,11,12,5,6,7,8,9,10,11,12,5,6,7";
    let run = |extra: &[&str]| -> Value {
        let out = mlex()
            .arg("generate")
            .arg("--model")
            .arg(&m)
            .args([
                "--prompt-ids",
                ids,
                "--max-tokens",
                "20",
                "--format",
                "json",
            ])
            .args(extra)
            .ok_stdout();
        last_json(&out)
    };
    let plain = run(&[]);
    assert!(plain["speculative"].is_null());
    let draft = m.to_str().unwrap();
    for extra in [
        vec!["--lookup"],
        vec!["--draft-model", draft, "--draft-tokens", "4"],
    ] {
        let spec = run(&extra);
        assert_eq!(spec["token_ids"], plain["token_ids"], "{extra:?}");
        let s = &spec["speculative"];
        assert!(s["rounds"].as_u64().unwrap() > 0, "{extra:?}: {s}");
        let per = s["acceptance_per_position"].as_array().unwrap();
        assert!(!per.is_empty() && per.len() <= 4, "{s}");
        for key in [
            "acceptance",
            "mean_accepted_length",
            "draft_s",
            "verify_s",
            "commit_s",
        ] {
            assert!(s[key].as_f64().is_some(), "{extra:?}: no {key} in {s}");
        }
    }
    // The model drafting for itself: every draft accepted.
    let spec = run(&["--draft-model", draft, "--draft-tokens", "4"]);
    assert_eq!(spec["speculative"]["acceptance"].as_f64(), Some(1.0));
}

#[test]
fn speculative_options_reject_bad_values_naming_them() {
    let m = fixture_path("llama-f32");
    let fail = |args: &[&str]| -> String {
        let out = mlex()
            .arg("generate")
            .arg("--model")
            .arg(&m)
            .args(["--prompt-ids", "1,2,3", "--max-tokens", "4"])
            .args(args)
            .failed_stderr();
        out
    };
    for k in ["0", "17"] {
        let e = fail(&["--lookup", "--draft-tokens", k]);
        assert!(e.contains("--draft-tokens") && e.contains(k), "{e}");
    }
    let other = fixture_path("qwen3-chat");
    let e = fail(&["--draft-model", other.to_str().unwrap()]);
    assert_mentions(&e, &["--draft-model", "vocabulary", "qwen3-chat"]);
    let e = fail(&["--lookup", "--draft-model", other.to_str().unwrap()]);
    assert!(e.contains("--lookup") || e.contains("--draft-model"), "{e}");
    // A batch speculates too: the same tokens, with what drafting did.
    // Every row drafts under `MLEX_SPECULATIVE_ROWS=8`; by default a batch
    // drafts only for a lone sequence, with the same tokens.
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("p.txt");
    std::fs::write(&prompts, "1,2,3,4,1,2,3,4,1,2\n9,8,7,9,8,7,9\n5\n").unwrap();
    let batch_rows = |m: &std::path::Path, rows: &str, extra: &[&str]| {
        let out = mlex()
            .env("MLEX_SPECULATIVE_ROWS", rows)
            .arg("generate")
            .arg("--model")
            .arg(m)
            .arg("--prompts-file")
            .arg(&prompts)
            .args(["--ids", "--max-tokens", "12", "--format", "json"])
            .args(extra)
            .ok_stdout();
        let mut v: Vec<serde_json::Value> = String::from_utf8_lossy(&out)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        v.sort_by_key(|x| x["index"].as_u64());
        v
    };
    let batch = |m: &std::path::Path, extra: &[&str]| batch_rows(m, "8", extra);
    let plain = batch(&m, &[]);
    let spec = batch(&m, &["--lookup"]);
    let lone = batch_rows(&m, "1", &["--lookup"]);
    assert_eq!(plain.len(), 3);
    for ((p, s), l) in plain.iter().zip(&spec).zip(&lone) {
        assert_eq!(p["token_ids"], s["token_ids"], "{s}");
        assert_eq!(p["token_ids"], l["token_ids"], "{l}");
        assert!(p["speculative"].is_null());
        assert_eq!(s["speculative"]["drafter"], "lookup", "{s}");
    }
    // The MTP head drafts in a batch too: its model loads with the head.
    let m = fixture_path("qwen3_5-mtp-hf");
    let plain = batch(&m, &[]);
    let spec = batch(&m, &["--mtp", "--draft-tokens", "2"]);
    assert_eq!(spec.len(), 3);
    for (p, s) in plain.iter().zip(&spec) {
        assert_eq!(p["token_ids"], s["token_ids"], "{s}");
        assert_eq!(s["speculative"]["drafter"], "mtp", "{s}");
    }
    let rounds: u64 = spec
        .iter()
        .map(|s| s["speculative"]["rounds"].as_u64().unwrap())
        .sum();
    assert!(rounds > 0, "{spec:?}");
    // A checkpoint without a head, asked for --mtp in a batch, says so.
    let e = mlex()
        .arg("generate")
        .arg("--model")
        .arg(fixture_path("qwen3_5-f32"))
        .arg("--prompts-file")
        .arg(&prompts)
        .args(["--ids", "--mtp"])
        .failed_stderr();
    assert_mentions(&e, &["--mtp", "config.json"]);
}

/// `--mtp`: the checkpoint's own head drafts, the output is the plain
/// output; a checkpoint without a head and the prompt cache say so.
#[test]
fn mtp_drafts_with_the_checkpoints_head_and_bad_uses_name_it() {
    let m = fixture_path("qwen3_5-mtp-hf");
    let gen = |model: &std::path::Path, extra: &[&str]| {
        mlex()
            .arg("generate")
            .arg("--model")
            .arg(model)
            .args([
                "--prompt-ids",
                "5,6,7,8,9,10,11,12",
                "--max-tokens",
                "16",
                "--format",
                "json",
            ])
            .args(extra)
            .assert()
    };
    let plain = last_json(&gen(&m, &[]).success().get_output().stdout.clone());
    let spec = last_json(
        &gen(&m, &["--mtp", "--draft-tokens", "2"])
            .success()
            .get_output()
            .stdout
            .clone(),
    );
    assert_eq!(spec["token_ids"], plain["token_ids"]);
    assert_eq!(spec["speculative"]["drafter"], "mtp");
    assert!(
        spec["speculative"]["rounds"].as_u64().unwrap() > 0,
        "{spec}"
    );
    let stderr = |a: assert_cmd::assert::Assert| {
        String::from_utf8_lossy(&a.failure().get_output().stderr).into_owned()
    };
    let e = stderr(gen(&fixture_path("qwen3_5-f32"), &["--mtp"]));
    assert_mentions(&e, &["--mtp", "config.json"]);
    let dir = tempfile::tempdir().unwrap();
    let e = stderr(gen(
        &m,
        &["--mtp", "--prompt-cache", dir.path().to_str().unwrap()],
    ));
    assert_mentions(&e, &["--mtp", "--prompt-cache"]);
    let e = stderr(gen(&m, &["--mtp", "--lookup"]));
    assert!(e.contains("--mtp") || e.contains("--lookup"), "{e}");
    // `mlex logits --mtp`: the head's logits, one row fewer than the
    // prompt; a checkpoint without a head, or one prompt id, is named.
    let logits = |model: &std::path::Path, ids: &str| {
        let out = dir.path().join("mtp.npy");
        let a = mlex()
            .args(["logits", "--mtp", "--prompt-ids", ids, "--out"])
            .arg(&out)
            .arg("--model")
            .arg(model)
            .assert();
        (a, out)
    };
    let (a, out) = logits(&m, "5,6,7,8");
    a.success();
    assert_eq!(mlx_rs::Array::load_numpy(&out).unwrap().shape(), &[3, 256]);
    let e = stderr(logits(&fixture_path("qwen3_5-f32"), "5,6,7,8").0);
    assert_mentions(&e, &["--mtp", "config.json"]);
    let e = stderr(logits(&m, "5").0);
    assert_mentions(&e, &["--prompt-ids", "2 prompt ids"]);
}

/// The last JSON line of `mlex bench --model m ARGS`, ARGS the words of
/// `args`, which must succeed.
fn bench_words(m: &std::path::Path, args: &str) -> Value {
    let out = mlex()
        .arg("bench")
        .arg("--model")
        .arg(m)
        .args(args.split_whitespace())
        .ok_stdout();
    last_json(&out)
}

/// `mlex bench --model m --prompt-len 8 --draft-tokens 3 ARGS --format
/// json`, which must succeed: its JSON.
fn bench_json(m: &std::path::Path, args: &[&str]) -> Value {
    let out = mlex()
        .arg("bench")
        .arg("--model")
        .arg(m)
        .args(["--prompt-len", "8", "--draft-tokens", "3"])
        .args(args)
        .args(["--format", "json"])
        .ok_stdout();
    last_json(&out)
}

#[test]
fn bench_measures_speculation_by_acceptance_and_the_verify_cost() {
    let m = fixture_path("nemotron_h-f32");
    let v = bench_json(
        &m,
        &["--gen", "24", "--repeats", "2", "--draft-acceptance", "0.8"],
    );
    for key in ["plain_decode_tok_s", "speculative_decode_tok_s", "speedup"] {
        assert!(v[key]["median"].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
    let acc = v["speculative"]["acceptance"].as_f64().unwrap();
    assert!(acc > 0.0 && acc < 1.0, "{v}");
    assert!(v["peak_memory_bytes"].as_u64().unwrap() > 0);
    // Forced acceptance 1: every draft kept.
    let v = bench_json(
        &m,
        &[
            "--gen",
            "24",
            "--repeats",
            "1",
            "--draft-acceptance",
            "1",
            "--force-acceptance",
        ],
    );
    assert_eq!(v["forced_acceptance"], true, "{v}");
    assert_eq!(v["speculative"]["acceptance"].as_f64(), Some(1.0), "{v}");
    let s = &v["speculative"];
    assert!(s["rounds"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(s["accepted"], s["proposed"], "{v}");
    let v = bench_json(&m, &["--verify-cost"]);
    let rows = v["verify"].as_array().unwrap();
    assert_eq!(rows.len(), 8, "{v}");
    assert!(rows
        .iter()
        .all(|r| r["cost_in_steps"].as_f64().unwrap() > 0.0));
    let out = mlex()
        .arg("bench")
        .arg("--model")
        .arg(&m)
        .args(["--draft-acceptance", "1.5"])
        .failed_stderr();
    assert!(out.contains("--draft-acceptance"));
    // --force-acceptance alone has nothing to force.
    let e = mlex()
        .arg("bench")
        .arg("--model")
        .arg(&m)
        .arg("--force-acceptance")
        .failed_stderr();
    assert!(e.contains("--draft-acceptance"), "{e}");
    // The MTP head drafting at a forced acceptance: every draft kept; a
    // random head's own acceptance is refused as a measure.
    let mtp = fixture_path("qwen3_5-mtp-hf");
    let v = bench_json(
        &mtp,
        &[
            "--gen",
            "16",
            "--repeats",
            "1",
            "--mtp",
            "--draft-acceptance",
            "1",
            "--force-acceptance",
        ],
    );
    assert_eq!(v["speculative"]["drafter"], "mtp", "{v}");
    assert_eq!(v["speculative"]["acceptance"].as_f64(), Some(1.0), "{v}");
    let e = mlex()
        .arg("bench")
        .arg("--model")
        .arg(&mtp)
        .args(["--mtp", "--draft-acceptance", "0.5"])
        .failed_stderr();
    assert_mentions(&e, &["--mtp", "--force-acceptance"]);
}

/// `generate`'s greedy token ids from `prompt` on the model at `m`, `n` of
/// them, under the options `extra`.
fn generated_ids(m: &std::path::Path, prompt: &[i32], n: usize, extra: &[&str]) -> Vec<i32> {
    let out = mlex()
        .arg("generate")
        .arg("--model")
        .arg(m)
        .args([
            "--prompt-ids",
            &ids_arg(prompt),
            "--max-tokens",
            &n.to_string(),
        ])
        .args(["--format", "json"])
        .args(extra)
        .ok_stdout();
    last_json(&out)["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap() as i32)
        .collect()
}

/// The `llama-kvq-f32` fixture, its model folder, and its
/// `xtask/py/kvq_ref.py` reference's entries (`CASE.params`, `CASE.tokens`)
/// as integers by name.
fn kvq_reference() -> (Fixture, PathBuf, impl Fn(&str) -> Vec<i32>) {
    let f = fixture("llama-kvq-f32");
    let m = path_of(&f);
    let r: std::collections::HashMap<String, mlx_rs::Array> =
        mlx_rs::Array::load_safetensors(fixtures_dir().join(f.kv_reference.as_ref().unwrap()))
            .unwrap();
    let ints =
        move |name: &str| -> Vec<i32> { to_f32(&r[name]).iter().map(|&x| x as i32).collect() };
    (f, m, ints)
}

/// `--kv-bits`: `generate` gives mlx-lm's tokens under its quantized cache
/// (the `late` case of `xtask/py/kvq_ref.py`: 8 bits from token 20), bench
/// reports the form, and the modes whose caches are not quantized yet say
/// so, naming the option.
#[test]
fn kv_bits_follow_mlx_lm_and_bad_uses_name_the_option() {
    let (f, m, ints) = kvq_reference();
    let p = ints("late.params");
    let want = ints("late.tokens");
    let prompt = reference(&f).prompt.clone();
    let (bits, group, start) = (p[0].to_string(), p[1].to_string(), p[2].to_string());
    let kv = [
        "--kv-bits",
        bits.as_str(),
        "--kv-group-size",
        group.as_str(),
        "--quantized-kv-start",
        start.as_str(),
    ];
    let got = generated_ids(&m, &prompt, want.len(), &kv);
    assert_eq!(got, want, "mlx-lm's tokens under its {bits}-bit cache");

    let out = mlex()
        .arg("bench")
        .arg("--model")
        .arg(&m)
        .args(["--prompt-len", "8", "--gen", "4", "--format", "json"])
        .args(["--kv-bits", "4", "--kv-group-size", "32"])
        .ok_stdout();
    let v = last_json(&out);
    assert_eq!(v["kv_quantization"]["bits"], 4, "{v}");
    assert_eq!(v["kv_quantization"]["start"], 5000, "{v}");

    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("p.txt");
    std::fs::write(&prompts, "a\nb\n").unwrap();
    let p = prompts.to_str().unwrap();
    let ids = ["generate", "--prompt-ids", "1,2"];
    refused(
        &m,
        &[&ids[..], &["--kv-bits", "7"]].concat(),
        &["--kv-bits", "7"],
    );
    let odd_group = ["--kv-bits", "4", "--kv-group-size", "48"];
    refused(&m, &[&ids[..], &odd_group].concat(), &["--kv-group-size"]);
    refused(
        &m,
        &[&ids[..], &["--kv-bits", "4"]].concat(),
        &["--kv-group-size", "32"],
    );
    let batch = ["generate", "--prompts-file", p, "--kv-bits", "4"];
    refused(&m, &batch, &["--kv-bits", "--prompts-file"]);
    refused(&m, &["serve", "--kv-bits", "4"], &["--kv-bits", "serve"]);
}

/// `--max-kv-size`: `generate` gives mlx-lm's tokens under its rotating
/// window (the `window` case of `xtask/py/kvq_ref.py`: 10 tokens, the
/// prompt 16), bench reports it, and the bad uses name the option.
#[test]
fn max_kv_size_follows_mlx_lm_and_bad_uses_name_the_option() {
    let (f, m, ints) = kvq_reference();
    let window = ints("window.params")[0].to_string();
    let want = ints("window.tokens");
    let prompt = reference(&f).prompt.clone();
    let got = generated_ids(&m, &prompt, want.len(), &["--max-kv-size", &window]);
    assert_eq!(got, want, "mlx-lm's tokens in its {window}-token window");

    let v = bench_words(&m, "--prompt-len 8 --gen 4 --format json --max-kv-size 6");
    assert_eq!(v["max_kv_size"], 6, "{v}");
    // A given --prefill-chunk wins over the window's cap on the step.
    let args = "--prompt-len 8 --gen 4 --format json --max-kv-size 6 --prefill-chunk 2048";
    assert_eq!(bench_words(&m, args)["dispatch"]["prefill_chunk"], 2048);

    let ids = ["generate", "--prompt-ids", "1,2"];
    let tiny = [&ids[..], &["--max-kv-size", "4"]].concat();
    refused(&m, &tiny, &["--max-kv-size", "4"]);
    let both = [&ids[..], &["--max-kv-size", "64", "--kv-bits", "4"]].concat();
    refused(&m, &both, &["--max-kv-size", "--kv-bits"]);
    refused(
        &m,
        &["serve", "--max-kv-size", "64"],
        &["--max-kv-size", "serve"],
    );
}

/// `mlex bench --batch N` with a drafter: plain and speculative batches
/// alternate; at a forced acceptance of 1 every draft is kept, so rounds
/// keep several tokens a row; without `--force-acceptance` it is refused.
#[test]
fn bench_measures_speculation_in_a_batch() {
    let m = fixture_path("nemotron_h-f32");
    let v = bench_json(
        &m,
        &[
            "--gen",
            "16",
            "--batch",
            "3",
            "--draft-acceptance",
            "1",
            "--force-acceptance",
        ],
    );
    let s = &v["speculative"];
    assert!(s["speedup"]["median"].as_f64().unwrap() > 0.0, "{v}");
    assert!(s["rounds"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(s["accepted"], s["proposed"], "{v}");
    assert!(
        s["decode_steps"].as_u64().unwrap() < v["decode_steps"].as_u64().unwrap(),
        "{v}"
    );
    let e = mlex()
        .arg("bench")
        .arg("--model")
        .arg(&m)
        .args(["--batch", "2", "--draft-acceptance", "0.5"])
        .failed_stderr();
    assert!(e.contains("--force-acceptance"), "{e}");
}
