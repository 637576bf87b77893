//! Tool calls in model output: the formats the chat templates of the
//! architectures mlex runs teach their models, read back into calls, and
//! the grammar that forces a valid call (`tool_choice` `required` or a
//! named function, through [`crate::Grammar`]).
//!
//! The format is chosen as mlx-lm chooses its tool parser
//! (`mlx_lm/tokenizer_utils.py`, `_infer_tool_parser`): a
//! `tool_parser_type` in `tokenizer_config.json`, else marker strings in the
//! chat template, first match wins:
//!
//! | format | template holds | the model writes |
//! |---|---|---|
//! | [`ToolFormat::Qwen3Coder`] (Qwen3-Coder, Qwen3.5, Qwen3-Next, Nemotron 3) | `<tool_call>` then `<function=` | `<tool_call>\n<function=NAME>\n<parameter=P>\nV\n</parameter>\n</function>\n</tool_call>` |
//! | [`ToolFormat::NemotronJson`] (Nemotron-H Nano 2) | `<TOOLCALL>` | `<TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>` |
//! | [`ToolFormat::Hermes`] (Qwen2.5, Qwen3, Hermes) | `<tool_call>` and `tool_call.name` | `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` |
//! | [`ToolFormat::Llama3Json`] (Llama 3.1-3.3) | `<\|python_tag\|>` or `"parameters"` | `{"name": ..., "parameters": {...}}` as the whole answer |
//!
//! Text that fails to parse as a call is handed back as text, markers and
//! all: a client sees what the model wrote, never an error.

use serde_json::{json, Map, Value};

/// One function a client offers (`tools[i].function`).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolDef {
    /// The function's name.
    pub name: String,
    /// Its parameters' JSON schema (`{"type": "object", ...}`).
    pub parameters: Value,
}

/// A call read from the model's text.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCall {
    /// The function's name.
    pub name: String,
    /// Its arguments (a JSON object).
    pub arguments: Value,
}

/// How a model writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`.
    Hermes,
    /// `<tool_call>\n<function=NAME>\n<parameter=P>\nV\n</parameter>\n</function>\n</tool_call>`.
    Qwen3Coder,
    /// `<TOOLCALL>[{"name": ..., "arguments": ...}, ...]</TOOLCALL>`.
    NemotronJson,
    /// The whole answer is `{"name": ..., "parameters": ...}` (several
    /// separated by `;`).
    Llama3Json,
}

impl ToolFormat {
    /// Every format, for listing in errors.
    pub const ALL: [ToolFormat; 4] = [
        ToolFormat::Hermes,
        ToolFormat::Qwen3Coder,
        ToolFormat::NemotronJson,
        ToolFormat::Llama3Json,
    ];

