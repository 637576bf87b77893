//! Builds mlx-c against the MLX shared library from the PyPI wheel and
//! generates the bindings mlx-rs expects.
//!
//! Inputs come from `cargo xtask setup`, which fills `$MLEX_NATIVE_DIR`
//! (set by the workspace's `.cargo/config.toml`):
//! - `mlx/` (`lib/`, `include/`, `share/cmake/MLX/`) and, on Linux,
//!   `mlx_cpu.libs/`: the unpacked wheel;
//! - `mlx-c/`: the mlx-c source of the crates.io `mlx-sys` package.
//!
//! The static `libmlxc.a` is cached in `$MLEX_NATIVE_DIR/mlxc-build/<hash>`,
//! keyed by everything that goes into it, so that another profile or a
//! `cargo test -p` does not rebuild it. The runtime libraries are staged
//! beside the binaries (`target/<profile>/mlx/lib`), where the run path set
//! in `.cargo/config.toml` finds them.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=MLEX_NATIVE_DIR");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=native");

    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let workspace_manifest = manifest_dir.join("../../Cargo.toml");
    println!("cargo:rerun-if-changed={}", workspace_manifest.display());
    let pin = read_pin(&workspace_manifest);

    let native = match env::var_os("MLEX_NATIVE_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => fail(
            "MLEX_NATIVE_DIR is not set. Build inside the mlex workspace (its \
             .cargo/config.toml sets it) after running `cargo xtask setup`.",
        ),
    };
    let mlx_dir = native.join("mlx");
    let mlx_c = native.join("mlx-c");
    for needed in [
        mlx_dir.join("include/mlx/version.h"),
        mlx_c.join("CMakeLists.txt"),
    ] {
        if !needed.exists() {
            fail(&format!(
                "{} is missing: MLX is not set up. Run `cargo xtask setup` \
                 (it downloads the pinned MLX {pin} wheel and the mlx-c source).",
                needed.display()
            ));
        }
        println!("cargo:rerun-if-changed={}", needed.display());
    }
    check_versions(&pin, &mlx_dir, &mlx_c);

    let mlxc_lib = build_mlx_c(&native, &mlx_dir, &mlx_c, &manifest_dir);
    println!("cargo:rustc-link-search=native={}", mlxc_lib.display());
    println!("cargo:rustc-link-lib=static=mlxc");
    println!(
        "cargo:rustc-link-search=native={}",
        mlx_dir.join("lib").display()
    );
    println!("cargo:rustc-link-lib=dylib=mlx");
    if target_os() == "macos" {
        println!("cargo:rustc-link-lib=dylib=c++");
    } else {
        println!("cargo:rustc-link-lib=dylib=stdc++");
    }
    // Published for dependents' build scripts as DEP_MLX_LIB_DIR/VERSION.
    println!("cargo:lib_dir={}", mlx_dir.join("lib").display());
    println!("cargo:version={pin}");

    generate_bindings(&mlx_c, &manifest_dir);
    stage_runtime(&native, &mlx_dir);
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    panic!("mlx-sys: {message}");
}

fn target_os() -> String {
    env::var("CARGO_CFG_TARGET_OS").unwrap_or_default()
}

/// The MLX version pinned in the workspace's `[workspace.metadata.mlx]`.
fn read_pin(workspace_manifest: &Path) -> String {
    let text = fs::read_to_string(workspace_manifest).unwrap_or_else(|e| {
        fail(&format!(
            "cannot read {}: {e}",
            workspace_manifest.display()
        ))
    });
    let doc: toml::Value = text
        .parse()
        .unwrap_or_else(|e| fail(&format!("{}: {e}", workspace_manifest.display())));
    doc.get("workspace")
        .and_then(|w| w.get("metadata"))
        .and_then(|m| m.get("mlx"))
        .and_then(|m| m.get("version"))
        .and_then(|v| v.as_str())
        .map(str::to_owned)
        .unwrap_or_else(|| {
            fail(&format!(
                "{} has no [workspace.metadata.mlx] version",
                workspace_manifest.display()
            ))
        })
}

/// The wheel, the workspace pin and mlx-c's own pin must name one MLX.
fn check_versions(pin: &str, mlx_dir: &Path, mlx_c: &Path) {
    let header = fs::read_to_string(mlx_dir.join("include/mlx/version.h")).unwrap();
    let part = |name: &str| {
        header
            .lines()
            .find_map(|l| l.trim().strip_prefix(&format!("#define {name} ")))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| fail(&format!("no {name} in the wheel's mlx/version.h")))
    };
    let wheel = format!(
        "{}.{}.{}",
        part("MLX_VERSION_MAJOR"),
        part("MLX_VERSION_MINOR"),
        part("MLX_VERSION_PATCH")
    );
    let cmake = fs::read_to_string(mlx_c.join("CMakeLists.txt")).unwrap();
    let mlx_c_pin = cmake
        .lines()
        .find_map(|l| l.trim().strip_prefix("GIT_TAG v"))
        .map(|v| v.trim_end_matches(')').trim().to_owned())
        .unwrap_or_else(|| fail("mlx-c's CMakeLists.txt names no MLX GIT_TAG"));
    if wheel != pin || mlx_c_pin != pin {
        fail(&format!(
            "MLX version mismatch: the workspace pins {pin}, the wheel in {} is {wheel}, \
             and mlx-c in {} expects {mlx_c_pin}. Run `cargo xtask setup` after changing \
             the pin; the pin and mlx-c's must agree.",
            mlx_dir.display(),
            mlx_c.display()
        ));
    }
}

/// FNV-1a, enough to key a build cache.
fn fnv(hash: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *hash ^= u64::from(*b);
        *hash = hash.wrapping_mul(0x100000001b3);
    }
}

