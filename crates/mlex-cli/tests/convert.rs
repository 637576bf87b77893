//! `mlex convert` and `mlex perplexity` against mlx-lm: a checkpoint mlex
//! writes holds what `mlx_lm.convert` writes from the same input (tensors,
//! quantization block, index), mlx-lm loads it and computes mlex's logits
//! on it; mlex's perplexity equals `mlx_lm.perplexity`'s `eval_ppl` on the
//! same windows. Bad input leaves nothing behind.

mod server;

use assert_cmd::Command;
use mlex_testkit::*;
use serde_json::Value;
use server::python;
use std::path::{Path, PathBuf};

fn mlex(args: &[&str]) -> std::process::Output {
    Command::cargo_bin("mlex")
        .unwrap()
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = mlex(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "mlex {args:?} failed:\n{err}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// mlex's and mlx-lm's float32 logits of `model` on a few ids, compared.
fn same_logits(model: &Path, tolerance: f32) {
    let tmp = tempfile::tempdir().unwrap();
    let ids = "1,5,9,17,33,65,100,7";
    let (ours, theirs) = (tmp.path().join("mlex.npy"), tmp.path().join("mlxlm.npy"));
    ok(&[
        "logits",
        "--model",
        s(model),
        "--prompt-ids",
        ids,
        "--out",
        s(&ours),
    ]);
    python(
        "mlxlm_check.py",
        &[
            "logits",
            "--model",
            s(model),
            "--ids",
            ids,
            "--out",
            s(&theirs),
        ],
    );
    let a = mlx_rs::Array::load_numpy(&ours).unwrap();
    let b = mlx_rs::Array::load_numpy(&theirs).unwrap();
    assert_eq!(a.shape(), b.shape());
    let (abs, scale) = max_diff(&to_f32(&a), &to_f32(&b));
    assert!(
        abs <= tolerance * scale,
        "{}: logits differ by {abs} (the largest is {scale})",
        model.display()
    );
}

/// A copy of the checkpoint `src` with qwen3-chat's tokenizer files beside
/// it: `mlx_lm.convert` will not run without a tokenizer (the vocabulary
/// need not match for writing weights).
fn with_tokenizer(src: &Path, dir: &Path) -> PathBuf {
    let out = dir.join("src");
    std::fs::create_dir(&out).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, out.join(p.file_name().unwrap())).unwrap();
    }
    let chat = path_of(&fixture("qwen3-chat"));
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(chat.join(f), out.join(f)).unwrap();
    }
    out
}

/// `mlex convert` with `ours` and `mlx_lm.convert` with `theirs` on `src`:
/// the same checkpoint; mlx-lm loads mlex's and gives its logits.
fn converts_as_mlx_lm(src: &Path, ours: &[&str], theirs: &[&str], tolerance: f32) {
    let tmp = tempfile::tempdir().unwrap();
    let src = &with_tokenizer(src, tmp.path());
    let (a, b) = (tmp.path().join("mlex"), tmp.path().join("mlxlm"));
    let mut args = vec!["convert", "--model", s(src), "--out", s(&a)];
    args.extend(ours);
    ok(&args);
    let mut py = vec!["convert", "--model", s(src), "--out", s(&b)];
    py.extend(theirs);
    python("mlxlm_check.py", &py);
    let out = python("mlxlm_check.py", &["compare", s(&a), s(&b)]);
    assert!(out.contains("same:"), "{out}");
    same_logits(&a, tolerance);
}

#[test]
fn converted_checkpoints_are_what_mlx_lm_writes_and_loads() {
    let llama = path_of(&fixture("llama-f32"));
    converts_as_mlx_lm(
        &llama,
        &["--quantize", "4"],
        &["-q", "--q-bits", "4", "--q-group-size", "64"],
        1e-4,
    );
    converts_as_mlx_lm(
        &llama,
        &["--quantize", "8", "--group-size", "32"],
        &["-q", "--q-bits", "8", "--q-group-size", "32"],
        1e-4,
    );
    converts_as_mlx_lm(
        &llama,
        &["--quant-recipe", "mixed-3-6"],
        &[
            "-q",
            "--quant-predicate",
            "mixed_3_6",
            "--q-group-size",
            "64",
        ],
        1e-4,
    );
    converts_as_mlx_lm(
        &llama,
        &["--dtype", "bfloat16"],
        &["--dtype", "bfloat16"],
        2e-2,
    );
    converts_as_mlx_lm(
        &path_of(&fixture("llama-q4")),
        &["--dequantize"],
        &["-d"],
        1e-4,
    );
    // Hybrids: mlx-lm loads what mlex writes and computes the same logits.
    for (name, extra) in [
        ("qwen3_5-f32", vec!["--quantize", "4"]),
        (
            "nemotron_h-f32",
            vec!["--quantize", "4", "--shard-size", "40KB"],
        ),
        ("qwen3_next-f32", vec!["--dtype", "float32"]),
        ("gguf-q8_0", vec!["--dequantize"]),
    ] {
        let src = path_of(&fixture(name));
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let mut args = vec![
            "convert",
            "--model",
            s(&src),
            "--out",
            s(&out),
            "--format",
            "json",
        ];
        args.extend(&extra);
        let v: Value = serde_json::from_str(ok(&args).lines().last().unwrap()).unwrap();
        if extra.contains(&"--shard-size") {
            assert!(v["files"].as_array().unwrap().len() > 1, "{name}: {v}");
        }
        let tol = if extra.contains(&"--quantize") {
            1e-4
        } else {
            tolerance(&fixture(name))
        };
        same_logits(&out, tol);
    }
}

