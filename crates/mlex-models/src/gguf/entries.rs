//! How a `[gguf.config]` entry is read: a metadata key ([`MetaKey`]) of a
//! type ([`MetaType`]), what stands in when the file has none, and how it
//! derives from other entries (a difference, an exact quotient, a multiple
//! checked, the largest of a per-layer array). Every error names the file
//! and the metadata key.

use super::family::GgufSpec;
use super::{bad, Meta};
use crate::gguf_file::MetaValue;
use mlex_core::error::Result;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::BTreeSet;

/// Where one `config.json` entry comes from: a metadata key (a positive
/// count, required), or a table.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MetaKey {
    /// A required positive count.
    Count(String),
    /// Anything else.
    Table(Box<MetaKeyTable>),
}

/// A metadata key with its type and what stands in when it is absent.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetaKeyTable {
    /// The metadata key; with `keys`, the first present of several.
    pub key: Option<String>,
    /// Alternative keys, the first present wins.
    pub keys: Vec<String>,
    /// The value's type.
    #[serde(rename = "type")]
    pub ty: MetaType,
    /// The value when the file has none.
    pub default: Option<toml::Value>,
    /// Another config entry's value when the file has none.
    pub or: Option<String>,
    /// Left out of the config when the file has none.
    pub optional: bool,
    /// Another config entry this one may not exceed.
    pub at_most: Option<String>,
    /// Read only when this other entry is present and not zero (the
    /// experts' settings of a file that may have none).
    pub when: Option<String>,
    /// Less this other entry (the trunk's layers: the blocks less the
    /// multi-token-prediction ones).
    pub minus: Option<String>,
    /// Divided by this other entry (a head's width from the heads' total):
    /// exactly, for an integer.
    pub per: Option<String>,
    /// Other entries the metadata value must be a multiple of.
    pub multiple_of: Vec<String>,
    /// An integer list: its first this many.
    pub first: Option<usize>,
    /// An integer: at least this.
    pub at_least: Option<i64>,
}

/// The type of a metadata value.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MetaType {
    /// A positive integer that fits an `i32`.
    #[default]
    Count,
    /// Any integer.
    Int,
    /// A number.
    Float,
    /// A boolean (or an integer, not zero for true).
    Bool,
    /// An array of integers (left out when empty).
    IntList,
    /// The largest of a per-layer array of non-negative integers (one value
    /// a block), or the one value given for every block.
    MaxPerLayer,
}

impl MetaKey {
    fn table(&self) -> MetaKeyTable {
        match self {
            MetaKey::Count(k) => MetaKeyTable {
                key: Some(k.clone()),
                ..MetaKeyTable::default()
            },
            MetaKey::Table(t) => (**t).clone(),
        }
    }
}

impl MetaKeyTable {
    /// The other entries this one is computed from.
    fn depends_on(&self) -> impl Iterator<Item = &String> {
        [&self.or, &self.when, &self.minus, &self.per]
            .into_iter()
            .flatten()
            .chain(&self.multiple_of)
    }
}

/// Sets `name` in `out`; a dotted name sets an entry of a nested object.
pub(super) fn insert(out: &mut Map<String, Value>, name: &str, v: Value) {
    match name.split_once('.') {
        None => {
            out.insert(name.to_owned(), v);
        }
        Some((outer, rest)) => {
            let inner = out
                .entry(outer.to_owned())
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(m) = inner {
                insert(m, rest, v);
            }
        }
    }
}

/// The value of a (possibly dotted) entry of `out`.
fn lookup<'v>(out: &'v Map<String, Value>, name: &str) -> Option<&'v Value> {
    match name.split_once('.') {
        None => out.get(name),
        Some((outer, rest)) => lookup(out.get(outer)?.as_object()?, rest),
    }
}

