//! Architecture specs: a `model_type` described as data, in TOML, and built
//! into an [`Architecture`] with no Rust. Every built-in architecture is one
//! of these (`crates/mlex-models/architectures/*.toml`, embedded at build
//! time); a user adds one with `--arch-dir`/`--arch-file` or
//! `$MLEX_ARCH_PATH`, and a downstream crate embeds its own with
//! [`crate::add_toml_architecture`].
//!
//! A spec says, in this order (the format is documented with a worked
//! example in `docs/architecture-specs.md`):
//!
//! - `model_type`, `summary`, `reference`, `also` (more `model_type`s it
//!   serves), `extends` (another spec it starts from, deep-merged);
//! - `text_config` (a nested config to lift, as multimodal wrappers have)
//!   and `[config_defaults]` (values filled in where the config is silent);
//! - `[params]`: the typed parameters read from `config.json`, each with its
//!   key (or alternative keys, dotted for nesting), type, default, value
//!   map, and `only_if` gate;
//! - `[model]`: embedding, layer, final-norm and head weight prefixes, tied
//!   head, sizes, context limit, logit soft-cap;
//! - `[layers]`: the pattern (repeating list, interval rule or per-layer
//!   codes from a config key) of layer names, the per-layer feed-forward
//!   choice, and `where` rules that set mixer options on the layers a
//!   config list names;
//! - `[block]`: the options of every layer's block
//!   ([`crate::block::BlockOptions`]: norms, feed-forward, multipliers);
//!   `[blocks.<name>]`: what differs for the layers called `<name>`,
//!   including `mixer` (a registered mixer, or `"none"`);
//! - `[kinds.<kind>]`: the options of each mixer (or whole-layer) kind, the
//!   kind's own typed struct (an unknown option is an error naming it);
//! - `[[sanitize]]`: the weight translation steps, in order.
//!
//! A layer name is a block around the mixer of that name unless
//! `[blocks.<name>]` says which mixer; a name that is a registered
//! whole-layer kind (a downstream crate's) builds that kind instead. Any
//! string value `"$name"` in `[model]`, `[layers]`, `[block]`, `[blocks]` or
//! `[kinds]` is the parameter `name`; an option whose parameter is absent
//! (optional, or gated off) is left out, so the default applies.

use mlex_core::arch::{Architecture, HeadPlan, LayerPlan, ModelPlan, MtpPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_core::weights::WeightMap;
use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::sanitize as steps;

/// A whole spec file, as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArchSpec {
    /// The `config.json` `model_type` it serves.
    pub model_type: String,
    /// One line for `mlex list`.
    pub summary: Option<String>,
    /// Where the reference implementation is (paper, mlx-lm file).
    pub reference: Option<String>,
    /// Another spec this one starts from; its tables are merged under this
    /// file's (see [`merge_over_base`]).
    pub extends: Option<String>,
    /// With `extends`: dotted paths of the base's entries that this file
    /// replaces instead of merging into (`["sanitize"]` drops the base's
    /// sanitize steps for this file's; `["kinds.attention"]` starts the
    /// kind's options afresh).
    #[serde(default)]
    pub replace: Vec<String>,
    /// More `model_type`s served by the same spec, with their summaries.
    #[serde(default)]
    pub also: Vec<AlsoServes>,
    /// A nested config object to read instead of the top level, when the
    /// config has it (`text_config` of multimodal wrappers).
    pub text_config: Option<String>,
    /// Values filled into the (text) config where it has none or `null`.
    #[serde(default)]
    pub config_defaults: toml::Table,
    /// The typed parameters read from the config.
    #[serde(default)]
    pub params: BTreeMap<String, ParamSpec>,
    /// The model around the layers.
    pub model: Option<ModelSpec>,
    /// The layer stack.
    pub layers: LayersSpec,
    /// Block options of every layer.
    #[serde(default)]
    pub block: toml::Table,
    /// Block options by layer name, over `block`.
    #[serde(default)]
    pub blocks: BTreeMap<String, toml::Table>,
    /// Options per mixer (or whole-layer) kind.
    #[serde(default)]
    pub kinds: BTreeMap<String, toml::Table>,
    /// Weight translation, in order.
    #[serde(default)]
    pub sanitize: Vec<SanitizeStep>,
    /// A multi-token-prediction head.
    pub mtp: Option<MtpSpec>,
    /// How llama.cpp's GGUF files of this family load ([`crate::gguf`]); a
    /// spec that extends another inherits its base's only when it declares
    /// its own.
    pub gguf: Option<crate::gguf::GgufSpec>,
}

/// `[mtp]`: the multi-token-prediction head a checkpoint may carry
/// (Qwen3-Next, Qwen3.5): `{prefix}.fc`, `{prefix}.pre_fc_norm_embedding`,
/// `{prefix}.pre_fc_norm_hidden`, `{prefix}.layers.{i}`, `{prefix}.norm`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MtpSpec {
    /// How many MTP layers (`"$param"`); none when 0.
    pub count: toml::Value,
    /// The head's weight prefix (after sanitize).
    pub prefix: String,
    /// The trunk layer name whose block every MTP layer is (`attention`).
    pub layer: String,
}

/// Another `model_type` a spec serves.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlsoServes {
    /// The `model_type`.
    pub model_type: String,
    /// Its line for `mlex list`.
    pub summary: String,
}

/// A typed config parameter: `name = "int"` (the key is the name, the
/// value required) or a table.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum ParamSpec {
    /// Just the type; key = the parameter's name; required.
    Type(ParamType),
    /// The full form.
    Full(ParamTable),
}

/// The full form of a [`ParamSpec`].
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamTable {
    /// The config key (default: the parameter's name); dotted for nesting,
    /// e.g. `rope_parameters.rope_theta`.
    pub key: Option<String>,
    /// Alternative keys, the first present wins (instead of `key`).
    #[serde(default)]
    pub keys: Vec<String>,
    /// The value's type.
    #[serde(rename = "type")]
    pub ty: ParamType,
    /// The value when no key is present (else the parameter is required,
    /// unless `optional`).
    pub default: Option<toml::Value>,
    /// Absent is allowed: options that use it are left out.
    #[serde(default)]
    pub optional: bool,
    /// Replace the value by this table's entry for it (e.g. a config enum
    /// to a layer-kind option); a value not in the map is an error listing
    /// the known ones.
    pub map: Option<toml::Table>,
    /// The parameter is absent unless this parameter is true (a non-zero
    /// number, a non-empty string or list count as true).
    pub only_if: Option<String>,
}

/// The type of a config parameter.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ParamType {
    /// An integer.
    Int,
    /// An integer from 1 up (sizes, counts).
    Count,
    /// A number.
    Float,
    /// `true` or `false`.
    Bool,
    /// A string.
    String,
    /// A list of integers.
    IntList,
    /// A list of strings.
    StringList,
    /// A list of numbers.
    FloatList,
    /// A string or a list of strings (layer patterns).
    Pattern,
    /// An object (e.g. RoPE scaling), passed through.
    Object,
}

