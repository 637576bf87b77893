//! `mlex serve` for agent clients, on a tiny Qwen3 (random weights) with
//! the real Qwen3 tokenizer and chat template (`qwen3-tools`): tool calls
//! forced by `tool_choice` and read back, streamed or not, a whole round
//! trip, template arguments, reasoning apart from the answer, answers held
//! to a JSON schema, log-probabilities and penalties against mlx-lm's, and
//! the real `openai` client.

mod server;

use mlex_testkit::*;
use serde_json::{json, Value};
use server::*;

fn tools_server(extra: &[&str]) -> Server {
    start_on(&tools_fixture(), extra)
}

fn cases() -> Vec<Value> {
    serde_json::from_str(&std::fs::read_to_string(tools_fixture().join("render.json")).unwrap())
        .unwrap()
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        }},
        {"type": "function", "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]},
        }},
    ])
}

fn ask() -> Value {
    json!([{"role": "user", "content": "What is the weather in Paris?"}])
}

/// Checks the calls of an answer: ids, names among the tools, arguments a
/// JSON string of an object with the required keys. Returns (name, args).
fn check_calls(calls: &Value) -> Vec<(String, Value)> {
    let calls = calls
        .as_array()
        .unwrap_or_else(|| panic!("no tool_calls: {calls}"));
    assert!(!calls.is_empty());
    calls
        .iter()
        .map(|c| {
            assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
            assert_eq!(c["type"], "function", "{c}");
            let name = c["function"]["name"].as_str().unwrap().to_owned();
            let args: Value =
                serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            match name.as_str() {
                "get_weather" => {
                    assert!(
                        args["city"].as_str().unwrap().chars().count() <= 16,
                        "{args}"
                    );
                    assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()));
                }
                "get_time" => assert!(args["utc"].is_boolean(), "{args}"),
                other => panic!("a call to {other}"),
            }
            (name, args)
        })
        .collect()
}

#[test]
fn forced_tool_calls_come_back_as_calls_streamed_or_not_and_a_round_trip_renders_as_transformers() {
    let s = tools_server(&[]);
    let req = json!({"messages": ask(), "tools": weather_tools(), "tool_choice": "required",
                     "temperature": 0, "max_tokens": 300});
    let (code, v) = post(&s, "/v1/chat/completions", None, &req);
    assert_eq!(code, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert!(choice["message"]["content"].is_null(), "{v}");
    let calls = check_calls(&choice["message"]["tool_calls"]);

    // Streamed: the same calls, as delta.tool_calls chunks with indices.
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let evs = events(stream(&s, "/v1/chat/completions", None, &sreq));
    let mut streamed = Vec::new();
    for e in &evs {
        for c in e["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            assert_eq!(c["index"].as_u64(), Some(streamed.len() as u64), "{c}");
            streamed.push(c.clone());
        }
    }
    assert_eq!(check_calls(&Value::Array(streamed)), calls);
    assert_eq!(finish_reason(&evs), "tool_calls");

    // A named function, one call only.
    let mut named = req.clone();
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    named["parallel_tool_calls"] = json!(false);
    let (code, v) = post(&s, "/v1/chat/completions", None, &named);
    assert_eq!(code, 200, "{v}");
    let calls = check_calls(&v["choices"][0]["message"]["tool_calls"]);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].0, "get_time");

    // The round trip of render.json (tool calls, their results) and the
    // template arguments reach the template: the prompt has the length
    // transformers gives it.
    let all = cases();
    for i in [1, 2, 3, 4] {
        let c = &all[i];
        let mut body = json!({"messages": c["messages"], "max_tokens": 2, "temperature": 0});
        if !c["tools"].is_null() {
            body["tools"] = c["tools"].clone();
        }
        if !c["kwargs"].as_object().unwrap().is_empty() {
            body["chat_template_kwargs"] = c["kwargs"].clone();
        }
        let (code, v) = post(&s, "/v1/chat/completions", None, &body);
        assert_eq!(code, 200, "case {i}: {v}");
        assert_eq!(
            v["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
            c["ids"].as_array().unwrap().len(),
            "case {i}"
        );
    }
}

#[test]
fn reasoning_is_apart_from_the_answer_streamed_or_not() {
    let s = tools_server(&[]);
    // Biases script the answer `<think>` `Because` `</think>` ...: each
    // token's repetition penalty lets the next bias win.
    let because = 17949; // "Because" in Qwen3's vocabulary
    let req = json!({
        "messages": ask(), "max_tokens": 6, "temperature": 0, "repetition_penalty": 1000.0,
        "logit_bias": {"151667": 100.0, because.to_string(): 60.0, "151668": 30.0},
    });
    let (code, v) = post(&s, "/v1/chat/completions", None, &req);
    assert_eq!(code, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "Because", "{v}");
    let content = m["content"].as_str().unwrap();
    assert!(!content.contains("think>") && !content.is_empty(), "{v}");
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let evs = events(stream(&s, "/v1/chat/completions", None, &sreq));
    assert_eq!(delta_text(&evs, "reasoning_content"), "Because");
    assert_eq!(delta_text(&evs, "content"), content);
}

