//! GGUF checkpoints of the llama family, read with MLX's own GGUF loader.
//!
//! MLX returns `Q4_0`, `Q4_1` and `Q8_0` tensors as affine-quantized
//! `weight`/`scales`/`biases` (group 32) and `F16`/`F32` as dense arrays.
//! This module turns llama.cpp's naming into mlx-lm's, undoes llama.cpp's
//! row permutation of Q and K (its RoPE layout), synthesizes `config.json`
//! (with the quantization of every tensor) from the `llama.*` metadata, and
//! reads the tokenizer metadata.
//!
//! The file header is walked before MLX sees the file, so a truncated or
//! corrupt GGUF is an error naming it rather than a crash inside gguflib.

use mlex_core::config::ModelConfig;
use mlex_core::error::{Error, Result};
use mlex_core::weights::WeightMap;
use mlx_rs::io::{GgufFile, GgufMetadataValue};
use mlx_rs::{ops, Array, Dtype};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// Tokenizer data stored in a GGUF file.
#[derive(Clone, Debug, Default)]
pub struct GgufTokenizer {
    /// `tokenizer.ggml.model` (`gpt2` for byte-level BPE, `llama` for SentencePiece).
    pub model: String,
    /// Vocabulary in id order.
    pub tokens: Vec<String>,
    /// BPE merges (`"a b"`).
    pub merges: Vec<String>,
    /// Per-token types (1 normal, 3 control, ...).
    pub token_types: Vec<i32>,
    /// Beginning-of-sequence id.
    pub bos: Option<u32>,
    /// End-of-sequence id.
    pub eos: Option<u32>,
    /// Whether to prepend BOS.
    pub add_bos: Option<bool>,
    /// Jinja chat template.
    pub chat_template: Option<String>,
}

/// A GGUF file turned into an mlx-lm-style checkpoint.
pub struct GgufCheckpoint {
    /// Synthesized `config.json`.
    pub config: ModelConfig,
    /// Tensors under mlx-lm llama names.
    pub weights: WeightMap,
    /// Tokenizer metadata.
    pub tokenizer: GgufTokenizer,
    /// The GGML type (`Q4_1`, `F32`, ...) each weight had in the file, under
    /// its mlx-lm name.
    pub tensor_types: Vec<(String, String)>,
}

fn bad(path: &Path, message: impl Into<String>) -> Error {
    Error::BadWeightsFile {
        file: path.to_owned(),
        format: "GGUF",
        message: message.into(),
    }
}

