//! The fused Mamba2 decode kernel against its ops form (CUDA only; the ops
//! form itself is checked against mlx-lm by the parity suite's NemotronH
//! fixtures, whose decode steps run it on the CPU).

mod common;

use common::{assert_kept_state, assert_on_cuda, assert_step_close, normal};
use mlex_kernels::mamba2::{self, Inputs, Shape};
use mlx_rs::{ops, Array, Dtype};

/// Random `dt_bias`, `A_log` and `D` of `h` heads, from seeds `seed`,
/// `seed + 1` and `seed + 2`.
fn weights(h: i32, seed: u64) -> (Array, Array, Array) {
    (
        normal(&[h], seed),
        normal(&[h], seed + 1),
        normal(&[h], seed + 2),
    )
}

/// The small shape of the kernel tests: groups of two heads, a state row
/// one warp wide.
const SMALL: Shape = Shape {
    heads: 4,
    head_dim: 16,
    groups: 2,
    state_dim: 32,
    dt_limit: (0.001, 100.0),
};

/// A `dt` clip that never bites.
const NO_CLIP: (f32, f32) = (0.0, f32::INFINITY);

/// The kernel's inputs: token inputs `conv` and `dt` with [`weights`].
fn inputs<'a>(conv: &'a Array, dt: &'a Array, w: &'a (Array, Array, Array)) -> Inputs<'a> {
    let (dt_bias, a_log, d) = (&w.0, &w.1, &w.2);
    Inputs {
        conv,
        dt,
        dt_bias,
        a_log,
        d,
    }
}

#[test]
#[ignore = "needs the CUDA backend: run on the GPU machine with --ignored"]
fn fused_decode_equals_ops_on_cuda() {
    assert_on_cuda();
    let shapes = [
        Shape {
            dt_limit: NO_CLIP,
            ..SMALL
        },
        Shape {
            heads: 32,
            head_dim: 64,
            groups: 8,
            state_dim: 128,
            ..SMALL
        },
    ];
    for shape in shapes {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let (b, h) = (2, shape.heads);
            let cast = |x: Array| x.as_dtype(dtype).unwrap();
            let w = weights(h, 1);
            let mut s0 = normal(&[b, h, shape.head_dim, shape.state_dim], 4);
            let mut s1 = s0.clone();
            for t in 0..4 {
                let conv = cast(normal(&[b, 1, shape.conv_dim()], 10 + t));
                let dt = cast(normal(&[b, 1, h], 20 + t));
                let p = inputs(&conv, &dt, &w);
                let ops = mamba2::decode_ops(p, &s0, shape).unwrap();
                let fused = mamba2::decode_fused(p, &s1, shape).unwrap();
                assert_step_close(
                    &ops,
                    &fused,
                    dtype,
                    &format!("{shape:?} {dtype:?} token {t}"),
                );
                (s0, s1) = (ops.1, fused.1);
            }
        }
    }
}

/// The ops form against plain loops over host vectors (an independent
/// reference), with grouped B/C and a dt clip that bites.
#[test]
fn ops_step_equals_scalar_loops() {
    let shape = Shape {
        heads: 4,
        head_dim: 3,
        groups: 2,
        state_dim: 5,
        dt_limit: (0.05, 1.5),
    };
    let (b, h, dh, g, n) = (2usize, 4usize, 3usize, 2usize, 5usize);
    let conv = normal(&[b as i32, 1, shape.conv_dim()], 41);
    let dt = normal(&[b as i32, 1, h as i32], 42);
    let (dt_bias, a_log, d) = (normal(&[4], 43), normal(&[4], 44), normal(&[4], 45));
    let state = normal(&[2, 4, 3, 5], 46);
    let p = Inputs {
        conv: &conv,
        dt: &dt,
        dt_bias: &dt_bias,
        a_log: &a_log,
        d: &d,
    };
    let (y, next) = mamba2::decode_ops(p, &state, shape).unwrap();
    let host = |a: &Array| a.as_slice::<f32>().to_vec();
    let (cv, dtv, bias, al, dv, sv) = (
        host(&conv),
        host(&dt),
        host(&dt_bias),
        host(&a_log),
        host(&d),
        host(&state),
    );
    let (yv, nv) = (host(&y), host(&next));
    let conv_dim = shape.conv_dim() as usize;
    for bi in 0..b {
        for hi in 0..h {
            let gi = hi / (h / g);
            let raw = dtv[bi * h + hi] + bias[hi];
            let sp = raw.max(0.0) + (-raw.abs()).exp().ln_1p();
            let t = sp.clamp(0.05, 1.5);
            let da = (-al[hi].exp() * t).exp();
            for r in 0..dh {
                let x = cv[bi * conv_dim + hi * dh + r];
                let mut out = 0.0f32;
                for k in 0..n {
                    let bk = cv[bi * conv_dim + h * dh + gi * n + k];
                    let ck = cv[bi * conv_dim + h * dh + g * n + gi * n + k];
                    let idx = ((bi * h + hi) * dh + r) * n + k;
                    let s = sv[idx] * da + t * x * bk;
                    assert!(
                        (nv[idx] - s).abs() < 1e-5,
                        "state {idx}: {} vs {s}",
                        nv[idx]
                    );
                    out += s * ck;
                }
                let want = out + dv[hi] * x;
                let got = yv[(bi * h + hi) * dh + r];
                assert!(
                    (got - want).abs() < 1e-4,
                    "y {bi},{hi},{r}: {got} vs {want}"
                );
            }
        }
    }
}

