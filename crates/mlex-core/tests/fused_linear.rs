//! Fused projections and LayerNorm: a fused product equals its parts' own
//! products (dense, biased, quantized), parts stored differently stay
//! separate, a checkpoint holding the fused name loads as it is, and
//! `nn::LayerNorm` equals LayerNorm written out with plain loops.

use mlex_core::config::ModelConfig;
use mlex_core::nn::{fused_name, FusedLinear, Norm, NormKind};
use mlex_core::params::ParamStore;
use mlex_core::quant::Quantization;
use mlex_core::weights::{WeightLoader, WeightMap};
use mlx_rs::{ops, Array};
use serde_json::json;

mod common;
use common::data;

fn values(a: &Array) -> Vec<f32> {
    // The parts of a fused product are strided views: copy to read them.
    let a = a
        .as_dtype(mlx_rs::Dtype::Float32)
        .unwrap()
        .contiguous()
        .unwrap();
    a.eval().unwrap();
    a.try_as_slice::<f32>().unwrap().to_vec()
}

const IN: i32 = 64;
const PARTS: [(&str, i32); 3] = [("l.q_proj", 32), ("l.k_proj", 16), ("l.v_proj", 16)];

/// A checkpoint with the three parts; `quantize[i]` packs part i to 4 bits
/// in groups of 32.
fn checkpoint(quantize: [bool; 3], bias: bool) -> (WeightMap, Quantization) {
    let mut map = WeightMap::new();
    let file = map.add_file("test.safetensors".into());
    for (i, (name, out)) in PARTS.iter().enumerate() {
        let w = Array::from_slice(&data((out * IN) as usize, i as u64 + 1), &[*out, IN]);
        if quantize[i] {
            let (wq, s, b) = ops::quantize(&w, 32, 4).unwrap();
            map.insert(format!("{name}.weight"), wq, file);
            map.insert(format!("{name}.scales"), s, file);
            map.insert(format!("{name}.biases"), b, file);
        } else {
            map.insert(format!("{name}.weight"), w, file);
        }
        if bias {
            let b = Array::from_slice(&data(*out as usize, i as u64 + 10), &[*out]);
            map.insert(format!("{name}.bias"), b, file);
        }
    }
    let config = ModelConfig::new(
        if quantize.contains(&true) {
            json!({"quantization": {"group_size": 32, "bits": 4}})
        } else {
            json!({})
        },
        "config.json",
    );
    (map, Quantization::from_config(&config).unwrap())
}

/// Loads the parts fused or not and returns the layer with its store.
fn load(map: WeightMap, quant: Quantization, bias: bool, fuse: bool) -> (FusedLinear, ParamStore) {
    let mut ld = WeightLoader::new(map, quant);
    let l = FusedLinear::load_with(&mut ld, &PARTS, IN, bias, fuse).unwrap();
    (l, ld.finish().unwrap())
}

