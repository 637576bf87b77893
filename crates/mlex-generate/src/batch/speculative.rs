//! Speculative decoding inside the batch: every row proposes its own drafts,
//! one verify forward takes `[rows, T]` tokens (`T` the longest proposal
//! plus one; shorter rows are padded), each row is judged by its own
//! sampler (the rule of [`crate::speculative`]) and keeps its own accepted
//! prefix: [`ModelCache::commit_rows`] leaves holes in the batch KV cache
//! where a row kept fewer tokens than another
//! (`mlex_cache::BatchKvCache`), and recurrent state takes each row's own
//! position. Rows that propose nothing verify only their one token, so
//! rows with and without drafts share a round.
//!
//! A drafter that reads the target's hidden states (the MTP head) gets its
//! row's: such a row is prefilled on its own with every position's normed
//! state (never from the prompt cache, whose prefixes have none), and while
//! it is in the batch every step, plain or a round, keeps the normed states
//! of the positions each row committed ([`RowSpec::hidden`]).
//!
//! Rounds run while few rows are active ([`BatchSpeculation::max_rows`]):
//! a fuller batch already keeps the device busy, and a verify forward of
//! `rows x T` tokens then costs more than it saves (measured in
//! `docs/BENCHMARKS.md`). Rows with a grammar or log-probabilities, and
//! rows still feeding a prompt tail, run plain steps (their batch does).

use super::{Active, BatchGenerator, Emitted, SeqId};
use crate::generate::{Flow, GenerateOptions};
use crate::speculative::{argmax_ids, Draft, DraftRequest, Drafter, Judge, SpecStats};
use mlex_core::error::Result;
use mlex_core::model::Model;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use rand::rngs::StdRng;
use std::time::Instant;

/// Speculative decoding in a [`BatchGenerator`].
pub struct BatchSpeculation {
    /// Makes the drafter of one admitted request.
    pub make: Box<dyn FnMut() -> Result<Box<dyn Drafter>>>,
    /// Most tokens a row proposes a round (`--draft-tokens`).
    pub k: usize,
    /// Rounds run while at most this many rows are active; a fuller batch
    /// decodes plain steps.
    pub max_rows: usize,
}

/// One row's drafting state.
pub(super) struct RowSpec {
    drafter: Box<dyn Drafter>,
    /// The prompt and every token handed out (what drafters and
    /// penalties read).
    pub(super) tokens: Vec<u32>,
    rng: StdRng,
    pub(super) stats: SpecStats,
    /// For a drafter that reads the target's hidden states: the normed
    /// states (`[1, n, D]` pieces) of the positions committed since its
    /// last proposal, the prompt's at first.
    hidden: Option<Vec<Array>>,
}

impl RowSpec {
    /// A row's drafting state: `drafter`, its prompt, its random stream;
    /// `prompt_hidden`, the prompt's normed states, for a drafter that
    /// reads them.
    pub(super) fn new(
        drafter: Box<dyn Drafter>,
        prompt: &[u32],
        rng: StdRng,
        k: usize,
        prompt_hidden: Option<Array>,
    ) -> Self {
        let hidden = drafter
            .wants_hidden()
            .then(|| prompt_hidden.into_iter().collect());
        let stats = SpecStats {
            drafter: drafter.name().to_owned(),
            draft_tokens: k,
            ..SpecStats::default()
        };
        Self {
            drafter,
            tokens: prompt.to_vec(),
            rng,
            stats,
            hidden,
        }
    }

    /// True when its drafter reads the target's hidden states.
    pub(super) fn wants_hidden(&self) -> bool {
        self.hidden.is_some()
    }
}

impl Active {
    /// This row's proposal after `y` (the token it feeds next, not yet
    /// handed out), within its token budget and context.
    fn propose(&mut self, y: u32, k: usize, model: &Model) -> Result<Draft> {
        let Some(s) = self.spec.as_mut() else {
            return Ok(Draft::default());
        };
        // `y` and the accepted drafts are handed out this round; the token
        // after them is fed by the next.
        let budget = self.max_tokens.saturating_sub(self.out.len() + 1);
        let room = self
            .context
            .saturating_sub(self.prompt_len + self.out.len() + 2);
        let kk = k.min(budget).min(room);
        if kk == 0 {
            return Ok(Draft::default());
        }
        let t0 = Instant::now();
        let hidden = match s.hidden.as_mut() {
            Some(parts) => crate::speculative::take_hidden(parts)?,
            None => None,
        };
        s.tokens.push(y);
        let proposed = s.drafter.propose(DraftRequest {
            context: &s.tokens,
            k: kk,
            sampler: &self.sampler,
            rng: &mut s.rng,
            model: Some(model),
            hidden: hidden.as_ref(),
        });
        s.tokens.pop();
        let mut draft = proposed?;
        draft.tokens.truncate(kk);
        s.stats.draft_s += t0.elapsed().as_secs_f64();
        Ok(draft)
    }
}