fn hash_tree(hash: &mut u64, root: &Path, dir: &Path) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", dir.display())))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            hash_tree(hash, root, &path);
        } else {
            fnv(
                hash,
                path.strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .as_bytes(),
            );
            fnv(hash, &fs::read(&path).unwrap());
        }
    }
}

/// Builds (or reuses) `libmlxc.a`; returns the folder holding it.
fn build_mlx_c(native: &Path, mlx_dir: &Path, mlx_c: &Path, manifest_dir: &Path) -> PathBuf {
    let compat = manifest_dir.join("native/mlx_c_compat.h");
    let mut hash = 0xcbf29ce484222325_u64;
    hash_tree(&mut hash, mlx_c, &mlx_c.join("mlx/c"));
    fnv(&mut hash, &fs::read(mlx_c.join("CMakeLists.txt")).unwrap());
    fnv(&mut hash, &fs::read(&compat).unwrap());
    fnv(&mut hash, mlx_dir.to_string_lossy().as_bytes());
    fnv(&mut hash, env::var("TARGET").unwrap().as_bytes());
    let key = format!("{hash:016x}");
    let cache = native.join("mlxc-build").join(&key);
    let lib_dir = cache.join("lib");
    if lib_dir.join("libmlxc.a").exists() {
        return lib_dir;
    }

    let mut config = cmake::Config::new(mlx_c);
    config
        .out_dir(&cache)
        .profile("Release")
        .define("MLX_C_USE_SYSTEM_MLX", "ON")
        .define("MLX_DIR", mlx_dir.join("share/cmake/MLX"))
        .define("MLX_C_BUILD_EXAMPLES", "OFF")
        .define("BUILD_SHARED_LIBS", "OFF")
        .define("CMAKE_INSTALL_LIBDIR", "lib")
        .cxxflag(format!("-include {}", compat.display()));
    config.build();
    if !lib_dir.join("libmlxc.a").exists() {
        fail(&format!(
            "the mlx-c build finished but {} has no libmlxc.a",
            lib_dir.display()
        ));
    }
    lib_dir
}

fn generate_bindings(mlx_c: &Path, manifest_dir: &Path) {
    let mut headers: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "h"))
        .collect();
    headers.sort();
    // Same settings as upstream mlx-sys 0.7.0, so mlx-rs sees the same API.
    let mut builder = bindgen::Builder::default()
        .rust_target("1.73.0".parse().expect("rust target"))
        .clang_arg(format!("-I{}", mlx_c.display()))
        .blocklist_function("malloc")
        .blocklist_function("realloc");
    if env::var("CARGO_CFG_TARGET_ARCH").as_deref() != Ok("aarch64") {
        builder = builder.header(
            manifest_dir
                .join("native/bindgen_prelude.h")
                .to_string_lossy(),
        );
    }
    for header in &headers {
        builder = builder.header(header.to_string_lossy());
    }
    let bindings = builder
        .generate()
        .unwrap_or_else(|e| fail(&format!("bindgen failed on the mlx-c headers: {e}")));
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bindings.rs");
    bindings
        .write_to_file(&out)
        .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", out.display())));
}

/// Copies the runtime libraries next to the binaries of this profile
/// (`target/<profile>/`), where the run path finds them:
/// `mlx/lib/libmlx.*` (+ `mlx.metallib` on macOS) and, on Linux, the
/// wheel's BLAS/LAPACK in `mlx_cpu.libs/` where libmlx's own run path
/// (`$ORIGIN/../../mlx_cpu.libs`) expects them.
fn stage_runtime(native: &Path, mlx_dir: &Path) {
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    // OUT_DIR = target/<profile>/build/mlx-sys-<hash>/out
    let Some(profile_dir) = out_dir.ancestors().nth(3) else {
        return;
    };
    let dest = profile_dir.join("mlx/lib");
    fs::create_dir_all(&dest).unwrap();
    for entry in fs::read_dir(mlx_dir.join("lib")).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            sync_file(&path, &dest.join(path.file_name().unwrap()));
        }
    }
    let libs = native.join("mlx_cpu.libs");
    // `cargo xtask setup` puts OpenBLAS's libblas.so.3 and liblapack.so.3
    // here (unless MLEX_BLAS=reference); they take the place of the wheel's
    // reference BLAS/LAPACK under the names libmlx was linked against.
    let blas = native.join("blas");
    // A missing path would rerun this script on every build; setup always
    // makes the folder on Linux (empty with MLEX_BLAS=reference).
    if blas.is_dir() {
        println!("cargo:rerun-if-changed={}", blas.display());
    }
    if libs.is_dir() {
        let dest = profile_dir.join("mlx_cpu.libs");
        fs::create_dir_all(&dest).unwrap();
        for entry in fs::read_dir(&libs).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let replacement = if name.starts_with("libblas-") {
                Some(blas.join("libblas.so.3"))
            } else if name.starts_with("liblapack-") {
                Some(blas.join("liblapack.so.3"))
            } else {
                None
            };
            let from = replacement.filter(|p| p.is_file()).unwrap_or(path);
            sync_file(&from, &dest.join(&name));
        }
    }
}

fn sync_file(from: &Path, to: &Path) {
    let same = match (fs::metadata(from), fs::metadata(to)) {
        (Ok(a), Ok(b)) => a.len() == b.len() && a.modified().ok() <= b.modified().ok(),
        _ => false,
    };
    if same {
        return;
    }
    let _ = fs::remove_file(to);
    if fs::hard_link(from, to).is_err() {
        fs::copy(from, to).unwrap_or_else(|e| {
            fail(&format!(
                "cannot stage {} at {}: {e}",
                from.display(),
                to.display()
            ))
        });
    }
}
