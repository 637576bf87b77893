//! What a GGUF family needs, as data: an architecture spec's `[gguf]`
//! table names the file's `general.architecture`, the column of
//! `names.toml` its tensors are renamed by, whether llama.cpp interleaved
//! its q/k rows, which metadata key gives each `config.json` entry (and how
//! an entry derives from others: a difference, a quotient, the largest of
//! a per-layer array), and the tensors llama.cpp stores reordered, split
//! or transformed ([`TensorRule`]). The loader in [`super`] reads any
//! family so declared; adding one is a spec change (`architectures/
//! granite.toml` is one, `qwen3_5.toml` and `nemotron_h.toml` the
//! hybrids').
//!
//! What stays in Rust is what every such family shares: the vocabulary
//! from the embedding's rows, a tied head when the file has no `output`,
//! llama.cpp's `rope_freqs` factors, the quantization of each tensor, and
//! the handful of reorders a [`TensorRule`] names (in `rules.rs`).

use super::entries::MetaKey;
use super::names::Scheme;
use super::rules::TensorRule;
use mlex_core::error::Result;
use serde::Deserialize;
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
    /// metadata key is given after the `{architecture}.` prefix. A dotted
    /// config key (`rope_parameters.rope_theta`) is an entry of a nested
    /// object.
    pub config: BTreeMap<String, MetaKey>,
    /// `config.json` entries set as they are.
    #[serde(default)]
    pub set: BTreeMap<String, toml::Value>,
    /// `config.json` entries listing the blocks that lack a module
    /// (`mlp_only_layers = "ffn_gate_inp"`: the layers without a router).
    #[serde(default)]
    pub blocks_without: BTreeMap<String, String>,
    /// `config.json` entries that say whether a block has a tensor (named
    /// after `blk.N.`: `attention_bias = "attn_q.bias"`).
    #[serde(default)]
    pub has_tensor: BTreeMap<String, HasTensor>,
    /// Put before every name the checkpoint's weights have (Qwen3.5's
    /// multimodal wrapper: `language_model.`).
    #[serde(default)]
    pub prefix: String,
    /// The config nests under this key, beside the top's `model_type` and
    /// `tie_word_embeddings` (Qwen3.5's `text_config`).
    pub nest: Option<String>,
    /// Tensors llama.cpp stores reordered, split or transformed, by name
    /// after `blk.N.` (`attn_qkv.weight`, `ssm_a`); the rest are renamed by
    /// `names.toml` as they are.
    #[serde(default)]
    pub tensors: BTreeMap<String, TensorRule>,
    /// The Gated DeltaNet value heads are stored tiled (slot `j * nk + g`
    /// holds head `g * r + j`; Qwen3.5): the `value_heads` of a
    /// [`TensorRule`] puts them back in grouped order. The head counts and
    /// widths are the config's `linear_num_key_heads`,
    /// `linear_num_value_heads`, `linear_key_head_dim` and
    /// `linear_value_head_dim`.
    #[serde(default)]
    pub tiled_value_heads: bool,
    /// The config entry counting the multi-token-prediction blocks
    /// llama.cpp keeps after the trunk (`blk.{n_layer + i}`, their head's
    /// tensors `nextn.*`): they load as the checkpoint's `mtp.*`.
    pub mtp_blocks: Option<String>,
    /// A layer-pattern string from per-layer metadata arrays (NemotronH).
    pub layer_pattern: Option<LayerPattern>,
    /// Tensors (after `blk.N.`) mlex cannot read, with the reason.
    #[serde(default)]
    pub unsupported: BTreeMap<String, String>,
    /// The `model_type` a file of this architecture gets when it is not the
    /// spec's own (one of its `[[also]]`).
    pub model_type: Option<String>,
    /// Other `general.architecture`s this spec reads: each table's entries
    /// over these (`[gguf.also.qwen35moe]`).
    #[serde(default)]
    pub also: BTreeMap<String, toml::Table>,
}

/// A config entry that says whether the file has a block tensor: `true`
/// or `false`, or one of two values.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum HasTensor {
    /// `true` when some block has the tensor.
    Flag(String),
    /// One value or the other.
    Choice(HasTensorChoice),
}

/// `{ tensor = "ssm_in.weight", present = "fused", absent = "split" }`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HasTensorChoice {
    /// The tensor, after `blk.N.`.
    pub tensor: String,
    /// The value when some block has it.
    pub present: toml::Value,
    /// The value when none has.
    pub absent: toml::Value,
}

