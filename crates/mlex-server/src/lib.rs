//! # mlex-server
//!
//! `mlex serve`: an OpenAI-compatible HTTP server (axum on tokio) over the
//! batched engine ([`mlex_generate::BatchGenerator`]).
//!
//! - `POST /v1/chat/completions` and `POST /v1/completions`, streamed as
//!   server-sent events or not; `GET /v1/models`, `GET /health`,
//!   `GET /metrics` (Prometheus text).
//! - Concurrent requests decode in one forward: the HTTP side only parses
//!   and answers; one engine thread owns the model (MLX arrays and compiled
//!   traces stay on one thread) and steps the batch (module `engine`).
//! - A bounded queue answers 503 with `Retry-After` when full; a client
//!   that disconnects stops its sequence within one decode step; with an API
//!   key, a request without `Authorization: Bearer KEY` is a 401; a
//!   [`Shutdown`] request (the CLI makes one on SIGTERM or Ctrl-C) stops
//!   accepting, lets what is in flight finish (cancelled after the shutdown
//!   timeout) and returns.
//!
//! - Requests that share a prefix (a system prompt, earlier turns) restore
//!   it from the prompt cache under `prompt_cache_bytes`, hybrids included
//!   (recurrent-state checkpoints); the reused count is in the metrics, in
//!   `usage.prompt_tokens_details.cached_tokens` and in a log line per
//!   request.
//!
//! The request fields honoured and refused are listed in module `api`
//! (and in the README).
#![deny(missing_docs)]

mod api;
mod engine;
mod metrics;

use api::{ChatRequest, Common, CompletionRequest};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use engine::{Event, Job, Msg, Prompt};
use metrics::Metrics;
use mlex_core::error::{Error, Result};
use mlex_generate::{Finish, GenerateOptions, Generator, Message, SamplerConfig, Tokenizer};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc as tmpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Address to bind (loopback by default in the CLI).
    pub host: String,
    /// Port (0 picks a free one; the bound address is printed).
    pub port: u16,
    /// Most sequences decoding together.
    pub batch: usize,
    /// Most requests waiting beyond `batch` before 503s.
    pub max_queue: usize,
    /// Required bearer token, if any.
    pub api_key: Option<String>,
    /// The model id clients name (`GET /v1/models`).
    pub model_id: String,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: usize,
    /// After SIGTERM, how long in-flight requests may run before they are
    /// cancelled.
    pub shutdown_timeout: Duration,
    /// Byte budget of the prompt cache that shares prefixes across requests.
    pub prompt_cache_bytes: usize,
}

/// What the engine thread serves: built on that thread by the loader given
/// to [`serve`].
pub struct Loaded {
    /// The model with its compiled decoder.
    pub generator: Generator,
    /// Its tokenizer (chat template, end tokens).
    pub tokenizer: Tokenizer,
}

struct AppState {
    cfg: ServeConfig,
    jobs: mpsc::Sender<Msg>,
    metrics: Arc<Metrics>,
    in_flight: AtomicUsize,
    vocab: usize,
    max_context: Option<usize>,
    next_id: AtomicU64,
}

/// Counts a request against the queue bound until it ends.
struct Slot(Arc<AppState>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body =
        json!({"error": {"message": message.into(), "type": kind, "param": null, "code": null}});
    (status, axum::Json(body)).into_response()
}

fn bad_request(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Length | Finish::Context => "length",
        Finish::Eos | Finish::Stop | Finish::Cancelled => "stop",
    }
}

/// Checks the bearer token; `Some(response)` refuses.
fn check_auth(s: &AppState, headers: &HeaderMap) -> Option<Response> {
    let key = s.cfg.api_key.as_ref()?;
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given == Some(key.as_str()) {
        None
    } else {
        s.metrics.rejected.inc();
        Some(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key: send `Authorization: Bearer KEY`",
        ))
    }
}

/// Why a request is refused: its status and a message naming the field.
struct Refusal(StatusCode, String);

impl Refusal {
    fn bad(message: impl Into<String>) -> Refusal {
        Refusal(StatusCode::BAD_REQUEST, message.into())
    }

    fn response(self) -> Response {
        error(self.0, "invalid_request_error", self.1)
    }
}

