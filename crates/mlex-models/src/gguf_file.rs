//! The GGUF container, read by mlex itself rather than by MLX's gguflib
//! (which reads Q4_K and Q6_K only as float16 and fails on Q5_K): the
//! header (metadata and tensor descriptors), every size checked against the
//! file, and each tensor's data converted to what MLX computes with.
//!
//! Tensor types, as llama.cpp's `ggml-common.h` lays out their blocks, and
//! what each becomes:
//! - `F32`, `F16`, `BF16`: dense arrays of that dtype.
//! - `Q4_0`, `Q4_1`, `Q8_0` (32-element blocks, one f16 scale, and for
//!   `Q4_1` an f16 minimum): MLX affine 4/4/8-bit, group 32, with float16
//!   scales and biases: exact (`Q4_0`'s bias is `-8 d`, `Q8_0`'s `-128 d`).
//! - `Q4_K`, `Q5_K` (256-element super-blocks of eight 32-element
//!   sub-blocks, `w = d * sc * q - dmin * m` with 6-bit `sc` and `m`): MLX
//!   affine 4/5-bit, group 32, with float32 scales `d * sc` and biases
//!   `-dmin * m` (exact; float16 would round them), so the same bits per
//!   weight plus 2 x 32 bits per 32 weights: 6.0 and 7.0 bits a weight
//!   against the file's 4.5 and 5.5.
//! - `Q6_K` (16-element sub-blocks with int8 scales): no MLX affine group
//!   holds two scales, so it is dequantized to float16 (16 bits a weight
//!   against the file's 6.56, about 2.4x the memory; the value `d * sc * q`
//!   is rounded to float16 once).

use half::f16;
use mlex_core::error::{Error, Result};
use mlx_rs::{Array, Dtype};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// Any signed integer type.
    Int(i64),
    /// Any unsigned integer type.
    UInt(u64),
    /// `f32` or `f64`.
    Float(f64),
    /// `bool`.
    Bool(bool),
    /// A string (invalid UTF-8 replaced).
    Str(String),
    /// An array of values.
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// As a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::Int(v) => Some(v),
            MetaValue::UInt(v) => i64::try_from(v).ok(),
            MetaValue::Bool(b) => Some(b as i64),
            _ => None,
        }
    }

    /// As a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::Float(v) => Some(v),
            MetaValue::Int(v) => Some(v as f64),
            MetaValue::UInt(v) => Some(v as f64),
            _ => None,
        }
    }
}

/// A GGML tensor type mlex reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// 4-bit, blocks of 32, scale only.
    Q4_0,
    /// 4-bit, blocks of 32, scale and minimum.
    Q4_1,
    /// 8-bit, blocks of 32.
    Q8_0,
    /// 4-bit K-quant (super-blocks of 256).
    Q4K,
    /// 5-bit K-quant.
    Q5K,
    /// 6-bit K-quant.
    Q6K,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    /// llama.cpp's name (`Q4_K`, `F32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// (elements, bytes) of one block.
    pub(crate) fn block(self) -> (u64, u64) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
        }
    }
}

/// One tensor's descriptor.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// The name in the file (`blk.0.attn_q.weight`).
    pub name: String,
    /// The shape in MLX order (GGML's reversed: rows first).
    pub shape: Vec<i32>,
    /// The tensor type.
    pub ty: GgmlType,
    /// Where its data starts in the file.
    pub start: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

/// The header of a GGUF file.
#[derive(Clone, Debug, Default)]
pub struct GgufHeader {
    /// Metadata by key.
    pub meta: BTreeMap<String, MetaValue>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
}

fn bad(path: &Path, message: impl Into<String>) -> Error {
    Error::BadWeightsFile {
        file: path.to_owned(),
        format: "GGUF",
        message: message.into(),
    }
}

/// The longest metadata array read: vocabularies and merge lists run to a
/// few hundred thousand entries; each element costs 32 bytes in memory.
const MAX_ARRAY: u64 = 1 << 22;

struct Reader<'a, R> {
    r: R,
    pos: u64,
    len: u64,
    path: &'a Path,
}

