//! Speculative decoding: a drafter proposes `k` tokens, the target model
//! verifies them and the token after them in one forward over `k + 1`
//! positions, and the standard accept/reject rule keeps a prefix of the
//! proposal (Leviathan, Kalman, Matias, *Fast Inference from Transformers
//! via Speculative Decoding*, 2023; Chen et al., *Accelerating Large
//! Language Model Decoding with Speculative Sampling*, 2023). Reference
//! implementation: mlx-lm `generate.py`, `speculative_generate_step`, which
//! refuses models with recurrent state; here every cache kind rolls back by
//! keeping its state after each verified position
//! ([`mlex_core::model::Model::verify`], [`ModelCache::commit`]).
//!
//! The rule keeps the target's distribution exactly: a draft token `d`
//! drawn from `q` is accepted with probability `min(1, p(d) / q(d))`; on
//! rejection the token comes from `max(0, p - q)` renormalised, and after
//! `k` acceptances one more comes from `p`. A draft chosen rather than
//! sampled (prompt lookup, a greedy drafter) is a point mass `q = δ_d`:
//! accepted with probability `p(d)`, otherwise replaced from `p` without
//! `d`. When greedy, `p` is the point mass on the target's argmax, so the
//! output is token for token the plain greedy output.

use crate::sampler::Sampler;
use mlex_core::error::{Error, Result};
use mlx_rs::{ops, Array};
use rand::rngs::StdRng;
use rand::Rng;

mod decode;
mod drafters;
mod mtp;

pub(crate) use decode::{argmax_ids, Judge};

pub use drafters::{DraftModel, ForcedKeep, PromptLookup, ScriptedDrafter, Spoil};
pub use mtp::MtpDrafter;

/// Most tokens one round may propose (`--draft-tokens`).
pub const MAX_DRAFT_TOKENS: usize = 16;

/// Checks a `--draft-tokens` value.
pub fn check_draft_tokens(k: usize) -> Result<usize> {
    if (1..=MAX_DRAFT_TOKENS).contains(&k) {
        Ok(k)
    } else {
        Err(Error::invalid(
            "--draft-tokens",
            format!("{k} is outside 1..={MAX_DRAFT_TOKENS}"),
        ))
    }
}

/// What a drafter proposes for one round.
#[derive(Clone, Debug, Default)]
pub struct Draft {
    /// The proposed tokens, in order (may be fewer than asked, or none).
    pub tokens: Vec<u32>,
    /// The distribution each token was drawn from (`V` probabilities
    /// each); `None` when the tokens were chosen, not sampled (point
    /// masses).
    pub probs: Option<Vec<Vec<f32>>>,
    /// Benchmarks only ([`Spoil::Forced`]): the round keeps exactly this
    /// many draft tokens whatever the target says, then the target's own
    /// token after them. The output is then not the target's; it measures
    /// the mechanism at a set acceptance.
    pub keep: Option<usize>,
}

/// What a drafter gets to make a proposal.
pub struct DraftRequest<'a> {
    /// Every token so far: the prompt, then the output; the last one is
    /// not yet in the target's cache.
    pub context: &'a [u32],
    /// Most tokens to propose.
    pub k: usize,
    /// The target's sampler: drafts drawn from a distribution should use
    /// its [`Sampler::probs`] (and [`Sampler::config`]) so that they are
    /// accepted often; any distribution keeps the output exact.
    pub sampler: &'a Sampler,
    /// The generation's random stream, for drafts that are sampled.
    pub rng: &'a mut StdRng,
    /// The target model (its multi-token-prediction head drafts), when
    /// the caller has it.
    pub model: Option<&'a mlex_core::model::Model>,
    /// For a drafter that [`Drafter::wants_hidden`]: the target's states
    /// after its final norm, `[1, n, D]`, of the positions it committed
    /// since the last proposal (the prompt's, at the first), in order; the
    /// state at position `j` is the one whose logits gave token `j + 1`.
    pub hidden: Option<&'a Array>,
}

/// Proposes tokens for the target to verify: a smaller model, the
/// prompt's own n-grams, a model's multi-token-prediction head.
pub trait Drafter {
    /// A short name for reports (`lookup`, `draft-model`).
    fn name(&self) -> &'static str;

