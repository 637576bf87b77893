//! The multi-token-prediction head of Qwen3-Next and Qwen3.5 checkpoints
//! (`mtp.*`, which mlx-lm drops), a drafter for speculative decoding:
//!
//! ```text
//! x      = fc(concat[pre_fc_norm_embedding(embed(t[j+1])), pre_fc_norm_hidden(h[j])])
//! y      = the head's decoder layers (copies of the trunk's full-attention block), own caches
//! normed = norm(y);  logits = the trunk's output projection of normed
//! ```
//!
//! `h[j]` is the trunk's hidden state at position `j` after its final norm
//! (what vLLM, SGLang and llama.cpp feed; the pre-norm state costs 15-35
//! points of acceptance in reports), and the row predicts `t[j+2]`. A
//! draft after the first feeds the previous row's `normed` back in place of
//! `h`, one position on. The embedding half comes first in `fc`'s input.
//! References: vLLM `qwen3_next_mtp.py`, llama.cpp `qwen35.cpp`
//! (`graph_mtp`); the check here is against a composition of mlx-lm's own
//! decoder layer (`xtask/py/mtp_ref.py`).

use crate::arch::MtpPlan;
use crate::cache::Cache;
use crate::error::{Error, Result, ResultExt};
use crate::layer::State;
use crate::model::{advance_fixed, gather_state, scatter_state, LayerSlot, Model};
use crate::nn::{Linear, Norm, NormKind};
use crate::registry::Registry;
use crate::weights::WeightLoader;
use mlx_rs::{ops, Array};
use std::sync::Arc;

/// The head, built from a checkpoint's `mtp.*` weights.
pub struct MtpHead {
    /// `[D, 2D]`: the normed embedding and hidden state, concatenated, to
    /// the layer's input.
    pub fc: Linear,
    /// Norm of the next token's embedding.
    pub norm_embedding: Norm,
    /// Norm of the hidden state.
    pub norm_hidden: Norm,
    /// The decoder layers.
    pub layers: Vec<LayerSlot>,
    /// The final norm before the shared output projection.
    pub norm: Norm,
}

impl MtpHead {
    /// Builds the head of `plan` from `ld` (the trunk's loader).
    pub(crate) fn build(
        plan: &MtpPlan,
        ld: &mut WeightLoader,
        config: &crate::config::ModelConfig,
        registry: &Registry,
        (hidden, eps, norm_type): (i32, f32, NormKind),
    ) -> Result<Self> {
        let p = &plan.prefix;
        let norm = |ld: &mut WeightLoader, name: &str| {
            Norm::load(norm_type, ld, &format!("{p}.{name}"), hidden, eps)
        };
        let norm_embedding = norm(ld, "pre_fc_norm_embedding")?;
        let norm_hidden = norm(ld, "pre_fc_norm_hidden")?;
        let fc = Linear::load(ld, &format!("{p}.fc"), 2 * hidden, hidden, false)?;
        let mut layers = Vec::with_capacity(plan.layers.len());
        for (index, lp) in plan.layers.iter().enumerate() {
            let kind = registry.layer_kind(&lp.kind)?;
            let mut ctx = crate::layer::BuildCtx {
                config,
                index,
                prefix: lp.prefix.clone(),
                options: &lp.options,
                weights: ld,
                registry,
            };
            let layer = kind.build(&mut ctx)?;
            // Under --tp the head's layers split as the trunk's do (heads,
            // experts' width; `fc` and the norms stay whole): every rank
            // drafts the same tokens, through the same collectives.
            if let Some(shard) = ld.shard() {
                shard.check_built(index, lp, "the MTP head", &*layer)?;
            }
            layers.push(LayerSlot {
                kind: lp.name.clone(),
                prefix: lp.prefix.clone(),
                layer: Arc::from(layer),
            });
        }
        Ok(Self {
            fc,
            norm_embedding,
            norm_hidden,
            layers,
            norm: norm(ld, "norm")?,
        })
    }

    /// Fresh caches of the head's layers for `batch` sequences.
    pub fn make_caches(&self, model: &Model, batch: usize) -> Result<Vec<Vec<Box<dyn Cache>>>> {
        self.layers
            .iter()
            .map(|s| s.layer.make_caches(batch, model.dtype))
            .collect()
    }
}

impl Model {
    /// The head's rows: `hidden` `[B, T, D]` (the trunk's normed states,
    /// or the head's own `normed` of the previous draft) with the tokens
    /// after them, `next` `[B, T]`, through the head's layers and `caches`
    /// (which take the `T` rows). Returns the logits `[B, T, V]` and the
    /// rows' `normed` states `[B, T, D]`.
    pub fn mtp_rows(
        &self,
        hidden: &Array,
        next: &Array,
        caches: &mut [Vec<Box<dyn Cache>>],
    ) -> Result<(Array, Array)> {
        let head = self.mtp.as_ref().ok_or_else(|| {
            Error::Other("the model was loaded without its multi-token-prediction head".into())
        })?;
        let p = self.params.view();
        let e = head
            .norm_embedding
            .forward(&p, &self.embed_tokens(&p, next)?)?;
        let h = head.norm_hidden.forward(&p, hidden)?;
        let mut x = head.fc.forward(&p, &ops::concatenate(&[e, h], -1)?)?;
        let tokens = x.shape()[1] as usize;
        for (i, (slot, caches)) in head.layers.iter().zip(caches.iter_mut()).enumerate() {
            let ctx = || format!("MTP layer {i} ({})", slot.kind);
            let mut state = gather_state(caches);
            let layer = &slot.layer;
            let mut st = State::new(&mut state);
            let carry = layer.before_cache(&p, &x, &mut st).ctx(ctx)?;
            let carry = if layer.grows() {
                let kv = caches
                    .iter_mut()
                    .find(|c| c.grows())
                    .ok_or_else(|| Error::Cache(format!("{} has no growing cache", ctx())))?;
                layer.grow(&p, carry, kv.as_mut()).ctx(ctx)?
            } else {
                carry
            };
            x = layer.after_cache(&p, carry, &mut st).ctx(ctx)?;
            scatter_state(caches, state)?;
            advance_fixed(caches, tokens);
        }
        let normed = head.norm.forward(&p, &x)?;
        let logits = self.output.project(&p, &normed)?;
        Ok((logits, normed))
    }
}
