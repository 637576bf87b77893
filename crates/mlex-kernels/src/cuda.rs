//! A safe-to-call wrapper over MLX's custom CUDA kernels
//! (`mlx_fast_cuda_kernel_*` of mlx-c 0.7.0; MLX JIT-compiles the source
//! with NVRTC the first time it runs and caches it by name and template
//! arguments). mlx-rs wraps only the Metal variant.
//!
//! MLX generates the kernel's signature: each input `x` becomes
//! `const T* x` (T from the input's dtype), each output `y` becomes `T* y`,
//! template arguments become `constexpr int` / `using` lines, and the body
//! is `source`. The launch grid is given in threads, as for Metal.

use mlex_core::error::{Error, Result};
use mlx_rs::{Array, Dtype, Stream};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CString;
use std::rc::Rc;

/// A compile-time argument of a kernel.
#[derive(Clone, Copy, Debug)]
pub enum TemplateArg {
    /// `constexpr int NAME = v;`
    Int(i32),
    /// `using NAME = <cuda type of the dtype>;`
    Dtype(Dtype),
}

/// One output: its shape and dtype.
#[derive(Clone, Debug)]
pub struct OutputSpec {
    /// Shape.
    pub shape: Vec<i32>,
    /// Element type.
    pub dtype: Dtype,
}

impl OutputSpec {
    /// An output of `shape` and `dtype`.
    pub fn new(shape: &[i32], dtype: Dtype) -> Self {
        Self {
            shape: shape.to_vec(),
            dtype,
        }
    }
}

/// A custom CUDA kernel built from source.
pub struct CudaKernel {
    raw: mlx_sys::mlx_fast_cuda_kernel,
    name: String,
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(what, "contains a NUL byte"))
}

struct Strings(mlx_sys::mlx_vector_string);

impl Strings {
    fn new(items: &[&str]) -> Result<Strings> {
        // SAFETY: a fresh vector, freed in Drop.
        let v = Strings(unsafe { mlx_sys::mlx_vector_string_new() });
        for s in items {
            let c = cstring("kernel argument name", s)?;
            // SAFETY: `c` outlives the call; mlx-c copies the string.
            unsafe { mlx_sys::mlx_vector_string_append_value(v.0, c.as_ptr()) };
        }
        Ok(v)
    }
}

impl Drop for Strings {
    fn drop(&mut self) {
        // SAFETY: created by mlx_vector_string_new, freed once.
        unsafe { mlx_sys::mlx_vector_string_free(self.0) };
    }
}

impl CudaKernel {
    /// A kernel `name` with the given argument names and body; its inputs
    /// are made row-contiguous before the launch.
    pub fn new(name: &str, inputs: &[&str], outputs: &[&str], source: &str) -> Result<CudaKernel> {
        CudaKernel::with_layout(name, inputs, outputs, source, true)
    }

    /// [`CudaKernel::new`], where `contiguous: false` hands the inputs over
    /// in whatever layout they have: the body reads `x_strides` (in
    /// elements) for each input `x` it does not assume contiguous.
    pub fn with_layout(
        name: &str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        contiguous: bool,
    ) -> Result<CudaKernel> {
        // mlx-rs installs the error handler that turns mlx-c failures into
        // errors instead of exits; make sure it is in place.
        let _ = mlx_rs::Device::try_default();
        let (cname, csource, header) = (
            cstring("kernel name", name)?,
            cstring("kernel source", source)?,
            cstring("kernel header", "")?,
        );
        let (ins, outs) = (Strings::new(inputs)?, Strings::new(outputs)?);
        // SAFETY: all pointers are valid for the call; mlx-c copies them.
        let raw = unsafe {
            mlx_sys::mlx_fast_cuda_kernel_new(
                cname.as_ptr(),
                ins.0,
                outs.0,
                csource.as_ptr(),
                header.as_ptr(),
                contiguous,
                0,
            )
        };
        if raw.ctx.is_null() {
            return Err(Error::invalid(name, "MLX could not create the CUDA kernel"));
        }
        Ok(CudaKernel {
            raw,
            name: name.to_owned(),
        })
    }