impl GgufSpec {
    /// The `config.json` entries the metadata gives (with `set`); the
    /// entries that depend on the tensors (`blocks_without`, `has_tensor`,
    /// the vocabulary) are the loader's.
    pub(super) fn config(&self, meta: &Meta) -> Result<Map<String, Value>> {
        let arch = &self.architecture;
        let mut out = Map::new();
        let entries: Vec<(&String, MetaKeyTable)> =
            self.config.iter().map(|(c, k)| (c, k.table())).collect();
        // Each entry after those it is computed from.
        let mut done: BTreeSet<&str> = BTreeSet::new();
        while done.len() < entries.len() {
            let before = done.len();
            for (name, e) in &entries {
                let ready = e
                    .depends_on()
                    .all(|d| done.contains(d.as_str()) || !self.config.contains_key(d.as_str()));
                if done.contains(name.as_str()) || !ready {
                    continue;
                }
                if let Some(v) = self.entry(meta, name, e, &out)? {
                    insert(&mut out, name, v);
                }
                done.insert(name.as_str());
            }
            if done.len() == before {
                return Err(bad(
                    meta.path,
                    format!("gguf config entries of `{arch}` depend on each other in a circle"),
                ));
            }
        }
        for (name, e) in &entries {
            let Some(other) = &e.at_most else { continue };
            let (v, limit) = (lookup(&out, name), lookup(&out, other));
            if let (Some(v), Some(limit)) =
                (v.and_then(Value::as_i64), limit.and_then(Value::as_i64))
            {
                if v > limit {
                    return Err(bad(
                        meta.path,
                        format!(
                            "metadata `{}` ({v}) exceeds `{}` ({limit})",
                            self.key_of(name),
                            self.key_of(other)
                        ),
                    ));
                }
            }
        }
        for (k, v) in &self.set {
            let v = serde_json::to_value(v)
                .map_err(|x| bad(meta.path, format!("gguf set `{k}`: {x}")))?;
            insert(&mut out, k, v);
        }
        Ok(out)
    }

    /// The metadata key (with its prefix) of config entry `name`, for
    /// messages; the entry's name when it has none.
    fn key_of(&self, name: &str) -> String {
        self.config
            .get(name)
            .and_then(|k| {
                let t = k.table();
                t.key.or_else(|| t.keys.first().cloned())
            })
            .map(|k| format!("{}.{k}", self.architecture))
            .unwrap_or_else(|| name.to_owned())
    }

