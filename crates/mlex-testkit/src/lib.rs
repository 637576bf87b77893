//! Test support shared by the crates' integration tests: fixture discovery
//! and comparisons.
//!
//! Fixtures are made by `cargo xtask fixtures` (mlx-lm, the Python
//! reference, and the NumPy DharaAR reference) into `target/fixtures`
//! (override with `MLEX_FIXTURES`). When they are missing, a test that
//! needs them fails with the command that makes them: none passes by
//! skipping (`xtask/tests/repository_rules.rs` keeps it so).
#![allow(missing_docs)]

pub mod hub;

use mlex_core::model::{Model, ModelCache};
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The f32 fixtures of the first seven families, one of each mixer and
/// feed-forward they combine (attention, gated delta, Mamba2, canon
/// convolutions; dense and mixture-of-experts): what a test runs on when it
/// must cover every kind and not every family.
pub const EACH_KIND_F32: [&str; 7] = [
    "llama-f32",
    "qwen3-f32",
    "qwen3_moe-f32",
    "qwen3_next-f32",
    "qwen3_5-f32",
    "nemotron_h-f32",
    "dhara-f32",
];

/// One manifest entry.
#[derive(Clone, Debug, Deserialize)]
pub struct Fixture {
    pub name: String,
    pub arch: String,
    pub dtype: String,
    pub quant: Option<serde_json::Value>,
    pub layout: String,
    pub path: String,
    pub reference: String,
    #[serde(default)]
    pub notes: String,
    /// A directory of architecture specs (relative to the repository root)
    /// the fixture's `model_type` needs: one no built-in serves.
    pub arch_dir: Option<String>,
    /// The reference of the checkpoint's multi-token-prediction head
    /// (`xtask/py/mtp_ref.py`), when it has one.
    pub mtp_reference: Option<String>,
    /// mlx-lm's traces with a quantized KV cache (`xtask/py/kvq_ref.py`),
    /// when the fixture has them.
    pub kv_reference: Option<String>,
}

impl Fixture {
    /// The extra architecture paths to build a registry with.
    pub fn arch_paths(&self) -> Vec<PathBuf> {
        self.arch_dir
            .iter()
            .map(|d| Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(d))
            .collect()
    }
}

#[derive(Deserialize)]
struct Manifest {
    fixtures: Vec<Fixture>,
}

pub fn fixtures_dir() -> PathBuf {
    std::env::var_os("MLEX_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/fixtures"))
}

/// All fixtures of both manifests. Missing fixtures fail the test with the
/// command that makes them: a test that needs a fixture never passes by
/// skipping.
pub fn fixtures() -> Vec<Fixture> {
    let dir = fixtures_dir();
    let mut all = Vec::new();
    for m in ["manifest.json", "dhara-manifest.json"] {
        let path = dir.join(m);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|_| {
            panic!(
                "fixtures missing: {} (run `cargo xtask fixtures`, or `cargo xtask test`)",
                path.display()
            )
        });
        let parsed: Manifest = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(_) => {
                // dhara's manifest is a bare list
                let list: Vec<Fixture> = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                Manifest { fixtures: list }
            }
        };
        all.extend(parsed.fixtures);
    }
    all
}

/// The Python of the reference venv that made the fixtures (it has mlx-lm
/// and the `openai` client), and the folder of the repository's Python
/// scripts. Fails like a missing fixture when the manifest does not name
/// one.
pub fn reference_python() -> (PathBuf, PathBuf) {
    let path = fixtures_dir().join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "fixtures missing: {} (run `cargo xtask fixtures`, or `cargo xtask test`)",
            path.display()
        )
    });
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let py = v["python"].as_str().map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "{} names no Python (made by an older xtask: run `cargo xtask fixtures`)",
            path.display()
        )
    });
    assert!(
        py.exists(),
        "{}: the reference Python {} is gone (run `cargo xtask fixtures`)",
        path.display(),
        py.display()
    );
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../xtask/py");
    (py, scripts)
}

/// The agent-server fixture `qwen3-tools` (`xtask/py/tool_fixture.py`): a
/// tiny Qwen3 with the real Qwen3 tokenizer and chat template, its
/// `render.json` and `logprobs.json` references. Not in the manifest's list
/// (its model is plain qwen3); missing, it fails like a missing fixture.
pub fn tools_fixture() -> PathBuf {
    let dir = fixtures_dir().join("qwen3-tools");
    assert!(
        dir.join("render.json").is_file(),
        "fixture missing: {} (run `cargo xtask fixtures`, or `cargo xtask test`)",
        dir.display()
    );
    dir
}

