//! The OpenAI request bodies mlex accepts, typed. Unknown fields are a 400
//! naming the field (serde's `deny_unknown_fields`): a client never gets a
//! silently ignored option. Honoured: `model`, `messages` / `prompt`,
//! `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k`,
//! `min_p`, `repetition_penalty`, `presence_penalty`, `frequency_penalty`,
//! `stop`, `seed`, `stream`, `stream_options.include_usage`, `n` (1 only),
//! `logit_bias`, `logprobs` / `top_logprobs`, `tools`, `tool_choice`,
//! `parallel_tool_calls`, `chat_template_kwargs`, `response_format`.
//! Accepted and ignored (the `openai` client sends them back with an
//! earlier answer): a message's `refusal` and `annotations`, and `user`.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// One chat message.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text: a string, a list of text parts, or null (an assistant
    /// turn that only calls tools).
    pub content: Option<Content>,
    /// An assistant turn's tool calls.
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// A tool result's call id.
    pub tool_call_id: Option<String>,
    /// A tool result's (or a participant's) name.
    pub name: Option<String>,
    /// An earlier turn's reasoning.
    pub reasoning_content: Option<String>,
    /// The same, as mlx-lm names it.
    pub reasoning: Option<String>,
    /// Sent back by clients with an earlier answer; ignored.
    #[serde(rename = "refusal")]
    pub _refusal: Option<IgnoredAny>,
    /// Likewise.
    #[serde(rename = "annotations")]
    pub _annotations: Option<IgnoredAny>,
}

/// A message's content.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Parts; only `{"type": "text", "text": ...}` ones are accepted.
    Parts(Vec<Value>),
}

/// An assistant message's tool call.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallIn {
    /// Its id.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// The function called.
    pub function: FunctionCallIn,
    /// Position in a streamed answer (ignored).
    #[serde(rename = "index")]
    pub _index: Option<IgnoredAny>,
}

/// The function of a [`ToolCallIn`].
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCallIn {
    /// The function's name.
    pub name: String,
    /// Its arguments: a JSON string (as OpenAI sends them) or an object.
    pub arguments: Value,
}

/// One entry of `tools`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function offered.
    pub function: FunctionDef,
}

/// A function offered to the model.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionDef {
    /// Its name.
    pub name: String,
    /// What it does.
    #[serde(rename = "description")]
    pub _description: Option<IgnoredAny>,
    /// Its parameters' JSON schema.
    pub parameters: Option<Value>,
    /// OpenAI's strict mode (calls forced by a grammar are strict anyway).
    #[serde(rename = "strict")]
    pub _strict: Option<IgnoredAny>,
}

/// `tool_choice`: `none`, `auto`, `required`, or a named function.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    /// `none`, `auto` or `required`.
    Mode(String),
    /// `{"type": "function", "function": {"name": ...}}`.
    Named(NamedTool),
}

/// A named function in `tool_choice`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedTool {
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: NamedFunction,
}

/// The function of a [`NamedTool`].
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedFunction {
    /// Its name.
    pub name: String,
}

/// `response_format`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    /// With `json_schema`.
    pub json_schema: Option<JsonSchemaFormat>,
}

/// `response_format.json_schema`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    /// The schema's name (required, unused).
    #[serde(rename = "name")]
    pub _name: IgnoredAny,
    /// What it is for.
    #[serde(rename = "description")]
    pub _description: Option<IgnoredAny>,
    /// The schema.
    pub schema: Option<Value>,
    /// OpenAI's strict mode (the grammar is always strict).
    #[serde(rename = "strict")]
    pub _strict: Option<IgnoredAny>,
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
    /// Subtracted once from each recent token's logit, in [-2, 2].
    pub presence_penalty: Option<f32>,
    /// Subtracted per occurrence in the recent tokens, in [-2, 2].
    pub frequency_penalty: Option<f32>,
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
    /// The end user (ignored).
    #[serde(rename = "user")]
    pub _user: Option<IgnoredAny>,
    /// The answer's shape: text, any JSON object, or a JSON schema.
    pub response_format: Option<ResponseFormat>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Newer name of `max_tokens`.
    pub max_completion_tokens: Option<usize>,
    /// Functions the model may call, as sent (the template gets them
    /// unchanged); checked against [`Tool`].
    pub tools: Option<Vec<Value>>,
    /// Whether and which tool to call.
    pub tool_choice: Option<ToolChoice>,
    /// Allow more than one call in an answer (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Extra variables for the chat template (`enable_thinking`, ...).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Return each token's log-probability.
    #[serde(default)]
    pub logprobs: bool,
    /// With `logprobs`, this many alternatives per token (0-20).
    pub top_logprobs: Option<usize>,
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
    /// Return each token's log-probability with this many alternatives
    /// (0-20).
    pub logprobs: Option<usize>,
    /// Everything else.
    #[serde(flatten)]
    pub common: Common,
}
