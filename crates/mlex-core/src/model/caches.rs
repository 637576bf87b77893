//! The caches of a whole model ([`ModelCache`]): going back to a mark,
//! committing a verify forward's accepted prefix (one count, or one per
//! batch row), and the fixed-size state threaded through compiled
//! segments.

use crate::cache::Cache;
use crate::error::{Error, Result};
use mlx_rs::{ops, Array};

/// The caches of a whole model: one list per layer.
#[derive(Clone, Default)]
pub struct ModelCache {
    /// `layers[i]` are the caches of layer `i` (growing cache first).
    pub layers: Vec<Vec<Box<dyn Cache>>>,
}

impl ModelCache {
    /// Tokens seen (the offset of the first cache that has one).
    pub fn offset(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|c| c.offset())
            .next()
            .unwrap_or(0)
    }

    /// Bytes held by all caches.
    pub fn nbytes(&self) -> usize {
        self.layers.iter().flatten().map(|c| c.nbytes()).sum()
    }

    /// True when some cache holds fixed-size (recurrent) state rather than
    /// growing with the tokens.
    pub fn has_fixed_state(&self) -> bool {
        self.layers.iter().flatten().any(|c| !c.grows())
    }

    /// True when some cache is of `kind` (a [`crate::cache::Cache::kind`]).
    pub fn holds_kind(&self, kind: &str) -> bool {
        self.layers.iter().flatten().any(|c| c.kind() == kind)
    }

    /// True when every cache can drop tokens exactly (no recurrent state).
    pub fn is_trimmable(&self) -> bool {
        self.layers.iter().flatten().all(|c| c.is_trimmable())
    }

    /// Drops the last `n` tokens of every cache (requires
    /// [`ModelCache::is_trimmable`]).
    pub fn trim(&mut self, n: usize) -> Result<()> {
        if !self.is_trimmable() {
            return Err(Error::Cache(
                "this model keeps recurrent state, which cannot be trimmed; restore a snapshot instead"
                    .into(),
            ));
        }
        for c in self.layers.iter_mut().flatten() {
            c.trim(n);
        }
        Ok(())
    }

    /// True when every growing cache could drop `n` tokens after taking
    /// them (a sliding window that would wrap cannot); a speculative round
    /// of `n` tokens needs it.
    pub fn can_take_back(&self, n: usize) -> bool {
        self.layers
            .iter()
            .flatten()
            .filter(|c| c.grows())
            .all(|c| c.trimmable_after(n))
    }

    /// Where the cache stands now, to [`ModelCache::rewind`] to later.
    pub fn mark(&self) -> CacheMark {
        CacheMark {
            layers: self
                .layers
                .iter()
                .map(|l| {
                    l.iter()
                        .map(|c| {
                            if c.grows() {
                                Marked::Grows(c.offset())
                            } else {
                                Marked::Fixed(c.box_clone())
                            }
                        })
                        .collect()
                })
                .collect(),
        }
    }

    /// Goes back to `mark`, made on this cache before it took more tokens:
    /// growing caches drop what came after, fixed-size caches return to
    /// their copies. Fails, naming the cache kind, when a growing cache
    /// cannot drop them exactly (check [`ModelCache::can_take_back`]
    /// first).
    pub fn rewind(&mut self, mark: &CacheMark) -> Result<()> {
        if mark.layers.len() != self.layers.len() {
            return Err(Error::Cache("a cache mark of another model".into()));
        }
        for (caches, marks) in self.layers.iter_mut().zip(&mark.layers) {
            for (c, m) in caches.iter_mut().zip(marks) {
                match m {
                    Marked::Grows(at) => {
                        let n = c.offset().checked_sub(*at).ok_or_else(|| {
                            Error::Cache(format!("a `{}` cache is behind its mark", c.kind()))
                        })?;
                        if c.trim(n) != n {
                            return Err(Error::Cache(format!(
                                "a `{}` cache cannot drop {n} tokens",
                                c.kind()
                            )));
                        }
                    }
                    Marked::Fixed(saved) => *c = saved.box_clone(),
                }
            }
        }
        Ok(())
    }

    /// Ends a verify forward ([`Model::verify`]) keeping its first `kept`
    /// tokens (1..=T): growing caches drop the others, fixed-size caches
    /// take their state after position `kept` and count `kept` tokens.
    pub fn commit(&mut self, states: PositionStates, kept: usize) -> Result<()> {
        let t = states.tokens;
        if kept == 0 || kept > t || states.layers.len() != self.layers.len() {
            return Err(Error::Cache(format!(
                "cannot keep {kept} of {t} verified tokens ({} layers for a cache of {})",
                states.layers.len(),
                self.layers.len()
            )));
        }
        for (caches, state) in self.layers.iter_mut().zip(states.layers) {
            for c in caches.iter_mut().filter(|c| c.grows()) {
                if c.trim(t - kept) != t - kept {
                    return Err(Error::Cache(format!(
                        "a `{}` cache cannot drop {} tokens",
                        c.kind(),
                        t - kept
                    )));
                }
            }
            if state.is_empty() {
                continue;
            }
            let picked = state
                .iter()
                .map(|a| crate::layer::position_entry(a, kept - 1))
                .collect::<Result<Vec<Array>>>()?;
            scatter_state(caches, picked)?;
            advance_fixed(caches, kept);
        }
        Ok(())
    }

    /// [`ModelCache::commit`] for a batch whose rows keep different
    /// counts: row `r` keeps its first `kept[r]` (1..=T) verified tokens.
    /// Growing caches drop each row's rejected tokens
    /// ([`Cache::trim_rows`]); fixed-size caches take each row's state after
    /// its own last kept position and count the most kept.
    pub fn commit_rows(&mut self, states: PositionStates, kept: &[usize]) -> Result<()> {
        let t = states.tokens;
        if let Some(&k) = kept.first() {
            if kept.iter().all(|&x| x == k) {
                return self.commit(states, k);
            }
        }
        if kept.is_empty()
            || kept.iter().any(|&k| k == 0 || k > t)
            || states.layers.len() != self.layers.len()
        {
            return Err(Error::Cache(format!(
                "cannot keep {kept:?} of {t} verified tokens ({} layers for a cache of {})",
                states.layers.len(),
                self.layers.len()
            )));
        }
        let drop: Vec<usize> = kept.iter().map(|&k| t - k).collect();
        let most = kept.iter().copied().max().unwrap_or(1);
        let last: Vec<i32> = kept.iter().map(|&k| k as i32 - 1).collect();
        for (caches, state) in self.layers.iter_mut().zip(states.layers) {
            for c in caches.iter_mut().filter(|c| c.grows()) {
                c.trim_rows(&drop)?;
            }
            if state.is_empty() {
                continue;
            }
            let picked = state
                .iter()
                .map(|a| {
                    // `[T, B, ...]`: row r's entry `kept[r] - 1`.
                    if a.ndim() < 2 || a.shape()[1] as usize != kept.len() {
                        return Err(Error::Cache(format!(
                            "a verified state of shape {:?} has no row for each of {} kept counts",
                            a.shape(),
                            kept.len()
                        )));
                    }
                    let mut shape = vec![1i32; a.ndim()];
                    shape[1] = kept.len() as i32;
                    let idx = Array::from_slice(&last, &shape);
                    let one = a.take_along_axis(&idx, 0)?;
                    Ok(ops::reshape(&one, &a.shape()[1..])?)
                })
                .collect::<Result<Vec<Array>>>()?;
            scatter_state(caches, picked)?;
            advance_fixed(caches, most);
        }
        Ok(())
    }

    /// Every array the caches hold (for `eval`/`async_eval`).
    pub fn arrays(&self) -> Vec<Array> {
        let mut out = Vec::new();
        for c in self.layers.iter().flatten() {
            out.extend(c.to_tensors().arrays.into_values());
        }
        out
    }
}