fn outputs(l: &FusedLinear, store: &ParamStore) -> Vec<Vec<f32>> {
    let x = Array::from_slice(&data(3 * IN as usize, 99), &[1, 3, IN]);
    let out = l.forward(&store.view(), &x).unwrap();
    assert_eq!(out.len(), 3);
    for (o, (_, n)) in out.iter().zip(PARTS) {
        assert_eq!(o.shape(), &[1, 3, n]);
    }
    out.iter().map(values).collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_fused_product_equals_the_parts_products() {
    for (quantize, bias) in [
        ([false; 3], false),
        ([false; 3], true),
        ([true; 3], false),
        ([true; 3], true),
    ] {
        let (map, q) = checkpoint(quantize, bias);
        let (sep, sep_store) = load(map, q, bias, false);
        assert!(matches!(sep, FusedLinear::Parts(_)));
        let (map, q) = checkpoint(quantize, bias);
        let (fused, fused_store) = load(map, q, bias, true);
        let FusedLinear::One { linear, .. } = &fused else {
            panic!("parts stored alike fuse ({quantize:?}, bias {bias})");
        };
        assert_eq!(linear.out_features, 64);
        assert_eq!(linear.quant.is_some(), quantize[0]);
        let name = fused_store.name(linear.weight);
        assert_eq!(name, "l.q_proj+k_proj+v_proj.weight");
        let d = max_diff(&outputs(&fused, &fused_store), &outputs(&sep, &sep_store));
        assert!(d <= 1e-5, "{quantize:?} bias {bias}: fused differs by {d}");
        // Every part contributes: the fused layer is not the first part
        // repeated.
        let o = outputs(&fused, &fused_store);
        assert!(max_diff(&o[1..2], &o[2..3]) > 1e-3);
    }
}

#[test]
fn parts_stored_differently_stay_separate_products() {
    let (map, q) = checkpoint([true, false, false], true);
    let (l, store) = load(map, q, true, true);
    let FusedLinear::Parts(parts) = &l else {
        panic!("a quantized part beside dense ones must not fuse");
    };
    assert!(parts[0].quant.is_some() && parts[1].quant.is_none());
    let (map, q) = checkpoint([true, false, false], true);
    let (sep, sep_store) = load(map, q, true, false);
    assert_eq!(
        max_diff(&outputs(&l, &store), &outputs(&sep, &sep_store)),
        0.0
    );
}

#[test]
fn dense_parts_of_different_dtypes_stay_separate() {
    let (mut map, q) = checkpoint([false; 3], false);
    let (k, file) = map.remove("l.k_proj.weight").unwrap().unwrap();
    map.insert(
        "l.k_proj.weight",
        k.as_dtype(mlx_rs::Dtype::Float16).unwrap(),
        file,
    );
    let (l, _) = load(map, q, false, true);
    assert!(
        matches!(l, FusedLinear::Parts(_)),
        "float16 beside float32 must not be concatenated"
    );
}

#[test]
fn a_checkpoint_holding_the_fused_name_loads_as_it_is() {
    // What an in-memory quantization of a fused model writes back.
    let (map, q) = checkpoint([false; 3], false);
    let (fused, store) = load(map, q, false, true);
    let want = outputs(&fused, &store);
    let mut map = WeightMap::new();
    let file = map.add_file("requantized".into());
    let prefixes: Vec<&str> = PARTS.iter().map(|(p, _)| *p).collect();
    let name = format!("{}.weight", fused_name(&prefixes));
    let FusedLinear::One { linear, .. } = &fused else {
        panic!("fused");
    };
    map.insert(name, store.get(linear.weight).clone(), file);
    let (again, again_store) = load(map, Quantization::default(), false, true);
    assert!(matches!(again, FusedLinear::One { .. }));
    assert_eq!(max_diff(&outputs(&again, &again_store), &want), 0.0);
}

#[test]
fn a_missing_part_is_named() {
    let (mut map, q) = checkpoint([false; 3], false);
    map.remove("l.k_proj.weight").unwrap();
    let mut ld = WeightLoader::new(map, q);
    let err = FusedLinear::load_with(&mut ld, &PARTS, IN, false, true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("l.k_proj.weight"), "{err}");
}

#[test]
fn layer_norm_matches_loops() {
    let (rows, d) = (3usize, 16usize);
    let x = data(rows * d, 7);
    let w = data(d, 8);
    let b = data(d, 9);
    let eps = 1e-5f32;
    for with_bias in [true, false] {
        let mut map = WeightMap::new();
        let file = map.add_file("norm.safetensors".into());
        map.insert("n.weight", Array::from_slice(&w, &[d as i32]), file);
        if with_bias {
            map.insert("n.bias", Array::from_slice(&b, &[d as i32]), file);
        }
        let mut ld = WeightLoader::new(map, Quantization::default());
        let norm = Norm::load(NormKind::LayerNorm, &mut ld, "n", d as i32, eps).unwrap();
        assert_eq!(norm.params().len(), 1 + usize::from(with_bias));
        let store = ld.finish().unwrap();
        let got = values(
            &norm
                .forward(
                    &store.view(),
                    &Array::from_slice(&x, &[rows as i32, d as i32]),
                )
                .unwrap(),
        );
        for r in 0..rows {
            let row = &x[r * d..(r + 1) * d];
            let mean = row.iter().sum::<f32>() / d as f32;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
            let inv = 1.0 / (var + eps).sqrt();
            for i in 0..d {
                let want = (row[i] - mean) * inv * w[i] + if with_bias { b[i] } else { 0.0 };
                let g = got[r * d + i];
                assert!(
                    (g - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "layer_norm[{r},{i}] (bias {with_bias}): got {g}, want {want}"
                );
            }
        }
    }
}
