//! GGUF checkpoints of the llama family.
//!
//! [`crate::gguf_file`] reads the container and turns each tensor type into
//! MLX affine `weight`/`scales`/`biases` (group 32) or a dense array (see
//! there for which type becomes what, and at what memory cost).
//! This module turns llama.cpp's naming into mlx-lm's (by `names.toml`, the
//! one table of names every GGUF family here uses), undoes llama.cpp's
//! row permutation of Q and K (its RoPE layout), synthesizes `config.json`
//! (with the quantization of every tensor) from the `llama.*` metadata, and
//! reads the tokenizer metadata.
//!
//! Every size in the header is checked against the file before any tensor
//! is read, so a truncated or corrupt GGUF is an error naming it.

mod family;
mod hybrid;
mod lazy;
mod names;

pub use family::{GgufSpec, MetaKey, MetaKeyTable, MetaType, NameScheme};

use crate::gguf_file::{self, MetaValue};
use mlex_core::config::ModelConfig;
use mlex_core::error::{Error, Result};
use mlex_core::weights::WeightMap;
use names::Scheme;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
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
    /// Per-token scores (SentencePiece vocabularies rank merges by them).
    pub scores: Vec<f32>,
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
/// every tensor's type is one mlex reads and its data lies inside the file;
/// returns each tensor's name and GGML type.
pub fn validate_gguf(path: &Path) -> Result<Vec<(String, String)>> {
    Ok(gguf_file::read_header(path)?
        .tensors
        .into_iter()
        .map(|t| (t.name, t.ty.name().to_owned()))
        .collect())
}

/// Typed metadata reads; every error names the file and the key.
struct Meta<'a> {
    meta: &'a BTreeMap<String, MetaValue>,
    path: &'a Path,
}

impl Meta<'_> {
    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.meta
            .get(key)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| bad(self.path, format!("metadata `{key}` is not a number")))
            })
            .transpose()
    }

    fn i64(&self, key: &str) -> Result<Option<i64>> {
        self.meta
            .get(key)
            .map(|v| {
                v.as_i64()
                    .ok_or_else(|| bad(self.path, format!("metadata `{key}` is not an integer")))
            })
            .transpose()
    }

    fn ints(&self, key: &str) -> Result<Vec<i32>> {
        match self.meta.get(key) {
            Some(MetaValue::Array(v)) => v
                .iter()
                .map(|x| {
                    x.as_i64()
                        .and_then(|i| i32::try_from(i).ok())
                        .ok_or_else(|| {
                            bad(self.path, format!("metadata `{key}` holds a non-integer"))
                        })
                })
                .collect(),
            Some(_) => Err(bad(self.path, format!("metadata `{key}` is not an array"))),
            None => Ok(Vec::new()),
        }
    }

    fn floats(&self, key: &str) -> Result<Vec<f32>> {
        match self.meta.get(key) {
            Some(MetaValue::Array(v)) => v
                .iter()
                .map(|x| {
                    x.as_f64().map(|f| f as f32).ok_or_else(|| {
                        bad(self.path, format!("metadata `{key}` holds a non-number"))
                    })
                })
                .collect(),
            Some(_) => Err(bad(self.path, format!("metadata `{key}` is not an array"))),
            None => Ok(Vec::new()),
        }
    }

    fn str(&self, key: &str) -> Option<String> {
        match self.meta.get(key) {
            Some(MetaValue::Str(s)) => Some(s.clone()),
            _ => None,
        }
    }

    fn strings(&self, key: &str) -> Result<Vec<String>> {
        match self.meta.get(key) {
            // A dropped element would shift every later token id.
            Some(MetaValue::Array(v)) => v
                .iter()
                .map(|x| match x {
                    MetaValue::Str(s) => Ok(s.clone()),
                    _ => Err(bad(
                        self.path,
                        format!("metadata `{key}` holds a non-string"),
                    )),
                })
                .collect(),
            Some(_) => Err(bad(self.path, format!("metadata `{key}` is not an array"))),
            None => Ok(Vec::new()),
        }
    }
}

