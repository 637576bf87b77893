//! Every cache against a naive reference (plain concatenation) on random
//! sequences that cross growth steps and wrap windows; fixed-size state;
//! O(layers) copies.

use mlex_cache::KV_STEP;
use mlex_cache::{
    conv_window_step, windows_after_each, ConcatKvCache, KvCache, RotatingKvCache, StateCache,
};
use mlex_core::cache::{AttentionMask, Cache, KvAccess};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, random, Array, Dtype};
use proptest::prelude::*;

fn vals(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).unwrap().contiguous().unwrap();
    a.eval().unwrap();
    a.try_as_slice::<f32>().unwrap().to_vec()
}

fn chunk(seed: u64, t: i32) -> (Array, Array) {
    let key = random::key(seed).unwrap();
    let k = random::normal::<f32>(&[1, 2, t, 4], None, None, &key).unwrap();
    let v = ops::add(&k, Array::from_f32(100.0)).unwrap();
    (k, v)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, .. ProptestConfig::default() })]

    /// Writes of random lengths (single tokens and chunks) crossing the
    /// 256-token growth steps return exactly what concatenation returns.
    #[test]
    fn kv_cache_equals_concatenation(lens in proptest::collection::vec(prop_oneof![Just(1i32), 1i32..300], 1..12), seed in 0u64..1000) {
        let mut kv = KvCache::new();
        let mut naive = ConcatKvCache::new();
        for (i, t) in lens.iter().enumerate() {
            let (k, v) = chunk(seed * 100 + i as u64, *t);
            let (a_k, a_v) = kv.update_and_fetch(&k, &v).unwrap();
            let (b_k, b_v) = naive.update_and_fetch(&k, &v).unwrap();
            prop_assert_eq!(a_k.shape(), b_k.shape());
            prop_assert_eq!(vals(&a_k), vals(&b_k));
            prop_assert_eq!(vals(&a_v), vals(&b_v));
            prop_assert_eq!(KvAccess::offset(&kv), KvAccess::offset(&naive));
        }
        let total: usize = lens.iter().sum::<i32>() as usize;
        let longest = *lens.iter().max().unwrap() as usize;
        // Grown in steps: never short, never more than one step (plus the
        // chunk that triggered growth) spare.
        prop_assert!(kv.capacity() >= total);
        prop_assert!(kv.capacity() <= total + KV_STEP + longest);
    }

    /// A rotating cache returns the last `window` tokens (plus the kept
    /// first ones): the same keys attention sees with a full cache masked to
    /// the window, checked as sets per step.
    #[test]
    fn rotating_cache_keeps_the_window(window in 4usize..40, keep in 0usize..3, steps in 1usize..90, prefill in 1i32..30, seed in 0u64..1000) {
        prop_assume!(keep < window);
        let mut rot = RotatingKvCache::new(window, keep);
        let mut all: Vec<f32> = Vec::new(); // first feature of every token
        let (k, v) = chunk(seed, prefill);
        let (got, _) = rot.update_and_fetch(&k, &v).unwrap();
        all.extend(vals(&k.try_index((0, 0, .., 0)).unwrap()));
        // The first (multi-token) write returns all of it.
        prop_assert_eq!(got.shape()[2], prefill);
        for s in 0..steps {
            let (k, v) = chunk(seed * 1000 + s as u64 + 1, 1);
            let (got, _) = rot.update_and_fetch(&k, &v).unwrap();
            all.extend(vals(&k.try_index((0, 0, .., 0)).unwrap()));
            let seen: Vec<f32> = vals(&got.try_index((0, 0, .., 0)).unwrap());
            let n = all.len();
            let mut want: Vec<f32> = all[..keep.min(n)].to_vec();
            let start = n.saturating_sub(window - keep).max(keep.min(n));
            want.extend(&all[start..]);
            let mut a = seen.clone();
            let mut b = want.clone();
            if n > window || seen.len() > window {
                a.sort_by(f32::total_cmp);
                b.sort_by(f32::total_cmp);
                // After the window fills, exactly the kept + most recent tokens.
                prop_assert_eq!(a, b, "step {}: window {} keep {}", s, window, keep);
            } else {
                prop_assert_eq!(a, all.clone());
            }
            prop_assert_eq!(KvAccess::offset(&rot), n);
        }
    }

    /// The conv window after any sequence of chunks holds the last K-1
    /// inputs (zeros before the start), and the padded input the
    /// convolution reads is the history window followed by the chunk.
    #[test]
    fn conv_window_matches_history(kernel in 2i32..6, lens in proptest::collection::vec(1i32..9, 1..8), seed in 0u64..1000) {
        let channels = 3;
        let mut window = ops::zeros_dtype(&[1, kernel - 1, channels], Dtype::Float32).unwrap();
        let mut history: Vec<Vec<f32>> = vec![vec![0.0; channels as usize]; (kernel - 1) as usize];
        for (i, t) in lens.iter().enumerate() {
            let key = random::key(seed * 31 + i as u64).unwrap();
            let x = random::normal::<f32>(&[1, *t, channels], None, None, &key).unwrap();
            let (padded, next) = conv_window_step(&window, &x).unwrap();
            let xs = vals(&x);
            let before = history[history.len() - (kernel - 1) as usize..].concat();
            for r in xs.chunks(channels as usize) {
                history.push(r.to_vec());
            }
            let mut want_padded = before.clone();
            want_padded.extend(&xs);
            prop_assert_eq!(vals(&padded), want_padded);
            let want_next = history[history.len() - (kernel - 1) as usize..].concat();
            prop_assert_eq!(vals(&next), want_next);
            window = next;
        }
    }

    /// In a verify run the window after each new position `j` of each row
    /// is the last K-1 inputs up to `j`: the rows `j+1 ..= j+K-1` of the
    /// padded input, read here on the host, row by row.
    #[test]
    fn windows_after_each_position_are_the_padded_rows(kernel in 2i32..6, batch in 1i32..4, t in 1i32..9, seed in 0u64..1000) {
        let (channels, keep) = (3, kernel - 1);
        let key = random::key(seed).unwrap();
        let window = random::normal::<f32>(&[batch, keep, channels], None, None, &key).unwrap();
        let key = random::key(seed + 7).unwrap();
        let x = random::normal::<f32>(&[batch, t, channels], None, None, &key).unwrap();
        let (padded, _) = conv_window_step(&window, &x).unwrap();
        let all = windows_after_each(&padded, keep).unwrap();
        prop_assert_eq!(all.shape(), &[t, batch, keep, channels][..]);
        let p = vals(&padded);
        let (c, len) = (channels as usize, (keep + t) as usize);
        let mut want: Vec<f32> = Vec::new();
        for j in 0..t as usize {
            for b in 0..batch as usize {
                let from = (b * len + j + 1) * c;
                want.extend(&p[from..from + keep as usize * c]);
            }
        }
        prop_assert_eq!(vals(&all), want);
    }
}

