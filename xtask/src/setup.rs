//! `cargo xtask setup`: everything `crates/mlx-sys/build.rs` needs, made
//! idempotent. A second run checks stamps and touches nothing, so it works
//! offline.
//!
//! - system packages (cmake, g++, libclang for bindgen): installed with
//!   apt-get when running as root, otherwise named in the error;
//! - the MLX wheel pinned in the workspace `Cargo.toml`, checked by sha256,
//!   unpacked into `target/native/`;
//! - the mlx-c source from the crates.io `mlx-sys` package, which cargo
//!   downloads into its own cache; copied to `target/native/mlx-c`.

use crate::download;
use crate::workspace_root;
use anyhow::{bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// What `[workspace.metadata.mlx]` pins.
pub struct Pin {
    /// MLX version, e.g. "0.32.2".
    pub version: String,
    /// The crates.io package whose source carries mlx-c.
    pub mlx_c_crate: String,
    /// Its exact version.
    pub mlx_c_crate_version: String,
    /// Wheel URL for this platform.
    pub wheel_url: String,
    /// Wheel sha256 for this platform.
    pub wheel_sha256: String,
}

/// The platform key used in `[workspace.metadata.mlx.wheels]`.
pub fn platform() -> &'static str {
    match (std::env::consts::OS, std::env::consts::ARCH) {
        ("linux", "x86_64") => "linux-x86_64",
        ("linux", "aarch64") => "linux-aarch64",
        ("macos", "aarch64") => "macos-aarch64",
        _ => "unsupported",
    }
}

/// Reads the pin from the workspace manifest.
pub fn read_pin() -> Result<Pin> {
    let path = workspace_root().join("Cargo.toml");
    let doc: toml::Value = fs::read_to_string(&path)?
        .parse()
        .with_context(|| format!("{} is not valid TOML", path.display()))?;
    let mlx = doc
        .get("workspace")
        .and_then(|w| w.get("metadata"))
        .and_then(|m| m.get("mlx"))
        .with_context(|| format!("{} has no [workspace.metadata.mlx]", path.display()))?;
    let s = |v: Option<&toml::Value>, what: &str| -> Result<String> {
        v.and_then(|v| v.as_str())
            .map(str::to_owned)
            .with_context(|| format!("[workspace.metadata.mlx] lacks {what}"))
    };
    let plat = platform();
    let wheel = mlx
        .get("wheels")
        .and_then(|w| w.get(plat))
        .with_context(|| format!("no MLX wheel is pinned for platform {plat}"))?;
    Ok(Pin {
        version: s(mlx.get("version"), "version")?,
        mlx_c_crate: s(mlx.get("mlx-c-crate"), "mlx-c-crate")?,
        mlx_c_crate_version: s(mlx.get("mlx-c-crate-version"), "mlx-c-crate-version")?,
        wheel_url: s(wheel.get("url"), "wheels.<platform>.url")?,
        wheel_sha256: s(wheel.get("sha256"), "wheels.<platform>.sha256")?,
    })
}

/// `target/native`: what mlx-sys's build script reads (see
/// `.cargo/config.toml`).
pub fn native_dir() -> PathBuf {
    workspace_root().join("target/native")
}

/// Runs every setup step; returns the native folder.
pub fn setup() -> Result<PathBuf> {
    let pin = read_pin()?;
    system_packages()?;
    let native = native_dir();
    fs::create_dir_all(&native)?;
    install_wheel(&pin, &native)?;
    install_blas(&native)?;
    install_mlx_c(&pin, &native)?;
    Ok(native)
}

/// Which BLAS the staged CPU runtime uses (`MLEX_BLAS`): OpenBLAS unless
/// `reference` asks for the wheel's own netlib BLAS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlasChoice {
    /// Debian's `libopenblas0-pthread` in place of the wheel's BLAS/LAPACK.
    OpenBlas,
    /// The reference BLAS bundled with the wheel, as pip installs it.
    Reference,
}

impl BlasChoice {
    /// From `MLEX_BLAS` (`openblas`, the default on Linux, or `reference`).
    pub fn from_env() -> Result<BlasChoice> {
        if !cfg!(target_os = "linux") {
            return Ok(BlasChoice::Reference);
        }
        match std::env::var("MLEX_BLAS").as_deref() {
            Err(_) | Ok("") | Ok("openblas") => Ok(BlasChoice::OpenBlas),
            Ok("reference") => Ok(BlasChoice::Reference),
            Ok(other) => bail!("MLEX_BLAS is `{other}`; expected `openblas` or `reference`"),
        }
    }
}

/// Where Debian's `libopenblas0-pthread` puts its `libblas.so.3` and
/// `liblapack.so.3` (both front `libopenblas.so.0`).
fn openblas_dir() -> PathBuf {
    PathBuf::from(format!(
        "/usr/lib/{}-linux-gnu/openblas-pthread",
        std::env::consts::ARCH
    ))
}

