//! The answer to a generation request, from the engine's events: one JSON
//! body, or server-sent events as the tokens come. A chat answer's text is
//! split into reasoning (`reasoning_content`), content and tool calls
//! (`tool_calls`, `finish_reason: "tool_calls"`) on the way.

use crate::engine::{Drafted, Event, LogprobOut, TokenText};
use crate::request::Shape;
use crate::{error, finish_reason, now, Kind, Slot};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use mlex_generate::{Finish, ParsedCall, Part, ReasoningSplit, ToolCallStream, ToolPiece};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::mpsc as tmpsc;
use tokio_stream::wrappers::ReceiverStream;

/// One piece of a chat answer.
enum Delta {
    Reasoning(String),
    Content(String),
    Call(ParsedCall),
}

/// Text to reasoning, content and tool calls, as it streams.
struct Shaper {
    reasoning: Option<ReasoningSplit>,
    tools: Option<ToolCallStream>,
    parallel: bool,
    calls: usize,
}

impl Shaper {
    fn new(shape: &Shape, in_reasoning: bool) -> Self {
        Self {
            reasoning: shape.reasoning.then(|| ReasoningSplit::new(in_reasoning)),
            tools: shape
                .tools
                .as_ref()
                .map(|t| ToolCallStream::new(t.format, t.tools.clone())),
            parallel: shape.tools.as_ref().is_none_or(|t| t.parallel),
            calls: 0,
        }
    }

    fn push(&mut self, text: &str) -> Vec<Delta> {
        let parts = match &mut self.reasoning {
            Some(r) => r.push(text),
            None => vec![Part::Content(text.to_owned())],
        };
        self.route(parts, false)
    }

    fn finish(&mut self) -> Vec<Delta> {
        let parts = self
            .reasoning
            .as_mut()
            .map(|r| r.finish())
            .unwrap_or_default();
        self.route(parts, true)
    }

    fn route(&mut self, parts: Vec<Part>, end: bool) -> Vec<Delta> {
        let mut out = Vec::new();
        for p in parts {
            match p {
                Part::Reasoning(t) => out.push(Delta::Reasoning(t)),
                Part::Content(t) => match &mut self.tools {
                    Some(tools) => {
                        let pieces = tools.push(&t);
                        self.pieces(pieces, &mut out);
                    }
                    None => out.push(Delta::Content(t)),
                },
            }
        }
        if end {
            if let Some(tools) = &mut self.tools {
                let pieces = tools.finish();
                self.pieces(pieces, &mut out);
            }
        }
        out
    }

    fn pieces(&mut self, pieces: Vec<ToolPiece>, out: &mut Vec<Delta>) {
        for piece in pieces {
            match piece {
                ToolPiece::Text(t) => out.push(Delta::Content(t)),
                // Without parallel calls, the first call is the answer.
                ToolPiece::Call(_) if !self.parallel && self.calls > 0 => {}
                ToolPiece::Call(c) => {
                    self.calls += 1;
                    out.push(Delta::Call(c));
                }
            }
        }
    }
}

/// A new tool call id: `call_` and 24 hexadecimal digits, unique in this
/// process.
fn call_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!("call_{t:016x}{:08x}", n as u32)
}

fn call_json(c: &ParsedCall, index: Option<usize>) -> Value {
    let mut v = json!({
        "id": call_id(),
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments.to_string()},
    });
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

fn token_json(t: &TokenText, logprob: f32) -> Value {
    json!({"token": t.text, "logprob": logprob, "bytes": t.bytes})
}

/// A chat `logprobs.content` entry.
fn chat_logprob(l: &LogprobOut) -> Value {
    let mut v = token_json(&l.token, l.logprob);
    v["top_logprobs"] = Value::Array(l.top.iter().map(|(t, p)| token_json(t, *p)).collect());
    v
}

/// A completion's `logprobs` object for these tokens, `text_offset` from
/// `offset` (the answer's bytes before them).
fn completion_logprobs(lps: &[LogprobOut], mut offset: usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut offsets = Vec::new();
    for l in lps {
        tokens.push(json!(l.token.text));
        token_logprobs.push(json!(l.logprob));
        let mut m = serde_json::Map::new();
        for (t, p) in &l.top {
            m.insert(t.text.clone(), json!(p));
        }
        top.push(Value::Object(m));
        offsets.push(json!(offset));
        offset += l.token.text.len();
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

fn usage(
    prompt_tokens: usize,
    cached: usize,
    completion: usize,
    drafted: Option<Drafted>,
) -> Value {
    let mut u = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    });
    if let Some(d) = drafted {
        // Not OpenAI's: what speculative decoding did for this request.
        u["speculative"] = json!({
            "rounds": d.rounds,
            "draft_tokens": d.proposed,
            "accepted_draft_tokens": d.accepted,
            "acceptance": d.accepted as f64 / d.proposed.max(1) as f64,
            "mean_accepted_length": (d.accepted + d.rounds) as f64 / d.rounds.max(1) as f64,
        });
    }
    u
}

