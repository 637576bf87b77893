//! Repository rules, checked as tests (as rust-analyzer's tidy tests do).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// A test that needs a fixture fails when it is missing (with the command
/// that makes it); none turns a missing fixture into an early return.
#[test]
fn no_test_skips_a_missing_fixture() {
    let mut files = Vec::new();
    for dir in ["crates", "examples"] {
        rust_files(&root().join(dir), &mut files);
    }
    let helpers = [
        "fixture(",
        "fixtures(",
        "fixture_path(",
        "copy_fixture(",
        "smollm2(",
    ];
    let mut offences = Vec::new();
    for f in files.iter().filter(|f| {
        let s = f.to_string_lossy();
        s.contains("/tests/") || s.contains("/benches/")
    }) {
        let text = std::fs::read_to_string(f).unwrap();
        for (i, line) in text.lines().enumerate() {
            let l = line.trim();
            let skips = l.starts_with("let Some(") && l.contains("else");
            let optional = l.contains(")?;") || l.contains(").ok()");
            if helpers.iter().any(|h| l.contains(h)) && (skips || optional) {
                offences.push(format!("{}:{}: {l}", f.display(), i + 1));
            }
        }
    }
    assert!(
        offences.is_empty(),
        "tests that skip when a fixture is missing:\n{}",
        offences.join("\n")
    );
    // The rule sees what it is meant to see.
    assert!(files
        .iter()
        .any(|f| f.ends_with("crates/mlex-models/tests/parity.rs")));
}

/// Every library crate denies missing docs, so an undocumented public item
/// fails the build (the test command builds every crate), not only clippy.
#[test]
fn every_library_crate_denies_missing_docs() {
    // Bindgen output, and helpers that only tests link.
    let exempt = ["crates/mlx-sys", "crates/mlex-testkit"];
    let mut checked = 0;
    for dir in ["crates", "examples"] {
        for e in std::fs::read_dir(root().join(dir)).unwrap() {
            let krate = e.unwrap().path();
            let lib = krate.join("src/lib.rs");
            let rel = krate.strip_prefix(root()).unwrap().display().to_string();
            if !lib.is_file() || exempt.contains(&rel.as_str()) {
                continue;
            }
            let text = std::fs::read_to_string(&lib).unwrap();
            assert!(
                text.contains("#![deny(missing_docs)]"),
                "{rel}/src/lib.rs must have #![deny(missing_docs)]"
            );
            checked += 1;
        }
    }
    assert!(checked >= 11, "only {checked} library crates found");
}