const BLAS_LIBS: [&str; 2] = ["libblas.so.3", "liblapack.so.3"];

/// Puts OpenBLAS's BLAS and LAPACK in `native/blas/`, which the mlx-sys
/// build stages under the wheel's library names (the wheel links the
/// reference BLAS: OpenBLAS took SmolLM2-135M's CPU prefill from 14 to 357
/// tok/s); `MLEX_BLAS=reference` removes them.
fn install_blas(native: &Path) -> Result<()> {
    let dest = native.join("blas");
    if !cfg!(target_os = "linux") {
        return Ok(());
    }
    // The folder stays (empty for the reference BLAS): the mlx-sys build
    // watches it.
    fs::create_dir_all(&dest)?;
    if BlasChoice::from_env()? == BlasChoice::Reference {
        let mut removed = false;
        for lib in BLAS_LIBS {
            removed |= fs::remove_file(dest.join(lib)).is_ok();
        }
        if removed {
            eprintln!(
                "xtask: MLEX_BLAS=reference: the CPU runtime uses the wheel's reference BLAS"
            );
        }
        return Ok(());
    }
    let src = openblas_dir();
    for lib in BLAS_LIBS {
        let from = src.join(lib);
        let to = dest.join(lib);
        let same = match (download::sha256_file(&from), download::sha256_file(&to)) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if !same {
            // Beside, then renamed: the old file is hard-linked into the
            // staged runtimes, which running processes may have mapped.
            let tmp = to.with_extension(format!("tmp.{}", std::process::id()));
            fs::copy(&from, &tmp).with_context(|| {
                format!("copying {} (from libopenblas0-pthread)", from.display())
            })?;
            fs::rename(&tmp, &to)?;
        }
    }
    Ok(())
}

/// `LD_PRELOAD` for a Python that runs the wheel's MLX with the same BLAS
/// as the staged runtime (the reference venv, mlx-lm in benchmarks); `None`
/// with the reference BLAS.
pub fn blas_preload() -> Option<String> {
    let dir = native_dir().join("blas");
    let libs: Vec<String> = BLAS_LIBS
        .iter()
        .map(|l| dir.join(l))
        .filter(|p| p.is_file())
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    (libs.len() == BLAS_LIBS.len()).then(|| libs.join(":"))
}

fn succeeds(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// True when bindgen will find libclang and clang's own headers.
fn has_libclang() -> bool {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("LIBCLANG_PATH") {
        dirs.push(PathBuf::from(p));
    }
    if let Ok(entries) = fs::read_dir("/usr/lib") {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("llvm-") {
                dirs.push(e.path().join("lib"));
            }
        }
    }
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/local/lib",
        ]
        .map(PathBuf::from),
    );
    let lib = dirs.iter().any(|d| {
        fs::read_dir(d).is_ok_and(|mut it| {
            it.any(|e| {
                e.is_ok_and(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.starts_with("libclang") && n.contains(".so") && !n.contains("cpp")
                })
            })
        })
    });
    // clang's resource headers (stddef.h and friends) come separately.
    let headers = fs::read_dir("/usr/lib").is_ok_and(|it| {
        it.flatten().any(|e| {
            let clang = e.path().join("lib/clang");
            fs::read_dir(clang).is_ok_and(|vs| {
                vs.flatten()
                    .any(|v| v.path().join("include/stddef.h").exists())
            })
        })
    });
    lib && headers
}

/// The libclang version Debian's default `libclang-dev` points at.
fn debian_clang_version() -> String {
    let out = Command::new("apt-cache")
        .args(["depends", "libclang-dev"])
        .output();
    if let Ok(out) = out {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(rest) = line.trim().strip_prefix("Depends: libclang-") {
                if let Some(v) = rest.strip_suffix("-dev") {
                    return v.to_owned();
                }
            }
        }
    }
    "14".to_owned()
}

