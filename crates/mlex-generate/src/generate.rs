//! The decode loop.
//!
//! - **Prefix reuse**: the longest prefix of the prompt found in the prompt
//!   cache (hybrid-aware snapshots, see `mlex_cache::prompt`) is restored and
//!   only the rest is prefilled; after generation the cache is recorded at
//!   the end of the prompt and at the end of what was fed, so the next chat
//!   turn prefills only its new tokens.
//! - **Pipelining**: step t+1's graph is built (and handed to MLX with
//!   `async_eval`) before the host waits for step t's token; the host syncs
//!   only for the sampled token id, never for logits.
//! - **Compiled segments**: single-token steps run through
//!   [`SegmentedDecoder`] unless compilation is off.

use crate::sampler::{history_of, token_id, Sampler, SamplerConfig};
use crate::speculative::{Drafter, SpecStats};
use mlex_cache::{PromptCache, StateSnapshot};
use mlex_compile::{CompilePolicy, SegmentedDecoder};
use mlex_core::error::{Error, Result};
use mlex_core::model::{ArrayExt, Model, ModelCache, PositionStates};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array, Dtype};
use std::collections::BTreeSet;
use std::time::Instant;

/// A prefilled prompt: its batch-1 cache, last logits, the count of
/// tokens restored from the prompt cache, and recurrent-state checkpoints.
pub(crate) type Prefilled = (ModelCache, Array, usize, Vec<(usize, StateSnapshot)>);

/// Where a model's context length comes from, for errors about it.
pub(crate) const CONTEXT_HINT: &str =
    "max_position_embeddings in config.json, or <arch>.context_length in a GGUF file";

/// What the token callback wants next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Keep generating.
    Continue,
    /// Stop now (e.g. a stop string appeared).
    Stop,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token.
    Eos,
    /// `max_tokens` reached.
    Length,
    /// The callback asked to stop.
    Stop,
    /// The model's context is full.
    Context,
    /// Cancelled by the caller (batched generation).
    Cancelled,
}

impl Finish {
    /// Lower-case name (`eos`, `length`, `stop`, `context`, `cancelled`).
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Eos => "eos",
            Finish::Length => "length",
            Finish::Stop => "stop",
            Finish::Context => "context",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// Settings of one generation.
#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling.
    pub sampler: SamplerConfig,
    /// Tokens that end generation.
    pub stop_ids: BTreeSet<u32>,
    /// Look up and record prefixes in the prompt cache.
    pub use_prompt_cache: bool,
    /// A grammar the output must match (batched generation only).
    pub constraint: Option<crate::constraint::Constraint>,
    /// Report each token's log-probability and this many of the most
    /// likely alternatives (batched generation only).
    pub logprobs: Option<usize>,
}

/// The outcome of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated ids (including a final EOS token).
    pub tokens: Vec<u32>,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Prompt tokens restored from the prompt cache (not computed).
    pub reused_tokens: usize,
    /// Seconds until the first token.
    pub prefill_s: f64,
    /// Seconds from the first token to the last.
    pub decode_s: f64,
    /// Why it ended.
    pub finish: Finish,
    /// Peak MLX memory during the call, bytes.
    pub peak_memory_bytes: usize,
    /// Peak MLX memory up to the first token (the prompt's prefill and its
    /// sampling), bytes: where a long prompt's peak falls.
    pub prefill_peak_memory_bytes: usize,
    /// Speculative decoding's counters, when a drafter ran.
    pub speculative: Option<SpecStats>,
}

impl Generation {
    /// Prompt tokens computed per second.
    pub fn prefill_tok_s(&self) -> f64 {
        (self.prompt_tokens - self.reused_tokens) as f64 / self.prefill_s.max(1e-9)
    }

    /// Generated tokens per second after the first.
    pub fn decode_tok_s(&self) -> f64 {
        if self.tokens.len() < 2 {
            return 0.0;
        }
        (self.tokens.len() - 1) as f64 / self.decode_s.max(1e-9)
    }
}