/// Walks the GGUF header (metadata and tensor descriptors) and checks that
/// every tensor's data lies inside the file; returns each tensor's name and
/// GGML type.
pub fn validate_gguf(path: &Path) -> Result<Vec<(String, String)>> {
    let len = std::fs::metadata(path)
        .map_err(|e| Error::io(path, e))?
        .len();
    let mut f = std::io::BufReader::new(std::fs::File::open(path).map_err(|e| Error::io(path, e))?);
    let mut pos: u64 = 0;
    // Every size comes from the file: checked arithmetic throughout, so a
    // crafted header is an error, not an overflow or a huge allocation.
    let mut read = |n: u64, pos: &mut u64| -> Result<Vec<u8>> {
        if pos.checked_add(n).is_none_or(|end| end > len) {
            return Err(bad(
                path,
                format!(
                    "truncated header: {n} bytes claimed at byte {}, file has {len}",
                    *pos
                ),
            ));
        }
        let mut b = vec![0u8; n as usize];
        f.read_exact(&mut b).map_err(|e| bad(path, e.to_string()))?;
        *pos += n;
        Ok(b)
    };
    let u32_at = |b: &[u8]| u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
    let u64_at = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
    if read(4, &mut pos)? != b"GGUF" {
        return Err(bad(path, "missing GGUF magic"));
    }
    let version = u32_at(&read(4, &mut pos)?);
    if !(2..=3).contains(&version) {
        return Err(bad(path, format!("unsupported GGUF version {version}")));
    }
    let n_tensors = u64_at(&read(8, &mut pos)?);
    let n_kv = u64_at(&read(8, &mut pos)?);
    if n_tensors > 1 << 24 || n_kv > 1 << 24 {
        return Err(bad(path, "implausible tensor or metadata count"));
    }
    fn skip_value(
        ty: u32,
        read: &mut dyn FnMut(u64, &mut u64) -> Result<Vec<u8>>,
        pos: &mut u64,
        depth: usize,
        path: &Path,
    ) -> Result<()> {
        let size = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => {
                let n = u64::from_le_bytes(read(8, pos)?[..8].try_into().expect("8"));
                read(n, pos)?;
                return Ok(());
            }
            9 => {
                if depth > 2 {
                    return Err(bad(path, "nested metadata arrays too deep"));
                }
                let inner = u32::from_le_bytes(read(4, pos)?[..4].try_into().expect("4"));
                let n = u64::from_le_bytes(read(8, pos)?[..8].try_into().expect("8"));
                for _ in 0..n {
                    skip_value(inner, read, pos, depth + 1, path)?;
                }
                return Ok(());
            }
            other => return Err(bad(path, format!("unknown metadata type {other}"))),
        };
        read(size, pos)?;
        Ok(())
    }
    let mut alignment = 32u64;
    for _ in 0..n_kv {
        let klen = u64_at(&read(8, &mut pos)?);
        let key = String::from_utf8_lossy(&read(klen, &mut pos)?).into_owned();
        let ty = u32_at(&read(4, &mut pos)?);
        if key == "general.alignment" && ty == 4 {
            alignment = u64::from(u32_at(&read(4, &mut pos)?)).max(1);
        } else {
            skip_value(ty, &mut read, &mut pos, 0, path)?;
        }
    }
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        let nlen = u64_at(&read(8, &mut pos)?);
        let name = String::from_utf8_lossy(&read(nlen, &mut pos)?).into_owned();
        let ndim = u32_at(&read(4, &mut pos)?);
        if ndim > 8 {
            return Err(bad(path, format!("tensor `{name}` has {ndim} dimensions")));
        }
        let mut elems: u64 = 1;
        for _ in 0..ndim {
            let dim = u64_at(&read(8, &mut pos)?);
            elems = elems.checked_mul(dim).ok_or_else(|| {
                bad(
                    path,
                    format!("tensor `{name}`: its dimensions overflow 64 bits"),
                )
            })?;
        }
        let ty = u32_at(&read(4, &mut pos)?);
        let offset = u64_at(&read(8, &mut pos)?);
        // Bytes per element block for the types MLX reads.
        let bytes = match ty {
            0 => elems.checked_mul(4),           // F32
            1 => elems.checked_mul(2),           // F16
            2 => (elems / 32).checked_mul(18),   // Q4_0
            3 => (elems / 32).checked_mul(20),   // Q4_1
            8 => (elems / 32).checked_mul(34),   // Q8_0
            30 => elems.checked_mul(2),          // BF16
            other => {
                return Err(bad(
                    path,
                    format!("tensor `{name}` has GGML type {other}; MLX reads F32, F16, BF16, Q4_0, Q4_1 and Q8_0"),
                ))
            }
        };
        let bytes = bytes
            .ok_or_else(|| bad(path, format!("tensor `{name}`: its size overflows 64 bits")))?;
        let type_name = match ty {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            8 => "Q8_0",
            _ => "BF16",
        };
        infos.push((name, offset, bytes, type_name));
    }
    let data_start = pos
        .div_ceil(alignment)
        .checked_mul(alignment)
        .ok_or_else(|| {
            bad(
                path,
                format!("alignment {alignment} overflows the file offsets"),
            )
        })?;
    let mut types = Vec::with_capacity(infos.len());
    for (name, offset, bytes, type_name) in infos {
        let Some(end) = data_start
            .checked_add(offset)
            .and_then(|e| e.checked_add(bytes))
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
        types.push((name, type_name.to_owned()));
    }
    Ok(types)
}

/// Typed metadata reads; every error names the file and the key.
struct Meta<'a> {
    f: &'a GgufFile,
    path: &'a Path,
}