impl ParamType {
    fn check(self, v: &Value) -> std::result::Result<(), &'static str> {
        let ok = match self {
            ParamType::Int => v.as_i64().is_some(),
            ParamType::Count => v.as_i64().is_some(),
            ParamType::Float => v.as_f64().is_some(),
            ParamType::Bool => v.is_boolean(),
            ParamType::String => v.is_string(),
            ParamType::IntList => v
                .as_array()
                .is_some_and(|a| a.iter().all(|x| x.as_i64().is_some())),
            ParamType::StringList => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
            ParamType::FloatList => v
                .as_array()
                .is_some_and(|a| a.iter().all(|x| x.as_f64().is_some())),
            ParamType::Pattern => {
                v.is_string() || v.as_array().is_some_and(|a| a.iter().all(Value::is_string))
            }
            ParamType::Object => v.is_object(),
        };
        if ok {
            Ok(())
        } else {
            Err(match self {
                ParamType::Int => "expected an integer",
                ParamType::Count => "expected an integer from 1",
                ParamType::Float => "expected a number",
                ParamType::Bool => "expected true or false",
                ParamType::String => "expected a string",
                ParamType::IntList => "expected a list of integers",
                ParamType::StringList => "expected a list of strings",
                ParamType::FloatList => "expected a list of numbers",
                ParamType::Pattern => "expected a string or a list of strings",
                ParamType::Object => "expected an object",
            })
        }
    }
}

/// The model around the layers. Every field is a value or a `"$param"`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Embedding prefix, e.g. `model.embed_tokens`.
    pub embed: String,
    /// Layer prefix; layer `i` is at `{layers}.{i}`.
    pub layers: String,
    /// Final norm prefix.
    pub final_norm: String,
    /// Output head prefix (unused when tied).
    pub head: String,
    /// Whether the head is the embedding (bool or `"$param"`).
    pub tie: Option<toml::Value>,
    /// Vocabulary size.
    pub vocab_size: toml::Value,
    /// Residual width.
    pub hidden_size: toml::Value,
    /// Final norm epsilon.
    pub norm_eps: toml::Value,
    /// Final norm kind: `rms` (default) or `layer_norm`.
    #[serde(default)]
    pub norm_type: mlex_core::nn::NormKind,
    /// Longest context (optional).
    pub max_context: Option<toml::Value>,
    /// `c * tanh(logits / c)` when set and positive.
    pub logit_softcap: Option<toml::Value>,
    /// Embedded tokens multiplied by this (Granite).
    pub embedding_multiplier: Option<toml::Value>,
    /// Logits divided by this (Granite).
    pub logits_scaling: Option<toml::Value>,
}

/// The layer stack.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayersSpec {
    /// Number of layers (`"$param"`), unless `codes` gives them.
    pub count: Option<toml::Value>,
    /// Kinds repeated over the layers.
    pub pattern: Option<Vec<String>>,
    /// Every `every`-th layer is `on`, the others `off`.
    pub interval: Option<IntervalRule>,
    /// One code per layer from a config string or list.
    pub codes: Option<CodesRule>,
    /// The feed-forward of the blocks whose `[blocks.<name>]` does not set
    /// `ffn`: a fixed kind or a MoE rule.
    pub ffn: Option<MlpRule>,
    /// Options set on the layers a config list marks.
    #[serde(default, rename = "where")]
    pub where_: Vec<WhereRule>,
}

/// `interval = { every = "$full_attention_interval", on = "attention", off = "gated_delta" }`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntervalRule {
    /// The interval (`"$param"` or a number).
    pub every: toml::Value,
    /// The kind of every `every`-th layer (1-based).
    pub on: String,
    /// The kind of the others.
    pub off: String,
}

/// `codes = { from = "$pattern", map = { M = "mamba2", "*" = "attention" } }`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodesRule {
    /// A pattern parameter: a string (one code per character) or a list
    /// (one code per item).
    pub from: String,
    /// Code → layer kind.
    pub map: BTreeMap<String, String>,
}

/// The feed-forward choice.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MlpRule {
    /// The same feed-forward kind on every layer.
    Fixed(String),
    /// MoE on some layers.
    Moe(MoeRule),
}

/// MoE on every `sparse_step`-th layer not in `dense_layers`, when
/// `experts` is positive (Qwen's `decoder_sparse_step`/`mlp_only_layers`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeRule {
    /// The MoE feed-forward kind.
    pub moe: String,
    /// The dense feed-forward kind.
    pub dense: String,
    /// Expert count (`"$param"`).
    pub experts: toml::Value,
    /// MoE every this many layers (`"$param"`, default 1).
    pub sparse_step: Option<toml::Value>,
    /// Layers that stay dense (`"$param"`).
    pub dense_layers: Option<toml::Value>,
}

/// `[[layers.where]] list = "$layer_types"; equals = "sliding_attention"; options = {...}`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WhereRule {
    /// A list parameter, one entry per layer.
    pub list: String,
    /// The entry that selects a layer (a string, number or boolean).
    pub equals: toml::Value,
    /// Options set on the selected layers.
    pub options: toml::Table,
}

/// One weight translation step: exactly one operation, optionally gated.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SanitizeStep {
    /// Drop tensors whose name starts with any of these.
    pub drop_prefix: Option<Vec<String>>,
    /// Drop tensors whose name contains any of these.
    pub drop_containing: Option<Vec<String>>,
    /// Drop the module `{x}` (`{x}.*` and `{x}` itself).
    pub drop_module: Option<String>,
    /// Rename the prefix `[from, to]`.
    pub rename_prefix: Option<[String; 2]>,
    /// Prefix every name that does not start with it already.
    pub add_prefix: Option<String>,
    /// Rename a run of dotted name parts wherever it stands, `[from, to]`:
    /// `["mlp.gate_up_proj", "mlp.gate_proj+up_proj"]` turns
    /// `model.layers.0.mlp.gate_up_proj.weight` into
    /// `model.layers.0.mlp.gate_proj+up_proj.weight` (a fused name mlex
    /// loads as one product).
    pub rename_part: Option<[String; 2]>,
    /// PyTorch conv `[C, 1, K]` → MLX `[C, K, 1]` for `*{x}*weight`.
    pub conv_to_mlx: Option<String>,
    /// Add 1 to 1-D norm weights ending in any of these (offset norms).
    pub norm_plus_one: Option<Vec<String>>,
    /// Stack per-expert weights into `switch_mlp`.
    pub stack_experts: Option<StackExperts>,
    /// Split fused `experts.gate_up_proj` under `{prefix}` (with `{i}`).
    pub split_fused_experts: Option<String>,
    /// Run only when this boolean parameter is true (`"$param"`).
    pub when: Option<String>,
    /// Run only when some tensor of the checkpoint as read ends with this.
    pub if_tensor_ending: Option<String>,
    /// Run only when the checkpoint as read has PyTorch-layout convs named
    /// `*{x}*weight` (it was not sanitized before).
    pub if_torch_conv: Option<String>,
}

