//! The speculative decode loop of [`Generator`].

use super::{
    accept_or_replace, check_draft_tokens, draw, host_probs, Draft, DraftRequest, Drafter,
    SpecStats,
};
use crate::generate::{Decoded, Finish, Flow, GenerateOptions, Generator};
use crate::sampler::{history_of, host_rng, token_id, Sampler};
use mlex_core::error::Result;
use mlex_core::model::ModelCache;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use rand::rngs::StdRng;
use std::time::Instant;

impl Generator {
    /// The decode loop with a drafter: `first` is the token sampled from
    /// the prompt's logits, `cache` holds the prompt. Each round proposes
    /// up to `k` tokens, verifies them in one forward and commits the
    /// accepted prefix; a round with no proposal (or whose tokens a sliding
    /// window could not take back) is a plain step.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decode_speculative(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        cache: &mut ModelCache,
        sampler: &mut Sampler,
        (drafter, k): (&mut dyn Drafter, usize),
        (first, prompt_hidden): (Array, Option<Array>),
        on_token: &mut dyn FnMut(u32) -> Result<Flow>,
    ) -> Result<Decoded> {
        // The target's normed states of the positions committed since the
        // last proposal, for a drafter that reads them.
        let wants_hidden = drafter.wants_hidden();
        let mut hidden: Vec<Array> = prompt_hidden.into_iter().collect();
        let k = check_draft_tokens(k)?;
        let limit = self.model.max_context.unwrap_or(usize::MAX);
        let mut rng = host_rng(opts.sampler.seed);
        let ctx = opts.sampler.repetition_context.max(1);
        let use_history = opts.sampler.uses_history();
        let greedy = opts.sampler.is_greedy();
        let mut stats = SpecStats {
            drafter: drafter.name().to_owned(),
            draft_tokens: k,
            ..SpecStats::default()
        };
        let mut fed: Vec<u32> = prompt.to_vec();
        let mut out: Vec<u32> = Vec::new();
        let mut pending = vec![token_id(&first)?];
        let first_at = Instant::now();
        let finish = loop {
            if let Some(f) = emit(&mut pending, &mut out, opts, on_token)? {
                break f;
            }
            if fed.len() + 1 >= limit {
                break Finish::Context;
            }
            if out.len() >= opts.max_tokens {
                break Finish::Length;
            }
            let y = *out.last().expect("one token emitted");
            // A drafter standing down: its rounds as plain decode, pipelined.
            let idle = (!wants_hidden).then(|| drafter.take_idle_rounds());
            if let Some(idle) = idle.filter(|&n| n > 0) {
                let at = (&mut fed, &mut out, &mut stats);
                match self.plain_stretch(y, idle, at, opts, cache, sampler, on_token)? {
                    Some(f) => break f,
                    None => continue,
                }
            }
            // Drafts may fill neither the output budget nor the context.
            let kk = k
                .min(opts.max_tokens - out.len() - 1)
                .min(limit - fed.len() - 2);
            let mut draft = Draft::default();
            if kk > 0 {
                let t0 = Instant::now();
                // The context is what the cache holds and `y`.
                fed.push(y);
                let h = super::take_hidden(&mut hidden)?;
                let proposed = drafter.propose(DraftRequest {
                    context: &fed,
                    k: kk,
                    sampler,
                    rng: &mut rng,
                    model: Some(&self.model),
                    hidden: h.as_ref(),
                });
                fed.pop();
                draft = proposed?;
                draft.tokens.truncate(kk);
                stats.draft_s += t0.elapsed().as_secs_f64();
            }
            let n = draft.tokens.len();
            if n == 0 || !cache.can_take_back(n + 1) {
                if n > 0 {
                    drafter.accepted(0)?;
                }
                let logits = self.plain_step(y, cache, wants_hidden.then_some(&mut hidden))?;
                fed.push(y);
                let hist = use_history.then(|| history_of(&fed, ctx));
                pending.push(token_id(&sampler.sample(&logits, hist.as_ref())?)?);
                stats.plain_steps += 1;
                continue;
            }
            let t0 = Instant::now();
            let mut input: Vec<i32> = vec![y as i32];
            input.extend(draft.tokens.iter().map(|&t| t as i32));
            let x = Array::from_slice(&input, &[1, input.len() as i32]);
            let (logits, normed, states) = self.verify_normed(&x, cache)?;
            let judge = Judge {
                sampler,
                logits: ops::squeeze_axes(&logits, &[0])?,
                history: use_history.then_some((fed.as_slice(), ctx)),
                input: &input,
            };
            let emitted = judge.emitted(&draft, greedy, &mut rng)?;
            let accepted = emitted.len() - 1;
            stats.verify_s += t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            cache.commit(states, accepted + 1)?;
            if wants_hidden {
                hidden.push(normed.try_index((.., ..accepted as i32 + 1, ..))?);
            }
            fed.extend(input[..=accepted].iter().map(|&t| t as u32));
            stats.commit_s += t1.elapsed().as_secs_f64();
            drafter.accepted(accepted)?;
            stats.record(n, accepted);
            pending = emitted;
        };
        Ok(Decoded {
            out,
            fed,
            finish,
            first_at: Some(first_at),
            speculative: Some(stats),
        })
    }
}