    /// Up to `req.k` tokens to follow `req.context`.
    fn propose(&mut self, req: DraftRequest<'_>) -> Result<Draft>;

    /// How many tokens of the last proposal the target accepted (called
    /// once after every non-empty proposal).
    fn accepted(&mut self, n: usize) -> Result<()>;

    /// True when proposals read the target's hidden states
    /// ([`DraftRequest::hidden`]; the target then prefills without its
    /// prompt cache, whose restored prefixes have none).
    fn wants_hidden(&self) -> bool {
        false
    }

    /// The rounds from now on in which it proposes nothing whatever the
    /// context, handed over (it then counts them as passed): the decode
    /// loop runs that many plain steps pipelined, as plain decode does,
    /// instead of asking a round at a time and waiting for each token.
    fn take_idle_rounds(&mut self) -> usize {
        0
    }
}

/// The target's normed states kept since a drafter's last proposal
/// (`[1, n, D]` pieces), as one `[1, sum n, D]` array for its next one;
/// `parts` is left empty. `None` when nothing was kept.
pub(crate) fn take_hidden(parts: &mut Vec<Array>) -> Result<Option<Array>> {
    let h = match parts.len() {
        0 | 1 => parts.pop(),
        _ => Some(ops::concatenate(parts, 1)?),
    };
    parts.clear();
    Ok(h)
}

/// A `[1, V]` (or `[V]`) probability array on the host.
pub(crate) fn host_probs(p: &Array) -> Result<Vec<f32>> {
    let p = ops::reshape(p, &[-1])?;
    p.eval()?;
    Ok(p.as_slice::<f32>().to_vec())
}

/// A draw from the (unnormalised, non-negative) weights `w`.
pub(crate) fn draw(w: &[f32], rng: &mut StdRng) -> u32 {
    let total: f64 = w.iter().map(|&x| f64::from(x.max(0.0))).sum();
    let mut u = rng.random::<f64>() * total;
    let mut last = 0;
    for (i, &x) in w.iter().enumerate() {
        if x > 0.0 {
            last = i;
            u -= f64::from(x);
            if u < 0.0 {
                return i as u32;
            }
        }
    }
    last as u32
}

/// One position of the accept/reject rule: the target's distribution `p`,
/// the draft token `d` and the distribution `q` it was drawn from (`None`:
/// a point mass). Returns whether `d` is accepted and the token to emit
/// (`d`, or the replacement drawn from the residual).
pub fn accept_or_replace(p: &[f32], q: Option<&[f32]>, d: u32, rng: &mut StdRng) -> (bool, u32) {
    let di = d as usize;
    let pd = f64::from(p.get(di).copied().unwrap_or(0.0));
    let qd = q.map_or(1.0, |q| f64::from(q.get(di).copied().unwrap_or(0.0)));
    let accept = if qd <= 0.0 {
        false
    } else {
        rng.random::<f64>() < (pd / qd).min(1.0)
    };
    if accept {
        return (true, d);
    }
    let residual: Vec<f32> = match q {
        Some(q) => p.iter().zip(q).map(|(&a, &b)| (a - b).max(0.0)).collect(),
        None => p
            .iter()
            .enumerate()
            .map(|(i, &a)| if i == di { 0.0 } else { a })
            .collect(),
    };
    if residual.iter().all(|&r| r <= 0.0) {
        // p ≤ q everywhere means p == q: rejection had probability 0 but
        // rounding can get here; p itself is then the right law.
        return (false, draw(p, rng));
    }
    (false, draw(&residual, rng))
}

/// Counters of a speculative generation.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SpecStats {
    /// The drafter (`lookup`, `draft-model`).
    pub drafter: String,
    /// Most tokens proposed per round.
    pub draft_tokens: usize,
    /// Verify forwards run.
    pub rounds: usize,
    /// Single-token steps (no proposal, or a cache that could not roll
    /// back).
    pub plain_steps: usize,
    /// Tokens proposed.
    pub proposed: usize,
    /// Tokens accepted.
    pub accepted: usize,
    /// `accepted_at[i]`: rounds whose token `i + 1` was accepted.
    pub accepted_at: Vec<usize>,
    /// `proposed_at[i]`: rounds that proposed a token `i + 1`.
    pub proposed_at: Vec<usize>,
    /// Seconds drafting.
    pub draft_s: f64,
    /// Seconds in verify forwards and the accept/reject rule.
    pub verify_s: f64,
    /// Seconds committing caches.
    pub commit_s: f64,
}

