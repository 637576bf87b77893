//! Hugging Face Hub checkpoints: `org/name[@revision][:FILE.gguf | :QUANT]`
//! resolved from the cache that Python tools share (`$HF_HUB_CACHE`, else
//! `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), or downloaded into it.
//!
//! Downloads go through the `hf-hub` crate (blocking API on `ureq`): the
//! standard `blobs/`, `snapshots/<commit>/` and `refs/<revision>` layout, a
//! progress bar per file on a terminal, and resumption of a `.incomplete`
//! blob with an HTTP range request, both after a dropped connection within a
//! run and in the next run. What `hf-hub` does not do, this crate adds:
//! - only the files a model needs are fetched (config, tokenizer files and
//!   the safetensors, or the one GGUF asked for);
//! - every downloaded blob whose ETag is a sha256 (the Hub's LFS files) is
//!   hashed and removed again when it does not match;
//! - `HF_TOKEN` (then the cached token file), `HF_ENDPOINT` and
//!   `HF_HUB_OFFLINE=1` are honoured, and a 401 names `HF_TOKEN`.
#![deny(missing_docs)]

use mlex_core::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// What a repo id asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubSpec {
    /// `org/name`.
    pub repo: String,
    /// A branch, tag or commit (`main` unless `@revision` is given).
    pub revision: String,
    /// Which GGUF file, when the repo holds GGUF files.
    pub gguf: Option<GgufChoice>,
}

/// The GGUF file a spec selects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GgufChoice {
    /// `:model-Q4_K_M.gguf`: that file.
    File(String),
    /// `:Q4_K_M`: the one `.gguf` whose name carries this tag.
    Quant(String),
}

impl HubSpec {
    /// The spec as written: `org/name[@rev][:FILE.gguf|:QUANT]`.
    pub fn display(&self) -> String {
        let mut s = self.repo.clone();
        if self.revision != "main" {
            s += &format!("@{}", self.revision);
        }
        match &self.gguf {
            Some(GgufChoice::File(f)) | Some(GgufChoice::Quant(f)) => s + ":" + f,
            None => s,
        }
    }

    /// Parses `org/name[@revision][:FILE.gguf | :QUANT]`; `None` when `spec`
    /// does not have that shape (a local path, for instance).
    pub fn parse(spec: &str) -> Option<HubSpec> {
        if spec.starts_with('.') || spec.starts_with('/') || spec.starts_with('~') {
            return None;
        }
        let (rest, gguf) = match spec.split_once(':') {
            Some((r, sel)) if !sel.is_empty() => {
                let choice = if sel.to_ascii_lowercase().ends_with(".gguf") {
                    GgufChoice::File(sel.to_owned())
                } else {
                    GgufChoice::Quant(sel.to_owned())
                };
                (r, Some(choice))
            }
            Some(_) => return None,
            None => (spec, None),
        };
        let (repo, revision) = match rest.split_once('@') {
            Some((r, rev)) if !rev.is_empty() => (r, rev),
            Some(_) => return None,
            None => (rest, "main"),
        };
        let mut parts = repo.split('/');
        let ok = parts.clone().count() == 2
            && parts.all(|p| {
                !p.is_empty()
                    && p != ".."
                    && p.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            });
        ok.then(|| HubSpec {
            repo: repo.to_owned(),
            revision: revision.to_owned(),
            gguf,
        })
    }
}

/// Where a resolved checkpoint came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Already complete in the Hugging Face cache.
    Cache,
    /// Downloaded (at least one file) by this call.
    Downloaded,
}

/// A checkpoint in the cache: a snapshot directory or one GGUF file in it.
#[derive(Clone, Debug)]
pub struct Fetched {
    /// The snapshot directory (safetensors checkpoints) or the `.gguf` file.
    pub path: PathBuf,
    /// Whether it is a GGUF file.
    pub is_gguf: bool,
    /// Cache or downloaded.
    pub origin: Origin,
}