fn system_packages() -> Result<()> {
    if cfg!(target_os = "macos") {
        if !succeeds("cmake", &["--version"]) {
            bail!("cmake is missing: install it (`brew install cmake`) and run again");
        }
        return Ok(());
    }
    let mut missing_tools = Vec::new();
    if !succeeds("cmake", &["--version"]) {
        missing_tools.push("cmake");
    }
    // MLX's CPU backend also runs g++ at run time to build fused kernels.
    if !succeeds("g++", &["--version"]) {
        missing_tools.push("g++");
    }
    let need_clang = !has_libclang();
    let need_blas = BlasChoice::from_env()? == BlasChoice::OpenBlas
        && !BLAS_LIBS.iter().all(|l| openblas_dir().join(l).is_file());
    if missing_tools.is_empty() && !need_clang && !need_blas {
        return Ok(());
    }
    let mut packages: Vec<String> = missing_tools.iter().map(|s| s.to_string()).collect();
    if need_blas {
        // Its BLAS is 25x faster than the wheel's on the CPU; MLEX_BLAS=reference
        // keeps the wheel's.
        packages.push("libopenblas0-pthread".to_owned());
    }
    if need_clang {
        let v = debian_clang_version();
        packages.push(format!("libclang1-{v}"));
        packages.push(format!("libclang-common-{v}-dev"));
    }
    let list = packages.join(" ");
    let blas_hint = if need_blas {
        " (or set MLEX_BLAS=reference to keep the wheel's slow reference BLAS instead of libopenblas0-pthread)"
    } else {
        ""
    };
    if !succeeds("apt-get", &["--version"]) {
        bail!("missing system packages: {list} (cmake, a C++ compiler, libclang, OpenBLAS); install them and run again{blas_hint}");
    }
    if !is_root() {
        bail!("missing system packages; run `sudo apt-get install -y {list}` and then this command again{blas_hint}");
    }
    eprintln!("xtask: installing {list} with apt-get");
    let status = Command::new("apt-get")
        .args(["update", "-qq"])
        .status()
        .context("apt-get update")?;
    if !status.success() {
        bail!("`apt-get update` failed; install {list} by hand");
    }
    let status = Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&packages)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("apt-get install")?;
    if !status.success() {
        bail!("`apt-get install {list}` failed");
    }
    Ok(())
}

fn install_wheel(pin: &Pin, native: &Path) -> Result<()> {
    let stamp = native.join(".wheel-sha256");
    if fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == pin.wheel_sha256)
        && native.join("mlx/include/mlx/version.h").exists()
    {
        return Ok(());
    }
    let wheel = download::fetch_wheel(&pin.wheel_url, &pin.wheel_sha256)?;
    for old in ["mlx", "mlx_cpu.libs"] {
        let p = native.join(old);
        if p.exists() {
            fs::remove_dir_all(&p)?;
        }
    }
    // The mlx-c build cache is keyed by the mlx folder's path, not its
    // contents: a new wheel must not reuse it.
    let _ = fs::remove_dir_all(native.join("mlxc-build"));
    download::unzip(
        &wheel,
        &["mlx/lib/", "mlx/include/", "mlx/share/", "mlx_cpu.libs/"],
        native,
    )?;
    if !native.join("mlx/include/mlx/version.h").exists() {
        bail!("{} holds no mlx/include/mlx/version.h", wheel.display());
    }
    fs::write(&stamp, &pin.wheel_sha256)?;
    eprintln!(
        "xtask: MLX {} unpacked into {}",
        pin.version,
        native.display()
    );
    Ok(())
}

/// Has cargo download the crates.io package that carries mlx-c (a throwaway
/// manifest of its own, outside the workspace) and copies `src/mlx-c` out.
fn install_mlx_c(pin: &Pin, native: &Path) -> Result<()> {
    let dest = native.join("mlx-c");
    let stamp = native.join(".mlx-c-version");
    let want = format!("{} {}", pin.mlx_c_crate, pin.mlx_c_crate_version);
    if fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == want)
        && dest.join("CMakeLists.txt").exists()
    {
        return Ok(());
    }
    let probe = native.join("mlx-c-fetch");
    fs::create_dir_all(probe.join("src"))?;
    fs::write(
        probe.join("Cargo.toml"),
        format!(
            "[package]\nname = \"mlex-mlx-c-fetch\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
             [lib]\npath = \"src/lib.rs\"\n[dependencies]\n{} = {{ version = \"={}\", default-features = false }}\n\
             [workspace]\n",
            pin.mlx_c_crate, pin.mlx_c_crate_version
        ),
    )?;
    fs::write(probe.join("src/lib.rs"), "")?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = probe.join("Cargo.toml");
    eprintln!(
        "xtask: fetching the mlx-c source ({} {}) through cargo",
        pin.mlx_c_crate, pin.mlx_c_crate_version
    );
    // Run outside the workspace so that its [patch] does not apply.
    let status = Command::new(&cargo)
        .arg("fetch")
        .arg("--manifest-path")
        .arg(&manifest)
        .current_dir(&probe)
        .status()?;
    if !status.success() {
        bail!("`cargo fetch` of {} failed", pin.mlx_c_crate);
    }
    let out = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(&manifest)
        .current_dir(&probe)
        .output()?;
    if !out.status.success() {
        bail!(
            "`cargo metadata` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let manifest_path = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == pin.mlx_c_crate.as_str())
        .and_then(|p| p["manifest_path"].as_str())
        .context("cargo metadata does not list the mlx-c package")?;
    let src = Path::new(manifest_path).parent().unwrap().join("src/mlx-c");
    if !src.join("CMakeLists.txt").exists() {
        bail!("{} does not hold mlx-c", src.display());
    }
    if dest.exists() {
        fs::remove_dir_all(&dest)?;
    }
    copy_tree(&src, &dest)?;
    fs::write(&stamp, want)?;
    eprintln!("xtask: mlx-c source copied to {}", dest.display());
    Ok(())
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}