/// The generation options of a request, or the refusal that names the field.
fn options(
    s: &AppState,
    c: &Common,
    max_tokens: Option<usize>,
) -> std::result::Result<(GenerateOptions, Vec<String>), Refusal> {
    if let Some(m) = &c.model {
        if m != &s.cfg.model_id {
            return Err(Refusal(
                StatusCode::NOT_FOUND,
                format!(
                    "model `{m}` is not served here (this server serves `{}`)",
                    s.cfg.model_id
                ),
            ));
        }
    }
    if c.n.is_some_and(|n| n != 1) {
        return Err(Refusal::bad("`n` must be 1"));
    }
    let max_tokens = max_tokens.unwrap_or(s.cfg.default_max_tokens);
    if max_tokens == 0 {
        return Err(Refusal::bad("`max_tokens` must be at least 1"));
    }
    if let Some(ctx) = s.max_context {
        if max_tokens > ctx {
            return Err(Refusal::bad(format!(
                "`max_tokens` {max_tokens} exceeds the model's context of {ctx} tokens"
            )));
        }
    }
    let d = SamplerConfig::default();
    let temp = c.temperature.unwrap_or(d.temp);
    if !temp.is_finite() || temp < 0.0 {
        return Err(Refusal::bad(format!(
            "`temperature` {temp} must be a finite number ≥ 0"
        )));
    }
    let top_p = c.top_p.unwrap_or(d.top_p);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(Refusal::bad(format!("`top_p` {top_p} must be in (0, 1]")));
    }
    let min_p = c.min_p.unwrap_or(d.min_p);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(Refusal::bad(format!("`min_p` {min_p} must be in [0, 1]")));
    }
    let rp = c.repetition_penalty.unwrap_or(d.repetition_penalty);
    if !rp.is_finite() || rp <= 0.0 {
        return Err(Refusal::bad(format!(
            "`repetition_penalty` {rp} must be > 0"
        )));
    }
    let mut logit_bias = Vec::new();
    for (k, b) in c.logit_bias.iter().flatten() {
        let id: u32 = k
            .parse()
            .map_err(|_| Refusal::bad(format!("`logit_bias` key `{k}` is not a token id")))?;
        if id as usize >= s.vocab {
            return Err(Refusal::bad(format!(
                "`logit_bias` token {id} is outside the vocabulary of {}",
                s.vocab
            )));
        }
        logit_bias.push((id, *b));
    }
    let sampler = SamplerConfig {
        temp,
        top_p,
        top_k: c.top_k.unwrap_or(d.top_k),
        min_p,
        repetition_penalty: rp,
        logit_bias,
        seed: c.seed,
        ..d
    };
    let opts = GenerateOptions {
        max_tokens,
        sampler,
        stop_ids: Default::default(),
        use_prompt_cache: false,
    };
    Ok((
        opts,
        c.stop.clone().map(api::Stop::into_vec).unwrap_or_default(),
    ))
}

/// Parses a request body; the error names the field at fault.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> std::result::Result<T, String> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.inner().to_string()
        } else {
            format!("`{path}`: {}", e.inner())
        }
    })
}

/// Which response shape a request wants.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// The chat roles accepted (`developer` is OpenAI's newer `system`).
const ROLES: [&str; 4] = ["system", "developer", "user", "assistant"];

/// Largest request body accepted.
const MAX_BODY_BYTES: usize = 4 << 20;

/// How much of a body over [`MAX_BODY_BYTES`] is read and dropped before the
/// 413. Most clients send the whole body before they read the answer; a
/// server that answers and closes with the body unread resets the
/// connection, and the client sees a broken pipe instead of the 413.
const DRAIN_BODY_BYTES: usize = 64 << 20;

/// Reads a request body of at most [`MAX_BODY_BYTES`], or answers 413 (or
/// 400 when the body cannot be read).
async fn read_body(headers: &HeaderMap, body: Body) -> std::result::Result<Vec<u8>, Response> {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body: larger than the limit of {MAX_BODY_BYTES} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > DRAIN_BODY_BYTES as u64) {
        return Err(too_large());
    }
    let mut stream = body.into_data_stream();
    let mut data = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| bad_request(format!("request body: {e}")))?;
        seen += chunk.len();
        if seen > DRAIN_BODY_BYTES {
            return Err(too_large());
        }
        if seen <= MAX_BODY_BYTES {
            data.extend_from_slice(&chunk);
        }
    }
    if seen > MAX_BODY_BYTES {
        return Err(too_large());
    }
    Ok(data)
}

