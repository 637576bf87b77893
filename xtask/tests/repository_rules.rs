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

/// Every `.rs` file of the repository's own code (no build output).
fn own_rust_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    walk(&p, out);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "examples", "fuzz"] {
        walk(&root().join(dir), &mut files);
    }
    files.sort();
    files
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap().display().to_string()
}

/// Longest file, in lines.
const FILE_BUDGET: usize = 700;
/// Longest function, in lines.
const FN_BUDGET: usize = 120;

/// Files over the budget, each with why; an entry that fits again must go.
const LONG_FILES: &[(&str, &str)] = &[
    (
        "crates/mlex-models/src/spec.rs",
        "the spec interpreter: types, checks, plan and sanitize of one format",
    ),
    ("crates/mlex-generate/src/batch.rs", "the batched engine"),
    (
        "crates/mlex-core/src/nn.rs",
        "linear, fused linear, norms and quantization in one file: to be split",
    ),
    (
        "crates/mlex-cli/tests/cli.rs",
        "one end-to-end test per subcommand",
    ),
    (
        "crates/mlex-models/tests/bad_input.rs",
        "one test per kind of bad input",
    ),
];

/// Functions over the budget (`file::name`), each with why.
const LONG_FNS: &[(&str, &str)] = &[
    ("crates/mlex-models/src/layers/attention.rs::build", "every attention variant's weights and checks in one place"),
    ("crates/mlex-server/src/engine.rs::run", "one text stream for every front end (issue 24)"),
    ("crates/mlex-cli/src/commands/batch.rs::run", "one text stream for every front end (issue 24)"),
    ("crates/mlex-cli/src/commands/inspect.rs::run", "the readable plan of issue 24 replaces it"),
    ("crates/mlex-models/src/gguf_file.rs::decode", "one match over the GGUF tensor types"),
    ("crates/mlex-models/src/gguf_file.rs::read_header", "the header, field by field, with its checks"),
    ("crates/mlex-kernels/src/gated_delta/chunked.rs::chunked", "the chunked WY form in one place, as the paper writes it"),
    ("crates/mlex-models/src/spec.rs::plan", "the spec interpreter (issue 24)"),
    ("crates/mlex-cli/tests/serve.rs::chat_and_completions_answer_streamed_or_not_and_bad_requests_are_4xx", "one server process for every request shape"),
];

/// Every function (`fn` at the start of a line) with its length: from its
/// `fn` line to the `}` at the same indentation.
fn functions(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let indent = &l[..l.len() - t.len()];
        let rest = [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "const ",
            "async ",
            "unsafe ",
            "extern \"C\" ",
        ]
        .iter()
        .fold(t, |s, p| s.strip_prefix(p).unwrap_or(s));
        let Some(sig) = rest.strip_prefix("fn ") else {
            continue;
        };
        let name: String = sig
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // A declaration without a body (in a trait) ends with `;` first.
        let declared_only = lines[i..]
            .iter()
            .find(|x| x.contains('{') || x.trim_end().ends_with(';'))
            .is_some_and(|x| !x.contains('{'));
        if declared_only {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = lines[i..].iter().position(|x| *x == close) {
            out.push((name, end + 1));
        }
    }
    out
}

/// No file over 700 lines and no function over 120 outside the short lists
/// above, which say why; an entry that fits the budget again is removed.
#[test]
fn files_and_functions_stay_within_their_length_budgets() {
    let mut over = Vec::new();
    let mut long_files = Vec::new();
    let mut long_fns = Vec::new();
    for f in own_rust_files() {
        let r = rel(&f);
        let text = std::fs::read_to_string(&f).unwrap();
        let n = text.lines().count();
        if n > FILE_BUDGET {
            long_files.push(r.clone());
            if !LONG_FILES.iter().any(|(p, _)| *p == r) {
                over.push(format!("{r}: {n} lines (budget {FILE_BUDGET})"));
            }
        }
        for (name, len) in functions(&text) {
            let key = format!("{r}::{name}");
            if len > FN_BUDGET {
                long_fns.push(key.clone());
                if !LONG_FNS.iter().any(|(p, _)| *p == key) {
                    over.push(format!("{key}: {len} lines (budget {FN_BUDGET})"));
                }
            }
        }
    }
    for (p, _) in LONG_FILES {
        if !long_files.iter().any(|f| f == p) {
            over.push(format!("{p} fits the budget now: take it off LONG_FILES"));
        }
    }
    for (p, _) in LONG_FNS {
        if !long_fns.iter().any(|f| f == p) {
            over.push(format!("{p} fits the budget now: take it off LONG_FNS"));
        }
    }
    assert!(over.is_empty(), "{}", over.join("\n"));
}

