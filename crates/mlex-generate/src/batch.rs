//! Continuous batching: many sequences decode in one forward.
//!
//! A [`BatchGenerator`] holds a queue of requests and a batch of *slots*.
//! Each call to [`BatchGenerator::step`]:
//!
//! 1. **admits** waiting requests into free slots (the batch grows to the
//!    next bucket, a power of two up to `max_batch`). Their prompts are
//!    prefilled *together* as a staircase: sorted by length, all rows feed
//!    the tokens up to the shortest prompt in one `[rows, T]` forward, that
//!    row leaves with its caches, the rest continue to the next length, and
//!    so on. Every row of a stage sits at the same position, so plain
//!    caches, causal masks and the recurrent layers' prefill serve it
//!    unchanged: no padding enters any recurrence. Each sequence's caches
//!    are then written into its slot ([`mlex_core::cache::Cache::write_row`]): attention KV
//!    into the left-padded [`BatchKvCache`], recurrent state into its row.
//!    A request whose options set `use_prompt_cache` instead restores its
//!    longest cached prefix from the generator's prompt cache (hybrids
//!    through their recurrent-state checkpoints), prefills the rest alone,
//!    and records its prompt for the requests after it.
//! 2. runs **one decode step** for every slot (`[rows, 1]` tokens; compiled
//!    segments are traced once per bucket size), samples each row with its
//!    own options, and hands the step to MLX (`async_eval`) before it waits
//!    for the previous step's tokens, as the single-sequence loop does.
//! 3. **emits** the previous step's tokens, and retires sequences that hit
//!    an end token, their `max_tokens`, the context limit, a stop from the
//!    callback (stop strings) or a cancel: their slot is freed, nothing is
//!    copied, and the others never notice. When few slots stay used, the
//!    batch is compacted to a smaller bucket (one copy).
//!
//! Every layer kind batches through the [`mlex_core::cache::Cache`] row operations, so no
//! architecture has code of its own here; a cache kind that cannot batch
//! (the sliding-window KV) is refused with an error naming it.

mod speculative;

pub use speculative::BatchSpeculation;

use crate::constraint::Constraint;
use crate::generate::{Finish, Flow, GenerateOptions, Generator, CONTEXT_HINT};
use crate::sampler::{LogprobArrays, Sampler};
use crate::speculative::SpecStats;
use mlex_cache::BatchKvCache;
use mlex_core::error::{Error, Result};
use mlex_core::model::ModelCache;
use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array, Dtype};
use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

/// Identifies one request of a [`BatchGenerator`].
pub type SeqId = u64;

/// A token handed to [`BatchGenerator::step`]'s callback.
#[derive(Clone, Debug, PartialEq)]
pub struct Emitted {
    /// The token id.
    pub id: u32,
    /// Its log-probability and the most likely alternatives, when the
    /// request's options ask for them ([`GenerateOptions::logprobs`]).
    pub logprob: Option<TokenLogprob>,
}

/// The log-probability of one generated token (after the logit bias and
/// penalties, before temperature: what mlx-lm reports).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's.
    pub logprob: f32,
    /// The most likely tokens at that position with theirs, most likely
    /// first.
    pub top: Vec<(u32, f32)>,
}

/// One finished request.
#[derive(Clone, Debug)]
pub struct BatchOutput {
    /// Generated ids (including a final end token).
    pub tokens: Vec<u32>,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Prompt tokens restored from the prompt cache (not computed).
    pub reused_tokens: usize,
    /// Why it ended.
    pub finish: Finish,
    /// Its speculative decoding, when the batch drafted for it.
    pub speculative: Option<SpecStats>,
}

/// Totals over a generator's life (for benchmarks and logs).
#[derive(Clone, Debug, Default)]
pub struct BatchStats {
    /// Prompt tokens computed: prefilled, or fed as tails through decode
    /// steps (`tail_tokens`).
    pub prefill_tokens: usize,
    /// Prompt tokens restored from the prompt cache instead.
    pub reused_tokens: usize,
    /// Of `prefill_tokens`, those fed through decode steps (prompt tails
    /// of at most [`FEED_MAX`] tokens after a prompt-cache hit).
    pub tail_tokens: usize,
    /// Wall time of admissions (prefill, until the first tokens exist; a
    /// prompt tail fed through decode steps is in `decode_time`).
    pub prefill_time: Duration,
    /// Wall time of decode steps (graph building, waiting for the device,
    /// handing out tokens, compaction), admissions excluded.
    pub decode_time: Duration,
    /// Of `decode_time`, the time spent waiting for a step's tokens.
    pub wait_time: Duration,
    /// Of `decode_time`, the time spent in the caller's token callbacks.
    pub callback_time: Duration,
    /// Tokens emitted.
    pub generated_tokens: usize,
    /// Decode steps run.
    pub steps: usize,
    /// Most slots in use at once.
    pub peak_active: usize,
    /// Host time finished constrained sequences spent computing grammar
    /// masks.
    pub mask_time: Duration,
    /// Masks they computed (one per constrained token).
    pub masks: usize,
}

