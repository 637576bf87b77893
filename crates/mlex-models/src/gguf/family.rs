//! What a GGUF family needs, as data: an architecture spec's `[gguf]`
//! table names the file's `general.architecture`, the column of
//! `names.toml` its tensors are renamed by, whether llama.cpp interleaved
//! its q/k rows, and which metadata key gives each `config.json` entry. The
//! loader in [`super`] reads any family so declared; adding one is a spec
//! change (`architectures/granite.toml` is one).
//!
//! What stays in Rust is what every such family shares: the vocabulary
//! from the embedding's rows, a tied head when the file has no `output`,
//! llama.cpp's `rope_freqs` factors, the quantization of each tensor. The
//! hybrids' reorders and splits are in `hybrid.rs`.

use super::names::Scheme;
use super::{bad, Meta};
use mlex_core::error::Result;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// `[gguf]` of an architecture spec.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GgufSpec {
    /// The file's `general.architecture` (llama.cpp's name: `qwen3moe`).
    pub architecture: String,
    /// How its tensors are renamed: the column of `gguf/names.toml`.
    pub names: NameScheme,
    /// llama.cpp's converter interleaved the q/k rows for its RoPE kernels
    /// (`LlamaModel.permute`, llama and the families built on it).
    #[serde(default)]
    pub unpermute_qk: bool,
    /// `config.json` entries read from the metadata, by config key; a
    /// metadata key is given after the `{architecture}.` prefix.
    pub config: BTreeMap<String, MetaKey>,
    /// `config.json` entries set as they are.
    #[serde(default)]
    pub set: BTreeMap<String, toml::Value>,
    /// `config.json` entries listing the blocks that lack a module
    /// (`mlp_only_layers = "ffn_gate_inp"`: the layers without a router).
    #[serde(default)]
    pub blocks_without: BTreeMap<String, String>,
}

/// A column of `gguf/names.toml`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum NameScheme {
    /// `model.layers.N.self_attn/mlp/...`.
    Llama,
    /// `backbone.layers.N.mixer.*`.
    NemotronH,
}

impl NameScheme {
    pub(super) fn scheme(self) -> Scheme {
        match self {
            NameScheme::Llama => Scheme::Llama,
            NameScheme::NemotronH => Scheme::NemotronH,
        }
    }
}

/// Where one `config.json` entry comes from: a metadata key (a positive
/// count, required), or a table.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MetaKey {
    /// A required positive count.
    Count(String),
    /// Anything else.
    Table(MetaKeyTable),
}

/// A metadata key with its type and what stands in when it is absent.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetaKeyTable {
    /// The metadata key; with `keys`, the first present of several.
    #[serde(default)]
    pub key: Option<String>,
    /// Alternative keys, the first present wins.
    #[serde(default)]
    pub keys: Vec<String>,
    /// The value's type.
    #[serde(default, rename = "type")]
    pub ty: MetaType,
    /// The value when the file has none.
    #[serde(default)]
    pub default: Option<toml::Value>,
    /// Another config entry's value when the file has none.
    #[serde(default)]
    pub or: Option<String>,
    /// Left out of the config when the file has none.
    #[serde(default)]
    pub optional: bool,
    /// Another config entry this one may not exceed.
    #[serde(default)]
    pub at_most: Option<String>,
}

/// The type of a metadata value.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MetaType {
    /// A positive integer that fits an `i32`.
    #[default]
    Count,
    /// Any integer.
    Int,
    /// A number.
    Float,
}

impl MetaKey {
    fn table(&self) -> MetaKeyTable {
        match self {
            MetaKey::Count(k) => MetaKeyTable {
                key: Some(k.clone()),
                ..MetaKeyTable::default()
            },
            MetaKey::Table(t) => t.clone(),
        }
    }
}