/// llama.cpp tensor name → mlx-lm name (without `.weight` etc.), by the
/// names table's `scheme` column.
fn rename(scheme: Scheme, module: &str) -> Option<String> {
    if let Some(to) = names::global(scheme, module) {
        return Some(to.to_owned());
    }
    let rest = module.strip_prefix("blk.")?;
    let (n, part) = rest.split_once('.')?;
    Some(format!(
        "{}.{n}.{}",
        names::layers(scheme),
        names::block(scheme, part)?
    ))
}

/// The tokenizer metadata of a GGUF file.
fn read_tokenizer(meta: &Meta) -> Result<GgufTokenizer> {
    Ok(GgufTokenizer {
        model: meta.str("tokenizer.ggml.model").unwrap_or_default(),
        tokens: meta.strings("tokenizer.ggml.tokens")?,
        merges: meta.strings("tokenizer.ggml.merges")?,
        token_types: meta.ints("tokenizer.ggml.token_type")?,
        scores: meta.floats("tokenizer.ggml.scores")?,
        bos: meta.i64("tokenizer.ggml.bos_token_id")?.map(|v| v as u32),
        eos: meta.i64("tokenizer.ggml.eos_token_id")?.map(|v| v as u32),
        add_bos: meta.i64("tokenizer.ggml.add_bos_token")?.map(|v| v != 0),
        chat_template: meta.str("tokenizer.chat_template"),
    })
}

/// The `quantization` entry of `config.json` for the affine modules in
/// `quant` (module → (bits, group)): the most common setting, with every
/// other module listed by name.
fn quantization_config(quant: &BTreeMap<String, (i32, i32)>) -> Option<Value> {
    let mut counts: BTreeMap<(i32, i32), usize> = BTreeMap::new();
    for s in quant.values() {
        *counts.entry(*s).or_default() += 1;
    }
    let (&(bits, group), _) = counts.iter().max_by_key(|(_, n)| **n)?;
    let mut q = Map::new();
    q.insert("group_size".into(), json!(group));
    q.insert("bits".into(), json!(bits));
    for (module, (b, g)) in quant {
        if (*b, *g) != (bits, group) {
            q.insert(module.clone(), json!({"group_size": g, "bits": b}));
        }
    }
    Some(Value::Object(q))
}