/// `stack_experts = { module = "model.layers.{i}.mlp", experts = "$num_experts", names = [["up_proj", "up_proj"]] }`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StackExperts {
    /// The MoE module, with `{i}` for the layer index.
    pub module: String,
    /// Expert count (`"$param"`).
    pub experts: toml::Value,
    /// `[per-expert name, switch_mlp name]` pairs.
    pub names: Vec<[String; 2]>,
}

/// What builds the layers of one name.
#[derive(Clone, Debug)]
enum LayerTarget {
    /// A block around this mixer (`None`: no mixer).
    Block(Option<String>),
    /// A registered whole-layer kind.
    Kind,
}

/// A spec built against a registry: an [`Architecture`].
pub struct SpecArchitecture {
    spec: ArchSpec,
    table: toml::Table,
    model_type: String,
    summary: String,
    targets: BTreeMap<String, LayerTarget>,
}

/// `file:line:column` of byte `offset` in `text` (both 1-based, columns in
/// characters), as compilers print locations.
fn location(file: &Path, text: &str, offset: usize) -> String {
    let before = text.get(..offset.min(text.len())).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    format!("{}:{line}:{column}", file.display())
}

fn spec_error(at: &str, key: &str, message: impl Into<String>) -> Error {
    Error::Config {
        file: PathBuf::from(at),
        key: key.to_owned(),
        message: message.into(),
    }
}

/// Deep-merges `over` into `base`: tables merge key by key, arrays of
/// tables (`[[sanitize]]`, `[[layers.where]]`) append to the base's, every
/// other value replaces; an entry whose dotted path is in `replace`
/// replaces the base's whole.
fn merge_tables(base: &mut toml::Table, over: toml::Table, path: &str, replace: &[String]) {
    let of_tables = |a: &[toml::Value]| !a.is_empty() && a.iter().all(toml::Value::is_table);
    for (k, v) in over {
        let full = if path.is_empty() {
            k.clone()
        } else {
            format!("{path}.{k}")
        };
        if replace.contains(&full) {
            base.insert(k, v);
            continue;
        }
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => {
                merge_tables(b, o, &full, replace)
            }
            (Some(toml::Value::Array(b)), toml::Value::Array(o))
                if of_tables(b) && of_tables(&o) =>
            {
                b.extend(o)
            }
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// A dotted path into a table.
fn table_get<'t>(t: &'t toml::Table, path: &str) -> Option<&'t toml::Value> {
    let mut parts = path.split('.');
    let mut v = t.get(parts.next()?)?;
    for p in parts {
        v = v.as_table()?.get(p)?;
    }
    Some(v)
}

/// The spec a file that `extends` a base describes, as one table: the
/// base's table with the file's merged over it ([`merge_tables`]). The file
/// serves its own `model_type` only (the base's `also` and `summary` are
/// not inherited), and a layer rule (`pattern`, `interval`, `codes`) in the
/// file replaces the base's rule rather than merging with it.
fn merge_over_base(
    base: &toml::Table,
    own: &toml::Table,
    base_name: &str,
    at: &dyn Fn(&str) -> String,
) -> Result<toml::Table> {
    let mut merged = base.clone();
    let mut over = own.clone();
    over.remove("extends");
    let replace: Vec<String> = match over.remove("replace") {
        None => Vec::new(),
        Some(toml::Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str().map(str::to_owned).ok_or_else(|| {
                    spec_error(&at("replace"), "replace", "expected a list of dotted paths")
                })
            })
            .collect::<Result<_>>()?,
        Some(_) => {
            return Err(spec_error(
                &at("replace"),
                "replace",
                "expected a list of dotted paths",
            ))
        }
    };
    for p in &replace {
        if table_get(base, p).is_none() {
            return Err(spec_error(
                &at(p),
                "replace",
                format!("names `{p}`, which the base spec `{base_name}` does not have"),
            ));
        }
    }
    merged.remove("also");
    merged.remove("summary");
    merged.remove("replace");
    if !own.contains_key("gguf") {
        // A file of the base's family is not one of this family's.
        merged.remove("gguf");
    }
    if let Some(toml::Value::Table(l)) = over.get("layers") {
        if let Some(toml::Value::Table(bl)) = merged.get_mut("layers") {
            if ["pattern", "interval", "codes"]
                .iter()
                .any(|k| l.contains_key(*k))
            {
                bl.remove("pattern");
                bl.remove("interval");
                bl.remove("codes");
            }
        }
    }
    merge_tables(&mut merged, over, "", &replace);
    Ok(merged)
}

/// The built-in spec files, embedded at build time.
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "architectures/llama.toml",
        include_str!("../architectures/llama.toml"),
    ),
    (
        "architectures/qwen2.toml",
        include_str!("../architectures/qwen2.toml"),
    ),
    (
        "architectures/qwen3.toml",
        include_str!("../architectures/qwen3.toml"),
    ),
    (
        "architectures/qwen3_moe.toml",
        include_str!("../architectures/qwen3_moe.toml"),
    ),
    (
        "architectures/qwen3_next.toml",
        include_str!("../architectures/qwen3_next.toml"),
    ),
    (
        "architectures/qwen3_5.toml",
        include_str!("../architectures/qwen3_5.toml"),
    ),
    (
        "architectures/nemotron_h.toml",
        include_str!("../architectures/nemotron_h.toml"),
    ),
    (
        "architectures/dhara_ar.toml",
        include_str!("../architectures/dhara_ar.toml"),
    ),
    (
        "architectures/stablelm.toml",
        include_str!("../architectures/stablelm.toml"),
    ),
    (
        "architectures/olmo2.toml",
        include_str!("../architectures/olmo2.toml"),
    ),
    // After olmo2 and llama, which they extend.
    (
        "architectures/olmo3.toml",
        include_str!("../architectures/olmo3.toml"),
    ),
    (
        "architectures/granite.toml",
        include_str!("../architectures/granite.toml"),
    ),
    (
        "architectures/smollm3.toml",
        include_str!("../architectures/smollm3.toml"),
    ),
    (
        "architectures/phi3.toml",
        include_str!("../architectures/phi3.toml"),
    ),
];

/// The built-in specs as tables, in [`BUILTIN`]'s order: each one's
/// `model_type`, its file's own table and the table merged over its base
/// (the same table when it extends none).
pub(crate) fn builtin_tables() -> Result<Vec<(String, toml::Table, toml::Table)>> {
    let mut out: Vec<(String, toml::Table, toml::Table)> = Vec::new();
    for (file, text) in BUILTIN {
        let own: toml::Table =
            toml::from_str(text).map_err(|e| spec_error(file, "architecture spec", e.message()))?;
        let name = |k: &str| own.get(k).and_then(toml::Value::as_str).map(str::to_owned);
        let model_type = name("model_type").unwrap_or_default();
        let merged = match name("extends") {
            None => own.clone(),
            Some(base) => {
                let (_, _, b) = out
                    .iter()
                    .find(|(m, _, _)| *m == base)
                    .ok_or_else(|| spec_error(file, "extends", format!("`{base}` comes later")))?;
                merge_over_base(b, &own, &base, &|_| (*file).to_owned())?
            }
        };
        out.push((model_type, own, merged));
    }
    Ok(out)
}