struct Active {
    id: SeqId,
    prompt_len: usize,
    reused: usize,
    max_tokens: usize,
    stop_ids: BTreeSet<u32>,
    sampler: Sampler,
    /// Recent ids `[1, n]` for the penalties, when one is on.
    history: Option<Array>,
    /// The grammar the output must match, if any.
    constraint: Option<Constraint>,
    /// Report log-probabilities with this many alternatives.
    logprobs: Option<usize>,
    /// The log-probabilities of the token in `next` for this row.
    next_lp: Option<LogprobArrays>,
    /// Those of the token fed this step.
    fed_lp: Option<LogprobArrays>,
    /// A grammar failure: the row ends with it at the next emit.
    failed: Option<Error>,
    context: usize,
    out: Vec<u32>,
    /// Prompt tokens still to feed after the one in `next` (a prompt tail
    /// fed through the batched decode, see [`FEED_MAX`]).
    prompt_rest: VecDeque<u32>,
    /// The token in `next` for this row is a prompt token, not an output.
    next_is_prompt: bool,
    /// Its drafter, when the batch speculates and the request allows it.
    spec: Option<speculative::RowSpec>,
}

/// A request whose prompt the prompt cache covers to within this many
/// tokens feeds the rest through the batched decode steps, one token a
/// step, instead of a prefill of its own. A one-token prefill costs the
/// host about what a whole decode step does (an uncompiled forward and an
/// evaluation per admission), and repeated prompts (a chat's regenerate,
/// clients sending the same request) leave one token to feed: attention
/// caches trim anywhere, and recurrent state is checkpointed one token
/// before each prompt's end. Longer tails are prefilled, and recorded in
/// the prompt cache.
pub const FEED_MAX: usize = 4;

impl Active {
    /// A request's row, before its first token: `reused` prompt tokens came
    /// from the prompt cache; the penalties' history is the prompt's tail.
    fn new(
        id: SeqId,
        prompt: &[u32],
        reused: usize,
        opts: GenerateOptions,
        sampler: Sampler,
        context: usize,
    ) -> Self {
        let history = opts.sampler.uses_history().then(|| {
            let ctx = opts.sampler.repetition_context.max(1);
            let tail: Vec<i32> = prompt[prompt.len().saturating_sub(ctx)..]
                .iter()
                .map(|&t| t as i32)
                .collect();
            Array::from_slice(&tail, &[1, tail.len() as i32])
        });
        Active {
            id,
            prompt_len: prompt.len(),
            reused,
            max_tokens: opts.max_tokens,
            stop_ids: opts.stop_ids,
            sampler,
            history,
            constraint: opts.constraint,
            logprobs: opts.logprobs,
            next_lp: None,
            fed_lp: None,
            failed: None,
            context,
            out: Vec::new(),
            prompt_rest: VecDeque::new(),
            next_is_prompt: false,
            spec: None,
        }
    }

    /// True when this row can use the batch-wide argmax.
    fn plain_greedy(&self) -> bool {
        self.sampler.config().is_plain_greedy()
            && self.constraint.is_none()
            && self.logprobs.is_none()
    }

    /// Samples this row's next token from its logits `[1, V]`, under its
    /// grammar's mask; `feeding_output` when an output token not yet in
    /// `out` is being fed (the budget counts it).
    fn sample_row(&mut self, logits: &Array, feeding_output: bool) -> Result<Array> {
        // The budget left, this token included.
        let left = self
            .max_tokens
            .saturating_sub(self.out.len() + usize::from(feeding_output));
        let mask = match self.constraint.as_mut().map(|c| c.mask(left)).transpose() {
            Ok(m) => m,
            Err(e) => {
                self.failed = Some(e);
                return Ok(ops::zeros_dtype(&[1], Dtype::Uint32)?);
            }
        };
        let (ids, lp) = self.sampler.sample_with(
            logits,
            self.history.as_ref(),
            mask.as_ref(),
            self.logprobs,
        )?;
        self.next_lp = lp;
        Ok(ids)
    }
}