/// Modules follow the file tree: no `#[path]` attribute.
#[test]
fn no_module_is_moved_with_a_path_attribute() {
    let offences: Vec<String> = own_rust_files()
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            text.lines()
                .enumerate()
                .filter(|(_, l)| l.trim_start().starts_with("#[path"))
                .map(|(i, l)| format!("{}:{}: {}", rel(f), i + 1, l.trim()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(offences.is_empty(), "{}", offences.join("\n"));
}

/// Every `MLEX_` environment variable the code reads is documented in the
/// README or under docs/.
#[test]
fn every_mlex_variable_is_documented() {
    let mut docs = std::fs::read_to_string(root().join("README.md")).unwrap();
    for e in std::fs::read_dir(root().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            docs.push_str(&std::fs::read_to_string(p).unwrap());
        }
    }
    let mut missing = std::collections::BTreeSet::new();
    let mut seen = 0;
    for f in own_rust_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("MLEX_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            rest = &rest[at + name.len()..];
            if name.len() <= "MLEX_".len() {
                continue;
            }
            seen += 1;
            if !docs.contains(&name) {
                missing.insert(format!("{name} (read in {})", rel(&f)));
            }
        }
    }
    assert!(seen > 5, "only {seen} MLEX_ names found");
    assert!(missing.is_empty(), "undocumented: {missing:?}");
}

/// Backend policy has one home: only `crates/mlex-core/src/dispatch.rs`
/// reads `MLEX_` variables at run time. Build scripts, the test kit (where
/// the fixtures are) and xtask are not the product's run time.
#[test]
fn only_the_dispatch_module_reads_mlex_variables() {
    let home = "crates/mlex-core/src/dispatch.rs";
    let exempt = |r: &str| {
        r == home
            || r.ends_with("build.rs")
            || r.starts_with("crates/mlex-testkit/")
            || r.starts_with("xtask/")
            || r.contains("/tests/")
    };
    let mut readers = Vec::new();
    let mut home_reads = 0;
    for f in own_rust_files() {
        let r = rel(&f);
        let text = std::fs::read_to_string(&f).unwrap();
        let reads = ["var(\"MLEX_", "var_os(\"MLEX_", "env!(\"MLEX_"]
            .iter()
            .map(|p| text.matches(p).count())
            .sum::<usize>();
        if r == home {
            home_reads = reads;
        } else if reads > 0 && !exempt(&r) {
            readers.push(r);
        }
    }
    // The rule sees the reads it is about.
    assert!(home_reads >= 4, "{home} reads {home_reads} MLEX_ variables");
    assert!(
        readers.is_empty(),
        "MLEX_ variables read outside {home}: {readers:?}"
    );
}

/// An item has one public path: a crate root does not both make a module
/// public and re-export items from it (`pub mod kv;` + `pub use kv::KvCache;`
/// gives `KvCache` two names).
#[test]
fn no_item_has_two_public_paths() {
    let mut roots = Vec::new();
    for dir in ["crates", "examples"] {
        for e in std::fs::read_dir(root().join(dir)).unwrap() {
            let lib = e.unwrap().path().join("src/lib.rs");
            if lib.is_file() {
                roots.push(lib);
            }
        }
    }
    let mut offences = Vec::new();
    let mut reexports = 0;
    for lib in &roots {
        let text = std::fs::read_to_string(lib).unwrap();
        let public: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("pub mod "))
            .map(|m| m.trim_end_matches(';').trim())
            .collect();
        for line in text.lines().filter(|l| l.trim().starts_with("pub use ")) {
            reexports += 1;
            let path = line.trim().trim_start_matches("pub use ");
            let first = path.split("::").next().unwrap_or("");
            if public.contains(&first) {
                offences.push(format!("{}: {}", rel(lib), line.trim()));
            }
        }
    }
    assert!(reexports >= 10, "only {reexports} re-exports found");
    assert!(
        offences.is_empty(),
        "items re-exported from a public module (two paths):\n{}",
        offences.join("\n")
    );
}