/// The finish reason a client sees: `tool_calls` when the answer called a
/// tool and ended on its own.
fn reason(f: Finish, calls: usize) -> &'static str {
    match f {
        Finish::Eos | Finish::Stop if calls > 0 => "tool_calls",
        f => finish_reason(f),
    }
}

/// Who is answering: the response's id, model and time.
pub struct Header {
    pub id: String,
    pub model: String,
    pub created: u64,
}

impl Header {
    pub fn new(kind: Kind, n: u64, model: String) -> Self {
        Self {
            id: match kind {
                Kind::Chat => format!("chatcmpl-{n}"),
                Kind::Completion => format!("cmpl-{n}"),
            },
            model,
            created: now(),
        }
    }
}

fn engine_stopped() -> Response {
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "the engine stopped",
    )
}

/// One request's answer: who answers, its shape, whether the prompt left
/// the model inside a reasoning block, the engine's events and the slot the
/// request holds until it is done.
pub struct Answer {
    pub header: Header,
    pub shape: Shape,
    pub in_reasoning: bool,
    pub rx: tmpsc::UnboundedReceiver<Event>,
    pub slot: Slot,
}

impl Answer {
    /// The answer as the request asked: server-sent events or one body.
    pub async fn respond(self) -> Response {
        match self.shape.stream {
            true => streamed(self),
            false => whole(self).await,
        }
    }
}

/// The whole answer as one JSON body.
async fn whole(a: Answer) -> Response {
    let in_reasoning = a.in_reasoning;
    let (h, shape, mut rx, slot) = (a.header, a.shape, a.rx, a.slot);
    let mut shaper = Shaper::new(&shape, in_reasoning);
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    let mut lps: Vec<LogprobOut> = Vec::new();
    let mut take = |deltas: Vec<Delta>, reasoning: &mut String, content: &mut String| {
        for d in deltas {
            match d {
                Delta::Reasoning(t) => reasoning.push_str(&t),
                Delta::Content(t) => content.push_str(&t),
                Delta::Call(c) => calls.push(c),
            }
        }
    };
    loop {
        match rx.recv().await {
            Some(Event::Token { text, logprob }) => {
                lps.extend(logprob);
                let deltas = if shape.kind == Kind::Chat {
                    shaper.push(&text)
                } else {
                    vec![Delta::Content(text)]
                };
                take(deltas, &mut reasoning, &mut content);
            }
            Some(Event::Done {
                finish,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                drafted,
            }) => {
                drop(slot);
                if shape.kind == Kind::Chat {
                    take(shaper.finish(), &mut reasoning, &mut content);
                }
                let finish = reason(finish, calls.len());
                let (object, choice) = match shape.kind {
                    Kind::Chat => {
                        let mut message = json!({
                            "role": "assistant",
                            "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { json!(content) },
                        });
                        if !reasoning.is_empty() {
                            message["reasoning_content"] = json!(reasoning);
                        }
                        if !calls.is_empty() {
                            message["tool_calls"] =
                                Value::Array(calls.iter().map(|c| call_json(c, None)).collect());
                        }
                        let logprobs = match shape.logprobs {
                            Some(_) => {
                                json!({"content": lps.iter().map(chat_logprob).collect::<Vec<_>>()})
                            }
                            None => Value::Null,
                        };
                        (
                            "chat.completion",
                            json!({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}),
                        )
                    }
                    Kind::Completion => {
                        let logprobs = match shape.logprobs {
                            Some(_) => completion_logprobs(&lps, 0),
                            None => Value::Null,
                        };
                        (
                            "text_completion",
                            json!({"index": 0, "text": content, "logprobs": logprobs, "finish_reason": finish}),
                        )
                    }
                };
                return axum::Json(json!({
                    "id": h.id, "object": object, "created": h.created, "model": h.model,
                    "choices": [choice], "usage": usage(prompt_tokens, cached_tokens, completion_tokens, drafted),
                }))
                .into_response();
            }
            Some(Event::Rejected(msg)) => return crate::bad_request(msg),
            Some(Event::Accepted { .. }) => {}
            None => return engine_stopped(),
        }
    }
}