/// Default [`Generator::checkpoint_every`]: a 22 MB snapshot of the
/// Qwen3.5-like model's recurrent state per 1,024 tokens, and prefill
/// pieces large enough that their matrix products stay efficient.
pub const DEFAULT_CHECKPOINT_EVERY: usize = 1024;

/// A model with its compiled decoder and prompt cache.
pub struct Generator {
    /// The model.
    pub model: Model,
    decoder: Option<SegmentedDecoder>,
    /// Prefix reuse across calls.
    pub prompt_cache: PromptCache,
    /// Prompt tokens per prefill chunk (the model's dispatch's, unless
    /// set).
    pub prefill_chunk: usize,
    /// For models with recurrent state: prefill snapshots that state every
    /// this many tokens (absolute positions), so that a later prompt that
    /// diverges anywhere re-feeds fewer than this many shared tokens. `0`
    /// keeps only the end of each prompt.
    pub checkpoint_every: usize,
    /// Speculative decoding: the drafter and the most tokens it proposes
    /// per round (`None`: plain decode).
    pub speculative: Option<(Box<dyn Drafter>, usize)>,
}

impl Generator {
    /// Wraps `model`; `compile` turns on compiled decode segments.
    pub fn new(model: Model, compile: bool) -> Self {
        Self::with_policy(model, compile.then_some(CompilePolicy::All))
    }

    /// Wraps `model` with an explicit compile policy (`None`: eager).
    pub fn with_policy(model: Model, policy: Option<CompilePolicy>) -> Self {
        let decoder = policy.map(|p| SegmentedDecoder::with_policy(&model, p));
        let prefill_chunk = model.dispatch.prefill_chunk;
        Self {
            model,
            decoder,
            prompt_cache: PromptCache::new(8, 4 << 30),
            prefill_chunk,
            checkpoint_every: DEFAULT_CHECKPOINT_EVERY,
            speculative: None,
        }
    }

    /// True when decode steps are compiled.
    pub fn is_compiled(&self) -> bool {
        self.decoder.is_some()
    }

    /// One decode step as generation runs it (compiled when the generator
    /// is): `[B, 1]` tokens → `[B, V]` logits (for benchmarks).
    pub fn decode_step(&mut self, tokens: &Array, cache: &mut ModelCache) -> Result<Array> {
        self.step(tokens, cache)
    }

    /// The verify forward of speculative decoding as generation runs it
    /// (compiled when the generator is): `[B, T]` tokens → `[B, T, V]`
    /// logits and the state after each position ([`Model::verify`]).
    pub fn verify(
        &mut self,
        tokens: &Array,
        cache: &mut ModelCache,
    ) -> Result<(Array, PositionStates)> {
        match &mut self.decoder {
            Some(d) => d.verify(&self.model, tokens, cache),
            None => self.model.verify(tokens, cache),
        }
    }

    /// [`Generator::verify`], with the states after the final norm
    /// `[B, T, D]` (what a multi-token-prediction head reads).
    pub fn verify_normed(
        &mut self,
        tokens: &Array,
        cache: &mut ModelCache,
    ) -> Result<(Array, Array, PositionStates)> {
        match &mut self.decoder {
            Some(d) => d.verify_normed(&self.model, tokens, cache),
            None => self.model.verify_normed(tokens, cache),
        }
    }

    /// The whole prompt into a fresh cache (no prompt cache): its cache,
    /// last logits `[1, V]` and the states after the final norm of every
    /// position `[1, P, D]`.
    pub(crate) fn prefill_normed(&mut self, prompt: &[u32]) -> Result<(ModelCache, Array, Array)> {
        let mut cache = self.model.make_cache(1)?;
        let mut parts = Vec::new();
        let logits = self.prefill(prompt, 0, &mut cache, None, Some(&mut parts))?;
        let normed = match parts.len() {
            1 => parts.pop().expect("one"),
            _ => ops::concatenate(&parts, 1)?,
        };
        Ok((cache, logits, normed))
    }

