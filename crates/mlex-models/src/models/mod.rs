//! The architectures, one file per `model_type`, each registering itself.
//! Shared here: the plan of a plain decoder stack and the weight-translation
//! steps several `sanitize`s use.

pub mod dhara_ar;
pub mod llama;
pub mod nemotron_h;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod qwen3_next;

use mlex_core::arch::{HeadPlan, LayerPlan, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::{Error, Result};
use mlex_core::weights::WeightMap;
use mlx_rs::ops;
use serde_json::Value;

/// The keys of a typed config, for [`Architecture::config_keys`].
///
/// [`Architecture::config_keys`]: mlex_core::arch::Architecture::config_keys
pub(crate) fn config_keys<T: serde::de::DeserializeOwned>() -> Vec<String> {
    mlex_core::config::struct_fields::<T>()
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
}

/// The plan of `{root}.embed_tokens`, `{root}.layers.{i}`, `{root}.norm`
/// and `lm_head` (or tied), the layout of llama-family checkpoints.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decoder_plan(
    root: &str,
    head_prefix: &str,
    vocab_size: i32,
    hidden_size: i32,
    norm_eps: f32,
    tie: bool,
    layers: Vec<(String, Value)>,
    max_context: Option<usize>,
) -> ModelPlan {
    ModelPlan {
        vocab_size,
        hidden_size,
        embed: format!("{root}.embed_tokens"),
        layers: layers
            .into_iter()
            .enumerate()
            .map(|(i, (kind, options))| LayerPlan {
                kind,
                prefix: format!("{root}.layers.{i}"),
                options,
            })
            .collect(),
        final_norm: format!("{root}.norm"),
        norm_eps,
        head: if tie {
            HeadPlan::Tied
        } else {
            HeadPlan::Linear(head_prefix.to_owned())
        },
        logit_softcap: None,
        max_context,
    }
}

/// Drops a checkpoint's `lm_head` when the config ties it to the embedding
/// (`tie_word_embeddings`, with the architecture's default when absent).
pub(crate) fn drop_tied_head(
    config: &ModelConfig,
    weights: &mut WeightMap,
    default: bool,
) -> Result<()> {
    let tie = config
        .value()
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(default);
    if tie {
        drop_prefix(weights, "lm_head")?;
    }
    Ok(())
}

/// Drops every tensor under `prefix` (e.g. a tied `lm_head`).
pub(crate) fn drop_prefix(weights: &mut WeightMap, prefix: &str) -> Result<()> {
    let p = format!("{prefix}.");
    weights.rename_all(|n| (!n.starts_with(&p) && n != prefix).then(|| n.to_owned()))
}

/// Drops tensors whose name satisfies `pred`.
pub(crate) fn drop_where(weights: &mut WeightMap, pred: impl Fn(&str) -> bool) -> Result<()> {
    weights.rename_all(|n| (!pred(n)).then(|| n.to_owned()))
}

/// PyTorch conv weights `[C, 1, K]` → MLX `[C, K, 1]` for every tensor
/// named `*{marker}*weight` whose last axis is not 1 (mlx-lm's rule).
pub(crate) fn conv_to_mlx(weights: &mut WeightMap, marker: &str) -> Result<()> {
    weights.update_where(
        |n, a| n.contains(marker) && n.ends_with("weight") && a.ndim() == 3 && a.shape()[2] != 1,
        |a| Ok(ops::move_axis(a, 2, 1)?),
    )
}

/// True when some `*{marker}*weight` still has the PyTorch layout.
pub(crate) fn has_torch_conv(weights: &WeightMap, marker: &str) -> bool {
    weights.names().iter().any(|n| {
        n.contains(marker)
            && n.ends_with("weight")
            && weights
                .get(n)
                .is_some_and(|a| a.ndim() == 3 && a.shape()[2] != 1)
    })
}

/// Adds 1 to 1-D norm weights stored as offsets (HF Qwen3-Next/3.5).
pub(crate) fn norm_plus_one(weights: &mut WeightMap, suffixes: &[&str]) -> Result<()> {
    weights.update_where(
        |n, a| a.ndim() == 1 && suffixes.iter().any(|s| n.ends_with(s)),
        |a| Ok(ops::add(a, mlex_core::nn::scalar(1.0, a.dtype())?)?),
    )
}

/// Stacks per-expert weights `{prefix}.experts.{e}.{from}.weight` into
/// `{prefix}.switch_mlp.{to}.weight` (`[E, out, in]`).
pub(crate) fn stack_experts(
    weights: &mut WeightMap,
    prefix: &str,
    experts: usize,
    names: &[(&str, &str)],
) -> Result<()> {
    for (from, to) in names {
        let first = format!("{prefix}.experts.0.{from}.weight");
        if !weights.contains(&first) {
            continue;
        }
        let mut parts = Vec::with_capacity(experts);
        let mut file = 0;
        for e in 0..experts {
            let name = format!("{prefix}.experts.{e}.{from}.weight");
            let (a, f) = weights.remove(&name).ok_or_else(|| Error::MissingTensor {
                name: name.clone(),
                files: weights.files().to_vec(),
            })?;
            file = f;
            parts.push(a);
        }
        weights.insert(
            format!("{prefix}.switch_mlp.{to}.weight"),
            ops::stack(&parts, 0)?,
            file,
        );
    }
    Ok(())
}