    /// One entry's value, from the metadata and the entries before it.
    fn entry(
        &self,
        meta: &Meta,
        name: &str,
        e: &MetaKeyTable,
        out: &Map<String, Value>,
    ) -> Result<Option<Value>> {
        let full = |k: &str| format!("{}.{k}", self.architecture);
        let other = |n: &str| lookup(out, n).and_then(Value::as_f64);
        if let Some(w) = &e.when {
            if other(w).unwrap_or(0.0) == 0.0 {
                return Ok(None);
            }
        }
        let keys: Vec<&String> = e.key.iter().chain(&e.keys).collect();
        let Some(key) = keys
            .iter()
            .map(|k| full(k))
            .find(|k| meta.meta.contains_key(k))
        else {
            return match (&e.default, &e.or) {
                (Some(d), _) => {
                    Ok(Some(serde_json::to_value(d).map_err(|x| {
                        bad(meta.path, format!("gguf default of `{name}`: {x}"))
                    })?))
                }
                (None, Some(o)) => Ok(lookup(out, o).cloned()),
                (None, None) if e.optional => Ok(None),
                (None, None) => {
                    let key = keys.first().map(|k| full(k)).unwrap_or_default();
                    Err(bad(meta.path, format!("metadata `{key}` is missing")))
                }
            };
        };
        let mut v = read(meta, &key, e.ty)?;
        if let Some(n) = e.first {
            if let Value::Array(a) = &mut v {
                a.truncate(n);
            }
        }
        if matches!(&v, Value::Array(a) if a.is_empty()) {
            return Ok(None);
        }
        // `x` divided by entry `m`'s value, exactly, or an error naming both keys.
        let divide = |x: i64, m: &str| -> Result<i64> {
            let d = other(m).unwrap_or(1.0) as i64;
            if d == 0 || x % d != 0 {
                return Err(bad(
                    meta.path,
                    format!(
                        "metadata `{key}` ({x}) must be a multiple of `{}` ({d})",
                        self.key_of(m)
                    ),
                ));
            }
            Ok(x / d)
        };
        for m in &e.multiple_of {
            divide(v.as_i64().unwrap_or(0), m)?;
        }
        if let Some(m) = &e.minus {
            let (x, d) = (v.as_i64().unwrap_or(0), other(m).unwrap_or(0.0) as i64);
            // A negative count taken away would add blocks the file lacks.
            if d < 0 {
                return Err(bad(
                    meta.path,
                    format!("metadata `{}` ({d}) must not be negative", self.key_of(m)),
                ));
            }
            if x - d < 1 {
                return Err(bad(
                    meta.path,
                    format!(
                        "metadata `{key}` ({x}) must exceed `{}` ({d})",
                        self.key_of(m)
                    ),
                ));
            }
            v = json!(x - d);
        }
        if let Some(p) = &e.per {
            let d = other(p).unwrap_or(1.0);
            v = match e.ty {
                MetaType::Float => json!(v.as_f64().unwrap_or(0.0) / d),
                _ => json!(divide(v.as_i64().unwrap_or(0), p)?),
            };
        }
        if let (Some(min), Some(x)) = (e.at_least, v.as_i64()) {
            v = json!(x.max(min));
        }
        Ok(Some(v))
    }
}

/// The value of metadata `key` as `ty`, or an error naming the file and key.
fn read(meta: &Meta, key: &str, ty: MetaType) -> Result<Value> {
    Ok(match ty {
        MetaType::Float => json!(meta.f64(key)?.expect("present")),
        MetaType::Int => json!(meta.i64(key)?.expect("present")),
        MetaType::Count => {
            let v = meta.i64(key)?.expect("present");
            json!(mlex_core::config::count(v)
                .map_err(|m| bad(meta.path, format!("metadata `{key}` {m}")))?)
        }
        MetaType::Bool => match meta.meta.get(key) {
            Some(MetaValue::Bool(b)) => json!(*b),
            _ => json!(meta.i64(key)?.expect("present") != 0),
        },
        MetaType::IntList => json!(meta.ints(key)?),
        MetaType::MaxPerLayer => json!(per_layer(meta, key)?.into_iter().max().unwrap_or(0)),
    })
}

/// A per-layer array of non-negative integers (one value a block, the
/// family's `block_count`), or one value for every block.
pub(super) fn per_layer(meta: &Meta, key: &str) -> Result<Vec<i64>> {
    let arch = key.split_once('.').map_or("", |(a, _)| a);
    let blocks = meta
        .i64(&format!("{arch}.block_count"))?
        .unwrap_or(0)
        .max(0) as usize;
    let v: Vec<i64> = match meta.meta.get(key) {
        Some(MetaValue::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_i64()
                    .ok_or_else(|| bad(meta.path, format!("metadata `{key}` holds a non-integer")))
            })
            .collect::<Result<_>>()?,
        Some(x) => {
            vec![
                x.as_i64()
                    .ok_or_else(|| bad(meta.path, format!("metadata `{key}` is not an integer")))?;
                blocks
            ]
        }
        None => return Err(bad(meta.path, format!("metadata `{key}` is missing"))),
    };
    if v.len() != blocks || v.iter().any(|&x| x < 0) {
        return Err(bad(
            meta.path,
            format!(
                "metadata `{key}` must hold {blocks} non-negative values (one per layer), not {v:?}"
            ),
        ));
    }
    Ok(v)
}
