//! The segment schedule: where the single-token decode graph is cut.
//!
//! Generalised from mlx-swift-lm's Qwen3.5 design to any plan of layer
//! kinds: a growing cache (attention KV) gains a row every token and cannot
//! be written inside an MLX compiled function, so each growing layer's
//! cache write (its *grow* phase: RoPE, KV write, SDPA) runs eagerly, and
//! everything between two grow phases is one compiled segment: the part
//! after the cache write of one growing layer, every non-growing layer in
//! between (recurrent, MLP-only, MoE), and the part before the cache write
//! of the next growing layer. The embedding
//! opens the first segment and the output head closes the last.
//!
//! Pure logic, testable without MLX.

/// A pure (compilable) phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Token embedding.
    Embed,
    /// Layer `i` up to its growing-cache write (or all of it).
    BeforeCache(usize),
    /// Layer `i` after its growing-cache write.
    AfterCache(usize),
    /// Final norm and output head.
    Logits,
}

/// One step of a decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// A compiled segment: consecutive pure phases.
    Segment(Vec<Phase>),
    /// The eager growing-cache phase of layer `i`.
    Grow(usize),
}

/// The decode step of a model, cut into segments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Segments and grow phases in execution order.
    pub steps: Vec<Step>,
}

impl Schedule {
    /// The schedule for layers whose caches grow (`true`) or not.
    pub fn new(grows: &[bool]) -> Self {
        let mut steps = Vec::new();
        let mut current = vec![Phase::Embed];
        for (i, &g) in grows.iter().enumerate() {
            current.push(Phase::BeforeCache(i));
            if g {
                steps.push(Step::Segment(std::mem::take(&mut current)));
                steps.push(Step::Grow(i));
            }
            current.push(Phase::AfterCache(i));
        }
        current.push(Phase::Logits);
        steps.push(Step::Segment(current));
        Self { steps }
    }

    /// The compiled segments, in order.
    pub fn segments(&self) -> impl Iterator<Item = &[Phase]> {
        self.steps.iter().filter_map(|s| match s {
            Step::Segment(p) => Some(p.as_slice()),
            Step::Grow(_) => None,
        })
    }

    /// Number of compiled segments.
    pub fn num_segments(&self) -> usize {
        self.segments().count()
    }

    /// The layers whose phases a segment contains, in order, each once.
    pub fn layers_of(phases: &[Phase]) -> Vec<usize> {
        let mut out: Vec<usize> = Vec::new();
        for p in phases {
            if let Phase::BeforeCache(i) | Phase::AfterCache(i) = p {
                if out.last() != Some(i) {
                    out.push(*i);
                }
            }
        }
        out
    }

    /// A compact rendering, e.g. `[E B0 A0 B1] G1 [A1 L]` (B: before the cache write, A: after).
    pub fn render(&self) -> String {
        self.steps
            .iter()
            .map(|s| match s {
                Step::Grow(i) => format!("G{i}"),
                Step::Segment(p) => format!(
                    "[{}]",
                    p.iter()
                        .map(|p| match p {
                            Phase::Embed => "E".to_owned(),
                            Phase::BeforeCache(i) => format!("B{i}"),
                            Phase::AfterCache(i) => format!("A{i}"),
                            Phase::Logits => "L".to_owned(),
                        })
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn flatten(s: &Schedule) -> Vec<String> {
        s.steps
            .iter()
            .flat_map(|st| match st {
                Step::Grow(i) => vec![format!("G{i}")],
                Step::Segment(p) => p.iter().map(|p| format!("{p:?}")).collect(),
            })
            .collect()
    }

    #[test]
    fn attention_only_model_has_one_segment_per_gap() {
        let s = Schedule::new(&[true, true]);
        assert_eq!(s.render(), "[E B0] G0 [A0 B1] G1 [A1 L]");
        assert_eq!(s.num_segments(), 3);
    }

    #[test]
    fn model_without_attention_is_one_segment() {
        let s = Schedule::new(&[false, false, false]);
        assert_eq!(s.render(), "[E B0 A0 B1 A1 B2 A2 L]");
        assert_eq!(s.num_segments(), 1);
    }

    #[test]
    fn hybrid_qwen35_pattern() {
        // 3 gated-delta layers then attention, twice.
        let s = Schedule::new(&[false, false, false, true, false, false, false, true]);
        assert_eq!(
            s.render(),
            "[E B0 A0 B1 A1 B2 A2 B3] G3 [A3 B4 A4 B5 A5 B6 A6 B7] G7 [A7 L]"
        );
        assert_eq!(
            Schedule::layers_of(&[
                Phase::AfterCache(3),
                Phase::BeforeCache(4),
                Phase::AfterCache(4)
            ]),
            vec![3, 4]
        );
    }

    #[test]
    fn several_growing_kinds_and_stateless_layers() {
        // From layer kinds' declared state: full and sliding attention both
        // grow; gated delta, mamba2 (fixed state), mlp and moe (none) do not.
        use mlex_core::layer::StateKind;
        let plan = [
            StateKind::Fixed,           // mamba2
            StateKind::None,            // mlp
            StateKind::Growing,         // attention
            StateKind::None,            // moe
            StateKind::GrowingAndFixed, // attention with canon windows
            StateKind::Growing,         // sliding attention
            StateKind::Fixed,           // gated delta
        ];
        let grows: Vec<bool> = plan.iter().map(|k| k.grows()).collect();
        let s = Schedule::new(&grows);
        assert_eq!(
            s.render(),
            "[E B0 A0 B1 A1 B2] G2 [A2 B3 A3 B4] G4 [A4 B5] G5 [A5 B6 A6 L]"
        );
    }

    proptest! {
        #[test]
        fn every_phase_once_in_order_and_cuts_exactly_at_growing_layers(
            grows in proptest::collection::vec(any::<bool>(), 0..40)
        ) {
            let s = Schedule::new(&grows);
            // Every layer's phases exactly once, before-cache before after-cache,
            // layers in order; a grow between them iff the layer grows.
            let mut expected = vec!["Embed".to_owned()];
            for (i, g) in grows.iter().enumerate() {
                expected.push(format!("BeforeCache({i})"));
                if *g { expected.push(format!("G{i}")); }
                expected.push(format!("AfterCache({i})"));
            }
            expected.push("Logits".to_owned());
            prop_assert_eq!(flatten(&s), expected);
            // Boundaries exactly at growing layers.
            let cuts: Vec<usize> = s.steps.iter().filter_map(|st| match st {
                Step::Grow(i) => Some(*i), _ => None }).collect();
            let growing: Vec<usize> = grows.iter().enumerate().filter(|(_, g)| **g).map(|(i, _)| i).collect();
            prop_assert_eq!(cuts, growing.clone());
            // Segments and grows alternate; no empty segment.
            prop_assert_eq!(s.num_segments(), growing.len() + 1);
            for (k, st) in s.steps.iter().enumerate() {
                match st {
                    Step::Segment(p) => { prop_assert!(!p.is_empty()); prop_assert_eq!(k % 2, 0); }
                    Step::Grow(_) => prop_assert_eq!(k % 2, 1),
                }
            }
        }
    }
}
