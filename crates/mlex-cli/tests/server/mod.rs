//! A real `mlex serve` process on a free loopback port, and requests to it
//! over HTTP (shared by the server test files).
#![allow(dead_code)]

use mlex_testkit::*;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct Server {
    pub child: Child,
    pub base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `mlex serve` on SmolLM2 and waits for the line that names its
/// address.
pub fn start(extra: &[&str]) -> Server {
    start_on(&path_of(&fixture("smollm2-gguf")), extra)
}

/// Starts `mlex serve` on `model` and waits for the line that names its
/// address.
pub fn start_on(model: &std::path::Path, extra: &[&str]) -> Server {
    start_with(model, extra, &[])
}

/// [`start_on`] with environment variables `env` set for the server.
pub fn start_with(model: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
    let mut child = Command::new(assert_cmd::cargo::cargo_bin("mlex"))
        .args(["serve", "--port", "0", "--model"])
        .arg(model)
        .args(extra)
        .envs(env.iter().copied())
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

pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

pub fn post(s: &Server, path: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
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

/// `bodies` posted to `/v1/chat/completions` at once, each answered 200:
/// the answers, in order.
pub fn chat_all(s: &Server, bodies: &[Value]) -> Vec<Value> {
    std::thread::scope(|sc| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| sc.spawn(move || post(s, "/v1/chat/completions", None, b)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let (code, v) = h.join().unwrap();
                assert_eq!(code, 200, "{v}");
                v
            })
            .collect()
    })
}

/// Posts `body` over a bare TCP connection. The body is written from its
/// own thread and a failed write is ignored: a server may answer a body over
/// its limit (413) and close before the client has sent it all, which is
/// what HTTP allows, and a client that only writes would then see a broken
/// pipe instead of the answer.
pub fn post_raw(s: &Server, path: &str, body: Vec<u8>) -> (u16, Value) {
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

pub fn get_text(s: &Server, path: &str, key: Option<&str>) -> (u16, String) {
    let mut req = agent().get(format!("{}{path}", s.base));
    if let Some(k) = key {
        req = req.header("Authorization", format!("Bearer {k}"));
    }
    let mut resp = req.call().unwrap();
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_string().unwrap())
}

/// Opens a streaming request; returns the line reader of its body.
pub fn stream(s: &Server, path: &str, key: Option<&str>, body: &Value) -> impl BufRead {
    let mut req = agent().post(format!("{}{path}", s.base));
    if let Some(k) = key {
        req = req.header("Authorization", format!("Bearer {k}"));
    }
    let resp = req.send_json(body).unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    BufReader::new(resp.into_body().into_reader())
}

/// The JSON payloads of the `data:` lines up to `[DONE]`.
pub fn events(mut r: impl BufRead) -> Vec<Value> {
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

/// The `finish_reason` of a stream's last event with a choice.
pub fn finish_reason(evs: &[Value]) -> Value {
    let last = evs.iter().rev().find(|e| e["choices"].get(0).is_some());
    last.expect("an event with a choice")["choices"][0]["finish_reason"].clone()
}

/// The text of one `delta` field (`content`, `reasoning_content`) across
/// a stream's chunks.
pub fn delta_text(evs: &[Value], field: &str) -> String {
    evs.iter()
        .filter_map(|e| {
            e["choices"].get(0)?["delta"][field]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// Runs one of the repository's Python scripts with the reference venv's
/// Python (which has the `openai` client); panics with its output unless it
/// exits 0.
pub fn python(script: &str, args: &[&str]) -> String {
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

/// Reads `r` up to its first `data:` line (the stream has begun).
pub fn wait_for_data(r: &mut impl BufRead) {
    let mut line = String::new();
    while !line.starts_with("data:") {
        line.clear();
        r.read_line(&mut line).unwrap();
    }
}

/// Streams `body` from `s`, sends the server SIGTERM once the stream has
/// begun, and returns the stream's events to its end.
pub fn sigterm_while_streaming(s: &Server, body: &Value) -> Vec<Value> {
    let mut r = stream(s, "/v1/chat/completions", None, body);
    wait_for_data(&mut r);
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    events(r)
}
