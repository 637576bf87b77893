//! Prompt-cache prefix reuse that works for hybrid models.
//!
//! mlx-lm's prompt cache trims KV caches back to a shared prefix; it gives
//! up on hybrids because recurrent state cannot be trimmed. This cache keeps
//! **snapshots** of the whole model cache at token boundaries (the end of a
//! prompt, the end of a generation, prefill chunk boundaries). Snapshots are
//! O(layers) copies: MLX arrays are reference counted, and a KV buffer is
//! only copied when a later write finds it shared.
//!
//! A lookup finds the entry sharing the longest prefix with the new prompt
//! and restores the latest snapshot at or before that prefix (for caches
//! that are all trimmable, a later snapshot trimmed back to the prefix), so
//! only the rest of the prompt is computed. At least one prompt token is
//! always left to compute, since generation needs its logits.
//!
//! The cache is bounded by entries and by bytes (least recently used goes
//! first) and can be saved to and loaded from a safetensors file carrying a
//! model fingerprint.

use crate::restore::cache_from_tensors;
use mlex_core::cache::CacheTensors;
use mlex_core::error::{Error, Result};
use mlex_core::model::ModelCache;
use mlx_rs::Array;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

struct Entry {
    tokens: Vec<u32>,
    /// boundary (tokens covered) → cache state after exactly that many tokens.
    snapshots: BTreeMap<usize, ModelCache>,
    last_used: u64,
}