impl<R: Read> Reader<'_, R> {
    fn bytes(&mut self, n: u64) -> Result<Vec<u8>> {
        if self.pos.checked_add(n).is_none_or(|end| end > self.len) {
            return Err(bad(
                self.path,
                format!(
                    "truncated header: {n} bytes claimed at byte {}, file has {}",
                    self.pos, self.len
                ),
            ));
        }
        let mut b = vec![0u8; n as usize];
        self.r
            .read_exact(&mut b)
            .map_err(|e| bad(self.path, e.to_string()))?;
        self.pos += n;
        Ok(b)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.bytes(N as u64)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        Ok(String::from_utf8_lossy(&self.bytes(n)?).into_owned())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::UInt(u64::from(self.array::<1>()?[0])),
            1 => MetaValue::Int(i64::from(self.array::<1>()?[0] as i8)),
            2 => MetaValue::UInt(u64::from(u16::from_le_bytes(self.array()?))),
            3 => MetaValue::Int(i64::from(i16::from_le_bytes(self.array()?))),
            4 => MetaValue::UInt(u64::from(self.u32()?)),
            5 => MetaValue::Int(i64::from(i32::from_le_bytes(self.array()?))),
            6 => MetaValue::Float(f64::from(f32::from_le_bytes(self.array()?))),
            7 => MetaValue::Bool(self.array::<1>()?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(bad(self.path, "nested metadata arrays too deep"));
                }
                let inner = self.u32()?;
                let n = self.u64()?;
                // Every element takes at least a byte: a count past the
                // file's end is a crafted header, not an allocation to try.
                if n > self.len.saturating_sub(self.pos) || n > MAX_ARRAY {
                    return Err(bad(
                        self.path,
                        format!(
                            "a metadata array claims {n} elements (more than the file holds, or over {MAX_ARRAY})"
                        ),
                    ));
                }
                let mut v = Vec::new();
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::UInt(self.u64()?),
            11 => MetaValue::Int(i64::from_le_bytes(self.array()?)),
            12 => MetaValue::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(bad(self.path, format!("unknown metadata type {other}"))),
        })
    }
}

/// Reads and checks the header: magic and version, every metadata value,
/// and every tensor's type, shape and extent within the file.
pub fn read_header(path: &Path) -> Result<GgufHeader> {
    let len = std::fs::metadata(path)
        .map_err(|e| Error::io(path, e))?
        .len();
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut r = Reader {
        r: std::io::BufReader::new(f),
        pos: 0,
        len,
        path,
    };
    if r.bytes(4)? != b"GGUF" {
        return Err(bad(path, "missing GGUF magic"));
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(bad(path, format!("unsupported GGUF version {version}")));
    }
    let n_tensors = r.u64()?;
    let n_kv = r.u64()?;
    if n_tensors > 1 << 24 || n_kv > 1 << 24 {
        return Err(bad(path, "implausible tensor or metadata count"));
    }
    let mut meta = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string()?;
        let ty = r.u32()?;
        let v = r.value(ty, 0)?;
        meta.insert(key, v);
    }
    let alignment = match meta.get("general.alignment").and_then(MetaValue::as_i64) {
        Some(a) if a > 0 => a as u64,
        Some(a) => return Err(bad(path, format!("general.alignment is {a}"))),
        None => 32,
    };
    let mut raw = Vec::new();
    for _ in 0..n_tensors {
        let name = r.string()?;
        let ndim = r.u32()?;
        if ndim > 8 {
            return Err(bad(path, format!("tensor `{name}` has {ndim} dimensions")));
        }
        let mut dims = Vec::new();
        let mut elems: u64 = 1;
        for _ in 0..ndim {
            let dim = r.u64()?;
            elems = elems.checked_mul(dim).ok_or_else(|| {
                bad(
                    path,
                    format!("tensor `{name}`: its dimensions overflow 64 bits"),
                )
            })?;
            dims.push(dim);
        }
        let id = r.u32()?;
        let offset = r.u64()?;
        let ty = GgmlType::from_id(id).ok_or_else(|| {
            bad(
                path,
                format!(
                    "tensor `{name}` has GGML type {id}; mlex reads F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K"
                ),
            )
        })?;
        let (per, size) = ty.block();
        let row = dims.first().copied().unwrap_or(1);
        if row % per != 0 {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}`: rows of {row} elements do not split into {} blocks of {per}",
                    ty.name()
                ),
            ));
        }
        let bytes = (elems / per)
            .checked_mul(size)
            .ok_or_else(|| bad(path, format!("tensor `{name}`: its size overflows 64 bits")))?;
        if dims.contains(&0) {
            return Err(bad(
                path,
                format!("tensor `{name}` has an empty dimension {dims:?}"),
            ));
        }
        // MLX indexes arrays with 32-bit sizes.
        if elems > i32::MAX as u64 {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}` has {elems} elements; mlex reads tensors of at most 2^31 - 1"
                ),
            ));
        }
        let shape: Vec<i32> = dims.iter().rev().map(|&d| d as i32).collect();
        raw.push((name, shape, ty, offset, bytes));
    }
    let data_start = r
        .pos
        .div_ceil(alignment)
        .checked_mul(alignment)
        .ok_or_else(|| {
            bad(
                path,
                format!("alignment {alignment} overflows the file offsets"),
            )
        })?;
    let mut seen = std::collections::HashSet::new();
    for (name, ..) in &raw {
        if !seen.insert(name.as_str()) {
            return Err(bad(path, format!("tensor `{name}` is described twice")));
        }
    }
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, shape, ty, offset, bytes) in raw {
        let Some((start, end)) = data_start
            .checked_add(offset)
            .and_then(|s| s.checked_add(bytes).map(|e| (s, e)))
        else {
            return Err(bad(
                path,
                format!("tensor `{name}`: offset {offset} + {bytes} bytes overflows 64 bits"),
            ));
        };
        if end > len {
            return Err(bad(
                path,
                format!("tensor `{name}` ends at byte {end}, past the end of the file ({len} bytes): truncated?"),
            ));
        }
        tensors.push(TensorInfo {
            name,
            shape,
            ty,
            start,
            bytes,
        });
    }
    // Tensors may not share bytes: otherwise a small file could describe the
    // same region many times over and have it converted each time.
    let mut by_start: Vec<&TensorInfo> = tensors.iter().collect();
    by_start.sort_by_key(|t| t.start);
    for w in by_start.windows(2) {
        if w[0].start + w[0].bytes > w[1].start {
            return Err(bad(
                path,
                format!(
                    "tensors `{}` and `{}` overlap in the file",
                    w[0].name, w[1].name
                ),
            ));
        }
    }
    Ok(GgufHeader { meta, tensors })
}