/// Reads a GGUF file of a family mlex knows.
pub fn load(path: &Path) -> Result<GgufCheckpoint> {
    let header = gguf_file::read_header(path)?;
    let mut tensor_types = Vec::new();
    let meta = Meta {
        meta: &header.meta,
        path,
    };
    let arch = meta.str("general.architecture").unwrap_or_default();
    if let Some(hybrid) = hybrid::Family::of(&arch) {
        return hybrid::load(path, &header, &meta, hybrid);
    }
    let Some((model_type, spec)) = family::declared(&arch)? else {
        let mut known = family::architectures();
        known.extend(hybrid::ARCHITECTURES.iter().map(|a| (*a).to_owned()));
        return Err(bad(
            path,
            format!(
                "general.architecture is `{arch}`; GGUF loading supports {}",
                known.join(", ")
            ),
        ));
    };
    let mut config = spec.config(&meta)?;
    let count = |c: &Map<String, Value>, key: &str| c.get(key).and_then(Value::as_i64);
    let heads = count(&config, "num_attention_heads");
    let kv_heads = count(&config, "num_key_value_heads").or(heads);
    let scheme = spec.names.scheme();
    let global = |module: &str| names::global(scheme, module).unwrap_or_default();
    let tokenizer = read_tokenizer(&meta)?;

    let mut weights = WeightMap::new();
    let file = weights.add_file(path.to_owned());
    // module → (bits, group) for quantized tensors
    let mut quant: BTreeMap<String, (i32, i32)> = BTreeMap::new();
    let mut vocab = 0;
    let mut tied = true;
    let mut rope_factors: Option<Vec<f32>> = None;
    for t in &header.tensors {
        let name = &t.name;
        let tensor = lazy::Tensor::open(path, t);
        if name == "rope_freqs.weight" {
            // Llama 3.1+: llama.cpp stores the RoPE frequency factors it
            // derived from `rope_scaling` instead of the scaling itself.
            let f = tensor
                .dense()
                .and_then(|a| {
                    a.eval()?;
                    Ok(a.as_slice::<f32>().to_vec())
                })
                .map_err(|e| bad(path, format!("tensor `{name}`: {e}")))?;
            if f.iter().any(|v| !v.is_finite() || *v <= 0.0) {
                return Err(bad(
                    path,
                    format!("tensor `{name}` holds a factor that is not a positive number"),
                ));
            }
            rope_factors = Some(f);
            continue;
        }
        let (module, suffix) = name
            .rsplit_once('.')
            .ok_or_else(|| bad(path, format!("unexpected tensor `{name}`")))?;
        let target = rename(scheme, module).ok_or_else(|| {
            bad(
                path,
                format!(
                    "tensor `{name}` has no {arch} equivalent in mlex (unsupported GGUF layout)"
                ),
            )
        })?;
        if target == global("output") {
            tied = false;
        }
        tensor_types.push((format!("{target}.{suffix}"), t.ty.name().to_owned()));
        let shape = tensor.shape();
        if shape.is_empty() || shape.contains(&0) {
            return Err(bad(
                path,
                format!("tensor `{name}` has the empty shape {shape:?}"),
            ));
        }
        // llama.cpp's converter interleaves Q and K rows for llama and the
        // families built on it; the Qwen families keep Hugging Face's layout.
        let rotary = if !spec.unpermute_qk {
            None
        } else if module.ends_with("attn_q") {
            heads
        } else if module.ends_with("attn_k") {
            kv_heads
        } else {
            None
        };
        let tensor = match rotary {
            Some(h) if shape[0] as i64 % (2 * h) != 0 => {
                return Err(bad(
                    path,
                    format!(
                        "tensor `{name}`: {} rows do not split into {h} heads of rotary pairs",
                        shape[0]
                    ),
                ))
            }
            Some(h) => tensor.rows(&hybrid::unpermute(shape[0], h as i32), true, name, path)?,
            None => tensor,
        };
        if target == global("token_embd") {
            vocab = shape[0];
        }
        if let Some(q) = tensor.put(&mut weights, file, &target, suffix) {
            quant.insert(target, q);
        }
    }
    config.insert("model_type".into(), json!(model_type));
    let layers = count(&config, "num_hidden_layers").unwrap_or(0);
    for (key, module) in &spec.blocks_without {
        let to = names::block(scheme, module).ok_or_else(|| {
            bad(
                path,
                format!("gguf blocks_without `{key}`: `{module}` is not in names.toml"),
            )
        })?;
        let prefix = names::layers(scheme);
        let without: Vec<i64> = (0..layers)
            .filter(|i| !weights.contains(&format!("{prefix}.{i}.{to}.weight")))
            .collect();
        config.insert(key.clone(), json!(without));
    }
    config.insert("vocab_size".into(), json!(vocab));
    config.insert("tie_word_embeddings".into(), json!(tied));
    if let Some(f) = rope_factors {
        config.insert(
            "rope_scaling".into(),
            json!({"rope_type": "freq_factors", "factors": f}),
        );
    }
    if let Some(q) = quantization_config(&quant) {
        config.insert("quantization".into(), q);
    }
    Ok(GgufCheckpoint {
        config: ModelConfig::new(Value::Object(config), path),
        weights,
        tokenizer,
        tensor_types,
    })
}
