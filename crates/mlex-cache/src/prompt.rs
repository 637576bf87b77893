//! Prompt-cache prefix reuse that works for hybrid models.
//!
//! mlx-lm's prompt cache trims KV caches back to a shared prefix; it gives
//! up on hybrids because recurrent state cannot be trimmed. Here every
//! entry keeps the whole model cache after its tokens **and snapshots of
//! the fixed-size (recurrent) state at earlier token boundaries** (the end
//! of the prompt, say). Restoring boundary `b` clones the final cache, trims
//! its growing (KV) caches back to `b` and puts the snapshot's recurrent
//! state in place: exact, and O(layers) — MLX arrays are reference counted,
//! and a snapshot holds only the small state arrays, never KV buffers, so
//! taking one costs no copy.
//!
//! A lookup finds the entry sharing the longest prefix with the new prompt
//! and restores the latest usable boundary at or before it (for a model
//! without recurrent state, any prefix: the KV caches are simply trimmed).
//! At least one prompt token is always left to compute, since generation
//! needs its logits.
//!
//! Bounded by entries and by bytes (least recently used goes first); saved
//! to and loaded from a safetensors file carrying a model fingerprint.

use mlex_core::cache::{Cache, CacheTensors};
use mlex_core::error::{Error, Result};
use mlex_core::model::ModelCache;
use mlx_rs::Array;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The fixed-size caches of a model cache at one token boundary: per layer,
/// per cache, `Some(copy)` for fixed-size caches and `None` for growing ones.
#[derive(Clone, Default)]
pub struct StateSnapshot {
    layers: Vec<Vec<Option<Box<dyn Cache>>>>,
}

impl StateSnapshot {
    /// Copies the fixed-size caches of `cache` (O(layers), no data copy).
    pub fn of(cache: &ModelCache) -> Self {
        Self {
            layers: cache
                .layers
                .iter()
                .map(|l| {
                    l.iter()
                        .map(|c| (!c.grows()).then(|| c.box_clone()))
                        .collect()
                })
                .collect(),
        }
    }

    fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|c| c.nbytes())
            .sum()
    }

    fn is_empty(&self) -> bool {
        self.layers.iter().flatten().all(Option::is_none)
    }
}

struct Entry {
    tokens: Vec<u32>,
    /// The cache after all of `tokens`.
    cache: ModelCache,
    /// boundary → fixed-size state after exactly that many tokens.
    snapshots: BTreeMap<usize, StateSnapshot>,
    last_used: u64,
}

impl Entry {
    fn nbytes(&self) -> usize {
        self.cache.nbytes()
            + self
                .snapshots
                .values()
                .map(StateSnapshot::nbytes)
                .sum::<usize>()
    }

    /// True when the model keeps no fixed-size state (attention only).
    fn stateless(&self) -> bool {
        !self.cache.has_fixed_state()
    }

    /// The cache after the first `b` tokens, if it can be rebuilt.
    fn restore(&self, b: usize) -> Option<ModelCache> {
        let n = self.tokens.len();
        if b == n {
            return Some(self.cache.clone());
        }
        let growing_trimmable = self
            .cache
            .layers
            .iter()
            .flatten()
            .filter(|c| c.grows())
            .all(|c| c.is_trimmable());
        if !growing_trimmable {
            return None;
        }
        let snap = if self.stateless() {
            None
        } else {
            Some(self.snapshots.get(&b)?)
        };
        let mut cache = self.cache.clone();
        for (li, layer) in cache.layers.iter_mut().enumerate() {
            for (ci, c) in layer.iter_mut().enumerate() {
                if c.grows() {
                    if c.trim(n - b) != n - b {
                        return None;
                    }
                } else {
                    *c = snap?.layers.get(li)?.get(ci)?.as_ref()?.box_clone();
                }
            }
        }
        Some(cache)
    }
}

/// What a lookup found.
pub struct PrefixHit {
    /// The restored cache, covering exactly `reused` tokens.
    pub cache: ModelCache,
    /// Prompt tokens that need no computation.
    pub reused: usize,
}

