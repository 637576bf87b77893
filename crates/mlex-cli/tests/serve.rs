//! `mlex serve` end to end: a real server process on a free loopback port,
//! SmolLM2-135M-Instruct (the GGUF fixture) or a tiny Qwen3 with SmolLM2's
//! tokenizer, requests over HTTP from Rust and from the real `openai`
//! Python client.

mod server;

use mlex_testkit::*;
use serde_json::{json, Value};
use server::*;
use std::time::{Duration, Instant};

fn question() -> Value {
    json!([{"role": "user", "content": "What is the capital of France?"}])
}

/// The status and body of a chat request with [`question`] and no key.
fn ask(s: &Server) -> (u16, Value) {
    post(
        s,
        "/v1/chat/completions",
        None,
        &json!({"messages": question()}),
    )
}

#[test]
fn chat_and_completions_answer_streamed_or_not_and_bad_requests_are_4xx() {
    let s = start(&["--batch", "4", "--api-key", "k"]);
    // Every request needs the key.
    let (code, body) = ask(&s);
    assert_eq!(code, 401, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Bearer"));
    assert_eq!(get_text(&s, "/health", None).0, 401);
    assert_eq!(get_text(&s, "/health", Some("k")).0, 200);
    let (code, models) = get_text(&s, "/v1/models", Some("k"));
    assert_eq!(code, 200);
    assert!(
        models.contains("SmolLM2-135M-Instruct.Q4_1.gguf"),
        "{models}"
    );

    // Not streamed.
    let req = json!({"messages": question(), "max_tokens": 24, "temperature": 0});
    let (code, v) = post(&s, "/v1/chat/completions", Some("k"), &req);
    assert_eq!(code, 200, "{v}");
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(content.contains("Paris"), "{content}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["object"], "chat.completion");
    let usage = &v["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );

    // Streamed: the deltas add up to the same answer; usage on request.
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({"include_usage": true});
    let evs = events(stream(&s, "/v1/chat/completions", Some("k"), &sreq));
    let text = delta_text(&evs, "content");
    assert_eq!(text, content);
    assert_eq!(evs[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(finish_reason(&evs), "stop");
    // The same prompt again: all but its last token come from the prompt cache.
    let streamed_usage = &evs.last().unwrap()["usage"];
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(streamed_usage[k], usage[k], "{k}");
    }
    assert_eq!(
        streamed_usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().unwrap() - 1)
    );

    // Stop strings, and the completions endpoint.
    let (code, v) = post(
        &s,
        "/v1/chat/completions",
        Some("k"),
        &json!({"messages": question(), "max_tokens": 24, "stop": "Paris"}),
    );
    assert_eq!(code, 200);
    let cut = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!cut.contains("Paris") && content.starts_with(cut), "{cut}");
    let (code, v) = post(
        &s,
        "/v1/completions",
        Some("k"),
        &json!({"prompt": "The capital of France is", "max_tokens": 5}),
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // Bad requests name what is wrong, and the server keeps serving.
    for (body, needle) in [
        (
            json!({"messages": question(), "frequency_penalty": 3}),
            "frequency_penalty",
        ),
        (json!({"messages": question(), "n": 2}), "`n`"),
        (
            json!({"messages": question(), "temperature": -1}),
            "temperature",
        ),
        (json!({"messages": question(), "top_p": 0}), "top_p"),
        (
            json!({"messages": question(), "logit_bias": {"x": 1}}),
            "logit_bias",
        ),
        (
            json!({"messages": question(), "logit_bias": {"99999999": 1}}),
            "vocabulary",
        ),
        (
            json!({"messages": question(), "max_tokens": 0}),
            "max_tokens",
        ),
        (json!({"messages": "hi"}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": "hi ".repeat(9000)}]}),
            "exceeds the context",
        ),
        (json!({"prompt": "x"}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": ""}], "model": "other"}),
            "not served",
        ),
    ] {
        let (code, v) = post(&s, "/v1/chat/completions", Some("k"), &body);
        assert!((400..500).contains(&code), "{body}: {code} {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    let (code, _) = post(&s, "/v1/nothing", Some("k"), &json!({}));
    assert_eq!(code, 404);
    // Bodies that are not JSON, not UTF-8, or too large: 4xx in OpenAI's format.
    for (body, status) in [
        (b"{\"messages\": [".to_vec(), 400),
        (vec![b'{', 0xff, 0xfe, b'}'], 400),
        (vec![b' '; 5 << 20], 413),
    ] {
        let (code, v) = post_raw(&s, "/v1/chat/completions", body);
        assert_eq!(code, status, "{v}");
        assert!(v["error"]["message"].is_string(), "{v}");
        let (code, v) = post(&s, "/v1/chat/completions", Some("k"), &req);
        assert_eq!(code, 200, "the server keeps serving: {v}");
    }
    let (code, v) = post(&s, "/v1/chat/completions", Some("k"), &req);
    assert_eq!(
        (code, v["choices"][0]["message"]["content"].as_str()),
        (200, Some(content.as_str()))
    );

    // A shared system prompt is computed once.
    let system =
        "You are a concise assistant who answers questions about geography in one sentence.";
    let mut reused = Vec::new();
    for q in [
        "What is the capital of Italy?",
        "What is the capital of Spain?",
    ] {
        let (code, v) = post(
            &s,
            "/v1/chat/completions",
            Some("k"),
            &json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                    "max_tokens": 12}),
        );
        assert_eq!(code, 200, "{v}");
        reused.push(
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
    }
    assert!(reused[1] >= 20, "the second request reused {reused:?}");
    let (code, m) = get_text(&s, "/metrics", Some("k"));
    assert_eq!(code, 200);
    let reused_total: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("mlex_prefill_tokens_reused_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    assert!(reused_total >= reused[1] as f64, "{m}");
    for name in [
        "mlex_requests_total",
        "mlex_rejected_total",
        "mlex_queue_depth",
        "mlex_active_sequences",
        "mlex_prefill_tokens_computed_total",
        "mlex_prefill_tokens_reused_total",
        "mlex_generated_tokens_total",
        "mlex_decode_tokens_per_second",
    ] {
        assert!(m.contains(name), "{name} in\n{m}");
    }
}

/// Polls `/metrics` (at most a minute) until `name` reaches `at_least`,
/// failing with `never` otherwise.
fn await_metric(s: &Server, name: &str, at_least: f64, never: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(s, name) < at_least {
        assert!(Instant::now() < deadline, "{never}");
        std::thread::yield_now();
    }
}

/// Reads the metric `name`'s value from `/metrics`.
fn metric(s: &Server, name: &str) -> f64 {
    let (_, m) = get_text(s, "/metrics", None);
    m.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in\n{m}"))
}

#[test]
fn a_full_queue_answers_503_a_gone_client_frees_its_slot_and_sigterm_finishes_in_flight() {
    let s = start(&["--batch", "1", "--max-queue", "0"]);
    let long = json!({"messages": question(), "max_tokens": 400, "stream": true,
                      "logit_bias": {"2": -100.0}});
    // The only slot is taken once the first token arrives.
    let mut first = stream(&s, "/v1/chat/completions", None, &long);
    wait_for_data(&mut first);
    let (code, v) = ask(&s);
    assert_eq!(code, 503, "{v}");
    // The client goes away: its sequence stops and the slot frees.
    drop(first);
    await_metric(
        &s,
        "mlex_cancelled_total",
        1.0,
        "the dropped stream was never cancelled",
    );
    let (code, _) = post(
        &s,
        "/v1/chat/completions",
        None,
        &json!({"messages": question(), "max_tokens": 4}),
    );
    assert_eq!(code, 200);

    // SIGTERM while a request streams: it still completes, then exit 0.
    let mut s = s;
    let evs = sigterm_while_streaming(
        &s,
        &json!({"messages": question(), "max_tokens": 40, "stream": true}),
    );
    assert!(evs
        .iter()
        .any(|e| e["choices"][0]["finish_reason"].is_string()));
    let status = s.child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}

#[test]
fn concurrent_requests_decode_together() {
    let s = start(&["--batch", "4"]);
    let body = json!({"messages": question(), "max_tokens": 300, "stream": true,
                      "logit_bias": {"2": -100.0}});
    let mut open: Vec<_> = (0..3)
        .map(|_| stream(&s, "/v1/chat/completions", None, &body))
        .collect();
    for r in &mut open {
        wait_for_data(r);
    }
    // All three are in the one batch, none waits.
    await_metric(
        &s,
        "mlex_active_sequences",
        3.0,
        "the three requests never decoded together",
    );
    assert_eq!(metric(&s, "mlex_queue_depth"), 0.0);
}

/// The real `openai` client: models, chat and completions streamed and not
/// (streamed text equal to the non-streamed), usage, stop strings, a stream
/// closed mid-way, an unknown model (`xtask/py/openai_check.py`), on the
/// tiny Qwen3 and on SmolLM2.
#[test]
fn the_openai_python_client_gets_consistent_answers() {
    for (name, model_id) in [
        ("qwen3-chat", "qwen3-chat"),
        ("smollm2-gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ] {
        let s = start_on(&path_of(&fixture(name)), &[]);
        let out = python(
            "openai_check.py",
            &["--base-url", &format!("{}/v1", s.base), "--model", model_id],
        );
        eprintln!("{name}:\n{out}");
        assert!(out.contains("all checks passed"), "{name}: {out}");
    }
}

/// 32 concurrent `openai` clients x 20 streamed greedy requests on loopback
/// (`xtask/py/serve_load.py`): no request fails, and every answer equals
/// the same server's answer to that prompt one at a time.
#[test]
fn thirty_two_concurrent_clients_get_the_answers_of_one_at_a_time() {
    let mlex = assert_cmd::cargo::cargo_bin("mlex");
    let model = path_of(&fixture("qwen3-chat"));
    let logs = tempfile::tempdir().unwrap();
    let out = python(
        "serve_load.py",
        &[
            "--engines",
            "mlex",
            "--mlex",
            mlex.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--clients",
            "32",
            "--requests",
            "20",
            "--max-tokens",
            "16",
            "--distinct",
            "32",
            "--timeout",
            "120",
            "--logs",
            logs.path().to_str().unwrap(),
            "--check",
        ],
    );
    eprintln!("{out}");
    assert!(
        out.contains("640 ok, 0 errors, 0 differ"),
        "every request answered as one at a time: {out}"
    );
}

/// `mlex serve --lookup`: concurrent requests that copy text get the answers
/// of a server that does not speculate, with what drafting did in their
/// usage and in `/metrics`.
#[test]
fn a_speculating_server_answers_as_a_plain_one() {
    let ask = |i: usize| {
        let list = [
            "apples", "pears", "plums", "figs", "dates", "limes", "kiwis",
        ];
        let items: Vec<String> = (0..6)
            .map(|j| list[(i + j) % list.len()].to_owned())
            .collect();
        json!({"messages": [{"role": "user", "content": format!(
            "Repeat this list exactly, one item per line:\n{}", items.join("\n"))}],
            "max_tokens": 40, "temperature": 0})
    };
    let bodies: Vec<Value> = (0..3).map(ask).collect();
    let answers = |s: &Server| chat_all(s, &bodies);
    let plain = answers(&start(&["--batch", "4"]));
    // Every request speculates while the others run: a batch of up to 4
    // (the default policy drafts only for a lone sequence).
    let s = start_with(
        &path_of(&fixture("smollm2-gguf")),
        &["--batch", "4", "--lookup", "--draft-tokens", "4"],
        &[("MLEX_SPECULATIVE_ROWS", "4")],
    );
    let spec = answers(&s);
    let mut accepted = 0;
    for (i, (p, v)) in plain.iter().zip(&spec).enumerate() {
        assert_eq!(
            v["choices"][0]["message"]["content"], p["choices"][0]["message"]["content"],
            "request {i}"
        );
        assert!(p["usage"].get("speculative").is_none());
        let u = &v["usage"]["speculative"];
        assert!(u["rounds"].as_u64().unwrap() > 0, "{v}");
        accepted += u["accepted_draft_tokens"].as_u64().unwrap();
    }
    assert!(accepted > 0, "the copies were drafted: {spec:?}");
    assert_eq!(
        metric(&s, "mlex_draft_tokens_accepted_total"),
        accepted as f64
    );
    assert!(metric(&s, "mlex_speculative_rounds_total") > 0.0);
}

/// `mlex serve --mtp`: the checkpoint's own head drafts for each request
/// (a Qwen3.5 fixture with a head, given a word-level tokenizer of its 256
/// ids): concurrent completions, and one repeated after its prompt was
/// cached, are a plain server's, with the head's rounds in their usage.
#[test]
fn a_server_drafting_with_the_mtp_head_answers_as_a_plain_one() {
    let src = path_of(&fixture("qwen3_5-mtp-hf"));
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let vocab: serde_json::Map<String, Value> =
        (0..256).map(|i| (format!("t{i}"), json!(i))).collect();
    let tokenizer = json!({
        "version": "1.0",
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
        "pre_tokenizer": {"type": "Whitespace"},
    });
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let ask = |i: usize| {
        let words: Vec<String> = (0..9)
            .map(|j| format!("t{}", 3 + (i * 37 + j * 11) % 250))
            .collect();
        json!({"prompt": words.join(" "), "max_tokens": 14, "temperature": 0})
    };
    let answers = |s: &Server| -> Vec<Value> {
        let mut v: Vec<Value> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..3)
                .map(|i| sc.spawn(move || post(s, "/v1/completions", None, &ask(i))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .map(|(code, v)| {
                    assert_eq!(code, 200, "{v}");
                    v
                })
                .collect()
        });
        let (code, again) = post(s, "/v1/completions", None, &ask(0));
        assert_eq!(code, 200, "{again}");
        v.push(again);
        v
    };
    let plain = answers(&start_on(dir.path(), &["--batch", "4"]));
    let s = start_with(
        dir.path(),
        &["--batch", "4", "--mtp", "--draft-tokens", "2"],
        &[("MLEX_SPECULATIVE_ROWS", "4")],
    );
    let spec = answers(&s);
    for (i, (p, v)) in plain.iter().zip(&spec).enumerate() {
        assert_eq!(
            v["choices"][0]["text"], p["choices"][0]["text"],
            "request {i}"
        );
        let u = &v["usage"]["speculative"];
        assert!(u["rounds"].as_u64().unwrap() > 0, "{v}");
    }
    assert!(metric(&s, "mlex_speculative_rounds_total") > 0.0);
}

#[test]
fn a_server_under_three_ranks_answers_as_one_device() {
    // SmolLM2-135M on 3 ranks (9 heads, 3 key/value heads): rank 0 serves
    // and shares each admission and each stop with the others. Greedy
    // requests in one batch, a seeded sampled one and a stop string give
    // one device's answers, and so does a request held to a grammar (each
    // rank compiles it).
    let ask = |content: &str, extra: Value| {
        let mut v = json!({"messages": [{"role": "user", "content": content}],
            "max_tokens": 12, "temperature": 0});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    let requests = [
        ask("What is the capital of France?", json!({})),
        ask("Name three colors.", json!({"stop": ["Blue"]})),
        ask("Tell a story.", json!({"temperature": 0.9, "seed": 5})),
        ask(
            "Describe a cat as JSON.",
            json!({"response_format": {"type": "json_object"}}),
        ),
    ];
    let answers = |s: &Server| chat_all(s, &requests);
    let one = answers(&start(&["--batch", "4"]));
    let s = start(&["--batch", "4", "--tp", "3"]);
    let three = answers(&s);
    for (i, (a, b)) in one.iter().zip(&three).enumerate() {
        assert_eq!(a["choices"][0], b["choices"][0], "request {i}");
        assert_eq!(
            a["usage"]["completion_tokens"],
            b["usage"]["completion_tokens"]
        );
    }
    assert_eq!(one[1]["choices"][0]["finish_reason"], "stop");
    let (code, v) = post(&s, "/v1/chat/completions", None, &requests[0]);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["choices"][0], one[0]["choices"][0]);

    // SIGTERM to the launcher while a request streams: rank 0 drains it
    // (the others follow to the end), every rank exits, the launcher 0.
    let mut s = s;
    let ranks = children_of(s.child.id());
    assert_eq!(ranks.len(), 3, "{ranks:?}");
    let evs = sigterm_while_streaming(
        &s,
        &json!({"messages": question(), "max_tokens": 24, "stream": true}),
    );
    assert!(
        evs.iter()
            .any(|e| e["choices"][0]["finish_reason"].is_string()),
        "{evs:?}"
    );
    assert_eq!(s.child.wait().unwrap().code(), Some(0));
    for pid in ranks {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "rank process {pid} outlived the launcher"
        );
    }
}

/// The processes whose parent is `pid` (Linux `/proc`).
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`: the fields after the last ')'.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        if after.split_whitespace().nth(1) == Some(&pid.to_string()) {
            out.push(child);
        }
    }
    out
}
