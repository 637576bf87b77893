//! The drafters: prompt lookup, a draft model, and the scripted drafter of
//! tests and benchmarks.

use super::{draw, host_probs, Draft, DraftRequest, Drafter};
use crate::generate::Generator;
use crate::sampler::token_id;
use mlex_core::error::{Error, Result};
use mlex_core::model::{CacheMark, ModelCache};
use mlx_rs::{ops, Array, Dtype};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

/// Prompt lookup decoding (Saxena, 2023; as in Hugging Face transformers'
/// `prompt_lookup_num_tokens`): the last `n` tokens are searched for
/// earlier in the context, longest `n` first, and the tokens that followed
/// their latest earlier occurrence are the proposal. No second model.
///
/// When the last [`PromptLookup::WINDOW`] proposals were accepted at a
/// rate below [`PromptLookup::MIN_RATE`], it stands down (proposes nothing,
/// so decode runs plain steps) for [`PromptLookup::PAUSE`] rounds, then
/// tries again: free generation, where matches rarely continue, then costs
/// little more than plain decode.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    max_ngram: usize,
    min_ngram: usize,
    recent: VecDeque<(usize, usize)>,
    last_proposed: usize,
    pause: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        Self::new(3, 1)
    }
}

impl PromptLookup {
    /// Proposals judged together for the stand-down.
    pub const WINDOW: usize = 8;
    /// Accepted / proposed tokens below which it stands down.
    pub const MIN_RATE: f64 = 0.2;
    /// Rounds it stands down for.
    pub const PAUSE: usize = 32;

    /// Matches of `min_ngram..=max_ngram` tokens (longest tried first).
    pub fn new(max_ngram: usize, min_ngram: usize) -> Self {
        Self {
            max_ngram: max_ngram.max(1),
            min_ngram: min_ngram.clamp(1, max_ngram.max(1)),
            recent: VecDeque::new(),
            last_proposed: 0,
            pause: 0,
        }
    }

    /// The tokens that followed the latest earlier occurrence of the
    /// context's last n-gram (the latest with `k` tokens after it, if
    /// any), at most `k`.
    pub fn lookup(&self, context: &[u32], k: usize) -> Vec<u32> {
        let len = context.len();
        for n in (self.min_ngram..=self.max_ngram).rev() {
            if len <= n {
                continue;
            }
            let pattern = &context[len - n..];
            // The latest earlier occurrence followed by `k` tokens, else
            // the latest followed by any.
            let mut starts = (0..len - n)
                .rev()
                .filter(|&s| &context[s..s + n] == pattern);
            let Some(latest) = starts.next() else {
                continue;
            };
            let from = std::iter::once(latest)
                .chain(starts)
                .find(|&s| s + n + k <= len)
                .unwrap_or(latest)
                + n;
            return context[from..(from + k).min(len)].to_vec();
        }
        Vec::new()
    }
}

impl Drafter for PromptLookup {
    fn name(&self) -> &'static str {
        "lookup"
    }

    fn propose(&mut self, req: DraftRequest<'_>) -> Result<Draft> {
        if self.pause > 0 {
            self.pause -= 1;
            self.last_proposed = 0;
            return Ok(Draft::default());
        }
        let tokens = self.lookup(req.context, req.k);
        self.last_proposed = tokens.len();
        Ok(Draft {
            tokens,
            ..Draft::default()
        })
    }

    fn take_idle_rounds(&mut self) -> usize {
        self.last_proposed = 0;
        std::mem::take(&mut self.pause)
    }

    fn accepted(&mut self, n: usize) -> Result<()> {
        self.recent.push_back((self.last_proposed, n));
        if self.recent.len() > Self::WINDOW {
            self.recent.pop_front();
        }
        if self.recent.len() == Self::WINDOW {
            let (p, a) = self
                .recent
                .iter()
                .fold((0, 0), |(p, a), (pp, aa)| (p + pp, a + aa));
            if (a as f64) < Self::MIN_RATE * p as f64 {
                self.pause = Self::PAUSE;
                self.recent.clear();
            }
        }
        Ok(())
    }
}

/// A smaller model of the same vocabulary drafts token by token from its
/// own caches, which roll back to the accepted prefix after every round
/// (hybrids included: it keeps a [`CacheMark`] per drafted token).
pub struct DraftModel {
    /// Shared by the drafters of a batch's rows ([`DraftModel::share`]):
    /// one copy of the weights, a cache each.
    generator: Rc<RefCell<Generator>>,
    cache: Option<ModelCache>,
    /// The tokens its cache holds.
    seen: Vec<u32>,
    /// Marks after `seen[..base + j]` for the tokens drafted this round.
    marks: Vec<CacheMark>,
    base: usize,
}

