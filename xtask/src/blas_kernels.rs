//! `cargo xtask blas-kernels` (the last step of `cargo xtask test`): the
//! reference fixtures and the parity tests again, under BLAS kernels other
//! than the ones this CPU picks.
//!
//! OpenBLAS chooses its kernels by CPU (and `OPENBLAS_CORETYPE`), and with
//! them the summation order of every product, so a check that holds bitwise
//! on the developers' CPUs can fail on another (mlx-lm's cached and
//! uncached prompt logits differed by 4.3e-6 on one AMD EPYC and agreed
//! bitwise on others). Forcing kernels this CPU can run, but did not pick,
//! puts the suite on "another CPU" on every machine: the fixture script's
//! self-checks (`fixtures.py`), and mlex on those kernels against the
//! references made on this CPU's own (`parity`, `batch`, `prefix_reuse`,
//! `speculative`: the tests that compare results across different
//! products).
//!
//! The kernels are ones the CPU can execute: the x86-64 baseline
//! (`Prescott`, SSE3) and the AVX family just below the one picked; on
//! aarch64 the generic `ARMV8` and `CortexA57`. With the wheel's reference
//! BLAS (`MLEX_BLAS=reference`) there is one kernel everywhere and nothing
//! to vary.

use crate::{fixtures, python, setup, workspace_root};
use anyhow::{bail, Context, Result};
use std::process::Command;

/// The suites run under each forced kernel (`--workspace`, so that the
/// features and so the build are those of the `cargo test --workspace`
/// before: nothing is compiled again).
const TESTS: &[&str] = &[
    "--workspace",
    "--test",
    "parity",
    "--test",
    "batch",
    "--test",
    "prefix_reuse",
    "--test",
    "speculative",
];

/// The kernel OpenBLAS runs with `coretype` forced (None: its own choice).
fn corename(coretype: Option<&str>) -> Result<String> {
    let py = python::venv_python()?;
    let lib = setup::native_dir().join("blas/libblas.so.3");
    let mut c = Command::new(py);
    c.args([
        "-c",
        "import ctypes, sys; l = ctypes.CDLL(sys.argv[1]); \
         l.openblas_get_corename.restype = ctypes.c_char_p; \
         print(l.openblas_get_corename().decode())",
    ])
    .arg(&lib);
    match coretype {
        Some(k) => c.env("OPENBLAS_CORETYPE", k),
        None => c.env_remove("OPENBLAS_CORETYPE"),
    };
    let out = c.output().context("asking OpenBLAS for its kernel")?;
    if !out.status.success() {
        bail!(
            "cannot ask {} for its kernel: {}",
            lib.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Kernels this CPU can run other than `native`, at most two.
fn alternatives(native: &str) -> Vec<&'static str> {
    let flags = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("flags") || l.starts_with("Features"))
                .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        })
        .unwrap_or_default();
    let has = |f: &str| flags.iter().any(|x| x == f);
    let ladder: Vec<&'static str> = if cfg!(target_arch = "x86_64") {
        // From the newest family this CPU runs down to the baseline.
        let mut l = Vec::new();
        if has("avx512f") && has("avx512vl") && has("avx512bw") && has("avx512dq") {
            l.push("SkylakeX");
        }
        if has("avx2") && has("fma") {
            l.push("Haswell");
        }
        if has("avx") {
            l.push("Sandybridge");
        }
        l.push("Nehalem");
        l.push("Prescott");
        l
    } else if cfg!(target_arch = "aarch64") {
        vec!["CortexA57", "ARMV8"]
    } else {
        Vec::new()
    };
    // The baseline, and the family just below the one picked (or the
    // newest this CPU runs, when the pick is off the ladder, e.g. Zen).
    let below = match ladder.iter().position(|k| k.eq_ignore_ascii_case(native)) {
        Some(i) => ladder.get(i + 1).copied(),
        None => ladder.first().copied(),
    };
    let mut out: Vec<&'static str> = below.into_iter().collect();
    if let Some(base) = ladder.last() {
        if !out.contains(base) && !base.eq_ignore_ascii_case(native) {
            out.push(base);
        }
    }
    out
}

/// Runs the fixture script and the cross-product tests under each
/// alternative kernel.
pub fn blas_kernels() -> Result<()> {
    if setup::blas_preload().is_none() {
        eprintln!(
            "xtask: blas-kernels: the reference BLAS has one kernel on every CPU; nothing to vary"
        );
        return Ok(());
    }
    let native = corename(None)?;
    let alts = alternatives(&native);
    if alts.is_empty() {
        bail!("blas-kernels: no other OpenBLAS kernel is known for this CPU (picked: {native})");
    }
    let root = workspace_root();
    let gguf = crate::assets::smollm2_gguf()?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // The references the tests read were made on the native kernels.
    let references = fixtures::fixtures()?;
    for k in alts {
        let got = corename(Some(k))?;
        if !got.eq_ignore_ascii_case(k) {
            bail!(
                "OPENBLAS_CORETYPE={k} runs `{got}` kernels: the staged OpenBLAS cannot force it"
            );
        }
        eprintln!(
            "xtask: blas-kernels: {k} in place of {native}: the fixture script's self-checks"
        );
        let out = root.join(format!("target/fixtures-under-{k}"));
        let _ = std::fs::remove_dir_all(&out);
        if !fixtures::fixture_script(&out, &gguf, Some(k))?.success() {
            bail!("xtask/py/fixtures.py failed under OPENBLAS_CORETYPE={k} (it passed under {native})");
        }
        let _ = std::fs::remove_dir_all(&out);
        eprintln!(
            "xtask: blas-kernels: {k}: mlex against the references made on {native} ({})",
            references.display()
        );
        let status = Command::new(&cargo)
            .arg("test")
            .args(TESTS)
            .current_dir(&root)
            .env("OPENBLAS_CORETYPE", k)
            .status()?;
        if !status.success() {
            bail!("the parity tests failed under OPENBLAS_CORETYPE={k} (kernels other than this CPU's {native})");
        }
    }
    Ok(())
}