impl GgufSpec {
    /// The `config.json` entries the metadata gives (with `set`); the
    /// entries that depend on the tensors (`blocks_without`, the
    /// vocabulary) are the loader's.
    pub(super) fn config(&self, meta: &Meta) -> Result<Map<String, Value>> {
        let arch = &self.architecture;
        let full = |k: &str| format!("{arch}.{k}");
        let mut out = Map::new();
        let entries: Vec<(&String, MetaKeyTable)> =
            self.config.iter().map(|(c, k)| (c, k.table())).collect();
        // Entries that fall back on another come after the rest.
        for pass in [false, true] {
            for (name, e) in entries.iter().filter(|(_, e)| e.or.is_some() == pass) {
                let keys: Vec<&String> = e.key.iter().chain(&e.keys).collect();
                let found = keys.iter().find(|k| meta.meta.contains_key(&full(k)));
                let value = match found {
                    Some(k) => Some(read(meta, &full(k), e.ty)?),
                    None => match (&e.default, &e.or) {
                        (Some(d), _) => Some(serde_json::to_value(d).map_err(|x| {
                            bad(meta.path, format!("gguf default of `{name}`: {x}"))
                        })?),
                        (None, Some(other)) => out.get(other).cloned(),
                        (None, None) if e.optional => None,
                        (None, None) => {
                            let key = keys.first().map(|k| full(k)).unwrap_or_default();
                            return Err(bad(meta.path, format!("metadata `{key}` is missing")));
                        }
                    },
                };
                if let Some(v) = value {
                    out.insert((*name).clone(), v);
                }
            }
        }
        for (name, e) in &entries {
            let Some(other) = &e.at_most else { continue };
            let (v, limit) = (out.get(*name), out.get(other));
            if let (Some(v), Some(limit)) =
                (v.and_then(Value::as_i64), limit.and_then(Value::as_i64))
            {
                if v > limit {
                    let key = |n: &str| {
                        self.config
                            .get(n)
                            .and_then(|k| k.table().key)
                            .map(|k| full(&k))
                            .unwrap_or_else(|| n.to_owned())
                    };
                    return Err(bad(
                        meta.path,
                        format!(
                            "metadata `{}` ({v}) exceeds `{}` ({limit})",
                            key(name),
                            key(other)
                        ),
                    ));
                }
            }
        }
        for (k, v) in &self.set {
            let v = serde_json::to_value(v)
                .map_err(|x| bad(meta.path, format!("gguf set `{k}`: {x}")))?;
            out.insert(k.clone(), v);
        }
        Ok(out)
    }
}

/// The value of metadata `key` as `ty`, or an error naming the file and key.
fn read(meta: &Meta, key: &str, ty: MetaType) -> Result<Value> {
    Ok(match ty {
        MetaType::Float => json!(meta.f64(key)?.expect("present")),
        MetaType::Int => json!(meta.i64(key)?.expect("present")),
        MetaType::Count => {
            let v = meta.i64(key)?.expect("present");
            json!(mlex_core::config::count(v)
                .map_err(|m| bad(meta.path, format!("metadata `{key}` {m}")))?)
        }
    })
}

/// The built-in spec that declares `architecture` in its own `[gguf]`
/// table: its `model_type` and its `[gguf]` (merged over its base's, when
/// it extends one).
pub(super) fn declared(architecture: &str) -> Result<Option<(String, GgufSpec)>> {
    for (model_type, own, merged) in crate::spec::builtin_tables()? {
        let declares = own
            .get("gguf")
            .and_then(|g| g.get("architecture"))
            .and_then(toml::Value::as_str)
            == Some(architecture);
        if !declares {
            continue;
        }
        let table = merged.get("gguf").cloned().expect("declared above");
        let spec = GgufSpec::deserialize(table).map_err(|e| {
            mlex_core::error::Error::Other(format!("architectures/{model_type}.toml [gguf]: {e}"))
        })?;
        return Ok(Some((model_type, spec)));
    }
    Ok(None)
}