impl Generator {
    /// Up to `rounds` tokens after `y` (emitted, not yet fed) by plain
    /// decode's pipelined loop, into `out`, `fed` extended by what they
    /// feed and each counted a plain step: the tokens and the sampling
    /// draws of a plain step a round. The reason to stop, if the loop must.
    #[allow(clippy::too_many_arguments)]
    fn plain_stretch(
        &mut self,
        y: u32,
        rounds: usize,
        (fed, out, stats): (&mut Vec<u32>, &mut Vec<u32>, &mut SpecStats),
        opts: &GenerateOptions,
        cache: &mut ModelCache,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(u32) -> Result<Flow>,
    ) -> Result<Option<Finish>> {
        let budget = rounds.min(opts.max_tokens - out.len());
        let ctx = opts.sampler.repetition_context.max(1);
        let use_history = opts.sampler.uses_history();
        let logits = self.step(&Array::from_slice(&[y as i32], &[1, 1]), cache)?;
        fed.push(y);
        let history = history_of(fed, ctx);
        let next = sampler.sample(&logits, use_history.then_some(&history))?;
        let stretch = GenerateOptions {
            max_tokens: budget,
            ..opts.clone()
        };
        let run = self.decode_plain(fed, &stretch, cache, sampler, next, history, on_token)?;
        *fed = run.fed;
        stats.plain_steps += run.out.len();
        out.extend(run.out);
        Ok(match run.finish {
            Finish::Length if out.len() < opts.max_tokens => None,
            f => Some(f),
        })
    }

    /// One token through the target, `[1, V]` logits; with `hidden`, as a
    /// one-token verify that also hands out the step's normed state.
    fn plain_step(
        &mut self,
        y: u32,
        cache: &mut ModelCache,
        hidden: Option<&mut Vec<Array>>,
    ) -> Result<Array> {
        let one = Array::from_slice(&[y as i32], &[1, 1]);
        let Some(hidden) = hidden else {
            return self.step(&one, cache);
        };
        let (l, h, states) = self.verify_normed(&one, cache)?;
        cache.commit(states, 1)?;
        hidden.push(h);
        Ok(ops::squeeze_axes(&l, &[1])?)
    }
}

/// Hands `pending` to `on_token` in order, into `out`; the reason to stop
/// at an end token or when the callback asks.
fn emit(
    pending: &mut Vec<u32>,
    out: &mut Vec<u32>,
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Result<Flow>,
) -> Result<Option<Finish>> {
    for t in pending.drain(..) {
        out.push(t);
        let flow = on_token(t)?;
        if opts.stop_ids.contains(&t) {
            return Ok(Some(Finish::Eos));
        }
        if flow == Flow::Stop {
            return Ok(Some(Finish::Stop));
        }
    }
    Ok(None)
}

/// The accept/reject rule over one verify forward (of one sequence).
pub(crate) struct Judge<'a> {
    pub(crate) sampler: &'a Sampler,
    /// `[T, V]`: the logits after each input position.
    pub(crate) logits: Array,
    /// The tokens before the round and the repetition penalty's context,
    /// when the penalty is on.
    pub(crate) history: Option<(&'a [u32], usize)>,
    /// The round's input: the last token, then the draft.
    pub(crate) input: &'a [i32],
}

impl Judge<'_> {
    /// The logits after input position `i`, `[1, V]`.
    fn at(&self, i: usize) -> Result<Array> {
        Ok(self.logits.try_index(i as i32..i as i32 + 1)?)
    }

    /// The penalty's history at position `i`: everything up to it.
    fn history_at(&self, i: usize) -> Option<Array> {
        self.history.map(|(fed, ctx)| {
            let mut h = fed.to_vec();
            h.extend(self.input[..=i].iter().map(|&t| t as u32));
            history_of(&h, ctx)
        })
    }

    /// The tokens the round emits: the accepted drafts, then the target's
    /// own token (the replacement of the first rejected draft, or the one
    /// after them all).
    pub(crate) fn emitted(
        &self,
        draft: &Draft,
        greedy: bool,
        rng: &mut StdRng,
    ) -> Result<Vec<u32>> {
        let n = draft.tokens.len();
        if let Some(m) = draft.keep {
            // Benchmarks only: the target's token after a set prefix.
            let m = m.min(n);
            let targets = argmax_ids(&self.sampler.filtered(&self.logits, None)?)?;
            let mut emitted = draft.tokens[..m].to_vec();
            emitted.push(targets[m]);
            return Ok(emitted);
        }
        let mut emitted = Vec::with_capacity(n + 1);
        if greedy {
            let targets: Vec<u32> = if self.history.is_some() {
                let rows = (0..=n)
                    .map(|i| {
                        self.sampler
                            .filtered(&self.at(i)?, self.history_at(i).as_ref())
                    })
                    .collect::<Result<Vec<_>>>()?;
                argmax_ids(&ops::concatenate(&rows, 0)?)?
            } else {
                argmax_ids(&self.sampler.filtered(&self.logits, None)?)?
            };
            for (i, &t) in targets.iter().enumerate().take(n + 1) {
                emitted.push(t);
                if i == n || draft.tokens[i] != t {
                    break;
                }
            }
            return Ok(emitted);
        }
        for i in 0..=n {
            let p = host_probs(
                &self
                    .sampler
                    .probs(&self.at(i)?, self.history_at(i).as_ref())?,
            )?;
            if i == n {
                emitted.push(draw(&p, rng));
                break;
            }
            let q = draft.probs.as_ref().map(|q| q[i].as_slice());
            let (ok, t) = accept_or_replace(&p, q, draft.tokens[i], rng);
            emitted.push(t);
            if !ok {
                break;
            }
        }
        Ok(emitted)
    }
}

/// The argmax of every row of `[T, V]` logits (or of any leading shape),
/// on the host.
pub(crate) fn argmax_ids(l: &Array) -> Result<Vec<u32>> {
    let ids = ops::indexing::argmax_axis(l, -1, None)?.as_dtype(Dtype::Uint32)?;
    ids.eval()?;
    Ok(ids.as_slice::<u32>().to_vec())
}
