//! The fused norm kernels against MLX's own ops: q/k norms + RoPE against
//! `fast::rms_norm` and `fast::rope`, the residual add + RMS norm against
//! `add` and `fast::rms_norm` (CUDA only); the rotation tables the first is
//! given against `fast::rope`, and the checks on bad input, on any backend.

use mlex_kernels::add_rms_norm;
use mlex_kernels::qk_rope::{self, QkNorms, Rotation};
mod common;

use common::{assert_on_cuda, max_abs_diff, max_rel, normal};
use mlx_rs::{fast, ops, Array, Dtype};

/// MLX's rope of `x` `[B, H, L, D]`: at `offset` for every row, or at
/// `positions[b]` for row `b`.
fn mlx_rope(x: &Array, rot: &Rope, positions: &[i32]) -> Array {
    let freqs = rot
        .periods
        .as_ref()
        .map(|f| Array::from_slice(f, &[f.len() as i32]));
    let (base, scale) = match &freqs {
        Some(_) => (None, 1.0),
        None => (Some(rot.base), rot.scale),
    };
    if positions.len() == 1 {
        fast::rope(
            x,
            rot.dims,
            rot.traditional,
            base,
            scale,
            positions[0],
            freqs.as_ref(),
        )
        .unwrap()
    } else {
        let pos = Array::from_slice(positions, &[positions.len() as i32]);
        fast::rope_dynamic(
            x,
            rot.dims,
            rot.traditional,
            base,
            scale,
            &pos,
            freqs.as_ref(),
        )
        .unwrap()
    }
}

/// A rotation as a layer would describe it to `fast::rope`.
struct Rope {
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
    periods: Option<Vec<f32>>,
}

impl Rope {
    fn rotation(&self) -> Rotation {
        match &self.periods {
            Some(p) => Rotation::from_periods(self.dims, self.traditional, p, 1.0),
            None => Rotation::from_base(self.dims, self.traditional, self.base, self.scale),
        }
    }
}

/// Rotates `x` `[D]` at `pos` by the table alone, in f64 on the host.
fn rotate_by_table(x: &[f32], rot: &Rotation, pos: f64) -> Vec<f64> {
    let mut y: Vec<f64> = x.iter().map(|v| *v as f64).collect();
    let half = (rot.dims / 2) as usize;
    for i in 0..half {
        let (a, b) = if rot.traditional {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let theta = rot.scale as f64 * pos * rot.inv_freq[i] as f64;
        let (s, c) = theta.sin_cos();
        y[a] = x[a] as f64 * c - x[b] as f64 * s;
        y[b] = x[a] as f64 * s + x[b] as f64 * c;
    }
    y
}

fn ropes() -> Vec<Rope> {
    vec![
        Rope {
            dims: 128,
            traditional: false,
            base: 1_000_000.0,
            scale: 1.0,
            periods: None,
        },
        Rope {
            dims: 64,
            traditional: false,
            base: 10_000_000.0,
            scale: 1.0,
            periods: None,
        },
        Rope {
            dims: 64,
            traditional: true,
            base: 10_000.0,
            scale: 0.5,
            periods: None,
        },
        Rope {
            dims: 32,
            traditional: false,
            base: 500_000.0,
            scale: 1.0,
            // Periods as llama3 scaling makes them: some stretched.
            periods: Some(
                (0..16)
                    .map(|i| {
                        500_000f32.powf(2.0 * i as f32 / 32.0) * if i > 10 { 8.0 } else { 1.0 }
                    })
                    .collect(),
            ),
        },
    ]
}

/// The kernel's rotation tables (inverse frequencies and scale) rotate as
/// `fast::rope` does, on whatever backend MLX runs here.
#[test]
fn rotation_tables_rotate_as_fast_rope() {
    for (n, rope) in ropes().iter().enumerate() {
        let d = rope.dims + 16;
        let x = normal(&[1, 1, 1, d], 7 + n as u64);
        for pos in [0, 1, 37, 1000] {
            let got = mlx_rope(&x, rope, &[pos]);
            let want = rotate_by_table(x.as_slice::<f32>(), &rope.rotation(), pos as f64);
            let got = got.as_slice::<f32>();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - w).abs() < 2e-3,
                    "rope {n} position {pos} element {i}: fast::rope {g}, table {w}"
                );
            }
        }
    }
}

