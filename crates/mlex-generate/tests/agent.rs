//! The agent pieces on the real Qwen3 tokenizer and chat template
//! (`qwen3-tools`): prompts rendered token for token as transformers'
//! `apply_chat_template` renders them, and grammars whose every output, on
//! a random walk through the allowed tokens, parses as what they promise.

use mlex_generate::{
    FunctionCall, Grammar, Grammars, Message, RenderOptions, Tokenizer, ToolCall, ToolDef,
    ToolFormat,
};
use mlex_testkit::tools_fixture;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&tools_fixture()).unwrap()
}

/// A message of `render.json` as the server turns a request's message into
/// one (arguments given as a JSON string become the object).
fn message(v: &Value) -> Message {
    let mut m = Message::new(
        v["role"].as_str().unwrap(),
        v["content"].as_str().unwrap_or_default(),
    );
    m.tool_call_id = v["tool_call_id"].as_str().map(str::to_owned);
    for c in v["tool_calls"].as_array().into_iter().flatten() {
        let args = &c["function"]["arguments"];
        let arguments = match args {
            Value::String(s) => serde_json::from_str(s).unwrap(),
            a => a.clone(),
        };
        m.tool_calls.push(ToolCall {
            id: c["id"].as_str().unwrap().into(),
            kind: "function".into(),
            function: FunctionCall {
                name: c["function"]["name"].as_str().unwrap().into(),
                arguments,
            },
        });
    }
    m
}

#[test]
fn chats_with_tools_render_as_transformers_renders_them() {
    let tok = tokenizer();
    let cases: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string(tools_fixture().join("render.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cases.len(), 5);
    let template = tok.chat_template.as_ref().unwrap();
    assert!(template.supports_tools());
    assert_eq!(
        ToolFormat::detect(template.source()),
        Some(ToolFormat::Hermes)
    );
    for (i, case) in cases.iter().enumerate() {
        let messages: Vec<Message> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(message)
            .collect();
        let opts = RenderOptions {
            add_generation_prompt: true,
            tools: (!case["tools"].is_null()).then(|| case["tools"].clone()),
            extra: case["kwargs"].as_object().unwrap().clone(),
        };
        let text = template.render_with(&messages, &opts).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "case {i}");
        let ids = tok.chat_ids_with(&messages, &opts).unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(ids, want, "case {i}");
    }
}

/// Draws allowed tokens at random until the grammar lets an end token be
/// drawn (taken with probability 1/2 once allowed); returns the text.
fn random_walk(g: &Grammars, tok: &Tokenizer, grammar: &Grammar, seed: u64) -> String {
    let mut c = g.compile(grammar).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids = Vec::new();
    for _ in 0..1500 {
        let allowed = c.allowed_within(usize::MAX).unwrap();
        let ends: Vec<u32> = tok
            .eos_ids
            .iter()
            .copied()
            .filter(|&e| allowed[e as usize])
            .collect();
        if !ends.is_empty()
            && (rng.random_range(0..2) == 0 || ends.len() == allowed.iter().filter(|a| **a).count())
        {
            return tok.decode(&ids).unwrap();
        }
        let choices: Vec<u32> = (0..allowed.len() as u32)
            .filter(|&t| allowed[t as usize] && !tok.eos_ids.contains(&t))
            .collect();
        assert!(
            !choices.is_empty(),
            "the grammar allows nothing after {ids:?}"
        );
        let t = choices[rng.random_range(0..choices.len())];
        c.consume(t).unwrap();
        ids.push(t);
    }
    panic!("no end after 1500 tokens: {:?}", tok.decode(&ids));
}

fn weather() -> ToolDef {
    ToolDef {
        name: "get_weather".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        }),
    }
}

fn clock() -> ToolDef {
    ToolDef {
        name: "get_time".into(),
        parameters: json!({"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}),
    }
}

/// Checks a call against its tool: every required argument there, each
/// with its type and bounds.
fn check_call(name: &str, args: &Value, text: &str) {
    match name {
        "get_weather" => {
            let city = args["city"].as_str().unwrap_or_else(|| panic!("{text}"));
            assert!(city.chars().count() <= 12, "{text}");
            let days = args["days"].as_i64().unwrap_or_else(|| panic!("{text}"));
            assert!((1..=7).contains(&days), "{text}");
            if let Some(u) = args.get("unit") {
                assert!(u == "celsius" || u == "fahrenheit", "{text}");
            }
        }
        "get_time" => assert!(args["utc"].is_boolean(), "{text}"),
        other => panic!("called {other}: {text}"),
    }
}

#[test]
fn every_walk_through_a_tool_call_grammar_parses_as_a_valid_call() {
    let tok = tokenizer();
    let g = Grammars::new(&tok, 151_936).unwrap();
    let tools = vec![weather(), clock()];
    for format in ToolFormat::ALL {
        for parallel in [false, true] {
            let grammar = Grammar::Lark(format.call_grammar(&tools, parallel));
            for seed in 0..6 {
                let text = random_walk(&g, &tok, &grammar, seed);
                let mut s = mlex_generate::ToolCallStream::new(format, tools.clone());
                let mut pieces = s.push(&text);
                pieces.extend(s.finish());
                let calls: Vec<_> = pieces
                    .iter()
                    .map(|p| match p {
                        mlex_generate::ToolPiece::Call(c) => c.clone(),
                        mlex_generate::ToolPiece::Text(t) if t.trim().is_empty() => {
                            mlex_generate::ParsedCall {
                                name: String::new(),
                                arguments: Value::Null,
                            }
                        }
                        mlex_generate::ToolPiece::Text(t) => {
                            panic!("{format:?}: text outside a call {t:?} in {text:?}")
                        }
                    })
                    .filter(|c| !c.name.is_empty())
                    .collect();
                assert!(!calls.is_empty(), "{format:?}: no call in {text:?}");
                if !parallel {
                    assert_eq!(calls.len(), 1, "{format:?}: {text:?}");
                }
                for c in &calls {
                    check_call(&c.name, &c.arguments, &text);
                }
            }
        }
    }
}

#[test]
fn every_walk_through_a_json_schema_parses_against_it() {
    let tok = tokenizer();
    let g = Grammars::new(&tok, 151_936).unwrap();
    let schema = json!({
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 20},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["answer", "confidence", "tags"],
        "additionalProperties": false,
    });
    for seed in 0..10 {
        let text = random_walk(&g, &tok, &Grammar::JsonSchema(schema.clone()), seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 3, "{text}");
        assert!(
            v["answer"].as_str().unwrap().chars().count() <= 20,
            "{text}"
        );
        let c = v["confidence"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&c), "{text}");
        let tags = v["tags"].as_array().unwrap();
        assert!(
            tags.len() <= 3 && tags.iter().all(|t| t == "a" || t == "b"),
            "{text}"
        );
    }
    let bad = g.compile(&Grammar::JsonSchema(
        json!({"type": "object", "properties": {"a": {"type": "strng"}}}),
    ));
    assert!(bad.is_err(), "an unknown type is refused");
}

