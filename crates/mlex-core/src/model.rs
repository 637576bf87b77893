//! The runnable model every architecture produces: embedding, a stack of
//! layers from registered kinds, final norm, output head.
//!
//! The eager forward pass here is the reference path: prefill, the full
//! forward of `mlex logits`, and what compiled decode must equal.

use crate::arch::{Architecture, HeadPlan, ModelPlan};
use crate::cache::Cache;
use crate::config::ModelConfig;
use crate::dispatch::Dispatch;
use crate::error::{Error, Result, ResultExt};
use crate::layer::{BuildCtx, Layer, State};
use crate::nn::{Embedding, Linear, Norm};
use crate::params::{ParamId, ParamStore, Params};
use crate::quant::Quantization;
use crate::registry::Registry;
use crate::weights::{WeightLoader, WeightMap};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use std::sync::Arc;

mod caches;

pub use caches::{
    advance_fixed, gather_state, scatter_state, CacheMark, ModelCache, PositionStates,
};

/// The output projection.
#[derive(Clone, Debug)]
pub enum Head {
    /// `x @ embedding^T`.
    Tied(Embedding),
    /// A separate linear layer.
    Linear(Linear),
    /// A separate linear layer split by vocabulary across the ranks of
    /// `--tp` (its rows; the logits gathered).
    SplitLinear(Linear, crate::distributed::Shard),
}

/// Final norm, output projection and optional soft-cap: hidden states to
/// logits. Holds only ids, so compiled segments can own a copy.
#[derive(Clone, Debug)]
pub struct OutputHead {
    /// Final norm.
    pub norm: Norm,
    /// Projection.
    pub head: Head,
    /// `c * tanh(logits / c)` when set.
    pub softcap: Option<f32>,
    /// Logits divided by this (Granite's `logits_scaling`), before the
    /// soft-cap.
    pub divisor: Option<f32>,
}

impl OutputHead {
    /// Weights read by [`OutputHead::forward`].
    pub fn params(&self) -> Vec<ParamId> {
        let mut v = self.norm.params();
        match &self.head {
            Head::Tied(e) => v.extend(e.params()),
            Head::Linear(l) | Head::SplitLinear(l, _) => v.extend(l.params()),
        }
        v
    }

    /// Hidden states → logits.
    pub fn forward(&self, p: &Params, x: &Array) -> Result<Array> {
        self.project(p, &self.norm.forward(p, x)?)
    }

    /// Hidden states → (logits, the states after the final norm: what a
    /// multi-token-prediction head reads).
    pub fn forward_with_normed(&self, p: &Params, x: &Array) -> Result<(Array, Array)> {
        let h = self.norm.forward(p, x)?;
        Ok((self.project(p, &h)?, h))
    }

    /// States after the final norm → logits (projection, scaling,
    /// soft-cap).
    pub fn project(&self, p: &Params, h: &Array) -> Result<Array> {
        let h = h.clone();
        let mut out = match &self.head {
            Head::Tied(e) => e.as_linear(p, &h)?,
            Head::Linear(l) => l.forward(p, &h)?,
            Head::SplitLinear(l, shard) => crate::nn::gather_vocab(shard, &l.forward(p, &h)?)?,
        };
        if let Some(d) = self.divisor {
            out = ops::divide(&out, crate::nn::scalar(d, out.dtype())?)?;
        }
        if let Some(c) = self.softcap {
            let cc = crate::nn::scalar(c, out.dtype())?;
            out = ops::multiply(ops::tanh(ops::divide(&out, &cc)?)?, &cc)?;
        }
        Ok(out)
    }
}

/// One layer and its place in the stack.
pub struct LayerSlot {
    /// The layer's name in the plan (the spec's `attention`, `mamba2`, ...).
    pub kind: String,
    /// The weight prefix.
    pub prefix: String,
    /// The built layer.
    pub layer: Arc<dyn Layer>,
}

/// A loaded model.
pub struct Model {
    /// The `model_type`.
    pub arch: String,
    /// The text config the layers were built from.
    pub config: ModelConfig,
    /// All weights.
    pub params: ParamStore,
    /// Token embedding.
    pub embed: Embedding,
    /// The layer stack.
    pub layers: Vec<LayerSlot>,
    /// Final norm, head, soft-cap.
    pub output: OutputHead,
    /// Activation dtype.
    pub dtype: Dtype,
    /// Context limit from the config, if any.
    pub max_context: Option<usize>,
    /// The checkpoint's quantization.
    pub quantization: Quantization,
    /// The backend policy it was built with (and that decode and prefill
    /// follow).
    pub dispatch: Dispatch,
    /// The multi-token-prediction head, when loaded ([`Model::build_with`]).
    pub mtp: Option<crate::mtp::MtpHead>,
    /// Quantized keys and values in the caches [`Model::make_cache`] makes
    /// (`--kv-bits`; `None`: full precision).
    pub kv_quantization: Option<crate::cache::KvQuantization>,
    /// At most this many tokens in each full-attention KV cache
    /// [`Model::make_cache`] makes, rotating (`--max-kv-size`; `None`:
    /// unbounded). Sliding-window layers keep their own window.
    pub max_kv_size: Option<usize>,
}

