//! Architectures: how a `model_type` turns a config and weights into a
//! [`Model`](crate::model::Model).
//!
//! An architecture does two things, as mlx-lm's model files do: `sanitize`
//! (all weight-name translation, so layers see one naming) and `plan`
//! (which registered layer kind each layer is, with which options and
//! weight prefix). Building the layers is then generic: every layer comes
//! from a registered [`LayerKind`](crate::layer::LayerKind), which is what
//! lets a TOML file compose a new hybrid without Rust code.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::WeightMap;
use serde_json::Value;

/// One layer of a plan.
#[derive(Clone, Debug)]
pub struct LayerPlan {
    /// What the layer is called in the plan and in `mlex inspect`: the
    /// spec's name for it (`attention`, `mamba2`, `mlp`, ...).
    pub name: String,
    /// The registered layer kind that builds it: `block` for a block of a
    /// mixer and a feed-forward, or a downstream crate's whole-layer kind.
    pub kind: String,
    /// Weight prefix, e.g. `model.layers.3`.
    pub prefix: String,
    /// The kind's options (for a block: its block options, its mixer's
    /// name and the mixer's options).
    pub options: Value,
}

/// How the output head is stored.
#[derive(Clone, Debug)]
pub enum HeadPlan {
    /// The embedding matrix is reused (`tie_word_embeddings`).
    Tied,
    /// A separate linear layer with this weight prefix.
    Linear(String),
}

/// A multi-token-prediction head (Qwen3-Next, Qwen3.5): weights
/// `{prefix}.fc` (`[D, 2D]`), `{prefix}.pre_fc_norm_embedding`,
/// `{prefix}.pre_fc_norm_hidden`, `{prefix}.norm`, and `layers` (copies of
/// one trunk layer's plan under `{prefix}.layers.{i}`); the embedding and
/// the output head are the trunk's.
#[derive(Clone, Debug)]
pub struct MtpPlan {
    /// Weight prefix, e.g. `mtp`.
    pub prefix: String,
    /// Its decoder layers.
    pub layers: Vec<LayerPlan>,
}

/// The whole model, as the layer builder sees it.
#[derive(Clone, Debug)]
pub struct ModelPlan {
    /// Vocabulary size.
    pub vocab_size: i32,
    /// Residual width.
    pub hidden_size: i32,
    /// Embedding weight prefix.
    pub embed: String,
    /// The layers in order.
    pub layers: Vec<LayerPlan>,
    /// Final norm weight prefix.
    pub final_norm: String,
    /// Final norm epsilon.
    pub norm_eps: f32,
    /// Final norm kind (RMS or LayerNorm).
    pub norm_type: crate::nn::NormKind,
    /// Output head.
    pub head: HeadPlan,
    /// `c * tanh(logits / c)` when set.
    pub logit_softcap: Option<f32>,
    /// Embedded tokens multiplied by this (Granite).
    pub embedding_multiplier: Option<f32>,
    /// Logits divided by this (Granite).
    pub logits_scaling: Option<f32>,
    /// The longest context the model supports, if the config says.
    pub max_context: Option<usize>,
    /// A multi-token-prediction head the checkpoint may hold (built only
    /// when asked for: [`crate::model::Model::build_with`]).
    pub mtp: Option<MtpPlan>,
}

/// One `model_type`.
pub trait Architecture: Send + Sync {
    /// The `model_type` served.
    fn name(&self) -> &str;

    /// One line for `mlex list`.
    fn summary(&self) -> &str;

    /// The config the layers read. Multimodal wrappers lift their
    /// `text_config` here; others return the config unchanged.
    fn text_config(&self, config: &ModelConfig) -> Result<ModelConfig> {
        Ok(config.clone())
    }

    /// Which layer kinds, with which options and prefixes.
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan>;

    /// The `config.json` keys its typed config reads (for the generated
    /// `docs/architectures.md`; [`crate::config::struct_fields`] gives them
    /// for a serde struct). Layer kinds may read more.
    fn config_keys(&self) -> Vec<String> {
        Vec::new()
    }

    /// The spec it was built from, as a TOML table (the start of another
    /// spec's `extends`); `None` for an architecture written in Rust.
    fn spec_table(&self) -> Option<&toml::Table> {
        None
    }

    /// Translates checkpoint names/layouts into the naming the plan uses
    /// (drops unused tensors, fixes conv axis order, norm offsets, ...).
    /// `config` is the top-level config.
    fn sanitize(&self, _config: &ModelConfig, _weights: &mut WeightMap) -> Result<()> {
        Ok(())
    }
}
