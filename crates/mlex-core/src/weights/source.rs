//! Where a checkpoint's tensor data lies before a loader takes it: in a
//! safetensors file (read by MLX lazily, or only a `--tp` rank's runs of
//! it), in memory, or behind a [`PartReader`] that knows another file's
//! layout (GGUF blocks) and reads the whole tensor or a rank's part.

use crate::distributed::Shard;
use crate::error::{Error, Result};
use mlx_rs::{Array, Dtype};
use std::cell::OnceCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// Reads one tensor of a file on demand: whole, or only the runs
/// `(start, count)` along one axis that a `--tp` rank keeps, touching no
/// other bytes of the file than those runs need.
pub trait PartReader: Send + Sync + std::fmt::Debug {
    /// The tensor (`part` `None`), or its runs `ranges` along `axis`.
    fn read(&self, part: Option<(usize, &[(i32, i32)])>) -> Result<Array>;
}

/// One tensor's data as a [`super::WeightMap`] holds it.
#[derive(Clone, Debug)]
pub(super) enum Data {
    /// An MLX array, with where its bytes lie in a safetensors file while
    /// it is as loaded (MLX reads such an array only when evaluated).
    Array {
        array: Array,
        span: Option<FileSpan>,
    },
    /// Not read yet: `reader` reads it, whole (kept in `whole` once read)
    /// or one rank's part.
    Deferred {
        shape: Vec<i32>,
        dtype: Dtype,
        reader: Arc<dyn PartReader>,
        whole: OnceCell<Array>,
    },
}

impl Data {
    pub(super) fn shape(&self) -> &[i32] {
        match self {
            Data::Array { array, .. } => array.shape(),
            Data::Deferred { shape, .. } => shape,
        }
    }

    pub(super) fn dtype(&self) -> Dtype {
        match self {
            Data::Array { array, .. } => array.dtype(),
            Data::Deferred { dtype, .. } => *dtype,
        }
    }

    /// The whole tensor (a deferred one is read here, once).
    pub(super) fn array(&self) -> Result<&Array> {
        match self {
            Data::Array { array, .. } => Ok(array),
            Data::Deferred { reader, whole, .. } => {
                if whole.get().is_none() {
                    let _ = whole.set(reader.read(None)?);
                }
                Ok(whole.get().expect("set above"))
            }
        }
    }

    pub(super) fn into_array(self) -> Result<Array> {
        match self {
            Data::Array { array, .. } => Ok(array),
            Data::Deferred { reader, whole, .. } => match whole.into_inner() {
                Some(a) => Ok(a),
                None => reader.read(None),
            },
        }
    }

    /// This rank's part along `axis`: `ranges` of it (as
    /// [`Shard::part_ranges`] gives them for the segments `whole`), read
    /// from the file alone where the tensor is still as the file holds it.
    pub(super) fn part(
        self,
        path: &Path,
        shard: &Shard,
        axis: usize,
        whole_segments: &[(i32, usize)],
        ranges: &[(i32, i32)],
        name: &str,
    ) -> Result<Array> {
        match self {
            Data::Array {
                array,
                span: Some(span),
            } if span.shape.as_slice() == array.shape() && span.dtype == array.dtype() => {
                read_part(path, &span, axis, ranges)
            }
            Data::Deferred { reader, whole, .. } if whole.get().is_none() => {
                reader.read(Some((axis, ranges)))
            }
            data => shard.segmented_part(&data.into_array()?, axis, whole_segments, name),
        }
    }
}

/// A tensor's place in a safetensors file: the offset of its data, its
/// element type and shape (row-major).
#[derive(Clone, Debug)]
pub(super) struct FileSpan {
    offset: u64,
    dtype: Dtype,
    /// Bytes an element.
    elem: u64,
    shape: Vec<i32>,
}

/// Validates a safetensors file without reading its data: header present,
/// parseable, offsets inside the file, dtypes that MLX can load.
pub fn validate_safetensors(path: &Path) -> Result<()> {
    scan_safetensors(path).map(|_| ())
}