/// A call the model opens but never finishes (its text is scripted by
/// biases, as above) comes back as text, not as an error.
#[test]
fn malformed_tool_call_text_comes_back_as_text() {
    let s = tools_server(&[]);
    for stream_it in [false, true] {
        let req = json!({
            "messages": ask(), "tools": weather_tools(), "max_tokens": 6, "temperature": 0,
            "repetition_penalty": 1000.0, "logit_bias": {"151657": 100.0}, "stream": stream_it,
        });
        let (content, calls, finish) = if stream_it {
            let evs = events(stream(&s, "/v1/chat/completions", None, &req));
            let text = delta_text(&evs, "content");
            let calls = evs
                .iter()
                .any(|e| !e["choices"][0]["delta"]["tool_calls"].is_null());
            (text, calls, finish_reason(&evs))
        } else {
            let (code, v) = post(&s, "/v1/chat/completions", None, &req);
            assert_eq!(code, 200, "{v}");
            let m = &v["choices"][0]["message"];
            (
                m["content"].as_str().unwrap().to_owned(),
                !m["tool_calls"].is_null(),
                v["choices"][0]["finish_reason"].clone(),
            )
        };
        assert!(
            content.starts_with("<tool_call>") && content.len() > 11,
            "{content:?}"
        );
        assert!(!calls, "{content:?}");
        assert_eq!(finish, "length");
    }
}

