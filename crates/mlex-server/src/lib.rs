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
mod replicas;
mod request;
mod respond;

pub use replicas::follow;

use api::{ChatRequest, CompletionRequest};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use engine::{Event, Job, Msg};
use metrics::Metrics;
use mlex_core::error::{Error, Result};
use mlex_generate::{Finish, Generator, Tokenizer, ToolFormat};
use request::Refusal;
use serde_json::json;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc as tmpsc;
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
    /// Speculative decoding for the requests that allow it (`--lookup`,
    /// `--draft-model`), made on the engine thread.
    pub speculation: Option<mlex_generate::BatchSpeculation>,
}

/// What the HTTP side knows of the model, read on the engine thread.
#[derive(Clone, Debug)]
pub(crate) struct ModelInfo {
    /// Output width.
    pub vocab: usize,
    /// Longest context, if the config says.
    pub max_context: Option<usize>,
    /// The chat template renders `tools`.
    pub supports_tools: bool,
    /// How its tool calls are written (`tool_parser_type`, else the
    /// template).
    pub tool_format: Option<ToolFormat>,
    /// The vocabulary has `<think>` and `</think>`: answers may reason.
    pub has_thinking: bool,
}

impl ModelInfo {
    fn of(generator: &Generator, tok: &Tokenizer) -> ModelInfo {
        let m = &generator.model;
        let template = tok.chat_template.as_ref();
        let named = tok.tool_parser_type.as_deref().and_then(|n| {
            let f = ToolFormat::from_name(n);
            if f.is_none() {
                eprintln!(
                    "mlex serve: tokenizer_config.json: tool_parser_type `{n}` is not one of {}; reading the chat template instead",
                    ToolFormat::ALL.map(ToolFormat::name).join(", ")
                );
            }
            f
        });
        ModelInfo {
            vocab: m.vocab_size() as usize,
            max_context: m.max_context,
            supports_tools: template.is_some_and(|t| t.supports_tools()),
            tool_format: named.or_else(|| template.and_then(|t| ToolFormat::detect(t.source()))),
            has_thinking: tok.token_to_id(mlex_generate::THINK_START).is_some()
                && tok.token_to_id(mlex_generate::THINK_END).is_some(),
        }
    }
}

struct AppState {
    cfg: ServeConfig,
    jobs: mpsc::Sender<Msg>,
    metrics: Arc<Metrics>,
    in_flight: AtomicUsize,
    info: ModelInfo,
    next_id: AtomicU64,
}

/// Counts a request against the queue bound until it ends.
pub(crate) struct Slot(Arc<AppState>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(crate) fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body =
        json!({"error": {"message": message.into(), "type": kind, "param": null, "code": null}});
    (status, axum::Json(body)).into_response()
}

pub(crate) fn bad_request(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(crate) fn finish_reason(f: Finish) -> &'static str {
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

/// [`parse`] for a part of a body already read as JSON; the error starts
/// with the path inside it (`` `.function.name`: ... ``).
pub(crate) fn parse_value<T: serde::de::DeserializeOwned>(
    v: &serde_json::Value,
) -> std::result::Result<T, String> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            format!("`: {}", e.inner())
        } else {
            format!("`.{path}`: {}", e.inner())
        }
    })
}

/// Which response shape a request wants.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

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
    let prepared = match kind {
        Kind::Chat => parse::<ChatRequest>(&body).map(|r| request::chat(&s, r)),
        Kind::Completion => parse::<CompletionRequest>(&body).map(|r| request::completion(&s, r)),
    };
    let prepared = match prepared {
        Ok(Ok(p)) => p,
        Ok(Err(Refusal(status, msg))) => {
            s.metrics.rejected.inc();
            return error(status, "invalid_request_error", msg);
        }
        Err(e) => {
            s.metrics.rejected.inc();
            return bad_request(format!("request body: {e}"));
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
        prompt: prepared.prompt,
        opts: prepared.opts,
        stops: prepared.stops,
        grammar: prepared.grammar,
        events: tx,
    };
    if s.jobs.send(Msg::Job(Box::new(job))).is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_busy",
            "the engine has stopped",
        );
    }
    // The first event decides between a 400 and an answer.
    let in_reasoning = match rx.recv().await {
        Some(Event::Rejected(msg)) => {
            s.metrics.rejected.inc();
            return bad_request(msg);
        }
        Some(Event::Accepted { in_reasoning }) => in_reasoning,
        _ => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "the engine stopped",
            )
        }
    };
    let n = s.next_id.fetch_add(1, Ordering::SeqCst);
    respond::Answer {
        header: respond::Header::new(kind, n, s.cfg.model_id.clone()),
        shape: prepared.shape,
        in_reasoning,
        rx,
        slot,
    }
    .respond()
    .await
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
    let (ready_tx, ready_rx) = mpsc::channel::<Result<ModelInfo>>();
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
        let _ = ready_tx.send(Ok(ModelInfo::of(&loaded.generator, &loaded.tokenizer)));
        let mut loaded = loaded;
        loaded.generator.prompt_cache = mlex_generate::PromptCache::new(64, cache_bytes);
        engine::run(loaded, batch, rx, engine_metrics)
    });
    let info = ready_rx
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
        info,
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
