//! The multi-token-prediction drafter: the target's own MTP head
//! ([`mlex_core::mtp`]) drafts from the target's hidden states.
//!
//! The head's cache holds one row per position `j` of the target's cache,
//! `(h[j], t[j+1])` (as vLLM and llama.cpp keep it). Each proposal first
//! computes the rows of the positions the target committed since the last
//! one, from their hidden states (the prompt's at the first): the last of
//! them, `(h[n-1], y)` with `y` the token about to be verified, gives the
//! first draft. Each later draft is one more row, the previous row's own
//! normed state with the token just drafted, one position on. Those chained
//! rows rest on draft states, so the next proposal takes them back first
//! (the head's caches trim like any attention cache) and rebuilds the rows
//! of what the target kept from its real states: rollback by recomputing a
//! one-layer head over a few rows, never the target.

use super::{draw, host_probs, Draft, DraftRequest, Drafter};
use crate::sampler::token_id;
use mlex_core::cache::Cache;
use mlex_core::error::{Error, Result};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};

/// Drafts with the target's multi-token-prediction head.
#[derive(Default)]
pub struct MtpDrafter {
    caches: Option<Vec<Vec<Box<dyn Cache>>>>,
    /// Rows in the caches that rest on the target's states.
    confirmed: usize,
    /// Rows after them, chained on draft states (taken back next time).
    chained: usize,
}

impl MtpDrafter {
    /// A drafter for a target loaded with its head.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Drafter for MtpDrafter {
    fn name(&self) -> &'static str {
        "mtp"
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn propose(&mut self, req: DraftRequest<'_>) -> Result<Draft> {
        let model = req
            .model
            .ok_or_else(|| Error::Other("the MTP drafter was given no target model".into()))?;
        let head = model.mtp.as_ref().ok_or_else(|| {
            Error::invalid(
                "--mtp",
                "the target was loaded without its multi-token-prediction head",
            )
        })?;
        let hidden = req.hidden.ok_or_else(|| {
            Error::Other("the MTP drafter was given no hidden states of the target".into())
        })?;
        let n = req.context.len() - 1;
        let new = hidden.shape()[1] as usize;
        if self.confirmed + new != n {
            return Err(Error::Other(format!(
                "the MTP drafter holds {} rows and was given {new} more for {n} positions",
                self.confirmed
            )));
        }
        if self.caches.is_none() {
            self.caches = Some(head.make_caches(model, 1)?);
        }
        let caches = self.caches.as_mut().expect("made above");
        for c in caches.iter_mut().flatten() {
            if c.grows() {
                c.trim(self.chained);
            }
        }
        self.chained = 0;
        let next: Vec<i32> = req.context[self.confirmed + 1..=n]
            .iter()
            .map(|&t| t as i32)
            .collect();
        let (mut logits, mut normed) = model.mtp_rows(
            hidden,
            &Array::from_slice(&next, &[1, next.len() as i32]),
            caches,
        )?;
        self.confirmed = n;
        let greedy = req.sampler.config().is_greedy();
        let mut tokens = Vec::with_capacity(req.k);
        let mut probs = Vec::new();
        for j in 0..req.k {
            let t = logits.shape()[1];
            let last = logits.try_index((.., t - 1, ..))?;
            let d = if greedy {
                token_id(&ops::indexing::argmax_axis(&last, -1, None)?.as_dtype(Dtype::Uint32)?)?
            } else {
                let q = host_probs(&req.sampler.probs(&last, None)?)?;
                let d = draw(&q, req.rng);
                probs.push(q);
                d
            };
            tokens.push(d);
            if j + 1 == req.k {
                break;
            }
            let t = normed.shape()[1];
            let h = normed.try_index((.., t - 1.., ..))?;
            (logits, normed) =
                model.mtp_rows(&h, &Array::from_slice(&[d as i32], &[1, 1]), caches)?;
            self.chained += 1;
        }
        Ok(Draft {
            tokens,
            probs: (!greedy).then_some(probs),
            keep: None,
        })
    }

    fn accepted(&mut self, _n: usize) -> Result<()> {
        // The rows of what was kept come from the target's own states at
        // the next proposal.
        Ok(())
    }
}