impl BatchGenerator<'_> {
    /// A drafter for each admitted request of these options, in order
    /// (speculation's factory is called in submission order): none when
    /// speculation is off, or for a request held to a grammar or asking
    /// for log-probabilities (those decode plain steps).
    pub(super) fn drafters_for<'o>(
        &mut self,
        opts: impl Iterator<Item = &'o GenerateOptions>,
    ) -> Result<Vec<Option<Box<dyn Drafter>>>> {
        opts.map(|o| match self.speculation.as_mut() {
            Some(spec) if o.constraint.is_none() && o.logprobs.is_none() => (spec.make)().map(Some),
            _ => Ok(None),
        })
        .collect()
    }

    /// True when some row's drafter reads the target's hidden states.
    pub(super) fn rows_want_hidden(&self) -> bool {
        self.slots
            .iter()
            .flatten()
            .any(|a| a.spec.as_ref().is_some_and(RowSpec::wants_hidden))
    }

    /// Keeps for each row that reads them the normed states `[B, T, D]` of
    /// the first `kept[r]` positions, the ones it committed.
    fn keep_hidden(&mut self, normed: &Array, kept: &[usize]) -> Result<()> {
        for (r, slot) in self.slots.iter_mut().enumerate() {
            let Some(parts) = slot
                .as_mut()
                .and_then(|a| a.spec.as_mut())
                .and_then(|s| s.hidden.as_mut())
            else {
                continue;
            };
            let (r, n) = (r as i32, kept[r] as i32);
            parts.push(normed.try_index((r..r + 1, ..n, ..))?);
        }
        Ok(())
    }

    /// A plain decode step of `[B, 1]` tokens that also keeps the normed
    /// states of the rows that read them: `[B, V]` logits.
    pub(super) fn step_keeping_hidden(&mut self, inp: &Array) -> Result<Array> {
        let cache = self.cache.as_mut().expect("a used batch has caches");
        let (logits, normed, states) = self.gen.verify_normed(inp, cache)?;
        cache.commit(states, 1)?;
        self.keep_hidden(&normed, &vec![1; self.slots.len()])?;
        Ok(ops::squeeze_axes(&logits, &[1])?)
    }

    /// True when the next step can be a speculative round: speculation is
    /// on, few enough rows are active, and every one of them drafts and
    /// feeds an output token.
    pub(super) fn can_speculate(&self) -> bool {
        let Some(spec) = &self.speculation else {
            return false;
        };
        self.active() <= spec.max_rows
            && self.slots.iter().flatten().all(|a| {
                a.spec.is_some()
                    && a.prompt_rest.is_empty()
                    && !a.next_is_prompt
                    && a.failed.is_none()
            })
    }

    /// One speculative round for every row; `Ok(false)` when no row
    /// proposed anything (or the caches could not take the tokens back),
    /// with the batch as it was, for a plain step instead.
    pub(super) fn round(
        &mut self,
        on_token: &mut dyn FnMut(SeqId, &Emitted) -> Result<Flow>,
    ) -> Result<bool> {
        let k = self.speculation.as_ref().map_or(1, |s| s.k);
        let feed = self.next.take().expect("a used batch has tokens");
        let waited = Instant::now();
        feed.eval()?;
        self.stats.wait_time += waited.elapsed();
        let ids: Vec<u32> = feed.as_slice::<u32>().to_vec();
        let rows = self.slots.len();
        let mut drafts: Vec<Draft> = (0..rows).map(|_| Draft::default()).collect();
        for (r, slot) in self.slots.iter_mut().enumerate() {
            if let Some(a) = slot {
                drafts[r] = a.propose(ids[r], k, &self.gen.model)?;
            }
        }
        let longest = drafts.iter().map(|d| d.tokens.len()).max().unwrap_or(0);
        let cache = self.cache.as_mut().expect("a used batch has caches");
        if longest == 0 || !cache.can_take_back(longest + 1) {
            for (slot, d) in self.slots.iter_mut().zip(&drafts) {
                if let (Some(s), false) = (
                    slot.as_mut().and_then(|a| a.spec.as_mut()),
                    d.tokens.is_empty(),
                ) {
                    s.drafter.accepted(0)?;
                }
            }
            self.next = Some(feed);
            return Ok(false);
        }
        let t = longest + 1;
        let want_hidden = self.rows_want_hidden();
        let cache = self.cache.as_mut().expect("a used batch has caches");
        let inputs: Vec<Vec<i32>> = (0..rows)
            .map(|r| {
                let y = ids[r] as i32;
                let mut v = vec![y];
                v.extend(drafts[r].tokens.iter().map(|&d| d as i32));
                v.resize(t, y);
                v
            })
            .collect();
        let flat: Vec<i32> = inputs.iter().flatten().copied().collect();
        let x = Array::from_slice(&flat, &[rows as i32, t as i32]);
        let started = Instant::now();
        let (logits, normed, states) = if want_hidden {
            let (l, n, s) = self.gen.verify_normed(&x, cache)?;
            (l, Some(n), s)
        } else {
            let (l, s) = self.gen.verify(&x, cache)?;
            (l, None, s)
        };
        let emitted = self.judge(&logits, &inputs, &drafts)?;
        let verify_s = started.elapsed().as_secs_f64();
        let kept: Vec<usize> = emitted.iter().map(Vec::len).collect();
        let committed = Instant::now();
        self.cache
            .as_mut()
            .expect("a used batch has caches")
            .commit_rows(states, &kept)?;
        if let Some(normed) = normed {
            self.keep_hidden(&normed, &kept)?;
        }
        let commit_s = committed.elapsed().as_secs_f64();
        let mut next = vec![0u32; rows];
        for r in 0..rows {
            let Some(a) = self.slots[r].as_mut() else {
                continue;
            };
            let e = &emitted[r];
            next[r] = *e.last().expect("a round emits a token a row");
            let accepted = e.len() - 1;
            let n = drafts[r].tokens.len();
            if let Some(s) = a.spec.as_mut() {
                if n > 0 {
                    s.drafter.accepted(accepted)?;
                    s.stats.record(n, accepted);
                } else {
                    s.stats.plain_steps += 1;
                }
                s.stats.verify_s += verify_s;
                s.stats.commit_s += commit_s;
            }
            // `y`, then the accepted drafts; the target's own token is fed
            // by the next step.
            let out = std::iter::once(ids[r]).chain(e[..accepted].iter().copied());
            for tok in out.collect::<Vec<u32>>() {
                if let Some(end) = self.hand_out(r, tok, None, on_token)? {
                    self.retire(r, Ok(end));
                    break;
                }
            }
        }
        for a in self.slots.iter_mut().flatten() {
            refresh_history(a)?;
        }
        self.next = Some(Array::from_slice(&next, &[rows as i32]));
        Ok(true)
    }

    /// Each row's emitted tokens: its accepted drafts, then the target's
    /// own token (a free row: one token, ignored).
    fn judge(
        &mut self,
        logits: &Array,
        inputs: &[Vec<i32>],
        drafts: &[Draft],
    ) -> Result<Vec<Vec<u32>>> {
        let rows = self.slots.len();
        let t = inputs.first().map_or(1, Vec::len);
        let mut emitted: Vec<Vec<u32>> = vec![vec![0]; rows];
        let forced = drafts.iter().any(|d| d.keep.is_some());
        if !forced && self.slots.iter().flatten().all(Active::plain_greedy) {
            // One argmax for the whole batch.
            let targets = argmax_ids(&logits.as_dtype(Dtype::Float32)?)?;
            for (r, slot) in self.slots.iter().enumerate() {
                if slot.is_none() {
                    continue;
                }
                let d = &drafts[r].tokens;
                let row = &targets[r * t..(r + 1) * t];
                emitted[r] = accept_greedy(d, row);
            }
            return Ok(emitted);
        }
        for (r, slot) in self.slots.iter_mut().enumerate() {
            let Some(a) = slot else { continue };
            let Some(s) = a.spec.as_mut() else { continue };
            let ctx = a.sampler.config().repetition_context.max(1);
            let history = a
                .sampler
                .config()
                .uses_history()
                .then_some((s.tokens.as_slice(), ctx));
            let greedy = a.sampler.config().is_greedy();
            let n = drafts[r].tokens.len();
            let r = r as i32;
            let judge = Judge {
                sampler: &a.sampler,
                logits: ops::squeeze_axes(&logits.try_index(r..r + 1)?, &[0])?,
                history,
                input: &inputs[r as usize][..=n],
            };
            emitted[r as usize] = judge.emitted(&drafts[r as usize], greedy, &mut s.rng)?;
        }
        Ok(emitted)
    }
}