#[test]
fn bad_conversions_name_the_option_and_leave_nothing() {
    let llama = path_of(&fixture("llama-f32"));
    let tmp = tempfile::tempdir().unwrap();
    let exists = tmp.path().join("exists");
    std::fs::create_dir(&exists).unwrap();
    let fresh = tmp.path().join("fresh");
    let q4 = path_of(&fixture("llama-q4"));
    let (l, e, f, q) = (s(&llama), s(&exists), s(&fresh), s(&q4));
    // The paths are a temporary folder's: no spaces to split on.
    for (line, needle) in [
        (format!("--model {l} --out {e} --quantize 4"), "--out"),
        (format!("--model {l} --out {f} --quantize 7"), "--quantize"),
        (
            format!("--model {l} --out {f} --quantize 4 --group-size 48"),
            "--group-size",
        ),
        (format!("--model {q} --out {f} --quantize 4"), "--quantize"),
        (format!("--model {l} --out /nonexistent/dir/out"), "--out"),
        (
            format!("--model {l} --out {f} --quantize 4 --dequantize"),
            "--dequantize",
        ),
    ] {
        let args: Vec<&str> = line.split_whitespace().collect();
        let mut all = vec!["convert"];
        all.extend(&args);
        let out = mlex(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!fresh.exists(), "{args:?} left {}", fresh.display());
        let left: Vec<PathBuf> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(left, vec![exists.clone()], "{args:?} left files behind");
        assert_eq!(
            std::fs::read_dir(&exists).unwrap().count(),
            0,
            "the existing folder is untouched"
        );
    }
}

/// A few paragraphs, as documents of a .jsonl file and as one text.
fn texts(dir: &Path) -> (PathBuf, PathBuf) {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .unwrap();
    let paras: Vec<&str> = readme
        .split("\n\n")
        .filter(|p| p.len() > 200)
        .take(4)
        .collect();
    let jsonl = dir.join("docs.jsonl");
    let lines: Vec<String> = paras
        .iter()
        .map(|p| serde_json::json!({"text": p}).to_string())
        .collect();
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    let txt = dir.join("book.txt");
    std::fs::write(&txt, paras.join("\n\n")).unwrap();
    (jsonl, txt)
}

#[test]
fn perplexity_equals_mlx_lm_s() {
    let model = tools_fixture();
    let tmp = tempfile::tempdir().unwrap();
    let (jsonl, txt) = texts(tmp.path());
    for (data, context, stride) in [
        (&jsonl, "32", None),
        (&txt, "48", None),
        (&jsonl, "32", Some("12")),
    ] {
        let mut args = vec![
            "perplexity",
            "--model",
            s(&model),
            "--data",
            s(data),
            "--context",
            context,
            "--format",
            "json",
        ];
        let mut py = vec![
            "perplexity",
            "--model",
            s(&model),
            "--data",
            s(data),
            "--sequence-length",
            context,
        ];
        if let Some(st) = stride {
            args.extend(["--stride", st]);
            py.extend(["--stride", st]);
        }
        let ours: Value = serde_json::from_str(ok(&args).lines().last().unwrap()).unwrap();
        let theirs: Value =
            serde_json::from_str(python("mlxlm_check.py", &py).lines().last().unwrap()).unwrap();
        assert_eq!(ours["windows"], theirs["windows"], "{data:?} {context}");
        for k in ["perplexity", "standard_error"] {
            let (x, y) = (ours[k].as_f64().unwrap(), theirs[k].as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-4 * y.abs(),
                "{data:?} {context} {stride:?}: {k} {x} vs {y}"
            );
        }
    }
    let short = tmp.path().join("short.txt");
    std::fs::write(&short, "Too short.").unwrap();
    let out = mlex(&[
        "perplexity",
        "--model",
        s(&model),
        "--data",
        s(&short),
        "--context",
        "512",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--data"));
}