#[test]
fn supported_checks_sizes_and_epsilon() {
    let rot = Rotation::from_base(128, false, 10_000.0, 1.0);
    assert!(qk_rope::supported(128, &rot, Some(1e-6)));
    assert!(qk_rope::supported(128, &rot, None));
    assert!(
        !qk_rope::supported(64, &rot, None),
        "more rotated dims than the head"
    );
    assert!(!qk_rope::supported(
        1024,
        &Rotation::from_base(128, false, 1e4, 1.0),
        None
    ));
    assert!(!qk_rope::supported(128, &rot, Some(0.0)), "an epsilon of 0");
    assert!(!qk_rope::supported(128, &rot, Some(1e-13)), "below 1e-12");
    assert!(qk_rope::supported(128, &rot, Some(1e-5)));
}

/// Shapes that do not fit are refused before any launch, naming the kernel.
#[test]
fn mismatched_inputs_are_named() {
    let rot = Rotation::from_base(64, false, 10_000.0, 1.0);
    let q = normal(&[1, 4, 1, 64], 1);
    let k = normal(&[1, 2, 1, 32], 2);
    let pos = Array::from_slice(&[3i32], &[1]);
    let err = qk_rope::apply(&q, &k, None, &pos, &rot).unwrap_err();
    assert!(err.to_string().contains("qk_rope"), "{err}");
    let k = normal(&[1, 2, 1, 64], 2);
    let bad_pos = Array::from_slice(&[3i32, 4, 5], &[3]);
    let err = qk_rope::apply(&q, &k, None, &bad_pos, &rot).unwrap_err();
    assert!(err.to_string().contains("positions"), "{err}");
}

/// The fused kernel against `fast::rms_norm` then `fast::rope`, per
/// rotation, with and without norms, one position for all rows and one per
/// row, decode (L = 1) and two-token steps, f32 and bf16.
#[test]
#[ignore = "needs the CUDA backend: run on the GPU machine with --ignored"]
fn fused_equals_norm_then_rope_on_cuda() {
    assert_on_cuda();
    // (batch, q heads, k heads, tokens, norms, positions)
    type Case = (i32, i32, i32, i32, bool, &'static [i32]);
    let cases: [Case; 5] = [
        (1, 16, 8, 1, true, &[37]),
        (3, 4, 2, 2, true, &[5, 0, 130]),
        (2, 4, 4, 1, false, &[1000]),
        (2, 8, 2, 1, false, &[9, 4000]),
        // 5 rows: the last block of four rows is partly empty.
        (1, 3, 2, 1, true, &[11]),
    ];
    let mut all = ropes();
    // A head narrower than a warp.
    all.push(Rope {
        dims: 16,
        traditional: false,
        base: 10_000.0,
        scale: 1.0,
        periods: None,
    });
    for (n, rope) in all.iter().enumerate() {
        for (c, &(b, hq, hk, l, with_norms, positions)) in cases.iter().enumerate() {
            // Partial rotation on some (the head is wider than the rotated
            // dims), and a head size off a multiple of 32 in the last case.
            let d = match (n, c) {
                (_, 4) => rope.dims + 16,
                (1, _) => 256,
                _ => rope.dims * if c % 2 == 0 { 1 } else { 2 },
            };
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let cast = |x: Array| x.as_dtype(dtype).unwrap();
                let q = cast(normal(&[b, hq, l, d], 10 + c as u64));
                let k = cast(normal(&[b, hk, l, d], 20 + c as u64));
                let qw = cast(ops::add(normal(&[d], 30), Array::from_f32(1.0)).unwrap());
                let kw = cast(ops::add(normal(&[d], 31), Array::from_f32(1.0)).unwrap());
                let eps = 1e-6;
                let (q0, k0) = if with_norms {
                    (
                        fast::rms_norm(&q, Some(&qw), eps).unwrap(),
                        fast::rms_norm(&k, Some(&kw), eps).unwrap(),
                    )
                } else {
                    (q.clone(), k.clone())
                };
                let (q0, k0) = (
                    mlx_rope(&q0, rope, positions),
                    mlx_rope(&k0, rope, positions),
                );
                let norms = with_norms.then_some(QkNorms {
                    q: &qw,
                    k: &kw,
                    eps,
                });
                let pos = Array::from_slice(positions, &[positions.len() as i32]);
                let (q1, k1) = qk_rope::apply(&q, &k, norms, &pos, &rope.rotation()).unwrap();
                assert_eq!((q1.shape(), q1.dtype()), (q0.shape(), q0.dtype()));
                assert_eq!((k1.shape(), k1.dtype()), (k0.shape(), k0.dtype()));
                // Relative to the largest value: bf16 two rounding steps; in
                // f32 the angles (an inverse frequency an ulp apart, times
                // positions up to 4,000) bound it.
                let limit = if dtype == Dtype::Float32 {
                    1e-3
                } else {
                    1.6e-2
                };
                let (dq, dk) = (max_rel(&q1, &q0), max_rel(&k1, &k0));
                assert!(
                    dq <= limit && dk <= limit,
                    "rope {n} case {c} {dtype:?}: q differs by {dq}, k by {dk}"
                );
            }
        }
    }
}

