//! Cache benchmarks (criterion):
//!
//! - one-token KV append at 1k and 8k tokens: the pre-allocated cache
//!   (writes one row in place) against the concatenating one (copies the
//!   whole cache every token);
//! - prefix restore from the prompt cache against recomputing the prefix
//!   (a 512-token prefix of the `qwen3_5-f32` fixture, a hybrid).
//!
//! `cargo bench -p mlex-cache`; ratios are reported in docs/BENCHMARKS.md.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use mlex_cache::{ConcatKvCache, KvCache, PromptCache};
use mlex_core::cache::{Cache, KvAccess};
use mlx_rs::{random, Array, Dtype};

fn filled<C: KvAccess + Default>(n: i32) -> C {
    let mut c = C::default();
    let key = random::key(1).unwrap();
    let k = random::normal::<f32>(&[1, 8, n, 128], None, None, &key)
        .unwrap()
        .as_dtype(Dtype::Bfloat16)
        .unwrap();
    let (a, b) = c.update_and_fetch(&k, &k).unwrap();
    mlx_rs::transforms::eval([&a, &b]).unwrap();
    c
}

fn kv_append(c: &mut Criterion) {
    let mut g = c.benchmark_group("kv_append_one_token");
    let key = random::key(2).unwrap();
    let t = random::normal::<f32>(&[1, 8, 1, 128], None, None, &key)
        .unwrap()
        .as_dtype(Dtype::Bfloat16)
        .unwrap();
    t.eval().unwrap();
    for n in [1024, 8192] {
        let caches: [(&str, Box<dyn Cache>); 2] = [
            ("preallocated", Box::new(filled::<KvCache>(n))),
            ("concatenating", Box::new(filled::<ConcatKvCache>(n))),
        ];
        for (name, mut cache) in caches {
            g.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| {
                    let kv = cache.as_kv().unwrap();
                    let (k, v) = kv.update_and_fetch(&t, &t).unwrap();
                    mlx_rs::transforms::eval([&k, &v]).unwrap();
                    drop((k, v));
                    cache.trim(1);
                })
            });
        }
    }
    g.finish();
}

fn prefix_restore(c: &mut Criterion) {
    let f = mlex_testkit::fixture("qwen3_5-f32");
    let registry = mlex_models::registry().unwrap();
    let model = mlex_models::load::load(mlex_testkit::path_of(&f).to_str().unwrap(), registry)
        .unwrap()
        .model;
    let prefix: Vec<i32> = (0..512).map(|i| i * 37 % 256).collect();
    let ids = |v: &[i32]| Array::from_slice(v, &[1, v.len() as i32]);
    let mut full = model.make_cache(1).unwrap();
    model.forward_hidden(&ids(&prefix), &mut full).unwrap();
    mlx_rs::transforms::eval(full.arrays().iter()).unwrap();
    let tokens: Vec<u32> = prefix.iter().map(|&t| t as u32).collect();
    let mut pc = PromptCache::new(4, 1 << 30);
    pc.insert(&tokens, full, vec![]);
    let mut query = tokens.clone();
    query.push(7);
    let mut g = c.benchmark_group("prefix_512_tokens_qwen3_5_tiny");
    g.sample_size(10);
    g.bench_function("restore_from_prompt_cache", |b| {
        b.iter(|| {
            let hit = pc.lookup(&query).unwrap();
            assert_eq!(hit.reused, 512);
            mlx_rs::transforms::eval(hit.cache.arrays().iter()).unwrap();
        })
    });
    g.bench_function("recompute", |b| {
        b.iter(|| {
            let mut cache = model.make_cache(1).unwrap();
            model.forward_hidden(&ids(&prefix), &mut cache).unwrap();
            mlx_rs::transforms::eval(cache.arrays().iter()).unwrap();
        })
    });
    g.finish();
}

criterion_group!(benches, kv_append, prefix_restore);
criterion_main!(benches);