impl Model {
    /// Builds a model: the architecture's config lifting, sanitize and plan,
    /// then every layer from its registered kind; loading is strict. A
    /// multi-token-prediction head the checkpoint holds is left out.
    pub fn build(
        arch: &dyn Architecture,
        raw_config: &ModelConfig,
        weights: WeightMap,
        registry: &Registry,
        dispatch: &Dispatch,
    ) -> Result<Model> {
        Self::build_with(arch, raw_config, weights, registry, dispatch, false)
    }

    /// [`Model::build`], with the multi-token-prediction head when `mtp`
    /// (an error naming `--mtp` when the architecture has none or the
    /// checkpoint holds none of its weights).
    pub fn build_with(
        arch: &dyn Architecture,
        raw_config: &ModelConfig,
        mut weights: WeightMap,
        registry: &Registry,
        dispatch: &Dispatch,
        mtp: bool,
    ) -> Result<Model> {
        let config = arch.text_config(raw_config)?;
        let quantization = Quantization::from_config(raw_config)?;
        arch.sanitize(raw_config, &mut weights)?;
        let plan = arch.plan(&config)?;
        if let Some(m) = plan.mtp.as_ref().filter(|_| !mtp) {
            let p = format!("{}.", m.prefix);
            weights.rename_all(|n| (!n.starts_with(&p)).then(|| n.to_owned()))?;
        }
        if mtp {
            let file = raw_config.file().display();
            let m = plan.mtp.as_ref().filter(|m| !m.layers.is_empty()).ok_or_else(|| {
                Error::invalid(
                    "--mtp",
                    format!(
                        "{file}: this `{}` model has no multi-token-prediction head (its architecture \
                         has none, or its config sets no MTP layers)",
                        arch.name()
                    ),
                )
            })?;
            if !weights.contains(&format!("{}.fc.weight", m.prefix)) {
                return Err(Error::invalid(
                    "--mtp",
                    format!(
                        "{file} holds no multi-token-prediction weights (`{}.fc.weight` and the \
                         rest); mlx-lm's conversions and GGUFs converted before llama.cpp kept the `nextn` \
                         block drop them: use the Hugging Face checkpoint or a newer GGUF",
                        m.prefix
                    ),
                ));
            }
        }
        Self::build_from_plan(
            arch.name(),
            config,
            plan,
            weights,
            quantization,
            registry,
            dispatch,
        )
    }