    /// Its name (`tool_parser_type` in `tokenizer_config.json`; mlx-lm's
    /// module names where it has one).
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "json_tools",
            ToolFormat::Qwen3Coder => "qwen3_coder",
            ToolFormat::NemotronJson => "nemotron_json",
            ToolFormat::Llama3Json => "llama3_json",
        }
    }

    /// The format named `name`.
    pub fn from_name(name: &str) -> Option<ToolFormat> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The format a chat template teaches, if any.
    pub fn detect(template: &str) -> Option<ToolFormat> {
        if template.contains("<tool_call>\\n<function=")
            || template.contains("<tool_call>\n<function=")
        {
            Some(ToolFormat::Qwen3Coder)
        } else if template.contains("<TOOLCALL>") {
            Some(ToolFormat::NemotronJson)
        } else if template.contains("<tool_call>") && template.contains("tool_call.name") {
            Some(ToolFormat::Hermes)
        } else if template.contains("<|python_tag|>")
            || (template.contains("tools") && template.contains("\"parameters\""))
        {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The text that opens a call; `None` when the whole answer is one.
    fn start(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder => Some("<tool_call>"),
            ToolFormat::NemotronJson => Some("<TOOLCALL>"),
            ToolFormat::Llama3Json => None,
        }
    }

    fn end(self) -> &'static str {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder => "</tool_call>",
            ToolFormat::NemotronJson => "</TOOLCALL>",
            ToolFormat::Llama3Json => "",
        }
    }

    /// The calls in the text between a start and an end marker (or the
    /// whole answer, for [`ToolFormat::Llama3Json`]).
    pub fn parse(self, body: &str, tools: &[ToolDef]) -> Result<Vec<ParsedCall>, String> {
        match self {
            ToolFormat::Hermes => {
                json_call(&parse_json(body.trim())?, "arguments").map(|c| vec![c])
            }
            ToolFormat::NemotronJson => match parse_json(body.trim())? {
                Value::Array(items) => items.iter().map(|v| json_call(v, "arguments")).collect(),
                v => json_call(&v, "arguments").map(|c| vec![c]),
            },
            ToolFormat::Llama3Json => body
                .trim()
                .split(';')
                .filter(|p| !p.trim().is_empty())
                .map(|p| json_call(&parse_json(p.trim())?, "parameters"))
                .collect(),
            ToolFormat::Qwen3Coder => xml_call(body, tools).map(|c| vec![c]),
        }
    }

    /// A Lark grammar (llguidance's dialect) of one call, or of one or more
    /// when `parallel`, to any of `tools`. Arguments are strict, as
    /// OpenAI's strict mode makes them: no property the schema does not
    /// name (unless it says otherwise), and no whitespace but one space
    /// after `,` and `:`.
    pub fn call_grammar(self, tools: &[ToolDef], parallel: bool) -> String {
        let json_opts =
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        let tools: Vec<ToolDef> = tools.iter().map(strict).collect();
        let tools = &tools[..];
        let object = |args: &str| -> Vec<Value> {
            tools
                .iter()
                .map(|t| {
                    json!({
                        "type": "object",
                        "properties": {"name": {"const": t.name}, args: t.parameters},
                        "required": ["name", args],
                        "additionalProperties": false,
                    })
                })
                .collect()
        };
        let many = if parallel { "(\"\\n\" call)*" } else { "" };
        match self {
            ToolFormat::Hermes => {
                let schema = json!({"anyOf": object("arguments"), "x-guidance": json_opts});
                format!("start: call {many}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {schema}\n")
            }
            ToolFormat::NemotronJson => {
                let mut schema = json!({"type": "array", "items": {"anyOf": object("arguments")}, "minItems": 1, "x-guidance": json_opts});
                if !parallel {
                    schema["maxItems"] = json!(1);
                }
                format!("start: \"<TOOLCALL>\" body \"</TOOLCALL>\"\nbody: %json {schema}\n")
            }
            ToolFormat::Llama3Json => {
                let schema = json!({"anyOf": object("parameters"), "x-guidance": json_opts});
                let many = if parallel { "(\"; \" call)*" } else { "" };
                format!("start: call {many}\ncall: %json {schema}\n")
            }
            ToolFormat::Qwen3Coder => {
                let mut g = format!(
                    "start: call {many}\ncall: \"<tool_call>\\n\" function \"\\n</tool_call>\"\n"
                );
                let names: Vec<String> = (0..tools.len()).map(|i| format!("f{i}")).collect();
                g += &format!("function: {}\n", names.join(" | "));
                for (i, t) in tools.iter().enumerate() {
                    g += &coder_function_rules(i, t, &json_opts);
                }
                g
            }
        }
    }
}

/// A tool whose parameters allow no property they do not name, unless
/// they say otherwise.
fn strict(t: &ToolDef) -> ToolDef {
    let mut t = t.clone();
    if let Some(o) = t.parameters.as_object_mut() {
        o.entry("additionalProperties")
            .or_insert(Value::Bool(false));
    }
    t
}