async fn generate(s: Arc<AppState>, headers: HeaderMap, body: Body, kind: Kind) -> Response {
    if let Some(r) = check_auth(&s, &headers) {
        return r;
    }
    s.metrics.requests.inc();
    let body = match read_body(&headers, body).await {
        Ok(b) => b,
        Err(r) => {
            s.metrics.rejected.inc();
            return r;
        }
    };
    let parsed = match kind {
        Kind::Chat => parse::<ChatRequest>(&body)
            .and_then(|r| {
                if let Some((i, m)) = r
                    .messages
                    .iter()
                    .enumerate()
                    .find(|(_, m)| !ROLES.contains(&m.role.as_str()))
                {
                    return Err(format!(
                        "`messages[{i}].role`: `{}` is not one of {}",
                        m.role,
                        ROLES.join(", ")
                    ));
                }
                if r.messages.is_empty() {
                    return Err("`messages` is empty".into());
                }
                Ok(r)
            })
            .map(|r| {
                let max = r.max_completion_tokens.or(r.common.max_tokens);
                let msgs = r
                    .messages
                    .into_iter()
                    .map(|m| {
                        let role = if m.role == "developer" {
                            "system"
                        } else {
                            m.role.as_str()
                        };
                        Message::new(role, &m.content)
                    })
                    .collect();
                (Prompt::Chat(msgs), r.common, max)
            }),
        Kind::Completion => parse::<CompletionRequest>(&body).map(|r| {
            let max = r.common.max_tokens;
            (Prompt::Text(r.prompt), r.common, max)
        }),
    };
    let (prompt, common, max) = match parsed {
        Ok(p) => p,
        Err(e) => {
            s.metrics.rejected.inc();
            return bad_request(format!("request body: {e}"));
        }
    };
    let (opts, stops) = match options(&s, &common, max) {
        Ok(o) => o,
        Err(r) => {
            s.metrics.rejected.inc();
            return r.response();
        }
    };
    let limit = s.cfg.batch + s.cfg.max_queue;
    if s.in_flight.fetch_add(1, Ordering::SeqCst) >= limit {
        s.in_flight.fetch_sub(1, Ordering::SeqCst);
        s.metrics.rejected.inc();
        let mut r = error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_busy",
            format!("{limit} requests are in flight or queued; retry shortly"),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return r;
    }
    let slot = Slot(s.clone());
    let (tx, mut rx) = tmpsc::unbounded_channel();
    let job = Job {
        prompt,
        opts,
        stops,
        events: tx,
    };
    if s.jobs.send(Msg::Job(job)).is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_busy",
            "the engine has stopped",
        );
    }
    // The first event decides between a 400 and an answer.
    let first = match rx.recv().await {
        Some(Event::Rejected(msg)) => {
            s.metrics.rejected.inc();
            return bad_request(msg);
        }
        Some(ev) => ev,
        None => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "the engine stopped",
            )
        }
    };
    let id = s.next_id.fetch_add(1, Ordering::SeqCst);
    let id = match kind {
        Kind::Chat => format!("chatcmpl-{id}"),
        Kind::Completion => format!("cmpl-{id}"),
    };
    let model = s.cfg.model_id.clone();
    let created = now();
    if !common.stream {
        let mut text = String::new();
        let mut ev = Some(first);
        loop {
            match ev {
                Some(Event::Text(t)) => text.push_str(&t),
                Some(Event::Done {
                    finish,
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                }) => {
                    drop(slot);
                    let usage = json!({
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                        "prompt_tokens_details": {"cached_tokens": cached_tokens},
                    });
                    let choice = match kind {
                        Kind::Chat => {
                            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason(finish)})
                        }
                        Kind::Completion => {
                            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason(finish)})
                        }
                    };
                    let object = if kind == Kind::Chat {
                        "chat.completion"
                    } else {
                        "text_completion"
                    };
                    return axum::Json(json!({
                        "id": id, "object": object, "created": created, "model": model,
                        "choices": [choice], "usage": usage,
                    }))
                    .into_response();
                }
                Some(Event::Rejected(msg)) => return bad_request(msg),
                None => {
                    return error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "the engine stopped",
                    )
                }
            }
            ev = rx.recv().await;
        }
    }
    let include_usage = common.stream_options.is_some_and(|o| o.include_usage);
    let (out, out_rx) = tmpsc::channel::<std::result::Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let _slot = slot;
        let object = if kind == Kind::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = |delta: Value, finish: Value| -> SseEvent {
            let choice = match kind {
                Kind::Chat => json!({"index": 0, "delta": delta, "finish_reason": finish}),
                Kind::Completion => {
                    json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": null, "finish_reason": finish})
                }
            };
            SseEvent::default().data(
                json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]})
                    .to_string(),
            )
        };
        if kind == Kind::Chat
            && out
                .send(Ok(chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                )))
                .await
                .is_err()
        {
            return;
        }
        let mut ev = Some(first);
        while let Some(e) = ev {
            match e {
                Event::Text(t) => {
                    if out
                        .send(Ok(chunk(json!({"content": t}), Value::Null)))
                        .await
                        .is_err()
                    {
                        return; // Client gone: dropping `rx` stops the sequence.
                    }
                }
                Event::Done {
                    finish,
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                } => {
                    let _ = out
                        .send(Ok(chunk(json!({}), json!(finish_reason(finish)))))
                        .await;
                    if include_usage {
                        let usage = json!({
                            "id": id, "object": object, "created": created, "model": model, "choices": [],
                            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                      "total_tokens": prompt_tokens + completion_tokens,
                                      "prompt_tokens_details": {"cached_tokens": cached_tokens}},
                        });
                        let _ = out
                            .send(Ok(SseEvent::default().data(usage.to_string())))
                            .await;
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
            ev = rx.recv().await;
        }
    });
    Sse::new(ReceiverStream::new(out_rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn chat(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    generate(s, headers, body, Kind::Chat).await
}

async fn completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    generate(s, headers, body, Kind::Completion).await
}

async fn models(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Some(r) = check_auth(&s, &headers) {
        return r;
    }
    axum::Json(json!({"object": "list", "data": [
        {"id": s.cfg.model_id, "object": "model", "created": 0, "owned_by": "mlex"}
    ]}))
    .into_response()
}

async fn health(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Some(r) = check_auth(&s, &headers) {
        return r;
    }
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn metrics_text(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Some(r) = check_auth(&s, &headers) {
        return r;
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such endpoint",
    )
}

/// Stops a running [`serve`] from any thread (the process's signal
/// thread): the server stops accepting, finishes the requests in flight
/// (at most `ServeConfig::shutdown_timeout`) and returns.
#[derive(Clone, Default)]
pub struct Shutdown {
    inner: Arc<ShutdownState>,
}

#[derive(Default)]
struct ShutdownState {
    notify: tokio::sync::Notify,
    serving: std::sync::atomic::AtomicBool,
}

impl Shutdown {
    /// Asks the server to drain and stop. Returns false when it is not
    /// serving (still loading, or done): nothing will act on the request,
    /// so the caller should end the process itself.
    pub fn request(&self) -> bool {
        if self.inner.serving.load(Ordering::SeqCst) {
            self.inner.notify.notify_one();
            true
        } else {
            false
        }
    }
}

/// Loads the model on the engine thread (with `load`), binds, and serves
/// until `stop` is requested; returns when in-flight requests are done.
pub fn serve(
    cfg: ServeConfig,
    load: Box<dyn FnOnce() -> Result<Loaded> + Send>,
    stop: Shutdown,
) -> Result<()> {
    let metrics = Arc::new(Metrics::default());
    let (jobs, rx) = mpsc::channel::<Msg>();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(usize, Option<usize>)>>();
    let engine_metrics = metrics.clone();
    let batch = cfg.batch;
    let cache_bytes = cfg.prompt_cache_bytes;
    let engine = std::thread::spawn(move || -> Result<()> {
        let loaded = match load() {
            Ok(l) => l,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return Ok(());
            }
        };
        let m = &loaded.generator.model;
        let _ = ready_tx.send(Ok((m.vocab_size() as usize, m.max_context)));
        let mut generator = loaded.generator;
        generator.prompt_cache = mlex_generate::PromptCache::new(64, cache_bytes);
        engine::run(generator, loaded.tokenizer, batch, rx, engine_metrics)
    });
    let (vocab, max_context) = ready_rx
        .recv()
        .map_err(|_| Error::Other("the engine thread ended while loading".into()))??;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::Other(format!("starting the server runtime: {e}")))?;
    let timeout = cfg.shutdown_timeout;
    let state = Arc::new(AppState {
        cfg: cfg.clone(),
        jobs: jobs.clone(),
        metrics,
        in_flight: AtomicUsize::new(0),
        vocab,
        max_context,
        next_id: AtomicU64::new(0),
    });
    let cancel = jobs.clone();
    let served = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
            .await
            .map_err(|e| Error::invalid("host/port", format!("{}:{}: {e}", cfg.host, cfg.port)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Other(format!("bound address: {e}")))?;
        eprintln!(
            "mlex serve: {} on http://{addr}/v1 (batch {}, queue {})",
            cfg.model_id, cfg.batch, cfg.max_queue
        );
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/v1/completions", post(completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics_text))
            .fallback(not_found)
            .with_state(state);
        stop.inner.serving.store(true, Ordering::SeqCst);
        let stopping = stop.clone();
        let shutdown = async move {
            stopping.inner.notify.notified().await;
            eprintln!(
                "mlex serve: stopping; finishing requests in flight (at most {} s)",
                timeout.as_secs()
            );
            let _ = cancel.send(Msg::Drain);
            tokio::spawn(async move {
                tokio::time::sleep(timeout).await;
                let _ = cancel.send(Msg::CancelAll);
            });
        };
        // Tokens go out as small writes; with Nagle's algorithm each would
        // wait for the client's delayed ACK (40 ms on Linux).
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(|e| Error::Other(format!("server: {e}")));
        stop.inner.serving.store(false, Ordering::SeqCst);
        served
    });
    let _ = jobs.send(Msg::Drain);
    drop(jobs);
    let engine = engine
        .join()
        .map_err(|_| Error::Other("the engine thread panicked".into()))?;
    served?;
    engine
}
