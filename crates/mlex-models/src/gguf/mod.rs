//! GGUF checkpoints of every family a built-in spec's `[gguf]` declares.
//!
//! [`crate::gguf_file`] reads the container and turns each tensor type into
//! MLX affine `weight`/`scales`/`biases` (group 32) or a dense array (see
//! there for which type becomes what, and at what memory cost).
//! This module turns llama.cpp's naming into mlx-lm's (by `names.toml`, the
//! one table of names every GGUF family here uses), undoes llama.cpp's
//! row permutation of Q and K (its RoPE layout) and the reorders, splits
//! and transforms the spec's [`TensorRule`]s name, synthesizes
//! `config.json` (with the quantization of every tensor) from the
//! metadata as the spec maps it ([`GgufSpec`]), and reads the tokenizer
//! metadata.
//!
//! Every size in the header is checked against the file before any tensor
//! is read, so a truncated or corrupt GGUF is an error naming it.

mod entries;
mod family;
mod lazy;
mod names;
mod rules;

pub use entries::{MetaKey, MetaKeyTable, MetaType};
pub use family::{GgufSpec, HasTensor, HasTensorChoice, LayerPattern, NameScheme};
pub use rules::{How, Split, TensorRule, ValueHeads};

use crate::gguf_file::{self, MetaValue};
use mlex_core::config::ModelConfig;
use mlex_core::error::{Error, Result};
use mlex_core::weights::WeightMap;
use names::Scheme;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};
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
    /// Metadata `key` as `T` (`as_t` of its value), `None` when absent, or
    /// an error naming the key as not `a_t`.
    fn typed<T>(
        &self,
        key: &str,
        a_t: &str,
        as_t: impl Fn(&MetaValue) -> Option<T>,
    ) -> Result<Option<T>> {
        let Some(v) = self.meta.get(key) else {
            return Ok(None);
        };
        let v = as_t(v).ok_or_else(|| bad(self.path, format!("metadata `{key}` is not {a_t}")))?;
        Ok(Some(v))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", MetaValue::as_f64)
    }

    fn i64(&self, key: &str) -> Result<Option<i64>> {
        self.typed(key, "an integer", MetaValue::as_i64)
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

/// The output: weights under mlx-lm names, the GGML type each came from,
/// and the quantization of each quantized module.
struct Out {
    weights: WeightMap,
    file: usize,
    types: Vec<(String, String)>,
    quant: BTreeMap<String, (i32, i32)>,
}

impl Out {
    /// Puts `t` as `{module}.{suffix}` (or the module's quantized triple).
    fn put(&mut self, module: &str, t: lazy::Tensor, ty: &str, suffix: &str) {
        self.types
            .push((format!("{module}.{suffix}"), ty.to_owned()));
        if let Some(q) = t.put(&mut self.weights, self.file, module, suffix) {
            self.quant.insert(module.to_owned(), q);
        }
    }

    /// Puts `t` under the full name `name` (`module.suffix`).
    fn put_named(&mut self, name: &str, t: lazy::Tensor, ty: &str) {
        let (module, suffix) = name.rsplit_once('.').unwrap_or(("", name));
        self.put(module, t, ty, suffix);
    }

    /// Puts a float32 value under the full name `name`.
    fn dense(&mut self, name: &str, a: mlx_rs::Array, ty: &str) {
        self.weights.insert(name.to_owned(), a, self.file);
        self.types.push((name.to_owned(), ty.to_owned()));
    }
}

/// What the loader needs to place each tensor of one file.
struct Placer<'a> {
    path: &'a Path,
    spec: &'a GgufSpec,
    scheme: Scheme,
    /// `block_count`, multi-token-prediction blocks included.
    blocks: usize,
    /// The trunk's layers (the blocks before the multi-token-prediction ones).
    layers: usize,
    heads: Option<i64>,
    kv_heads: Option<i64>,
    linear: Option<rules::Heads>,
    /// Every block tensor's name after `blk.N.`.
    parts: BTreeSet<String>,
}

