//! Quantized KV caches (`--kv-bits`) and bounded KV windows
//! (`--max-kv-size`) against mlx-lm's own: its `generate_step` with
//! `kv_bits`, and with its `RotatingKVCache` in place of each
//! full-attention cache, on the same random checkpoints
//! (`xtask/py/kvq_ref.py`), the same prefill schedule (`prompt[:-1]` in
//! steps, then the last token), greedy tokens equal and log-probabilities
//! within 1e-4 of the largest.

use mlex_core::cache::KvQuantization;
use mlex_core::model::Model;
use mlex_testkit::*;
use mlx_rs::Array;
use std::collections::HashMap;

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let s: f32 = row.iter().map(|x| (x - m).exp()).sum();
    row.iter().map(|x| x - m - s.ln()).collect()
}

/// mlx-lm's schedule: the greedy tokens and each step's log-probabilities.
fn trace(model: &Model, prompt: &[i32], step: usize, n: usize) -> (Vec<i32>, Vec<Vec<f32>>) {
    let mut cache = model.make_cache(1).unwrap();
    let mut pos = 0;
    while prompt.len() - pos > 1 {
        let take = step.min(prompt.len() - 1 - pos);
        model
            .forward_hidden(&tokens(&prompt[pos..pos + take]), &mut cache)
            .unwrap();
        mlx_rs::transforms::eval(cache.arrays().iter()).unwrap();
        pos += take;
    }
    let mut logits = model
        .forward_last(&tokens(&prompt[pos..]), &mut cache)
        .unwrap();
    let (mut out, mut rows) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let lp = log_softmax(&to_f32(&logits));
        let t = argmax(&lp);
        out.push(t);
        rows.push(lp);
        logits = model.forward_last(&tokens(&[t]), &mut cache).unwrap();
    }
    (out, rows)
}

fn load(f: &Fixture) -> Model {
    load_dispatched(f, |_| {})
}

/// With the dispatch choices `choose` makes (CUDA's, on this backend).
fn load_dispatched(f: &Fixture, choose: impl Fn(&mut mlex_core::dispatch::Dispatch)) -> Model {
    let registry = mlex_models::registry().unwrap();
    let mut dispatch = mlex_models::dispatch().unwrap();
    choose(&mut dispatch);
    mlex_models::load::load_with_mtp(path_of(f).to_str().unwrap(), registry, &dispatch, false)
        .unwrap()
        .model
}

fn ints(a: &Array) -> Vec<i32> {
    to_f32(a).iter().map(|&x| x as i32).collect()
}

#[test]
fn quantized_kv_follows_mlx_lm() {
    let with = fixtures_where(|f| f.kv_reference.is_some());
    assert_eq!(with.len(), 3, "llama, qwen3_5 and nemotron_h kvq fixtures");
    for f in with {
        let mut model = load(&f);
        let kv = KvReference::of(&f);
        let plain = trace(&model, &kv.prompt, 2048, 8);
        for case in ["early", "late"] {
            let p = kv.params(case);
            model.kv_quantization = Some(KvQuantization::new(p[0], p[1], p[2] as usize).unwrap());
            let got = kv.follows(&model, case, p[3] as usize, "");
            // CUDA's form (dequantized keys, the fused attention): the
            // same tokens, log-probabilities as close.
            let mut dq = load_dispatched(&f, |d| d.dequantize_kv_reads = true);
            dq.kv_quantization = model.kv_quantization;
            kv.follows(&dq, case, p[3] as usize, " dequantized");
            if case == "early" {
                // Quantized keys change what the model computes: the
                // comparison above is of the quantized path.
                assert_moved(&got[0], &plain.1[0], &format!("{}: 4-bit KV", f.name));
            }
        }
        model.kv_quantization = None;
    }
}

/// Fails unless `got` moved away from the plain cache's `plain` (by more
/// than 1e-3): the path compared is really the quantized or bounded one.
fn assert_moved(got: &[f32], plain: &[f32], what: &str) {
    let (d, _) = max_diff(got, plain);
    assert!(d > 1e-3, "{what} left the logits as they were");
}

/// One fixture's mlx-lm reference for its KV cases: the prompt and the
/// traces of `kv_reference` (`CASE.params`, `CASE.tokens`,
/// `CASE.logprobs`).
struct KvReference {
    name: String,
    prompt: Vec<i32>,
    r: HashMap<String, Array>,
}

impl KvReference {
    fn of(f: &Fixture) -> Self {
        let path = fixtures_dir().join(f.kv_reference.as_ref().unwrap());
        Self {
            name: f.name.clone(),
            prompt: reference(f).prompt.clone(),
            r: Array::load_safetensors(path).unwrap(),
        }
    }

    /// `case`'s parameters.
    fn params(&self, case: &str) -> Vec<i32> {
        ints(&self.r[&format!("{case}.params")])
    }