/// LRU cache of model caches keyed by token sequences.
pub struct PromptCache {
    entries: Vec<Entry>,
    max_entries: usize,
    max_bytes: usize,
    clock: u64,
}

/// The snapshot whose removal loses the least: the one closest to the
/// snapshot before it (the gap a lookup would then re-feed grows least),
/// the oldest among equals; the newest snapshot goes last. Checkpoints made
/// every C tokens thus thin out from the start of a long prompt, every
/// other one at a time: sparse for old context, dense for recent, where
/// chats and agents most often diverge.
fn thinnest(snapshots: &BTreeMap<usize, StateSnapshot>) -> Option<usize> {
    let newest = *snapshots.keys().next_back()?;
    if snapshots.len() == 1 {
        return Some(newest);
    }
    let mut prev = 0;
    let mut best: Option<(usize, usize)> = None; // (gap, boundary)
    for &b in snapshots.keys() {
        if b != newest && best.is_none_or(|(g, _)| b - prev < g) {
            best = Some((b - prev, b));
        }
        prev = b;
    }
    best.map(|(_, b)| b)
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PromptCache {
    /// A cache holding at most `max_entries` sequences and `max_bytes`
    /// bytes.
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        Self {
            entries: Vec::new(),
            max_entries: max_entries.max(1),
            max_bytes,
            clock: 0,
        }
    }

    /// Number of cached sequences.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes held (logical; buffers shared between entries count per entry).
    pub fn nbytes(&self) -> usize {
        self.entries.iter().map(Entry::nbytes).sum()
    }

    /// Of [`PromptCache::nbytes`], the bytes of the state snapshots (the
    /// checkpoints prefix reuse restores), not of the entries' own caches.
    pub fn snapshot_nbytes(&self) -> usize {
        self.entries
            .iter()
            .flat_map(|e| e.snapshots.values())
            .map(StateSnapshot::nbytes)
            .sum()
    }

    /// The token boundaries of each entry's state snapshots, ascending (what
    /// a lookup can restore to besides an entry's end).
    pub fn snapshot_boundaries(&self) -> Vec<Vec<usize>> {
        self.entries
            .iter()
            .map(|e| e.snapshots.keys().copied().collect())
            .collect()
    }

    /// Finds and restores the longest reusable prefix of `tokens`.
    pub fn lookup(&mut self, tokens: &[u32]) -> Option<PrefixHit> {
        if tokens.is_empty() {
            return None;
        }
        let limit = tokens.len() - 1;
        let mut best: Option<(usize, usize)> = None; // (reused, entry)
        for (i, e) in self.entries.iter().enumerate() {
            let shared = common_prefix(&e.tokens, tokens).min(limit);
            // Candidate boundaries, best first.
            let candidate = if e.tokens.len() <= shared {
                Some(e.tokens.len())
            } else if e.stateless() {
                Some(shared)
            } else {
                e.snapshots.range(..=shared).next_back().map(|(b, _)| *b)
            };
            if let Some(r) = candidate.filter(|r| *r > 0) {
                if best.is_none_or(|(b, _)| r > b) && e.restore(r).is_some() {
                    best = Some((r, i));
                }
            }
        }
        let (reused, i) = best?;
        self.clock += 1;
        let e = &mut self.entries[i];
        e.last_used = self.clock;
        let cache = e.restore(reused)?;
        Some(PrefixHit { cache, reused })
    }

    /// Records `cache` (the state after all of `tokens`) with fixed-size
    /// state snapshots at earlier boundaries. An entry whose tokens `tokens`
    /// extends is replaced, keeping its snapshots.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        cache: ModelCache,
        snapshots: Vec<(usize, StateSnapshot)>,
    ) {
        if tokens.is_empty() {
            return;
        }
        self.clock += 1;
        let mut merged: BTreeMap<usize, StateSnapshot> = BTreeMap::new();
        self.entries.retain_mut(|e| {
            let extends = e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens);
            if extends {
                merged.append(&mut e.snapshots);
                merged.insert(e.tokens.len(), StateSnapshot::of(&e.cache));
            }
            !extends
        });
        for (b, s) in snapshots {
            if b < tokens.len() && !s.is_empty() {
                merged.insert(b, s);
            }
        }
        merged.retain(|b, s| *b < tokens.len() && !s.is_empty());
        self.entries.push(Entry {
            tokens: tokens.to_vec(),
            cache,
            snapshots: merged,
            last_used: self.clock,
        });
        self.evict();
    }

    fn evict(&mut self) {
        while self.entries.len() > self.max_entries
            || (self.entries.len() > 1 && self.nbytes() > self.max_bytes)
        {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
                .expect("non-empty");
            self.entries.remove(oldest);
        }
        // A single entry over budget thins its snapshots.
        if let Some(e) = self.entries.first_mut() {
            while e.nbytes() > self.max_bytes && !e.snapshots.is_empty() {
                let b = thinnest(&e.snapshots).expect("non-empty");
                e.snapshots.remove(&b);
            }
        }
    }

    /// Saves every entry to a safetensors file stamped with `fingerprint`.
    pub fn save(&self, path: &Path, fingerprint: &str) -> Result<()> {
        let mut arrays: Vec<(String, Array)> = Vec::new();
        let mut entries = Vec::new();
        let mut put = |prefix: String, c: &dyn Cache| -> SavedCache {
            let t = c.to_tensors();
            for (name, a) in t.arrays {
                arrays.push((format!("{prefix}.{name}"), a));
            }
            SavedCache {
                kind: c.kind().to_owned(),
                meta: t.meta,
            }
        };
        for (ei, e) in self.entries.iter().enumerate() {
            let cache = saved_layers(&e.cache.layers, |li, ci, c| {
                Some(put(format!("e{ei}.final.l{li}.c{ci}"), c.as_ref()))
            });
            let snapshots = e
                .snapshots
                .iter()
                .map(|(b, s)| SavedSnapshot {
                    boundary: *b,
                    layers: saved_layers(&s.layers, |li, ci, c| {
                        let c = c.as_ref()?;
                        Some(put(format!("e{ei}.s{b}.l{li}.c{ci}"), c.as_ref()))
                    }),
                })
                .collect();
            entries.push(SavedEntry {
                tokens: e.tokens.clone(),
                cache,
                snapshots,
            });
        }
        let header = SavedHeader {
            format: FORMAT.to_owned(),
            fingerprint: fingerprint.to_owned(),
            entries,
        };
        let meta = HashMap::from([(
            META_KEY.to_owned(),
            serde_json::to_string(&header).map_err(|e| Error::Other(e.to_string()))?,
        )]);
        // Atomically: a temporary file beside the target, then a rename, so a
        // run killed mid-write leaves the old file or the new one. (MLX
        // appends `.safetensors` to names without it, so the temporary name
        // keeps that ending.)
        let name = path
            .file_name()
            .ok_or_else(|| {
                Error::invalid(
                    "prompt-cache path",
                    format!("{} names no file", path.display()),
                )
            })?
            .to_string_lossy();
        let tmp = path.with_file_name(format!(".{name}.{}.tmp.safetensors", std::process::id()));
        let written =
            Array::save_safetensors(arrays.iter().map(|(n, a)| (n.as_str(), a)), &meta, &tmp)
                .map_err(|e| Error::Other(format!("{}: {e}", tmp.display())))
                .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e)));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// Loads entries saved by [`PromptCache::save`]; the file must carry
    /// `fingerprint` (the same model), else it is an error saying so.
    pub fn load(&mut self, path: &Path, fingerprint: &str) -> Result<()> {
        mlex_core::weights::validate_safetensors(path)?;
        let (mut arrays, meta) =
            Array::load_safetensors_with_metadata(path).map_err(|e| Error::BadWeightsFile {
                file: path.to_owned(),
                format: "safetensors",
                message: e.to_string(),
            })?;
        let header: SavedHeader = meta
            .get(META_KEY)
            .ok_or_else(|| Error::Cache(format!("{} is not an mlex prompt cache", path.display())))
            .and_then(|s| {
                serde_json::from_str(s).map_err(|e| {
                    Error::Cache(format!("{}: bad prompt-cache header: {e}", path.display()))
                })
            })?;
        if header.format != FORMAT {
            return Err(Error::Cache(format!(
                "{}: unsupported prompt-cache format `{}`",
                path.display(),
                header.format
            )));
        }
        if header.fingerprint != fingerprint {
            return Err(Error::Cache(format!(
                "{} was saved for another model (fingerprint {}, this model is {})",
                path.display(),
                header.fingerprint,
                fingerprint
            )));
        }
        let mut take = |prefix: String, c: SavedCache| -> Result<Box<dyn Cache>> {
            let dotted = format!("{prefix}.");
            let names: Vec<String> = arrays
                .keys()
                .filter(|k| k.starts_with(&dotted))
                .cloned()
                .collect();
            let mut t = CacheTensors {
                arrays: BTreeMap::new(),
                meta: c.meta,
            };
            for n in names {
                let a = arrays.remove(&n).expect("listed");
                t.arrays.insert(n[dotted.len()..].to_owned(), a);
            }
            mlex_core::registry::restore_cache(&c.kind, &t)
        };
        for (ei, e) in header.entries.into_iter().enumerate() {
            let mut layers = Vec::new();
            for (li, l) in e.cache.into_iter().enumerate() {
                let mut out = Vec::new();
                for (ci, c) in l.into_iter().enumerate() {
                    let c = c.ok_or_else(|| {
                        Error::Cache(format!("{}: incomplete cache", path.display()))
                    })?;
                    out.push(take(format!("e{ei}.final.l{li}.c{ci}"), c)?);
                }
                layers.push(out);
            }
            let mut snapshots = Vec::new();
            for s in e.snapshots {
                let mut snap = StateSnapshot::default();
                for (li, l) in s.layers.into_iter().enumerate() {
                    let mut out = Vec::new();
                    for (ci, c) in l.into_iter().enumerate() {
                        out.push(match c {
                            Some(c) => Some(take(format!("e{ei}.s{}.l{li}.c{ci}", s.boundary), c)?),
                            None => None,
                        });
                    }
                    snap.layers.push(out);
                }
                snapshots.push((s.boundary, snap));
            }
            self.insert(&e.tokens, ModelCache { layers }, snapshots);
        }
        Ok(())
    }
}