impl DraftModel {
    /// Drafts with `generator`'s model (its compile policy and prefill
    /// chunk); `target_vocab` is the target's vocabulary size, which the
    /// draft's must equal.
    pub fn new(generator: Generator, target_vocab: usize, origin: &str) -> Result<Self> {
        let vocab = generator.model.vocab_size() as usize;
        if vocab != target_vocab {
            return Err(Error::invalid(
                "--draft-model",
                format!(
                    "{origin} has a vocabulary of {vocab} tokens, the target {target_vocab}: a draft model must share the target's tokenizer"
                ),
            ));
        }
        Ok(Self {
            generator: Rc::new(RefCell::new(generator)),
            cache: None,
            seen: Vec::new(),
            marks: Vec::new(),
            base: 0,
        })
    }

    /// A drafter on the same draft model with caches of its own (another
    /// sequence of a batch).
    pub fn share(&self) -> Self {
        Self {
            generator: self.generator.clone(),
            cache: None,
            seen: Vec::new(),
            marks: Vec::new(),
            base: 0,
        }
    }

    /// Brings its cache up to `context` and returns the logits `[1, V]`
    /// after it, or `None` when it cannot roll back `k` tokens (a full
    /// sliding window).
    fn catch_up(&mut self, context: &[u32], k: usize) -> Result<Option<Array>> {
        let mut generator = self.generator.borrow_mut();
        if self.cache.is_none()
            || !context.starts_with(&self.seen)
            || self.seen.len() == context.len()
        {
            self.cache = Some(generator.model.make_cache(1)?);
            self.seen.clear();
        }
        let cache = self.cache.as_mut().expect("made above");
        let start = self.seen.len();
        let logits = generator.prefill(&context[start..], start, cache, None, None)?;
        self.seen.extend_from_slice(&context[start..]);
        Ok(cache.can_take_back(k).then_some(logits))
    }
}

impl Drafter for DraftModel {
    fn name(&self) -> &'static str {
        "draft-model"
    }

    fn propose(&mut self, req: DraftRequest<'_>) -> Result<Draft> {
        self.marks.clear();
        let Some(mut logits) = self.catch_up(req.context, req.k)? else {
            return Ok(Draft::default());
        };
        self.base = self.seen.len();
        let greedy = req.sampler.config().is_greedy();
        let mut tokens = Vec::with_capacity(req.k);
        let mut probs = Vec::new();
        for j in 0..req.k {
            let t = if greedy {
                let id = ops::indexing::argmax_axis(&logits, -1, None)?;
                token_id(&id.as_dtype(Dtype::Uint32)?)?
            } else {
                let q = host_probs(&req.sampler.probs(&logits, None)?)?;
                let t = draw(&q, req.rng);
                probs.push(q);
                t
            };
            tokens.push(t);
            if j + 1 < req.k {
                let cache = self.cache.as_mut().expect("caught up");
                self.marks.push(cache.mark());
                let x = Array::from_slice(&[t as i32], &[1, 1]);
                logits = self.generator.borrow_mut().step(&x, cache)?;
                self.seen.push(t);
            }
        }
        Ok(Draft {
            tokens,
            probs: (!greedy).then_some(probs),
            keep: None,
        })
    }

    fn accepted(&mut self, n: usize) -> Result<()> {
        // The cache holds the context and the drafted tokens but the last;
        // keep the context and the accepted ones.
        if let Some(mark) = self.marks.get(n) {
            self.cache.as_mut().expect("proposed").rewind(mark)?;
            self.seen.truncate(self.base + n);
        }
        self.marks.clear();
        Ok(())
    }
}

/// Which draft tokens a [`ScriptedDrafter`] spoils.
#[derive(Clone, Copy, Debug)]
pub enum Spoil {
    /// Each token independently with probability `1 - acceptance`.
    Random {
        /// The chance a token is kept.
        acceptance: f64,
    },
    /// Round `r` spoils its token `r mod (k + 1)` (none when that is `k`),
    /// so rejections fall at every position in turn.
    Cycle,
    /// As `Random`, and the round keeps exactly the tokens before the
    /// first spoiled one whatever the target says ([`Draft::keep`]): on
    /// random weights in low precision a verify forward and a decode step
    /// round near ties apart, so the target's own continuation is no
    /// reliable script. Off the script it proposes arbitrary tokens.
    /// Benchmarks only: the output is not the target's.
    Forced {
        /// The chance a token is kept.
        acceptance: f64,
    },
}

/// A drafter for tests and benchmarks, where random weights make every
/// real drafter's acceptance meaningless: it proposes the continuation of
/// a known sequence (the target's own greedy output after the prompt) and
/// replaces tokens by others as [`Spoil`] says, so acceptance is what the
/// benchmark sets. Off the script it proposes nothing.
pub struct ScriptedDrafter {
    script: Vec<u32>,
    vocab: u32,
    spoil: Spoil,
    rng: StdRng,
    round: usize,
    oracle: Option<Generator>,
    resyncs: usize,
}