/// How to reach the Hub; [`HubConfig::from_env`] reads the usual variables.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// The cache (`.../hub`).
    pub cache_dir: PathBuf,
    /// The endpoint (`HF_ENDPOINT`, default `https://huggingface.co`).
    pub endpoint: String,
    /// The bearer token (`HF_TOKEN`, else `HUGGING_FACE_HUB_TOKEN`, else the
    /// token file beside the cache).
    pub token: Option<String>,
    /// Never touch the network (`HF_HUB_OFFLINE=1`).
    pub offline: bool,
    /// Show a progress bar per file (on a terminal).
    pub progress: bool,
}

/// The Hugging Face hub cache directory (`$HF_HUB_CACHE`, `$HF_HOME/hub`,
/// or `~/.cache/huggingface/hub`).
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("HF_HUB_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        return PathBuf::from(p).join("hub");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache/huggingface/hub")
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

impl HubConfig {
    /// From `HF_HUB_CACHE`/`HF_HOME`, `HF_ENDPOINT`, `HF_TOKEN` and
    /// `HF_HUB_OFFLINE`, as the Python `huggingface_hub` reads them.
    pub fn from_env() -> HubConfig {
        let cache_dir = cache_dir();
        let token = ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]
            .iter()
            .filter_map(|k| std::env::var(k).ok())
            .map(|t| t.trim().to_owned())
            .find(|t| !t.is_empty())
            .or_else(|| hf_hub::Cache::new(cache_dir.clone()).token());
        HubConfig {
            cache_dir,
            endpoint: std::env::var("HF_ENDPOINT")
                .ok()
                .map(|e| e.trim_end_matches('/').to_owned())
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "https://huggingface.co".to_owned()),
            token,
            offline: env_flag("HF_HUB_OFFLINE"),
            progress: true,
        }
    }
}

/// Files beside the weights that a checkpoint directory may need.
const SIDE_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
];

/// The files of `listing` that a model needs, or why none fit.
pub fn select_files(spec: &HubSpec, listing: &[String]) -> std::result::Result<Selection, String> {
    let ggufs: Vec<&String> = listing
        .iter()
        .filter(|f| f.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    let names = |v: &[&String]| v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
    if let Some(choice) = &spec.gguf {
        let hits: Vec<&String> = match choice {
            GgufChoice::File(f) => ggufs.iter().copied().filter(|g| *g == f).collect(),
            GgufChoice::Quant(q) => {
                let tokens = |s: &str| -> Vec<String> {
                    s.to_ascii_lowercase()
                        .trim_end_matches(".gguf")
                        .split(['-', '_', '.', '/'])
                        .map(str::to_owned)
                        .collect()
                };
                let tag = tokens(q);
                // A tag names the quant at the end of the name
                // (`Model-Q4_K_M.gguf`); failing that, anywhere in it.
                let at_end: Vec<&String> = ggufs
                    .iter()
                    .copied()
                    .filter(|g| tokens(g).ends_with(&tag))
                    .collect();
                if at_end.is_empty() {
                    ggufs
                        .iter()
                        .copied()
                        .filter(|g| tokens(g).windows(tag.len()).any(|w| w == tag.as_slice()))
                        .collect()
                } else {
                    at_end
                }
            }
        };
        return match hits.as_slice() {
            [one] => Ok(Selection::Gguf((*one).clone())),
            [] => Err(if ggufs.is_empty() {
                "the repo holds no .gguf file".to_owned()
            } else {
                format!("no .gguf file matches; the repo has {}", names(&ggufs))
            }),
            many => Err(format!(
                "{} .gguf files match ({}); name one as org/name:FILE.gguf",
                many.len(),
                names(many)
            )),
        };
    }
    if listing.iter().any(|f| f == "config.json") {
        let mut files: Vec<String> = listing
            .iter()
            .filter(|f| SIDE_FILES.contains(&f.as_str()) || f.ends_with(".safetensors"))
            // Subfolders hold other components (e.g. a vision tower or a
            // second format); the model's own files are at the top.
            .filter(|f| !f.contains('/'))
            .cloned()
            .collect();
        files.sort();
        if !files.iter().any(|f| f.ends_with(".safetensors")) {
            return Err(
                "the repo has a config.json but no .safetensors weights (only safetensors and GGUF are read)"
                    .to_owned(),
            );
        }
        return Ok(Selection::Dir(files));
    }
    match ggufs.as_slice() {
        [one] => Ok(Selection::Gguf((*one).clone())),
        [] => Err("the repo holds neither a config.json with safetensors nor a .gguf file".to_owned()),
        many => Err(format!(
            "the repo holds {} .gguf files ({}); choose one as org/name:FILE.gguf or by quant, e.g. org/name:Q4_K_M",
            many.len(),
            names(many)
        )),
    }
}

/// The files chosen for download.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selection {
    /// A checkpoint directory: these files of the snapshot.
    Dir(Vec<String>),
    /// One GGUF file.
    Gguf(String),
}

