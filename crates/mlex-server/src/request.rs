//! A parsed request body checked and turned into an engine [`Job`]'s
//! parts and the shape of its answer; every refusal names its field.

use crate::api::{
    ChatMessage, ChatRequest, Common, CompletionRequest, Content, ResponseFormat, Tool, ToolChoice,
};
use crate::engine::Prompt;
use crate::{AppState, Kind, ModelInfo};
use axum::http::StatusCode;
use mlex_generate::{
    FunctionCall, GenerateOptions, Grammar, Message, RenderOptions, SamplerConfig, ToolCall,
    ToolDef, ToolFormat,
};
use serde_json::{json, Value};

/// Why a request is refused: its status and a message naming the field.
pub struct Refusal(pub StatusCode, pub String);

impl Refusal {
    pub(crate) fn bad(message: impl Into<String>) -> Refusal {
        Refusal(StatusCode::BAD_REQUEST, message.into())
    }
}

type Checked<T> = std::result::Result<T, Refusal>;

/// How the model's tool calls are read from its text.
#[derive(Clone)]
pub struct ToolParsing {
    /// The format the template teaches.
    pub format: ToolFormat,
    /// The functions offered (their schemas type the XML form's values).
    pub tools: Vec<ToolDef>,
    /// Keep every call (else the first only).
    pub parallel: bool,
}

/// What the answer looks like.
#[derive(Clone)]
pub struct Shape {
    /// Chat or text completion.
    pub kind: Kind,
    /// Server-sent events.
    pub stream: bool,
    /// A last chunk with the usage.
    pub include_usage: bool,
    /// Read tool calls out of the text.
    pub tools: Option<ToolParsing>,
    /// Split `<think>` blocks off as `reasoning_content`.
    pub reasoning: bool,
    /// Log-probabilities with this many alternatives.
    pub logprobs: Option<usize>,
}

