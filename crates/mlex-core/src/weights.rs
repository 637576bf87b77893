//! Checkpoint tensors: loading (validated first, so a corrupt file is an
//! error naming it, never an abort inside MLX), name translation
//! (`sanitize`), and strict consumption by the model builder.
//!
//! The flow: [`WeightMap::load_safetensors`] (or a GGUF reader) gives raw
//! tensors; the architecture's `sanitize` renames/reshapes them in the map;
//! [`WeightLoader`] hands them to layers one by one, checking each shape,
//! and [`WeightLoader::finish`] fails if any tensor was left unused.

use crate::device::Backend;
use crate::dispatch::Dispatch;
use crate::distributed::{Shard, Split};
use crate::error::{Error, Result};
use crate::params::{ParamId, ParamStore};
use crate::quant::{QuantSpec, Quantization};
use mlx_rs::{Array, Dtype};
use source::{scan_safetensors, Data};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod source;
pub use source::{validate_safetensors, PartReader};

#[derive(Clone, Debug)]
struct Entry {
    data: Data,
    file: usize,
}

/// Named tensors with the file each came from.
#[derive(Clone, Debug, Default)]
pub struct WeightMap {
    tensors: BTreeMap<String, Entry>,
    files: Vec<PathBuf>,
    /// The tensors are already this rank's parts (a built model's weights,
    /// re-read to quantize them): split scopes cut nothing.
    rank_parts: bool,
}

impl WeightMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks the tensors as one `--tp` rank's parts already (the weights of
    /// a model built split, handed to a rebuild): a loader cuts nothing
    /// more, while its split scopes still say how the parts join.
    pub fn mark_rank_parts(&mut self) {
        self.rank_parts = true;
    }

    /// Loads every tensor of the given safetensors files. Each file is
    /// validated first; a tensor present in two files is an error.
    pub fn load_safetensors(paths: &[PathBuf]) -> Result<Self> {
        let mut map = Self::new();
        for path in paths {
            let mut spans = scan_safetensors(path)?;
            let tensors = Array::load_safetensors(path).map_err(|e| Error::BadWeightsFile {
                file: path.clone(),
                format: "safetensors",
                message: e.to_string(),
            })?;
            let idx = map.add_file(path.clone());
            for (name, array) in tensors {
                if let Some(prev) = map.tensors.get(&name) {
                    return Err(Error::BadWeightsFile {
                        file: path.clone(),
                        format: "safetensors",
                        message: format!(
                            "tensor `{name}` is also in {}",
                            map.files[prev.file].display()
                        ),
                    });
                }
                let span = spans.remove(&name);
                map.tensors.insert(
                    name,
                    Entry {
                        data: Data::Array { array, span },
                        file: idx,
                    },
                );
            }
        }
        Ok(map)
    }

    /// Registers a source file; returns its index for [`WeightMap::insert`].
    pub fn add_file(&mut self, path: PathBuf) -> usize {
        self.files.push(path);
        self.files.len() - 1
    }

    /// The source files.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Inserts (or replaces) a tensor from source file `file`.
    pub fn insert(&mut self, name: impl Into<String>, array: Array, file: usize) {
        let data = Data::Array { array, span: None };
        self.tensors.insert(name.into(), Entry { data, file });
    }

    /// Inserts (or replaces) a tensor of `shape` and `dtype` from source
    /// file `file` that `reader` reads on demand: whole when something
    /// asks for it whole, else only a `--tp` rank's part of it.
    pub fn insert_deferred(
        &mut self,
        name: impl Into<String>,
        shape: Vec<i32>,
        dtype: Dtype,
        reader: Arc<dyn PartReader>,
        file: usize,
    ) {
        let whole = Default::default();
        let data = Data::Deferred {
            shape,
            dtype,
            reader,
            whole,
        };
        self.tensors.insert(name.into(), Entry { data, file });
    }

    /// The tensor called `name` (one read on demand is read whole here: an
    /// error names its file).
    pub fn get(&self, name: &str) -> Result<Option<&Array>> {
        self.tensors.get(name).map(|e| e.data.array()).transpose()
    }

    /// The shape of the tensor called `name`, without reading it.
    pub fn shape_of(&self, name: &str) -> Option<&[i32]> {
        self.tensors.get(name).map(|e| e.data.shape())
    }

    /// The dtype of the tensor called `name`, without reading it.
    pub fn dtype_of(&self, name: &str) -> Option<Dtype> {
        self.tensors.get(name).map(|e| e.data.dtype())
    }

    /// True when `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Removes and returns a tensor with its source file index.
    pub fn remove(&mut self, name: &str) -> Result<Option<(Array, usize)>> {
        self.tensors
            .remove(name)
            .map(|e| Ok((e.data.into_array()?, e.file)))
            .transpose()
    }

    /// Removes and returns a tensor that must be there, or the error that
    /// names it, the files and the nearest names present.
    pub fn remove_required(&mut self, name: &str) -> Result<(Array, usize)> {
        match self.remove(name)? {
            Some(found) => Ok(found),
            None => Err(self.missing(name)),
        }
    }

    /// The error for a tensor `name` these files lack: the files and the
    /// nearest names present.
    pub fn missing(&self, name: &str) -> Error {
        Error::MissingTensor {
            name: name.to_owned(),
            files: self.files().to_vec(),
            nearest: nearest_names(name, &self.names(), 3),
        }
    }

    /// All names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The file a tensor came from.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.tensors.get(name).map(|e| self.files[e.file].as_path())
    }

    /// Renames every tensor with `f`; `None` drops it. Two tensors mapped to
    /// one name is an error.
    pub fn rename_all(&mut self, mut f: impl FnMut(&str) -> Option<String>) -> Result<()> {
        let old = std::mem::take(&mut self.tensors);
        for (name, entry) in old {
            if let Some(new) = f(&name) {
                if self.tensors.contains_key(&new) {
                    return Err(Error::BadWeightsFile {
                        file: self.files[entry.file].clone(),
                        format: "checkpoint",
                        message: format!("two tensors map to `{new}` (one is `{name}`)"),
                    });
                }
                self.tensors.insert(new, entry);
            }
        }
        Ok(())
    }

    /// Applies `f` to every tensor whose name and shape satisfy `pred`
    /// (only those are read).
    pub fn update_where(
        &mut self,
        pred: impl Fn(&str, &[i32]) -> bool,
        f: impl Fn(&Array) -> Result<Array>,
    ) -> Result<()> {
        for (name, e) in self.tensors.iter_mut() {
            if pred(name, e.data.shape()) {
                let array = f(e.data.array()?)?;
                e.data = Data::Array { array, span: None };
            }
        }
        Ok(())
    }
}

