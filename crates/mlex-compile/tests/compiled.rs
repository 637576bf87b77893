//! Compiled decode segments against eager decode, and the properties of
//! compiled traces: weights are inputs (an update is seen without a new
//! trace), every trace is its own, and a structural change rebuilds.

use mlex_compile::{CompilePolicy, CompiledTrace, SegmentedDecoder};
use mlex_core::registry::Registry;
use mlex_testkit::*;
use mlx_rs::error::Exception;
use mlx_rs::{ops, Array};

fn values(a: &Array) -> Vec<f32> {
    to_f32(a)
}

/// The float32 safetensors fixtures: every architecture, TOML-only ones too.
fn every_f32_architecture() -> Vec<Fixture> {
    let all: Vec<Fixture> = fixtures()
        .into_iter()
        .filter(|f| f.dtype == "float32" && f.quant.is_none() && f.layout != "gguf")
        .collect();
    assert!(all.len() >= 8, "expected fixtures of every architecture");
    all
}

/// `check` of each of `fixtures` with its registry (a spec-only one's
/// spec too), pushing what differs; fails with every failure.
fn on_each<'a>(
    fixtures: impl IntoIterator<Item = &'a Fixture>,
    mut check: impl FnMut(&Fixture, &Registry, &mut Vec<String>),
) {
    let mut failures = Vec::new();
    for f in fixtures {
        let registry = mlex_models::build_registry(&f.arch_paths()).unwrap();
        check(f, &registry, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn compiled_trace_reads_weights_as_inputs_and_sees_updates() {
    let mut t = CompiledTrace::new();
    let f = || {
        |args: &[Array]| -> Result<Vec<Array>, Exception> {
            Ok(vec![ops::matmul(&args[0], &args[1])?])
        }
    };
    let x = Array::from_slice(&[1f32, 2.0], &[1, 2]);
    let w1 = Array::from_slice(&[1f32, 0.0, 0.0, 1.0], &[2, 2]);
    let w2 = Array::from_slice(&[2f32, 0.0, 0.0, 3.0], &[2, 2]);
    let a = t.call(1, &[x.clone(), w1.clone()], f).unwrap();
    assert_eq!(values(&a[0]), vec![1.0, 2.0]);
    // A new weight value: the next call sees it, with no new trace.
    let b = t.call(1, &[x.clone(), w2.clone()], f).unwrap();
    assert_eq!(values(&b[0]), vec![2.0, 6.0]);
    assert_eq!(t.times_traced(), 1);
    // Compiled equals eager.
    assert_eq!(values(&b[0]), values(&ops::matmul(&x, &w2).unwrap()));
    // A structural change (new key) rebuilds the trace.
    let c = t.call(2, &[x, w1], f).unwrap();
    assert_eq!(values(&c[0]), vec![1.0, 2.0]);
    assert_eq!(t.times_traced(), 2);
}

#[test]
fn traces_of_identical_shapes_stay_separate() {
    // Two closures of the same type, differing only in a captured scalar,
    // called interleaved with identical input shapes.
    let make = |k: f32| {
        move || {
            move |args: &[Array]| -> Result<Vec<Array>, Exception> {
                Ok(vec![ops::multiply(&args[0], Array::from_f32(k))?])
            }
        }
    };
    let mut traces: Vec<CompiledTrace> = (0..4).map(|_| CompiledTrace::new()).collect();
    let x = Array::from_slice(&[1f32, 2.0, 3.0], &[3]);
    for round in 0..2 {
        for (i, t) in traces.iter_mut().enumerate() {
            let out = t
                .call(7, std::slice::from_ref(&x), make(i as f32 + 1.0))
                .unwrap();
            let k = i as f32 + 1.0;
            assert_eq!(
                values(&out[0]),
                vec![k, 2.0 * k, 3.0 * k],
                "trace {i}, round {round}"
            );
        }
    }
    assert!(traces.iter().all(|t| t.times_traced() == 1));
}

/// Greedy-decodes `n` tokens with the compiled decoder.
fn compiled_greedy(
    model: &mlex_core::model::Model,
    prompt: &[i32],
    n: usize,
    policy: CompilePolicy,
) -> (Vec<i32>, Vec<Vec<f32>>, SegmentedDecoder) {
    let mut dec = SegmentedDecoder::with_policy(model, policy);
    let mut cache = model.make_cache(1).unwrap();
    let mut logits = prefill(model, &mut cache, prompt, None);
    let (mut out, mut rows) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let row = to_f32(&logits);
        let t = argmax(&row);
        out.push(t);
        rows.push(row);
        logits = dec.step(model, &tokens(&[t]), &mut cache).unwrap();
    }
    (out, rows, dec)
}

#[test]
fn compiled_decode_equals_eager_on_every_architecture() {
    let all = fixtures();
    let names: Vec<&Fixture> = all
        .iter()
        .filter(|f| {
            (f.dtype == "float32" && f.quant.is_none() && f.layout != "gguf")
                || f.name == "qwen3_next-q4"
                || f.name == "nemotron_h-q4"
        })
        .collect();
    assert!(names.len() >= 8, "expected fixtures of every architecture");
    // The spec-only hybrid too (its spec comes from the fixture's arch_dir).
    assert!(names.iter().any(|f| f.name == "hybrid_mix-f32"));
    on_each(names, |f, registry, failures| {
        let loaded = mlex_models::load::load(path_of(f).to_str().unwrap(), registry).unwrap();
        let model = &loaded.model;
        let r = reference(f);
        let n = 12;
        let (eager, eager_rows) = greedy(model, &r.prompt, n, None);
        for policy in [CompilePolicy::All, CompilePolicy::Recurrent] {
            let (compiled, rows, dec) = compiled_greedy(model, &r.prompt, n, policy);
            let mut worst = 0f32;
            for (a, b) in rows.iter().zip(&eager_rows) {
                let (d, m) = max_diff(a, b);
                worst = worst.max(d / m.max(1.0));
            }
            let tol = if f.quant.is_some() { 1e-3 } else { 1e-5 };
            if compiled != eager || worst > tol {
                failures.push(format!(
                    "{} ({policy:?}): compiled {compiled:?} vs eager {eager:?}, logit diff {worst}",
                    f.name
                ));
            }
            // Each compiled segment traced once for the whole decode; under
            // the default policy exactly the segments with recurrent layers.
            let which = dec.compiled_segments();
            for (k, (&t, &c)) in dec.times_traced().iter().zip(&which).enumerate() {
                assert_eq!(
                    t,
                    usize::from(c),
                    "{} ({policy:?}) segment {k}: {:?}",
                    f.name,
                    dec.times_traced()
                );
            }
            if policy == CompilePolicy::All {
                assert!(which.iter().all(|&c| c));
            } else {
                let recurrent = model.make_cache(1).unwrap().has_fixed_state();
                assert_eq!(which.iter().any(|&c| c), recurrent, "{}", f.name);
            }
            assert_eq!(
                dec.schedule().num_segments(),
                model.layers.iter().filter(|l| l.layer.grows()).count() + 1
            );
        }
    });
}

/// The compiled verify forward of speculative decoding against the eager
/// one, on every architecture, with attention through MLX's kernel and as
/// ops (`Dispatch::ops_attention_rows`): the logits of every position, and the cache
/// after keeping each prefix (growing caches trimmed, fixed-size state
/// picked per position) then one more decode step.
#[test]
fn compiled_verify_equals_eager_verify_on_every_architecture() {
    on_each(&every_f32_architecture(), |f, registry, failures| {
        let loaded = mlex_models::load::load(path_of(f).to_str().unwrap(), registry).unwrap();
        let model = &loaded.model;
        // The same weights with every verify row attending as ops (CUDA's
        // default from 4 rows on), compiled under the first policy.
        let mut ops_rows = mlex_core::dispatch::Dispatch::from_env().unwrap();
        ops_rows.ops_attention_rows = Some((2, 32));
        let path = path_of(f);
        let with_ops = mlex_models::load::load_with(path.to_str().unwrap(), registry, &ops_rows);
        let with_ops = with_ops.unwrap().model;
        let r = reference(f);
        let mut base = model.make_cache(1).unwrap();
        prefill(model, &mut base, &r.prompt, None);
        for (policy, model) in [
            (CompilePolicy::All, &with_ops),
            (CompilePolicy::Recurrent, model),
        ] {
            let mut dec = SegmentedDecoder::with_policy(model, policy);
            for (t, kept) in [(2usize, 1usize), (4, 4), (7, 3), (4, 2)] {
                let ids: Vec<i32> = (0..t as i32).map(|i| (7 * i + 3) % 50).collect();
                let (mut eager_cache, mut compiled_cache) = (base.clone(), base.clone());
                let (le, se) = loaded
                    .model
                    .verify(&tokens(&ids), &mut eager_cache)
                    .unwrap();
                let (lc, sc) = dec
                    .verify(model, &tokens(&ids), &mut compiled_cache)
                    .unwrap();
                assert_eq!(lc.shape(), le.shape(), "{}", f.name);
                let mut worst = relative(&to_f32(&lc), &to_f32(&le));
                eager_cache.commit(se, kept).unwrap();
                compiled_cache.commit(sc, kept).unwrap();
                let (ae, ac) = (eager_cache.arrays(), compiled_cache.arrays());
                assert_eq!(ae.len(), ac.len());
                for (a, b) in ae.iter().zip(&ac) {
                    assert_eq!(a.shape(), b.shape(), "{}: a cache array", f.name);
                    worst = worst.max(relative(&to_f32(b), &to_f32(a)));
                }
                let next = tokens(&[11]);
                let after_e = loaded.model.forward_last(&next, &mut eager_cache).unwrap();
                let after_c = dec.step(model, &next, &mut compiled_cache).unwrap();
                worst = worst.max(relative(&to_f32(&after_c), &to_f32(&after_e)));
                if worst > 1e-5 {
                    failures.push(format!(
                        "{} ({policy:?}) T={t} kept {kept}: relative difference {worst}",
                        f.name
                    ));
                }
            }
            // One trace per verified length (2, 4, 7) in every compiled
            // segment, none in the eager ones; the decode step's own.
            let which = dec.compiled_segments();
            for (k, (&n, &c)) in dec.verify_times_traced().iter().zip(&which).enumerate() {
                assert_eq!(
                    n,
                    if c { 3 } else { 0 },
                    "{} ({policy:?}) segment {k}",
                    f.name
                );
            }
        }
    });
}

/// A forward handed to MLX one layer at a time (`Dispatch::layer_sync_rows`,
/// CUDA's prefill default; Gated DeltaNet scans in pieces) against one graph
/// a step, on every architecture: the same logits of every position
/// (within 1e-5 of the largest), and the same cache (a decode step after it
/// gives the same logits).
#[test]
fn a_forward_one_layer_at_a_time_equals_one_graph_on_every_architecture() {
    on_each(&every_f32_architecture(), |f, registry, failures| {
        let path = path_of(f);
        // Chunks of 2 tokens, so that the layered run's Gated DeltaNet
        // scans go in pieces of 4 (`Dispatch::scan_piece`).
        let mut whole = mlex_core::dispatch::Dispatch::from_env().unwrap();
        whole.layer_sync_rows = None;
        whole.gated_delta_chunk = Some(2);
        let mut layered = whole.clone();
        layered.layer_sync_rows = Some(2);
        layered.scan_piece = 4;
        let run = |d: &mlex_core::dispatch::Dispatch| {
            let m = mlex_models::load::load_with(path.to_str().unwrap(), registry, d)
                .unwrap()
                .model;
            let prompt = &reference(f).prompt;
            let mut cache = m.make_cache(1).unwrap();
            let half = prompt.len() / 2;
            let first = m.forward(&tokens(&prompt[..half]), &mut cache).unwrap();
            mlx_rs::transforms::eval(cache.arrays().iter()).unwrap();
            let rest = m.forward(&tokens(&prompt[half..]), &mut cache).unwrap();
            let next = m.forward_last(&tokens(&[5]), &mut cache).unwrap();
            [first, rest, next].map(|a| values(&a))
        };
        // Pieces make other (smaller) batched products than one scan, so
        // another BLAS may round them differently: within 1e-5, not bitwise.
        let (a, b) = (run(&whole), run(&layered));
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| relative(y, x))
            .fold(0.0f32, f32::max);
        if worst > 1e-5 {
            failures.push(format!("{} differs ({worst:.2e})", f.name));
        }
    });
}

#[test]
fn quantized_expert_products_cut_by_experts_equal_one_call() {
    // Two experts a token, at most one pair a call: a decode step's
    // products go in two calls each; the prompt's stay in one.
    on_each(
        &[fixture("qwen3_moe-q4"), fixture("nemotron_h-q4")],
        |f, registry, failures| {
            let path = path_of(f);
            let mut one = mlex_core::dispatch::Dispatch::from_env().unwrap();
            one.gather_pairs = None;
            let mut cut = one.clone();
            cut.gather_pairs = Some(1);
            let run = |d: &mlex_core::dispatch::Dispatch| {
                let m = mlex_models::load::load_with(path.to_str().unwrap(), registry, d)
                    .unwrap()
                    .model;
                let mut cache = m.make_cache(1).unwrap();
                let mut out = vec![values(
                    &m.forward_last(&tokens(&reference(f).prompt), &mut cache)
                        .unwrap(),
                )];
                for t in [5, 9, 2] {
                    out.push(values(&m.forward_last(&tokens(&[t]), &mut cache).unwrap()));
                }
                out
            };
            // Each (row, expert) product is computed alone in either form.
            if run(&one) != run(&cut) {
                failures.push(format!("{}: the cut products differ", f.name));
            }
        },
    );
}

/// The largest difference between `a` and `b` relative to `b`'s largest
/// magnitude (at least 1).
fn relative(a: &[f32], b: &[f32]) -> f32 {
    let (d, m) = max_diff(a, b);
    d / m.max(1.0)
}

#[test]
fn a_weight_update_after_compiling_changes_the_next_step() {
    let f = fixture("qwen3_5-f32");
    let registry = mlex_models::registry().unwrap();
    let mut loaded = mlex_models::load::load(path_of(&f).to_str().unwrap(), registry).unwrap();
    let r = reference(&f);
    let model = &mut loaded.model;
    let mut dec = SegmentedDecoder::with_policy(model, CompilePolicy::All);
    let mut cache = model.make_cache(1).unwrap();
    prefill(model, &mut cache, &r.prompt, None);
    let snapshot = cache.clone();
    let before = to_f32(&dec.step(model, &tokens(&[5]), &mut cache).unwrap());
    // Scale the final norm: a weight read by the last compiled segment.
    let name = "language_model.model.norm.weight";
    let w = model.params.get(model.params.find(name).unwrap()).clone();
    model
        .update_weight(name, ops::multiply(&w, Array::from_f32(2.0)).unwrap())
        .unwrap();
    let mut cache = snapshot.clone();
    let after = to_f32(&dec.step(model, &tokens(&[5]), &mut cache).unwrap());
    let (d, _) = max_diff(&after, &before);
    assert!(d > 1e-3, "the update must change the logits (diff {d})");
    // And equals a fresh eager step with the new weights.
    let mut cache = snapshot;
    let eager = to_f32(&model.forward_last(&tokens(&[5]), &mut cache).unwrap());
    assert_close(&after, &eager, 1e-5, "compiled after update and eager");
    assert!(
        dec.times_traced().iter().all(|&t| t == 1),
        "a value update must not retrace: {:?}",
        dec.times_traced()
    );
}

#[test]
fn quantizing_rebuilds_the_traces() {
    let f = fixture("qwen3_5-f32");
    let registry = mlex_models::registry().unwrap();
    let model = mlex_models::load::load(path_of(&f).to_str().unwrap(), registry)
        .unwrap()
        .model;
    let r = reference(&f);
    let mut dec = SegmentedDecoder::with_policy(&model, CompilePolicy::All);
    let mut cache = model.make_cache(1).unwrap();
    prefill(&model, &mut cache, &r.prompt, None);
    let dense = to_f32(&dec.step(&model, &tokens(&[5]), &mut cache).unwrap());
    assert!(dec.times_traced().iter().all(|&t| t == 1));

    let arch = registry.architecture("qwen3_5").unwrap();
    let q = mlex_models::quantize::quantize(&model, arch.as_ref(), registry, 64, 4).unwrap();
    assert!(
        q.params.len() > model.params.len(),
        "scales and biases were added"
    );
    let mut cache = q.make_cache(1).unwrap();
    prefill(&q, &mut cache, &r.prompt, None);
    let snapshot = cache.clone();
    let compiled = to_f32(&dec.step(&q, &tokens(&[5]), &mut cache).unwrap());
    assert!(
        dec.times_traced().iter().all(|&t| t == 2),
        "new weight structure, new traces: {:?}",
        dec.times_traced()
    );
    let mut cache = snapshot;
    let eager = to_f32(&q.forward_last(&tokens(&[5]), &mut cache).unwrap());
    assert_close(
        &compiled,
        &eager,
        1e-5,
        "compiled on the quantized model and eager",
    );
    let (d, _) = max_diff(&compiled, &dense);
    assert!(d > 1e-4, "4-bit weights change the logits");
    assert!(mlex_models::quantize::quantize(&q, arch.as_ref(), registry, 64, 4).is_err());
}

/// An MLX exception inside a forward pass and inside a compiled segment
/// (float token ids: the embedding's gather throws) comes back as an error,
/// and MLX keeps working afterwards.
#[test]
fn mlx_exceptions_in_a_forward_pass_and_a_compiled_segment_are_errors() {
    let f = fixture("qwen3_5-f32");
    let registry = mlex_models::registry().unwrap();
    let loaded = mlex_models::load::load(path_of(&f).to_str().unwrap(), registry).unwrap();
    let model = &loaded.model;
    let bad = Array::from_slice(&[1.5f32, 2.5], &[1, 2]);
    let mut cache = model.make_cache(1).unwrap();
    let e = model
        .forward(&bad, &mut cache)
        .and_then(|y| Ok(y.eval()?))
        .expect_err("float token ids in a forward pass");
    assert!(!e.to_string().is_empty());
    let mut dec = SegmentedDecoder::new(model);
    let mut cache = model.make_cache(1).unwrap();
    let one_bad = Array::from_slice(&[1.5f32], &[1, 1]);
    let e = dec
        .step(model, &one_bad, &mut cache)
        .and_then(|y| Ok(y.eval()?))
        .expect_err("float token ids in a compiled segment");
    assert!(!e.to_string().is_empty());
    // Both paths still work.
    let good = Array::from_slice(&[1i32], &[1, 1]);
    let mut cache = model.make_cache(1).unwrap();
    dec.step(model, &good, &mut cache).unwrap().eval().unwrap();
    let mut cache = model.make_cache(1).unwrap();
    model.forward(&good, &mut cache).unwrap().eval().unwrap();
}
