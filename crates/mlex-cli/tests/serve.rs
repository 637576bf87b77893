//! `mlex serve` end to end: a real server process on a free loopback port,
//! SmolLM2-135M-Instruct (the GGUF fixture) or a tiny Qwen3 with SmolLM2's
//! tokenizer, requests over HTTP from Rust and from the real `openai`
//! Python client.

use mlex_testkit::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `mlex serve` on SmolLM2 and waits for the line that names its
/// address.
fn start(extra: &[&str]) -> Server {
    start_on(&path_of(&fixture("smollm2-gguf")), extra)
}

/// Starts `mlex serve` on `model` and waits for the line that names its
/// address.
fn start_on(model: &std::path::Path, extra: &[&str]) -> Server {
    let mut child = Command::new(assert_cmd::cargo::cargo_bin("mlex"))
        .args(["serve", "--port", "0", "--model"])
        .arg(model)
        .args(extra)
        .env_remove("MLEX_API_KEY")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let base = loop {
        line.clear();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "mlex serve ended before listening"
        );
        if let Some(at) = line.find("http://") {
            let url = line[at..].split_whitespace().next().unwrap_or_default();
            break url.trim_end_matches("/v1").to_owned();
        }
    };
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = String::new();
        let _ = stderr.read_to_string(&mut sink);
    });
    Server { child, base }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

fn post(s: &Server, path: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
    let mut req = agent().post(format!("{}{path}", s.base));
    if let Some(k) = key {
        req = req.header("Authorization", format!("Bearer {k}"));
    }
    let mut resp = req.send_json(body).unwrap();
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Posts `body` over a bare TCP connection. The body is written from its
/// own thread and a failed write is ignored: a server may answer a body over
/// its limit (413) and close before the client has sent it all, which is
/// what HTTP allows, and a client that only writes would then see a broken
/// pipe instead of the answer.
fn post_raw(s: &Server, path: &str, body: Vec<u8>) -> (u16, Value) {
    use std::io::Write;
    let addr = s.base.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer k\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut writer = stream.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let _ = writer
            .write_all(head.as_bytes())
            .and_then(|()| writer.write_all(&body));
    });
    let mut answer = Vec::new();
    // The server may reset the connection after its answer; what was read
    // up to then is the answer.
    let mut chunk = [0u8; 8192];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
        }
    }
    sender.join().unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status line in {text:?}"));
    let payload = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (
        status,
        serde_json::from_str(payload).unwrap_or(Value::String(payload.to_owned())),
    )
}

fn get_text(s: &Server, path: &str, key: Option<&str>) -> (u16, String) {
    let mut req = agent().get(format!("{}{path}", s.base));
    if let Some(k) = key {
        req = req.header("Authorization", format!("Bearer {k}"));
    }
    let mut resp = req.call().unwrap();
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_string().unwrap())
}

/// Opens a streaming request; returns the line reader of its body.
fn stream(s: &Server, path: &str, key: Option<&str>, body: &Value) -> impl BufRead {
    let mut req = agent().post(format!("{}{path}", s.base));
    if let Some(k) = key {
        req = req.header("Authorization", format!("Bearer {k}"));
    }
    let resp = req.send_json(body).unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    BufReader::new(resp.into_body().into_reader())
}

/// The JSON payloads of the `data:` lines up to `[DONE]`.
fn events(mut r: impl BufRead) -> Vec<Value> {
    let mut out = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap() == 0 {
            panic!("stream ended without [DONE]: {out:?}");
        }
        let Some(data) = line.trim().strip_prefix("data:") else {
            continue;
        };
        let data = data.trim();
        if data == "[DONE]" {
            return out;
        }
        out.push(serde_json::from_str(data).unwrap());
    }
}

fn question() -> Value {
    json!([{"role": "user", "content": "What is the capital of France?"}])
}

#[test]
fn chat_and_completions_answer_streamed_or_not_and_bad_requests_are_4xx() {
    let s = start(&["--batch", "4", "--api-key", "k"]);
    // Every request needs the key.
    let (code, body) = post(
        &s,
        "/v1/chat/completions",
        None,
        &json!({"messages": question()}),
    );
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
    let text: String = evs
        .iter()
        .filter_map(|e| {
            e["choices"].get(0)?["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, content);
    assert_eq!(evs[0]["choices"][0]["delta"]["role"], "assistant");
    let last_choice = evs
        .iter()
        .rev()
        .find(|e| e["choices"].get(0).is_some())
        .unwrap();
    assert_eq!(last_choice["choices"][0]["finish_reason"], "stop");
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
            json!({"messages": question(), "frequency_penalty": 1}),
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
    let mut line = String::new();
    while !line.starts_with("data:") {
        line.clear();
        first.read_line(&mut line).unwrap();
    }
    let (code, v) = post(
        &s,
        "/v1/chat/completions",
        None,
        &json!({"messages": question()}),
    );
    assert_eq!(code, 503, "{v}");
    // The client goes away: its sequence stops and the slot frees.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(&s, "mlex_cancelled_total") < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the dropped stream was never cancelled"
        );
        std::thread::yield_now();
    }
    let (code, _) = post(
        &s,
        "/v1/chat/completions",
        None,
        &json!({"messages": question(), "max_tokens": 4}),
    );
    assert_eq!(code, 200);

    // SIGTERM while a request streams: it still completes, then exit 0.
    let mut s = s;
    let mut r = stream(
        &s,
        "/v1/chat/completions",
        None,
        &json!({"messages": question(), "max_tokens": 40, "stream": true}),
    );
    let mut head = String::new();
    while !head.starts_with("data:") {
        head.clear();
        r.read_line(&mut head).unwrap();
    }
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let evs = events(r);
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
        let mut line = String::new();
        while !line.starts_with("data:") {
            line.clear();
            r.read_line(&mut line).unwrap();
        }
    }
    // All three are in the one batch, none waits.
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(&s, "mlex_active_sequences") < 3.0 {
        assert!(
            Instant::now() < deadline,
            "the three requests never decoded together"
        );
        std::thread::yield_now();
    }
    assert_eq!(metric(&s, "mlex_queue_depth"), 0.0);
}

/// Runs one of the repository's Python scripts with the reference venv's
/// Python (which has the `openai` client); panics with its output unless it
/// exits 0.
fn python(script: &str, args: &[&str]) -> String {
    let (py, scripts) = reference_python();
    let out = Command::new(py)
        .arg(scripts.join(script))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} failed:\n{text}");
    text
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