    /// Builds a model from an explicit plan (sanitized weights).
    pub fn build_from_plan(
        arch: &str,
        config: ModelConfig,
        plan: ModelPlan,
        weights: WeightMap,
        quantization: Quantization,
        registry: &Registry,
        dispatch: &Dispatch,
    ) -> Result<Model> {
        for (key, v) in [
            ("vocab_size", plan.vocab_size),
            ("hidden_size", plan.hidden_size),
        ] {
            crate::config::count(i64::from(v)).map_err(|m| config.error(key, m))?;
        }
        let mut ld = WeightLoader::with_dispatch(weights, quantization.clone(), dispatch.clone());
        let mut embed = Embedding::load(&mut ld, &plan.embed, plan.vocab_size, plan.hidden_size)?;
        embed.scale = plan.embedding_multiplier;
        let mut layers = Vec::with_capacity(plan.layers.len());
        for (index, lp) in plan.layers.iter().enumerate() {
            let kind = registry.layer_kind(&lp.kind).map_err(|e| match e {
                Error::UnknownLayerKind { kind, known, .. } => Error::UnknownLayerKind {
                    kind,
                    context: Some(format!("layer {index} of `{arch}`")),
                    known,
                },
                e => e,
            })?;
            let mut ctx = BuildCtx {
                config: &config,
                index,
                prefix: lp.prefix.clone(),
                options: &lp.options,
                weights: &mut ld,
                registry,
            };
            let layer = kind.build(&mut ctx)?;
            if let Some(shard) = &dispatch.tensor_parallel {
                shard.check_built(index, lp, arch, &*layer)?;
            }
            layers.push(LayerSlot {
                kind: lp.name.clone(),
                prefix: lp.prefix.clone(),
                layer: Arc::from(layer),
            });
        }
        let norm = Norm::load(
            plan.norm_type,
            &mut ld,
            &plan.final_norm,
            plan.hidden_size,
            plan.norm_eps,
        )?;
        let head = match &plan.head {
            HeadPlan::Tied => Head::Tied(embed.clone()),
            HeadPlan::Linear(prefix) => {
                let load = |ld: &mut WeightLoader, rows: i32| {
                    Linear::load(ld, prefix, plan.hidden_size, rows, false)
                };
                // Under --tp split by vocabulary (as mlx-lm shards an untied
                // head) when the ranks divide it.
                match dispatch
                    .tensor_parallel
                    .as_ref()
                    .filter(|s| (plan.vocab_size as usize).is_multiple_of(s.size()))
                {
                    Some(shard) => {
                        let rows = plan.vocab_size / shard.size() as i32;
                        let l =
                            ld.with_split(crate::distributed::Split::Output, |ld| load(ld, rows))?;
                        Head::SplitLinear(l, shard.clone())
                    }
                    None => Head::Linear(load(&mut ld, plan.vocab_size)?),
                }
            }
        };
        let mtp = match &plan.mtp {
            Some(m) if !m.layers.is_empty() && ld.has(&format!("{}.fc.weight", m.prefix)) => {
                Some(crate::mtp::MtpHead::build(
                    m,
                    &mut ld,
                    &config,
                    registry,
                    (plan.hidden_size, plan.norm_eps, plan.norm_type),
                )?)
            }
            _ => None,
        };
        let params = ld.finish()?;
        let dtype = embed.dtype(&params.view())?;
        Ok(Model {
            arch: arch.to_owned(),
            config,
            params,
            embed,
            layers,
            output: OutputHead {
                norm,
                head,
                softcap: plan.logit_softcap,
                divisor: plan.logits_scaling,
            },
            dtype,
            max_context: plan.max_context,
            quantization,
            dispatch: dispatch.clone(),
            mtp,
            kv_quantization: None,
            max_kv_size: None,
        })
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> i32 {
        self.embed.vocab
    }

    /// Fresh caches for `batch` sequences.
    pub fn make_cache(&self, batch: usize) -> Result<ModelCache> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for slot in &self.layers {
            let mut caches = slot.layer.make_caches(batch, self.dtype)?;
            if let Some(max) = self.max_kv_size {
                let max = crate::cache::check_max_kv_size(max)?;
                caches = caches
                    .into_iter()
                    .map(|c| c.with_max_kv_size(max).unwrap_or(c))
                    .collect();
            }
            if let Some(q) = self.kv_quantization {
                caches = caches
                    .into_iter()
                    .map(|c| c.with_kv_quantization(q).unwrap_or(c))
                    .collect();
            }
            layers.push(caches);
        }
        Ok(ModelCache { layers })
    }

    /// `tokens` (`[B, T]` int) → hidden states `[B, T, D]`.
    pub fn embed_tokens(&self, p: &Params, tokens: &Array) -> Result<Array> {
        self.embed.forward(p, tokens).ctx(|| "embedding".into())
    }

    /// Hidden states → logits (final norm, head, soft-cap).
    pub fn logits(&self, p: &Params, x: &Array) -> Result<Array> {
        self.output.forward(p, x).ctx(|| "output head".into())
    }

    /// Runs layer `i` eagerly on `x` with its caches.
    pub fn run_layer(
        &self,
        p: &Params,
        i: usize,
        x: &Array,
        caches: &mut [Box<dyn Cache>],
    ) -> Result<Array> {
        let tokens = x.shape()[1] as usize;
        let mut state = gather_state(caches);
        let y = self.run_phases(p, i, x, caches, &mut State::new(&mut state))?;
        scatter_state(caches, state)?;
        advance_fixed(caches, tokens);
        Ok(y)
    }

    /// Layer `i`'s three phases on `x`: the growing cache written, the
    /// fixed-size state threaded through `state`.
    fn run_phases(
        &self,
        p: &Params,
        i: usize,
        x: &Array,
        caches: &mut [Box<dyn Cache>],
        state: &mut State<'_>,
    ) -> Result<Array> {
        let layer = &self.layers[i].layer;
        let ctx = || format!("layer {i} ({})", self.layers[i].kind);
        let carry = layer.before_cache(p, x, state).ctx(ctx)?;
        let carry = if layer.grows() {
            let kv = caches
                .iter_mut()
                .find(|c| c.grows())
                .ok_or_else(|| Error::Cache(format!("{} has no growing cache", ctx())))?;
            layer.grow(p, carry, kv.as_mut()).ctx(ctx)?
        } else {
            carry
        };
        layer.after_cache(p, carry, state).ctx(ctx)
    }