#[test]
fn answers_held_to_a_json_schema_parse_against_it() {
    let s = tools_server(&[]);
    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "rain": {"type": "boolean"},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "rain", "days"],
        "additionalProperties": false,
    });
    for (i, format) in [
        json!({"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema, "strict": true}}),
        json!({"type": "json_object"}),
    ]
    .into_iter()
    .enumerate()
    {
        for stream_it in [false, true] {
            let req = json!({"messages": ask(), "response_format": format, "temperature": 0,
                                 "max_tokens": 400, "stream": stream_it});
            let text: String = if stream_it {
                delta_text(&events(stream(&s, "/v1/chat/completions", None, &req)), "content")
            } else {
                let (code, v) = post(&s, "/v1/chat/completions", None, &req);
                assert_eq!(code, 200, "{v}");
                assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
                v["choices"][0]["message"]["content"].as_str().unwrap().to_owned()
            };
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert!(v.is_object(), "{text}");
            if i == 0 {
                assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
                assert!(v["city"].as_str().unwrap().chars().count() <= 24);
                assert!(v["rain"].is_boolean());
                assert!((1..=9).contains(&v["days"].as_i64().unwrap()));
            }
        }
    }
}

/// The reference's tokens as bytes, for comparing with the answer's.
fn token_bytes() -> Vec<Vec<u8>> {
    let tok = mlex_generate::Tokenizer::from_dir(&tools_fixture()).unwrap();
    tok.token_bytes().unwrap().to_vec()
}

#[test]
fn logprobs_and_penalties_equal_mlx_lm_s() {
    let s = tools_server(&[]);
    let runs: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string(tools_fixture().join("logprobs.json")).unwrap(),
    )
    .unwrap();
    let bytes = token_bytes();
    let case0 = &cases()[0];
    for run in &runs {
        let steps = run["steps"].as_array().unwrap();
        let mut req = json!({"messages": case0["messages"], "temperature": 0,
                             "max_tokens": steps.len(), "logprobs": true, "top_logprobs": 5});
        for k in ["presence_penalty", "frequency_penalty"] {
            if !run[k].is_null() {
                req[k] = run[k].clone();
            }
        }
        let (code, v) = post(&s, "/v1/chat/completions", None, &req);
        assert_eq!(code, 200, "{v}");
        let got = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .clone();
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        let streamed: Vec<Value> = events(stream(&s, "/v1/chat/completions", None, &sreq))
            .iter()
            .flat_map(|e| {
                e["choices"]
                    .get(0)
                    .and_then(|c| c["logprobs"]["content"].as_array())
                    .cloned()
                    .unwrap_or_default()
            })
            .collect();
        // Streamed after the same request, the prompt comes from the prompt
        // cache: the same tokens, the numbers within rounding.
        assert_eq!(streamed.len(), got.len());
        for (a, b) in streamed.iter().zip(&got) {
            assert_eq!(a["bytes"], b["bytes"]);
            let d = a["logprob"].as_f64().unwrap() - b["logprob"].as_f64().unwrap();
            assert!(d.abs() < 1e-4, "{a} vs {b}");
        }
        assert_eq!(got.len(), steps.len(), "{v}");
        for (i, (g, want)) in got.iter().zip(steps).enumerate() {
            let id = want["token"].as_u64().unwrap() as usize;
            let gb: Vec<u8> = serde_json::from_value(g["bytes"].clone()).unwrap();
            assert_eq!(gb, bytes[id], "step {i}: token");
            let close =
                |a: &Value, b: &Value| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4;
            assert!(
                close(&g["logprob"], &want["logprob"]),
                "step {i}: {g} vs {want}"
            );
            let top = g["top_logprobs"].as_array().unwrap();
            let want_top = want["top"].as_array().unwrap();
            assert_eq!(top.len(), 5);
            for (t, w) in top.iter().zip(want_top) {
                assert!(close(&t["logprob"], &w[1]), "step {i}: {t} vs {w}");
                // A near tie may order two alternatives either way.
                let wid = w[0].as_u64().unwrap() as usize;
                let tb: Vec<u8> = serde_json::from_value(t["bytes"].clone()).unwrap();
                assert!(
                    tb == bytes[wid]
                        || want_top
                            .iter()
                            .any(|x| bytes[x[0].as_u64().unwrap() as usize] == tb),
                    "step {i}: {t} not among {want_top:?}"
                );
            }
        }
    }
    // The completions endpoint on the same prompt text: the same numbers.
    let steps = runs[0]["steps"].as_array().unwrap();
    let (code, v) = post(
        &s,
        "/v1/completions",
        None,
        &json!({"prompt": cases()[0]["text"], "temperature": 0, "max_tokens": steps.len(), "logprobs": 2}),
    );
    assert_eq!(code, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    for (i, want) in steps.iter().enumerate() {
        let got = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(
            (got - want["logprob"].as_f64().unwrap()).abs() < 1e-4,
            "step {i}"
        );
        assert_eq!(lp["top_logprobs"][i].as_object().unwrap().len(), 2);
    }
    assert_eq!(lp["text_offset"][0], 0);
}

#[test]
fn agent_requests_that_cannot_work_are_400s_naming_the_field() {
    let s = tools_server(&[]);
    let tools = weather_tools();
    let with = |extra: Value| {
        let mut b = json!({"messages": ask(), "max_tokens": 4, "tools": tools});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let bad_params = json!([{"type": "function", "function": {"name": "f", "parameters": 5}}]);
    let bad_type =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]);
    let bad_name = json!([{"type": "function", "function": {"name": "no spaces"}}]);
    for (body, needle) in [
        (
            with(json!({"tools": bad_params})),
            "tools[0].function.parameters",
        ),
        (
            with(json!({"tools": bad_type})),
            "tools[0].function.parameters.type",
        ),
        (with(json!({"tools": bad_name})), "tools[0].function.name"),
        (with(json!({"tools": [{"type": "function"}]})), "tools[0]"),
        (
            with(json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}})),
            "tool_choice.function.name",
        ),
        (with(json!({"tool_choice": "sometimes"})), "tool_choice"),
        (
            json!({"messages": ask(), "tool_choice": "auto"}),
            "tool_choice",
        ),
        (
            with(
                json!({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "21"}]}),
            ),
            "messages[1].tool_call_id",
        ),
        (
            with(json!({"messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "get_time", "arguments": "{not json"}}]}]})),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            with(
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            ),
            "messages[0].content[0].type",
        ),
        (
            with(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "object", "properties": {"a": {"type": "strng"}}}}}}),
            ),
            "response_format.json_schema.schema",
        ),
        (
            with(json!({"response_format": {"type": "xml"}})),
            "response_format.type",
        ),
        (
            with(json!({"tool_choice": "required", "response_format": {"type": "json_object"}})),
            "response_format",
        ),
        (
            with(json!({"logprobs": true, "top_logprobs": 50})),
            "top_logprobs",
        ),
        (with(json!({"top_logprobs": 2})), "top_logprobs"),
        (
            with(json!({"chat_template_kwargs": {"messages": []}})),
            "chat_template_kwargs.messages",
        ),
        (with(json!({"presence_penalty": 2.5})), "presence_penalty"),
    ] {
        let (code, v) = post(&s, "/v1/chat/completions", None, &body);
        assert_eq!(code, 400, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{body}: {msg}");
        let (code, v) = post(&s, "/v1/chat/completions", None, &with(json!({})));
        assert_eq!(code, 200, "the server keeps serving: {v}");
    }
    // A model whose template renders no tools says so.
    let plain = start_on(&path_of(&fixture("qwen3-chat")), &[]);
    let (code, v) = post(&plain, "/v1/chat/completions", None, &with(json!({})));
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("`tools`"),
        "{v}"
    );
}

/// The real `openai` client through a whole tool-call round trip, streamed
/// and not, and a `json_schema` answer (`xtask/py/openai_tools_check.py`).
#[test]
fn the_openai_python_client_runs_a_tool_call_round_trip() {
    let s = tools_server(&[]);
    let out = python(
        "openai_tools_check.py",
        &[
            "--base-url",
            &format!("{}/v1", s.base),
            "--model",
            "qwen3-tools",
        ],
    );
    eprintln!("{out}");
    assert!(out.contains("all checks passed"), "{out}");
}