    /// One single-token step: `[B, 1]` tokens → `[B, V]` logits.
    pub(crate) fn step(&mut self, tokens: &Array, cache: &mut ModelCache) -> Result<Array> {
        match &mut self.decoder {
            Some(d) => d.step(&self.model, tokens, cache),
            None => self.model.forward_last(tokens, cache),
        }
    }

    /// Computes `tokens` (the prompt from position `start` on) into `cache`
    /// in steps of `prefill_chunk`, evaluating between steps; returns the
    /// last logits. With `snapshots`, the fixed-size state is also recorded
    /// at every absolute multiple of `checkpoint_every` before the end and
    /// one token before the end (the step is cut and evaluated there). The last one serves the same prompt again: a lookup
    /// needs the last token's logits, so it restores at most `len - 1`
    /// tokens, and without it a repeated hybrid prompt would recompute up to
    /// `checkpoint_every` of them.
    pub(crate) fn prefill(
        &mut self,
        tokens: &[u32],
        start: usize,
        cache: &mut ModelCache,
        mut snapshots: Option<&mut Vec<(usize, StateSnapshot)>>,
        mut normed: Option<&mut Vec<Array>>,
    ) -> Result<Array> {
        if tokens.is_empty() {
            return Err(Error::invalid("prompt", "is empty"));
        }
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let step = self.prefill_chunk.max(1);
        let every = self.checkpoint_every;
        let end = start + ids.len();
        let mut pos = start;
        let before_last = (snapshots.is_some() && end - start > 1).then_some(end - 1);
        loop {
            let mut next = (pos + step).min(end);
            if snapshots.is_some() && every > 0 {
                next = next.min((pos / every + 1) * every);
            }
            if let Some(b) = before_last.filter(|&b| pos < b) {
                next = next.min(b);
            }
            let piece = &ids[pos - start..next - start];
            let x = Array::from_slice(piece, &[1, piece.len() as i32]);
            if let Some(out) = normed.as_deref_mut() {
                // Every position's state after the final norm too.
                let h = self.model.forward_hidden(&x, cache)?;
                let p = self.model.params.view();
                let n = self.model.output.norm.forward(&p, &h)?;
                out.push(n.clone());
                if next == end {
                    let last = n.index_last(n.shape()[1])?;
                    return Ok(ops::squeeze_axes(
                        &self.model.output.project(&p, &last)?,
                        &[1],
                    )?);
                }
            } else if next == end {
                return self.model.forward_last(&x, cache);
            } else {
                self.model.forward_hidden(&x, cache)?;
            }
            if let Some(snaps) = snapshots.as_deref_mut() {
                if (every > 0 && next.is_multiple_of(every)) || before_last == Some(next) {
                    snaps.push((next, StateSnapshot::of(cache)));
                }
            }
            // Materialise the cache after every piece, cut short at a
            // checkpoint or not: it bounds the graph, and on MLX's CUDA
            // backend (0.32.2) one graph that holds two pieces' cache
            // writes gives wrong logits that change from run to run
            // (NemotronH on the H200: off by 1-13, greedy tokens changed
            // at `--checkpoint-every 4`; CUDA graphs off did not help).
            // The cause is inside MLX; one evaluation per piece avoids it.
            eval(cache.arrays().iter())?;
            pos = next;
        }
    }

    /// With `use_cache`, restores the deepest cached prefix of `prompt`;
    /// prefills the rest into a batch-1 cache, recording recurrent-state
    /// checkpoints when the cache is used and the model has fixed-size
    /// state (holding them costs no copy of the KV caches). Returns the
    /// cache, the last logits, the reused token count and the checkpoints.
    pub(crate) fn restore_and_prefill(
        &mut self,
        prompt: &[u32],
        use_cache: bool,
    ) -> Result<Prefilled> {
        let hit = if use_cache {
            self.prompt_cache.lookup(prompt)
        } else {
            None
        };
        self.prefill_after(prompt, hit, use_cache)
    }