/// [`validate_safetensors`], and where each tensor's data lies.
pub(super) fn scan_safetensors(path: &Path) -> Result<BTreeMap<String, FileSpan>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let bad = |message: String| Error::BadWeightsFile {
        file: path.to_owned(),
        format: "safetensors",
        message,
    };
    // SAFETY: read-only map of a file we do not modify; a concurrent writer
    // could change bytes under us, which safetensors' bounds checks tolerate.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let st = safetensors::SafeTensors::deserialize(&map).map_err(|e| {
        // Some of safetensors' messages do not say which tensor: find it.
        match inconsistent_tensor(&map) {
            Some(name) => bad(format!(
                "{e} (`{name}`: its shape and dtype do not fit its data_offsets)"
            )),
            None => bad(e.to_string()),
        }
    })?;
    let mut spans = BTreeMap::new();
    for (name, view) in st.tensors() {
        use safetensors::Dtype as D;
        let dtype = match view.dtype() {
            D::F32 => Dtype::Float32,
            D::F16 => Dtype::Float16,
            D::BF16 => Dtype::Bfloat16,
            D::U32 => Dtype::Uint32,
            D::I32 => Dtype::Int32,
            D::U8 => Dtype::Uint8,
            D::I8 => Dtype::Int8,
            D::I64 => Dtype::Int64,
            D::U64 => Dtype::Uint64,
            D::BOOL => Dtype::Bool,
            D::U16 => Dtype::Uint16,
            D::I16 => Dtype::Int16,
            D::F64 => Dtype::Float64,
            other => {
                return Err(bad(format!(
                    "tensor `{name}` has dtype {other:?}, which MLX cannot load"
                )))
            }
        };
        let offset = (view.data().as_ptr() as usize - map.as_ptr() as usize) as u64;
        let shape = view.shape().iter().map(|&d| d as i32).collect();
        let elem = (view.dtype().bitsize() / 8) as u64;
        spans.insert(
            name,
            FileSpan {
                offset,
                dtype,
                elem,
                shape,
            },
        );
    }
    Ok(spans)
}

/// The runs `ranges` (`(start, count)` along `axis`) of the tensor at
/// `span` in `path`, read from the file and nothing else: one read per
/// run and index of the axes before `axis`.
fn read_part(path: &Path, span: &FileSpan, axis: usize, ranges: &[(i32, i32)]) -> Result<Array> {
    use std::os::unix::fs::FileExt;
    let elem = span.elem;
    let dim = span.shape[axis] as u64;
    let outer: u64 = span.shape[..axis].iter().map(|&d| d as u64).product();
    let inner: u64 = span.shape[axis + 1..].iter().map(|&d| d as u64).product();
    let kept: i32 = ranges.iter().map(|&(_, n)| n).sum();
    let mut bytes = vec![0u8; (outer * kept as u64 * inner * elem) as usize];
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut at = 0usize;
    for o in 0..outer {
        for &(start, n) in ranges {
            let from = span.offset + ((o * dim + start as u64) * inner) * elem;
            let len = (n as u64 * inner * elem) as usize;
            file.read_exact_at(&mut bytes[at..at + len], from)
                .map_err(|e| Error::io(path, e))?;
            at += len;
        }
    }
    let mut shape = span.shape.clone();
    shape[axis] = kept;
    // SAFETY: `bytes` holds exactly `shape`'s elements of `span.dtype`, row
    // major; MLX copies them.
    Ok(unsafe { Array::from_raw_data(bytes.as_ptr().cast(), &shape, span.dtype) })
}

/// The first tensor of a safetensors header whose shape and dtype need
/// another byte count than its `data_offsets` give (or overflow).
fn inconsistent_tensor(bytes: &[u8]) -> Option<String> {
    let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let end = 8usize.checked_add(usize::try_from(len).ok()?)?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes.get(8..end)?).ok()?;
    header.iter().find_map(|(name, t)| {
        if name == "__metadata__" {
            return None;
        }
        let size: u64 = match t.get("dtype")?.as_str()? {
            "F64" | "I64" | "U64" => 8,
            "F32" | "I32" | "U32" => 4,
            "F16" | "BF16" | "I16" | "U16" => 2,
            _ => 1,
        };
        let count = t
            .get("shape")?
            .as_array()?
            .iter()
            .try_fold(size, |n, d| n.checked_mul(d.as_u64()?));
        let off = t.get("data_offsets")?.as_array()?;
        let span = off.get(1)?.as_u64()?.checked_sub(off.first()?.as_u64()?);
        (count.is_none() || span.is_none() || count != span).then(|| name.clone())
    })
}
