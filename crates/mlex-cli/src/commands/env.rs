//! `mlex env`: which MLX library is loaded, what it runs on, the backend
//! policy (`Dispatch`) a command would run with, and whether a matmul on
//! the default device agrees with the CPU.

use crate::args::{EnvArgs, Format};
use mlex_core::error::Result;
use mlx_rs::{random, Device, Dtype};
use serde_json::json;

/// The path of the `libmlx` the process loaded (Linux: from the maps).
fn loaded_libmlx() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("libmlx"))
        .map(str::to_owned)
}

pub fn run(a: EnvArgs) -> Result<()> {
    let info = mlex_core::device::runtime_info()?;
    let n = 1024;
    let key = random::key(0)?;
    let x = random::normal::<f32>(&[n, n], None, None, &key)?;
    let on_default = mlx_rs::ops::matmul(&x, &x)?;
    on_default.eval()?;
    let on_cpu = mlx_rs::with_device(Device::cpu(), || mlx_rs::ops::matmul(&x, &x))?;
    on_cpu.eval()?;
    let diff = mlx_rs::ops::abs(mlx_rs::ops::subtract(&on_default, &on_cpu)?)?
        .max(None)?
        .as_dtype(Dtype::Float32)?
        .try_item_exact::<f32>()
        .map_err(|e| mlex_core::error::Error::Other(e.to_string()))?;
    let scale = mlx_rs::ops::abs(&on_cpu)?
        .max(None)?
        .try_item_exact::<f32>()
        .map_err(|e| mlex_core::error::Error::Other(e.to_string()))?;
    let rel = diff / scale.max(1e-30);
    let ok = rel < 1e-2;
    let lib = loaded_libmlx();
    let blas = mlex_core::device::cpu_blas().to_string();
    let dispatch = crate::session::dispatch(None)?;
    let out = json!({
        "cpu_blas": blas,
        "mlx_version": info.mlx_version,
        "backend": info.backend.to_string(),
        "default_device": info.default_device,
        "gpu_count": info.gpu_count,
        "gpu_name": info.gpu_name,
        "libmlx": lib,
        "matmul_check": {"n": n, "max_rel_diff_vs_cpu": rel, "ok": ok},
        "dispatch": dispatch.to_json(),
        "kernel_cache": std::env::var(crate::KERNEL_CACHE_VAR).ok(),
        "cpu_kernels": crate::cpu_kernels::dir(),
    });
    if a.format == Format::Json {
        println!("{out}");
    } else {
        println!("mlx           {}", info.mlx_version);
        println!("libmlx        {}", lib.as_deref().unwrap_or("(unknown)"));
        println!("cpu blas      {blas}");
        println!("backend       {}", info.backend);
        if let Some(dir) = out["kernel_cache"].as_str() {
            println!("kernel cache  {dir}");
        }
        println!("cpu kernels   {}", crate::cpu_kernels::dir().display());
        println!("default       {}", info.default_device);
        match &info.gpu_name {
            Some(g) => println!("gpu           {g} ({} device(s))", info.gpu_count),
            None => println!("gpu           none"),
        }
        println!(
            "matmul check  {n}x{n}: max relative difference vs CPU {rel:.2e} {}",
            if ok { "(ok)" } else { "(MISMATCH)" }
        );
        println!("dispatch      (defaults of the backend, then the MLEX_ variables)");
        if let Some(o) = out["dispatch"].as_object() {
            for (k, v) in o {
                println!("  {k:<24}{v}");
            }
        }
    }
    if !ok {
        return Err(mlex_core::error::Error::Other(format!(
            "matmul on {} differs from the CPU by {rel:.2e}",
            info.default_device
        )));
    }
    Ok(())
}