/// The greedy rule on one row: the drafts the targets agree with, then the
/// target's token after them.
fn accept_greedy(drafts: &[u32], targets: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(drafts.len() + 1);
    for (i, &target) in targets.iter().enumerate().take(drafts.len() + 1) {
        out.push(target);
        if i == drafts.len() || drafts[i] != target {
            break;
        }
    }
    out
}

/// The penalties' device history of a row after a round: the tail of what
/// it fed (its prompt and the tokens handed out).
fn refresh_history(a: &mut Active) -> Result<()> {
    let (Some(h), Some(s)) = (&a.history, &a.spec) else {
        return Ok(());
    };
    let ctx = a.sampler.config().repetition_context.max(1);
    let tail: Vec<i32> = s.tokens[s.tokens.len().saturating_sub(ctx)..]
        .iter()
        .map(|&t| t as i32)
        .collect();
    let dtype = h.dtype();
    a.history = Some(Array::from_slice(&tail, &[1, tail.len() as i32]).as_dtype(dtype)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::accept_greedy;

    #[test]
    fn greedy_rounds_keep_the_agreeing_prefix_and_the_targets_token() {
        assert_eq!(accept_greedy(&[5, 6, 7], &[5, 6, 9, 1]), [5, 6, 9]);
        assert_eq!(accept_greedy(&[5, 6, 7], &[5, 6, 7, 1]), [5, 6, 7, 1]);
        assert_eq!(accept_greedy(&[5], &[4, 8, 8]), [4]);
        // No drafts: the target's first token alone (padding ignored).
        assert_eq!(accept_greedy(&[], &[3, 3, 3]), [3]);
    }
}