/// The snapshot directory `refs/<revision>` points at (or the revision
/// itself, for a commit hash).
fn snapshot_dir(cfg: &HubConfig, spec: &HubSpec) -> PathBuf {
    let root = cfg
        .cache_dir
        .join(format!("models--{}", spec.repo.replace('/', "--")));
    let commit = std::fs::read_to_string(root.join("refs").join(&spec.revision))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| spec.revision.clone());
    root.join("snapshots").join(commit)
}

/// A cached snapshot that needs no download: a GGUF asked for (or the only
/// one), or a directory with `config.json` and every shard its index names.
/// A download fetches `config.json` last, so a snapshot that has it is
/// complete.
fn cached(cfg: &HubConfig, spec: &HubSpec) -> Option<Fetched> {
    let snap = snapshot_dir(cfg, spec);
    let mut listing = Vec::new();
    list_files(&snap, "", 0, &mut listing);
    if listing.is_empty() {
        return None;
    }
    match select_files(spec, &listing).ok()? {
        Selection::Gguf(f) => Some(Fetched {
            path: snap.join(f),
            is_gguf: true,
            origin: Origin::Cache,
        }),
        Selection::Dir(_) => {
            let index = snap.join("model.safetensors.index.json");
            if index.is_file() {
                // Every shard the index names must be there: an interrupted
                // download leaves some out.
                let text = std::fs::read_to_string(&index).ok()?;
                let complete = shard_names(&text).iter().all(|s| snap.join(s).is_file());
                if !complete {
                    return None;
                }
            }
            Some(Fetched {
                path: snap,
                is_gguf: false,
                origin: Origin::Cache,
            })
        }
    }
}

/// The files under `dir` as repo paths (`Q4_K_M/x.gguf`), two levels deep.
fn list_files(dir: &Path, prefix: &str, depth: usize, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        let path = e.path();
        if path.is_dir() {
            if depth < 2 {
                list_files(&path, &format!("{prefix}{name}/"), depth + 1, out);
            }
        } else {
            out.push(format!("{prefix}{name}"));
        }
    }
}