/// "Any JSON object" lets a walk go on forever; within its budget the
/// constraint closes it, and what comes out is an object.
#[test]
fn a_free_json_object_closes_within_its_budget() {
    let tok = tokenizer();
    let g = Grammars::new(&tok, 151_936).unwrap();
    let schema = json!({"type": "object"});
    for (seed, budget) in [(0u64, 60usize), (1, 40), (2, 100), (3, 25), (4, 8)] {
        let mut c = g.compile(&Grammar::JsonSchema(schema.clone())).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut ids = Vec::new();
        let mut ended = false;
        for n in 0..budget {
            let allowed = c.allowed_within(budget - n).unwrap();
            let choices: Vec<u32> = (0..allowed.len() as u32)
                .filter(|&t| allowed[t as usize])
                .collect();
            let t = choices[rng.random_range(0..choices.len())];
            if tok.eos_ids.contains(&t) {
                ended = true;
                break;
            }
            c.consume(t).unwrap();
            ids.push(t);
        }
        let text = tok.decode(&ids).unwrap();
        assert!(ended, "budget {budget}: no end in {text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(v.is_object(), "{text}");
    }
}

/// Constrained rows decode in one batch beside unconstrained ones: the
/// unconstrained rows give what they give alone, the constrained ones parse.
#[test]
fn constrained_rows_decode_beside_unconstrained_ones() {
    use mlex_generate::{BatchGenerator, Flow, GenerateOptions, Generator};
    let tok = tokenizer();
    let load = || {
        let registry = mlex_models::registry().unwrap();
        let loaded = mlex_models::load::load(tools_fixture().to_str().unwrap(), registry).unwrap();
        Generator::new(loaded.model, true)
    };
    let g = Grammars::new(&tok, 151_936).unwrap();
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
                        "required": ["ok", "n"], "additionalProperties": false});
    let prompts: Vec<Vec<u32>> = ["Hello there", "Write JSON.", "What now?", "Another JSON."]
        .iter()
        .map(|p| tok.chat_ids(&[Message::new("user", p)], true).unwrap())
        .collect();
    let opts = |i: usize| GenerateOptions {
        max_tokens: 16,
        stop_ids: tok.eos_ids.clone(),
        constraint: (i % 2 == 1).then(|| g.compile(&Grammar::JsonSchema(schema.clone())).unwrap()),
        logprobs: (i == 2).then_some(3),
        ..Default::default()
    };
    let run = |which: &[usize]| {
        let mut gen = load();
        let mut b = BatchGenerator::new(&mut gen, 4).unwrap();
        let ids: Vec<_> = which
            .iter()
            .map(|&i| b.submit(prompts[i].clone(), opts(i)))
            .collect();
        let mut lps = 0;
        let out = b
            .run(&mut |_, e| {
                lps += usize::from(e.logprob.is_some());
                Ok(Flow::Continue)
            })
            .unwrap();
        let toks: Vec<Vec<u32>> = ids
            .iter()
            .map(|id| {
                out.iter()
                    .find(|(o, _)| o == id)
                    .unwrap()
                    .1
                    .as_ref()
                    .unwrap()
                    .tokens
                    .clone()
            })
            .collect();
        (toks, lps)
    };
    let (together, lps) = run(&[0, 1, 2, 3]);
    let (alone, _) = run(&[0, 2]);
    assert_eq!(together[0], alone[0]);
    assert_eq!(together[2], alone[1]);
    assert_eq!(
        lps,
        together[2].len(),
        "the row that asked has a logprob per token"
    );
    for i in [1, 3] {
        let ids: Vec<u32> = together[i]
            .iter()
            .copied()
            .filter(|t| !tok.eos_ids.contains(t))
            .collect();
        let text = tok.decode(&ids).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(
            v["ok"].is_boolean() && [1, 2, 3].contains(&v["n"].as_i64().unwrap()),
            "{text}"
        );
    }
}