impl SpecArchitecture {
    /// Parses the spec in `text` (read from `file`) and checks it against
    /// the layer kinds and the specs already in `registry` (for `extends`).
    /// Returns one architecture per `model_type` it serves.
    pub fn parse(text: &str, file: &Path, registry: &Registry) -> Result<Vec<Self>> {
        let syntax = |e: toml::de::Error| {
            let at = e
                .span()
                .map(|s| location(file, text, s.start))
                .unwrap_or_else(|| file.display().to_string());
            spec_error(&at, "architecture spec", e.message())
        };
        let table: toml::Table = toml::from_str(text).map_err(syntax)?;
        let at = |needle: &str| {
            text.find(needle)
                .map(|o| location(file, text, o))
                .unwrap_or_else(|| file.display().to_string())
        };
        let extends = match table.get("extends") {
            None => None,
            Some(toml::Value::String(b)) => Some(b.clone()),
            Some(_) => {
                return Err(spec_error(
                    &at("extends"),
                    "extends",
                    "expected the model_type of another spec",
                ))
            }
        };
        let (spec, table) = match extends {
            // Typed from the text, so that its errors are located in it.
            None => (toml::from_str::<ArchSpec>(text).map_err(syntax)?, table),
            // The file alone may be partial (a [model] with one field, no
            // [layers]): only the merged table must be a whole spec.
            Some(base_name) => {
                let base = registry
                    .architecture(&base_name)
                    .ok()
                    .and_then(|a| a.spec_table().cloned())
                    .ok_or_else(|| Error::UnknownArchitecture {
                        model_type: base_name.clone(),
                        file: Some(PathBuf::from(at(&format!("\"{base_name}\"")))),
                        known: registry.architecture_names(),
                    })?;
                let merged = merge_over_base(&base, &table, &base_name, &at)?;
                let mut s =
                    ArchSpec::deserialize(toml::Value::Table(merged.clone())).map_err(|e| {
                        let message = e.to_string();
                        // Point at the field serde names, when the file has it.
                        let field = message.split('`').nth(1).unwrap_or("");
                        let place = if field.is_empty() {
                            file.display().to_string()
                        } else {
                            at(field)
                        };
                        spec_error(&place, "architecture spec", message)
                    })?;
                s.extends = Some(base_name);
                (s, merged)
            }
        };
        if spec.extends.is_none() && !spec.replace.is_empty() {
            return Err(spec_error(
                &at("replace"),
                "replace",
                "only a spec that `extends` another can replace its entries",
            ));
        }
        let targets = check(&spec, text, file, registry)?;
        let summary = spec.summary.clone().unwrap_or_else(|| {
            format!(
                "spec {}{}",
                spec.model_type,
                spec.extends
                    .as_ref()
                    .map(|b| format!(" on {b}"))
                    .unwrap_or_default()
            )
        });
        let mut out = vec![SpecArchitecture {
            model_type: spec.model_type.clone(),
            summary,
            spec: spec.clone(),
            table: table.clone(),
            targets: targets.clone(),
        }];
        for a in &spec.also {
            out.push(SpecArchitecture {
                model_type: a.model_type.clone(),
                summary: a.summary.clone(),
                spec: spec.clone(),
                table: table.clone(),
                targets: targets.clone(),
            });
        }
        Ok(out)
    }
}

/// A spec's text, for locating what a check names.
struct Located<'a> {
    text: &'a str,
    file: &'a Path,
}

impl Located<'_> {
    /// `file:line:column` of the first `needle`, else the file.
    fn at(&self, needle: &str) -> String {
        self.text
            .find(needle)
            .map(|o| location(self.file, self.text, o))
            .unwrap_or_else(|| self.file.display().to_string())
    }

    /// Where the key `key` starts a line, else [`Located::at`].
    fn key(&self, key: &str) -> String {
        self.text
            .find(&format!("\n{key}"))
            .map(|o| location(self.file, self.text, o + 1))
            .unwrap_or_else(|| self.at(key))
    }
}

/// An option `bad` under `path` that the struct does not have: located,
/// with the options it does have.
fn unknown_option(
    loc: &Located<'_>,
    path: &str,
    bad: &str,
    what: &str,
    known: &[&str],
    hint: &str,
) -> Error {
    spec_error(
        &loc.key(bad),
        &format!("{path}.{bad}"),
        format!("{what} (its options: {}{hint})", known.join(", ")),
    )
}

/// An unknown layer or mixer name, with the registered ones.
fn unknown_kind(registry: &Registry, kind: &str, context: String) -> Error {
    match registry.layer_kind(kind) {
        Err(Error::UnknownLayerKind { kind: k, known, .. }) => Error::UnknownLayerKind {
            kind: k,
            context: Some(context),
            known,
        },
        Err(e) => e,
        Ok(_) => Error::Other(format!("{context}: `{kind}`")),
    }
}

/// Static checks with locations: every layer name is a block of a
/// registered mixer or a registered kind, every option is one its struct
/// takes, every `"$param"` is declared, one pattern rule, a model section.
/// Returns what builds each layer name.
fn check(
    spec: &ArchSpec,
    text: &str,
    file: &Path,
    registry: &Registry,
) -> Result<BTreeMap<String, LayerTarget>> {
    let loc = Located { text, file };
    check_block_tables(spec, &loc)?;
    let targets = layer_targets(spec, &loc, registry)?;
    check_kind_options(spec, &loc, registry)?;
    if spec.model.is_none() {
        return Err(spec_error(
            &file.display().to_string(),
            "model",
            "missing: a spec needs a [model] section (or `extends` a spec that has one)",
        ));
    }
    for name in spec.blocks.keys() {
        if !targets.contains_key(name) {
            return Err(spec_error(
                &loc.at(&format!("blocks.{name}")),
                &format!("blocks.{name}"),
                "no layer of the pattern has this name",
            ));
        }
    }
    // Every "$param" must be declared.
    for r in spec.refs() {
        let name = r.trim_start_matches('$');
        if !spec.params.contains_key(name) {
            let known: Vec<&str> = spec.params.keys().map(String::as_str).collect();
            return Err(spec_error(
                &loc.at(&r),
                &r,
                format!(
                    "`{name}` is not a declared parameter (add it under [params]; declared: {})",
                    known.join(", ")
                ),
            ));
        }
    }
    Ok(targets)
}