/// The fixtures `keep` takes, in the manifest's order.
pub fn fixtures_where(keep: impl Fn(&Fixture) -> bool) -> Vec<Fixture> {
    fixtures().into_iter().filter(|f| keep(f)).collect()
}

/// The fixture called `name` (see [`fixtures`]).
pub fn fixture(name: &str) -> Fixture {
    fixtures()
        .into_iter()
        .find(|f| f.name == name)
        .unwrap_or_else(|| {
            panic!("no fixture `{name}` in the manifest (run `cargo xtask fixtures`)")
        })
}

pub fn path_of(f: &Fixture) -> PathBuf {
    let p = Path::new(&f.path);
    if p.is_absolute() {
        p.to_owned()
    } else {
        fixtures_dir().join(p)
    }
}

/// The reference tensors of a fixture.
pub struct Reference {
    pub prompt: Vec<i32>,
    pub logits_full: Array,
    pub greedy: Vec<i32>,
    pub step_logits: Array,
}

pub fn reference(f: &Fixture) -> Reference {
    let path = fixtures_dir().join(&f.reference);
    let t: HashMap<String, Array> =
        Array::load_safetensors(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let ints = |k: &str| -> Vec<i32> {
        let a = t[k].as_dtype(Dtype::Int32).unwrap();
        a.eval().unwrap();
        a.try_as_slice::<i32>().unwrap().to_vec()
    };
    Reference {
        prompt: ints("prompt"),
        logits_full: t["logits_full"].as_dtype(Dtype::Float32).unwrap(),
        greedy: ints("greedy"),
        step_logits: t["step_logits"].as_dtype(Dtype::Float32).unwrap(),
    }
}

pub fn tokens(ids: &[i32]) -> Array {
    Array::from_slice(ids, &[1, ids.len() as i32])
}

pub fn to_f32(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).unwrap().contiguous().unwrap();
    a.eval().unwrap();
    a.try_as_slice::<f32>().unwrap().to_vec()
}

/// Max |a - b| and the max |b|.
pub fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "shapes differ");
    let mut d = 0f32;
    let mut m = 0f32;
    for (x, y) in a.iter().zip(b) {
        d = d.max((x - y).abs());
        m = m.max(y.abs());
    }
    (d, m)
}

/// The last JSON object line of a command's output (`--format json`
/// reports end with one).
#[track_caller]
pub fn last_json(out: &[u8]) -> serde_json::Value {
    let text = String::from_utf8_lossy(out);
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .expect("a JSON line");
    serde_json::from_str(line).unwrap()
}

/// Asserts `text` (an error message, a command's output) contains every
/// one of `needles`, showing the text otherwise.
#[track_caller]
pub fn assert_mentions(text: &str, needles: &[&str]) {
    let missing: Vec<&&str> = needles.iter().filter(|n| !text.contains(**n)).collect();
    assert!(missing.is_empty(), "{missing:?} not in: {text}");
}

/// Asserts `a` and `b` differ by at most `rel` times the largest magnitude
/// of `b` (at least 1), naming `what` and both numbers otherwise.
#[track_caller]
pub fn assert_close(a: &[f32], b: &[f32], rel: f32, what: &str) {
    let (d, m) = max_diff(a, b);
    assert!(d <= rel * m.max(1.0), "{what} differ by {d} (largest {m})");
}

pub fn argmax(row: &[f32]) -> i32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as i32
}

/// Greedy decode: the prompt in one pass (or in `chunk`-token pieces), then
/// `n` tokens one at a time; returns tokens and the logits each came from.
pub fn greedy(
    model: &Model,
    prompt: &[i32],
    n: usize,
    chunk: Option<usize>,
) -> (Vec<i32>, Vec<Vec<f32>>) {
    let mut cache = model.make_cache(1).unwrap();
    let mut logits = prefill(model, &mut cache, prompt, chunk);
    let mut out = Vec::new();
    let mut rows = Vec::new();
    for _ in 0..n {
        let row = to_f32(&logits);
        let t = argmax(&row);
        out.push(t);
        rows.push(row);
        logits = model.forward_last(&tokens(&[t]), &mut cache).unwrap();
    }
    (out, rows)
}