/// A layer pattern (one character a layer) from two per-layer arrays:
/// no attention heads and no feed-forward width is `M` (Mamba2), heads
/// without a feed-forward `*` (attention), a feed-forward `ffn_layer`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerPattern {
    /// The config entry the pattern goes to.
    pub entry: String,
    /// The per-layer metadata array of attention kv heads.
    pub attention: String,
    /// The per-layer metadata array of feed-forward widths.
    pub ffn: String,
    /// The character of a feed-forward layer (`-` dense, `E` experts).
    pub ffn_layer: char,
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

/// The built-in spec that reads files of `architecture` (its `[gguf]`
/// table's, or one of that table's `also`): its `model_type` and the
/// `[gguf]` (merged over its base's, when it extends one; an `also` table
/// merged over that).
pub(super) fn declared(architecture: &str) -> Result<Option<(String, GgufSpec)>> {
    for (model_type, own, merged) in crate::spec::builtin_tables()? {
        if !own
            .get("gguf")
            .is_some_and(|g| reads(g).any(|a| a == architecture))
        {
            continue;
        }
        let mut table = merged.get("gguf").cloned().expect("declared above");
        let variant = table.get("also").and_then(|a| a.get(architecture)).cloned();
        if let (toml::Value::Table(t), Some(toml::Value::Table(over))) = (&mut table, variant) {
            t.remove("also");
            merge(t, over);
            t.insert("architecture".into(), architecture.into());
        }
        let spec = GgufSpec::deserialize(table).map_err(|e| {
            mlex_core::error::Error::Other(format!("architectures/{model_type}.toml [gguf]: {e}"))
        })?;
        let model_type = spec.model_type.clone().unwrap_or(model_type);
        return Ok(Some((model_type, spec)));
    }
    Ok(None)
}

/// The architectures a `[gguf]` table reads: its own and its `also`'s.
fn reads(gguf: &toml::Value) -> impl Iterator<Item = &str> {
    let own = gguf.get("architecture").and_then(toml::Value::as_str);
    let also = gguf.get("also").and_then(toml::Value::as_table);
    own.into_iter()
        .chain(also.into_iter().flat_map(|t| t.keys().map(String::as_str)))
}