    /// The verify forward of speculative decoding: logits of every
    /// position of `tokens` (`[B, T]`), `[B, T, V]`. Growing caches take
    /// all `T` tokens; fixed-size caches stay as they were, and their state
    /// after each position comes back in the [`PositionStates`], for
    /// [`ModelCache::commit`] to keep the accepted prefix.
    pub fn verify(
        &self,
        tokens: &Array,
        cache: &mut ModelCache,
    ) -> Result<(Array, PositionStates)> {
        self.verify_normed(tokens, cache)
            .map(|(logits, _, states)| (logits, states))
    }

    /// [`Model::verify`], with the states after the final norm `[B, T, D]`
    /// (what a multi-token-prediction head reads).
    pub fn verify_normed(
        &self,
        tokens: &Array,
        cache: &mut ModelCache,
    ) -> Result<(Array, Array, PositionStates)> {
        self.check_cache(cache)?;
        let p = self.params.view();
        let mut x = self.embed_tokens(&p, tokens)?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (i, caches) in cache.layers.iter_mut().enumerate() {
            let mut state = gather_state(caches);
            x = self.run_phases(&p, i, &x, caches, &mut State::per_position(&mut state))?;
            layers.push(state);
        }
        let tokens = tokens.shape()[1] as usize;
        let (logits, normed) = self.output.forward_with_normed(&p, &x)?;
        Ok((logits, normed, PositionStates::new(layers, tokens)))
    }

    fn check_cache(&self, cache: &ModelCache) -> Result<()> {
        if cache.layers.len() != self.layers.len() {
            return Err(Error::Cache(format!(
                "cache has {} layers, model has {}",
                cache.layers.len(),
                self.layers.len()
            )));
        }
        Ok(())
    }

    /// Hidden states after the last layer (before the final norm) for
    /// `tokens` `[B, T]`, updating `cache`.
    pub fn forward_hidden(&self, tokens: &Array, cache: &mut ModelCache) -> Result<Array> {
        self.check_cache(cache)?;
        let p = self.params.view();
        let mut x = self.embed_tokens(&p, tokens)?;
        let shape = tokens.shape();
        let sync = self
            .dispatch
            .syncs_layers(shape[0] as usize, shape[shape.len() - 1] as usize);
        let mut in_flight: Option<Array> = None;
        for (i, caches) in cache.layers.iter_mut().enumerate() {
            x = self.run_layer(&p, i, &x, caches)?;
            if sync {
                // One layer in flight ([`Dispatch::layer_sync_rows`]): the
                // layer's output and new fixed-size state go to MLX now
                // (the KV writes are inputs of the output), and the host
                // waits for the layer before it.
                let mut layer = vec![x.clone()];
                layer.extend(caches.iter().flat_map(|c| c.state()));
                mlx_rs::transforms::async_eval(layer.iter())?;
                if let Some(before) = in_flight.replace(x.clone()) {
                    before.eval()?;
                }
            }
        }
        Ok(x)
    }

    /// Logits of every position, `[B, T, V]`.
    pub fn forward(&self, tokens: &Array, cache: &mut ModelCache) -> Result<Array> {
        let x = self.forward_hidden(tokens, cache)?;
        self.logits(&self.params.view(), &x)
    }

    /// Logits of the last position only, `[B, V]` (prefill for generation).
    pub fn forward_last(&self, tokens: &Array, cache: &mut ModelCache) -> Result<Array> {
        let x = self.forward_hidden(tokens, cache)?;
        let t = x.shape()[1];
        let last = x.index_last(t)?;
        let logits = self.logits(&self.params.view(), &last)?;
        Ok(ops::squeeze_axes(&logits, &[1])?)
    }

    /// Replaces the weight called `name` (same shape and dtype). Compiled
    /// traces built before see the new value on their next call. `name` is
    /// the store's: projections fused at load go by their fused name
    /// (`...q_proj+k_proj+v_proj.weight`, [`crate::nn::fused_name`]).
    pub fn update_weight(&mut self, name: &str, array: Array) -> Result<()> {
        let id = self.params.find(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_owned(),
            files: vec![],
            nearest: Vec::new(),
        })?;
        self.params.set(id, array)
    }

    /// Parameter count (elements; packed quantized weights count as stored).
    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(|(_, a)| a.size()).sum()
    }
}

/// Slicing helpers on [`Array`] used across the engine.
pub trait ArrayExt {
    /// `x[:, t-1:t, :]` of a `[B, T, D]` array.
    fn index_last(&self, t: i32) -> Result<Array>;
}

impl ArrayExt for Array {
    fn index_last(&self, t: i32) -> Result<Array> {
        Ok(self.try_index((.., (t - 1)..t, ..))?)
    }
}
