//! Which MLX backend is loaded and what it runs on.
//!
//! The binary is linked against the CPU `libmlx.so` from the pinned wheel;
//! at run time the dynamic loader may pick another build of the same
//! version (CUDA on an NVIDIA machine through `LD_LIBRARY_PATH`, Metal on a
//! Mac). This module asks the loaded library what it is.

use crate::error::Result;
use std::ffi::CStr;

/// The loaded MLX backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// CPU only.
    Cpu,
    /// NVIDIA CUDA.
    Cuda,
    /// Apple Metal.
    Metal,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Metal => "metal",
        })
    }
}

/// A summary of the MLX runtime in this process.
#[derive(Clone, Debug)]
pub struct RuntimeInfo {
    /// MLX version reported by the loaded library.
    pub mlx_version: String,
    /// The backend with a GPU, if any.
    pub backend: Backend,
    /// Number of GPU devices.
    pub gpu_count: i32,
    /// The default device (`cpu` or `gpu`).
    pub default_device: String,
    /// The GPU's name, when there is one.
    pub gpu_name: Option<String>,
}

/// The BLAS that MLX's CPU products run on in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuBlas {
    /// OpenBLAS (staged by `cargo xtask setup` in place of the wheel's).
    OpenBlas,
    /// The reference (netlib) BLAS bundled with the PyPI wheel.
    Reference,
    /// Apple's Accelerate.
    Accelerate,
    /// Not known (no `/proc/self/maps`).
    Unknown,
}

impl std::fmt::Display for CpuBlas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CpuBlas::OpenBlas => "OpenBLAS",
            CpuBlas::Reference => "reference BLAS (netlib)",
            CpuBlas::Accelerate => "Accelerate",
            CpuBlas::Unknown => "unknown",
        })
    }
}

/// Which BLAS the loaded `libmlx` resolved: on Linux, read from the
/// libraries mapped into this process (OpenBLAS's `libblas.so.3` pulls in
/// `libopenblas.so.0`).
pub fn cpu_blas() -> CpuBlas {
    if cfg!(target_os = "macos") {
        return CpuBlas::Accelerate;
    }
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(maps) if maps.contains("openblas") => CpuBlas::OpenBlas,
        Ok(maps) if maps.contains("libblas") => CpuBlas::Reference,
        _ => CpuBlas::Unknown,
    }
}

/// Makes sure mlx-rs's error handler is installed before any raw mlx-c
/// call (mlx-c's default handler exits the process).
pub(crate) fn ensure_error_handler() {
    let _ = mlx_rs::Device::try_default();
}

fn flag(f: unsafe extern "C" fn(*mut bool) -> i32) -> bool {
    ensure_error_handler();
    let mut v = false;
    // SAFETY: the function writes one bool through the pointer.
    let status = unsafe { f(&mut v) };
    status == 0 && v
}

/// True when the default device is a CUDA GPU. MLX's CUDA backend lacks
/// some kernels its CPU and Metal backends have (quantized products with
/// float32 activations), so a few building blocks pick another form there.
pub fn default_is_cuda_gpu() -> bool {
    static CUDA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CUDA.get_or_init(|| flag(mlx_sys::mlx_cuda_is_available))
        && mlx_rs::Device::try_default()
            .and_then(|d| d.get_type())
            .is_ok_and(|t| matches!(t, mlx_rs::DeviceType::Gpu))
}

/// Asks the loaded MLX library what it runs on.
pub fn runtime_info() -> Result<RuntimeInfo> {
    ensure_error_handler();
    let backend = if flag(mlx_sys::mlx_cuda_is_available) {
        Backend::Cuda
    } else if flag(mlx_sys::mlx_metal_is_available) {
        Backend::Metal
    } else {
        Backend::Cpu
    };
    let mut gpu_count = 0;
    // SAFETY: writes one int; a failure leaves 0.
    unsafe {
        mlx_sys::mlx_device_count(&mut gpu_count, mlx_sys::mlx_device_type__MLX_GPU);
    }
    let default = mlx_rs::Device::try_default()?;
    let default_device = match default.get_type()? {
        mlx_rs::DeviceType::Cpu => "cpu",
        mlx_rs::DeviceType::Gpu => "gpu",
    }
    .to_owned();
    let gpu_name = if gpu_count > 0 {
        device_string(mlx_sys::mlx_device_type__MLX_GPU, "device_name")
    } else {
        None
    };
    Ok(RuntimeInfo {
        mlx_version: mlx_version(),
        backend,
        gpu_count,
        default_device,
        gpu_name,
    })
}

