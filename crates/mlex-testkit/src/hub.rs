//! A Hugging Face Hub lookalike on loopback for download tests: the
//! `api/models/<repo>/revision/<rev>` listing and `<repo>/resolve/<rev>/<file>`
//! with the Hub's headers (`x-repo-commit`, `etag`, `x-linked-etag` for LFS
//! files, `Content-Range` for range requests), plus faults on demand: a
//! connection dropped part-way through a file, corrupt bytes under the
//! right checksum, and gated repos that want a bearer token.

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One request the hub saw.
#[derive(Clone, Debug)]
pub struct Seen {
    /// The path, e.g. `/org/name/resolve/main/config.json`.
    pub path: String,
    /// The `Range` header, if any.
    pub range: Option<String>,
    /// The `Authorization` header, if any.
    pub auth: Option<String>,
}

#[derive(Default)]
struct Repo {
    commit: String,
    files: Vec<(String, Vec<u8>)>,
    token: Option<String>,
}

#[derive(Default)]
struct State {
    repos: HashMap<String, Repo>,
    seen: Vec<Seen>,
    /// (repo, file) → bytes after which the next full download drops.
    drop_after: HashMap<(String, String), usize>,
    /// (repo, file) served with one byte flipped.
    corrupt: Vec<(String, String)>,
}

/// A running fake hub; it stops when dropped.
pub struct FakeHub {
    /// The endpoint, e.g. `http://127.0.0.1:41234` (for `HF_ENDPOINT`).
    pub url: String,
    state: Arc<Mutex<State>>,
    _rt: tokio::runtime::Runtime,
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(b))
}

fn is_lfs(name: &str) -> bool {
    name.ends_with(".safetensors") || name.ends_with(".gguf") || name.ends_with(".bin")
}

impl FakeHub {
    /// Starts the hub on a free loopback port.
    pub fn start() -> FakeHub {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let state = Arc::new(Mutex::new(State::default()));
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let s = state.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap| {
            let s = s.clone();
            async move { handle(&s, uri, headers) }
        });
        rt.spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeHub {
            url,
            state,
            _rt: rt,
        }
    }

    /// Publishes `repo` (`org/name`) with `files` at `main`; with `token`,
    /// it is gated: requests without `Authorization: Bearer <token>` get 401.
    pub fn add_repo(&self, repo: &str, files: Vec<(String, Vec<u8>)>, token: Option<&str>) {
        let commit = sha256_hex(repo.as_bytes())[..40].to_owned();
        self.state.lock().unwrap().repos.insert(
            repo.to_owned(),
            Repo {
                commit,
                files,
                token: token.map(str::to_owned),
            },
        );
    }

    /// The commit hash `main` resolves to for `repo`.
    pub fn commit(&self, repo: &str) -> String {
        self.state.lock().unwrap().repos[repo].commit.clone()
    }

    /// The next download of `file` from byte 0 sends `after` bytes and
    /// then drops the connection.
    pub fn drop_once(&self, repo: &str, file: &str, after: usize) {
        self.state
            .lock()
            .unwrap()
            .drop_after
            .insert((repo.to_owned(), file.to_owned()), after);
    }

    /// Serve `file` with one byte changed (its checksum stays the true one).
    pub fn corrupt(&self, repo: &str, file: &str, on: bool) {
        let mut s = self.state.lock().unwrap();
        let key = (repo.to_owned(), file.to_owned());
        s.corrupt.retain(|k| *k != key);
        if on {
            s.corrupt.push(key);
        }
    }

    /// Every request so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }
}

fn handle(state: &Mutex<State>, uri: Uri, headers: HeaderMap) -> Response {
    let path = uri.path().to_owned();
    let header = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let mut s = state.lock().unwrap();
    s.seen.push(Seen {
        path: path.clone(),
        range: header("range"),
        auth: header("authorization"),
    });
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    // api/models/<org>/<name>/revision/<rev> or <org>/<name>/resolve/<rev>/<file>
    let (repo_id, file) = match parts.as_slice() {
        ["api", "models", org, name, ..] => (format!("{org}/{name}"), None),
        [org, name, "resolve", _rev, file] => (format!("{org}/{name}"), Some(file.to_string())),
        _ => return StatusCode::NOT_FOUND.into_response(),
    };
    let Some(repo) = s.repos.get(&repo_id) else {
        // As huggingface.co answers a request without a token for a repo
        // that does not exist.
        return (StatusCode::UNAUTHORIZED, "Repository not found").into_response();
    };
    if let Some(t) = &repo.token {
        if header("authorization").as_deref() != Some(&format!("Bearer {t}")) {
            return (
                StatusCode::UNAUTHORIZED,
                "Access to this repo is restricted",
            )
                .into_response();
        }
    }
    let commit = repo.commit.clone();
    let Some(file) = file else {
        let siblings: Vec<_> = repo
            .files
            .iter()
            .map(|(n, _)| serde_json::json!({ "rfilename": n }))
            .collect();
        let body = serde_json::json!({ "id": repo_id, "sha": commit, "siblings": siblings });
        return ([("content-type", "application/json")], body.to_string()).into_response();
    };
    let Some(bytes) = repo
        .files
        .iter()
        .find(|(n, _)| *n == file)
        .map(|(_, b)| b.clone())
    else {
        return (StatusCode::NOT_FOUND, "Entry not found").into_response();
    };
    let sha = sha256_hex(&bytes);
    let mut body = bytes;
    if s.corrupt.contains(&(repo_id.clone(), file.clone())) {
        if let Some(b) = body.last_mut() {
            *b ^= 0xff;
        }
    }
    let total = body.len();
    let range = header("range");
    let (start, end) = match range.as_deref().and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) => {
            let (a, b) = r.split_once('-').unwrap_or((r, ""));
            let a: usize = a.parse().unwrap_or(0);
            let b: usize = b.parse().unwrap_or(total.saturating_sub(1));
            (a, b.min(total.saturating_sub(1)))
        }
        None => (0, total.saturating_sub(1)),
    };
    if start >= total && total > 0 {
        return StatusCode::RANGE_NOT_SATISFIABLE.into_response();
    }
    let chunk = if total == 0 {
        Vec::new()
    } else {
        body[start..=end].to_vec()
    };
    let drop_after = if start == 0 && end + 1 == total {
        s.drop_after.remove(&(repo_id.clone(), file.clone()))
    } else {
        None
    };
    let mut resp = if let Some(n) = drop_after {
        // The headers promise the whole file; the body stops after `n`
        // bytes with an error, which aborts the connection.
        let first = Bytes::from(chunk[..n.min(chunk.len())].to_vec());
        let stream = futures_util::stream::iter(vec![
            Ok::<Bytes, std::io::Error>(first),
            Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "dropped",
            )),
        ]);
        Response::new(Body::from_stream(stream))
    } else {
        Response::new(Body::from(chunk.clone()))
    };
    let h = resp.headers_mut();
    let v = |s: String| HeaderValue::from_str(&s).expect("header");
    h.insert("x-repo-commit", v(commit));
    h.insert("accept-ranges", v("bytes".into()));
    h.insert("content-length", v((end + 1 - start).to_string()));
    if is_lfs(&file) {
        h.insert("x-linked-etag", v(format!("\"{sha}\"")));
        h.insert("etag", v(format!("\"{sha}\"")));
    } else {
        // A git object id, as the Hub sends for files kept in git.
        h.insert("etag", v(format!("\"{}\"", &sha[..40])));
    }
    if range.is_some() {
        h.insert("content-range", v(format!("bytes {start}-{end}/{total}")));
        *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
    }
    resp
}
