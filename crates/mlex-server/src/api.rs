//! The OpenAI request bodies mlex accepts, typed. Unknown fields are a 400
//! naming the field (serde's `deny_unknown_fields`): a client never gets a
//! silently ignored option. Honoured: `model`, `messages` / `prompt`,
//! `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k`,
//! `min_p`, `repetition_penalty`, `stop`, `seed`, `stream`,
//! `stream_options.include_usage`, `n` (1 only), `logit_bias`.

use serde::Deserialize;
use std::collections::BTreeMap;

/// One chat message.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// `stop`: one string or several.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and length fields both endpoints share.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Common {
    /// Must name the served model (or be left out).
    pub model: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<usize>,
    /// Temperature; 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens.
    pub top_k: Option<usize>,
    /// Drop tokens below min_p times the top probability.
    pub min_p: Option<f32>,
    /// Penalty on recent tokens.
    pub repetition_penalty: Option<f32>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Sampling seed.
    pub seed: Option<u64>,
    /// Server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Completions per request (only 1).
    pub n: Option<usize>,
    /// Token id (as a string) to bias.
    pub logit_bias: Option<BTreeMap<String, f32>>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Newer name of `max_tokens`.
    pub max_completion_tokens: Option<usize>,
    /// Everything else.
    #[serde(flatten)]
    pub common: Common,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    /// The raw prompt (no chat template).
    pub prompt: String,
    /// Everything else.
    #[serde(flatten)]
    pub common: Common,
}