#[test]
fn add_rms_norm_takes_decode_rows_only() {
    let x = normal(&[8, 1, 64], 1);
    assert!(add_rms_norm::supported(&x, 1e-6));
    assert!(
        !add_rms_norm::supported(&normal(&[1, 65, 64], 1), 1e-6),
        "a prefill's rows"
    );
    assert!(!add_rms_norm::supported(&x, 0.0), "an epsilon of 0");
    assert!(
        !add_rms_norm::supported(&Array::from_slice(&[1i32, 2], &[1, 2]), 1e-6),
        "integers"
    );
    let y = normal(&[8, 1, 32], 2);
    let w = normal(&[64], 3);
    let err = add_rms_norm::apply(&x, &y, &w, 1e-6).unwrap_err();
    assert!(err.to_string().contains("add_rms_norm"), "{err}");
    let err = add_rms_norm::apply(&x, &x, &normal(&[32], 3), 1e-6).unwrap_err();
    assert!(err.to_string().contains("weight"), "{err}");
}

/// The fused residual add + RMS norm against `add` then `fast::rms_norm`:
/// the sum exactly, the norm to two rounding steps, for decode-step shapes
/// (one and several rows, widths not a multiple of the block).
#[test]
#[ignore = "needs the CUDA backend: run on the GPU machine with --ignored"]
fn add_rms_norm_equals_add_then_rms_norm_on_cuda() {
    assert_on_cuda();
    for (c, shape) in [[1, 1, 1024], [8, 1, 2048], [3, 2, 1000], [64, 1, 4096]]
        .iter()
        .enumerate()
    {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let cast = |x: Array| x.as_dtype(dtype).unwrap();
            let x = cast(normal(shape, 40 + c as u64));
            let y = cast(normal(shape, 50 + c as u64));
            let w = cast(ops::add(normal(&[shape[2]], 60), Array::from_f32(1.0)).unwrap());
            let eps = 1e-6;
            let h0 = ops::add(&x, &y).unwrap();
            let n0 = fast::rms_norm(&h0, Some(&w), eps).unwrap();
            let (h1, n1) = add_rms_norm::apply(&x, &y, &w, eps).unwrap();
            assert_eq!((h1.shape(), h1.dtype()), (h0.shape(), h0.dtype()));
            assert_eq!((n1.shape(), n1.dtype()), (n0.shape(), n0.dtype()));
            let dh = max_abs_diff(&h1, &h0);
            let dn = max_rel(&n1, &n0);
            let limit = if dtype == Dtype::Float32 {
                1e-5
            } else {
                1.6e-2
            };
            assert!(
                dh == 0.0 && dn <= limit,
                "{shape:?} {dtype:?}: sum differs by {dh}, norm by {dn}"
            );
        }
    }
}