/// A tensor ready for MLX.
#[derive(Clone, Debug)]
pub enum TensorData {
    /// A dense array.
    Dense(Array),
    /// MLX affine quantization: packed weights, scales and biases.
    Affine {
        /// `uint32`, `[rows, cols * bits / 32]`.
        weight: Array,
        /// `[rows, cols / group]`.
        scales: Array,
        /// `[rows, cols / group]`.
        biases: Array,
        /// Bits per weight.
        bits: i32,
        /// Weights per scale.
        group: i32,
    },
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Packs `vals` (each below `2^bits`) as MLX does: a little-endian bit
/// stream, value `i` at bits `[i * bits, (i + 1) * bits)`.
fn pack(vals: &[u8], bits: u32, out: &mut Vec<u32>) {
    let mut acc: u64 = 0;
    let mut n = 0u32;
    for &v in vals {
        acc |= u64::from(v) << n;
        n += bits;
        while n >= 32 {
            out.push(acc as u32);
            acc >>= 32;
            n -= 32;
        }
    }
    debug_assert_eq!(n, 0, "rows are whole groups of 32");
}

/// Q4_K/Q5_K's 6-bit scale and minimum of sub-block `j` (llama.cpp's
/// `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Converts the data `raw` of a tensor shaped as `t` says (whole rows of
/// whole blocks: all of a tensor, or the rows and blocks of it that one
/// rank reads) into MLX arrays (see the module docs).
pub fn decode(raw: &[u8], t: &TensorInfo, path: &Path) -> Result<TensorData> {
    let shape = &t.shape;
    let cols = *shape.last().unwrap_or(&1) as usize;
    let n: usize = shape.iter().map(|&d| d as usize).product();
    let mlx = |e: mlx_rs::error::Exception| bad(path, format!("tensor `{}`: {e}", t.name));
    let u16s = |b: &[u8]| -> Vec<u16> {
        b.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    };
    let affine = |vals: Vec<u8>,
                  scales: Vec<f32>,
                  biases: Vec<f32>,
                  bits: u32,
                  half_scales: bool|
     -> Result<TensorData> {
        let mut packed = Vec::with_capacity(vals.len() * bits as usize / 32);
        pack(&vals, bits, &mut packed);
        let mut wshape = shape.clone();
        *wshape.last_mut().expect("a matrix") = (cols as u64 * u64::from(bits) / 32) as i32;
        let mut sshape = shape.clone();
        *sshape.last_mut().expect("a matrix") = (cols / 32) as i32;
        let (scales, biases) = if half_scales {
            let to16 =
                |v: &[f32]| -> Vec<u16> { v.iter().map(|x| f16::from_f32(*x).to_bits()).collect() };
            (
                Array::from_slice(&to16(&scales), &sshape)
                    .view_dtype(Dtype::Float16)
                    .map_err(mlx)?,
                Array::from_slice(&to16(&biases), &sshape)
                    .view_dtype(Dtype::Float16)
                    .map_err(mlx)?,
            )
        } else {
            (
                Array::from_slice(&scales, &sshape),
                Array::from_slice(&biases, &sshape),
            )
        };
        Ok(TensorData::Affine {
            weight: Array::from_slice(&packed, &wshape),
            scales,
            biases,
            bits: bits as i32,
            group: 32,
        })
    };
    Ok(match t.ty {
        GgmlType::F32 => {
            let v: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            TensorData::Dense(Array::from_slice(&v, shape))
        }
        GgmlType::F16 => TensorData::Dense(
            Array::from_slice(&u16s(raw), shape)
                .view_dtype(Dtype::Float16)
                .map_err(mlx)?,
        ),
        GgmlType::Bf16 => TensorData::Dense(
            Array::from_slice(&u16s(raw), shape)
                .view_dtype(Dtype::Bfloat16)
                .map_err(mlx)?,
        ),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
            let (_, size) = t.ty.block();
            let blocks = n / 32;
            let mut vals = Vec::with_capacity(n);
            let mut scales = Vec::with_capacity(blocks);
            let mut biases = Vec::with_capacity(blocks);
            for b in raw.chunks_exact(size as usize) {
                let d = h(b, 0);
                match t.ty {
                    GgmlType::Q4_0 | GgmlType::Q4_1 => {
                        let (qs, bias) = if t.ty == GgmlType::Q4_0 {
                            (&b[2..18], -8.0 * d)
                        } else {
                            (&b[4..20], h(b, 2))
                        };
                        vals.extend(qs.iter().map(|q| q & 0xF));
                        vals.extend(qs.iter().map(|q| q >> 4));
                        scales.push(d);
                        biases.push(bias);
                    }
                    _ => {
                        vals.extend(b[2..34].iter().map(|&q| (q as i8 as i16 + 128) as u8));
                        scales.push(d);
                        biases.push(-128.0 * d);
                    }
                }
            }
            let bits = if t.ty == GgmlType::Q8_0 { 8 } else { 4 };
            affine(vals, scales, biases, bits, true)?
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let five = t.ty == GgmlType::Q5K;
            let mut vals = Vec::with_capacity(n);
            let mut scales = Vec::with_capacity(n / 32);
            let mut biases = Vec::with_capacity(n / 32);
            for b in raw.chunks_exact(if five { 176 } else { 144 }) {
                let (d, dmin) = (h(b, 0), h(b, 2));
                let sc = &b[4..16];
                let (qh, qs) = if five {
                    (&b[16..48], &b[48..176])
                } else {
                    (&b[0..0], &b[16..144])
                };
                for pair in 0..4 {
                    let q = &qs[pair * 32..pair * 32 + 32];
                    for half in 0..2 {
                        let j = pair * 2 + half;
                        let (s, m) = scale_min_k4(j, sc);
                        scales.push(d * f32::from(s));
                        biases.push(-dmin * f32::from(m));
                        for l in 0..32 {
                            let low = if half == 0 { q[l] & 0xF } else { q[l] >> 4 };
                            let high = if five { ((qh[l] >> j) & 1) << 4 } else { 0 };
                            vals.push(low | high);
                        }
                    }
                }
            }
            affine(vals, scales, biases, if five { 5 } else { 4 }, false)?
        }
        GgmlType::Q6K => {
            let mut out = vec![0u16; n];
            for (bi, b) in raw.chunks_exact(210).enumerate() {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = h(b, 208);
                let y = &mut out[bi * 256..bi * 256 + 256];
                for half in 0..2 {
                    let (ql, qh, sc) = (&ql[half * 64..], &qh[half * 32..], &sc[half * 8..]);
                    for l in 0..32 {
                        let is = l / 16;
                        let q = [
                            (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                            (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                            (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                            (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                        ];
                        for (k, q) in q.iter().enumerate() {
                            let v = d * f32::from(sc[is + 2 * k] as i8) * (f32::from(*q) - 32.0);
                            y[half * 128 + l + 32 * k] = f16::from_f32(v).to_bits();
                        }
                    }
                }
            }
            TensorData::Dense(
                Array::from_slice(&out, shape)
                    .view_dtype(Dtype::Float16)
                    .map_err(mlx)?,
            )
        }
    })
}
