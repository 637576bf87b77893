//! A lazily compiled MLX function with explicit inputs and an invalidation
//! key.
//!
//! mlx-rs 0.33 gives every compiled instance its own id, so two traces of
//! identical shapes never share an MLX trace. Arrays *captured* by a
//! compiled closure are frozen into the trace as constants, so everything
//! that may change (weights, recurrent state) must come in as inputs: the
//! closure given to [`CompiledTrace::call`] receives only its input slice.
//! A trace built for one structure of weights (ids, shapes) is dropped and
//! rebuilt when the caller's key changes (new weights loaded, quantized).

use mlex_core::error::{Error, Result};
use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;
use std::cell::Cell;
use std::rc::Rc;

type Callable = Box<dyn FnMut(&[Array]) -> std::result::Result<Vec<Array>, Exception>>;

/// A compiled function, built on first use and rebuilt when its key changes.
pub struct CompiledTrace {
    callable: Option<Callable>,
    key: u64,
    traced: Rc<Cell<usize>>,
}

impl Default for CompiledTrace {
    fn default() -> Self {
        Self::new()
    }
}

impl CompiledTrace {
    /// An empty trace (nothing compiled yet).
    pub fn new() -> Self {
        Self {
            callable: None,
            key: 0,
            traced: Rc::new(Cell::new(0)),
        }
    }

    /// Calls the compiled function on `inputs`, compiling `make()` first if
    /// there is none yet or `key` differs from the one it was built for.
    /// `make` returns the function to trace; it must read arrays only from
    /// its argument.
    pub fn call<F>(
        &mut self,
        key: u64,
        inputs: &[Array],
        make: impl FnOnce() -> F,
    ) -> Result<Vec<Array>>
    where
        F: FnMut(&[Array]) -> std::result::Result<Vec<Array>, Exception> + 'static,
    {
        if self.callable.is_none() || self.key != key {
            // Dropping the old callable erases its MLX trace.
            self.callable = None;
            let mut f = make();
            let traced = self.traced.clone();
            let counted = move |args: &[Array]| {
                traced.set(traced.get() + 1);
                f(args)
            };
            self.callable = Some(Box::new(compile(counted, false)));
            self.key = key;
        }
        let callable = self.callable.as_mut().expect("built above");
        callable(inputs).map_err(|e| Error::Mlx {
            context: Some("compiled segment".into()),
            message: e.what().to_owned(),
        })
    }

    /// How many times MLX has traced (run the Rust body of) this function.
    /// A call that reuses the trace does not count.
    pub fn times_traced(&self) -> usize {
        self.traced.get()
    }
}
