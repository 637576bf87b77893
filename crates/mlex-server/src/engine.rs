//! The engine thread: owns the model (MLX arrays and compiled traces stay on
//! one thread) and the [`BatchGenerator`]; takes jobs from the HTTP side over
//! a channel, runs one batched step at a time, and sends each job's events
//! back on its own channel. A job whose channel is closed (the client went
//! away) is stopped at the next token: its slot frees within one step.

use crate::metrics::Metrics;
use mlex_generate::{
    starts_in_reasoning, BatchGenerator, Emitted, Finish, Flow, GenerateOptions, Grammar, Grammars,
    Message, RenderOptions, SeqId, TextStream, Tokenizer,
};
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// What to feed the model.
pub enum Prompt {
    /// Chat messages, rendered with the model's template, the tools and
    /// template arguments.
    Chat(Vec<Message>, RenderOptions),
    /// Raw text, encoded as is.
    Text(String),
}

/// One request for the engine.
pub struct Job {
    /// The prompt.
    pub prompt: Prompt,
    /// Length and sampling; `stop_ids` is filled in from the tokenizer.
    pub opts: GenerateOptions,
    /// Stop strings.
    pub stops: Vec<String>,
    /// A grammar the output must match, and the request field it came
    /// from (named when the grammar engine refuses it).
    pub grammar: Option<(Grammar, &'static str)>,
    /// Where the events go.
    pub events: UnboundedSender<Event>,
}

/// A token's text for a client: as a string (lossy where the token is
/// part of a character) and as bytes.
#[derive(Clone, Debug)]
pub struct TokenText {
    /// The token's text.
    pub text: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

/// A generated token's log-probability, with its alternatives.
#[derive(Clone, Debug)]
pub struct LogprobOut {
    /// The token.
    pub token: TokenText,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens there, most likely first.
    pub top: Vec<(TokenText, f32)>,
}

/// What the engine says about one job.
#[derive(Debug)]
pub enum Event {
    /// The job is admitted: its prompt encoded, its grammar compiled.
    Accepted {
        /// The prompt leaves the model inside a think block.
        in_reasoning: bool,
    },
    /// One token: the text it made safe to show (may be empty while a
    /// multi-byte character is incomplete or a stop string could begin),
    /// and its log-probability when asked for.
    Token {
        /// New text.
        text: String,
        /// The token's log-probability.
        logprob: Option<LogprobOut>,
    },
    /// The end.
    Done {
        /// Why.
        finish: Finish,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Prompt tokens restored from the prompt cache.
        cached_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
        /// What speculative decoding did for it, when it drafted.
        drafted: Option<Drafted>,
    },
    /// The request cannot run (bad prompt or options): a 400.
    Rejected(String),
}

/// One request's speculative decoding (`usage.speculative`).
#[derive(Clone, Copy, Debug)]
pub struct Drafted {
    /// Verify forwards.
    pub rounds: usize,
    /// Draft tokens proposed.
    pub proposed: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
}

/// Messages to the engine thread.
pub enum Msg {
    /// A new job (boxed: its options are large beside the other messages).
    Job(Box<Job>),
    /// Finish what is in flight, take nothing new, then return.
    Drain,
    /// Stop everything now.
    CancelAll,
}

struct Running<'t> {
    events: UnboundedSender<Event>,
    text: TextStream<'t>,
    /// The client went away; its generation was stopped for that.
    gone: bool,
}

/// The prompt's ids, and whether it leaves the model inside a think block.
fn prompt_ids(tok: &Tokenizer, p: &Prompt) -> mlex_core::error::Result<(Vec<u32>, bool)> {
    match p {
        Prompt::Chat(messages, opts) => match &tok.chat_template {
            Some(t) => {
                let opts = RenderOptions {
                    add_generation_prompt: true,
                    ..opts.clone()
                };
                let text = t.render_with(messages, &opts)?;
                Ok((tok.encode(&text, false)?, starts_in_reasoning(&text)))
            }
            None => Ok((tok.chat_ids(messages, false)?, false)),
        },
        Prompt::Text(t) => Ok((tok.encode(t, tok.add_bos)?, false)),
    }
}

/// A token's text and bytes.
fn token_text(tok: &Tokenizer, bytes: &[Vec<u8>], id: u32) -> TokenText {
    let b = bytes.get(id as usize).cloned().unwrap_or_default();
    TokenText {
        text: String::from_utf8_lossy(&b).into_owned(),
        bytes: b,
    }
    .or_decoded(tok, id)
}

impl TokenText {
    /// Falls back to the decoder for an id the byte table lacks (a padded
    /// vocabulary's tail).
    fn or_decoded(self, tok: &Tokenizer, id: u32) -> TokenText {
        if !self.bytes.is_empty() {
            return self;
        }
        let text = tok.decode(&[id]).unwrap_or_default();
        TokenText {
            bytes: text.as_bytes().to_vec(),
            text,
        }
    }
}

fn logprob_out(tok: &Tokenizer, e: &Emitted) -> Option<LogprobOut> {
    let lp = e.logprob.as_ref()?;
    let bytes = tok.token_bytes().unwrap_or(&[]);
    Some(LogprobOut {
        token: token_text(tok, bytes, e.id),
        logprob: lp.logprob,
        top: lp
            .top
            .iter()
            .map(|&(t, l)| (token_text(tok, bytes, t), l))
            .collect(),
    })
}

/// The engine's totals over the server's life, where its time went.
fn log_totals(st: &mlex_generate::BatchStats) {
    eprintln!(
        "mlex serve: engine totals: {} prompt tokens computed ({} of them as tails in decode steps), {} reused, in {:.2} s of admissions; \
         {} tokens in {} decode steps, {:.2} s (of it {:.2} s waiting for the device, {:.2} s handing out tokens)",
        st.prefill_tokens,
        st.tail_tokens,
        st.reused_tokens,
        st.prefill_time.as_secs_f64(),
        st.generated_tokens,
        st.steps,
        st.decode_time.as_secs_f64(),
        st.wait_time.as_secs_f64(),
        st.callback_time.as_secs_f64(),
    );
}

/// Runs the engine until the channel closes or a drain completes.
pub fn run(
    loaded: crate::Loaded,
    batch: usize,
    rx: mpsc::Receiver<Msg>,
    metrics: Arc<Metrics>,
) -> mlex_core::error::Result<()> {
    let crate::Loaded {
        mut generator,
        tokenizer,
        speculation,
    } = loaded;
    let tok = &tokenizer;
    let vocab = generator.model.vocab_size() as usize;
    // Under --tp: what rank 0 does, shared with the other ranks.
    let shard = generator.model.dispatch.tensor_parallel.clone();
    let mut plan = crate::replicas::Plan::default();
    let end = |shard: &Option<mlex_core::distributed::Shard>| match shard {
        Some(s) => crate::replicas::share(
            s,
            Some(&crate::replicas::Plan {
                end: true,
                ..Default::default()
            }),
        )
        .map(|_| ()),
        None => Ok(()),
    };
    let mut grammars: Option<Grammars> = None;
    let mut engine = BatchGenerator::new(&mut generator, batch)?;
    if let Some(s) = speculation {
        engine.speculate(s)?;
    }
    let mut running: BTreeMap<SeqId, Running> = BTreeMap::new();
    let mut draining = false;
    loop {
        // Block for work only when there is none in flight.
        let first = if engine.is_idle() {
            if draining {
                log_totals(engine.stats());
                return end(&shard);
            }
            match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => {
                    log_totals(engine.stats());
                    return end(&shard);
                }
            }
        } else {
            None
        };
        for msg in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            match msg {
                Msg::Job(job) => {
                    let job = *job;
                    let (ids, in_reasoning) = match prompt_ids(tok, &job.prompt) {
                        Ok((ids, r)) if !ids.is_empty() => (ids, r),
                        Ok(_) => {
                            let _ = job
                                .events
                                .send(Event::Rejected("the prompt is empty".into()));
                            continue;
                        }
                        Err(e) => {
                            let _ = job.events.send(Event::Rejected(e.to_string()));
                            continue;
                        }
                    };
                    let mut opts = job.opts;
                    if let Some((g, field)) = &job.grammar {
                        if grammars.is_none() {
                            match Grammars::new(tok, vocab) {
                                Ok(g) => grammars = Some(g),
                                Err(e) => {
                                    let _ = job.events.send(Event::Rejected(e.to_string()));
                                    continue;
                                }
                            }
                        }
                        let engine_for = grammars.as_ref().expect("made above");
                        match engine_for.compile(g) {
                            Ok(c) => opts.constraint = Some(c),
                            Err(e) => {
                                let _ = job.events.send(Event::Rejected(format!(
                                    "`{field}`: the grammar engine refused it: {e}"
                                )));
                                continue;
                            }
                        }
                    }
                    if job.events.send(Event::Accepted { in_reasoning }).is_err() {
                        continue;
                    }
                    opts.stop_ids = tok.eos_ids.clone();
                    // Shared prefixes (system prompts, earlier turns) come
                    // from the prompt cache, hybrids included.
                    opts.use_prompt_cache = true;
                    if shard.is_some() {
                        let grammar = job.grammar.as_ref().map(|(g, _)| g);
                        plan.admit
                            .push(crate::replicas::Admission::of(&ids, &mut opts, grammar));
                    }
                    let id = engine.submit(ids, opts);
                    running.insert(
                        id,
                        Running {
                            events: job.events,
                            text: TextStream::new(tok, job.stops),
                            gone: false,
                        },
                    );
                }
                Msg::Drain => draining = true,
                Msg::CancelAll => {
                    for &id in running.keys() {
                        engine.cancel(id);
                        plan.cancel.push(id);
                    }
                }
            }
        }
        if let Some(s) = &shard {
            crate::replicas::share(s, Some(&std::mem::take(&mut plan)))?;
        }
        metrics.queue_depth.set(engine.waiting() as i64);
        metrics.active.set(engine.active() as i64);
        let before = engine.stats().clone();
        let started = std::time::Instant::now();
        let mut decide = |id: SeqId, t: &Emitted| -> mlex_core::error::Result<Flow> {
            let Some(r) = running.get_mut(&id) else {
                return Ok(Flow::Continue);
            };
            let pushed = r.text.push(t.id)?;
            let flow = if pushed.stop {
                Flow::Stop
            } else {
                Flow::Continue
            };
            let logprob = logprob_out(tok, t);
            if !pushed.text.is_empty() || logprob.is_some() {
                let ev = Event::Token {
                    text: pushed.text,
                    logprob,
                };
                if r.events.send(ev).is_err() {
                    // The client is gone: free its slot.
                    metrics.cancelled.inc();
                    r.gone = true;
                    return Ok(Flow::Stop);
                }
            } else if r.events.is_closed() {
                metrics.cancelled.inc();
                r.gone = true;
                return Ok(Flow::Stop);
            }
            Ok(flow)
        };
        // Every rank stops a sequence at the same token.
        let mut on_token = |id: SeqId, t: &Emitted| -> mlex_core::error::Result<Flow> {
            let flow = decide(id, t)?;
            match &shard {
                Some(s) => crate::replicas::agree(s, flow),
                None => Ok(flow),
            }
        };
        let finished = engine.step(&mut on_token)?;
        let after = engine.stats();
        metrics
            .prefill_computed
            .inc_by((after.prefill_tokens - before.prefill_tokens) as u64);
        metrics
            .prefill_reused
            .inc_by((after.reused_tokens - before.reused_tokens) as u64);
        let generated = (after.generated_tokens - before.generated_tokens) as u64;
        metrics.generated.inc_by(generated);
        if generated > 0 {
            let rate = generated as f64 / started.elapsed().as_secs_f64().max(1e-9);
            metrics.decode_rate.set(rate);
        }
        for (id, r) in finished {
            let Some(mut run) = running.remove(&id) else {
                continue;
            };
            match r {
                Ok(out) => {
                    // A detokenizer error at the end loses the held bytes
                    // only, as before.
                    let rest = run.text.finish(out.finish).unwrap_or_default();
                    if !rest.is_empty() {
                        let _ = run.events.send(Event::Token {
                            text: rest,
                            logprob: None,
                        });
                    }
                    eprintln!(
                        "mlex serve: request {id}: {} prompt tokens ({} reused, {} computed), {} generated, {}",
                        out.prompt_tokens,
                        out.reused_tokens,
                        out.prompt_tokens - out.reused_tokens,
                        out.tokens.len(),
                        if run.gone {
                            "cancelled (client gone)"
                        } else {
                            out.finish.as_str()
                        }
                    );
                    let drafted = out.speculative.as_ref().map(|s| Drafted {
                        rounds: s.rounds,
                        proposed: s.proposed,
                        accepted: s.accepted,
                    });
                    if let Some(d) = drafted {
                        metrics.speculative_rounds.inc_by(d.rounds as u64);
                        metrics.draft_proposed.inc_by(d.proposed as u64);
                        metrics.draft_accepted.inc_by(d.accepted as u64);
                    }
                    let _ = run.events.send(Event::Done {
                        finish: out.finish,
                        prompt_tokens: out.prompt_tokens,
                        cached_tokens: out.reused_tokens,
                        completion_tokens: out.tokens.len(),
                        drafted,
                    });
                }
                Err(e) => {
                    let _ = run.events.send(Event::Rejected(e.to_string()));
                }
            }
        }
        metrics.queue_depth.set(engine.waiting() as i64);
        metrics.active.set(engine.active() as i64);
    }
}
