//! The few-row matmul kernel equals MLX's matmul (CUDA only).

mod common;

use common::assert_on_cuda;
use mlex_kernels::skinny;
use mlx_rs::{ops, random, Array, Dtype};

#[test]
#[ignore = "needs the CUDA backend: run on the GPU machine with --ignored"]
fn skinny_matmul_equals_mlx_matmul_on_cuda() {
    assert_on_cuda();
    for dtype in [Dtype::Bfloat16, Dtype::Float16] {
        // The last: as many columns as a vocabulary head has (the launch
        // grid's y axis stops at 65,535 blocks).
        for (n, k) in [
            (8, 16),
            (1000, 1032),
            (2048, 1024),
            (1024, 3072),
            (70_000, 64),
        ] {
            for m in [2, 3, 8, 17, 64] {
                let key = random::key((m * 1000 + n) as u64).unwrap();
                let x = random::normal::<f32>(&[m, k], None, None, &key)
                    .unwrap()
                    .as_dtype(dtype)
                    .unwrap();
                let w = random::normal::<f32>(&[n, k], None, None, &random::key(7).unwrap())
                    .unwrap()
                    .as_dtype(dtype)
                    .unwrap();
                let got = skinny::matmul_within(&x, &w, (1, 64))
                    .unwrap()
                    .expect("applies");
                // The reference in f32 from the same rounded inputs.
                let want = ops::matmul(
                    x.as_dtype(Dtype::Float32).unwrap(),
                    w.as_dtype(Dtype::Float32).unwrap().t(),
                )
                .unwrap();
                let diff =
                    ops::abs(ops::subtract(got.as_dtype(Dtype::Float32).unwrap(), &want).unwrap())
                        .unwrap()
                        .max(None)
                        .unwrap()
                        .item_exact::<f32>();
                let scale = ops::abs(&want)
                    .unwrap()
                    .max(None)
                    .unwrap()
                    .item_exact::<f32>();
                // One rounding of the output to 8 (bf16) or 11 (f16) bits.
                let tol = if dtype == Dtype::Bfloat16 {
                    1.0 / 128.0
                } else {
                    1.0 / 1024.0
                };
                assert!(
                    diff <= tol * scale,
                    "{dtype:?} m={m} n={n} k={k}: max diff {diff} against max {scale}"
                );
                // A 3-D input keeps its leading shape.
                let x3 = ops::reshape(&x, &[1, m, k]).unwrap();
                let y3 = skinny::matmul_within(&x3, &w, (1, 64)).unwrap().unwrap();
                assert_eq!(y3.shape(), &[1, m, n]);
            }
        }
        // Out of range, or a shape it does not take: MLX's matmul serves.
        let zeros = |shape: &[i32]| Array::zeros::<f32>(shape).unwrap().as_dtype(dtype).unwrap();
        for (x, w) in [([65, 16], [8, 16]), ([4, 12], [8, 12])] {
            let (x, w) = (zeros(&x), zeros(&w));
            assert!(skinny::matmul_within(&x, &w, (1, 64)).unwrap().is_none());
        }
    }
}