/// Launching a custom CUDA kernel is an error where MLX has no CUDA (the
/// CPU backend), never an abort inside MLX; on CUDA it runs.
#[test]
fn a_custom_kernel_launch_errs_without_cuda_and_runs_with_it() {
    let on_cuda =
        mlex_core::device::runtime_info().unwrap().backend == mlex_core::device::Backend::Cuda;
    let shape = Shape {
        dt_limit: NO_CLIP,
        ..SMALL
    };
    let w = weights(4, 1);
    let state = normal(&[1, 4, 16, 32], 4);
    let conv = normal(&[1, 1, shape.conv_dim()], 5);
    let dt = normal(&[1, 1, 4], 6);
    let result = mamba2::decode_fused(inputs(&conv, &dt, &w), &state, shape)
        .and_then(|(y, s)| Ok(mlx_rs::transforms::eval([&y, &s])?));
    assert_eq!(
        result.is_ok(),
        on_cuda,
        "{:?}",
        result.err().map(|e| e.to_string())
    );
    // MLX still works afterwards.
    let x = ops::add(normal(&[2], 7), normal(&[2], 8)).unwrap();
    x.eval().unwrap();
}

/// The verify kernel (`steps_fused`, every position in one launch, the
/// state after each kept) against the ops step chained per position, and
/// bit for bit against the fused decode step chained per position.
#[test]
#[ignore = "needs the CUDA backend: run on the GPU machine with --ignored"]
fn fused_steps_keep_every_state_on_cuda() {
    use mlx_rs::ops::indexing::TryIndexOp;
    assert_on_cuda();
    let shape = SMALL;
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        for t in [1, 4, 7] {
            let (b, h) = (2, shape.heads);
            let cast = |x: Array| x.as_dtype(dtype).unwrap();
            let w = weights(h, 51);
            let s0 = normal(&[b, h, shape.head_dim, shape.state_dim], 54);
            let conv = cast(normal(&[b, t, shape.conv_dim()], 55));
            let dt = cast(normal(&[b, t, h], 56));
            let (ys, states) =
                mamba2::steps_fused(inputs(&conv, &dt, &w), &s0, shape, true).unwrap();
            assert_eq!(ys.shape(), [b, t, h, shape.head_dim]);
            assert_eq!(states.shape(), [t, b, h, shape.head_dim, shape.state_dim]);
            let (mut s_ops, mut s_dec) = (s0.clone(), s0.clone());
            for i in 0..t {
                let at = |x: &Array| x.try_index((.., i..i + 1)).unwrap();
                let (conv_i, dt_i) = (at(&conv), at(&dt));
                let p = inputs(&conv_i, &dt_i, &w);
                let ops = mamba2::decode_ops(p, &s_ops, shape).unwrap();
                let dec = mamba2::decode_fused(p, &s_dec, shape).unwrap();
                let kept = (at(&ys), states.try_index(i).unwrap());
                let what = format!("{dtype:?} T={t} position {i}");
                assert_kept_state(&kept, &ops, &dec, dtype, &what);
                (s_ops, s_dec) = (ops.1, dec.1);
            }
        }
    }
}