    /// Launches the kernel lazily on the default GPU stream, `grid` threads
    /// in blocks of `block`.
    ///
    /// The kernel's source must stay inside the buffers that the shapes of
    /// `inputs` and `outputs` imply for this grid and these template
    /// arguments, and write every output element; callers check the shapes
    /// the source assumes before calling.
    pub fn apply(
        &self,
        inputs: &[&Array],
        outputs: &[OutputSpec],
        template: &[(&str, TemplateArg)],
        grid: (i32, i32, i32),
        block: (i32, i32, i32),
    ) -> Result<Vec<Array>> {
        let fail = |what: &str| Error::invalid(&self.name, format!("CUDA kernel: {what} failed"));
        // SAFETY: the config is created, filled and freed here; every
        // pointer passed lives across its call.
        unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            let mut status = 0;
            for o in outputs {
                status |= mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                    config,
                    o.shape.as_ptr(),
                    o.shape.len(),
                    o.dtype.into(),
                );
            }
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, grid.0, grid.1, grid.2);
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(
                config, block.0, block.1, block.2,
            );
            let mut names = Vec::new();
            for (name, arg) in template {
                let c = cstring("template argument", name)?;
                status |= match *arg {
                    TemplateArg::Int(v) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                            config,
                            c.as_ptr(),
                            v,
                        )
                    }
                    TemplateArg::Dtype(d) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                            config,
                            c.as_ptr(),
                            d.into(),
                        )
                    }
                };
                names.push(c);
            }
            if status != 0 {
                mlx_sys::mlx_fast_cuda_kernel_config_free(config);
                return Err(fail("configuring the launch"));
            }
            let ins = mlx_sys::mlx_vector_array_new();
            for a in inputs {
                mlx_sys::mlx_vector_array_append_value(ins, a.as_ptr());
            }
            let mut outs = mlx_sys::mlx_vector_array_new();
            let stream = Stream::thread_local_or_gpu();
            let status = mlx_sys::mlx_fast_cuda_kernel_apply(
                &mut outs,
                self.raw,
                ins,
                config,
                stream.as_ptr(),
            );
            mlx_sys::mlx_vector_array_free(ins);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            drop(names);
            if status != 0 {
                mlx_sys::mlx_vector_array_free(outs);
                return Err(fail("launching"));
            }
            let n = mlx_sys::mlx_vector_array_size(outs);
            let mut result = Vec::with_capacity(n);
            for i in 0..n {
                let mut a = mlx_sys::mlx_array_new();
                mlx_sys::mlx_vector_array_get(&mut a, outs, i);
                result.push(Array::from_ptr(a));
            }
            mlx_sys::mlx_vector_array_free(outs);
            Ok(result)
        }
    }
}

impl Drop for CudaKernel {
    fn drop(&mut self) {
        // SAFETY: created by mlx_fast_cuda_kernel_new, freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.raw) };
    }
}

/// FNV-1a of `source`, folded to 32 bits.
fn source_hash(source: &str) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in source.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h ^ (h >> 32)) as u32
}

thread_local! {
    /// Kernels by name (MLX arrays and kernels stay on their thread).
    static KERNELS: RefCell<HashMap<&'static str, Rc<CudaKernel>>> = RefCell::new(HashMap::new());
}

impl CudaKernel {
    /// The kernel `name` of this thread, built from `source` on first use
    /// (MLX sees `name` followed by a hash of `source`).
    pub fn cached(
        name: &'static str,
        inputs: &[&str],
        outputs: &[&str],
        source: &'static str,
    ) -> Result<Rc<CudaKernel>> {
        CudaKernel::cached_with_layout(name, inputs, outputs, source, true)
    }

    /// [`CudaKernel::cached`] for a kernel made by
    /// [`CudaKernel::with_layout`].
    pub fn cached_with_layout(
        name: &'static str,
        inputs: &[&str],
        outputs: &[&str],
        source: &'static str,
        contiguous: bool,
    ) -> Result<Rc<CudaKernel>> {
        KERNELS.with(|k| {
            if let Some(found) = k.borrow().get(name) {
                return Ok(found.clone());
            }
            // MLX caches compiled kernels on disk by name and template
            // arguments, not by source: a name that carries a hash of the
            // source keeps an edited kernel from running its old build.
            let versioned = format!("{name}_{:08x}", source_hash(source));
            let made = Rc::new(CudaKernel::with_layout(
                &versioned, inputs, outputs, source, contiguous,
            )?);
            k.borrow_mut().insert(name, made.clone());
            Ok(made)
        })
    }

    /// [`apply`](Self::apply) for a kernel with two outputs.
    pub fn apply2(
        &self,
        inputs: &[&Array],
        outputs: [OutputSpec; 2],
        template: &[(&str, TemplateArg)],
        grid: (i32, i32, i32),
        block: (i32, i32, i32),
    ) -> Result<(Array, Array)> {
        let mut out = self
            .apply(inputs, &outputs, template, grid, block)?
            .into_iter();
        match (out.next(), out.next()) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => Err(Error::invalid(
                &self.name,
                "the CUDA kernel returned fewer than two outputs",
            )),
        }
    }
}

/// A recurrent decode step as its multi-token kernel run on one token:
/// `conv` (the step's `[B, 1, C]` input) must be one token, and `steps`
/// (the kernel keeping only the last state, `[1, ...]`) runs with the
/// state reshaped back to `state`'s shape. `what` names the step in the
/// error.
pub(crate) fn one_token_step(
    what: &str,
    conv: &Array,
    state: &Array,
    steps: impl FnOnce() -> Result<(Array, Array)>,
) -> Result<(Array, Array)> {
    if conv.shape().get(1) != Some(&1) {
        return Err(Error::invalid(
            what,
            format!("conv {:?} is not one token", conv.shape()),
        ));
    }
    let (y, states) = steps()?;
    Ok((y, mlx_rs::ops::reshape(&states, state.shape())?))
}
