//! Architectures defined in TOML, with no Rust: a new `model_type` that
//! reuses a registered base architecture's config keys, weight naming and
//! sanitize, and composes registered layer kinds in a repeating pattern.
//!
//! ```toml
//! name = "my_hybrid"            # the config.json model_type it serves
//! base = "qwen3_next"           # weight naming, config keys, sanitize
//! summary = "two Gated DeltaNet layers per attention layer"
//!
//! [layers]
//! pattern = ["gated_delta", "gated_delta", "attention"]   # repeats
//! mlp = "swiglu"                # optional: feed-forward of every layer
//!
//! [options.attention]           # optional: per-kind option overrides
//! sliding_window = 4096
//! ```
//!
//! Each layer takes the options the base architecture gives that layer when
//! it is of the same kind (keeping per-layer choices such as MoE vs dense),
//! else those of the base's first layer of the kind (so a `gated_delta` layer
//! keeps Qwen3-Next's layout), then the overrides above.

use mlex_core::arch::{Architecture, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_core::weights::WeightMap;
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    name: String,
    base: toml::Spanned<String>,
    summary: Option<String>,
    layers: LayersSpec,
    #[serde(default)]
    options: BTreeMap<String, toml::Table>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayersSpec {
    pattern: toml::Spanned<Vec<toml::Spanned<String>>>,
    mlp: Option<String>,
}

/// An architecture read from a TOML file.
pub struct TomlArchitecture {
    name: String,
    summary: String,
    base: Arc<dyn Architecture>,
    pattern: Vec<String>,
    mlp: Option<String>,
    options: BTreeMap<String, Value>,
    file: PathBuf,
}

/// `file:line:column` of byte `offset` in `text` (both 1-based, columns in
/// characters), as compilers print locations.
fn location(file: &Path, text: &str, offset: usize) -> String {
    let before = text.get(..offset.min(text.len())).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    format!("{}:{line}:{column}", file.display())
}

fn config_error(file: &Path, key: &str, message: impl Into<String>) -> Error {
    Error::Config {
        file: file.to_owned(),
        key: key.to_owned(),
        message: message.into(),
    }
}

impl TomlArchitecture {
    /// Parses `text` (read from `file`) against the kinds and bases in
    /// `registry`.
    pub fn parse(text: &str, file: &Path, registry: &Registry) -> Result<Self> {
        let spec: Spec = toml::from_str(text).map_err(|e| {
            let at = e
                .span()
                .map(|s| location(file, text, s.start))
                .unwrap_or_else(|| file.display().to_string());
            config_error(Path::new(&at), "architecture spec", e.message())
        })?;
        let pattern_at = location(file, text, spec.layers.pattern.span().start);
        let pattern: Vec<toml::Spanned<String>> = spec.layers.pattern.into_inner();
        if pattern.is_empty() {
            return Err(config_error(
                Path::new(&pattern_at),
                "layers.pattern",
                "must name at least one layer kind",
            ));
        }
        for (i, kind) in pattern.iter().enumerate() {
            registry.layer_kind(kind.get_ref()).map_err(|e| match e {
                Error::UnknownLayerKind { kind: k, known, .. } => Error::UnknownLayerKind {
                    kind: k,
                    context: Some(format!(
                        "{}: layers.pattern[{i}]",
                        location(file, text, kind.span().start)
                    )),
                    known,
                },
                e => e,
            })?;
        }
        let base_at = location(file, text, spec.base.span().start);
        let base_name = spec.base.into_inner();
        let base = registry.architecture(&base_name).map_err(|e| match e {
            Error::UnknownArchitecture {
                model_type, known, ..
            } => Error::UnknownArchitecture {
                model_type,
                file: Some(PathBuf::from(&base_at)),
                known,
            },
            e => e,
        })?;
        let pattern: Vec<String> = pattern.into_iter().map(toml::Spanned::into_inner).collect();
        let options = spec
            .options
            .into_iter()
            .map(|(k, t)| {
                let v = serde_json::to_value(&t)
                    .map_err(|e| config_error(file, &format!("options.{k}"), e.to_string()))?;
                Ok((k, v))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            summary: spec
                .summary
                .unwrap_or_else(|| format!("TOML hybrid on {base_name}: {}", pattern.join(", "))),
            name: spec.name,
            base,
            pattern,
            mlp: spec.layers.mlp,
            options,
            file: file.to_owned(),
        })
    }

    /// The file it came from.
    pub fn file(&self) -> &Path {
        &self.file
    }
}

fn merge(into: &mut Value, from: &Value) {
    if let (Some(a), Some(b)) = (into.as_object_mut(), from.as_object()) {
        for (k, v) in b {
            a.insert(k.clone(), v.clone());
        }
    }
}

impl Architecture for TomlArchitecture {
    fn name(&self) -> &str {
        &self.name
    }
    fn summary(&self) -> &str {
        &self.summary
    }
    fn text_config(&self, config: &ModelConfig) -> Result<ModelConfig> {
        self.base.text_config(config)
    }
    fn config_keys(&self) -> Vec<String> {
        self.base.config_keys()
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        let mut plan = self.base.plan(config)?;
        let mut base_options: BTreeMap<String, Value> = BTreeMap::new();
        for l in &plan.layers {
            base_options
                .entry(l.kind.clone())
                .or_insert_with(|| l.options.clone());
        }
        for (i, layer) in plan.layers.iter_mut().enumerate() {
            let kind = &self.pattern[i % self.pattern.len()];
            // The base's own options for this layer when it is of the same
            // kind (keeps per-layer choices such as MoE vs dense MLP), else
            // those of the base's first layer of that kind.
            let mut opts = if &layer.kind == kind {
                layer.options.clone()
            } else {
                base_options
                    .get(kind)
                    .cloned()
                    .unwrap_or_else(|| Value::Object(Default::default()))
            };
            if let Some(m) = &self.mlp {
                if opts.is_object() {
                    opts["mlp"] = Value::String(m.clone());
                }
            }
            if let Some(o) = self.options.get(kind) {
                merge(&mut opts, o);
            }
            layer.kind = kind.clone();
            layer.options = opts;
        }
        Ok(plan)
    }
    fn sanitize(&self, config: &ModelConfig, weights: &mut WeightMap) -> Result<()> {
        self.base.sanitize(config, weights)
    }
}