/// The rules of one function in the Qwen3-Coder form: each property in
/// schema order, the required ones always, the others optional; string
/// values as text without `<` (within their `minLength` and `maxLength`),
/// enums as their literals, anything else as JSON of its schema.
fn coder_function_rules(i: usize, t: &ToolDef, json_opts: &Value) -> String {
    let props = t.parameters.get("properties").and_then(Value::as_object);
    let required: Vec<&str> = t
        .parameters
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut parts = Vec::new();
    let mut rules = String::new();
    for (j, (name, schema)) in props.into_iter().flatten().enumerate() {
        let value = format!("f{i}_p{j}");
        let is_string = schema.get("type").and_then(Value::as_str) == Some("string");
        let body = match schema.get("enum").and_then(Value::as_array) {
            Some(options) if options.iter().all(Value::is_string) => options
                .iter()
                .map(|o| lark_literal(o.as_str().unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(" | "),
            _ if is_string => {
                let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
                match schema.get("maxLength").and_then(Value::as_u64) {
                    Some(max) => format!("/[^<]{{{min},{max}}}/"),
                    None => format!("/[^<]{{{min},}}/"),
                }
            }
            _ => {
                let mut s = schema.clone();
                if let Some(o) = s.as_object_mut() {
                    o.insert("x-guidance".into(), json_opts.clone());
                }
                format!("%json {s}")
            }
        };
        rules += &format!("{value}: {body}\n");
        let part = format!(
            "{} \"\\n\" {value} \"\\n</parameter>\\n\"",
            lark_literal(&format!("<parameter={name}>"))
        );
        parts.push(if required.contains(&name.as_str()) {
            part
        } else {
            format!("({part})?")
        });
    }
    format!(
        "f{i}: {} \"\\n\" {}\"</function>\"\n{rules}",
        lark_literal(&format!("<function={}>", t.name)),
        parts.iter().map(|p| format!("{p} ")).collect::<String>()
    )
}

/// A Lark string literal of `s`.
fn lark_literal(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

fn parse_json(s: &str) -> Result<Value, String> {
    serde_json::from_str(s).map_err(|e| format!("not JSON: {e}"))
}

/// `{"name": ..., args: {...}}` (the arguments may also come as a JSON
/// string holding the object).
fn json_call(v: &Value, args: &str) -> Result<ParsedCall, String> {
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .ok_or("no string `name`")?;
    let arguments = match v.get(args).or_else(|| v.get("arguments")) {
        None => Value::Object(Map::new()),
        Some(Value::String(s)) => parse_json(s)?,
        Some(a) => a.clone(),
    };
    if !arguments.is_object() {
        return Err(format!("`{args}` is not an object"));
    }
    Ok(ParsedCall {
        name: name.to_owned(),
        arguments,
    })
}

/// `\n<function=NAME>\n<parameter=P>\nV\n</parameter>\n...</function>\n`:
/// values typed by the function's schema, as mlx-lm's `qwen3_coder`
/// parser types them (`_convert_param_value`).
fn xml_call(body: &str, tools: &[ToolDef]) -> Result<ParsedCall, String> {
    let rest = body
        .trim()
        .strip_prefix("<function=")
        .ok_or("no `<function=`")?;
    let (name, mut rest) = rest.split_once('>').ok_or("unclosed `<function=`")?;
    let name = name.trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        return Err(format!("bad function name `{name}`"));
    }
    let props = tools
        .iter()
        .find(|t| t.name == name)
        .and_then(|t| t.parameters.get("properties"))
        .and_then(Value::as_object);
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            if !after.trim().is_empty() {
                return Err("text after `</function>`".into());
            }
            break;
        }
        let p = rest
            .strip_prefix("<parameter=")
            .ok_or("expected `<parameter=` or `</function>`")?;
        let (pname, p) = p.split_once('>').ok_or("unclosed `<parameter=`")?;
        let (value, after) = p
            .split_once("</parameter>")
            .ok_or("unclosed `<parameter>`")?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let schema = props.and_then(|p| p.get(pname.trim()));
        args.insert(pname.trim().to_owned(), typed_value(value, schema)?);
        rest = after;
    }
    Ok(ParsedCall {
        name: name.to_owned(),
        arguments: Value::Object(args),
    })
}