/// The shard file names in an index's `weight_map`, without a JSON parser:
/// every quoted value after a `:` that ends in `.safetensors`.
fn shard_names(index: &str) -> Vec<String> {
    let mut out: Vec<String> = index
        .split('"')
        .filter(|s| s.ends_with(".safetensors"))
        .map(str::to_owned)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Resolves `spec` from the cache, downloading what is missing unless
/// offline.
pub fn fetch(spec: &HubSpec, cfg: &HubConfig) -> Result<Fetched> {
    if let Some(f) = cached(cfg, spec) {
        return Ok(f);
    }
    if cfg.offline {
        return Err(hub_err(
            spec,
            None,
            format!(
                "not in the Hugging Face cache at {} and HF_HUB_OFFLINE is set; unset it to download",
                snapshot_dir(cfg, spec).display()
            ),
        ));
    }
    let api = hf_hub::api::sync::ApiBuilder::from_cache(hf_hub::Cache::new(cfg.cache_dir.clone()))
        .with_endpoint(cfg.endpoint.clone())
        .with_token(cfg.token.clone())
        .with_progress(cfg.progress)
        .with_retries(4)
        .with_user_agent("mlex", env!("CARGO_PKG_VERSION"))
        .build()
        .map_err(|e| hub_err(spec, None, e.to_string()))?;
    let repo = api.repo(hf_hub::Repo::with_revision(
        spec.repo.clone(),
        hf_hub::RepoType::Model,
        spec.revision.clone(),
    ));
    let info = repo.info().map_err(|e| api_err(spec, None, cfg, e))?;
    let commit = info.sha.clone();
    let listing: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let selection = select_files(spec, &listing).map_err(|m| hub_err(spec, None, m))?;
    let mut files = match &selection {
        Selection::Dir(f) => f.clone(),
        Selection::Gguf(f) => vec![f.clone()],
    };
    // `config.json` last: a run cut off midway leaves a snapshot without
    // it, which `cached` does not take for a complete one.
    files.sort_by_key(|f| f == "config.json");
    // Every file from the commit the listing came from, even if the
    // branch moves meanwhile: one snapshot, not a mix.
    let repo = api.repo(hf_hub::Repo::with_revision(
        spec.repo.clone(),
        hf_hub::RepoType::Model,
        commit.clone(),
    ));
    let mut last = None;
    for f in &files {
        let pointer = repo.get(f).map_err(|e| api_err(spec, Some(f), cfg, e))?;
        verify(spec, f, &pointer)?;
        last = Some(pointer);
    }
    let pointer = last.expect("a selection names at least one file");
    write_ref(cfg, spec, &commit)?;
    Ok(match selection {
        Selection::Gguf(_) => Fetched {
            path: pointer,
            is_gguf: true,
            origin: Origin::Downloaded,
        },
        Selection::Dir(_) => Fetched {
            path: pointer
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| snapshot_dir(cfg, spec)),
            is_gguf: false,
            origin: Origin::Downloaded,
        },
    })
}

/// Points `refs/<revision>` at `commit` (temporary file, then rename), as
/// `huggingface_hub` does, so the next lookup finds the snapshot offline.
fn write_ref(cfg: &HubConfig, spec: &HubSpec, commit: &str) -> Result<()> {
    if spec.revision == commit {
        return Ok(());
    }
    let refs = cfg
        .cache_dir
        .join(format!("models--{}", spec.repo.replace('/', "--")))
        .join("refs");
    let path = refs.join(&spec.revision);
    let parent = path.parent().unwrap_or(&refs).to_path_buf();
    std::fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, commit).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
}

/// Checks a blob named by a sha256 ETag (the Hub's LFS files) against its
/// contents; a mismatch removes the blob and its pointer, so the next run
/// downloads it again instead of loading corrupt weights.
fn verify(spec: &HubSpec, file: &str, pointer: &Path) -> Result<()> {
    let Ok(blob) = std::fs::canonicalize(pointer) else {
        return Ok(());
    };
    let Some(etag) = blob.file_name().and_then(|n| n.to_str()) else {
        return Ok(());
    };
    if etag.len() != 64 || !etag.bytes().all(|b| b.is_ascii_hexdigit()) {
        // Small files are stored in git, not LFS: their ETag is a git hash
        // of the object, not of the bytes alone.
        return Ok(());
    }
    let got = sha256_file(&blob).map_err(|e| Error::io(&blob, e))?;
    if got.eq_ignore_ascii_case(etag) {
        return Ok(());
    }
    let _ = std::fs::remove_file(&blob);
    let _ = std::fs::remove_file(pointer);
    Err(hub_err(
        spec,
        Some(file),
        format!(
            "checksum mismatch: the Hub says sha256 {etag}, the download has {got}; the file was removed, run again to download it anew"
        ),
    ))
}

/// Hex sha256 of a file.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut h = Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut h)?;
    Ok(format!("{:x}", h.finalize()))
}

fn hub_err(spec: &HubSpec, file: Option<&str>, message: String) -> Error {
    Error::Hub {
        repo: if spec.revision == "main" {
            spec.repo.clone()
        } else {
            format!("{}@{}", spec.repo, spec.revision)
        },
        file: file.map(str::to_owned),
        message,
    }
}