    /// The rest of [`Generator::restore_and_prefill`], from a lookup already
    /// made: prefills what `hit` does not cover, with checkpoints when
    /// `record`.
    pub(crate) fn prefill_after(
        &mut self,
        prompt: &[u32],
        hit: Option<mlex_cache::PrefixHit>,
        record: bool,
    ) -> Result<Prefilled> {
        let use_cache = record;
        let (mut cache, reused) = match hit {
            Some(h) => (h.cache, h.reused),
            None => (self.model.make_cache(1)?, 0),
        };
        let recurrent = cache.has_fixed_state();
        let mut checkpoints = Vec::new();
        let logits = self.prefill(
            &prompt[reused..],
            reused,
            &mut cache,
            (use_cache && recurrent).then_some(&mut checkpoints),
            None,
        )?;
        Ok((cache, logits, reused, checkpoints))
    }

    /// A prompt this model can take: not empty, every id in the vocabulary,
    /// shorter than the context.
    fn check_prompt(&self, prompt: &[u32]) -> Result<()> {
        if prompt.is_empty() {
            return Err(Error::invalid("prompt", "is empty"));
        }
        let vocab = self.model.vocab_size() as usize;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::invalid(
                "prompt",
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        let limit = self.model.max_context.unwrap_or(usize::MAX);
        if prompt.len() >= limit {
            return Err(Error::PromptTooLong {
                len: prompt.len(),
                max: limit,
                hint: Some(CONTEXT_HINT.into()),
            });
        }
        Ok(())
    }

    /// The last-position logits `[1, V]` of `prompt`, prefilled as
    /// [`Generator::generate`] prefills it (from the deepest cached prefix
    /// when `use_prompt_cache`), and the count of tokens restored. Nothing
    /// is recorded or generated: this is for comparing a restored prefix
    /// with a cold prefill.
    pub fn prompt_logits(
        &mut self,
        prompt: &[u32],
        use_prompt_cache: bool,
    ) -> Result<(Array, usize)> {
        self.check_prompt(prompt)?;
        let (_, logits, reused, _) = self.restore_and_prefill(prompt, use_prompt_cache)?;
        logits.eval()?;
        Ok((logits, reused))
    }

    /// Generates from `prompt`, calling `on_token` with every new id.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Result<Flow>,
    ) -> Result<Generation> {
        self.check_prompt(prompt)?;
        let vocab = self.model.vocab_size() as usize;
        let mut sampler = Sampler::new(opts.sampler.clone(), vocab)?;
        mlex_core::device::reset_peak_memory()?;
        let start = Instant::now();

        // A drafter that reads the target's hidden states needs every
        // prompt position's: the prompt cache (whose restored prefixes have
        // none) is not used.
        let wants_hidden = self
            .speculative
            .as_ref()
            .is_some_and(|(d, _)| d.wants_hidden());
        let use_cache = opts.use_prompt_cache && !wants_hidden;
        let (mut cache, logits, reused, mut checkpoints, prompt_hidden) = if wants_hidden {
            let (cache, logits, normed) = self.prefill_normed(prompt)?;
            (cache, logits, 0, Vec::new(), Some(normed))
        } else {
            let (c, l, r, k) = self.restore_and_prefill(prompt, use_cache)?;
            (c, l, r, k, None)
        };
        let prompt_snapshot = use_cache.then(|| StateSnapshot::of(&cache));

        let ctx = opts.sampler.repetition_context.max(1);
        let history = history_of(prompt, ctx);
        let use_history = opts.sampler.uses_history();

        let y = sampler.sample(&logits, use_history.then_some(&history))?;
        // The first token is waited for anyway; waiting here, before the
        // first decode step is queued, separates the prefill's peak.
        y.eval()?;
        let prefill_peak_memory_bytes = mlex_core::device::peak_memory()?;
        let decoded = match self.speculative.take() {
            Some((mut drafter, k)) => {
                let run = self.decode_speculative(
                    prompt,
                    opts,
                    &mut cache,
                    &mut sampler,
                    (drafter.as_mut(), k),
                    (y, prompt_hidden),
                    on_token,
                );
                self.speculative = Some((drafter, k));
                run?
            }
            None => {
                self.decode_plain(prompt, opts, &mut cache, &mut sampler, y, history, on_token)?
            }
        };
        let end = Instant::now();
        let first_at = decoded.first_at.unwrap_or(end);
        if let Some(snap) = prompt_snapshot {
            checkpoints.push((prompt.len(), snap));
            self.prompt_cache.insert(&decoded.fed, cache, checkpoints);
        }
        Ok(Generation {
            tokens: decoded.out,
            prompt_tokens: prompt.len(),
            reused_tokens: reused,
            prefill_s: (first_at - start).as_secs_f64(),
            decode_s: (end - first_at).as_secs_f64(),
            finish: decoded.finish,
            peak_memory_bytes: mlex_core::device::peak_memory()?,
            prefill_peak_memory_bytes,
            speculative: decoded.speculative,
        })
    }