impl Meta<'_> {
    fn array(&self, key: &str, dtype: Dtype) -> Result<Option<Array>> {
        let err = |e: &dyn std::fmt::Display| bad(self.path, format!("metadata `{key}`: {e}"));
        match self.f.get_metadata(key).map_err(|e| err(&e))? {
            Some(GgufMetadataValue::Array(a)) => {
                let a = a.as_dtype(dtype).map_err(|e| err(&e))?;
                a.eval().map_err(|e| err(&e))?;
                Ok(Some(a))
            }
            _ => Ok(None),
        }
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.array(key, Dtype::Float32)?
            .map(|a| {
                a.try_item_exact::<f32>()
                    .map(f64::from)
                    .map_err(|e| bad(self.path, format!("metadata `{key}`: {e}")))
            })
            .transpose()
    }

    fn i64(&self, key: &str) -> Result<Option<i64>> {
        self.array(key, Dtype::Int32)?
            .map(|a| {
                a.try_item_exact::<i32>()
                    .map(i64::from)
                    .map_err(|e| bad(self.path, format!("metadata `{key}`: {e}")))
            })
            .transpose()
    }

    fn ints(&self, key: &str) -> Result<Vec<i32>> {
        match self.array(key, Dtype::Int32)? {
            Some(a) => Ok(a
                .try_as_slice::<i32>()
                .map_err(|e| bad(self.path, format!("metadata `{key}`: {e}")))?
                .to_vec()),
            None => Ok(Vec::new()),
        }
    }

    fn str(&self, key: &str) -> Option<String> {
        match self.f.get_metadata(key) {
            Ok(Some(GgufMetadataValue::String(s))) => Some(s),
            _ => None,
        }
    }

    fn strings(&self, key: &str) -> Vec<String> {
        match self.f.get_metadata(key) {
            Ok(Some(GgufMetadataValue::Strings(s))) => s,
            _ => Vec::new(),
        }
    }
}

/// llama.cpp tensor name → mlx-lm llama name (without `.weight` etc.).
fn rename(module: &str) -> Option<String> {
    let simple = [
        ("token_embd", "model.embed_tokens"),
        ("output_norm", "model.norm"),
        ("output", "lm_head"),
    ];
    if let Some((_, to)) = simple.iter().find(|(f, _)| *f == module) {
        return Some((*to).to_owned());
    }
    let rest = module.strip_prefix("blk.")?;
    let (n, part) = rest.split_once('.')?;
    let to = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{n}.{to}"))
}

/// Inverse of llama.cpp's `permute` of Q/K rows: rows are `[heads, 2, d/2]`
/// interleaved as `[heads, d/2, 2]` in the file.
fn unpermute(a: &Array, heads: i32) -> Result<Array> {
    let s = a.shape().to_vec();
    let rows = s[0];
    let half = rows / heads / 2;
    let mut shape = vec![heads, half, 2];
    shape.extend_from_slice(&s[1..]);
    let r = ops::reshape(a, &shape)?.swap_axes(1, 2)?;
    Ok(ops::reshape(&r, &s)?)
}

