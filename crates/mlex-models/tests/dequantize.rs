//! Dequantizing a loaded model (`--weights dense`) keeps its numbers: on a
//! checkpoint with per-module quantization overrides (fixture `llama-mixed`:
//! 4-bit by default, `model.layers.1.mlp.*` at 8 bits, one projection at
//! group 32, one unquantized), whose projections are fused at load, the
//! dense model's logits equal the stored model's and mlx-lm's.

use mlex_models::load::load;
use mlex_models::quantize::dequantize;
use mlex_testkit::*;

#[test]
fn a_mixed_quantization_dequantizes_to_the_same_logits() {
    let f = fixture("llama-mixed");
    let registry = mlex_models::registry().unwrap();
    let loaded = load(path_of(&f).to_str().unwrap(), registry).unwrap();
    let stored = &loaded.model;
    let arch = registry.architecture(&stored.arch).unwrap();
    let dense = dequantize(stored, arch.as_ref(), registry, mlx_rs::Dtype::Float32)
        .unwrap()
        .expect("a quantized model");
    assert!(dense.quantization.is_none());
    let r = reference(&f);
    let logits = |m: &mlex_core::model::Model| {
        let mut cache = m.make_cache(1).unwrap();
        to_f32(&m.forward(&tokens(&r.prompt), &mut cache).unwrap())
    };
    let (want, theirs) = (logits(stored), to_f32(&r.logits_full));
    let got = logits(&dense);
    let (d, m) = max_diff(&got, &want);
    assert!(d <= 1e-4 * m.max(1.0), "dense vs stored: {d} (max {m})");
    let (d, m) = max_diff(&got, &theirs);
    assert!(d <= 1e-4 * m.max(1.0), "dense vs mlx-lm: {d} (max {m})");
}