/// `[block]` and `[blocks.<name>]` hold only block options (and `mixer` in
/// the latter).
fn check_block_tables(spec: &ArchSpec, loc: &Located<'_>) -> Result<()> {
    let block_keys = mlex_core::config::struct_fields::<crate::block::BlockOptions>();
    let check_table = |t: &toml::Table, path: &str| -> Result<()> {
        if let Some(bad) = t
            .keys()
            .find(|k| *k == "mixer_options" || !block_keys.contains(&k.as_str()))
        {
            let known: Vec<&str> = block_keys
                .iter()
                .filter(|k| **k != "mixer_options")
                .copied()
                .collect();
            let what = format!("a block has no option `{bad}`");
            let hint = "; a mixer's options go under [kinds.<mixer>]";
            return Err(unknown_option(loc, path, bad, &what, &known, hint));
        }
        Ok(())
    };
    check_table(&spec.block, "block")?;
    if spec.block.contains_key("mixer") {
        return Err(spec_error(
            &loc.at("mixer"),
            "block.mixer",
            "the mixer is the layer's name or [blocks.<name>].mixer, not an option of every block",
        ));
    }
    for (name, t) in &spec.blocks {
        check_table(t, &format!("blocks.{name}"))?;
    }
    Ok(())
}

/// What builds each layer name of the pattern rule: a block around a
/// mixer, or a registered whole-layer kind.
fn layer_targets(
    spec: &ArchSpec,
    loc: &Located<'_>,
    registry: &Registry,
) -> Result<BTreeMap<String, LayerTarget>> {
    let at = |needle: &str| loc.at(needle);
    let mut targets: BTreeMap<String, LayerTarget> = BTreeMap::new();
    let mut target_of = |name: &str, context: String| -> Result<()> {
        let target = match spec.blocks.get(name).and_then(|t| t.get("mixer")) {
            Some(toml::Value::String(m)) if m == "none" => LayerTarget::Block(None),
            Some(toml::Value::String(m)) if registry.mixer_kind(m).is_some() => {
                LayerTarget::Block(Some(m.clone()))
            }
            Some(m) => {
                let m = m.as_str().unwrap_or("");
                let context = format!("{}: blocks.{name}.mixer", at(m));
                return Err(unknown_kind(registry, m, context));
            }
            None if registry.mixer_kind(name).is_some() => {
                LayerTarget::Block(Some(name.to_owned()))
            }
            None if registry.layer_kind(name).is_ok() => LayerTarget::Kind,
            None => return Err(unknown_kind(registry, name, context)),
        };
        targets.insert(name.to_owned(), target);
        Ok(())
    };
    let l = &spec.layers;
    let rules = [l.pattern.is_some(), l.interval.is_some(), l.codes.is_some()]
        .iter()
        .filter(|b| **b)
        .count();
    if rules != 1 {
        return Err(spec_error(
            &at("[layers]"),
            "layers",
            "needs exactly one of `pattern` (a repeating list of kinds), `interval` or `codes`",
        ));
    }
    if let Some(p) = &l.pattern {
        if p.is_empty() {
            // Point at the empty list itself.
            let list = loc
                .text
                .find("pattern")
                .and_then(|o| loc.text[o..].find('[').map(|b| o + b))
                .map(|o| location(loc.file, loc.text, o))
                .unwrap_or_else(|| loc.file.display().to_string());
            return Err(spec_error(
                &list,
                "layers.pattern",
                "must name at least one layer kind",
            ));
        }
        for (i, k) in p.iter().enumerate() {
            target_of(
                k,
                format!("{}: layers.pattern[{i}]", at(&format!("\"{k}\""))),
            )?;
        }
    }
    if let Some(r) = &l.interval {
        target_of(&r.on, format!("{}: layers.interval.on", at(&r.on)))?;
        target_of(&r.off, format!("{}: layers.interval.off", at(&r.off)))?;
    }
    if let Some(c) = &l.codes {
        for (code, kind) in &c.map {
            target_of(kind, format!("{}: layers.codes.map.{code}", at(kind)))?;
        }
    }
    Ok(targets)
}

/// Every `[kinds.<kind>]` names a registered mixer or layer kind and holds
/// only options its struct takes.
fn check_kind_options(spec: &ArchSpec, loc: &Located<'_>, registry: &Registry) -> Result<()> {
    for (kind, options) in &spec.kinds {
        let keys = match (registry.mixer_kind(kind), registry.layer_kind(kind)) {
            (Some(m), _) => m.option_keys(),
            (None, Ok(k)) => k.option_keys(),
            (None, Err(_)) => {
                let context = format!("{}: [kinds.{kind}]", loc.at(kind));
                return Err(unknown_kind(registry, kind, context));
            }
        };
        if keys.is_empty() {
            continue;
        }
        if let Some(bad) = options.keys().find(|k| !keys.contains(&k.as_str())) {
            let what = format!("`{kind}` has no option `{bad}`");
            let path = format!("kinds.{kind}");
            return Err(unknown_option(loc, &path, bad, &what, keys, ""));
        }
    }
    Ok(())
}

impl ArchSpec {
    /// Every `"$param"` the spec uses (in `[model]`, `[layers]`, `[kinds]`,
    /// the sanitize gates and the parameters' `only_if`).
    fn refs(&self) -> Vec<String> {
        let text = |s: &str| toml::Value::String(s.to_owned());
        let mut values: Vec<toml::Value> = Vec::new();
        if let Some(m) = &self.model {
            values.extend(
                [&m.vocab_size, &m.hidden_size, &m.norm_eps]
                    .into_iter()
                    .chain(&m.tie)
                    .chain(&m.max_context)
                    .chain(&m.logit_softcap)
                    .chain(&m.embedding_multiplier)
                    .chain(&m.logits_scaling)
                    .cloned(),
            );
        }
        let l = &self.layers;
        values.extend(l.count.iter().cloned());
        values.extend(l.interval.iter().map(|r| r.every.clone()));
        values.extend(l.codes.iter().map(|c| text(&c.from)));
        if let Some(MlpRule::Moe(m)) = &l.ffn {
            values.push(m.experts.clone());
            values.extend(m.sparse_step.iter().chain(&m.dense_layers).cloned());
        }
        for w in &l.where_ {
            values.push(text(&w.list));
            values.push(toml::Value::Table(w.options.clone()));
        }
        values.extend(self.kinds.values().cloned().map(toml::Value::Table));
        values.push(toml::Value::Table(self.block.clone()));
        values.extend(self.blocks.values().cloned().map(toml::Value::Table));
        for st in &self.sanitize {
            values.extend(st.when.iter().map(|w| text(w)));
            values.extend(st.stack_experts.iter().map(|se| se.experts.clone()));
        }
        for p in self.params.values() {
            if let ParamSpec::Full(ParamTable {
                only_if: Some(g), ..
            }) = p
            {
                values.push(text(&format!("${g}")));
            }
        }
        let mut refs = Vec::new();
        for v in &values {
            collect_refs(v, &mut refs);
        }
        refs
    }

    /// Every config key the parameters read (for the generated docs).
    pub fn config_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = Vec::new();
        for (name, p) in &self.params {
            match p {
                ParamSpec::Type(_) => keys.push(name.clone()),
                ParamSpec::Full(t) => {
                    if t.keys.is_empty() {
                        keys.push(t.key.clone().unwrap_or_else(|| name.clone()));
                    } else {
                        keys.extend(t.keys.iter().cloned());
                    }
                }
            }
        }
        if let Some(t) = &self.text_config {
            keys.push(t.clone());
        }
        keys.sort();
        keys.dedup();
        keys
    }
}