/// A cache holding `tokens` random keys and values of 8 heads of 64 (the
/// random key `seed`), the inputs dropped.
fn filled(tokens: i32, seed: u64) -> KvCache {
    let mut kv = KvCache::new();
    let key = random::key(seed).unwrap();
    let k = random::normal::<f32>(&[1, 8, tokens, 64], None, None, &key).unwrap();
    kv.update_and_fetch(&k, &k).unwrap();
    kv
}

#[test]
fn appending_one_token_never_copies_the_cache() {
    // 8k tokens, then room for more: capacity 8192 + 256.
    let mut kv = filled(8000, 11);
    mlx_rs::transforms::eval(kv.to_tensors().arrays.values()).unwrap();
    let size = Cache::nbytes(&kv);
    mlex_core::device::reset_peak_memory().unwrap();
    let base = mlex_core::device::active_memory().unwrap();
    for i in 0..100 {
        let key = random::key(100 + i).unwrap();
        let t = random::normal::<f32>(&[1, 8, 1, 64], None, None, &key).unwrap();
        let (keys, _) = kv.update_and_fetch(&t, &t).unwrap();
        keys.eval().unwrap();
    }
    let peak = mlex_core::device::peak_memory().unwrap();
    assert!(
        peak.saturating_sub(base) < size / 4,
        "100 single-token appends to a {size}-byte cache peaked {} bytes above it: the cache was copied",
        peak.saturating_sub(base)
    );
}

#[test]
fn kv_trim_drops_exactly_the_last_tokens() {
    let mut kv = KvCache::new();
    let (k, v) = chunk(1, 10);
    kv.update_and_fetch(&k, &v).unwrap();
    assert!(kv.is_trimmable());
    assert_eq!(kv.trim(3), 3);
    let (k2, v2) = chunk(2, 1);
    let (got, _) = kv.update_and_fetch(&k2, &v2).unwrap();
    let mut naive = ConcatKvCache::new();
    naive
        .update_and_fetch(
            &k.try_index((.., .., ..7, ..)).unwrap(),
            &v.try_index((.., .., ..7, ..)).unwrap(),
        )
        .unwrap();
    let (want, _) = naive.update_and_fetch(&k2, &v2).unwrap();
    assert_eq!(vals(&got), vals(&want));
    assert_eq!(kv.trim(100), 8, "trim is bounded by what is there");
}