const FORMAT: &str = "mlex-prompt-cache-2";
const META_KEY: &str = "mlex.prompt_cache";

#[derive(Serialize, Deserialize)]
struct SavedHeader {
    format: String,
    fingerprint: String,
    entries: Vec<SavedEntry>,
}

/// `save` (layer index, cache index, cache) of every cache of `layers`, in
/// their nesting.
fn saved_layers<C>(
    layers: &[Vec<C>],
    mut save: impl FnMut(usize, usize, &C) -> Option<SavedCache>,
) -> Vec<Vec<Option<SavedCache>>> {
    let mut layer = |(li, l): (usize, &Vec<C>)| -> Vec<_> {
        l.iter()
            .enumerate()
            .map(|(ci, c)| save(li, ci, c))
            .collect()
    };
    layers.iter().enumerate().map(&mut layer).collect()
}

#[derive(Serialize, Deserialize)]
struct SavedEntry {
    tokens: Vec<u32>,
    cache: Vec<Vec<Option<SavedCache>>>,
    snapshots: Vec<SavedSnapshot>,
}

#[derive(Serialize, Deserialize)]
struct SavedSnapshot {
    boundary: usize,
    layers: Vec<Vec<Option<SavedCache>>>,
}

#[derive(Serialize, Deserialize)]
struct SavedCache {
    kind: String,
    meta: BTreeMap<String, String>,
}