/// Reads a llama-family GGUF file.
pub fn load(path: &Path) -> Result<GgufCheckpoint> {
    let file_types: BTreeMap<String, String> = validate_gguf(path)?.into_iter().collect();
    let mut tensor_types = Vec::new();
    let f = GgufFile::load(path).map_err(|e| bad(path, e.to_string()))?;
    let meta = Meta { f: &f, path };
    let arch = meta.str("general.architecture").unwrap_or_default();
    if arch != "llama" {
        return Err(bad(
            path,
            format!("general.architecture is `{arch}`; GGUF loading supports the llama family"),
        ));
    }
    let positive = |k: &str, v: i64| -> Result<i64> {
        mlex_core::config::count(v)
            .map(i64::from)
            .map_err(|m| bad(path, format!("metadata `{k}` {m}")))
    };
    let need = |k: &str| -> Result<i64> {
        let v = meta
            .i64(k)?
            .ok_or_else(|| bad(path, format!("metadata `{k}` is missing")))?;
        positive(k, v)
    };
    let layers = need("llama.block_count")?;
    let hidden = need("llama.embedding_length")?;
    let ffn = need("llama.feed_forward_length")?;
    let heads = need("llama.attention.head_count")?;
    let kv_heads = match meta.i64("llama.attention.head_count_kv")? {
        Some(v) => positive("llama.attention.head_count_kv", v)?,
        None => heads,
    };
    let theta = meta.f64("llama.rope.freq_base")?.unwrap_or(10000.0);
    let eps = meta
        .f64("llama.attention.layer_norm_rms_epsilon")?
        .unwrap_or(1e-5);
    let context = meta.i64("llama.context_length")?;
    let tokenizer = GgufTokenizer {
        model: meta.str("tokenizer.ggml.model").unwrap_or_default(),
        tokens: meta.strings("tokenizer.ggml.tokens"),
        merges: meta.strings("tokenizer.ggml.merges"),
        token_types: meta.ints("tokenizer.ggml.token_type")?,
        bos: meta.i64("tokenizer.ggml.bos_token_id")?.map(|v| v as u32),
        eos: meta.i64("tokenizer.ggml.eos_token_id")?.map(|v| v as u32),
        add_bos: meta.i64("tokenizer.ggml.add_bos_token")?.map(|v| v != 0),
        chat_template: meta.str("tokenizer.chat_template"),
    };

    let raw = f.arrays().map_err(|e| bad(path, e.to_string()))?;
    let mut weights = WeightMap::new();
    let file = weights.add_file(path.to_owned());
    // module → (bits, group) for quantized tensors
    let mut quant: BTreeMap<String, (i32, i32)> = BTreeMap::new();
    let mut vocab = 0;
    let mut tied = true;
    for (name, array) in raw {
        let (module, suffix) = name
            .rsplit_once('.')
            .ok_or_else(|| bad(path, format!("unexpected tensor `{name}`")))?;
        let target = rename(module).ok_or_else(|| {
            bad(
                path,
                format!("tensor `{name}` has no llama equivalent (unsupported GGUF layout)"),
            )
        })?;
        if target == "lm_head" {
            tied = false;
        }
        if suffix == "weight" || suffix == "bias" {
            if let Some(ty) = file_types.get(&name) {
                tensor_types.push((format!("{target}.{suffix}"), ty.clone()));
            }
        }
        if array.ndim() == 0 || array.shape().contains(&0) {
            return Err(bad(
                path,
                format!("tensor `{name}` has the empty shape {:?}", array.shape()),
            ));
        }
        let mut a = array;
        let rotary = if module.ends_with("attn_q") {
            Some(heads)
        } else if module.ends_with("attn_k") {
            Some(kv_heads)
        } else {
            None
        };
        if let Some(h) = rotary.filter(|h| a.shape()[0] as i64 % (2 * h) != 0) {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}`: {} rows do not split into {h} heads of rotary pairs",
                    a.shape()[0]
                ),
            ));
        }
        if module.ends_with("attn_q") {
            a = unpermute(&a, heads as i32)?;
        } else if module.ends_with("attn_k") {
            a = unpermute(&a, kv_heads as i32)?;
        }
        if target == "model.embed_tokens" {
            vocab = a.shape()[0];
        }
        weights.insert(format!("{target}.{suffix}"), a, file);
        if suffix == "scales" {
            quant.entry(target).or_insert((0, 0));
        }
    }
    // Bits and group of each quantized module from its packed shapes.
    for (module, spec) in quant.iter_mut() {
        let w = weights
            .get(&format!("{module}.weight"))
            .ok_or_else(|| bad(path, format!("{module} has scales but no weight")))?;
        let s = weights.get(&format!("{module}.scales")).expect("present");
        let group = 32;
        let in_features = s.shape()[s.ndim() - 1] * group;
        let packed = w.shape()[w.ndim() - 1];
        *spec = (packed * 32 / in_features, group);
    }
    let mut counts: BTreeMap<(i32, i32), usize> = BTreeMap::new();
    for s in quant.values() {
        *counts.entry(*s).or_default() += 1;
    }
    let mut config = Map::new();
    config.insert("model_type".into(), json!("llama"));
    config.insert("hidden_size".into(), json!(hidden));
    config.insert("num_hidden_layers".into(), json!(layers));
    config.insert("intermediate_size".into(), json!(ffn));
    config.insert("num_attention_heads".into(), json!(heads));
    config.insert("num_key_value_heads".into(), json!(kv_heads));
    config.insert("rms_norm_eps".into(), json!(eps));
    config.insert("rope_theta".into(), json!(theta));
    config.insert("vocab_size".into(), json!(vocab));
    config.insert("tie_word_embeddings".into(), json!(tied));
    if let Some(c) = context {
        config.insert("max_position_embeddings".into(), json!(c));
    }
    if let Some((&(bits, group), _)) = counts.iter().max_by_key(|(_, n)| **n) {
        let mut q = Map::new();
        q.insert("group_size".into(), json!(group));
        q.insert("bits".into(), json!(bits));
        for (module, (b, g)) in &quant {
            if (*b, *g) != (bits, group) {
                q.insert(module.clone(), json!({"group_size": g, "bits": b}));
            }
        }
        config.insert("quantization".into(), Value::Object(q));
    }
    Ok(GgufCheckpoint {
        config: ModelConfig::new(Value::Object(config), path),
        weights,
        tokenizer,
        tensor_types,
    })
}