impl Entry {
    fn nbytes(&self) -> usize {
        self.snapshots.values().map(ModelCache::nbytes).sum()
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

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PromptCache {
    /// A cache holding at most `max_entries` sequences and `max_bytes`
    /// bytes of snapshots.
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

    /// Bytes held by all snapshots (logical; shared buffers count once per
    /// snapshot).
    pub fn nbytes(&self) -> usize {
        self.entries.iter().map(Entry::nbytes).sum()
    }

    /// Finds the longest reusable prefix of `tokens`.
    pub fn lookup(&mut self, tokens: &[u32]) -> Option<PrefixHit> {
        if tokens.is_empty() {
            return None;
        }
        let limit = tokens.len() - 1;
        let mut best: Option<(usize, usize, usize)> = None; // (reused, entry, boundary)
        for (i, e) in self.entries.iter().enumerate() {
            let shared = common_prefix(&e.tokens, tokens).min(limit);
            if shared == 0 {
                continue;
            }
            // Latest snapshot at or before the shared prefix.
            let exact = e.snapshots.range(..=shared).next_back().map(|(b, _)| *b);
            // A later snapshot trimmed back, when nothing in it is recurrent.
            let trimmed = e
                .snapshots
                .range(shared..)
                .find(|(_, c)| c.is_trimmable())
                .map(|_| shared);
            let reuse = match (exact, trimmed) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            if let Some(r) = reuse.filter(|r| *r > 0) {
                if best.is_none_or(|(b, _, _)| r > b) {
                    let boundary = if exact == Some(r) {
                        r
                    } else {
                        *e.snapshots.range(shared..).next().expect("found above").0
                    };
                    best = Some((r, i, boundary));
                }
            }
        }
        let (reused, i, boundary) = best?;
        self.clock += 1;
        let e = &mut self.entries[i];
        e.last_used = self.clock;
        let mut cache = e.snapshots[&boundary].clone();
        if boundary > reused {
            cache.trim(boundary - reused).ok()?;
        }
        Some(PrefixHit { cache, reused })
    }

    /// Records `tokens` with snapshots `(boundary, cache after boundary
    /// tokens)`. An entry whose tokens extend an existing one replaces it
    /// and keeps its snapshots.
    pub fn insert(&mut self, tokens: &[u32], snapshots: Vec<(usize, ModelCache)>) {
        self.clock += 1;
        let mut merged: BTreeMap<usize, ModelCache> = BTreeMap::new();
        self.entries.retain_mut(|e| {
            let extends = e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens);
            if extends {
                merged.append(&mut e.snapshots);
            }
            !extends
        });
        for (b, c) in snapshots {
            if b <= tokens.len() {
                merged.insert(b, c);
            }
        }
        if merged.is_empty() {
            return;
        }
        self.entries.push(Entry {
            tokens: tokens.to_vec(),
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
        // A single entry over budget keeps only its latest snapshot.
        if self.nbytes() > self.max_bytes {
            if let Some(e) = self.entries.first_mut() {
                while e.snapshots.len() > 1 {
                    let first = *e.snapshots.keys().next().expect("non-empty");
                    e.snapshots.remove(&first);
                }
            }
        }
    }

    /// Saves every entry to a safetensors file stamped with `fingerprint`.
    pub fn save(&self, path: &Path, fingerprint: &str) -> Result<()> {
        let mut arrays: Vec<(String, Array)> = Vec::new();
        let mut entries = Vec::new();
        for (ei, e) in self.entries.iter().enumerate() {
            let mut snaps = Vec::new();
            for (b, cache) in &e.snapshots {
                let mut layers = Vec::new();
                for (li, caches) in cache.layers.iter().enumerate() {
                    let mut metas = Vec::new();
                    for (ci, c) in caches.iter().enumerate() {
                        let t = c.to_tensors();
                        for (name, a) in t.arrays {
                            arrays.push((format!("e{ei}.s{b}.l{li}.c{ci}.{name}"), a));
                        }
                        metas.push(SavedCache {
                            kind: c.kind().to_owned(),
                            meta: t.meta,
                        });
                    }
                    layers.push(metas);
                }
                snaps.push(SavedSnapshot {
                    boundary: *b,
                    layers,
                });
            }
            entries.push(SavedEntry {
                tokens: e.tokens.clone(),
                snapshots: snaps,
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
        Array::save_safetensors(arrays.iter().map(|(n, a)| (n.as_str(), a)), &meta, path)
            .map_err(|e| Error::Other(format!("{}: {e}", path.display())))?;
        Ok(())
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
        for (ei, e) in header.entries.into_iter().enumerate() {
            let mut snapshots = Vec::new();
            for s in e.snapshots {
                let mut layers = Vec::new();
                for (li, caches) in s.layers.into_iter().enumerate() {
                    let mut out = Vec::new();
                    for (ci, c) in caches.into_iter().enumerate() {
                        let prefix = format!("e{ei}.s{}.l{li}.c{ci}.", s.boundary);
                        let names: Vec<String> = arrays
                            .keys()
                            .filter(|k| k.starts_with(&prefix))
                            .cloned()
                            .collect();
                        let mut t = CacheTensors {
                            arrays: BTreeMap::new(),
                            meta: c.meta,
                        };
                        for n in names {
                            let a = arrays.remove(&n).expect("listed");
                            t.arrays.insert(n[prefix.len()..].to_owned(), a);
                        }
                        out.push(cache_from_tensors(&c.kind, &t)?);
                    }
                    layers.push(out);
                }
                snapshots.push((s.boundary, ModelCache { layers }));
            }
            self.insert(&e.tokens, snapshots);
        }
        Ok(())
    }
}

const FORMAT: &str = "mlex-prompt-cache-1";
const META_KEY: &str = "mlex.prompt_cache";

#[derive(Serialize, Deserialize)]
struct SavedHeader {
    format: String,
    fingerprint: String,
    entries: Vec<SavedEntry>,
}

#[derive(Serialize, Deserialize)]
struct SavedEntry {
    tokens: Vec<u32>,
    snapshots: Vec<SavedSnapshot>,
}

#[derive(Serialize, Deserialize)]
struct SavedSnapshot {
    boundary: usize,
    layers: Vec<Vec<SavedCache>>,
}

#[derive(Serialize, Deserialize)]
struct SavedCache {
    kind: String,
    meta: BTreeMap<String, String>,
}