fn collect_refs(v: &toml::Value, out: &mut Vec<String>) {
    match v {
        toml::Value::String(s) if s.starts_with('$') => out.push(s.clone()),
        toml::Value::Array(a) => a.iter().for_each(|x| collect_refs(x, out)),
        toml::Value::Table(t) => t.values().for_each(|x| collect_refs(x, out)),
        _ => {}
    }
}

/// A dotted key path in a config value.
fn lookup<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(v, |v, k| v.get(k))
        .filter(|v| !v.is_null())
}

/// A `where` rule's `equals` against a list entry: numbers by value
/// (`0` equals `0.0`), anything else exactly.
fn same_entry(entry: &Value, equals: &Value) -> bool {
    match (entry.as_f64(), equals.as_f64()) {
        (Some(a), Some(b)) => a == b,
        _ => entry == equals,
    }
}

fn to_json(v: &toml::Value) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// The parameters of one config, resolved and type-checked.
struct Resolved<'a> {
    config: &'a ModelConfig,
    values: BTreeMap<String, Option<Value>>,
    /// The config key each parameter was read from (or would have been).
    keys: BTreeMap<String, String>,
}

impl<'a> Resolved<'a> {
    fn new(spec: &ArchSpec, config: &'a ModelConfig) -> Result<Self> {
        let mut values = BTreeMap::new();
        let mut read_from = BTreeMap::new();
        let cv = config.value();
        for (name, p) in &spec.params {
            let (keys, ty, default, optional, map) = match p {
                ParamSpec::Type(t) => (vec![name.clone()], *t, None, false, None),
                ParamSpec::Full(t) => (
                    if t.keys.is_empty() {
                        vec![t.key.clone().unwrap_or_else(|| name.clone())]
                    } else {
                        t.keys.clone()
                    },
                    t.ty,
                    t.default.as_ref().map(to_json),
                    t.optional,
                    t.map.as_ref(),
                ),
            };
            let found = keys
                .iter()
                .find_map(|k| lookup(cv, k).map(|v| (k.clone(), v.clone())));
            let (key, value) = match found {
                Some(kv) => (kv.0, Some(kv.1)),
                None => (keys[0].clone(), default),
            };
            let value = match value {
                None if optional => None,
                None => {
                    return Err(config.error(
                        &keys.join(" or "),
                        format!("missing from the model config ({ty:?} parameter `{name}`)")
                            .replace("Int", "integer")
                            .replace("Count", "positive integer")
                            .replace("Float", "number")
                            .replace("Bool", "boolean"),
                    ))
                }
                Some(v) => {
                    // Integers where numbers are expected are numbers.
                    if let Err(m) = ty.check(&v) {
                        return Err(config.error(&key, format!("{m}, got {v}")));
                    }
                    if ty == ParamType::Count {
                        if let Some(Err(m)) = v.as_i64().map(mlex_core::config::count) {
                            return Err(config.error(&key, m));
                        }
                    }
                    Some(match map {
                        None => v,
                        Some(m) => {
                            let k = match &v {
                                Value::String(s) => s.clone(),
                                other => other.to_string(),
                            };
                            match m.get(&k) {
                                Some(x) => to_json(x),
                                None => {
                                    let known: Vec<&str> = m.keys().map(String::as_str).collect();
                                    return Err(config.error(
                                        &key,
                                        format!(
                                            "unsupported value {v} (supported: {})",
                                            known.join(", ")
                                        ),
                                    ));
                                }
                            }
                        }
                    })
                }
            };
            values.insert(name.clone(), value);
            read_from.insert(name.clone(), key);
        }
        // Gates last: a gated parameter is absent when its gate is false.
        for (name, p) in &spec.params {
            if let ParamSpec::Full(ParamTable {
                only_if: Some(g), ..
            }) = p
            {
                // Truthy as in Python: true, a non-zero number, a
                // non-empty string or list.
                let on = match values.get(g).and_then(|v| v.as_ref()) {
                    Some(Value::Bool(b)) => *b,
                    Some(Value::Number(n)) => n.as_f64().is_some_and(|x| x != 0.0),
                    Some(Value::String(s)) => !s.is_empty(),
                    Some(Value::Array(a)) => !a.is_empty(),
                    Some(Value::Object(o)) => !o.is_empty(),
                    _ => false,
                };
                if !on {
                    values.insert(name.clone(), None);
                }
            }
        }
        Ok(Self {
            config,
            values,
            keys: read_from,
        })
    }

    /// The value of `"$name"`, or a literal.
    fn value(&self, v: &toml::Value) -> Option<Value> {
        match v {
            toml::Value::String(s) if s.starts_with('$') => {
                self.values.get(&s[1..]).cloned().flatten()
            }
            toml::Value::Table(t) => {
                let mut m = Map::new();
                for (k, x) in t {
                    if let Some(r) = self.value(x) {
                        m.insert(k.clone(), r);
                    }
                }
                Some(Value::Object(m))
            }
            toml::Value::Array(a) => Some(Value::Array(
                a.iter().filter_map(|x| self.value(x)).collect(),
            )),
            other => Some(to_json(other)),
        }
    }

    fn required(&self, v: &toml::Value, what: &str) -> Result<Value> {
        self.value(v).ok_or_else(|| {
            self.config.error(
                what,
                format!("has no value ({v} is absent from the config)"),
            )
        })
    }

    fn int(&self, v: &toml::Value, what: &str) -> Result<i64> {
        let x = self.required(v, what)?;
        x.as_i64().ok_or_else(|| {
            self.config
                .error(what, format!("expected an integer, got {x}"))
        })
    }

    /// The config key behind `v` (a `"$param"`), else the spec's `what`.
    fn key_of(&self, v: &toml::Value, what: &str) -> String {
        match v {
            toml::Value::String(s) if s.starts_with('$') => self
                .keys
                .get(&s[1..])
                .cloned()
                .unwrap_or_else(|| what.to_owned()),
            _ => what.to_owned(),
        }
    }

    /// An integer of at least `min` (a layer count, an interval, an expert
    /// count), the error naming the config key it came from.
    fn at_least(&self, v: &toml::Value, what: &str, min: i64) -> Result<usize> {
        let key = self.key_of(v, what);
        let x = self.required(v, &key)?;
        match x.as_i64() {
            Some(n) if n >= min && n <= i64::from(i32::MAX) => Ok(n as usize),
            _ => Err(self.config.error(
                &key,
                format!("must be an integer from {min} to {}, got {x}", i32::MAX),
            )),
        }
    }

    fn float(&self, v: &toml::Value, what: &str) -> Result<f64> {
        let x = self.required(v, what)?;
        x.as_f64().ok_or_else(|| {
            self.config
                .error(what, format!("expected a number, got {x}"))
        })
    }

    fn flag(&self, v: &toml::Value) -> bool {
        self.value(v).and_then(|x| x.as_bool()).unwrap_or(false)
    }
}