/// How ARCHITECTURE.md's backticked spans are checked: a path (it has a `/`
/// or ends like a source file) must exist under the repository root; an
/// identifier path must have its last segment in the code; anything else
/// (commands, flags, TOML tables, values) is not checked.
enum Named<'a> {
    Path(&'a str),
    Item(&'a str),
    Unchecked,
}

fn named(span: &str) -> Named<'_> {
    const SOURCE_ENDINGS: [&str; 7] = [".rs", ".toml", ".md", ".py", ".sh", ".cu", ".json"];
    if span.is_empty() || span.chars().any(char::is_whitespace) {
        return Named::Unchecked;
    }
    if span.contains('/') || SOURCE_ENDINGS.iter().any(|e| span.ends_with(e)) {
        // Placeholders and globs (`fuzz/corpus/<target>/`) name no one file.
        if span.contains(['*', '<', '{']) {
            return Named::Unchecked;
        }
        let path = span.split([':', '#']).next().unwrap_or_default();
        return Named::Path(path.trim_end_matches('/').trim_start_matches('/'));
    }
    // `a::b::C`, `f()`, `m!`: the last segment, without `!` and `()`.
    let item = span.strip_suffix("()").unwrap_or(span);
    let item = item.strip_suffix('!').unwrap_or(item);
    let is_identifier = |s: &str| {
        s.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    match item.rsplit("::").next() {
        Some(last) if item.split("::").all(is_identifier) => Named::Item(last),
        _ => Named::Unchecked,
    }
}

/// The single-backtick spans of `text` outside ``` fences, with their line
/// numbers; a span may not cross a line.
fn backticked_spans(text: &str, offences: &mut Vec<String>) -> Vec<(usize, String)> {
    let mut spans = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if fenced {
            continue;
        } else if line.matches('`').count() % 2 == 1 {
            offences.push(format!("line {}: a backtick without its pair", i + 1));
        } else {
            let parts = line.split('`').skip(1).step_by(2);
            spans.extend(parts.map(|s| (i + 1, s.to_owned())));
        }
    }
    if fenced {
        offences.push("a ``` fence is never closed".into());
    }
    spans
}

/// ARCHITECTURE.md is a short map that names only what exists: at most 250
/// lines, every backticked path present in the repository, and every
/// backticked identifier (its last `::` segment) a whole word of some `.rs`
/// file under crates/, xtask/ or examples/.
#[test]
fn architecture_md_names_only_what_exists() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let mut offences = Vec::new();
    let lines = text.lines().count();
    if lines > 250 {
        offences.push(format!(
            "{lines} lines (at most 250: measurements go to docs/BENCHMARKS.md)"
        ));
    }
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "examples"] {
        rust_files(&root().join(dir), &mut files);
    }
    let code: String = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let words: std::collections::HashSet<&str> = code
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    let (mut paths, mut items) = (0, 0);
    for (line, span) in backticked_spans(&text, &mut offences) {
        match named(&span) {
            Named::Path(path) => {
                paths += 1;
                if !root().join(path).exists() {
                    offences.push(format!("line {line}: `{span}`: there is no {path}"));
                }
            }
            Named::Item(name) => {
                items += 1;
                if !words.contains(name) {
                    offences.push(format!(
                        "line {line}: `{span}`: no .rs file under crates/, xtask/ or examples/ has the word {name}"
                    ));
                }
            }
            Named::Unchecked => {}
        }
    }
    // The rule sees what it is meant to see.
    if items < 50 || paths < 10 {
        offences.push(format!(
            "only {items} identifiers and {paths} paths found in backticks"
        ));
    }
    assert!(
        offences.is_empty(),
        "ARCHITECTURE.md:\n{}",
        offences.join("\n")
    );
}
