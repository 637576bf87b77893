//! The registry of architectures and layer kinds, on `inventory`.
//!
//! Users see one macro per thing ([`register_architecture!`],
//! [`register_layer_kind!`], [`register_cache_kind!`]); any crate linked
//! into the binary can use them, ours or not. [`Registry::from_inventory`]
//! collects every registration and fails loudly, naming both origins, when
//! two share a name; it can list everything it holds with where each came
//! from. A saved cache is rebuilt by its kind's registered constructor
//! ([`restore_cache`]), so a downstream layer kind's state round-trips
//! through a saved prompt cache like the built-in kinds' do.
//!
//! [`register_architecture!`]: crate::register_architecture
//! [`register_layer_kind!`]: crate::register_layer_kind
//! [`register_cache_kind!`]: crate::register_cache_kind

use crate::arch::Architecture;
use crate::cache::{Cache, CacheTensors};
use crate::error::{Error, Result};
use crate::layer::LayerKind;
use std::collections::BTreeMap;
use std::sync::Arc;

/// An architecture registration (made by [`crate::register_architecture!`]).
pub struct ArchitectureEntry {
    /// The `model_type`.
    pub name: &'static str,
    /// The registering module.
    pub origin: &'static str,
    /// Constructor.
    pub build: fn() -> Box<dyn Architecture>,
}

/// A layer-kind registration (made by [`crate::register_layer_kind!`]).
pub struct LayerKindEntry {
    /// The kind name.
    pub name: &'static str,
    /// The registering module.
    pub origin: &'static str,
    /// Constructor.
    pub build: fn() -> Box<dyn LayerKind>,
}

/// A cache-kind registration (made by [`crate::register_cache_kind!`]):
/// how a cache saved with [`Cache::to_tensors`] is rebuilt.
pub struct CacheKindEntry {
    /// The kind name ([`Cache::kind`]).
    pub name: &'static str,
    /// The registering module.
    pub origin: &'static str,
    /// One-line description (for `mlex list`).
    pub summary: &'static str,
    /// Rebuilds a saved cache of this kind.
    pub restore: fn(&CacheTensors) -> Result<Box<dyn Cache>>,
}

inventory::collect!(ArchitectureEntry);
inventory::collect!(LayerKindEntry);
inventory::collect!(CacheKindEntry);

/// Registers how a saved cache of a kind is rebuilt:
/// `register_cache_kind!("kv", "attention keys and values", |t| Ok(Box::new(KvCache::from_tensors(t)?)));`
#[macro_export]
macro_rules! register_cache_kind {
    ($name:literal, $summary:literal, $restore:expr) => {
        $crate::inventory::submit! {
            $crate::registry::CacheKindEntry {
                name: $name,
                origin: module_path!(),
                summary: $summary,
                restore: $restore,
            }
        }
    };
}

/// Rebuilds a cache saved with [`Cache::to_tensors`] through its kind's
/// registration; an unknown kind is an error listing the known ones, and a
/// kind registered twice an error naming both origins.
pub fn restore_cache(kind: &str, tensors: &CacheTensors) -> Result<Box<dyn Cache>> {
    let mut found = inventory::iter::<CacheKindEntry>
        .into_iter()
        .filter(|e| e.name == kind);
    let Some(entry) = found.next() else {
        let mut known: Vec<&str> = inventory::iter::<CacheKindEntry>
            .into_iter()
            .map(|e| e.name)
            .collect();
        known.sort_unstable();
        return Err(Error::Cache(format!(
            "unknown cache kind `{kind}` in a saved cache (registered: {}); the crate that registers it must be linked",
            known.join(", ")
        )));
    };
    if let Some(other) = found.next() {
        return Err(Error::DuplicateRegistration {
            what: "cache kind",
            name: kind.to_owned(),
            first: entry.origin.to_owned(),
            second: other.origin.to_owned(),
        });
    }
    (entry.restore)(tensors)
}

/// Registers an architecture under its `model_type`:
/// `register_architecture!("llama", Llama);`
#[macro_export]
macro_rules! register_architecture {
    ($name:literal, $value:expr) => {
        $crate::inventory::submit! {
            $crate::registry::ArchitectureEntry {
                name: $name,
                origin: module_path!(),
                build: || -> ::std::boxed::Box<dyn $crate::arch::Architecture> {
                    ::std::boxed::Box::new($value)
                },
            }
        }
    };
}

/// Registers a layer kind: `register_layer_kind!("attention", AttentionKind);`
#[macro_export]
macro_rules! register_layer_kind {
    ($name:literal, $value:expr) => {
        $crate::inventory::submit! {
            $crate::registry::LayerKindEntry {
                name: $name,
                origin: module_path!(),
                build: || -> ::std::boxed::Box<dyn $crate::layer::LayerKind> {
                    ::std::boxed::Box::new($value)
                },
            }
        }
    };
}

struct Slot<T: ?Sized> {
    item: Arc<T>,
    origin: String,
}

/// Everything registered, by name.
#[derive(Default)]
pub struct Registry {
    archs: BTreeMap<String, Slot<dyn Architecture>>,
    kinds: BTreeMap<String, Slot<dyn LayerKind>>,
    /// Cache kinds by name: (origin, summary).
    caches: BTreeMap<String, (String, String)>,
}