fn typed_value(v: &str, schema: Option<&Value>) -> Result<Value, String> {
    if v.eq_ignore_ascii_case("null") {
        return Ok(Value::Null);
    }
    let json_or_text = |v: &str| match serde_json::from_str::<Value>(v) {
        Ok(j) if j.is_object() || j.is_array() => j,
        _ => Value::String(v.to_owned()),
    };
    let Some(schema) = schema else {
        return Ok(Value::String(v.to_owned()));
    };
    let Some(ty) = schema.get("type").and_then(Value::as_str) else {
        return Ok(json_or_text(v));
    };
    Ok(match ty {
        "string" => Value::String(v.to_owned()),
        "integer" => {
            let f: f64 = v
                .trim()
                .parse()
                .map_err(|_| format!("`{v}` is not an integer"))?;
            if f.fract() != 0.0 {
                return Err(format!("`{v}` is not an integer"));
            }
            json!(f as i64)
        }
        "number" => {
            let f: f64 = v
                .trim()
                .parse()
                .map_err(|_| format!("`{v}` is not a number"))?;
            if f.fract() == 0.0 && f.abs() < 9e15 {
                json!(f as i64)
            } else {
                json!(f)
            }
        }
        "boolean" => Value::Bool(v.trim().eq_ignore_ascii_case("true")),
        _ => json_or_text(v),
    })
}

/// What a [`ToolCallStream`] hands out.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolPiece {
    /// Text to show.
    Text(String),
    /// A parsed call.
    Call(ParsedCall),
}

/// Reads calls out of text as it streams: text outside calls goes out as
/// soon as it cannot be the start of a call; a call goes out whole once its
/// end marker arrives (or, for formats without one, at the end).
pub struct ToolCallStream {
    format: ToolFormat,
    tools: Vec<ToolDef>,
    /// Text not yet handed out.
    pending: String,
    /// Inside a call (after its start marker), or, for a format without
    /// markers, holding the whole answer as a possible call.
    in_call: bool,
    /// Nothing but whitespace was seen yet (a markerless call must start
    /// the answer).
    at_start: bool,
}

impl ToolCallStream {
    /// Parses `format` calls to `tools` (whose schemas type the values of
    /// the XML form).
    pub fn new(format: ToolFormat, tools: Vec<ToolDef>) -> Self {
        Self {
            format,
            tools,
            pending: String::new(),
            in_call: false,
            at_start: true,
        }
    }