impl SpecArchitecture {
    fn lifted(&self, config: &ModelConfig) -> Result<ModelConfig> {
        let mut text = match &self.spec.text_config {
            Some(key) => match config.value().get(key) {
                Some(v) if !v.is_object() => {
                    return Err(config.error(key, "expected an object"));
                }
                Some(v) => v.clone(),
                None => config.value().clone(),
            },
            None => config.value().clone(),
        };
        if let Some(obj) = text.as_object_mut() {
            for (k, v) in &self.spec.config_defaults {
                if obj.get(k).is_none_or(Value::is_null) {
                    obj.insert(k.clone(), to_json(v));
                }
            }
        }
        Ok(ModelConfig::new(text, config.file()))
    }

    fn kinds_of_layers(&self, r: &Resolved<'_>) -> Result<Vec<String>> {
        let l = &self.spec.layers;
        let config = r.config;
        let count = |r: &Resolved<'_>| -> Result<usize> {
            let c = l.count.as_ref().ok_or_else(|| {
                config.error(
                    "layers.count",
                    "the spec's [layers] needs `count` for this rule",
                )
            })?;
            r.at_least(c, "layers.count", 1)
        };
        if let Some(p) = &l.pattern {
            return Ok((0..count(r)?).map(|i| p[i % p.len()].clone()).collect());
        }
        if let Some(iv) = &l.interval {
            let every = r.at_least(&iv.every, "layers.interval.every", 1)?;
            return Ok((0..count(r)?)
                .map(|i| {
                    if (i + 1) % every == 0 {
                        iv.on.clone()
                    } else {
                        iv.off.clone()
                    }
                })
                .collect());
        }
        let c = l.codes.as_ref().expect("checked: one pattern rule");
        let name = c.from.trim_start_matches('$');
        let key = self.param_key(name);
        let v = r.values.get(name).cloned().flatten().ok_or_else(|| {
            config.error(&key, "missing: the config must describe the layer stack")
        })?;
        let codes: Vec<String> = match &v {
            Value::String(s) => s.chars().map(String::from).collect(),
            Value::Array(a) => a
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            _ => return Err(config.error(&key, "expected a string or a list")),
        };
        // A layer count the config states must agree with the pattern.
        if let Some(c) = l.count.as_ref().filter(|c| r.value(c).is_some()) {
            let n = r.at_least(c, "layers.count", 1)?;
            if n != codes.len() {
                return Err(config.error(
                    &key,
                    format!(
                        "describes {} layers but the config says {n} (the pattern must cover every layer)",
                        codes.len()
                    ),
                ));
            }
        }
        codes
            .iter()
            .enumerate()
            .map(|(i, code)| {
                c.map.get(code).cloned().ok_or_else(|| {
                    let known: Vec<&str> = c.map.keys().map(String::as_str).collect();
                    config.error(
                        &key,
                        format!(
                            "unknown layer `{code}` at position {i} (known: {})",
                            known.join(", ")
                        ),
                    )
                })
            })
            .collect()
    }

    /// The config key a parameter reads (its first), for errors.
    fn param_key(&self, name: &str) -> String {
        match self.spec.params.get(name) {
            Some(ParamSpec::Full(t)) => t
                .keys
                .first()
                .cloned()
                .or_else(|| t.key.clone())
                .unwrap_or_else(|| name.to_owned()),
            _ => name.to_owned(),
        }
    }
}

impl SpecArchitecture {
    /// The MTP head's plan: `count` copies of the first trunk layer named
    /// `[mtp].layer`, under `{prefix}.layers.{i}` (none when the config
    /// sets no MTP layers: the prefix still names what to leave out).
    fn mtp_plan(&self, r: &Resolved<'_>, layers: &[LayerPlan]) -> Result<Option<MtpPlan>> {
        let Some(m) = &self.spec.mtp else {
            return Ok(None);
        };
        let count = match r.value(&m.count) {
            Some(_) => r.at_least(&m.count, "mtp.count", 0)?,
            None => 0,
        };
        if count == 0 {
            return Ok(Some(MtpPlan {
                prefix: m.prefix.clone(),
                layers: Vec::new(),
            }));
        }
        let like = layers.iter().find(|l| l.name == m.layer).ok_or_else(|| {
            Error::Other(format!(
                "`{}`: [mtp] layer `{}` is none of this model's layers",
                self.spec.model_type, m.layer
            ))
        })?;
        Ok(Some(MtpPlan {
            prefix: m.prefix.clone(),
            layers: (0..count)
                .map(|i| LayerPlan {
                    prefix: format!("{}.layers.{i}", m.prefix),
                    ..like.clone()
                })
                .collect(),
        }))
    }
}