/// Every `general.architecture` the built-in specs declare.
pub(super) fn architectures() -> Vec<String> {
    crate::spec::builtin_tables()
        .unwrap_or_default()
        .iter()
        .filter_map(|(_, own, _)| {
            own.get("gguf")?
                .get("architecture")?
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_file::MetaValue;
    use std::path::Path;

    fn config_of(arch: &str, pairs: &[(&str, MetaValue)]) -> Result<Map<String, Value>> {
        let meta: BTreeMap<String, MetaValue> = pairs
            .iter()
            .map(|(k, v)| (format!("{arch}.{k}"), v.clone()))
            .collect();
        let (_, spec) = declared(arch)?.expect("a built-in GGUF family");
        spec.config(&Meta {
            meta: &meta,
            path: Path::new("m.gguf"),
        })
    }

    fn dense(extra: &[(&'static str, MetaValue)]) -> Vec<(&'static str, MetaValue)> {
        let mut v = vec![
            ("block_count", MetaValue::UInt(2)),
            ("embedding_length", MetaValue::UInt(64)),
            ("feed_forward_length", MetaValue::UInt(128)),
            ("attention.head_count", MetaValue::UInt(4)),
        ];
        v.extend(extra.iter().cloned());
        v
    }

    #[test]
    fn the_specs_declare_each_gguf_architecture_once() {
        let mut archs = architectures();
        let n = archs.len();
        archs.sort();
        archs.dedup();
        assert_eq!(archs.len(), n, "{archs:?}");
        for a in ["llama", "qwen2", "qwen3", "qwen3moe", "granite"] {
            assert!(archs.iter().any(|x| x == a), "{a} in {archs:?}");
        }
        // A spec that extends one with a [gguf] does not read its files
        // unless it declares its own.
        let (model_type, _) = declared("llama").unwrap().unwrap();
        assert_eq!(model_type, "llama");
        let (_, granite) = declared("granite").unwrap().unwrap();
        assert!(granite.unpermute_qk && granite.config.contains_key("num_hidden_layers"));
        assert!(declared("smollm3").unwrap().is_none());
    }

    #[test]
    fn metadata_becomes_the_config_the_spec_declares() {
        let c = config_of("llama", &dense(&[])).unwrap();
        assert_eq!(c["num_hidden_layers"], 2);
        // Absent: kv heads fall back on the heads, theta on the default,
        // head_dim and the context are left out.
        assert_eq!(c["num_key_value_heads"], 4);
        assert_eq!(c["rope_theta"], 10000.0);
        assert!(!c.contains_key("head_dim") && !c.contains_key("max_position_embeddings"));
        let c = config_of(
            "qwen3",
            &dense(&[
                ("attention.head_count_kv", MetaValue::UInt(2)),
                ("rope.freq_base", MetaValue::Float(5e5)),
            ]),
        )
        .unwrap();
        assert_eq!(c["num_key_value_heads"], 2);
        assert_eq!(c["rope_theta"], 5e5);
        // A MoE file without the dense width takes the experts'.
        let mut moe = dense(&[
            ("expert_count", MetaValue::UInt(4)),
            ("expert_used_count", MetaValue::UInt(2)),
            ("expert_feed_forward_length", MetaValue::UInt(32)),
        ]);
        moe.retain(|(k, _)| *k != "feed_forward_length");
        let c = config_of("qwen3moe", &moe).unwrap();
        assert_eq!(c["intermediate_size"], 32);
        assert_eq!(c["norm_topk_prob"], true);
    }

    #[test]
    fn a_bad_gguf_table_names_what_is_wrong() {
        let parse = |t: &str| GgufSpec::deserialize(toml::from_str::<toml::Value>(t).unwrap());
        let base = "architecture = \"x\"\n[config]\nhidden_size = \"embedding_length\"\n";
        assert!(parse(&format!("names = \"llama\"\n{base}")).is_ok());
        let e = parse(&format!("names = \"gpt\"\n{base}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpt") && e.contains("nemotron_h"), "{e}");
        let e = parse(&format!("names = \"llama\"\nunpermute = true\n{base}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unpermute"), "{e}");
    }

    #[test]
    fn bad_metadata_names_the_file_and_the_key() {
        let mut missing = dense(&[]);
        missing.retain(|(k, _)| *k != "block_count");
        let e = config_of("qwen2", &missing).unwrap_err().to_string();
        assert!(
            e.contains("m.gguf") && e.contains("`qwen2.block_count` is missing"),
            "{e}"
        );
        let e = config_of(
            "llama",
            &dense(&[("attention.head_count", MetaValue::Int(-4))]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`llama.attention.head_count` must be from 1"),
            "{e}"
        );
        let e = config_of(
            "llama",
            &dense(&[("rope.freq_base", MetaValue::Str("big".into()))]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`llama.rope.freq_base` is not a number"), "{e}");
        let e = config_of(
            "qwen3moe",
            &dense(&[
                ("expert_count", MetaValue::UInt(4)),
                ("expert_used_count", MetaValue::UInt(8)),
                ("expert_feed_forward_length", MetaValue::UInt(32)),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`qwen3moe.expert_used_count` (8) exceeds `qwen3moe.expert_count` (4)"),
            "{e}"
        );
    }
}