    /// The plain decode loop, pipelined: step t+1 is handed to MLX before
    /// the host waits for token t. `y` is the token sampled from the
    /// prompt's logits, `history` the repetition penalty's context.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decode_plain(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        cache: &mut ModelCache,
        sampler: &mut Sampler,
        mut y: Array,
        mut history: Array,
        on_token: &mut dyn FnMut(u32) -> Result<Flow>,
    ) -> Result<Decoded> {
        let limit = self.model.max_context.unwrap_or(usize::MAX);
        let ctx = opts.sampler.repetition_context.max(1);
        let use_history = opts.sampler.uses_history();
        async_eval([&y])?;
        let mut fed: Vec<u32> = prompt.to_vec();
        let mut out = Vec::new();
        let mut first_at = None;
        let finish = loop {
            if out.len() >= opts.max_tokens {
                break Finish::Length;
            }
            let room = fed.len() + 1 < limit;
            let more = out.len() + 1 < opts.max_tokens && room;
            let next = if more {
                let inp = ops::reshape(&y, &[1, 1])?;
                let logits = self.step(&inp, cache)?;
                if use_history {
                    let yy = ops::reshape(&y.as_dtype(Dtype::Int32)?, &[1, 1])?;
                    let joined = ops::concatenate(&[&history, &yy], 1)?;
                    let n = joined.shape()[1];
                    history = joined.try_index((.., (n - ctx as i32).max(0)..))?;
                }
                let ny = sampler.sample(&logits, use_history.then_some(&history))?;
                async_eval([&ny])?;
                Some(ny)
            } else {
                None
            };
            let tok = token_id(&y)?;
            if first_at.is_none() {
                first_at = Some(Instant::now());
            }
            if more {
                fed.push(tok);
            }
            out.push(tok);
            let flow = on_token(tok)?;
            let stop = if opts.stop_ids.contains(&tok) {
                Some(Finish::Eos)
            } else if flow == Flow::Stop {
                Some(Finish::Stop)
            } else {
                None
            };
            if let Some(finish) = stop {
                // Wait for the step handed to MLX ahead of time: work left
                // running races MLX's teardown if the process exits next.
                if let Some(n) = &next {
                    n.eval()?;
                }
                break finish;
            }
            match next {
                Some(n) => y = n,
                None if !room => break Finish::Context,
                None => break Finish::Length,
            }
        };
        Ok(Decoded {
            out,
            fed,
            finish,
            first_at,
            speculative: None,
        })
    }
}

/// What a decode loop returns.
pub(crate) struct Decoded {
    /// The generated tokens.
    pub out: Vec<u32>,
    /// The tokens the cache holds (prompt and fed output).
    pub fed: Vec<u32>,
    /// Why it ended.
    pub finish: Finish,
    /// When the first token came.
    pub first_at: Option<Instant>,
    /// Speculative decoding's counters.
    pub speculative: Option<SpecStats>,
}
