//! Token sampling on the device: logit bias, repetition, presence and
//! frequency penalties (mlx-lm's order and arithmetic,
//! `mlx_lm/sample_utils.py`), a grammar's token mask, then greedy
//! (`temp == 0`) or temperature sampling with top-k, top-p and min-p
//! filtering; and the log-probabilities of what was drawn. Everything stays an MLX array (no host sync), so the
//! decode loop can build step t+1 while step t evaluates. A seed makes
//! sampling reproducible: the same seed gives the same tokens.

use mlex_core::error::{Error, Result};
use mlx_rs::ops::indexing::{self, TryIndexOp};
use mlx_rs::random::{self, RandomState};
use mlx_rs::{ops, Array, Dtype};

/// Sampling settings, validated by [`SamplerConfig::validate`].
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SamplerConfig {
    /// Temperature; 0 is greedy.
    pub temp: f32,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Drop tokens below `min_p` times the top probability; 0 disables.
    pub min_p: f32,
    /// Penalty > 0 on tokens of the recent context; 1 disables.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token of the recent
    /// context (OpenAI's `presence_penalty`); 0 disables.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it occurs in the
    /// recent context (OpenAI's `frequency_penalty`); 0 disables.
    pub frequency_penalty: f32,
    /// How many recent tokens (prompt and output) the penalties look at.
    pub repetition_context: usize,
    /// Additive biases by token id.
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the sampling stream.
    pub seed: Option<u64>,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            temp: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_context: 20,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

impl SamplerConfig {
    /// Checks every value; errors name the field (`SamplerConfig.top_p`),
    /// which the CLI shows as its option (`--top-p`).
    pub fn validate(&self, vocab: usize) -> Result<()> {
        if !self.temp.is_finite() || self.temp < 0.0 {
            return Err(Error::invalid(
                "SamplerConfig.temp",
                format!("{} (must be a finite number ≥ 0)", self.temp),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid(
                "SamplerConfig.top_p",
                format!("{} (must be in (0, 1])", self.top_p),
            ));
        }
        if self.top_k > vocab {
            return Err(Error::invalid(
                "SamplerConfig.top_k",
                format!("{} (the vocabulary has {vocab} tokens)", self.top_k),
            ));
        }
        if !(0.0..1.0).contains(&self.min_p) {
            return Err(Error::invalid(
                "SamplerConfig.min_p",
                format!("{} (must be in [0, 1))", self.min_p),
            ));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return Err(Error::invalid(
                "SamplerConfig.repetition_penalty",
                format!("{} (must be > 0)", self.repetition_penalty),
            ));
        }
        for (name, v) in [
            ("SamplerConfig.presence_penalty", self.presence_penalty),
            ("SamplerConfig.frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() {
                return Err(Error::invalid(name, format!("{v} (must be a number)")));
            }
        }
        for (id, b) in &self.logit_bias {
            if *id as usize >= vocab {
                return Err(Error::invalid(
                    "SamplerConfig.logit_bias",
                    format!("token {id} is outside the vocabulary of {vocab}"),
                ));
            }
            if !b.is_finite() && *b != f32::NEG_INFINITY {
                return Err(Error::invalid(
                    "SamplerConfig.logit_bias",
                    format!("bias {b} for token {id} is not a number"),
                ));
            }
        }
        Ok(())
    }

    /// True for plain argmax.
    pub fn is_greedy(&self) -> bool {
        self.temp == 0.0
    }

    /// True when a penalty looks at the recent tokens.
    pub fn uses_history(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// True when sampling is the argmax of the model's logits as they are.
    pub fn is_plain_greedy(&self) -> bool {
        self.is_greedy() && self.logit_bias.is_empty() && !self.uses_history()
    }
}

/// A stateful sampler (its random stream and bias vector).
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Option<RandomState>,
    bias: Option<Array>,
}

impl Sampler {
    /// A sampler for a vocabulary of `vocab` (validates `cfg`).
    pub fn new(cfg: SamplerConfig, vocab: usize) -> Result<Self> {
        cfg.validate(vocab)?;
        let rng = if cfg.is_greedy() {
            None
        } else {
            Some(match cfg.seed {
                Some(s) => RandomState::with_seed(s)?,
                None => RandomState::new()?,
            })
        };
        let bias = if cfg.logit_bias.is_empty() {
            None
        } else {
            let mut dense = vec![0f32; vocab];
            for (id, b) in &cfg.logit_bias {
                dense[*id as usize] += b;
            }
            Some(Array::from_slice(&dense, &[vocab as i32]))
        };
        Ok(Self { cfg, rng, bias })
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// The model's logits after the logit bias and the penalties over
    /// `history` (`[B, n]` int32, may be empty), f32 `[B, V]`: what
    /// log-probabilities are reported from (mlx-lm's `logprobs`: after its
    /// logits processors, before temperature and filtering).
    pub fn processed(&self, logits: &Array, history: Option<&Array>) -> Result<Array> {
        let mut l = logits.as_dtype(Dtype::Float32)?;
        if let Some(b) = &self.bias {
            l = ops::add(&l, b)?;
        }
        let Some(h) = history.filter(|h| h.size() > 0) else {
            return Ok(l);
        };
        if self.cfg.repetition_penalty != 1.0 {
            let picked = indexing::take_along_axis(&l, h, -1)?;
            let p = Array::from_f32(self.cfg.repetition_penalty);
            let zero = Array::from_f32(0.0);
            let penalised = ops::select(
                ops::lt(&picked, &zero)?,
                ops::multiply(&picked, &p)?,
                ops::divide(&picked, &p)?,
            )?;
            l = indexing::put_along_axis(&l, h, &penalised, -1)?;
        }
        if self.cfg.presence_penalty != 0.0 {
            // A token seen twice is written twice with the same value:
            // penalised once.
            let picked = indexing::take_along_axis(&l, h, -1)?;
            let less = ops::subtract(&picked, Array::from_f32(self.cfg.presence_penalty))?;
            l = indexing::put_along_axis(&l, h, &less, -1)?;
        }
        if self.cfg.frequency_penalty != 0.0 {
            // Counts of each id in the window: [B, n, 1] == [V] summed over n.
            let vocab = l.shape()[l.ndim() - 1];
            let ids = ops::arange::<_, i32>(0, vocab, None)?;
            let hits = ops::eq(&ops::expand_dims(h, -1)?, &ids)?;
            let counts = hits.as_dtype(Dtype::Float32)?.sum_axis(-2, false)?;
            l = ops::subtract(
                &l,
                ops::multiply(&counts, Array::from_f32(self.cfg.frequency_penalty))?,
            )?;
        }
        Ok(l)
    }

    /// The logits sampling draws from (f32, `[B, V]`): [`Sampler::processed`],
    /// then the tokens `mask` forbids (`[B, V]` bool, true = allowed) set to
    /// -inf, and unless greedy, scaled by the temperature with the tokens
    /// top-k, top-p and min-p drop set to -inf.
    pub fn filtered(&self, logits: &Array, history: Option<&Array>) -> Result<Array> {
        self.filtered_masked(logits, history, None)
    }

    /// [`Sampler::filtered`] under a grammar's token mask.
    pub fn filtered_masked(
        &self,
        logits: &Array,
        history: Option<&Array>,
        mask: Option<&Array>,
    ) -> Result<Array> {
        let l = self.processed(logits, history)?;
        self.finish_filter(l, mask)
    }

    fn finish_filter(&self, mut l: Array, mask: Option<&Array>) -> Result<Array> {
        if let Some(m) = mask {
            l = ops::select(m, &l, Array::from_f32(f32::NEG_INFINITY))?;
        }
        if self.cfg.is_greedy() {
            return Ok(l);
        }
        let neg_inf = Array::from_f32(f32::NEG_INFINITY);
        l = ops::multiply(&l, Array::from_f32(1.0 / self.cfg.temp))?;
        let vocab = l.shape()[l.ndim() - 1];
        if self.cfg.top_k > 0 && (self.cfg.top_k as i32) < vocab {
            // Mask everything outside the k largest.
            let k = self.cfg.top_k as i32;
            let order = ops::argpartition_axis(ops::negative(&l)?, k - 1, -1)?;
            let drop = order.try_index((.., k..))?;
            let fill = ops::broadcast_to(&neg_inf, drop.shape())?;
            l = indexing::put_along_axis(&l, &drop, &fill, -1)?;
        }
        if self.cfg.top_p < 1.0 {
            // Keep the smallest set of most likely tokens with mass ≥ top_p.
            let probs = ops::softmax_axis(&l, -1, true)?;
            let order = ops::argsort_axis(ops::negative(&probs)?, -1)?;
            let sorted = indexing::take_along_axis(&probs, &order, -1)?;
            let before = ops::subtract(sorted.cumsum(-1, None, None)?, &sorted)?;
            let keep = ops::lt(&before, Array::from_f32(self.cfg.top_p))?;
            let sorted_l = indexing::take_along_axis(&l, &order, -1)?;
            let masked = ops::select(&keep, &sorted_l, &neg_inf)?;
            l = indexing::put_along_axis(&l, &order, &masked, -1)?;
        }
        if self.cfg.min_p > 0.0 {
            let probs = ops::softmax_axis(&l, -1, true)?;
            let top = probs.max_axis(-1, true)?;
            let keep = ops::ge(
                &probs,
                ops::multiply(&top, Array::from_f32(self.cfg.min_p))?,
            )?;
            l = ops::select(&keep, &l, &neg_inf)?;
        }
        Ok(l)
    }

    /// The distribution a token is drawn from, `[B, V]` f32: the softmax
    /// of [`Sampler::filtered`], or, when greedy, all mass on the argmax.
    pub fn probs(&self, logits: &Array, history: Option<&Array>) -> Result<Array> {
        let l = self.filtered(logits, history)?;
        if self.cfg.is_greedy() {
            let top = ops::indexing::argmax_axis(&l, -1, Some(true))?;
            let ids = ops::arange::<_, i32>(0, l.shape()[l.ndim() - 1], None)?;
            return Ok(ops::eq(&ids, &top)?.as_dtype(Dtype::Float32)?);
        }
        Ok(ops::softmax_axis(&l, -1, true)?)
    }

    /// Samples from `logits` `[B, V]` given the recent tokens `history`
    /// (`[B, n]` int32, may be empty); returns `[B]` uint32 ids.
    pub fn sample(&mut self, logits: &Array, history: Option<&Array>) -> Result<Array> {
        self.sample_with(logits, history, None, None)
            .map(|(t, _)| t)
    }

    /// [`Sampler::sample`] under a grammar's token `mask` (`[B, V]` bool),
    /// with the log-probabilities of the drawn tokens and of the `top` most
    /// likely ones when `top` is given (from [`Sampler::processed`]).
    pub fn sample_with(
        &mut self,
        logits: &Array,
        history: Option<&Array>,
        mask: Option<&Array>,
        top: Option<usize>,
    ) -> Result<(Array, Option<LogprobArrays>)> {
        let processed = self.processed(logits, history)?;
        let ids = self.draw(self.finish_filter(processed.clone(), mask)?)?;
        let lp = match top {
            None => None,
            Some(n) => Some(LogprobArrays::of(&processed, &ids, n)?),
        };
        Ok((ids, lp))
    }

    fn draw(&mut self, l: Array) -> Result<Array> {
        if self.cfg.is_greedy() {
            return Ok(ops::indexing::argmax_axis(&l, -1, None)?.as_dtype(Dtype::Uint32)?);
        }
        let key = self
            .rng
            .as_mut()
            .expect("non-greedy sampler has a stream")
            .next_key()?;
        Ok(random::categorical(&l, -1, None, &key)?.as_dtype(Dtype::Uint32)?)
    }
}

/// The log-probabilities of drawn tokens, still on the device.
#[derive(Clone)]
pub struct LogprobArrays {
    /// `[B]` f32: each drawn token's.
    pub chosen: Array,
    /// `[B, n]` uint32: the `n` most likely ids, most likely first.
    pub top_ids: Array,
    /// `[B, n]` f32: their log-probabilities.
    pub top_logprobs: Array,
}

impl LogprobArrays {
    fn of(processed: &Array, ids: &Array, n: usize) -> Result<Self> {
        let lse = processed.logsumexp_axis(-1, true)?;
        let lp = ops::subtract(processed, &lse)?;
        let idx = ops::expand_dims(&ids.as_dtype(Dtype::Int32)?, -1)?;
        let chosen = indexing::take_along_axis(&lp, &idx, -1)?.squeeze_axes(&[-1])?;
        let vocab = lp.shape()[lp.ndim() - 1];
        let n = (n as i32).clamp(0, vocab);
        let order = ops::argsort_axis(ops::negative(&lp)?, -1)?.try_index((.., ..n))?;
        let top_logprobs = indexing::take_along_axis(&lp, &order, -1)?;
        Ok(Self {
            chosen,
            top_ids: order.as_dtype(Dtype::Uint32)?,
            top_logprobs,
        })
    }

    /// Row `r` on the host: (the drawn token's log-probability, the top
    /// ids with theirs). Waits for the arrays.
    pub fn row(&self, r: usize) -> Result<(f32, Vec<(u32, f32)>)> {
        let chosen = self.chosen.as_slice::<f32>();
        let n = self.top_ids.shape()[1] as usize;
        let ids = self.top_ids.as_slice::<u32>();
        let lps = self.top_logprobs.as_slice::<f32>();
        let top = (0..n).map(|j| (ids[r * n + j], lps[r * n + j])).collect();
        Ok((chosen[r], top))
    }

    /// The arrays, to hand to `eval`.
    pub fn arrays(&self) -> [&Array; 3] {
        [&self.chosen, &self.top_ids, &self.top_logprobs]
    }
}

/// Token ids `[1, n]` int32 of the last `ctx` of `tokens` (the
/// penalties' history).
pub(crate) fn history_of(tokens: &[u32], ctx: usize) -> Array {
    let tail: Vec<i32> = tokens[tokens.len().saturating_sub(ctx)..]
        .iter()
        .map(|&t| t as i32)
        .collect();
    Array::from_slice(&tail, &[1, tail.len() as i32])
}

/// The id a sampled `[1]` uint32 array holds (waits for it).
pub(crate) fn token_id(a: &Array) -> Result<u32> {
    a.try_item_exact::<u32>()
        .map_err(|e| Error::Other(e.to_string()))
}

/// The host's random generator of a run: seeded when the run has a seed
/// (so that a seeded run repeats), else from the operating system.
pub(crate) fn host_rng(seed: Option<u64>) -> rand::rngs::StdRng {
    use rand::SeedableRng;
    match seed {
        Some(s) => rand::rngs::StdRng::seed_from_u64(s),
        None => rand::rngs::StdRng::from_os_rng(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(a: &Array) -> Vec<u32> {
        a.eval().unwrap();
        a.try_as_slice::<u32>().unwrap().to_vec()
    }

    fn logits() -> Array {
        Array::from_slice(&[0.0f32, 3.0, 1.0, 2.9, -1.0, 0.5], &[1, 6])
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplerConfig::default(), 6).unwrap();
        assert_eq!(ids(&s.sample(&logits(), None).unwrap()), vec![1]);
    }

    #[test]
    fn logit_bias_and_repetition_penalty_change_the_argmax() {
        let cfg = SamplerConfig {
            logit_bias: vec![(4, 10.0)],
            ..Default::default()
        };
        let mut s = Sampler::new(cfg, 6).unwrap();
        assert_eq!(ids(&s.sample(&logits(), None).unwrap()), vec![4]);
        let cfg = SamplerConfig {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::new(cfg, 6).unwrap();
        let hist = Array::from_slice(&[1i32], &[1, 1]);
        // 3.0 / 2 = 1.5 < 2.9
        assert_eq!(ids(&s.sample(&logits(), Some(&hist)).unwrap()), vec![3]);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_restricts() {
        let cfg = SamplerConfig {
            temp: 1.0,
            top_k: 2,
            seed: Some(7),
            ..Default::default()
        };
        let draw = |cfg: &SamplerConfig| {
            let mut s = Sampler::new(cfg.clone(), 6).unwrap();
            (0..40)
                .map(|_| ids(&s.sample(&logits(), None).unwrap())[0])
                .collect::<Vec<_>>()
        };
        let a = draw(&cfg);
        assert_eq!(a, draw(&cfg));
        assert!(
            a.iter().all(|t| *t == 1 || *t == 3),
            "top-k 2 allows only ids 1 and 3: {a:?}"
        );
        assert!(
            a.contains(&1) && a.contains(&3),
            "both near-equal tokens appear: {a:?}"
        );
        let other = draw(&SamplerConfig {
            seed: Some(8),
            ..cfg
        });
        assert_ne!(a, other);
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let top_p = SamplerConfig {
            top_p: 0.5,
            seed: Some(1),
            ..Default::default()
        };
        let min_p = SamplerConfig {
            min_p: 0.5,
            seed: Some(2),
            ..Default::default()
        };
        for (cfg, keeps) in [
            (top_p, "top-p 0.5 keeps the two top tokens"),
            (
                min_p,
                "min-p 0.5 keeps tokens within half the top probability",
            ),
        ] {
            let mut s = Sampler::new(SamplerConfig { temp: 1.0, ..cfg }, 6).unwrap();
            for _ in 0..30 {
                let t = ids(&s.sample(&logits(), None).unwrap())[0];
                assert!(t == 1 || t == 3, "{keeps}, got {t}");
            }
        }
    }

    #[test]
    fn invalid_values_name_the_option() {
        type Edit = fn(&mut SamplerConfig);
        let bad: [(Edit, &str); 6] = [
            (|c| c.temp = -1.0, "SamplerConfig.temp"),
            (|c| c.top_p = 0.0, "SamplerConfig.top_p"),
            (|c| c.top_k = 99, "SamplerConfig.top_k"),
            (|c| c.min_p = 1.5, "SamplerConfig.min_p"),
            (
                |c| c.repetition_penalty = 0.0,
                "SamplerConfig.repetition_penalty",
            ),
            (
                |c| c.logit_bias = vec![(6, 1.0)],
                "SamplerConfig.logit_bias",
            ),
        ];
        for (edit, name) in bad {
            let mut cfg = SamplerConfig::default();
            edit(&mut cfg);
            let e = Sampler::new(cfg, 6).err().expect("rejected").to_string();
            assert!(e.contains(name), "{e} should name {name}");
        }
    }
}
