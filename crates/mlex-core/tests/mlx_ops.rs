//! MLX exercised through the workspace, against values computed here with
//! plain loops (no MLX on the reference side).

use mlex_core::error::Error;
use mlex_core::weights::{validate_safetensors, WeightMap};
use mlx_rs::{fast, ops, Array};

mod common;
use common::data;

fn values(a: &Array) -> Vec<f32> {
    a.eval().unwrap();
    a.try_as_slice::<f32>().unwrap().to_vec()
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

#[test]
fn matmul_matches_loops() {
    let (m, k, n) = (5, 7, 3);
    let a = data(m * k, 1);
    let b = data(k * n, 2);
    let got = values(
        &ops::matmul(
            Array::from_slice(&a, &[m as i32, k as i32]),
            Array::from_slice(&b, &[k as i32, n as i32]),
        )
        .unwrap(),
    );
    let mut want = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            want[i * n + j] = (0..k).map(|t| a[i * k + t] * b[t * n + j]).sum();
        }
    }
    assert_close(&got, &want, 1e-5, "matmul");
}

#[test]
fn matmul_by_hand() {
    // [[1, 2], [3, 4]] @ [[5, 6], [7, 8]] = [[19, 22], [43, 50]]
    let a = Array::from_slice(&[1f32, 2., 3., 4.], &[2, 2]);
    let b = Array::from_slice(&[5f32, 6., 7., 8.], &[2, 2]);
    assert_eq!(
        values(&ops::matmul(&a, &b).unwrap()),
        vec![19., 22., 43., 50.]
    );
}

#[test]
fn rms_norm_matches_loops() {
    let (rows, d) = (4, 16);
    let x = data(rows * d, 3);
    let w = data(d, 4);
    let eps = 1e-5f32;
    let got = values(
        &fast::rms_norm(
            Array::from_slice(&x, &[rows as i32, d as i32]),
            Some(&Array::from_slice(&w, &[d as i32])),
            eps,
        )
        .unwrap(),
    );
    let mut want = vec![0f32; rows * d];
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        let ms: f32 = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for i in 0..d {
            want[r * d + i] = row[i] * inv * w[i];
        }
    }
    assert_close(&got, &want, 1e-5, "rms_norm");
}

#[test]
fn rope_matches_loops() {
    // [B=1, H=2, T=3, D=8], non-traditional (rotate halves), offset 5.
    let (h, t, d) = (2usize, 3usize, 8usize);
    let x = data(h * t * d, 5);
    let (base, scale, offset) = (10000f32, 1.0f32, 5);
    let got = values(
        &fast::rope(
            Array::from_slice(&x, &[1, h as i32, t as i32, d as i32]),
            d as i32,
            false,
            base,
            scale,
            offset,
            None,
        )
        .unwrap(),
    );
    let half = d / 2;
    let mut want = vec![0f32; h * t * d];
    for hh in 0..h {
        for tt in 0..t {
            let pos = (offset as f32 + tt as f32) * scale;
            let row = &x[(hh * t + tt) * d..(hh * t + tt + 1) * d];
            for i in 0..half {
                let theta = pos * base.powf(-(2.0 * i as f32) / d as f32);
                let (c, s) = (theta.cos(), theta.sin());
                let o = (hh * t + tt) * d;
                want[o + i] = row[i] * c - row[i + half] * s;
                want[o + i + half] = row[i + half] * c + row[i] * s;
            }
        }
    }
    assert_close(&got, &want, 1e-4, "rope");
}

#[test]
fn sdpa_matches_loops_with_gqa_and_causal_mask() {
    // queries [1, 4 heads, 3, 8], keys/values [1, 2 heads, 5, 8]; the 3
    // queries are the last 3 positions of 5 (causal, bottom-right aligned).
    let (hq, hk, tq, tk, d) = (4usize, 2usize, 3usize, 5usize, 8usize);
    let q = data(hq * tq * d, 6);
    let k = data(hk * tk * d, 7);
    let v = data(hk * tk * d, 8);
    let scale = 1.0 / (d as f32).sqrt();
    let got = values(
        &fast::scaled_dot_product_attention(
            Array::from_slice(&q, &[1, hq as i32, tq as i32, d as i32]),
            Array::from_slice(&k, &[1, hk as i32, tk as i32, d as i32]),
            Array::from_slice(&v, &[1, hk as i32, tk as i32, d as i32]),
            scale,
            fast::ScaledDotProductAttentionMask::Causal,
            None,
        )
        .unwrap(),
    );
    let mut want = vec![0f32; hq * tq * d];
    for h in 0..hq {
        let kv = h / (hq / hk);
        for i in 0..tq {
            let visible = tk - tq + i + 1;
            let qrow = &q[(h * tq + i) * d..(h * tq + i + 1) * d];
            let scores: Vec<f32> = (0..visible)
                .map(|j| {
                    let krow = &k[(kv * tk + j) * d..(kv * tk + j + 1) * d];
                    qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f32>() * scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for c in 0..d {
                want[(h * tq + i) * d + c] = (0..visible)
                    .map(|j| e[j] / z * v[(kv * tk + j) * d + c])
                    .sum();
            }
        }
    }
    assert_close(&got, &want, 1e-5, "sdpa");
}

#[test]
fn safetensors_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let a = Array::from_slice(&data(12, 9), &[3, 4]);
    let b = Array::from_slice(&[1i32, 2, 3], &[3]);
    let bf = Array::from_slice(&data(6, 10), &[2, 3])
        .as_dtype(mlx_rs::Dtype::Bfloat16)
        .unwrap();
    Array::save_safetensors([("a", &a), ("b", &b), ("c.bf16", &bf)], None, &path).unwrap();
    validate_safetensors(&path).unwrap();
    let map = WeightMap::load_safetensors(std::slice::from_ref(&path)).unwrap();
    assert_eq!(map.names(), vec!["a", "b", "c.bf16"]);
    assert_eq!(values(map.get("a").unwrap().unwrap()), values(&a));
    let got_b = map.get("b").unwrap().unwrap();
    got_b.eval().unwrap();
    assert_eq!(got_b.try_as_slice::<i32>().unwrap(), &[1, 2, 3]);
    let got_c = map.get("c.bf16").unwrap().unwrap();
    assert_eq!(got_c.dtype(), mlx_rs::Dtype::Bfloat16);
    assert_eq!(
        values(&got_c.as_dtype(mlx_rs::Dtype::Float32).unwrap()),
        values(&bf.as_dtype(mlx_rs::Dtype::Float32).unwrap())
    );
    assert_eq!(map.file_of("a"), Some(path.as_path()));
}

#[test]
fn shape_mismatch_is_an_error_not_a_panic() {
    let a = Array::from_slice(&[1f32, 2., 3., 4., 5., 6.], &[2, 3]);
    let b = Array::from_slice(&[1f32, 2., 3., 4.], &[2, 2]);
    let err: Error = ops::matmul(&a, &b).map_err(Error::from).unwrap_err();
    match &err {
        Error::Mlx { message, .. } => assert!(
            message.contains("matmul")
                || message.contains("shape")
                || message.contains("dimension"),
            "unexpected message: {message}"
        ),
        other => panic!("expected an MLX error, got {other:?}"),
    }
    // The process and MLX are still usable afterwards.
    assert_eq!(values(&ops::add(&b, &b).unwrap()), vec![2., 4., 6., 8.]);
}