/// One line of [`Registry::list`].
#[derive(Clone, Debug)]
pub struct Listing {
    /// `architecture`, `layer kind` or `cache kind`.
    pub what: &'static str,
    /// Registered name.
    pub name: String,
    /// Where it came from (module path or file).
    pub origin: String,
    /// One-line summary.
    pub summary: String,
    /// The config keys an architecture's parameters read, or the options a
    /// layer kind takes (empty for cache kinds).
    pub config_keys: Vec<String>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Everything registered with the macros in linked crates.
    pub fn from_inventory() -> Result<Self> {
        let mut r = Self::new();
        for e in inventory::iter::<ArchitectureEntry> {
            let arch = (e.build)();
            if arch.name() != e.name {
                return Err(Error::Other(format!(
                    "architecture registered as `{}` by {} reports the name `{}`",
                    e.name,
                    e.origin,
                    arch.name()
                )));
            }
            r.add_architecture(Arc::from(arch), e.origin)?;
        }
        for e in inventory::iter::<LayerKindEntry> {
            let kind = (e.build)();
            if kind.name() != e.name {
                return Err(Error::Other(format!(
                    "layer kind registered as `{}` by {} reports the name `{}`",
                    e.name,
                    e.origin,
                    kind.name()
                )));
            }
            r.add_layer_kind(Arc::from(kind), e.origin)?;
        }
        for e in inventory::iter::<CacheKindEntry> {
            if let Some((prev, _)) = r.caches.get(e.name) {
                return Err(Error::DuplicateRegistration {
                    what: "cache kind",
                    name: e.name.to_owned(),
                    first: prev.clone(),
                    second: e.origin.to_owned(),
                });
            }
            r.caches.insert(
                e.name.to_owned(),
                (e.origin.to_owned(), e.summary.to_owned()),
            );
        }
        Ok(r)
    }

    /// Adds an architecture; a taken name is an error naming both origins.
    pub fn add_architecture(
        &mut self,
        arch: Arc<dyn Architecture>,
        origin: impl Into<String>,
    ) -> Result<()> {
        let name = arch.name().to_owned();
        let origin = origin.into();
        if let Some(prev) = self.archs.get(&name) {
            return Err(Error::DuplicateRegistration {
                what: "architecture",
                name,
                first: prev.origin.clone(),
                second: origin,
            });
        }
        self.archs.insert(name, Slot { item: arch, origin });
        Ok(())
    }

    /// Adds a layer kind; a taken name is an error naming both origins.
    pub fn add_layer_kind(
        &mut self,
        kind: Arc<dyn LayerKind>,
        origin: impl Into<String>,
    ) -> Result<()> {
        let name = kind.name().to_owned();
        let origin = origin.into();
        if let Some(prev) = self.kinds.get(&name) {
            return Err(Error::DuplicateRegistration {
                what: "layer kind",
                name,
                first: prev.origin.clone(),
                second: origin,
            });
        }
        self.kinds.insert(name, Slot { item: kind, origin });
        Ok(())
    }

    /// The architecture for `model_type`.
    pub fn architecture(&self, model_type: &str) -> Result<Arc<dyn Architecture>> {
        self.archs
            .get(model_type)
            .map(|s| s.item.clone())
            .ok_or_else(|| Error::UnknownArchitecture {
                model_type: model_type.to_owned(),
                file: None,
                known: self.archs.keys().cloned().collect(),
            })
    }

    /// The layer kind called `name`.
    pub fn layer_kind(&self, name: &str) -> Result<Arc<dyn LayerKind>> {
        self.kinds
            .get(name)
            .map(|s| s.item.clone())
            .ok_or_else(|| Error::UnknownLayerKind {
                kind: name.to_owned(),
                context: None,
                known: self.kinds.keys().cloned().collect(),
            })
    }

    /// Registered architecture names.
    pub fn architecture_names(&self) -> Vec<String> {
        self.archs.keys().cloned().collect()
    }

    /// Everything held, architectures first, each with its origin.
    pub fn list(&self) -> Vec<Listing> {
        let mut out: Vec<Listing> = self
            .archs
            .iter()
            .map(|(name, s)| Listing {
                what: "architecture",
                name: name.clone(),
                origin: s.origin.clone(),
                summary: s.item.summary().to_owned(),
                config_keys: s.item.config_keys(),
            })
            .collect();
        out.extend(self.kinds.iter().map(|(name, s)| {
            Listing {
                what: "layer kind",
                name: name.clone(),
                origin: s.origin.clone(),
                summary: s.item.summary().to_owned(),
                config_keys: s
                    .item
                    .option_keys()
                    .iter()
                    .map(|k| (*k).to_owned())
                    .collect(),
            }
        }));
        out.extend(self.caches.iter().map(|(name, (origin, summary))| Listing {
            what: "cache kind",
            name: name.clone(),
            origin: origin.clone(),
            summary: summary.clone(),
            config_keys: Vec::new(),
        }));
        out
    }
}