    /// Takes new text; returns what can be handed out now.
    pub fn push(&mut self, text: &str) -> Vec<ToolPiece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        let Some(start) = self.format.start() else {
            // The whole answer is a call, or none: decided by its first
            // character other than whitespace.
            if self.at_start {
                let t = self.pending.trim_start();
                if t.starts_with('{') {
                    self.in_call = true;
                    self.at_start = false;
                } else if !t.is_empty() {
                    self.at_start = false;
                }
            }
            if !self.in_call && !self.at_start {
                out.push(ToolPiece::Text(std::mem::take(&mut self.pending)));
            }
            return out;
        };
        let end = self.format.end();
        loop {
            if self.in_call {
                let Some(at) = self.pending.find(end) else {
                    break;
                };
                let body: String = self.pending[..at].to_owned();
                self.pending.drain(..at + end.len());
                self.in_call = false;
                out.extend(self.call_or_text(&body, start, end));
            } else if let Some(at) = self.pending.find(start) {
                if at > 0 {
                    out.push(ToolPiece::Text(self.pending[..at].to_owned()));
                }
                self.pending.drain(..at + start.len());
                self.in_call = true;
            } else {
                let keep = crate::stop::held_back(&self.pending, &[start.to_owned()]);
                let show = self.pending.len() - keep;
                if show > 0 {
                    out.push(ToolPiece::Text(self.pending[..show].to_owned()));
                    self.pending.drain(..show);
                }
                break;
            }
        }
        out
    }

    /// The end of the answer: a call without its end marker is parsed if
    /// the format has none, else handed back as text.
    pub fn finish(&mut self) -> Vec<ToolPiece> {
        let rest = std::mem::take(&mut self.pending);
        let in_call = std::mem::replace(&mut self.in_call, false);
        match (in_call, self.format.start()) {
            (true, None) => self.call_or_text(&rest, "", ""),
            (true, Some(start)) => vec![ToolPiece::Text(format!("{start}{rest}"))],
            (false, _) if rest.is_empty() => Vec::new(),
            (false, _) => vec![ToolPiece::Text(rest)],
        }
    }

    fn call_or_text(&self, body: &str, start: &str, end: &str) -> Vec<ToolPiece> {
        match self.format.parse(body, &self.tools) {
            Ok(calls) if !calls.is_empty() => calls.into_iter().map(ToolPiece::Call).collect(),
            _ => vec![ToolPiece::Text(format!("{start}{body}{end}"))],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Vec<ToolDef> {
        vec![ToolDef {
            name: "get_weather".into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "tags": {"type": "array"},
                },
                "required": ["city"],
            }),
        }]
    }

    fn call(name: &str, arguments: Value) -> ToolPiece {
        ToolPiece::Call(ParsedCall {
            name: name.into(),
            arguments,
        })
    }

    /// Feeds `text` a few bytes at a time (on char boundaries), as a
    /// detokenizer would, and joins adjacent texts.
    fn stream(format: ToolFormat, text: &str) -> Vec<ToolPiece> {
        let mut s = ToolCallStream::new(format, weather());
        let mut out = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(3) {
            out.extend(s.push(&piece.iter().collect::<String>()));
        }
        out.extend(s.finish());
        let mut joined: Vec<ToolPiece> = Vec::new();
        for p in out {
            match (joined.last_mut(), p) {
                (Some(ToolPiece::Text(a)), ToolPiece::Text(b)) => a.push_str(&b),
                (_, p) => joined.push(p),
            }
        }
        joined
    }

    #[test]
    fn hermes_calls_come_out_between_texts() {
        let text = "Let me look.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}\n</tool_call>";
        assert_eq!(
            stream(ToolFormat::Hermes, text),
            vec![
                ToolPiece::Text("Let me look.".into()),
                call("get_weather", json!({"city": "Paris"})),
                ToolPiece::Text("\n".into()),
                call("get_weather", json!({"city": "Rome"})),
            ]
        );
    }

    #[test]
    fn malformed_or_unfinished_calls_are_text() {
        for text in [
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",
            "<tool_call>\n[1, 2]\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": 3}\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_weather\"",
            "a < b <tool_",
        ] {
            assert_eq!(
                stream(ToolFormat::Hermes, text),
                vec![ToolPiece::Text(text.into())],
                "{text:?}"
            );
        }
    }

    #[test]
    fn qwen3_coder_values_are_typed_by_the_schema() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n<parameter=other>\n7\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(
            stream(ToolFormat::Qwen3Coder, text),
            vec![call(
                "get_weather",
                json!({"city": "New York", "days": 3, "metric": true, "tags": ["a", 1], "other": "7"})
            )]
        );
        let bad = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2.5\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(
            stream(ToolFormat::Qwen3Coder, bad),
            vec![ToolPiece::Text(bad.into())]
        );
    }

    #[test]
    fn nemotron_lists_and_llama3_answers_are_calls() {
        let text = "<TOOLCALL>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}, {\"name\": \"get_time\", \"arguments\": {}}]</TOOLCALL>";
        assert_eq!(
            stream(ToolFormat::NemotronJson, text),
            vec![
                call("get_weather", json!({"city": "Oslo"})),
                call("get_time", json!({})),
            ]
        );
        let text = " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}; {\"name\": \"get_time\", \"parameters\": {}}";
        assert_eq!(
            stream(ToolFormat::Llama3Json, text),
            vec![
                call("get_weather", json!({"city": "Oslo"})),
                call("get_time", json!({})),
            ]
        );
        for text in ["The answer is {1}.", "{not json"] {
            assert_eq!(
                stream(ToolFormat::Llama3Json, text),
                vec![ToolPiece::Text(text.into())]
            );
        }
    }

    #[test]
    fn formats_are_detected_from_the_template() {
        let cases = [
            (
                "{{- '<tool_call>\\n<function=' + tool_call.name }}",
                Some(ToolFormat::Qwen3Coder),
            ),
            (
                "<tool_call>\n{\"name\": {{ tool_call.name }}",
                Some(ToolFormat::Hermes),
            ),
            (
                "<TOOLCALL>{{ tool_calls | tojson }}</TOOLCALL>",
                Some(ToolFormat::NemotronJson),
            ),
            (
                "{{- '<|python_tag|>' }}{% for t in tools %}",
                Some(ToolFormat::Llama3Json),
            ),
            ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
        ];
        for (template, want) in cases {
            assert_eq!(ToolFormat::detect(template), want, "{template}");
        }
    }
}