    /// `model`'s trace (in mlx-lm's schedule, prefill steps of `step`)
    /// against the reference `case`: greedy tokens equal, log-probabilities
    /// within 1e-4 of the largest at every step. `form` names the model's
    /// form in a failure. Returns the log-probabilities.
    fn follows(&self, model: &Model, case: &str, step: usize, form: &str) -> Vec<Vec<f32>> {
        let what = format!("{} {case}{form}", self.name);
        let want_tokens = ints(&self.r[&format!("{case}.tokens")]);
        let want = to_f32(&self.r[&format!("{case}.logprobs")]);
        let (got_tokens, got) = trace(model, &self.prompt, step, want_tokens.len());
        assert_eq!(got_tokens, want_tokens, "{what}: tokens");
        let v = want.len() / got.len();
        for (i, row) in got.iter().enumerate() {
            let (d, scale) = max_diff(row, &want[i * v..(i + 1) * v]);
            assert!(
                d <= 1e-4 * scale.max(1.0),
                "{what}: step {i} differs by {d}"
            );
        }
        got
    }
}

#[test]
fn a_bounded_kv_window_follows_mlx_lm() {
    for f in fixtures().into_iter().filter(|f| f.kv_reference.is_some()) {
        let mut model = load(&f);
        let kv = KvReference::of(&f);
        let plain = trace(&model, &kv.prompt, 2048, 1);
        for case in ["window", "window_steps"] {
            let p = kv.params(case);
            assert_eq!(
                p[1] as usize,
                mlex_core::cache::KV_WINDOW_KEEP,
                "kept tokens"
            );
            model.max_kv_size = Some(p[0] as usize);
            let kinds: Vec<&str> = model
                .make_cache(1)
                .unwrap()
                .layers
                .iter()
                .flatten()
                .map(|c| c.kind())
                .collect();
            assert!(
                kinds.contains(&"rotating_kv") && !kinds.contains(&"kv"),
                "{kinds:?}"
            );
            let got = kv.follows(&model, case, p[2] as usize, "");
            // CUDA's form (masked attention as ops): as close.
            let mut ops = load_dispatched(&f, |d| d.masked_attention_ops = true);
            ops.max_kv_size = model.max_kv_size;
            kv.follows(&ops, case, p[2] as usize, " as ops");
            // The 16-token prompt overflows the window: what is compared is
            // the bounded path.
            assert_moved(&got[0], &plain.1[0], &format!("{}: the window", f.name));
        }
        model.max_kv_size = None;
    }
    let e = mlex_core::cache::check_max_kv_size(4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--max-kv-size") && e.contains('4'), "{e}");
}

#[test]
fn a_group_that_does_not_divide_the_head_dim_names_the_option() {
    let mut model = load(&fixture("llama-f32"));
    model.kv_quantization = Some(KvQuantization::new(4, 32, 0).unwrap());
    let mut cache = model.make_cache(1).unwrap();
    let e = model
        .forward_hidden(&tokens(&[1, 2, 3]), &mut cache)
        .expect_err("head dim 16 took groups of 32")
        .to_string();
    assert_mentions(&e, &["--kv-group-size", "16"]);
    for (bits, group, what) in [(7, 64, "--kv-bits"), (4, 48, "--kv-group-size")] {
        let e = KvQuantization::new(bits, group, 0).unwrap_err().to_string();
        assert!(e.contains(what), "{e}");
    }
}

/// Trimming (speculative rollback, prefix reuse) and the saved form keep a
/// quantized cache exact: a cache restored from its tensors, and one fed
/// four tokens and trimmed back, give what the untouched one gives.
#[test]
fn a_quantized_cache_trims_and_restores_exactly() {
    let f = fixture("qwen3_5-kvq-f32");
    let mut model = load(&f);
    model.kv_quantization = Some(KvQuantization::new(4, 32, 0).unwrap());
    let prompt = reference(&f).prompt.clone();
    let mut cache = model.make_cache(1).unwrap();
    model
        .forward_hidden(&tokens(&prompt[..8]), &mut cache)
        .unwrap();
    let kinds: Vec<&str> = cache.layers.iter().flatten().map(|c| c.kind()).collect();
    assert!(
        kinds.contains(&"quantized_kv") && !kinds.contains(&"kv"),
        "{kinds:?}"
    );
    let next = tokens(&prompt[8..12]);
    let want = to_f32(&model.forward_last(&next, &mut cache.clone()).unwrap());

    let mut restored = mlex_core::model::ModelCache {
        layers: cache
            .layers
            .iter()
            .map(|l| {
                l.iter()
                    .map(|c| mlex_core::registry::restore_cache(c.kind(), &c.to_tensors()).unwrap())
                    .collect()
            })
            .collect(),
    };
    let again = to_f32(&model.forward_last(&next, &mut restored).unwrap());
    assert_eq!(again, want, "restored from its saved form");

    // Fed four tokens, then KV trimmed back four (a hybrid's recurrent
    // state comes back from the clone, as a speculative commit picks it).
    let mut fed = cache.clone();
    model.forward_hidden(&next, &mut fed).unwrap();
    for (l, s) in fed.layers.iter_mut().zip(&cache.layers) {
        for (c, s) in l.iter_mut().zip(s) {
            if c.kind() == "quantized_kv" {
                assert_eq!(c.trim(4), 4);
            } else {
                *c = s.clone();
            }
        }
    }
    let trimmed = to_f32(&model.forward_last(&next, &mut fed).unwrap());
    assert_eq!(trimmed, want, "fed, trimmed back and fed again");
}