pub fn prefill(
    model: &Model,
    cache: &mut ModelCache,
    prompt: &[i32],
    chunk: Option<usize>,
) -> Array {
    let c = chunk.unwrap_or(prompt.len()).max(1);
    let mut last = None;
    for piece in prompt.chunks(c) {
        if last.is_some() {
            // As the engine's prefill does: one evaluation per piece (one
            // graph over several pieces' cache writes is wrong on MLX's
            // CUDA backend; see `mlex_generate`'s prefill).
            mlx_rs::transforms::eval(cache.arrays().iter()).unwrap();
        }
        last = Some(model.forward_last(&tokens(piece), cache).unwrap());
    }
    last.expect("non-empty prompt")
}

/// Tolerance on logits by fixture dtype/quantization (stated in the
/// README's "Parity with mlx-lm" section).
pub fn tolerance(f: &Fixture) -> f32 {
    match (f.dtype.as_str(), f.quant.is_some(), f.layout.as_str()) {
        // F32 tensors are read as they are; Q4_K and Q5_K map exactly to
        // affine 4/5-bit with float32 scales, computed in float32.
        (_, _, "gguf")
            if f.name.ends_with("f32") || f.name.ends_with("q4_k") || f.name.ends_with("q5_k") =>
        {
            1e-4
        }
        // The hybrids' Q8_0 references compute in float16 as mlex does.
        (_, _, "gguf")
            if ["qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h"]
                .contains(&f.arch.as_str()) =>
        {
            1e-3
        }
        (_, _, "gguf") => 2e-2,
        ("float32", false, _) => 1e-4,
        ("float32", true, _) => 1e-3,
        ("float16", _, _) => 2e-2,
        _ => 5e-2,
    }
}

/// A copy of the checkpoint directory `src` in a temporary directory, with
/// `edit` applied to its `config.json` (a smaller context, another
/// `model_type`).
pub fn copy_with_config(
    src: &Path,
    edit: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let cfg = dir.path().join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&cfg, v.to_string()).unwrap();
    dir
}

/// `n` deterministic pseudo-random token ids in `[0, vocab)`, one stream
/// per `seed`.
pub fn random_ids(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    mlex_core::ids::lcg_ids(
        seed.wrapping_mul(0x9e3779b97f4a7c15) | 1,
        n,
        u64::from(vocab),
    )
}

/// The gap between the two largest logits after `prefix` (one full forward
/// of `model`).
pub fn top2_gap(model: &mlex_core::model::Model, prefix: &[u32]) -> f32 {
    let ids: Vec<i32> = prefix.iter().map(|&t| t as i32).collect();
    let mut cache = model.make_cache(1).unwrap();
    let mut row = to_f32(&model.forward_last(&tokens(&ids), &mut cache).unwrap());
    row.sort_by(|a, b| b.partial_cmp(a).unwrap());
    row[0] - row[1]
}

/// `got` (greedy tokens after `prompt`, by another path) equals `want`; a
/// difference is allowed only where `want`'s path had its two best logits
/// within 1e-4: a tie that rounding may break either way, not an error.
pub fn assert_same_but_near_ties(
    model: &mlex_core::model::Model,
    prompt: &[u32],
    want: &[u32],
    got: &[u32],
    what: &str,
) {
    if want == got {
        return;
    }
    let i = want
        .iter()
        .zip(got)
        .position(|(a, b)| a != b)
        .unwrap_or(want.len().min(got.len()));
    let mut prefix = prompt.to_vec();
    prefix.extend(&want[..i]);
    let gap = top2_gap(model, &prefix);
    assert!(
        gap < 1e-4 && i < want.len() && i < got.len(),
        "{what}: the output differs at token {i} (top-2 logit gap {gap}):\n want {want:?}\n got  {got:?}"
    );
    eprintln!("{what}: a near tie at token {i} (gap {gap}) broke differently");
}

/// A command of the binaries under test, run to the outcome a test
/// expects.
pub trait RunExt {
    /// Runs it, asserts that it succeeded, and returns its stdout.
    fn ok_stdout(&mut self) -> Vec<u8>;
    /// Runs it, asserts that it failed, and returns its stderr (invalid
    /// UTF-8 replaced).
    fn failed_stderr(&mut self) -> String;
}

impl RunExt for assert_cmd::Command {
    fn ok_stdout(&mut self) -> Vec<u8> {
        self.assert().success().get_output().stdout.clone()
    }

    fn failed_stderr(&mut self) -> String {
        String::from_utf8_lossy(&self.assert().failure().get_output().stderr).into_owned()
    }
}
