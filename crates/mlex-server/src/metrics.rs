//! `GET /metrics`: the server's counters in the Prometheus text format
//! (OpenMetrics, through `prometheus-client`).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Every metric the server exports.
#[derive(Default)]
pub struct Metrics {
    /// Requests received on the generation endpoints.
    pub requests: Counter,
    /// Requests answered 4xx (bad body, auth) or 503 (queue full).
    pub rejected: Counter,
    /// Sequences stopped because their client went away.
    pub cancelled: Counter,
    /// Requests waiting to join the batch.
    pub queue_depth: Gauge,
    /// Sequences decoding now.
    pub active: Gauge,
    /// Prompt tokens computed by prefill.
    pub prefill_computed: Counter,
    /// Prompt tokens restored from the prompt cache instead.
    pub prefill_reused: Counter,
    /// Tokens generated.
    pub generated: Counter,
    /// Tokens per second of the last batched step, all sequences together.
    pub decode_rate: Gauge<f64, AtomicU64>,
    /// Speculative verify forwards of finished requests.
    pub speculative_rounds: Counter,
    /// Draft tokens they proposed.
    pub draft_proposed: Counter,
    /// Draft tokens the model accepted.
    pub draft_accepted: Counter,
}

impl Metrics {
    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut r = Registry::with_prefix("mlex");
        r.register(
            "requests",
            "Generation requests received",
            self.requests.clone(),
        );
        r.register(
            "rejected",
            "Requests answered 4xx or 503",
            self.rejected.clone(),
        );
        r.register(
            "cancelled",
            "Sequences stopped because their client disconnected",
            self.cancelled.clone(),
        );
        r.register(
            "queue_depth",
            "Requests waiting to join the batch",
            self.queue_depth.clone(),
        );
        r.register(
            "active_sequences",
            "Sequences decoding now",
            self.active.clone(),
        );
        r.register(
            "prefill_tokens_computed",
            "Prompt tokens computed by prefill",
            self.prefill_computed.clone(),
        );
        r.register(
            "prefill_tokens_reused",
            "Prompt tokens restored from the prompt cache",
            self.prefill_reused.clone(),
        );
        r.register(
            "generated_tokens",
            "Tokens generated",
            self.generated.clone(),
        );
        r.register(
            "speculative_rounds",
            "Speculative verify forwards of finished requests",
            self.speculative_rounds.clone(),
        );
        r.register(
            "draft_tokens_proposed",
            "Draft tokens proposed for finished requests",
            self.draft_proposed.clone(),
        );
        r.register(
            "draft_tokens_accepted",
            "Draft tokens the model accepted for finished requests",
            self.draft_accepted.clone(),
        );
        r.register(
            "decode_tokens_per_second",
            "Aggregate tok/s of the last batched step",
            self.decode_rate.clone(),
        );
        let mut out = String::new();
        let _ = encode(&mut out, &r);
        out
    }
}
