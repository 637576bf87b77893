//! Chat templates (Jinja, as in Hugging Face `tokenizer_config.json` or the
//! GGUF `tokenizer.chat_template`) rendered with minijinja, with Python
//! string methods (`.strip()`, `.startswith()`, ...), the helpers HF
//! templates call (`raise_exception`, `strftime_now`) and a `tojson` that
//! writes what Python's `json.dumps` writes (transformers' filter): the
//! same prompt, token for token, as `apply_chat_template`.
//!
//! Messages carry what agent clients send: assistant tool calls (their
//! arguments as a JSON object, which templates iterate or `tojson`), tool
//! results with the call's id, and the reasoning of earlier turns. The
//! tools and any extra template arguments (`enable_thinking`, ...) are
//! [`RenderOptions`].

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use mlex_core::error::{Error, Result};
use serde::Serialize;

/// A function call an assistant turn made.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ToolCall {
    /// The call's id (`call_...`), which the tool's answer names.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// The function of a [`ToolCall`].
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments: a JSON object (templates iterate it or write it
    /// with `tojson`).
    pub arguments: serde_json::Value,
}

/// One chat message.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (empty when an assistant turn only calls tools).
    pub content: String,
    /// An earlier assistant turn's reasoning, when the client sends it
    /// apart from the content.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// An assistant turn's tool calls.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool result's call id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name, when the client gives it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message with a role and a text.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_owned(),
            content: content.to_owned(),
            ..Default::default()
        }
    }
}

/// What a render passes to the template besides the messages.
#[derive(Clone, Debug, Default)]
pub struct RenderOptions {
    /// End with the opening of the assistant's turn.
    pub add_generation_prompt: bool,
    /// The tools (OpenAI's `tools` list), if any.
    pub tools: Option<serde_json::Value>,
    /// Extra template variables (`chat_template_kwargs`, e.g.
    /// `enable_thinking`); they cannot replace the ones above.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: Option<String>,
    eos: Option<String>,
    /// Where the template came from, for errors.
    origin: String,
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(_format: String) -> String {
    // Templates use it for a date line; a fixed, explicit value keeps
    // rendering deterministic (and cached prefixes stable across turns).
    "26 Jul 2024".to_owned()
}

/// Python's `json.dumps(value, ensure_ascii=False)` (with `indent`, as
/// transformers' `tojson` filter): `", "` and `": "` separators, keys in
/// their order, nothing escaped for HTML (minijinja's own `tojson` is
/// compact and escapes `<`, `>`, `&` and `'`, which changes the prompt).
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => out.push_str(&json_string(v.as_str().unwrap_or_default())),
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
            // A map iterates over its keys; each item is `"key": value`.
            let map = v.kind() == ValueKind::Map;
            let (open, close) = if map { ('{', '}') } else { ('[', ']') };
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push(open);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let value = if map {
                    let key = item
                        .as_str()
                        .map_or_else(|| item.to_string(), str::to_owned);
                    out.push_str(&json_string(&key));
                    out.push_str(": ");
                    v.get_item(item)?
                } else {
                    item.clone()
                };
                write_json(&value, indent, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(close);
        }
        _ => out.push_str(&json_string(&v.to_string())),
    }
    Ok(())
}

/// A string as `json.dumps(..., ensure_ascii=False)` writes it.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A float as Python's `repr` writes it (`1.0`, `0.1`, `1e-07`).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let s = format!("{f:?}");
    // Rust's Debug form is the shortest round trip, as Python's repr; they
    // differ only in exponents (Rust `1e-7`, Python `1e-07`).
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = match e.strip_prefix('-') {
                Some(d) => ("-", d),
                None => ("+", e),
            };
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos`/`eos` are exposed as `bos_token`/`eos_token`.
    pub fn new(source: &str, bos: Option<String>, eos: Option<String>) -> Result<Self> {
        Self::from_origin("the chat template", source, bos, eos)
    }

    /// [`new`](Self::new) for a template read from `origin` (a file and
    /// key), which compile and render errors name.
    pub fn from_origin(
        origin: &str,
        source: &str,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| Error::Other(format!("{origin} does not compile: {e}")))?;
        Ok(Self {
            env,
            source: source.to_owned(),
            bos,
            eos,
            origin: origin.to_owned(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// True when the template renders a `tools` list (the tool-calling
    /// templates of Qwen, Llama 3, Mistral, Nemotron, ... all read it).
    pub fn supports_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// Renders `messages`, ending with the assistant's turn opening when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(
            messages,
            &RenderOptions {
                add_generation_prompt,
                ..Default::default()
            },
        )
    }

    /// Renders `messages` with tools and extra template variables.
    pub fn render_with(&self, messages: &[Message], opts: &RenderOptions) -> Result<String> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| Error::Other(format!("{}: {e}", self.origin)))?;
        let mut ctx: std::collections::BTreeMap<String, Value> = opts
            .extra
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(opts.add_generation_prompt),
        );
        ctx.insert(
            "bos_token".into(),
            Value::from(self.bos.clone().unwrap_or_default()),
        );
        ctx.insert(
            "eos_token".into(),
            Value::from(self.eos.clone().unwrap_or_default()),
        );
        ctx.insert(
            "tools".into(),
            match &opts.tools {
                Some(t) => Value::from_serialize(t),
                None => Value::UNDEFINED,
            },
        );
        t.render(Value::from_serialize(&ctx))
            .map_err(|e| Error::Other(format!("{} failed to render: {e}", self.origin)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'].strip() + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_renders_with_default_system_and_python_methods() {
        let t = ChatTemplate::new(CHATML, None, None).unwrap();
        let out = t
            .render(&[Message::new("user", "  Hi there ")], true)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn explicit_system_prompt_replaces_the_default() {
        let t = ChatTemplate::new(CHATML, None, None).unwrap();
        let out = t
            .render(
                &[
                    Message::new("system", "Be brief."),
                    Message::new("user", "Q"),
                ],
                false,
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
        );
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t =
            ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", None, None).unwrap();
        let x: serde_json::Value = serde_json::from_str(
            r#"{"b": [1, 2.5, 1e-7, true, null], "a": "<é\n\"q\">", "e": {}}"#,
        )
        .unwrap();
        let mut extra = serde_json::Map::new();
        extra.insert("x".into(), x);
        let out = t
            .render_with(
                &[],
                &RenderOptions {
                    extra,
                    ..Default::default()
                },
            )
            .unwrap();
        // json.dumps(x, ensure_ascii=False) and json.dumps(x, ensure_ascii=False, indent=2)
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, 1e-07, true, null], \"a\": \"<é\\n\\\"q\\\">\", \"e\": {}}|{\n  \"b\": [\n    1,\n    2.5,\n    1e-07,\n    true,\n    null\n  ],\n  \"a\": \"<é\\n\\\"q\\\">\",\n  \"e\": {}\n}"
        );
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", None, None).unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }
}