/// The streamed chunks' choices, as the answer's pieces come.
struct Chunks {
    kind: Kind,
    /// Calls sent so far (the next one's index).
    calls: usize,
    /// Bytes of a completion's text sent so far.
    offset: usize,
}

impl Chunks {
    /// The choices of one token's pieces (content, reasoning, a call), its
    /// log-probability on the first.
    fn of(&mut self, deltas: Vec<Delta>, mut lp: Option<LogprobOut>) -> Vec<Value> {
        if self.kind == Kind::Completion {
            let text: String = deltas
                .into_iter()
                .map(|d| match d {
                    Delta::Content(t) | Delta::Reasoning(t) => t,
                    Delta::Call(_) => String::new(),
                })
                .collect();
            let logprobs = match lp.take() {
                Some(l) => completion_logprobs(std::slice::from_ref(&l), self.offset),
                None => Value::Null,
            };
            self.offset += text.len();
            if text.is_empty() && logprobs.is_null() {
                return Vec::new();
            }
            return vec![
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": null}),
            ];
        }
        let mut deltas: Vec<Value> = deltas
            .into_iter()
            .map(|d| match d {
                Delta::Reasoning(t) => json!({"reasoning_content": t}),
                Delta::Content(t) => json!({"content": t}),
                Delta::Call(c) => {
                    self.calls += 1;
                    json!({"tool_calls": [call_json(&c, Some(self.calls - 1))]})
                }
            })
            .collect();
        if deltas.is_empty() && lp.is_some() {
            deltas.push(json!({}));
        }
        deltas
            .into_iter()
            .map(|d| {
                let logprobs = match lp.take() {
                    Some(l) => json!({"content": [chat_logprob(&l)]}),
                    None => Value::Null,
                };
                json!({"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": null})
            })
            .collect()
    }
}

/// The answer as server-sent events.
fn streamed(a: Answer) -> Response {
    let in_reasoning = a.in_reasoning;
    let (h, shape, mut rx, slot) = (a.header, a.shape, a.rx, a.slot);
    let (out, out_rx) = tmpsc::channel::<std::result::Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let _slot = slot;
        let object = match shape.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let frame = |choice: Value| -> SseEvent {
            SseEvent::default().data(
                json!({"id": h.id, "object": object, "created": h.created, "model": h.model, "choices": [choice]})
                    .to_string(),
            )
        };
        let mut shaper = Shaper::new(&shape, in_reasoning);
        let mut chunks = Chunks {
            kind: shape.kind,
            calls: 0,
            offset: 0,
        };
        if shape.kind == Kind::Chat
            && out
                .send(Ok(frame(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))))
                .await
                .is_err()
        {
            return;
        }
        while let Some(e) = rx.recv().await {
            match e {
                Event::Accepted { .. } => {}
                Event::Token { text, logprob } => {
                    let deltas = if shape.kind == Kind::Chat {
                        shaper.push(&text)
                    } else {
                        vec![Delta::Content(text)]
                    };
                    for c in chunks.of(deltas, logprob) {
                        if out.send(Ok(frame(c))).await.is_err() {
                            return; // Client gone: dropping `rx` stops the sequence.
                        }
                    }
                }
                Event::Done {
                    finish,
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                    drafted,
                } => {
                    let rest = if shape.kind == Kind::Chat {
                        shaper.finish()
                    } else {
                        Vec::new()
                    };
                    for c in chunks.of(rest, None) {
                        let _ = out.send(Ok(frame(c))).await;
                    }
                    let finish = reason(finish, chunks.calls);
                    let last = match shape.kind {
                        Kind::Chat => {
                            json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish})
                        }
                        Kind::Completion => {
                            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish})
                        }
                    };
                    let _ = out.send(Ok(frame(last))).await;
                    if shape.include_usage {
                        let u = json!({
                            "id": h.id, "object": object, "created": h.created, "model": h.model, "choices": [],
                            "usage": usage(prompt_tokens, cached_tokens, completion_tokens, drafted),
                        });
                        let _ = out.send(Ok(SseEvent::default().data(u.to_string()))).await;
                    }
                    let _ = out.send(Ok(SseEvent::default().data("[DONE]"))).await;
                    return;
                }
                Event::Rejected(msg) => {
                    let _ = out
                        .send(Ok(SseEvent::default()
                            .data(json!({"error": {"message": msg}}).to_string())))
                        .await;
                    return;
                }
            }
        }
    });
    Sse::new(ReceiverStream::new(out_rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}