fn api_err(
    spec: &HubSpec,
    file: Option<&str>,
    cfg: &HubConfig,
    e: hf_hub::api::sync::ApiError,
) -> Error {
    use hf_hub::api::sync::ApiError;
    let status = match &e {
        ApiError::RequestError(r) => match r.as_ref() {
            ureq::Error::StatusCode(s) => Some(*s),
            _ => None,
        },
        ApiError::TooManyRetries(inner) => match inner.as_ref() {
            ApiError::RequestError(r) => match r.as_ref() {
                ureq::Error::StatusCode(s) => Some(*s),
                _ => None,
            },
            _ => None,
        },
        _ => None,
    };
    let message = match status {
        Some(401) | Some(403) => format!(
            "HTTP {}: no such repo, or it is gated or private and the token lacks access (the Hub answers all three alike); check the name, and {} (tokens: https://huggingface.co/settings/tokens)",
            status.unwrap_or(401),
            if cfg.token.is_some() {
                "note that the token in HF_TOKEN (or the cached token file) was refused"
            } else {
                "for a gated repo set HF_TOKEN to a token with access"
            }
        ),
        Some(404) => format!(
            "HTTP 404 at {}: no such repo, revision `{}` or file",
            cfg.endpoint, spec.revision
        ),
        Some(s) => format!("HTTP {s} from {}", cfg.endpoint),
        None => format!(
            "{e} (endpoint {}; is the network reachable? HF_HUB_OFFLINE=1 uses only the cache)",
            cfg.endpoint
        ),
    };
    // `org/name` is also how a relative path looks; `fetch` is asked only
    // when no such path exists, so say that too.
    let message = match (status, file) {
        (Some(401) | Some(404), None) => format!(
            "{message} (and there is no local directory or file `{}`)",
            spec.display()
        ),
        _ => message,
    };
    hub_err(spec, file, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn specs_parse_with_revision_and_gguf_choice() {
        let p = HubSpec::parse("org/name@v1:model-Q4_K_M.gguf").unwrap();
        assert_eq!(p.repo, "org/name");
        assert_eq!(p.revision, "v1");
        assert_eq!(p.gguf, Some(GgufChoice::File("model-Q4_K_M.gguf".into())));
        let p = HubSpec::parse("org/name:q4_k_m").unwrap();
        assert_eq!(p.revision, "main");
        assert_eq!(p.gguf, Some(GgufChoice::Quant("q4_k_m".into())));
        for bad in [
            "./org/name",
            "/abs/path",
            "one",
            "a/b/c",
            "org/",
            "org/na me",
            "org/..",
            "org/n@",
            "org/n:",
        ] {
            assert_eq!(HubSpec::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn selection_takes_only_what_a_model_needs() {
        let spec = HubSpec::parse("o/n").unwrap();
        let needed = [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ];
        let others = [
            ".gitattributes",
            "README.md",
            "pytorch_model.bin",
            "onnx/model.safetensors",
        ];
        let listing = s(&[&others[..2], &needed, &others[2..]].concat());
        assert_eq!(
            select_files(&spec, &listing).unwrap(),
            Selection::Dir(s(&needed))
        );
        let ggufs = s(&["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-Q4_K_S.gguf"]);
        let q = HubSpec::parse("o/n:Q4_K_M").unwrap();
        assert_eq!(
            select_files(&q, &ggufs).unwrap(),
            Selection::Gguf("m-Q4_K_M.gguf".into())
        );
        let q = HubSpec::parse("o/n:Q4_K").unwrap();
        let err = select_files(&q, &ggufs).unwrap_err();
        assert!(err.contains("2 .gguf files match"), "{err}");
        let q = HubSpec::parse("o/n:Q5_K_M").unwrap();
        assert!(select_files(&q, &ggufs)
            .unwrap_err()
            .contains("no .gguf file matches"));
        let err = select_files(&spec, &ggufs).unwrap_err();
        assert!(
            err.contains("3 .gguf files") && err.contains("Q4_K_M"),
            "{err}"
        );
        let f = HubSpec::parse("o/n:m-Q8_0.gguf").unwrap();
        assert_eq!(
            select_files(&f, &ggufs).unwrap(),
            Selection::Gguf("m-Q8_0.gguf".into())
        );
        assert!(
            select_files(&spec, &s(&["config.json", "pytorch_model.bin"]))
                .unwrap_err()
                .contains("no .safetensors")
        );
    }
}