impl Placer<'_> {
    fn no_equivalent(&self, name: &str) -> Error {
        bad(
            self.path,
            format!(
                "tensor `{name}` has no {} equivalent in mlex (unsupported GGUF layout)",
                self.spec.architecture
            ),
        )
    }

    /// Puts one tensor of the file where the checkpoint has it.
    fn place(&self, name: &str, t: lazy::Tensor, ty: &str, out: &mut Out) -> Result<()> {
        let prefix = &self.spec.prefix;
        let Some(rest) = name.strip_prefix("blk.") else {
            let (module, suffix) = name
                .rsplit_once('.')
                .ok_or_else(|| self.no_equivalent(name))?;
            let to = names::global(self.scheme, module).ok_or_else(|| self.no_equivalent(name))?;
            out.put(&format!("{prefix}{to}"), t, ty, suffix);
            return Ok(());
        };
        let (n, part) = rest
            .split_once('.')
            .ok_or_else(|| self.no_equivalent(name))?;
        let n: usize = n.parse().map_err(|_| self.no_equivalent(name))?;
        let module = part.rsplit_once('.').map_or(part, |(m, _)| m);
        if let Some(why) = [part, module]
            .iter()
            .find_map(|p| self.spec.unsupported.get(*p))
        {
            return Err(bad(self.path, format!("tensor `{name}`: {why}")));
        }
        if n >= self.blocks {
            return Err(self.no_equivalent(name));
        }
        let layer = if n < self.layers {
            format!("{prefix}{}.{n}", names::layers(self.scheme))
        } else {
            // A multi-token-prediction block: the checkpoint's `mtp.*`. Its
            // `nextn.*` modules other than the head's own are copies of the
            // trunk's embedding and head, where a file has them.
            if let Some((m, suffix)) = part.rsplit_once('.').filter(|_| part.starts_with("nextn."))
            {
                if let Some((_, to)) = names::nextn().find(|(from, _)| *from == m) {
                    if suffix == "weight" {
                        out.put(&format!("{prefix}mtp.{to}"), t, ty, suffix);
                    }
                }
                return Ok(());
            }
            format!("{prefix}mtp.layers.{}", n - self.layers)
        };
        if let Some(rule) = self.spec.tensors.get(part) {
            let whole = rule
                .whole_if
                .as_ref()
                .is_some_and(|w| self.parts.contains(w));
            let at = rules::At {
                path: self.path,
                name,
                layer: &layer,
            };
            return rule.apply(t, ty, &at, self.linear, whole, out);
        }
        let (module, suffix) = part
            .rsplit_once('.')
            .ok_or_else(|| self.no_equivalent(name))?;
        let to = names::block(self.scheme, module).ok_or_else(|| self.no_equivalent(name))?;
        // llama.cpp's converter interleaves Q and K rows for llama and the
        // families built on it; the Qwen families keep Hugging Face's layout.
        let rotary = match module {
            "attn_q" if self.spec.unpermute_qk => self.heads,
            "attn_k" if self.spec.unpermute_qk => self.kv_heads,
            _ => None,
        };
        let t = match rotary {
            Some(h) => {
                let rows = t.shape()[0];
                if h <= 0 || rows as i64 % (2 * h) != 0 {
                    return Err(bad(
                        self.path,
                        format!("tensor `{name}`: {rows} rows do not split into {h} heads of rotary pairs"),
                    ));
                }
                t.rows(&rules::unpermute(rows, h as i32), true, name, self.path)?
            }
            None => t,
        };
        out.put(&format!("{layer}.{to}"), t, ty, suffix);
        Ok(())
    }
}

/// Reads a GGUF file of a family mlex knows (a built-in spec's `[gguf]`).
pub fn load(path: &Path) -> Result<GgufCheckpoint> {
    let header = gguf_file::read_header(path)?;
    let meta = Meta {
        meta: &header.meta,
        path,
    };
    let arch = meta.str("general.architecture").unwrap_or_default();
    let Some((model_type, spec)) = family::declared(&arch)? else {
        return Err(bad(
            path,
            format!(
                "general.architecture is `{arch}`; GGUF loading supports {}",
                family::architectures().join(", ")
            ),
        ));
    };
    let mut config = spec.config(&meta)?;
    let count = |c: &Map<String, Value>, key: &str| c.get(key).and_then(Value::as_i64);
    let heads = count(&config, "num_attention_heads");
    let blocks = meta
        .i64(&format!("{arch}.block_count"))?
        .unwrap_or(0)
        .max(0) as usize;
    // Every block has tensors; a larger count is a corrupt header (and
    // would size per-layer tables by it).
    if blocks > header.tensors.len() {
        return Err(bad(
            path,
            format!(
                "metadata `{arch}.block_count` is {blocks}, more than the file's {} tensors",
                header.tensors.len()
            ),
        ));
    }
    let linear = |k: &str| count(&config, k).map(|v| v as i32);
    let placer = Placer {
        path,
        spec: &spec,
        scheme: spec.names.scheme(),
        blocks,
        layers: count(&config, "num_hidden_layers").unwrap_or(blocks as i64) as usize,
        heads,
        kv_heads: count(&config, "num_key_value_heads").or(heads),
        linear: (|| {
            let (nk, nv) = (
                linear("linear_num_key_heads")?,
                linear("linear_num_value_heads")?,
            );
            Some(rules::Heads {
                nk,
                nv,
                dk: linear("linear_key_head_dim")?,
                dv: linear("linear_value_head_dim")?,
                tiled: spec.tiled_value_heads && nk != nv,
            })
        })(),
        parts: header
            .tensors
            .iter()
            .filter_map(|t| Some(t.name.strip_prefix("blk.")?.split_once('.')?.1.to_owned()))
            .collect(),
    };
    let mut weights = WeightMap::new();
    let file = weights.add_file(path.to_owned());
    let mut out = Out {
        weights,
        file,
        types: Vec::new(),
        quant: BTreeMap::new(),
    };
    let mut rope_factors = None;
    for t in &header.tensors {
        let tensor = lazy::Tensor::open(path, t);
        let shape = tensor.shape();
        if shape.is_empty() || shape.contains(&0) {
            return Err(bad(
                path,
                format!("tensor `{}` has the empty shape {shape:?}", t.name),
            ));
        }
        if t.name == "rope_freqs.weight" {
            rope_factors = Some(rope_freqs(path, &t.name, &tensor)?);
            continue;
        }
        placer.place(&t.name, tensor, t.ty.name(), &mut out)?;
    }
    finish_config(&mut config, &placer, &meta, &out)?;
    if let Some(f) = rope_factors {
        config.insert(
            "rope_scaling".into(),
            json!({"rope_type": "freq_factors", "factors": f}),
        );
    }
    let mut config = match &spec.nest {
        None => {
            config.insert("model_type".into(), json!(model_type));
            config
        }
        Some(key) => {
            let mut top = Map::new();
            top.insert("model_type".into(), json!(model_type));
            top.insert(
                "tie_word_embeddings".into(),
                config["tie_word_embeddings"].clone(),
            );
            top.insert(key.clone(), Value::Object(config));
            top
        }
    };
    if let Some(q) = quantization_config(&out.quant) {
        config.insert("quantization".into(), q);
    }
    Ok(GgufCheckpoint {
        config: ModelConfig::new(Value::Object(config), path),
        weights: out.weights,
        tokenizer: read_tokenizer(&meta)?,
        tensor_types: out.types,
    })
}