impl Architecture for SpecArchitecture {
    fn name(&self) -> &str {
        &self.model_type
    }
    fn summary(&self) -> &str {
        &self.summary
    }
    fn text_config(&self, config: &ModelConfig) -> Result<ModelConfig> {
        self.lifted(config)
    }
    fn config_keys(&self) -> Vec<String> {
        self.spec.config_keys()
    }
    fn spec_table(&self) -> Option<&toml::Table> {
        Some(&self.table)
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let r = Resolved::new(&self.spec, config)?;
        let m = self.spec.model.as_ref().expect("checked: a model section");
        let kinds = self.kinds_of_layers(&r)?;
        let l = &self.spec.layers;
        let moe_layers: Option<Vec<bool>> = match &l.ffn {
            Some(MlpRule::Moe(rule)) => {
                let experts = match r.value(&rule.experts) {
                    Some(_) => r.at_least(&rule.experts, "layers.ffn.experts", 0)?,
                    None => 0,
                };
                let step = match &rule.sparse_step {
                    Some(v) if r.value(v).is_some() => {
                        r.at_least(v, "layers.ffn.sparse_step", 1)? as i64
                    }
                    _ => 1,
                };
                let dense: Vec<i64> = rule
                    .dense_layers
                    .as_ref()
                    .and_then(|v| r.value(v))
                    .and_then(|v| {
                        v.as_array()
                            .map(|a| a.iter().filter_map(Value::as_i64).collect())
                    })
                    .unwrap_or_default();
                Some(
                    (0..kinds.len())
                        .map(|i| {
                            experts > 0
                                && !dense.contains(&(i as i64))
                                && (i as i64 + 1) % step == 0
                        })
                        .collect(),
                )
            }
            _ => None,
        };
        let where_lists: Vec<(Vec<Value>, Value, &WhereRule)> = l
            .where_
            .iter()
            .map(|w| {
                let list = r
                    .values
                    .get(w.list.trim_start_matches('$'))
                    .cloned()
                    .flatten()
                    .and_then(|v| v.as_array().cloned())
                    .unwrap_or_default();
                (list, to_json(&w.equals), w)
            })
            .collect();
        let resolve = |t: &toml::Table| {
            r.value(&toml::Value::Table(t.clone()))
                .unwrap_or(Value::Null)
        };
        let mut layers = Vec::with_capacity(kinds.len());
        for (i, name) in kinds.into_iter().enumerate() {
            let target = self
                .targets
                .get(&name)
                .cloned()
                .unwrap_or(LayerTarget::Kind);
            let kind_options = |kind: &str| match self.spec.kinds.get(kind) {
                Some(t) => resolve(t),
                None => Value::Object(Map::new()),
            };
            // The mixer's (or whole kind's) options, with the `where` rules'.
            let mut options = match &target {
                LayerTarget::Block(Some(mixer)) => kind_options(mixer),
                LayerTarget::Block(None) => Value::Object(Map::new()),
                LayerTarget::Kind => kind_options(&name),
            };
            for (list, equals, w) in &where_lists {
                if list.get(i).is_some_and(|x| same_entry(x, equals)) {
                    if let (Value::Object(extra), Some(o)) =
                        (resolve(&w.options), options.as_object_mut())
                    {
                        o.extend(extra);
                    }
                }
            }
            let LayerTarget::Block(mixer) = target else {
                layers.push(LayerPlan {
                    kind: name.clone(),
                    name,
                    prefix: format!("{}.{i}", m.layers),
                    options,
                });
                continue;
            };
            let own = self.spec.blocks.get(&name);
            let mut block = match resolve(&self.spec.block) {
                Value::Object(o) => o,
                _ => Map::new(),
            };
            if let Some(Value::Object(o)) = own.map(resolve) {
                block.extend(o);
            }
            let ffn = match &l.ffn {
                _ if own.is_some_and(|t| t.contains_key("ffn")) => None,
                Some(MlpRule::Fixed(k)) => Some(k.clone()),
                Some(MlpRule::Moe(rule)) => Some(if moe_layers.as_ref().is_some_and(|v| v[i]) {
                    rule.moe.clone()
                } else {
                    rule.dense.clone()
                }),
                None => None,
            };
            if let Some(ffn) = ffn {
                block.insert("ffn".into(), Value::String(ffn));
            }
            block.insert("mixer".into(), mixer.map_or(Value::Null, Value::String));
            block.insert("mixer_options".into(), options);
            layers.push(LayerPlan {
                name,
                kind: "block".into(),
                prefix: format!("{}.{i}", m.layers),
                options: Value::Object(block),
            });
        }
        let tie = m.tie.as_ref().is_some_and(|t| r.flag(t));
        // A multiplier or divisor: absent, or a finite number other than 0.
        let factor = |v: &Option<toml::Value>, what: &str| -> Result<Option<f32>> {
            let Some(v) = v.as_ref().filter(|v| r.value(v).is_some()) else {
                return Ok(None);
            };
            let x = r.float(v, what)?;
            if !x.is_finite() || x == 0.0 {
                return Err(r
                    .config
                    .error(&r.key_of(v, what), "must be a finite number other than 0"));
            }
            Ok(Some(x as f32))
        };
        let mtp = self.mtp_plan(&r, &layers)?;
        let softcap = match &m.logit_softcap {
            Some(v) => r.value(v).and_then(|x| x.as_f64()).filter(|c| *c > 0.0),
            None => None,
        };
        Ok(ModelPlan {
            vocab_size: r.int(&m.vocab_size, "vocab_size")? as i32,
            hidden_size: r.int(&m.hidden_size, "hidden_size")? as i32,
            embed: m.embed.clone(),
            layers,
            final_norm: m.final_norm.clone(),
            norm_eps: r.float(&m.norm_eps, "norm_eps")? as f32,
            norm_type: m.norm_type,
            head: if tie {
                HeadPlan::Tied
            } else {
                HeadPlan::Linear(m.head.clone())
            },
            logit_softcap: softcap.map(|c| c as f32),
            embedding_multiplier: factor(&m.embedding_multiplier, "embedding_multiplier")?,
            logits_scaling: factor(&m.logits_scaling, "logits_scaling")?,
            max_context: match &m.max_context {
                Some(v) => r.value(v).and_then(|x| x.as_u64()).map(|n| n as usize),
                None => None,
            },
            mtp,
        })
    }
    fn sanitize(&self, config: &ModelConfig, weights: &mut WeightMap) -> Result<()> {
        let text = self.lifted(config)?;
        let r = Resolved::new(&self.spec, &text)?;
        // The layer stack as the plan will see it: a bad count is named here
        // already, not left to surface as unexpected tensors.
        let layer_count = self.kinds_of_layers(&r)?.len();
        // Conditions see the checkpoint as read, before any step.
        let names = weights.names();
        let gates: Vec<bool> = self
            .spec
            .sanitize
            .iter()
            .map(|s| {
                s.when
                    .as_ref()
                    .is_none_or(|w| r.flag(&toml::Value::String(w.clone())))
                    && s.if_tensor_ending
                        .as_ref()
                        .is_none_or(|e| names.iter().any(|n| n.ends_with(e.as_str())))
                    && s.if_torch_conv
                        .as_ref()
                        .is_none_or(|m| steps::has_torch_conv(weights, m))
            })
            .collect();
        for (s, on) in self.spec.sanitize.iter().zip(gates) {
            if !on {
                continue;
            }
            if let Some(p) = &s.drop_prefix {
                steps::drop_where(weights, |n| p.iter().any(|x| n.starts_with(x.as_str())))?;
            }
            if let Some(p) = &s.drop_containing {
                steps::drop_where(weights, |n| p.iter().any(|x| n.contains(x.as_str())))?;
            }
            if let Some(m) = &s.drop_module {
                steps::drop_prefix(weights, m)?;
            }
            if let Some([from, to]) = &s.rename_prefix {
                weights.rename_all(|n| {
                    Some(match n.strip_prefix(from.as_str()) {
                        Some(rest) => format!("{to}{rest}"),
                        None => n.to_owned(),
                    })
                })?;
            }
            if let Some([from, to]) = &s.rename_part {
                weights.rename_all(|n| Some(steps::rename_part(n, from, to)))?;
            }
            if let Some(p) = &s.add_prefix {
                weights.rename_all(|n| {
                    Some(if n.starts_with(p.as_str()) {
                        n.to_owned()
                    } else {
                        format!("{p}{n}")
                    })
                })?;
            }
            if let Some(m) = &s.conv_to_mlx {
                steps::conv_to_mlx(weights, m)?;
            }
            if let Some(sfx) = &s.norm_plus_one {
                let v: Vec<&str> = sfx.iter().map(String::as_str).collect();
                steps::norm_plus_one(weights, &v)?;
            }
            if let Some(se) = &s.stack_experts {
                let experts = match r.value(&se.experts) {
                    Some(_) => r.at_least(&se.experts, "sanitize.stack_experts.experts", 0)?,
                    None => 0,
                };
                let names: Vec<(&str, &str)> = se
                    .names
                    .iter()
                    .map(|[a, b]| (a.as_str(), b.as_str()))
                    .collect();
                for i in 0..layer_count {
                    let module = se.module.replace("{i}", &i.to_string());
                    steps::stack_experts(weights, &module, experts, &names)?;
                }
            }
            if let Some(m) = &s.split_fused_experts {
                for i in 0..layer_count {
                    steps::split_gate_up(weights, &m.replace("{i}", &i.to_string()))?;
                }
            }
        }
        Ok(())
    }
}
