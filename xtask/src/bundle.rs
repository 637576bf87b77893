//! `cargo xtask cuda-bundle`: a folder with the release `mlex` binary, its
//! CPU runtime (so it also runs without a GPU), and `mlex-cuda-env.sh`, which
//! points the binary at a CUDA build of the same MLX version; plus the GPU
//! side of `cargo xtask bench-vs-mlxlm`: `bench-vs-mlxlm.sh` with the Python
//! scripts it runs (`bench_vs_mlxlm.py`, `mlxlm_bench.py`,
//! `mlxlm_batch_bench.py`, `make_bench_models.py` with `real_shapes.py`,
//! `mlxlm_compat.py`), which need python3 with mlx and mlx-lm, no cargo.

use crate::{cargo, setup, workspace_root};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let dst = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_dir(&e.path(), &dst)?;
        } else {
            std::fs::copy(e.path(), &dst)
                .with_context(|| format!("copying {}", e.path().display()))?;
        }
    }
    Ok(())
}

/// Builds the bundle into `out` (default `target/cuda-bundle`).
pub fn cuda_bundle(args: &[String]) -> Result<PathBuf> {
    let root = workspace_root();
    let out = match args.iter().position(|a| a == "--out") {
        Some(i) => PathBuf::from(args.get(i + 1).context("--out needs a folder")?),
        None => root.join("target/cuda-bundle"),
    };
    setup::setup()?;
    cargo(&["build", "--release", "-p", "mlex-cli"])?;
    let release = root.join("target/release");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    std::fs::copy(release.join("mlex"), out.join("mlex"))?;
    copy_dir(&release.join("mlx"), &out.join("cpu-runtime/mlx"))?;
    // The wheel's own BLAS, not the staged OpenBLAS: that one needs the
    // build machine's libopenblas.so.0, which a GPU machine need not have
    // (there MLX's products run on the GPU anyway).
    let wheel_libs = setup::native_dir().join("mlx_cpu.libs");
    if wheel_libs.is_dir() {
        copy_dir(&wheel_libs, &out.join("cpu-runtime/mlx_cpu.libs"))?;
    }
    // The binary looks for its CPU runtime in $ORIGIN/mlx/lib.
    #[cfg(unix)]
    std::os::unix::fs::symlink("cpu-runtime/mlx", out.join("mlx"))?;
    for file in [
        "xtask/cuda/mlex-cuda-env.sh",
        "xtask/cuda/bench-vs-mlxlm.sh",
        "xtask/py/bench_vs_mlxlm.py",
        "xtask/py/mlxlm_bench.py",
        "xtask/py/mlxlm_batch_bench.py",
        "xtask/py/make_bench_models.py",
        "xtask/py/real_shapes.py",
        "xtask/py/mlxlm_compat.py",
    ] {
        let from = root.join(file);
        let name = from.file_name().context("a file name")?;
        std::fs::copy(&from, out.join(name))
            .with_context(|| format!("copying {}", from.display()))?;
    }
    std::fs::write(
        out.join("README.txt"),
        "mlex CUDA bundle\n\n\
         CPU:   ./mlex env\n\
         CUDA:  eval \"$(sh mlex-cuda-env.sh /path/to/mlx-cuda-runtime)\" && ./mlex env\n\n\
         The runtime is a CUDA build of MLX of the pinned version (lib/libmlx.so with include/ beside\n\
         lib/), e.g. the `mlx` folder of the PyPI wheel mlx-cuda-13, or the archive of mlx-cuda-pack.\n\n\
         mlex vs mlx-lm on the GPU (real-shape random-weight models made in /tmp/models):\n\
         \x20 OUT=/some/dir bash bench-vs-mlxlm.sh /path/to/mlx-cuda-runtime /path/to/wheels [--pairs 3 --shapes qwen3_5 ...]\n\
         The wheels folder holds mlx (CUDA, the same version) and mlx-lm 0.32.2 (pip --no-index --no-deps).\n",
    )?;
    eprintln!("xtask: CUDA bundle in {}", out.display());
    Ok(out)
}
