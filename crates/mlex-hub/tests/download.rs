//! Downloads from a Hub lookalike on loopback (`mlex_testkit::hub`): only
//! the files a model needs, the standard cache layout, a dropped connection
//! resumed with a range request, a corrupt file refused, a gated repo and
//! its token, offline mode, and GGUF selection by file or quant tag.

use mlex_hub::{fetch, HubConfig, HubSpec, Origin};
use mlex_testkit::assert_mentions;
use mlex_testkit::hub::FakeHub;
use std::path::Path;

fn config(hub: &FakeHub, cache: &Path) -> HubConfig {
    HubConfig {
        cache_dir: cache.to_owned(),
        endpoint: hub.url.clone(),
        token: None,
        offline: false,
        progress: false,
    }
}

/// Deterministic bytes that are not all alike (a shifted LCG).
fn blob(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect()
}

fn checkpoint_files() -> Vec<(String, Vec<u8>)> {
    vec![
        (
            ".gitattributes".into(),
            b"*.safetensors filter=lfs".to_vec(),
        ),
        ("README.md".into(), b"# tiny".to_vec()),
        ("config.json".into(), br#"{"model_type":"llama"}"#.to_vec()),
        ("tokenizer.json".into(), br#"{"version":"1.0"}"#.to_vec()),
        ("tokenizer_config.json".into(), b"{}".to_vec()),
        ("model.safetensors".into(), blob(3 << 20, 7)),
        ("pytorch_model.bin".into(), blob(1 << 20, 8)),
        ("onnx/model.safetensors".into(), blob(1 << 10, 9)),
    ]
}

fn file_paths(seen: &[mlex_testkit::hub::Seen]) -> Vec<String> {
    seen.iter()
        .filter(|s| s.path.contains("/resolve/"))
        .map(|s| s.path.rsplit('/').next().unwrap().to_owned())
        .collect()
}

#[test]
fn a_checkpoint_downloads_only_its_files_into_the_standard_layout_and_resumes_a_dropped_one() {
    let hub = FakeHub::start();
    hub.add_repo("org/tiny", checkpoint_files(), None);
    // The weights' first download stops after 1 MB of 3.
    hub.drop_once("org/tiny", "model.safetensors", 1 << 20);
    let cache = tempfile::tempdir().unwrap();
    let cfg = config(&hub, cache.path());
    let spec = HubSpec::parse("org/tiny").unwrap();
    let got = fetch(&spec, &cfg).unwrap();
    assert_eq!(got.origin, Origin::Downloaded);
    assert!(!got.is_gguf);
    let commit = hub.commit("org/tiny");
    let root = cache.path().join("models--org--tiny");
    assert_eq!(got.path, root.join("snapshots").join(&commit));
    assert_eq!(
        std::fs::read_to_string(root.join("refs/main"))
            .unwrap()
            .trim(),
        commit
    );
    let mut names: Vec<String> = std::fs::read_dir(&got.path)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    // The snapshot entries point into blobs/, the weights under their sha256.
    let weights = std::fs::read(got.path.join("model.safetensors")).unwrap();
    assert_eq!(weights, blob(3 << 20, 7));
    let target = std::fs::read_link(got.path.join("model.safetensors")).unwrap();
    assert!(target.to_string_lossy().contains("blobs/"), "{target:?}");
    let seen = hub.seen();
    let fetched = file_paths(&seen);
    for absent in ["README.md", "pytorch_model.bin", ".gitattributes"] {
        assert!(
            !fetched.iter().any(|f| f == absent),
            "{absent} was fetched: {fetched:?}"
        );
    }
    // After the drop, the download went on from where it stopped.
    let resumed: Vec<_> = seen
        .iter()
        .filter(|s| s.path.ends_with("/model.safetensors"))
        .filter_map(|s| s.range.as_deref())
        .filter_map(|r| r.strip_prefix("bytes="))
        .filter_map(|r| r.strip_suffix('-'))
        .filter_map(|a| a.parse::<usize>().ok())
        .filter(|a| *a > 0)
        .collect();
    assert!(
        resumed.iter().any(|a| *a >= 1 << 20),
        "no range request resumed the weights: {seen:?}"
    );

    // A second run finds everything in the cache and asks the hub nothing.
    let before = hub.seen().len();
    let again = fetch(&spec, &cfg).unwrap();
    assert_eq!(again.origin, Origin::Cache);
    assert_eq!(again.path, got.path);
    assert_eq!(hub.seen().len(), before);
}

#[test]
fn a_corrupt_download_is_refused_and_removed_then_fetched_anew() {
    let hub = FakeHub::start();
    hub.add_repo("org/tiny", checkpoint_files(), None);
    hub.corrupt("org/tiny", "model.safetensors", true);
    let cache = tempfile::tempdir().unwrap();
    let cfg = config(&hub, cache.path());
    let spec = HubSpec::parse("org/tiny").unwrap();
    let err = fetch(&spec, &cfg).unwrap_err().to_string();
    assert_mentions(&err, &["model.safetensors", "checksum mismatch"]);
    let snap = cache
        .path()
        .join("models--org--tiny/snapshots")
        .join(hub.commit("org/tiny"));
    assert!(!snap.join("model.safetensors").exists());
    // config.json comes last, so the cut-short snapshot is not taken for a
    // complete one.
    assert!(!snap.join("config.json").exists());
    hub.corrupt("org/tiny", "model.safetensors", false);
    let got = fetch(&spec, &cfg).unwrap();
    assert_eq!(
        std::fs::read(got.path.join("model.safetensors")).unwrap(),
        blob(3 << 20, 7)
    );
}

#[test]
fn a_gated_repo_asks_for_hf_token_and_opens_with_it() {
    let hub = FakeHub::start();
    hub.add_repo("org/gated", checkpoint_files(), Some("hf_good"));
    let cache = tempfile::tempdir().unwrap();
    let mut cfg = config(&hub, cache.path());
    let spec = HubSpec::parse("org/gated").unwrap();
    let err = fetch(&spec, &cfg).unwrap_err().to_string();
    assert_mentions(&err, &["org/gated", "401", "set HF_TOKEN"]);
    cfg.token = Some("hf_wrong".into());
    let err = fetch(&spec, &cfg).unwrap_err().to_string();
    assert_mentions(&err, &["HF_TOKEN", "refused"]);
    cfg.token = Some("hf_good".into());
    let got = fetch(&spec, &cfg).unwrap();
    assert!(got.path.join("config.json").is_file());
    assert!(hub
        .seen()
        .iter()
        .filter(|s| s.path.contains("/resolve/"))
        .all(|s| s.auth.is_some()));
}

#[test]
fn offline_mode_reads_the_cache_and_never_the_network() {
    let hub = FakeHub::start();
    hub.add_repo("org/tiny", checkpoint_files(), None);
    let cache = tempfile::tempdir().unwrap();
    let mut cfg = config(&hub, cache.path());
    cfg.offline = true;
    let spec = HubSpec::parse("org/tiny").unwrap();
    let err = fetch(&spec, &cfg).unwrap_err().to_string();
    assert_mentions(&err, &["HF_HUB_OFFLINE", "org/tiny"]);
    assert!(hub.seen().is_empty());
    cfg.offline = false;
    fetch(&spec, &cfg).unwrap();
    cfg.offline = true;
    let n = hub.seen().len();
    assert_eq!(fetch(&spec, &cfg).unwrap().origin, Origin::Cache);
    assert_eq!(hub.seen().len(), n);
}

#[test]
fn a_gguf_repo_downloads_the_one_file_asked_for() {
    let hub = FakeHub::start();
    hub.add_repo(
        "org/tiny-gguf",
        vec![
            ("README.md".into(), b"#".to_vec()),
            ("tiny-Q4_K_M.gguf".into(), blob(4096, 1)),
            ("tiny-Q8_0.gguf".into(), blob(8192, 2)),
        ],
        None,
    );
    let cache = tempfile::tempdir().unwrap();
    let cfg = config(&hub, cache.path());
    let err = fetch(&HubSpec::parse("org/tiny-gguf").unwrap(), &cfg)
        .unwrap_err()
        .to_string();
    assert_mentions(&err, &["tiny-Q4_K_M.gguf", "org/name:Q4_K_M"]);
    let got = fetch(&HubSpec::parse("org/tiny-gguf:Q8_0").unwrap(), &cfg).unwrap();
    assert!(got.is_gguf);
    assert_eq!(std::fs::read(&got.path).unwrap(), blob(8192, 2));
    let fetched = file_paths(&hub.seen());
    assert!(
        !fetched.is_empty() && fetched.iter().all(|f| f == "tiny-Q8_0.gguf"),
        "{fetched:?}"
    );
    let got = fetch(
        &HubSpec::parse("org/tiny-gguf:tiny-Q4_K_M.gguf").unwrap(),
        &cfg,
    )
    .unwrap();
    assert_eq!(std::fs::read(&got.path).unwrap(), blob(4096, 1));
    let err = fetch(&HubSpec::parse("org/absent").unwrap(), &cfg)
        .unwrap_err()
        .to_string();
    assert_mentions(&err, &["org/absent", "401", "no such repo"]);
}