impl ScriptedDrafter {
    /// Proposes from `script` (prompt then continuation) in a vocabulary of
    /// `vocab`; `seed` drives [`Spoil::Random`].
    pub fn new(script: Vec<u32>, vocab: u32, spoil: Spoil, seed: u64) -> Self {
        Self {
            script,
            vocab: vocab.max(2),
            spoil,
            rng: StdRng::seed_from_u64(seed),
            round: 0,
            oracle: None,
            resyncs: 0,
        }
    }

    /// Off the script, continue it with `oracle`'s greedy output (a second
    /// copy of the target): in low precision a verify forward's rounding
    /// differs from a decode step's, so at a near tie the output may leave
    /// the script, and without an oracle the drafter would then propose
    /// nothing. Its time is the drafter's (`SpecStats::draft_s`).
    pub fn with_oracle(mut self, oracle: Generator) -> Self {
        self.oracle = Some(oracle);
        self
    }

    /// How often the oracle continued the script.
    pub fn resyncs(&self) -> usize {
        self.resyncs
    }

    fn on_script(&self, context: &[u32]) -> bool {
        context.len() < self.script.len() && self.script[..context.len()] == *context
    }
}

impl Drafter for ScriptedDrafter {
    fn name(&self) -> &'static str {
        "scripted"
    }

    fn propose(&mut self, req: DraftRequest<'_>) -> Result<Draft> {
        let len = req.context.len();
        let forced = matches!(self.spoil, Spoil::Forced { .. });
        if !self.on_script(req.context) && !forced {
            let Some(oracle) = self.oracle.as_mut() else {
                return Ok(Draft::default());
            };
            let opts = crate::generate::GenerateOptions {
                max_tokens: req.k.max(64),
                sampler: crate::sampler::SamplerConfig::default(),
                stop_ids: Default::default(),
                use_prompt_cache: false,
                ..Default::default()
            };
            let more = oracle.generate(req.context, &opts, &mut |_| {
                Ok(crate::generate::Flow::Continue)
            })?;
            self.script = req.context.to_vec();
            self.script.extend(more.tokens);
            self.resyncs += 1;
        }
        let mut tokens = if self.on_script(req.context) {
            self.script[len..(len + req.k).min(self.script.len())].to_vec()
        } else {
            (0..req.k)
                .map(|_| self.rng.random_range(0..self.vocab))
                .collect()
        };
        let cycle_at = self.round % (req.k + 1);
        self.round += 1;
        let mut keep = None;
        for (i, t) in tokens.iter_mut().enumerate() {
            let spoil = match self.spoil {
                Spoil::Random { acceptance } | Spoil::Forced { acceptance } => {
                    self.rng.random::<f64>() >= acceptance
                }
                Spoil::Cycle => i == cycle_at,
            };
            if spoil {
                *t = (*t + 1 + self.rng.random_range(0..self.vocab - 1)) % self.vocab;
                keep = keep.or(Some(i));
            }
        }
        let keep = forced.then(|| keep.unwrap_or(tokens.len()));
        Ok(Draft {
            tokens,
            probs: None,
            keep,
        })
    }

    fn accepted(&mut self, _n: usize) -> Result<()> {
        Ok(())
    }
}

/// A drafter whose rounds keep a set share of its drafts (benchmarks
/// only): `inner` drafts as it would (its time is real), then each round
/// keeps the drafts before the first one a coin of `acceptance` spoils
/// ([`Draft::keep`]), whatever the target says. It measures what a real
/// drafter (an MTP head on random weights, say) would give at that
/// acceptance; the output is not the target's.
pub struct ForcedKeep {
    inner: Box<dyn Drafter>,
    acceptance: f64,
    rng: StdRng,
}

impl ForcedKeep {
    /// Wraps `inner`; `seed` drives the coins.
    pub fn new(inner: Box<dyn Drafter>, acceptance: f64, seed: u64) -> Self {
        Self {
            inner,
            acceptance,
            rng: StdRng::seed_from_u64(seed),
        }
    }
}

impl Drafter for ForcedKeep {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn wants_hidden(&self) -> bool {
        self.inner.wants_hidden()
    }

    fn propose(&mut self, req: DraftRequest<'_>) -> Result<Draft> {
        let mut d = self.inner.propose(req)?;
        let kept = (0..d.tokens.len())
            .take_while(|_| self.rng.random::<f64>() < self.acceptance)
            .count();
        d.keep = Some(kept);
        Ok(d)
    }

    fn accepted(&mut self, n: usize) -> Result<()> {
        self.inner.accepted(n)
    }
}
