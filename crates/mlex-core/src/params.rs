//! Model weights addressed by id.
//!
//! Layers never hold arrays: they hold [`ParamId`]s and read the arrays from
//! a [`Params`] view at call time. Eagerly that view is the model's
//! [`ParamStore`]; inside a compiled segment it is an overlay of the traced
//! function's *inputs*. That is what keeps weights out of MLX's compiled
//! traces as frozen constants, and it lets a segment declare exactly which
//! weights it reads (an undeclared read is an error, not a silent constant).
//!
//! Every change to a store (a new tensor, a replaced one) takes a fresh
//! value of a global generation counter, so a compiled trace can tell that
//! the weights it was built for are gone.

use crate::error::{Error, Result};
use mlx_rs::Array;
use std::sync::atomic::{AtomicU64, Ordering};

static GENERATION: AtomicU64 = AtomicU64::new(1);

fn next_generation() -> u64 {
    GENERATION.fetch_add(1, Ordering::Relaxed)
}

/// Index of one weight array in a [`ParamStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub u32);

impl ParamId {
    /// The index as `usize`.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// The weights of one model, by id, with their names.
#[derive(Clone, Debug)]
pub struct ParamStore {
    arrays: Vec<Array>,
    names: Vec<String>,
    generation: u64,
    structure: u64,
}

impl Default for ParamStore {
    fn default() -> Self {
        Self::new()
    }
}

impl ParamStore {
    /// An empty store.
    pub fn new() -> Self {
        let g = next_generation();
        Self {
            arrays: Vec::new(),
            names: Vec::new(),
            generation: g,
            structure: g,
        }
    }

    /// Adds a weight and returns its id.
    pub fn push(&mut self, name: impl Into<String>, array: Array) -> ParamId {
        self.arrays.push(array);
        self.names.push(name.into());
        self.generation = next_generation();
        self.structure = self.generation;
        ParamId((self.arrays.len() - 1) as u32)
    }

    /// Replaces the array behind `id`. The shape and dtype must stay the
    /// same (a change of structure needs a rebuilt layer instead).
    pub fn set(&mut self, id: ParamId, array: Array) -> Result<()> {
        let slot = self
            .arrays
            .get_mut(id.index())
            .ok_or_else(|| Error::Other(format!("no weight with id {}", id.0)))?;
        if slot.shape() != array.shape() || slot.dtype() != array.dtype() {
            return Err(Error::TensorMismatch {
                name: self.names[id.index()].clone(),
                file: "(update)".into(),
                expected: format!("{:?} {:?}", slot.shape(), slot.dtype()),
                found: format!("{:?} {:?}", array.shape(), array.dtype()),
            });
        }
        *slot = array;
        self.generation = next_generation();
        Ok(())
    }

    /// The array behind `id`.
    pub fn get(&self, id: ParamId) -> &Array {
        &self.arrays[id.index()]
    }

    /// The name behind `id`.
    pub fn name(&self, id: ParamId) -> &str {
        &self.names[id.index()]
    }

    /// The id of the weight called `name`, if any.
    pub fn find(&self, name: &str) -> Option<ParamId> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| ParamId(i as u32))
    }

    /// Number of weights.
    pub fn len(&self) -> usize {
        self.arrays.len()
    }

    /// True when the store holds nothing.
    pub fn is_empty(&self) -> bool {
        self.arrays.is_empty()
    }

    /// All `(name, array)` pairs in id order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Array)> {
        self.names
            .iter()
            .map(String::as_str)
            .zip(self.arrays.iter())
    }

    /// Total bytes of all weights.
    pub fn nbytes(&self) -> usize {
        self.arrays.iter().map(Array::nbytes).sum()
    }

    /// A value that changes whenever tensors are added (ids, shapes or
    /// dtypes change), but not when a value is replaced in place.
    pub fn structure_generation(&self) -> u64 {
        self.structure
    }

    /// The eager view.
    pub fn view(&self) -> Params<'_> {
        Params {
            inner: Inner::Store(self),
        }
    }

    /// Evaluates every weight (materialises lazily loaded tensors).
    pub fn eval(&self) -> Result<()> {
        mlx_rs::transforms::eval(self.arrays.iter())?;
        Ok(())
    }
}

/// Read access to weights for one call: the store, or a trace's overlay.
#[derive(Clone, Copy)]
pub struct Params<'a> {
    inner: Inner<'a>,
}

#[derive(Clone, Copy)]
enum Inner<'a> {
    Store(&'a ParamStore),
    Overlay(&'a [Option<Array>]),
}

impl<'a> Params<'a> {
    /// A view over traced inputs: `slots[id]` is the input standing in for
    /// weight `id`, `None` for weights the trace did not declare.
    pub fn overlay(slots: &'a [Option<Array>]) -> Self {
        Params {
            inner: Inner::Overlay(slots),
        }
    }

    /// The array for `id`.
    pub fn get(&self, id: ParamId) -> Result<&'a Array> {
        match self.inner {
            Inner::Store(store) => Ok(store.get(id)),
            Inner::Overlay(slots) => {
                slots
                    .get(id.index())
                    .and_then(Option::as_ref)
                    .ok_or_else(|| {
                        Error::Other(format!(
                        "a compiled segment read weight #{} that it did not declare as an input",
                        id.0
                    ))
                    })
            }
        }
    }
}
