//! Made-up token ids for benchmarks and tests: deterministic streams from
//! a 64-bit linear congruential generator (Knuth's MMIX constants), the
//! same on every machine and with no random-number crate.

/// `n` ids in `[0, vocab)` from the generator started at `state`.
pub fn lcg_ids(mut state: u64, n: usize, vocab: u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab) as u32
        })
        .collect()
}