/// What a verify forward ([`Model::verify`]) left for the fixed-size
/// caches: per layer, its state arrays with a leading axis of one entry per
/// verified position.
pub struct PositionStates {
    layers: Vec<Vec<Array>>,
    tokens: usize,
}

impl PositionStates {
    /// Per layer, its state arrays each with a leading axis of `tokens`
    /// entries (empty for a layer with no fixed-size state), as a verify
    /// forward of another driver (the compiled segments) leaves them.
    pub fn new(layers: Vec<Vec<Array>>, tokens: usize) -> Self {
        Self { layers, tokens }
    }

    /// Positions verified (`T`).
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

/// A point a [`ModelCache`] can go back to ([`ModelCache::mark`]): the
/// offsets of its growing caches and copies of its fixed-size ones (array
/// handles, no data).
pub struct CacheMark {
    layers: Vec<Vec<Marked>>,
}

enum Marked {
    Grows(usize),
    Fixed(Box<dyn Cache>),
}

/// The fixed-size state of one layer's caches, concatenated.
pub fn gather_state(caches: &[Box<dyn Cache>]) -> Vec<Array> {
    caches
        .iter()
        .filter(|c| !c.grows())
        .flat_map(|c| c.state())
        .collect()
}

/// Counts `tokens` on the fixed-size caches of one layer (growing caches
/// count their own writes).
pub fn advance_fixed(caches: &mut [Box<dyn Cache>], tokens: usize) {
    for c in caches.iter_mut().filter(|c| !c.grows()) {
        c.advance(tokens);
    }
}

/// Writes back what [`gather_state`] gathered.
pub fn scatter_state(caches: &mut [Box<dyn Cache>], state: Vec<Array>) -> Result<()> {
    let mut it = state.into_iter();
    for c in caches.iter_mut().filter(|c| !c.grows()) {
        let n = c.state().len();
        let part: Vec<Array> = it.by_ref().take(n).collect();
        if part.len() != n {
            return Err(Error::Cache("a layer returned too few state arrays".into()));
        }
        c.set_state(part)?;
    }
    Ok(())
}