/// Hands the tensors of a [`WeightMap`] to a model under construction and
/// checks that every one is used exactly once with the expected shape.
pub struct WeightLoader {
    map: WeightMap,
    store: ParamStore,
    quant: Quantization,
    dispatch: Dispatch,
    /// The split scope tensors are taken in ([`WeightLoader::with_split`]).
    split: Option<Split>,
    /// Tensors (by module prefix) whose split axis is a concatenation of
    /// segments, each split on its own ([`WeightLoader::with_segments`]):
    /// this rank's length of each and how many ranks hold each part.
    segments: Vec<(String, Vec<(i32, usize)>)>,
    /// Modules whose split tensors each part of which several ranks hold
    /// ([`WeightLoader::with_copies`]).
    copies: Vec<(String, usize)>,
}

/// Up to `n` of `candidates` closest to `name`: most characters shared at
/// the start and the end (a template off by one path part keeps both).
pub fn nearest_names(name: &str, candidates: &[String], n: usize) -> Vec<String> {
    let score = |c: &str| {
        let pre = name
            .bytes()
            .zip(c.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let suf = name
            .bytes()
            .rev()
            .zip(c.bytes().rev())
            .take_while(|(a, b)| a == b)
            .count();
        (pre + suf).min(name.len().max(c.len()))
    };
    let mut scored: Vec<(usize, &String)> = candidates
        .iter()
        .map(|c| (score(c), c))
        .filter(|(s, _)| *s > 0)
        .collect();
    scored.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    scored.into_iter().take(n).map(|(_, c)| c.clone()).collect()
}

fn shape_str(shape: &[i32]) -> String {
    format!(
        "[{}]",
        shape
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

impl WeightLoader {
    /// Starts loading from `map` with the checkpoint's quantization.
    pub fn new(map: WeightMap, quant: Quantization) -> Self {
        Self::with_dispatch(map, quant, Dispatch::for_backend(Backend::Cpu, false))
    }

    /// A loader whose layers take their products' form from `dispatch`
    /// ([`WeightLoader::new`]: the CPU's defaults).
    pub fn with_dispatch(map: WeightMap, quant: Quantization, dispatch: Dispatch) -> Self {
        Self {
            map,
            store: ParamStore::new(),
            quant,
            dispatch,
            split: None,
            segments: Vec::new(),
            copies: Vec::new(),
        }
    }

    /// This process's rank of a tensor-parallel group, when there is one.
    pub fn shard(&self) -> Option<&Shard> {
        self.dispatch.tensor_parallel.as_ref()
    }

    /// The split scope in force, when the model is sharded.
    pub fn split(&self) -> Option<Split> {
        self.split.filter(|_| self.shard().is_some())
    }

    /// Runs `f` with every tensor it takes cut by `split` across the ranks
    /// of [`WeightLoader::shard`] (nothing is cut on one device): the
    /// shapes `f` asks for are this rank's part, the checkpoint holds the
    /// whole tensor, and the rank keeps its part.
    pub fn with_split<T>(
        &mut self,
        split: Split,
        f: impl FnOnce(&mut WeightLoader) -> Result<T>,
    ) -> Result<T> {
        let outer = self.split.replace(split);
        let out = f(self);
        self.split = outer;
        out
    }

    /// Runs `f` with the split axis of the tensors under `module` (its
    /// weight, scales, biases, bias) read as the concatenation of
    /// `segments` (this rank's lengths): each whole segment is `size` times
    /// as long and is split on its own, so that a q/k/v projection keeps
    /// its q, k and v rows of the rank's heads.
    pub fn with_segments<T>(
        &mut self,
        module: &str,
        segments: &[i32],
        f: impl FnOnce(&mut WeightLoader) -> Result<T>,
    ) -> Result<T> {
        let ones: Vec<(i32, usize)> = segments.iter().map(|&n| (n, 1)).collect();
        self.with_shared_segments(module, &ones, f)
    }

    /// [`WeightLoader::with_segments`] where a segment's parts may each be
    /// held by several ranks: `(this rank's length, copies)`, a segment
    /// cut into `size / copies` parts (e.g. key/value heads fewer than the
    /// ranks, [`WeightLoader::with_copies`]).
    pub fn with_shared_segments<T>(
        &mut self,
        module: &str,
        segments: &[(i32, usize)],
        f: impl FnOnce(&mut WeightLoader) -> Result<T>,
    ) -> Result<T> {
        self.segments.push((module.to_owned(), segments.to_vec()));
        let out = f(self);
        self.segments.pop();
        out
    }

    /// Runs `f` with the split tensors under each of `modules` cut into
    /// `size / copies` parts, each held by `copies` consecutive ranks
    /// (`copies` dividing the ranks): a rank of a group larger than a
    /// layer's key/value heads keeps the one head its query heads read.
    pub fn with_copies<T>(
        &mut self,
        modules: &[&str],
        copies: usize,
        f: impl FnOnce(&mut WeightLoader) -> Result<T>,
    ) -> Result<T> {
        let depth = self.copies.len();
        self.copies
            .extend(modules.iter().map(|m| ((*m).to_owned(), copies)));
        let out = f(self);
        self.copies.truncate(depth);
        out
    }

    /// How many ranks hold each part of the split tensors under `module`
    /// ([`WeightLoader::with_copies`]; 1 outside it).
    pub fn copies_of(&self, module: &str) -> usize {
        let under = |m: &str| {
            module == m
                || module
                    .strip_prefix(m)
                    .is_some_and(|rest| rest.starts_with('.'))
        };
        self.copies
            .iter()
            .rev()
            .find(|(m, _)| under(m))
            .map_or(1, |&(_, c)| c)
    }

    /// The backend policy layers are built with.
    pub fn dispatch(&self) -> &Dispatch {
        &self.dispatch
    }

    /// How a product loaded now runs.
    pub fn product(&self) -> crate::nn::Product {
        crate::nn::Product::of(&self.dispatch)
    }

    /// True when the (sanitized) tensor `name` exists and is unused.
    pub fn has(&self, name: &str) -> bool {
        self.map.contains(name)
    }

    /// The quantization spec for a module path.
    pub fn quant_for(&self, module: &str) -> Option<QuantSpec> {
        self.quant.for_module(module)
    }

    fn missing(&self, name: &str) -> Error {
        self.map.missing(name)
    }

    fn file_for(&self, name: &str) -> PathBuf {
        self.map
            .file_of(name)
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("(checkpoint)"))
    }

    /// Takes a floating-point tensor of exactly `shape`.
    pub fn take(&mut self, name: &str, shape: &[i32]) -> Result<ParamId> {
        self.take_checked(name, Some(shape), true)
    }

    /// Takes a packed quantized weight (`uint32`) of exactly `shape`.
    pub fn take_packed(&mut self, name: &str, shape: &[i32]) -> Result<ParamId> {
        let array = self.take_raw(name, shape, false)?;
        Ok(self.store.push(name, array))
    }

    fn take_checked(&mut self, name: &str, shape: Option<&[i32]>, float: bool) -> Result<ParamId> {
        let array = self.remove_checked(name, shape, float)?;
        Ok(self.store.push(name, array))
    }

    /// Removes a tensor of exactly `shape` from the checkpoint without
    /// adding it to the store, for a caller that combines several tensors
    /// into one (see [`crate::nn::FusedLinear`]): floating-point when
    /// `float`, packed `uint32` otherwise.
    pub fn take_raw(&mut self, name: &str, shape: &[i32], float: bool) -> Result<Array> {
        if !float {
            let file = self.file_for(name);
            let dtype = self.map.dtype_of(name).ok_or_else(|| self.missing(name))?;
            if dtype != Dtype::Uint32 {
                return Err(Error::TensorMismatch {
                    name: name.to_owned(),
                    file,
                    expected: "uint32 (packed quantized weight)".into(),
                    found: format!("{dtype:?}"),
                });
            }
        }
        self.remove_checked(name, Some(shape), float)
    }

    /// The dtype of a tensor not taken yet.
    pub fn dtype_of(&self, name: &str) -> Option<Dtype> {
        self.map.dtype_of(name)
    }

    fn remove_checked(&mut self, name: &str, shape: Option<&[i32]>, float: bool) -> Result<Array> {
        let file = self.file_for(name);
        let data = self
            .map
            .tensors
            .remove(name)
            .ok_or_else(|| self.missing(name))?
            .data;
        let (dims, dtype) = (data.shape().to_vec(), data.dtype());
        let cut = match (self.split(), self.shard()) {
            (Some(split), Some(shard)) if !self.map.rank_parts => {
                split.axis(dims.len()).map(|axis| (axis, shard.clone()))
            }
            _ => None,
        };
        // Each segment of the split axis: this rank's length and how many
        // ranks hold each of its parts (one segment, one copy: an even cut).
        let plan: Vec<(i32, usize)> = self
            .segments
            .iter()
            .rev()
            .find(|(module, _)| {
                name.strip_prefix(module.as_str())
                    .is_some_and(|rest| rest.starts_with('.'))
            })
            .map(|(_, s)| s.clone())
            .unwrap_or_else(|| vec![(1, self.copies_of(name))]);
        // Nothing is cut (one device, or a map of this rank's parts already).
        let ranks = cut.as_ref().map(|(_, shard)| shard.size());
        let parts = |copies: usize| {
            let Some(ranks) = ranks else { return Ok(1) };
            if copies > 0 && ranks.is_multiple_of(copies) {
                Ok((ranks / copies) as i32)
            } else {
                Err(Error::Other(format!(
                    "{name}: {copies} ranks cannot share each part of a split across {ranks} ranks"
                )))
            }
        };
        let local: i32 = plan.iter().map(|&(n, _)| n).sum();
        let mut whole_units = 0;
        for &(n, c) in &plan {
            whole_units += n * parts(c)?;
        }
        let whole_shape: Option<Vec<i32>> = shape.map(|s| {
            let mut s = s.to_vec();
            if let Some((axis, _)) = &cut {
                if let Some(d) = s.get_mut(*axis) {
                    *d = (*d as i64 * whole_units as i64 / local.max(1) as i64) as i32;
                }
            }
            s
        });
        if let Some(shape) = whole_shape.as_deref() {
            if dims != shape {
                return Err(Error::TensorMismatch {
                    name: name.to_owned(),
                    file,
                    expected: format!("shape {}", shape_str(shape)),
                    found: format!("shape {}", shape_str(&dims)),
                });
            }
        }
        if float && !matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16) {
            return Err(Error::TensorMismatch {
                name: name.to_owned(),
                file,
                expected: "a floating-point dtype".into(),
                found: format!("{dtype:?}"),
            });
        }
        let Some((axis, shard)) = cut else {
            return data.into_array();
        };
        let len = dims[axis];
        let scale = len / whole_units.max(1);
        let mut whole = Vec::with_capacity(plan.len());
        for &(n, c) in &plan {
            let p = parts(c)?;
            whole.push((n * p * scale, p as usize));
        }
        let ranges = shard.part_ranges(len, axis, &whole, name)?;
        // Read this rank's part alone where the file still holds it as it is.
        data.part(&file, &shard, axis, &whole, &ranges, name)
    }

    /// Adds a tensor that the checkpoint does not hold (e.g. a derived one).
    pub fn push_derived(&mut self, name: &str, array: Array) -> ParamId {
        self.store.push(name, array)
    }

    /// Ends loading: an error if any tensor was not used.
    pub fn finish(self) -> Result<ParamStore> {
        if !self.map.is_empty() {
            let names = self.map.names();
            let file = self.file_for(&names[0]);
            return Err(Error::UnexpectedTensors { names, file });
        }
        Ok(self.store)
    }
}