fn device_string(kind: mlx_sys::mlx_device_type, key: &str) -> Option<String> {
    let key = std::ffi::CString::new(key).ok()?;
    // SAFETY: mlx-c device-info API used as documented; the info object is
    // freed before returning and the string copied out first.
    unsafe {
        let dev = mlx_sys::mlx_device_new_type(kind, 0);
        let mut info = mlx_sys::mlx_device_info_new();
        let mut out = None;
        if mlx_sys::mlx_device_info_get(&mut info, dev) == 0 {
            let mut s: *const std::os::raw::c_char = std::ptr::null();
            if mlx_sys::mlx_device_info_get_string(&mut s, info, key.as_ptr()) == 0 && !s.is_null()
            {
                out = Some(CStr::from_ptr(s).to_string_lossy().into_owned());
            }
        }
        mlx_sys::mlx_device_info_free(info);
        mlx_sys::mlx_device_free(dev);
        out
    }
}

/// The MLX version string of the loaded library.
pub fn mlx_version() -> String {
    ensure_error_handler();
    // SAFETY: mlx_version fills an mlx_string that we read and free.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let text = if mlx_sys::mlx_version(&mut s) == 0 {
            let p = mlx_sys::mlx_string_data(s);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        } else {
            String::new()
        };
        mlx_sys::mlx_string_free(s);
        text
    }
}

/// Peak memory MLX has allocated since start or the last reset, in bytes.
pub fn peak_memory() -> Result<usize> {
    Ok(mlx_rs::memory::peak_memory()?)
}

/// Resets the peak-memory counter.
pub fn reset_peak_memory() -> Result<()> {
    Ok(mlx_rs::memory::reset_peak_memory()?)
}

/// Memory MLX currently holds for live arrays, in bytes.
pub fn active_memory() -> Result<usize> {
    Ok(mlx_rs::memory::active_memory()?)
}

/// Where the memory is, at one moment: MLX's allocator counters and the
/// process's resident set (for the benchmarks' JSON).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryReport {
    /// MLX's peak allocation since start or the last reset.
    pub peak: usize,
    /// MLX's live arrays.
    pub active: usize,
    /// Freed buffers MLX keeps for reuse (its buffer cache).
    pub cache: usize,
    /// The process's resident set (Linux: `/proc/self/status`; `None`
    /// elsewhere).
    pub rss: Option<usize>,
    /// The process's highest resident set (as `rss`).
    pub rss_peak: Option<usize>,
    /// Bytes the process has read through read system calls since it
    /// started (Linux: `rchar` of `/proc/self/io`; `None` elsewhere): what
    /// loading the weights read from their files, with the tokenizer's and
    /// config's few kB.
    pub read: Option<usize>,
}

impl MemoryReport {
    /// The counters now.
    pub fn now() -> Result<Self> {
        let (rss, rss_peak) = process_rss();
        Ok(Self {
            peak: mlx_rs::memory::peak_memory()?,
            active: mlx_rs::memory::active_memory()?,
            cache: mlx_rs::memory::cache_memory()?,
            rss,
            rss_peak,
            read: process_read(),
        })
    }

    /// As JSON, in bytes.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "mlx_peak_bytes": self.peak,
            "mlx_active_bytes": self.active,
            "mlx_cache_bytes": self.cache,
            "rss_bytes": self.rss,
            "rss_peak_bytes": self.rss_peak,
            "read_bytes": self.read,
        })
    }
}

/// `rchar` of `/proc/self/io`: bytes read through system calls.
fn process_read() -> Option<usize> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("rchar:"))
        .and_then(|v| v.trim().parse().ok())
}

/// `VmRSS` and `VmHWM` of `/proc/self/status`, in bytes.
fn process_rss() -> (Option<usize>, Option<usize>) {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return (None, None);
    };
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .map(|kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}
