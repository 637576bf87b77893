//! Times the few-row matmul kernel against MLX's matmul on the GPU, for the
//! dense products of the Qwen3-0.6B / Qwen3.5-0.8B-like shapes, by row count:
//! the measurement behind `Dispatch::skinny_rows`.
//!
//!     cargo run --release -p mlex-kernels --example skinny_sweep

use mlex_kernels::skinny;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, random, Array, Dtype};
use std::time::Instant;

fn time(f: &dyn Fn() -> Array) -> f64 {
    // 50 products chained in one graph, so launch gaps count as they do in a
    // decode step; median of 5.
    let mut t = Vec::new();
    for _ in 0..6 {
        let start = Instant::now();
        let outs: Vec<Array> = (0..50).map(|_| f()).collect();
        eval(outs.iter()).unwrap();
        t.push(start.elapsed().as_secs_f64() / 50.0 * 1e6);
    }
    t.remove(0);
    t.sort_by(f64::total_cmp);
    t[2]
}

fn main() {
    println!("| N x K | rows | MLX matmul us | kernel us | speed-up |");
    println!("|---|---|---|---|---|");
    for (n, k) in [
        (2048, 1024),
        (1024, 2048),
        (6144, 1024),
        (1024, 3072),
        (151936, 1024),
    ] {
        let w = random::normal::<f32>(&[n, k], None, None, &random::key(1).unwrap())
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        for m in [1, 2, 4, 8, 16, 32, 64] {
            let x = random::normal::<f32>(&[m, k], None, None, &random::key(2).unwrap())
                .unwrap()
                .as_dtype(Dtype::Bfloat16)
                .unwrap();
            eval([&x, &w]).unwrap();
            let mlx = time(&|| ops::matmul(&x, w.t()).unwrap());
            let ours = time(&|| skinny::matmul_within(&x, &w, (1, 64)).unwrap().unwrap());
            println!(
                "| {n} x {k} | {m} | {mlx:.1} | {ours:.1} | {:.2}x |",
                mlx / ours
            );
        }
    }
}
