//! Single-token decode through compiled segments.
//!
//! One decode step, for a hybrid model:
//!
//! ```text
//! token → [segment 0: embed, layers without growing cache..., attention a before its cache]
//!       → eager: RoPE at the cache offset, KV write, SDPA (grow of a)
//!       → [segment 1: a after its cache (o_proj, residual, MLP), ..., b before its cache]
//!       → ... → [last segment: ..., final norm, lm_head] → logits
//! ```
//!
//! Each segment is a [`CompiledTrace`] whose inputs are, in order: the carry
//! from the previous step (the token ids for segment 0), the fixed-size
//! state of every layer it touches, and every weight it reads. Its outputs
//! are the new carry and the new state. Weights enter as inputs, so a
//! weight update is seen by the next call without recompiling; a change of
//! weight *structure* (another model, quantization) rebuilds the traces.

use crate::schedule::{Phase, Schedule, Step};
use crate::trace::CompiledTrace;
use mlex_core::error::{Error, Result};
use mlex_core::layer::{Layer, State};
use mlex_core::model::{
    advance_fixed, gather_state, scatter_state, Model, ModelCache, OutputHead, PositionStates,
};
use mlex_core::nn::Embedding;
use mlex_core::params::{ParamId, Params};
use mlx_rs::error::Exception;
use mlx_rs::{ops, Array};
use std::sync::Arc;

/// What one segment's compiled function needs, owned (no arrays).
#[derive(Clone)]
struct SegmentFn {
    phases: Vec<Phase>,
    embed: Embedding,
    output: OutputHead,
    layers: Vec<(usize, Arc<dyn Layer>)>,
    /// Per touched layer: how many state arrays.
    state_counts: Vec<usize>,
    n_carry: usize,
    param_ids: Vec<ParamId>,
    n_params_total: usize,
    /// A verify trace: state leaves with one entry per position.
    per_position: bool,
}

impl SegmentFn {
    fn run(&self, inputs: &[Array]) -> std::result::Result<Vec<Array>, Exception> {
        let n_state: usize = self.state_counts.iter().sum();
        if inputs.len() != self.n_carry + n_state + self.param_ids.len() {
            return Err(Exception::custom(
                "compiled segment called with the wrong inputs",
            ));
        }
        let mut carry: Vec<Array> = inputs[..self.n_carry].to_vec();
        let mut states: Vec<Vec<Array>> = Vec::with_capacity(self.state_counts.len());
        let mut at = self.n_carry;
        for &n in &self.state_counts {
            states.push(inputs[at..at + n].to_vec());
            at += n;
        }
        let mut slots: Vec<Option<Array>> = vec![None; self.n_params_total];
        for (id, a) in self.param_ids.iter().zip(&inputs[at..]) {
            slots[id.index()] = Some(a.clone());
        }
        let p = Params::overlay(&slots);
        let slot_of = |i: usize| {
            self.layers
                .iter()
                .position(|(l, _)| *l == i)
                .expect("touched")
        };
        carry = run_phases(
            &self.phases,
            &p,
            &self.embed,
            &self.output,
            |i| self.layers[slot_of(i)].1.as_ref(),
            slot_of,
            &mut states,
            self.per_position,
            carry,
        )?;
        let mut out = carry;
        out.extend(states.into_iter().flatten());
        Ok(out)
    }
}

/// Which segments to compile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CompilePolicy {
    /// Compile every segment.
    #[default]
    All,
    /// Compile only the segments that hold a layer with fixed-size
    /// (recurrent) state, where fusing many small ops pays most; run the
    /// others (an attention layer's part after its cache write and the next
    /// one's part before) eagerly, saving the
    /// compiled call's overhead. Measured against `All` in
    /// docs/BENCHMARKS.md.
    Recurrent,
}

/// One segment's static plan.
struct SegmentPlan {
    phases: Vec<Phase>,
    touched: Vec<usize>,
    param_ids: Vec<ParamId>,
    compiled: bool,
}

/// Runs a model's single-token decode step, and the verify forward of
/// speculative decoding, through compiled segments.
pub struct SegmentedDecoder {
    schedule: Schedule,
    policy: CompilePolicy,
    plans: Vec<SegmentPlan>,
    key: u64,
    traces: Vec<CompiledTrace>,
    /// The verify forward's traces, one per segment: MLX keeps one trace
    /// per input shape under each, so every `T` is traced once.
    verify_traces: Vec<CompiledTrace>,
}

