//! `mlex serve --tp N`: rank 0 serves HTTP and owns the tokenizer, the
//! queue and every decision; the other ranks hold their parts of the model
//! and run the same batched engine in lockstep. Before each engine step
//! rank 0 shares a [`Plan`] (the requests it admitted, with their token
//! ids and sampling settings, and the ones it cancelled); after each token
//! it shares whether that sequence stops (a stop string, a client gone).
//! Every rank then holds the same batch, samples the same tokens from the
//! same logits (a seed is fixed for each sampled request) and retires the
//! same rows, so the collectives inside the forward pair up.

use mlex_core::distributed::Shard;
use mlex_core::error::{Error, Result};
use mlex_generate::{
    BatchGenerator, Flow, GenerateOptions, Grammar, Grammars, SamplerConfig, SeqId,
};
use serde::{Deserialize, Serialize};

/// What rank 0 did to the engine's queue before one step.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Plan {
    /// Requests submitted, in order (so each rank gives them the same ids).
    pub admit: Vec<Admission>,
    /// Requests cancelled.
    pub cancel: Vec<SeqId>,
    /// The server is done: the other ranks return.
    pub end: bool,
}

/// One admitted request, as the engine takes it.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Admission {
    ids: Vec<u32>,
    max_tokens: usize,
    sampler: SamplerConfig,
    stop_ids: Vec<u32>,
    use_prompt_cache: bool,
    logprobs: Option<usize>,
    /// The grammar rank 0 compiled for it; each rank compiles its own
    /// (the same mask, so the same tokens).
    grammar: Option<Grammar>,
}

impl Admission {
    /// The request `opts` on `ids`, its sampling seed fixed first when it
    /// has none (each rank would draw its own).
    pub fn of(ids: &[u32], opts: &mut GenerateOptions, grammar: Option<&Grammar>) -> Admission {
        if opts.sampler.seed.is_none() {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            opts.sampler.seed = Some(now);
        }
        Admission {
            ids: ids.to_vec(),
            max_tokens: opts.max_tokens,
            sampler: opts.sampler.clone(),
            stop_ids: opts.stop_ids.iter().copied().collect(),
            use_prompt_cache: opts.use_prompt_cache,
            logprobs: opts.logprobs,
            grammar: grammar.cloned(),
        }
    }

    fn options(self) -> (Vec<u32>, GenerateOptions, Option<Grammar>) {
        let opts = GenerateOptions {
            max_tokens: self.max_tokens,
            sampler: self.sampler,
            stop_ids: self.stop_ids.into_iter().collect(),
            use_prompt_cache: self.use_prompt_cache,
            constraint: None,
            logprobs: self.logprobs,
        };
        (self.ids, opts, self.grammar)
    }
}

/// Rank 0's plan on every rank (rank 0 passes it, the others `None`).
pub(crate) fn share(shard: &Shard, plan: Option<&Plan>) -> Result<Plan> {
    let mine: Vec<i32> = match plan {
        Some(p) => serde_json::to_vec(p)
            .map_err(|e| Error::Other(format!("--tp: encoding a plan: {e}")))?
            .into_iter()
            .map(i32::from)
            .collect(),
        None => Vec::new(),
    };
    let bytes: Vec<u8> = shard
        .share_from_first(&mine)?
        .into_iter()
        .map(|b| b as u8)
        .collect();
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::Other(format!("--tp: rank 0's plan did not arrive whole: {e}")))
}

/// Rank 0's `flow` for one token, on every rank.
pub(crate) fn agree(shard: &Shard, flow: Flow) -> Result<Flow> {
    let stop = shard.rank() == 0 && matches!(flow, Flow::Stop);
    Ok(if shard.any(stop)? {
        Flow::Stop
    } else {
        Flow::Continue
    })
}

/// A rank other than 0: the engine in lockstep with rank 0's plans until
/// rank 0 ends.
pub fn follow(loaded: crate::Loaded, batch: usize, prompt_cache_bytes: usize) -> Result<()> {
    let crate::Loaded {
        mut generator,
        speculation,
        tokenizer,
    } = loaded;
    let vocab = generator.model.vocab_size() as usize;
    let mut grammars: Option<Grammars> = None;
    generator.prompt_cache = mlex_generate::PromptCache::new(64, prompt_cache_bytes);
    let shard = generator
        .model
        .dispatch
        .tensor_parallel
        .clone()
        .ok_or_else(|| Error::Other("a serving rank without a tensor-parallel group".into()))?;
    let mut engine = BatchGenerator::new(&mut generator, batch)?;
    if let Some(s) = speculation {
        engine.speculate(s)?;
    }
    loop {
        let plan = share(&shard, None)?;
        if plan.end {
            return Ok(());
        }
        for a in plan.admit {
            let (ids, mut opts, grammar) = a.options();
            if let Some(g) = grammar {
                if grammars.is_none() {
                    grammars = Some(Grammars::new(&tokenizer, vocab)?);
                }
                let compiled = grammars.as_ref().expect("made above").compile(&g);
                opts.constraint = Some(compiled.map_err(|e| {
                    Error::Other(format!("--tp: a grammar rank 0 compiled failed here: {e}"))
                })?);
            }
            engine.submit(ids, opts);
        }
        for id in plan.cancel {
            engine.cancel(id);
        }
        engine.step(&mut |_, _| agree(&shard, Flow::Continue))?;
    }
}