#[test]
fn masks_follow_mlx_lm() {
    let kv = KvCache::new();
    assert!(matches!(kv.mask(1).unwrap(), AttentionMask::None));
    assert!(matches!(kv.mask(5).unwrap(), AttentionMask::Causal));
    // A window smaller than the chunk needs an explicit banded mask.
    let mut rot = RotatingKvCache::new(4, 0);
    let (k, v) = chunk(3, 3);
    rot.update_and_fetch(&k, &v).unwrap();
    match rot.mask(3).unwrap() {
        AttentionMask::Array(m) => {
            // Query i (absolute 3 + i) sees keys j with i+3-4 < j <= i+3.
            assert_eq!(m.shape(), &[3, 6]);
            let m = m.as_dtype(Dtype::Int32).unwrap();
            m.eval().unwrap();
            let rows: Vec<i32> = m.try_as_slice::<i32>().unwrap().to_vec();
            assert_eq!(&rows[..6], &[1, 1, 1, 1, 0, 0]);
            assert_eq!(&rows[12..], &[0, 0, 1, 1, 1, 1]);
        }
        other => panic!("expected an explicit mask, got {other:?}"),
    }
}

#[test]
fn state_caches_hold_f32_recurrent_state_and_reject_shape_changes() {
    let mut gd =
        StateCache::recurrent("gated_delta", 1, (4, 12), [2, 8, 8], Dtype::Bfloat16).unwrap();
    let s = gd.state();
    assert_eq!(s[0].shape(), &[1, 3, 12]);
    assert_eq!(s[0].dtype(), Dtype::Bfloat16);
    assert_eq!(s[1].shape(), &[1, 2, 8, 8]);
    assert_eq!(
        s[1].dtype(),
        Dtype::Float32,
        "recurrent state is kept in f32"
    );
    assert!(!gd.grows() && !gd.is_trimmable());
    assert_eq!(gd.trim(1), 0, "recurrent state cannot be trimmed");
    let bad = vec![
        ops::zeros_dtype(&[1, 2, 12], Dtype::Float32).unwrap(),
        s[1].clone(),
    ];
    assert!(gd.set_state(bad).is_err());
    gd.advance(5);
    assert_eq!(gd.offset(), 5);
    let m = StateCache::recurrent("mamba2", 2, (4, 10), [3, 4, 16], Dtype::Float16).unwrap();
    assert_eq!(m.state()[1].shape(), &[2, 3, 4, 16]);
    assert_eq!(m.state()[1].dtype(), Dtype::Float32);
    let c = StateCache::conv_windows(1, 4, &[("A", 8), ("Bq", 16)], Dtype::Float32).unwrap();
    assert_eq!(c.kind(), "conv_window");
    assert_eq!(c.state().len(), 2);
}

#[test]
fn cloning_caches_shares_memory() {
    // An 8k-token cache; a clone must not allocate a second copy.
    let kv = filled(8192, 9);
    let mut caches: Vec<Box<dyn Cache>> = vec![Box::new(kv)];
    mlx_rs::transforms::eval(caches[0].to_tensors().arrays.values()).unwrap();
    let before = mlex_core::device::active_memory().unwrap();
    let copies: Vec<Vec<Box<dyn Cache>>> = (0..10).map(|_| caches.clone()).collect();
    for c in &copies {
        mlx_rs::transforms::eval(c[0].to_tensors().arrays.values()).unwrap();
    }
    let after = mlex_core::device::active_memory().unwrap();
    let one = caches[0].nbytes();
    assert!(one >= 2 * 8192 * 8 * 64 * 4);
    assert!(
        after.saturating_sub(before) < one / 4,
        "10 clones of a {one}-byte cache allocated {} bytes",
        after.saturating_sub(before)
    );
    // Writing to a clone leaves the original untouched (copy on write).
    let mut original = caches.remove(0);
    let before_vals = vals(&original.to_tensors().arrays["keys"]);
    let mut other = original.box_clone();
    let key = random::key(10).unwrap();
    let k1 = random::normal::<f32>(&[1, 8, 1, 64], None, None, &key).unwrap();
    other.as_kv().unwrap().update_and_fetch(&k1, &k1).unwrap();
    assert_eq!(other.offset(), 8193);
    assert_eq!(original.offset(), 8192);
    assert_eq!(vals(&original.to_tensors().arrays["keys"]), before_vals);
    let _ = original.as_kv();
}