/// A checked request.
pub struct Prepared {
    /// The prompt.
    pub prompt: Prompt,
    /// Length and sampling.
    pub opts: GenerateOptions,
    /// Stop strings.
    pub stops: Vec<String>,
    /// The grammar of a constrained answer, and the field it comes from.
    pub grammar: Option<(Grammar, &'static str)>,
    /// The answer's shape.
    pub shape: Shape,
}

/// The most alternatives per token a request may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The chat roles accepted (`developer` is OpenAI's newer `system`).
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Template variables a request's `chat_template_kwargs` may not replace.
const RESERVED: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// The generation options shared by both endpoints, or the refusal that
/// names the field.
fn options(
    s: &AppState,
    c: &Common,
    max_tokens: Option<usize>,
) -> Checked<(GenerateOptions, Vec<String>)> {
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
    if let Some(ctx) = s.info.max_context {
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
    let penalty = |name: &str, v: Option<f32>| -> Checked<f32> {
        let v = v.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&v) {
            return Err(Refusal::bad(format!("`{name}` {v} must be in [-2, 2]")));
        }
        Ok(v)
    };
    let presence = penalty("presence_penalty", c.presence_penalty)?;
    let frequency = penalty("frequency_penalty", c.frequency_penalty)?;
    let mut logit_bias = Vec::new();
    for (k, b) in c.logit_bias.iter().flatten() {
        let id: u32 = k
            .parse()
            .map_err(|_| Refusal::bad(format!("`logit_bias` key `{k}` is not a token id")))?;
        if id as usize >= s.info.vocab {
            return Err(Refusal::bad(format!(
                "`logit_bias` token {id} is outside the vocabulary of {}",
                s.info.vocab
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
        presence_penalty: presence,
        frequency_penalty: frequency,
        logit_bias,
        seed: c.seed,
        ..d
    };
    let opts = GenerateOptions {
        max_tokens,
        sampler,
        ..Default::default()
    };
    Ok((
        opts,
        c.stop
            .clone()
            .map(crate::api::Stop::into_vec)
            .unwrap_or_default(),
    ))
}

/// A request's `response_format` as a grammar, if it asks for one.
fn response_grammar(c: &Common) -> Checked<Option<(Grammar, &'static str)>> {
    Ok(c.response_format
        .as_ref()
        .map(format_grammar)
        .transpose()?
        .flatten())
}

/// `response_format` as a grammar (`text`: none), with the field it comes
/// from.
fn format_grammar(f: &ResponseFormat) -> Checked<Option<(Grammar, &'static str)>> {
    match f.kind.as_str() {
        "text" => Ok(None),
        "json_object" => Ok(Some((
            Grammar::JsonSchema(json!({"type": "object"})),
            "response_format",
        ))),
        "json_schema" => {
            let js = f.json_schema.as_ref().ok_or_else(|| {
                Refusal::bad("`response_format.json_schema`: required with `type` `json_schema`")
            })?;
            let schema = js.schema.clone().unwrap_or_else(|| json!({}));
            if !schema.is_object() && schema != json!(true) {
                return Err(Refusal::bad(
                    "`response_format.json_schema.schema`: must be a JSON schema object",
                ));
            }
            Ok(Some((
                Grammar::JsonSchema(schema),
                "response_format.json_schema.schema",
            )))
        }
        other => Err(Refusal::bad(format!(
            "`response_format.type`: `{other}` is not one of text, json_object, json_schema"
        ))),
    }
}

/// The text of a message's content.
fn content_text(i: usize, c: &Option<Content>) -> Checked<String> {
    match c {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (Some("text"), _) => {
                        return Err(Refusal::bad(format!(
                            "`messages[{i}].content[{j}].text`: a text part needs a string `text`"
                        )))
                    }
                    (t, _) => {
                        return Err(Refusal::bad(format!(
                        "`messages[{i}].content[{j}].type`: {} is not supported (only text parts)",
                        t.map(|t| format!("`{t}`"))
                            .unwrap_or("a missing type".into())
                    )))
                    }
                }
            }
            Ok(text)
        }
    }
}

/// One message as the template sees it.
fn message(i: usize, m: &ChatMessage) -> Checked<Message> {
    if !ROLES.contains(&m.role.as_str()) {
        return Err(Refusal::bad(format!(
            "`messages[{i}].role`: `{}` is not one of {}",
            m.role,
            ROLES.join(", ")
        )));
    }
    let role = if m.role == "developer" {
        "system"
    } else {
        m.role.as_str()
    };
    if m.content.is_none() && !(role == "assistant" && m.tool_calls.is_some()) {
        return Err(Refusal::bad(format!(
            "`messages[{i}].content`: required (only an assistant turn with `tool_calls` may leave it out)"
        )));
    }
    let mut out = Message::new(role, &content_text(i, &m.content)?);
    if role == "tool" {
        let id = m.tool_call_id.as_ref().ok_or_else(|| {
            Refusal::bad(format!(
                "`messages[{i}].tool_call_id`: required in a `tool` message (the id of the call it answers)"
            ))
        })?;
        out.tool_call_id = Some(id.clone());
    } else if m.tool_call_id.is_some() {
        return Err(Refusal::bad(format!(
            "`messages[{i}].tool_call_id`: only a `tool` message has one"
        )));
    }
    out.name = m.name.clone();
    out.reasoning_content = m.reasoning_content.clone().or_else(|| m.reasoning.clone());
    for (j, c) in m.tool_calls.iter().flatten().enumerate() {
        if role != "assistant" {
            return Err(Refusal::bad(format!(
                "`messages[{i}].tool_calls`: only an assistant message has them"
            )));
        }
        let at = format!("messages[{i}].tool_calls[{j}]");
        if c.kind.as_deref().is_some_and(|k| k != "function") {
            return Err(Refusal::bad(format!("`{at}.type`: must be `function`")));
        }
        // Templates iterate the arguments or write them with tojson: an
        // object, as mlx-lm and vLLM pass them.
        let arguments = match &c.function.arguments {
            Value::String(s) => serde_json::from_str::<Value>(s).map_err(|e| {
                Refusal::bad(format!("`{at}.function.arguments`: not a JSON object: {e}"))
            })?,
            v => v.clone(),
        };
        if !arguments.is_object() {
            return Err(Refusal::bad(format!(
                "`{at}.function.arguments`: must be a JSON object"
            )));
        }
        out.tool_calls.push(ToolCall {
            id: c.id.clone(),
            kind: "function".into(),
            function: FunctionCall {
                name: c.function.name.clone(),
                arguments,
            },
        });
    }
    Ok(out)
}

/// The tools of a request, checked: each a function with a name and an
/// object schema.
fn tool_defs(tools: &[Value]) -> Checked<Vec<ToolDef>> {
    let mut defs: Vec<ToolDef> = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let tool: Tool = crate::parse_value(t)
            .map_err(|e| Refusal::bad(format!("`tools[{i}]{}", e.trim_start_matches('`'))))?;
        let at = format!("tools[{i}]");
        if tool.kind != "function" {
            return Err(Refusal::bad(format!("`{at}.type`: must be `function`")));
        }
        let name = &tool.function.name;
        let good = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
        if !good {
            return Err(Refusal::bad(format!(
                "`{at}.function.name`: `{name}` must be 1-64 letters, digits, `_`, `-` or `.`"
            )));
        }
        if defs.iter().any(|d| &d.name == name) {
            return Err(Refusal::bad(format!(
                "`{at}.function.name`: `{name}` is offered twice"
            )));
        }
        let params = tool
            .function
            .parameters
            .clone()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        check_parameters(&format!("{at}.function.parameters"), &params)?;
        defs.push(ToolDef {
            name: name.clone(),
            parameters: params,
        });
    }
    Ok(defs)
}

/// A function's parameters must be an object schema.
fn check_parameters(at: &str, p: &Value) -> Checked<()> {
    let Some(o) = p.as_object() else {
        return Err(Refusal::bad(format!(
            "`{at}`: must be a JSON schema object"
        )));
    };
    if let Some(t) = o.get("type") {
        if t != "object" {
            return Err(Refusal::bad(format!(
                "`{at}.type`: must be `object`, not {t}"
            )));
        }
    }
    if let Some(props) = o.get("properties") {
        let Some(props) = props.as_object() else {
            return Err(Refusal::bad(format!(
                "`{at}.properties`: must be an object"
            )));
        };
        for (k, v) in props {
            if !v.is_object() && !v.is_boolean() {
                return Err(Refusal::bad(format!(
                    "`{at}.properties.{k}`: must be a schema object"
                )));
            }
        }
    }
    if let Some(r) = o.get("required") {
        let names = r.as_array().filter(|a| a.iter().all(Value::is_string));
        if names.is_none() {
            return Err(Refusal::bad(format!(
                "`{at}.required`: must be a list of property names"
            )));
        }
    }
    Ok(())
}

/// A chat request, checked.
pub fn chat(s: &AppState, r: ChatRequest) -> Checked<Prepared> {
    if r.messages.is_empty() {
        return Err(Refusal::bad("`messages` is empty"));
    }
    let messages = r
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Checked<Vec<_>>>()?;
    let max = r.max_completion_tokens.or(r.common.max_tokens);
    let (mut opts, stops) = options(s, &r.common, max)?;
    let info: &ModelInfo = &s.info;
    let mut extra = r.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(k) = RESERVED.iter().find(|k| extra.contains_key(**k)) {
        return Err(Refusal::bad(format!(
            "`chat_template_kwargs.{k}`: set by the server, not by a request"
        )));
    }
    let tools = r.tools.clone().filter(|t| !t.is_empty());
    let mut render = RenderOptions::default();
    let mut parsing = None;
    let mut grammar = response_grammar(&r.common)?;
    if let Some(list) = &tools {
        let defs = tool_defs(list)?;
        let choice = r
            .tool_choice
            .clone()
            .unwrap_or(ToolChoice::Mode("auto".into()));
        let named =
            match &choice {
                ToolChoice::Mode(m) if ["none", "auto", "required"].contains(&m.as_str()) => None,
                ToolChoice::Mode(m) => {
                    return Err(Refusal::bad(format!(
                    "`tool_choice`: `{m}` is not one of none, auto, required or a named function"
                )))
                }
                ToolChoice::Named(n) => {
                    if n.kind != "function" {
                        return Err(Refusal::bad("`tool_choice.type`: must be `function`"));
                    }
                    let Some(d) = defs.iter().find(|d| d.name == n.function.name) else {
                        return Err(Refusal::bad(format!(
                        "`tool_choice.function.name`: `{}` is not among the request's tools ({})",
                        n.function.name,
                        defs.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ")
                    )));
                    };
                    Some(d.clone())
                }
            };
        let forced = named.is_some() || matches!(&choice, ToolChoice::Mode(m) if m == "required");
        if !matches!(&choice, ToolChoice::Mode(m) if m == "none") {
            if !info.supports_tools {
                return Err(Refusal::bad(
                    "`tools`: this model's chat template does not render tools, so it cannot call them",
                ));
            }
            let format = info.tool_format.ok_or_else(|| {
                Refusal::bad(format!(
                    "`tools`: mlex knows no tool-call format for this model's chat template (set `tool_parser_type` in tokenizer_config.json to one of {})",
                    ToolFormat::ALL.map(ToolFormat::name).join(", ")
                ))
            })?;
            let parallel = r.parallel_tool_calls.unwrap_or(true);
            if forced {
                if grammar.is_some() {
                    return Err(Refusal::bad(
                        "`response_format`: cannot be combined with a `tool_choice` that forces a call",
                    ));
                }
                let offered = named.map(|d| vec![d]).unwrap_or_else(|| defs.clone());
                grammar = Some((
                    Grammar::Lark(format.call_grammar(&offered, parallel)),
                    "tools",
                ));
            }
            render.tools = Some(Value::Array(list.clone()));
            parsing = Some(ToolParsing {
                format,
                tools: defs,
                parallel,
            });
        }
    } else if r.tool_choice.is_some() {
        return Err(Refusal::bad("`tool_choice`: given without `tools`"));
    }
    render.extra = std::mem::take(&mut extra);
    let logprobs = match (r.logprobs, r.top_logprobs) {
        (_, Some(n)) if n > MAX_TOP_LOGPROBS => {
            return Err(Refusal::bad(format!(
                "`top_logprobs` {n} must be at most {MAX_TOP_LOGPROBS}"
            )))
        }
        (false, Some(_)) => return Err(Refusal::bad("`top_logprobs`: needs `logprobs` true")),
        (true, n) => Some(n.unwrap_or(0)),
        (false, None) => None,
    };
    opts.logprobs = logprobs;
    Ok(Prepared {
        prompt: Prompt::Chat(messages, render),
        opts,
        stops,
        grammar,
        shape: Shape {
            kind: Kind::Chat,
            stream: r.common.stream,
            include_usage: r.common.stream_options.is_some_and(|o| o.include_usage),
            tools: parsing,
            reasoning: info.has_thinking,
            logprobs,
        },
    })
}

/// A text completion request, checked.
pub fn completion(s: &AppState, r: CompletionRequest) -> Checked<Prepared> {
    let (mut opts, stops) = options(s, &r.common, r.common.max_tokens)?;
    if let Some(n) = r.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
        return Err(Refusal::bad(format!(
            "`logprobs` {n} must be at most {MAX_TOP_LOGPROBS}"
        )));
    }
    opts.logprobs = r.logprobs;
    let grammar = response_grammar(&r.common)?;
    Ok(Prepared {
        prompt: Prompt::Text(r.prompt),
        opts,
        stops,
        grammar,
        shape: Shape {
            kind: Kind::Completion,
            stream: r.common.stream,
            include_usage: r.common.stream_options.is_some_and(|o| o.include_usage),
            tools: None,
            reasoning: false,
            logprobs: r.logprobs,
        },
    })
}