/// The batch size a count of sequences runs at: the next power of two, at
/// most `max`. Few sizes means few compiled traces.
pub fn bucket(n: usize, max: usize) -> usize {
    n.max(1).next_power_of_two().min(max.max(1))
}

/// Many sequences through one model, decoded together.
pub struct BatchGenerator<'g> {
    gen: &'g mut Generator,
    max_batch: usize,
    waiting: VecDeque<(SeqId, Vec<u32>, GenerateOptions)>,
    slots: Vec<Option<Active>>,
    cache: Option<ModelCache>,
    /// Per slot, the token to feed next (not yet emitted), `[rows]` uint32.
    next: Option<Array>,
    cancelled: BTreeSet<SeqId>,
    finished: Vec<(SeqId, Result<BatchOutput>)>,
    next_id: SeqId,
    stats: BatchStats,
    speculation: Option<BatchSpeculation>,
}

impl<'g> BatchGenerator<'g> {
    /// A batch of at most `max_batch` sequences in flight on `gen`'s model
    /// (its compiled decoder and prefill step are used; its prompt cache
    /// serves the requests whose options ask for it).
    pub fn new(gen: &'g mut Generator, max_batch: usize) -> Result<Self> {
        if max_batch == 0 {
            return Err(Error::invalid("max_batch", "must be at least 1"));
        }
        Ok(Self {
            gen,
            max_batch,
            waiting: VecDeque::new(),
            slots: Vec::new(),
            cache: None,
            next: None,
            cancelled: BTreeSet::new(),
            finished: Vec::new(),
            next_id: 0,
            stats: BatchStats::default(),
            speculation: None,
        })
    }

    /// Speculative decoding for the requests admitted from now on that
    /// allow it (no grammar, no log-probabilities): see
    /// [`BatchSpeculation`].
    pub fn speculate(&mut self, speculation: BatchSpeculation) -> Result<()> {
        crate::speculative::check_draft_tokens(speculation.k)?;
        self.speculation = Some(speculation);
        Ok(())
    }