/// Where a segment's fixed-size state comes from and goes to.
enum StateFlow<'a> {
    /// A decode step: read from the cache, written back to it.
    Cache,
    /// A verify forward: read from the cache the first time a layer is
    /// touched, then from `states` (a layer cut by its growing cache is
    /// touched twice), which ends with every layer's state per position.
    Positions(&'a mut [Option<Vec<Array>>]),
}

impl StateFlow<'_> {
    fn read(&self, cache: &ModelCache, i: usize) -> Vec<Array> {
        match self {
            StateFlow::Positions(s) => s[i].clone(),
            StateFlow::Cache => None,
        }
        .unwrap_or_else(|| gather_state(&cache.layers[i]))
    }

    fn write(&mut self, cache: &mut ModelCache, i: usize, state: Vec<Array>) -> Result<()> {
        match self {
            StateFlow::Cache => scatter_state(&mut cache.layers[i], state),
            StateFlow::Positions(s) => {
                s[i] = Some(state);
                Ok(())
            }
        }
    }

    fn per_position(&self) -> bool {
        matches!(self, StateFlow::Positions(_))
    }
}

/// What identifies the weight structure a trace was built for.
fn structure_key(model: &Model) -> u64 {
    // The store's generation changes on every structural edit (new
    // tensors); values set in place keep shapes and flow in as inputs, so
    // they do not need a new trace. Combine with the tensor count so two
    // stores never alias.
    model.params.structure_generation() ^ ((model.params.len() as u64) << 48)
}

fn plans(model: &Model, schedule: &Schedule, policy: CompilePolicy) -> Result<Vec<SegmentPlan>> {
    let mut has_state = Vec::with_capacity(model.layers.len());
    for slot in &model.layers {
        let caches = slot.layer.make_caches(1, model.dtype)?;
        has_state.push(caches.iter().any(|c| !c.grows()));
    }
    Ok(schedule
        .segments()
        .map(|phases| {
            let touched = Schedule::layers_of(phases);
            let mut param_ids: Vec<ParamId> = Vec::new();
            if phases.contains(&Phase::Embed) {
                param_ids.extend(model.embed.params());
            }
            if phases.contains(&Phase::Logits) {
                param_ids.extend(model.output.params());
            }
            for &i in &touched {
                param_ids.extend(model.layers[i].layer.params());
            }
            param_ids.sort();
            param_ids.dedup();
            let compiled = match policy {
                CompilePolicy::All => true,
                CompilePolicy::Recurrent => touched.iter().any(|&i| has_state[i]),
            };
            SegmentPlan {
                phases: phases.to_vec(),
                touched,
                param_ids,
                compiled,
            }
        })
        .collect())
}

impl SegmentedDecoder {
    /// The decoder for `model`'s layer plan, compiling every segment.
    pub fn new(model: &Model) -> Self {
        Self::with_policy(model, CompilePolicy::default())
    }

    /// The decoder for `model` with an explicit policy.
    pub fn with_policy(model: &Model, policy: CompilePolicy) -> Self {
        let grows: Vec<bool> = model.layers.iter().map(|s| s.layer.grows()).collect();
        let schedule = Schedule::new(&grows);
        let traces = |_| CompiledTrace::new();
        Self {
            policy,
            plans: Vec::new(),
            key: 0,
            traces: (0..schedule.num_segments()).map(traces).collect(),
            verify_traces: (0..schedule.num_segments()).map(traces).collect(),
            schedule,
        }
    }

    /// The schedule in use.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Which segments run compiled (valid after the first step).
    pub fn compiled_segments(&self) -> Vec<bool> {
        self.plans.iter().map(|p| p.compiled).collect()
    }

    /// How often each segment has been traced.
    pub fn times_traced(&self) -> Vec<usize> {
        self.traces
            .iter()
            .map(CompiledTrace::times_traced)
            .collect()
    }

    /// How often each segment's verify trace has been traced (once per
    /// verified length `T` when it compiles).
    pub fn verify_times_traced(&self) -> Vec<usize> {
        self.verify_traces
            .iter()
            .map(CompiledTrace::times_traced)
            .collect()
    }