impl SpecStats {
    /// Accepted / proposed tokens.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.proposed.max(1) as f64
    }

    /// Tokens emitted per verify forward: accepted drafts plus the one the
    /// target adds.
    pub fn mean_accepted_length(&self) -> f64 {
        (self.accepted + self.rounds) as f64 / self.rounds.max(1) as f64
    }

    pub(crate) fn record(&mut self, proposed: usize, accepted: usize) {
        self.rounds += 1;
        self.proposed += proposed;
        self.accepted += accepted;
        if self.proposed_at.len() < proposed {
            self.proposed_at.resize(proposed, 0);
            self.accepted_at.resize(proposed, 0);
        }
        for i in 0..proposed {
            self.proposed_at[i] += 1;
            if i < accepted {
                self.accepted_at[i] += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// Pearson's chi-square of `counts` against the law `p`.
    fn chi_square(counts: &[u64], p: &[f32]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .map(|(&c, &pi)| {
                let e = n as f64 * f64::from(pi);
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    fn normalised(w: &[f32]) -> Vec<f32> {
        let s: f32 = w.iter().sum();
        w.iter().map(|x| x / s).collect()
    }

    /// Samples one emitted token per trial with `rule` and returns the
    /// chi-square of the counts against `p`.
    fn trials(
        p: &[f32],
        q: Option<&[f32]>,
        rule: impl Fn(&[f32], Option<&[f32]>, u32, &mut StdRng) -> (bool, u32),
    ) -> f64 {
        let mut rng = StdRng::seed_from_u64(20261203);
        let mut counts = vec![0u64; p.len()];
        for _ in 0..1_000_000 {
            // The draft: drawn from q, or the fixed point mass on token 2.
            let d = match q {
                Some(q) => draw(q, &mut rng),
                None => 2,
            };
            let (_, t) = rule(p, q, d, &mut rng);
            counts[t as usize] += 1;
        }
        chi_square(&counts, p)
    }

    // 11 degrees of freedom: P(chi2 > 45) is below 1e-5, so a correct rule
    // fails about once in 100,000 runs (the seed is fixed, so never here),
    // and the broken rules below land in the thousands.
    const CRITICAL: f64 = 45.0;

    fn target() -> Vec<f32> {
        normalised(&[5., 1., 9., 0.5, 3., 7., 2., 2., 4., 0.25, 6., 1.5])
    }

    #[test]
    fn the_rule_keeps_the_target_distribution_chi_square() {
        let p = target();
        let q = normalised(&[1., 6., 2., 4., 0.5, 3., 8., 1., 1., 5., 0.75, 2.]);
        let with_q = trials(&p, Some(&q), accept_or_replace);
        assert!(with_q < CRITICAL, "sampled drafts: chi2 {with_q}");
        let point = trials(&p, None, accept_or_replace);
        assert!(point < CRITICAL, "point-mass drafts: chi2 {point}");
        // q == p: everything is accepted and the law is p.
        let same = trials(&p, Some(&p), accept_or_replace);
        assert!(same < CRITICAL, "q = p: chi2 {same}");
    }

    #[test]
    fn the_chi_square_test_catches_a_broken_rule() {
        let p = target();
        let q = normalised(&[1., 6., 2., 4., 0.5, 3., 8., 1., 1., 5., 0.75, 2.]);
        // Accepting every draft gives q, not p.
        let always = |_: &[f32], _: Option<&[f32]>, d: u32, _: &mut StdRng| (true, d);
        assert!(trials(&p, Some(&q), always) > 100.0 * CRITICAL);
        // Replacing a rejected draft from p instead of the residual
        // over-weights the tokens q favours.
        let from_p = |p: &[f32], q: Option<&[f32]>, d: u32, rng: &mut StdRng| {
            let (ok, t) = accept_or_replace(p, q, d, rng);
            if ok {
                (ok, t)
            } else {
                (false, draw(p, rng))
            }
        };
        assert!(trials(&p, Some(&q), from_p) > 10.0 * CRITICAL);
        assert!(trials(&p, None, from_p) > 10.0 * CRITICAL);
    }

    #[test]
    fn draft_tokens_outside_1_to_16_name_the_option() {
        for k in [0, 17] {
            let e = check_draft_tokens(k).unwrap_err().to_string();
            assert!(
                e.contains("--draft-tokens") && e.contains(&k.to_string()),
                "{e}"
            );
        }
        assert_eq!(check_draft_tokens(16).unwrap(), 16);
    }
}