    /// Queues a request; it joins the batch at the next step with room.
    pub fn submit(&mut self, prompt: Vec<u32>, opts: GenerateOptions) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, prompt, opts));
        id
    }

    /// Cancels a request: it finishes with [`Finish::Cancelled`] at the
    /// next step, without disturbing the others.
    pub fn cancel(&mut self, id: SeqId) {
        self.cancelled.insert(id);
    }

    /// Sequences decoding now.
    pub fn active(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Requests not yet admitted.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// True when nothing is queued or decoding.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.active() == 0
    }

    /// Slots in the batch now (its bucket size).
    pub fn rows(&self) -> usize {
        self.slots.len()
    }

    /// Totals so far.
    pub fn stats(&self) -> &BatchStats {
        &self.stats
    }

    /// Bytes held by the batch's caches.
    pub fn cache_bytes(&self) -> usize {
        self.cache.as_ref().map(ModelCache::nbytes).unwrap_or(0)
    }

    /// Runs every queued request to its end; `on_token` sees each new id
    /// (and may stop its sequence). Returns the outputs by request id.
    pub fn run(
        &mut self,
        on_token: &mut dyn FnMut(SeqId, &Emitted) -> Result<Flow>,
    ) -> Result<Vec<(SeqId, Result<BatchOutput>)>> {
        let mut all = Vec::new();
        while !self.is_idle() {
            all.extend(self.step(on_token)?);
        }
        all.sort_by_key(|(id, _)| *id);
        Ok(all)
    }

    /// One round: admit, decode one token for every slot, emit. Returns the
    /// requests that finished (or failed) in it.
    pub fn step(
        &mut self,
        on_token: &mut dyn FnMut(SeqId, &Emitted) -> Result<Flow>,
    ) -> Result<Vec<(SeqId, Result<BatchOutput>)>> {
        self.drop_cancelled_waiting();
        self.admit()?;
        if self.active() == 0 {
            self.release();
            return Ok(std::mem::take(&mut self.finished));
        }
        let started = Instant::now();
        if !(self.can_speculate() && self.round(on_token)?) {
            self.plain_step(on_token)?;
        }
        self.stats.steps += 1;
        self.compact()?;
        self.stats.decode_time += started.elapsed();
        Ok(std::mem::take(&mut self.finished))
    }

    /// One decode step for every slot: feed `next`, sample, emit.
    fn plain_step(
        &mut self,
        on_token: &mut dyn FnMut(SeqId, &Emitted) -> Result<Flow>,
    ) -> Result<()> {
        let rows = self.slots.len() as i32;
        let feed = self.next.take().expect("a used batch has tokens");
        let inp = ops::reshape(&feed, &[rows, 1])?;
        let logits = if self.rows_want_hidden() {
            self.step_keeping_hidden(&inp)?
        } else {
            let cache = self.cache.as_mut().expect("a used batch has caches");
            self.gen.step(&inp, cache)?
        };
        for a in self.slots.iter_mut().flatten() {
            a.fed_lp = a.next_lp.take();
        }
        self.advance_grammars(&logits, &feed)?;
        // The repetition penalty looks back over what was fed, this step's
        // token included: appended on the device, before sampling (the host
        // learns the token's value only in `emit`). A prompt token fed as a
        // tail is already there, with the rest of the prompt.
        for (r, slot) in self.slots.iter_mut().enumerate() {
            let Some(a) = slot else { continue };
            if a.next_is_prompt {
                continue;
            }
            if let Some(h) = &a.history {
                let ctx = a.sampler.config().repetition_context.max(1) as i32;
                let r = r as i32;
                let t = ops::reshape(&feed.try_index(r..r + 1)?, &[1, 1])?.as_dtype(h.dtype())?;
                let joined = ops::concatenate(&[h, &t], 1)?;
                let n = joined.shape()[1];
                a.history = Some(joined.try_index((.., (n - ctx).max(0)..))?);
            }
        }
        let mut sampled = self.sample(&logits)?;
        // Rows still in their prompt feed its next token instead.
        let fed_prompt: Vec<bool> = self
            .slots
            .iter()
            .map(|s| s.as_ref().is_some_and(|a| a.next_is_prompt))
            .collect();
        for (r, slot) in self.slots.iter_mut().enumerate() {
            let Some(a) = slot else { continue };
            a.next_is_prompt = match a.prompt_rest.pop_front() {
                Some(t) => {
                    let r = r as i32;
                    sampled.try_index_mut(r..r + 1, Array::from_slice(&[t], &[1]))?;
                    true
                }
                None => false,
            };
        }
        let mut pending = vec![&sampled];
        for a in self.slots.iter().flatten() {
            pending.extend(a.next_lp.iter().flat_map(LogprobArrays::arrays));
        }
        async_eval(pending)?;
        self.emit(&feed, &fed_prompt, on_token)?;
        self.next = Some(sampled);
        Ok(())
    }

    /// Tells each constrained row's grammar the token fed this step (its
    /// mask for the next one depends on it): waits for that token, after
    /// handing this step's forward to the device so the wait overlaps it.
    fn advance_grammars(&mut self, logits: &Array, feed: &Array) -> Result<()> {
        let constrained = |a: &Active| a.constraint.is_some() && a.prompt_rest.is_empty();
        if !self.slots.iter().flatten().any(constrained) {
            return Ok(());
        }
        async_eval([logits])?;
        let waited = Instant::now();
        feed.eval()?;
        self.stats.wait_time += waited.elapsed();
        let ids = feed.as_slice::<u32>();
        for (r, slot) in self.slots.iter_mut().enumerate() {
            let Some(a) = slot else { continue };
            if a.next_is_prompt || a.failed.is_some() {
                continue;
            }
            if let Some(c) = a.constraint.as_mut() {
                if let Err(e) = c.consume(ids[r]) {
                    a.failed = Some(e);
                }
            }
        }
        Ok(())
    }

    fn drop_cancelled_waiting(&mut self) {
        if self.cancelled.is_empty() {
            return;
        }
        let cancelled = &self.cancelled;
        let finished = &mut self.finished;
        self.waiting.retain(|(id, prompt, _)| {
            if cancelled.contains(id) {
                finished.push((
                    *id,
                    Ok(BatchOutput {
                        tokens: Vec::new(),
                        prompt_tokens: prompt.len(),
                        reused_tokens: 0,
                        finish: Finish::Cancelled,
                        speculative: None,
                    }),
                ));
                false
            } else {
                true
            }
        });
    }

    /// Checks one request before it costs any compute.
    fn validate(&self, prompt: &[u32], opts: &GenerateOptions) -> Result<Sampler> {
        let model = &self.gen.model;
        if prompt.is_empty() {
            return Err(Error::invalid("prompt", "is empty"));
        }
        let vocab = model.vocab_size() as usize;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::invalid(
                "prompt",
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        let limit = model.max_context.unwrap_or(usize::MAX);
        if prompt.len() >= limit {
            return Err(Error::PromptTooLong {
                len: prompt.len(),
                max: limit,
                hint: Some(CONTEXT_HINT.into()),
            });
        }
        if opts.max_tokens == 0 {
            return Err(Error::invalid("max_tokens", "must be at least 1"));
        }
        Sampler::new(opts.sampler.clone(), vocab)
    }

    /// Moves waiting requests into free slots, prefilling them together.
    fn admit(&mut self) -> Result<()> {
        let room = self.max_batch - self.active();
        if room == 0 || self.waiting.is_empty() {
            return Ok(());
        }
        let mut group = Vec::new();
        while group.len() < room {
            let Some((id, prompt, opts)) = self.waiting.pop_front() else {
                break;
            };
            match self.validate(&prompt, &opts) {
                Ok(sampler) => group.push((id, prompt, opts, sampler)),
                Err(e) => self.finished.push((id, Err(e))),
            }
        }
        if group.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let drafters = self.drafters_for(group.iter().map(|g| &g.2))?;
        let reads_hidden: Vec<bool> = drafters
            .iter()
            .map(|d| d.as_ref().is_some_and(|d| d.wants_hidden()))
            .collect();
        let prompts: Vec<(&[u32], bool)> = group
            .iter()
            .map(|g| (g.1.as_slice(), g.2.use_prompt_cache))
            .collect();
        let (prefilled, prompt_hidden) = self.prefill_admitted(&prompts, &reads_hidden)?;
        self.ensure_rows(self.active() + group.len())?;
        let limit = self.gen.model.max_context.unwrap_or(usize::MAX);
        let mut firsts = Vec::with_capacity(group.len());
        let admitted = group
            .into_iter()
            .zip(prefilled)
            .zip(drafters)
            .zip(prompt_hidden);
        for ((((id, prompt, opts, sampler), (single, logits, reused)), drafter), hidden) in admitted
        {
            let row = self
                .slots
                .iter()
                .position(Option::is_none)
                .expect("ensure_rows made room");
            let cache = self.cache.as_mut().expect("ensure_rows made the batch");
            for (bc, sc) in cache.layers.iter_mut().zip(&single.layers) {
                for (b, s) in bc.iter_mut().zip(sc) {
                    b.write_row(row, s.as_ref())?;
                }
            }
            // With logits, the first output; without, the first prompt
            // token the cache does not cover.
            let mut prompt_rest: VecDeque<u32> = prompt[reused..].iter().copied().collect();
            let mut active = Active::new(id, &prompt, reused, opts, sampler, limit);
            let first = match &logits {
                Some(l) => {
                    prompt_rest.clear();
                    let first = active.sample_row(l, false)?;
                    firsts.push(first.clone());
                    firsts.extend(
                        active
                            .next_lp
                            .iter()
                            .flat_map(|lp| lp.arrays().map(Array::clone)),
                    );
                    first
                }
                None => {
                    self.stats.tail_tokens += prompt_rest.len();
                    let t = prompt_rest
                        .pop_front()
                        .expect("a hit leaves a token to feed");
                    Array::from_slice(&[t], &[1])
                }
            };
            let next_is_prompt = logits.is_none();
            if let (Some(spec), Some(drafter)) = (self.speculation.as_ref(), drafter) {
                let rng = crate::sampler::host_rng(active.sampler.config().seed);
                active.spec = Some(speculative::RowSpec::new(
                    drafter, &prompt, rng, spec.k, hidden,
                ));
            }
            let next = self.next.as_mut().expect("ensure_rows made the tokens");
            let r = row as i32;
            next.try_index_mut(r..r + 1, &first)?;
            self.stats.prefill_tokens += prompt.len() - reused;
            self.stats.reused_tokens += reused;
            active.prompt_rest = prompt_rest;
            active.next_is_prompt = next_is_prompt;
            self.slots[row] = Some(active);
        }
        eval(firsts.iter())?;
        self.stats.prefill_time += started.elapsed();
        self.stats.peak_active = self.stats.peak_active.max(self.active());
        Ok(())
    }

    /// Prefills the admitted `prompts` (each with whether it uses the
    /// prompt cache): those that do restore their longest cached prefix and
    /// prefill the rest on their own; the others are prefilled together.
    /// A prompt whose row `reads_hidden` (its drafter reads the target's
    /// states) is prefilled on its own, keeping every position's normed
    /// state. Returns each one's batch-1 caches, last logits (none when a
    /// restored prefix leaves prompt tokens to feed) and reused count, and
    /// the normed states of those that read them.
    #[allow(clippy::type_complexity)]
    fn prefill_admitted(
        &mut self,
        prompts: &[(&[u32], bool)],
        reads_hidden: &[bool],
    ) -> Result<(Vec<(ModelCache, Option<Array>, usize)>, Vec<Option<Array>>)> {
        let n = prompts.len();
        let mut prefilled: Vec<Option<(ModelCache, Option<Array>, usize)>> =
            (0..n).map(|_| None).collect();
        let mut hidden: Vec<Option<Array>> = (0..n).map(|_| None).collect();
        for i in (0..n).filter(|&i| reads_hidden[i]) {
            let (c, l, normed) = self.gen.prefill_normed(prompts[i].0)?;
            prefilled[i] = Some((c, Some(l), 0));
            hidden[i] = Some(normed);
        }
        let (cached, fresh): (Vec<usize>, Vec<usize>) = (0..n)
            .filter(|&i| !reads_hidden[i])
            .partition(|&i| prompts[i].1);
        let together: Vec<&[u32]> = fresh.iter().map(|&i| prompts[i].0).collect();
        for (&i, (c, l)) in fresh.iter().zip(self.prefill_group(&together)?) {
            prefilled[i] = Some((c, Some(l), 0));
        }
        for &i in &cached {
            let prompt = prompts[i].0;
            let hit = self.gen.prompt_cache.lookup(prompt);
            prefilled[i] = Some(match hit {
                Some(h) if (1..=FEED_MAX).contains(&(prompt.len() - h.reused)) => {
                    (h.cache, None, h.reused)
                }
                hit => {
                    let (c, l, r) = self.prefill_cached(prompt, hit)?;
                    (c, Some(l), r)
                }
            });
        }
        let prefilled = prefilled
            .into_iter()
            .map(|p| p.expect("every request prefilled"))
            .collect();
        Ok((prefilled, hidden))
    }

    /// One prompt through the prompt cache: the deepest cached prefix is
    /// restored, the rest prefilled (recurrent state snapshotted every
    /// `checkpoint_every` tokens), and the prompt recorded for later
    /// requests. Returns its batch-1 caches, last logits and reused count.
    fn prefill_cached(
        &mut self,
        prompt: &[u32],
        hit: Option<mlex_cache::PrefixHit>,
    ) -> Result<(ModelCache, Array, usize)> {
        let g = &mut *self.gen;
        let (cache, logits, reused, mut checkpoints) = g.prefill_after(prompt, hit, true)?;
        checkpoints.push((prompt.len(), mlex_cache::StateSnapshot::of(&cache)));
        g.prompt_cache.insert(prompt, cache.clone(), checkpoints);
        Ok((cache, logits, reused))
    }

    /// Staircase prefill of several prompts: per prompt (in the given
    /// order), its batch-1 caches and last-position logits `[1, V]`.
    fn prefill_group(&mut self, prompts: &[&[u32]]) -> Result<Vec<(ModelCache, Array)>> {
        let model = &self.gen.model;
        let mut order: Vec<usize> = (0..prompts.len()).collect();
        order.sort_by_key(|&i| prompts[i].len());
        let mut cache = model.make_cache(order.len())?;
        let mut rows = order;
        let mut done: Vec<Option<(ModelCache, Array)>> = (0..prompts.len()).map(|_| None).collect();
        let chunk = self.gen.prefill_chunk.max(1);
        let mut pos = 0;
        while !rows.is_empty() {
            let end = prompts[rows[0]].len();
            let piece = (chunk / rows.len()).max(16);
            let mut logits = None;
            let mut at = pos;
            while at < end {
                let next = (at + piece).min(end);
                let mut ids = Vec::with_capacity(rows.len() * (next - at));
                for &r in &rows {
                    ids.extend(prompts[r][at..next].iter().map(|&t| t as i32));
                }
                let x = Array::from_slice(&ids, &[rows.len() as i32, (next - at) as i32]);
                if next == end {
                    logits = Some(model.forward_last(&x, &mut cache)?);
                } else {
                    model.forward_hidden(&x, &mut cache)?;
                    eval(cache.arrays().iter())?;
                }
                at = next;
            }
            let logits = logits.expect("every stage feeds at least one token");
            let leaving = rows
                .iter()
                .take_while(|&&r| prompts[r].len() == end)
                .count();
            for (j, &r) in rows.iter().enumerate().take(leaving) {
                let mut single = cache.clone();
                for c in single.layers.iter_mut().flatten() {
                    c.select_rows(&[j as i32])?;
                }
                let j = j as i32;
                done[r] = Some((single, logits.try_index(j..j + 1)?));
            }
            if leaving < rows.len() {
                let keep: Vec<i32> = (leaving as i32..rows.len() as i32).collect();
                for c in cache.layers.iter_mut().flatten() {
                    c.select_rows(&keep)?;
                }
            }
            rows.drain(..leaving);
            pos = end;
        }
        Ok(done
            .into_iter()
            .map(|d| d.expect("every prompt prefilled"))
            .collect())
    }

    /// Makes the batch at least `need` slots (the next bucket).
    fn ensure_rows(&mut self, need: usize) -> Result<()> {
        let target = bucket(need, self.max_batch);
        let have = self.slots.len();
        if self.cache.is_none() {
            let model = &self.gen.model;
            let mut layers = Vec::with_capacity(model.layers.len());
            for (i, slot) in model.layers.iter().enumerate() {
                let mut caches = slot.layer.make_caches(target, model.dtype)?;
                for c in caches.iter_mut().filter(|c| c.grows()) {
                    if c.kind() != "kv" {
                        return Err(Error::Cache(format!(
                            "layer {i} ({}) keeps a `{}` cache, which cannot be batched yet; run its sequences one at a time",
                            slot.kind,
                            c.kind()
                        )));
                    }
                    *c = Box::new(BatchKvCache::new(target));
                }
                layers.push(caches);
            }
            self.cache = Some(ModelCache { layers });
            self.slots = (0..target).map(|_| None).collect();
            self.next = Some(ops::zeros_dtype(&[target as i32], Dtype::Uint32)?);
            return Ok(());
        }
        if target > have {
            let extra = target - have;
            let cache = self.cache.as_mut().expect("checked above");
            for c in cache.layers.iter_mut().flatten() {
                c.add_rows(extra)?;
            }
            self.slots.extend((0..extra).map(|_| None));
            let pad = ops::zeros_dtype(&[extra as i32], Dtype::Uint32)?;
            let next = self.next.take().expect("a batch has tokens");
            self.next = Some(ops::concatenate(&[next, pad], 0)?);
        }
        Ok(())
    }

    /// Samples every row: one argmax for the whole batch when every used
    /// row is plain greedy, else each used row with its own sampler.
    fn sample(&mut self, logits: &Array) -> Result<Array> {
        if self.slots.iter().flatten().all(Active::plain_greedy) {
            let l = logits.as_dtype(Dtype::Float32)?;
            return Ok(ops::indexing::argmax_axis(&l, -1, None)?.as_dtype(Dtype::Uint32)?);
        }
        let mut parts = Vec::with_capacity(self.slots.len());
        for (r, slot) in self.slots.iter_mut().enumerate() {
            let r = r as i32;
            match slot {
                // A row that feeds another prompt token next discards its
                // logits; its sampler (and its random stream) is not used.
                Some(a) if a.prompt_rest.is_empty() => {
                    let row = logits.try_index(r..r + 1)?;
                    let feeding_output = !a.next_is_prompt;
                    parts.push(a.sample_row(&row, feeding_output)?);
                }
                Some(_) => parts.push(ops::zeros_dtype(&[1], Dtype::Uint32)?),
                None => parts.push(ops::zeros_dtype(&[1], Dtype::Uint32)?),
            }
        }
        Ok(ops::concatenate(&parts, 0)?)
    }

    /// Hands out the tokens fed this step (but not the prompt tokens, per
    /// `fed_prompt`) and retires finished rows.
    fn emit(
        &mut self,
        fed: &Array,
        fed_prompt: &[bool],
        on_token: &mut dyn FnMut(SeqId, &Emitted) -> Result<Flow>,
    ) -> Result<()> {
        let waited = Instant::now();
        fed.eval()?;
        self.stats.wait_time += waited.elapsed();
        let ids: Vec<u32> = fed.as_slice::<u32>().to_vec();
        for r in 0..self.slots.len() {
            let Some(a) = self.slots[r].as_mut() else {
                continue;
            };
            if self.cancelled.remove(&a.id) {
                self.retire(r, Ok(Finish::Cancelled));
            } else if fed_prompt[r] {
            } else if let Some(e) = a.failed.take() {
                self.retire(r, Err(e));
            } else {
                let logprob = match a.fed_lp.take() {
                    Some(lp) => {
                        let (logprob, top) = lp.row(0)?;
                        Some(TokenLogprob { logprob, top })
                    }
                    None => None,
                };
                if let Some(finish) = self.hand_out(r, ids[r], logprob, on_token)? {
                    self.retire(r, Ok(finish));
                }
            }
        }
        Ok(())
    }

    /// Hands row `r`'s output token `tok` to the caller; why the row ends
    /// there, if it does.
    fn hand_out(
        &mut self,
        r: usize,
        tok: u32,
        logprob: Option<TokenLogprob>,
        on_token: &mut dyn FnMut(SeqId, &Emitted) -> Result<Flow>,
    ) -> Result<Option<Finish>> {
        let a = self.slots[r].as_mut().expect("a used row");
        if self.cancelled.remove(&a.id) {
            return Ok(Some(Finish::Cancelled));
        }
        a.out.push(tok);
        if let Some(s) = a.spec.as_mut() {
            s.tokens.push(tok);
        }
        self.stats.generated_tokens += 1;
        let called = Instant::now();
        let flow = on_token(a.id, &Emitted { id: tok, logprob })?;
        self.stats.callback_time += called.elapsed();
        let n = a.out.len();
        let room = a.prompt_len + n < a.context;
        Ok(if a.stop_ids.contains(&tok) {
            Some(Finish::Eos)
        } else if flow == Flow::Stop {
            Some(Finish::Stop)
        } else if !room {
            Some(Finish::Context)
        } else if n >= a.max_tokens {
            Some(Finish::Length)
        } else {
            None
        })
    }

    /// Ends row `r`'s request (with its output, or the error that ended
    /// it) and frees its slot.
    fn retire(&mut self, r: usize, end: Result<Finish>) {
        let Some(a) = self.slots[r].take() else {
            return;
        };
        if let Some(cache) = self.cache.as_mut() {
            for c in cache.layers.iter_mut().flatten() {
                c.free_row(r);
            }
        }
        let finish = match end {
            Ok(f) => f,
            Err(e) => {
                self.finished.push((a.id, Err(e)));
                return;
            }
        };
        if let Some(c) = &a.constraint {
            self.stats.mask_time += c.mask_time;
            self.stats.masks += c.masks;
        }
        self.finished.push((
            a.id,
            Ok(BatchOutput {
                tokens: a.out,
                prompt_tokens: a.prompt_len,
                reused_tokens: a.reused,
                finish,
                speculative: a.spec.map(|s| s.stats),
            }),
        ));
    }

    /// Shrinks the batch to the bucket of what is used (and of what waits
    /// to join), moving the used rows together.
    fn compact(&mut self) -> Result<()> {
        let used: Vec<usize> = (0..self.slots.len())
            .filter(|&r| self.slots[r].is_some())
            .collect();
        if used.is_empty() {
            if self.waiting.is_empty() {
                self.release();
            }
            return Ok(());
        }
        let target = bucket(used.len() + self.waiting.len(), self.max_batch);
        if target >= self.slots.len() {
            return Ok(());
        }
        let mut keep: Vec<i32> = used.iter().map(|&r| r as i32).collect();
        // Pad with free rows up to the bucket.
        keep.extend(
            (0..self.slots.len() as i32)
                .filter(|r| self.slots[*r as usize].is_none())
                .take(target - used.len()),
        );
        let cache = self.cache.as_mut().expect("a used batch has caches");
        for c in cache.layers.iter_mut().flatten() {
            c.select_rows(&keep)?;
        }
        let idx = Array::from_slice(&keep, &[keep.len() as i32]);
        let next = self.next.take().expect("a used batch has tokens");
        self.next = Some(next.take_axis(&idx, 0)?);
        let mut old: Vec<Option<Active>> = std::mem::take(&mut self.slots);
        self.slots = keep.iter().map(|&r| old[r as usize].take()).collect();
        Ok(())
    }

    /// Drops the batch's caches once nothing is in flight.
    fn release(&mut self) {
        self.settle();
        self.cache = None;
        self.next = None;
        self.slots.clear();
    }

    /// Waits for the step handed to MLX ahead of time: work left running
    /// when the process exits races MLX's teardown (heap corruption seen
    /// at exit on the CPU backend before this).
    fn settle(&mut self) {
        if let Some(n) = &self.next {
            let _ = n.eval();
        }
    }
}

impl Drop for BatchGenerator<'_> {
    fn drop(&mut self) {
        self.settle();
    }
}