/// `over`'s entries over `base`'s, tables entry by entry.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Every `general.architecture` the built-in specs declare.
pub(super) fn architectures() -> Vec<String> {
    crate::spec::builtin_tables()
        .unwrap_or_default()
        .iter()
        .filter_map(|(_, own, _)| own.get("gguf"))
        .flat_map(|g| reads(g).map(str::to_owned).collect::<Vec<_>>())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Meta;
    use crate::gguf_file::MetaValue;
    use serde_json::{json, Map, Value};
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
        for a in [
            "llama",
            "qwen2",
            "qwen3",
            "qwen3moe",
            "granite",
            "qwen3next",
            "qwen35",
            "qwen35moe",
            "nemotron_h",
            "nemotron_h_moe",
        ] {
            assert!(archs.iter().any(|x| x == a), "{a} in {archs:?}");
        }
        // A spec that extends one with a [gguf] does not read its files
        // unless it declares its own.
        let (model_type, _) = declared("llama").unwrap().unwrap();
        assert_eq!(model_type, "llama");
        let (_, granite) = declared("granite").unwrap().unwrap();
        assert!(granite.unpermute_qk && granite.config.contains_key("num_hidden_layers"));
        assert!(declared("smollm3").unwrap().is_none());
        // An `also` architecture: its own model type and key prefix, its
        // entries over the base's.
        let (model_type, moe) = declared("qwen35moe").unwrap().unwrap();
        assert_eq!(model_type, "qwen3_5_moe");
        assert_eq!(moe.architecture, "qwen35moe");
        assert!(moe.config.contains_key("num_experts") && moe.tiled_value_heads);
        assert_eq!(moe.set["model_type"].as_str(), Some("qwen3_5_moe_text"));
        let (model_type, dense) = declared("qwen35").unwrap().unwrap();
        assert_eq!(model_type, "qwen3_5");
        assert!(!dense.config.contains_key("num_experts") && dense.also.contains_key("qwen35moe"));
    }

    /// Qwen3.5's metadata as llama.cpp writes it: 2 key heads of 16, 4
    /// value heads of 16, 6 blocks, one of them multi-token prediction.
    fn qwen35(extra: &[(&'static str, MetaValue)]) -> Vec<(&'static str, MetaValue)> {
        let mut v = dense(&[
            ("block_count", MetaValue::UInt(6)),
            ("nextn_predict_layers", MetaValue::UInt(1)),
            ("attention.key_length", MetaValue::UInt(32)),
            ("rope.dimension_count", MetaValue::UInt(8)),
            (
                "rope.dimension_sections",
                MetaValue::Array(vec![
                    MetaValue::Int(2),
                    MetaValue::Int(1),
                    MetaValue::Int(1),
                    MetaValue::Int(0),
                ]),
            ),
            ("ssm.group_count", MetaValue::UInt(2)),
            ("ssm.time_step_rank", MetaValue::UInt(4)),
            ("ssm.state_size", MetaValue::UInt(16)),
            ("ssm.inner_size", MetaValue::UInt(64)),
            ("ssm.conv_kernel", MetaValue::UInt(4)),
        ]);
        // Later pairs win: these over `dense`'s, `extra` over these.
        v.extend(extra.iter().cloned());
        v
    }

    #[test]
    fn hybrid_entries_derive_from_others() {
        let c = config_of("qwen35", &qwen35(&[])).unwrap();
        // The trunk is the blocks less the multi-token-prediction one; a
        // value head's width is the inner size over the value heads.
        assert_eq!(c["num_hidden_layers"], 5);
        assert_eq!(c["mtp_num_hidden_layers"], 1);
        assert_eq!(c["linear_value_head_dim"], 16);
        // Dotted entries nest; the sections keep their first three.
        let rope = &c["rope_parameters"];
        assert_eq!(rope["partial_rotary_factor"], 0.25);
        assert_eq!(rope["mrope_section"], json!([2, 1, 1]));
        assert_eq!(rope["type"], "default");
        assert_eq!(c["model_type"], "qwen3_5_text");
        // The experts' entries only where the file has experts.
        assert!(!c.contains_key("num_experts_per_tok"));
        let moe = qwen35(&[
            ("expert_count", MetaValue::UInt(4)),
            ("expert_used_count", MetaValue::UInt(2)),
            ("expert_feed_forward_length", MetaValue::UInt(32)),
        ]);
        let c = config_of("qwen35moe", &moe).unwrap();
        assert_eq!(c["num_experts_per_tok"], 2);
        assert_eq!(c["shared_expert_intermediate_size"], 0);
        assert_eq!(c["model_type"], "qwen3_5_moe_text");
        // NemotronH: per-layer arrays give their largest value.
        let arr = |v: &[u64]| MetaValue::Array(v.iter().map(|&x| MetaValue::UInt(x)).collect());
        let nemo = [
            ("block_count", MetaValue::UInt(3)),
            ("embedding_length", MetaValue::UInt(64)),
            ("attention.head_count", MetaValue::UInt(4)),
            ("attention.head_count_kv", arr(&[0, 2, 0])),
            ("feed_forward_length", arr(&[0, 0, 96])),
            ("ssm.time_step_rank", MetaValue::UInt(8)),
            ("ssm.group_count", MetaValue::UInt(2)),
            ("ssm.inner_size", MetaValue::UInt(128)),
            ("ssm.state_size", MetaValue::UInt(16)),
            ("ssm.conv_kernel", MetaValue::UInt(4)),
        ];
        let c = config_of("nemotron_h", &nemo).unwrap();
        assert_eq!(
            (
                c["num_key_value_heads"].clone(),
                c["intermediate_size"].clone()
            ),
            (json!(2), json!(96))
        );
        assert_eq!(c["mamba_head_dim"], 16);
    }

    #[test]
    fn a_malformed_gguf_table_names_the_rule_and_what_it_takes() {
        let spec = |rule: &str| {
            let text = format!(
                "architecture = \"x\"\nnames = \"llama\"\n[config]\n[tensors.\"ssm_in.weight\"]\n{rule}\n"
            );
            GgufSpec::deserialize(toml::from_str::<toml::Value>(&text).unwrap())
                .err()
                .map(|e| e.to_string())
        };
        assert_eq!(spec("how = \"conv\""), None);
        let e = spec("how = \"twist\"").expect("an unknown `how`");
        assert!(e.contains("twist") && e.contains("keep"), "{e}");
        let e = spec("into = \"gate\"").expect("`into` takes a list");
        assert!(e.contains("sequence"), "{e}");
        let e = spec("split_by = \"halves\"").expect("an unknown key");
        assert!(e.contains("split_by"), "{e}");
    }

    #[test]
    fn hybrid_metadata_that_does_not_add_up_names_the_keys() {
        let e = config_of(
            "qwen35",
            &qwen35(&[("ssm.inner_size", MetaValue::UInt(66))]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`qwen35.ssm.inner_size` (66) must be a multiple of `qwen35.ssm.time_step_rank` (4)"),
            "{e}"
        );
        let e = config_of(
            "qwen35",
            &qwen35(&[("nextn_predict_layers", MetaValue::UInt(6))]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`qwen35.block_count` (6) must exceed `qwen35.nextn_predict_layers` (6)"),
            "{e}"
        );
        let e = config_of(
            "qwen35",
            &qwen35(&[("nextn_predict_layers", MetaValue::Int(-1))]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`qwen35.nextn_predict_layers` (-1) must not be negative"),
            "{e}"
        );
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