    /// One decode step: `tokens` `[B, 1]` → logits `[B, V]`; updates `cache`.
    pub fn step(&mut self, model: &Model, tokens: &Array, cache: &mut ModelCache) -> Result<Array> {
        if tokens.ndim() != 2 || tokens.shape()[1] != 1 {
            return Err(Error::invalid(
                "tokens",
                format!(
                    "compiled decode takes [B, 1] tokens, got {:?}",
                    tokens.shape()
                ),
            ));
        }
        let logits = self
            .run(model, tokens, cache, StateFlow::Cache)?
            .swap_remove(0);
        for caches in cache.layers.iter_mut() {
            advance_fixed(caches, 1);
        }
        Ok(ops::squeeze_axes(&logits, &[1])?)
    }

    /// The verify forward of speculative decoding ([`Model::verify`]),
    /// through the same segments: `tokens` `[B, T]` → logits `[B, T, V]`
    /// and the fixed-size state after every position, for
    /// [`ModelCache::commit`]. Growing caches take all `T` tokens.
    pub fn verify(
        &mut self,
        model: &Model,
        tokens: &Array,
        cache: &mut ModelCache,
    ) -> Result<(Array, PositionStates)> {
        self.verify_normed(model, tokens, cache)
            .map(|(logits, _, states)| (logits, states))
    }

    /// [`SegmentedDecoder::verify`], with the states after the final norm
    /// `[B, T, D]` (what a multi-token-prediction head reads).
    pub fn verify_normed(
        &mut self,
        model: &Model,
        tokens: &Array,
        cache: &mut ModelCache,
    ) -> Result<(Array, Array, PositionStates)> {
        if tokens.ndim() != 2 || tokens.shape()[1] < 1 {
            return Err(Error::invalid(
                "tokens",
                format!("verify takes [B, T] tokens, got {:?}", tokens.shape()),
            ));
        }
        let mut states: Vec<Option<Vec<Array>>> = vec![None; model.layers.len()];
        let mut out = self.run(model, tokens, cache, StateFlow::Positions(&mut states))?;
        let layers = states.into_iter().map(Option::unwrap_or_default).collect();
        let t = tokens.shape()[1] as usize;
        if out.len() != 2 {
            return Err(Error::Other("a verify gave no normed states".into()));
        }
        let normed = out.pop().expect("two outputs");
        let logits = out.pop().expect("two outputs");
        Ok((logits, normed, PositionStates::new(layers, t)))
    }

    /// Runs the schedule over `tokens`: the last segment's outputs (the
    /// logits of every position; in a verify, the normed states after).
    fn run(
        &mut self,
        model: &Model,
        tokens: &Array,
        cache: &mut ModelCache,
        mut flow: StateFlow<'_>,
    ) -> Result<Vec<Array>> {
        if cache.layers.len() != model.layers.len() {
            return Err(Error::Cache("cache does not match the model".into()));
        }
        let key = structure_key(model);
        if self.key != key || self.plans.is_empty() {
            self.plans = plans(model, &self.schedule, self.policy)?;
            self.key = key;
        }
        let traces = if flow.per_position() {
            &mut self.verify_traces
        } else {
            &mut self.traces
        };
        let eager = model.params.view();
        let mut carry: Vec<Array> = vec![tokens.clone()];
        let mut seg = 0;
        for step in &self.schedule.steps {
            match step {
                Step::Grow(i) => {
                    let layer = &model.layers[*i].layer;
                    let kv = cache.layers[*i]
                        .iter_mut()
                        .find(|c| c.grows())
                        .ok_or_else(|| Error::Cache(format!("layer {i} has no growing cache")))?;
                    carry = layer.grow(&eager, carry, kv.as_mut())?;
                }
                Step::Segment(_) => {
                    let plan = &self.plans[seg];
                    carry = if plan.compiled {
                        run_compiled(&mut traces[seg], plan, key, model, carry, cache, &mut flow)?
                    } else {
                        run_eager(plan, model, carry, cache, &mut flow)?
                    };
                    seg += 1;
                }
            }
        }
        if carry.is_empty() {
            return Err(Error::Other("decode produced no logits".into()));
        }
        Ok(carry)
    }
}