/// Llama 3.1+: llama.cpp stores the RoPE frequency factors it derived from
/// `rope_scaling` instead of the scaling itself.
fn rope_freqs(path: &Path, name: &str, tensor: &lazy::Tensor) -> Result<Vec<f32>> {
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
    Ok(f)
}

/// The config entries that depend on the tensors: `blocks_without`,
/// `has_tensor`, the layer pattern, the vocabulary and a tied head.
fn finish_config(
    config: &mut Map<String, Value>,
    placer: &Placer,
    meta: &Meta,
    out: &Out,
) -> Result<()> {
    let (spec, path, scheme) = (placer.spec, placer.path, placer.scheme);
    let prefix = &spec.prefix;
    for (key, module) in &spec.blocks_without {
        let to = names::block(scheme, module).ok_or_else(|| {
            bad(
                path,
                format!("gguf blocks_without `{key}`: `{module}` is not in names.toml"),
            )
        })?;
        let layers = names::layers(scheme);
        let without: Vec<usize> = (0..placer.layers)
            .filter(|i| {
                !out.weights
                    .contains(&format!("{prefix}{layers}.{i}.{to}.weight"))
            })
            .collect();
        config.insert(key.clone(), json!(without));
    }
    for (key, has) in &spec.has_tensor {
        let v = match has {
            family::HasTensor::Flag(t) => json!(placer.parts.contains(t)),
            family::HasTensor::Choice(c) => {
                let v = if placer.parts.contains(&c.tensor) {
                    &c.present
                } else {
                    &c.absent
                };
                serde_json::to_value(v)
                    .map_err(|x| bad(path, format!("gguf has_tensor `{key}`: {x}")))?
            }
        };
        entries::insert(config, key, v);
    }
    if let Some(p) = &spec.layer_pattern {
        let key = |k: &str| format!("{}.{k}", spec.architecture);
        let kv = entries::per_layer(meta, &key(&p.attention))?;
        let ff = entries::per_layer(meta, &key(&p.ffn))?;
        let pattern: String = kv
            .iter()
            .zip(&ff)
            .map(|(&kv, &ff)| match (kv, ff) {
                (0, 0) => 'M',
                (_, 0) => '*',
                _ => p.ffn_layer,
            })
            .collect();
        config.insert(p.entry.clone(), json!(pattern));
    }
    let embedding = format!(
        "{prefix}{}.weight",
        names::global(scheme, "token_embd").unwrap_or_default()
    );
    let vocab = out
        .weights
        .shape_of(&embedding)
        .map(|s| s[0])
        .ok_or_else(|| bad(path, "tensor `token_embd.weight` is missing"))?;
    let head = format!(
        "{prefix}{}",
        names::global(scheme, "output").unwrap_or_default()
    );
    config.insert("vocab_size".into(), json!(vocab));
    config.insert(
        "tie_word_embeddings".into(),
        json!(!out
            .types
            .iter()
            .any(|(n, _)| n.strip_suffix(".weight") == Some(&head))),
    );
    Ok(())
}