/// The one interpreter of a segment's phases, run by its compiled trace
/// and by its eager fallback alike: `layer(i)` is layer `i` of the model,
/// and `states[slot(i)]` its fixed-size state.
#[allow(clippy::too_many_arguments)]
fn run_phases<'a>(
    phases: &[Phase],
    p: &Params,
    embed: &Embedding,
    output: &OutputHead,
    layer: impl Fn(usize) -> &'a dyn Layer,
    slot: impl Fn(usize) -> usize,
    states: &mut [Vec<Array>],
    per_position: bool,
    mut carry: Vec<Array>,
) -> Result<Vec<Array>> {
    for phase in phases {
        carry = match *phase {
            Phase::Embed => vec![embed.forward(p, &carry[0])?],
            Phase::BeforeCache(i) => layer(i).before_cache(
                p,
                &carry[0],
                &mut view(&mut states[slot(i)], per_position),
            )?,
            Phase::AfterCache(i) => {
                vec![layer(i).after_cache(
                    p,
                    carry,
                    &mut view(&mut states[slot(i)], per_position),
                )?]
            }
            // A verify also hands out the states after the final norm (a
            // multi-token-prediction head reads them).
            Phase::Logits if per_position => {
                let (logits, normed) = output.forward_with_normed(p, &carry[0])?;
                vec![logits, normed]
            }
            Phase::Logits => vec![output.forward(p, &carry[0])?],
        };
    }
    Ok(carry)
}

/// A layer's state as a phase sees it: per position in a verify run.
fn view(state: &mut [Array], per_position: bool) -> State<'_> {
    if per_position {
        State::per_position(state)
    } else {
        State::new(state)
    }
}

/// Runs a segment's phases eagerly (the same functions the trace runs).
fn run_eager(
    plan: &SegmentPlan,
    model: &Model,
    mut carry: Vec<Array>,
    cache: &mut ModelCache,
    flow: &mut StateFlow<'_>,
) -> Result<Vec<Array>> {
    let p = model.params.view();
    let mut states: Vec<Vec<Array>> = plan.touched.iter().map(|&i| flow.read(cache, i)).collect();
    let slot_of = |i: usize| plan.touched.iter().position(|l| *l == i).expect("touched");
    carry = run_phases(
        &plan.phases,
        &p,
        &model.embed,
        &model.output,
        |i| model.layers[i].layer.as_ref(),
        slot_of,
        &mut states,
        flow.per_position(),
        carry,
    )?;
    for (&i, s) in plan.touched.iter().zip(states) {
        flow.write(cache, i, s)?;
    }
    Ok(carry)
}

/// Runs a segment through its compiled trace.
#[allow(clippy::too_many_arguments)]
fn run_compiled(
    trace: &mut CompiledTrace,
    plan: &SegmentPlan,
    key: u64,
    model: &Model,
    carry: Vec<Array>,
    cache: &mut ModelCache,
    flow: &mut StateFlow<'_>,
) -> Result<Vec<Array>> {
    let n_carry = carry.len();
    let mut inputs = carry;
    let mut state_counts = Vec::with_capacity(plan.touched.len());
    for &i in &plan.touched {
        let s = flow.read(cache, i);
        state_counts.push(s.len());
        inputs.extend(s);
    }
    inputs.extend(
        plan.param_ids
            .iter()
            .map(|id| model.params.get(*id).clone()),
    );
    let n_state: usize = state_counts.iter().sum();
    let out = trace.call(key, &inputs, || {
        let f = SegmentFn {
            phases: plan.phases.clone(),
            embed: model.embed.clone(),
            output: model.output.clone(),
            layers: plan
                .touched
                .iter()
                .map(|&i| (i, model.layers[i].layer.clone()))
                .collect(),
            state_counts: state_counts.clone(),
            n_carry,
            param_ids: plan.param_ids.clone(),
            n_params_total: model.params.len(),
            per_position: flow.per_position(),
        };
        move |args: &[Array]| f.run(args)
    })?;
    let n_out_carry = out.len() - n_state;
    let mut it = out.into_iter();
    let carry = it.by_ref().take(n_out_carry).collect();
    for (&i, &n) in plan.touched.iter().zip(&state_counts) {
        let s: Vec<Array> = it.by_ref().take(n).collect();
        flow.write(cache, i, s)?;
    }
    Ok(carry)
}
