//! The registry of architectures and layer kinds, on `inventory`.
//!
//! Users see one macro per thing ([`register_architecture!`],
//! [`register_mixer_kind!`], [`register_layer_kind!`],
//! [`register_cache_kind!`]); any crate linked
//! into the binary can use them, ours or not. [`Registry::from_inventory`]
//! collects every registration and fails loudly, naming both origins, when
//! two share a name; it can list everything it holds with where each came
//! from. A saved cache is rebuilt by its kind's registered constructor
//! ([`restore_cache`]), so a downstream layer kind's state round-trips
//! through a saved prompt cache like the built-in kinds' do.
//!
//! [`register_architecture!`]: crate::register_architecture
//! [`register_layer_kind!`]: crate::register_layer_kind
//! [`register_mixer_kind!`]: crate::register_mixer_kind
//! [`register_cache_kind!`]: crate::register_cache_kind

use crate::arch::Architecture;
use crate::cache::{Cache, CacheTensors};
use crate::error::{Error, Result};
use crate::layer::{LayerKind, MixerKind};
use std::collections::BTreeMap;
use std::sync::Arc;

/// A registration of something built by name: an architecture
/// ([`ArchitectureEntry`]), a layer kind ([`LayerKindEntry`]) or a mixer
/// kind ([`MixerKindEntry`]), made by the `register_*!` macros.
pub struct Entry<T: ?Sized + 'static> {
    /// The registered name (`model_type` or kind name).
    pub name: &'static str,
    /// The registering module.
    pub origin: &'static str,
    /// Constructor.
    pub build: fn() -> Box<T>,
}

/// An architecture registration (made by [`crate::register_architecture!`]).
pub type ArchitectureEntry = Entry<dyn Architecture>;
/// A layer-kind registration (made by [`crate::register_layer_kind!`]).
pub type LayerKindEntry = Entry<dyn LayerKind>;
/// A mixer-kind registration (made by [`crate::register_mixer_kind!`]).
pub type MixerKindEntry = Entry<dyn MixerKind>;

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

inventory::collect!(Entry<dyn Architecture>);
inventory::collect!(Entry<dyn LayerKind>);
inventory::collect!(Entry<dyn MixerKind>);
inventory::collect!(CacheKindEntry);

/// Registers how a saved cache of a kind is rebuilt:
/// `register_cache_kind!("kv", "attention keys and values", |t| Ok(Box::new(KvCache::from_tensors(t)?)));`
/// One invocation may register several kinds, separated by `;`.
#[macro_export]
macro_rules! register_cache_kind {
    ($($name:literal, $summary:literal, $restore:expr);+ $(;)?) => {
        $($crate::inventory::submit! {
            $crate::registry::CacheKindEntry {
                name: $name,
                origin: module_path!(),
                summary: $summary,
                restore: $restore,
            }
        })+
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

/// Registers a layer kind: `register_layer_kind!("block", BlockKind);`, or
/// defines and registers one from its typed options and a build function:
///
/// ```ignore
/// register_layer_kind! {
///     /// The registered `block` layer kind.
///     kind BlockKind = "block" {
///         options: BlockOptions,
///         state: StateKind::GrowingAndFixed,
///         summary: "pre-norm mixer + residual, ...",
///         build: Block::build, // fn(&mut BuildCtx, &BlockOptions) -> Result<Block>
///     }
/// }
/// ```
#[macro_export]
macro_rules! register_layer_kind {
    ($($args:tt)*) => {
        $crate::__register_kind!(LayerKindEntry, LayerKind, Layer; $($args)*);
    };
}

/// Registers a mixer kind: `register_mixer_kind!("mamba2", Mamba2Kind);`,
/// or defines and registers one as [`register_layer_kind!`] does, its
/// build function returning the mixer.
#[macro_export]
macro_rules! register_mixer_kind {
    ($($args:tt)*) => {
        $crate::__register_kind!(MixerKindEntry, MixerKind, Mixer; $($args)*);
    };
}

/// [`register_layer_kind!`] and [`register_mixer_kind!`] for the registry
/// entry `ENTRY` of kinds `TRAIT` that build a `BUILT`.
#[doc(hidden)]
#[macro_export]
macro_rules! __register_kind {
    ($entry:ident, $trait:ident, $built:ident; $name:literal, $value:expr) => {
        $crate::__submit_kind!($entry, $trait, $name, $value);
    };
    ($entry:ident, $trait:ident, $built:ident; $(#[$meta:meta])* kind $kind:ident = $name:literal {
        options: $options:ty, state: $state:expr, summary: $summary:literal, build: $build:path $(,)?
    }) => {
        $crate::__kind_impl!($(#[$meta])* $kind, $trait, $built, $name, $options, $state, $summary, $build);
        $crate::__submit_kind!($entry, $trait, $name, $kind);
    };
}

/// The registration of a layer or mixer kind (`ENTRY` names the registry
/// entry type, `TRAIT` the kind trait it builds).
#[doc(hidden)]
#[macro_export]
macro_rules! __submit_kind {
    ($entry:ident, $trait:ident, $name:literal, $value:expr) => {
        $crate::inventory::submit! {
            $crate::registry::$entry {
                name: $name,
                origin: module_path!(),
                build: || -> ::std::boxed::Box<dyn $crate::layer::$trait> {
                    ::std::boxed::Box::new($value)
                },
            }
        }
    };
}

/// The kind struct and its trait impl for [`register_layer_kind!`] and
/// [`register_mixer_kind!`]: options parsed strictly, errors naming the
/// layer and the kind.
#[doc(hidden)]
#[macro_export]
macro_rules! __kind_impl {
    ($(#[$meta:meta])* $kind:ident, $trait:ident, $built:ident, $name:literal, $options:ty,
     $state:expr, $summary:literal, $build:path) => {
        $(#[$meta])*
        pub struct $kind;

        impl $crate::layer::$trait for $kind {
            fn name(&self) -> &'static str {
                $name
            }
            fn option_keys(&self) -> &'static [&'static str] {
                $crate::config::struct_fields::<$options>()
            }
            fn state(&self) -> $crate::layer::StateKind {
                $state
            }
            fn summary(&self) -> &'static str {
                $summary
            }
            fn build(
                &self,
                ctx: &mut $crate::layer::BuildCtx<'_>,
            ) -> $crate::error::Result<::std::boxed::Box<dyn $crate::layer::$built>> {
                let o: $options = $crate::config::parse_value(
                    ctx.options,
                    ctx.config.file(),
                    &format!("options of layer {} ({})", ctx.index, $name),
                )?;
                Ok(::std::boxed::Box::new($build(ctx, &o)?))
            }
        }
    };
}

struct Slot<T: ?Sized> {
    item: Arc<T>,
    origin: String,
}

/// A registration's constructor must build the thing it was registered as.
fn same_name(what: &str, registered: &str, origin: &str, reported: &str) -> Result<()> {
    if registered == reported {
        return Ok(());
    }
    Err(Error::Other(format!(
        "{what} registered as `{registered}` by {origin} reports the name `{reported}`"
    )))
}

/// Builds every registration of `Entry<T>`, checks that each reports the
/// name it was registered under and hands it to `add` with its origin.
fn each_built<T: ?Sized + 'static>(
    what: &str,
    name_of: fn(&T) -> &str,
    mut add: impl FnMut(Arc<T>, &'static str) -> Result<()>,
) -> Result<()>
where
    Entry<T>: inventory::Collect,
{
    for e in inventory::iter::<Entry<T>> {
        let item = (e.build)();
        same_name(what, e.name, e.origin, name_of(&item))?;
        add(Arc::from(item), e.origin)?;
    }
    Ok(())
}

/// Everything registered, by name.
#[derive(Default)]
pub struct Registry {
    archs: BTreeMap<String, Slot<dyn Architecture>>,
    kinds: BTreeMap<String, Slot<dyn LayerKind>>,
    mixers: BTreeMap<String, Slot<dyn MixerKind>>,
    /// Cache kinds by name: (origin, summary).
    caches: BTreeMap<String, (String, String)>,
}

/// One line of [`Registry::list`].
#[derive(Clone, Debug)]
pub struct Listing {
    /// `architecture`, `layer kind`, `mixer kind` or `cache kind`.
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
        each_built::<dyn Architecture>(
            "architecture",
            |a| a.name(),
            |a, o| r.add_architecture(a, o),
        )?;
        each_built::<dyn LayerKind>("layer kind", |k| k.name(), |k, o| r.add_layer_kind(k, o))?;
        each_built::<dyn MixerKind>("mixer kind", |k| k.name(), |k, o| r.add_mixer_kind(k, o))?;
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

    /// The origin of the layer or mixer kind called `name` (a spec names
    /// either by the same name, so the two share one namespace).
    fn kind_origin(&self, name: &str) -> Option<&String> {
        let layer = self.kinds.get(name).map(|s| &s.origin);
        layer.or(self.mixers.get(name).map(|s| &s.origin))
    }

    fn check_kind_name(&self, what: &'static str, name: &str, origin: &str) -> Result<()> {
        match self.kind_origin(name) {
            Some(prev) => Err(Error::DuplicateRegistration {
                what,
                name: name.to_owned(),
                first: prev.clone(),
                second: origin.to_owned(),
            }),
            None => Ok(()),
        }
    }

    /// Adds a layer kind; a name taken by a layer or a mixer kind is an
    /// error naming both origins.
    pub fn add_layer_kind(
        &mut self,
        kind: Arc<dyn LayerKind>,
        origin: impl Into<String>,
    ) -> Result<()> {
        let (name, origin) = (kind.name().to_owned(), origin.into());
        self.check_kind_name("layer kind", &name, &origin)?;
        self.kinds.insert(name, Slot { item: kind, origin });
        Ok(())
    }

    /// Adds a mixer kind; a name taken by a mixer or a layer kind is an
    /// error naming both origins.
    pub fn add_mixer_kind(
        &mut self,
        kind: Arc<dyn MixerKind>,
        origin: impl Into<String>,
    ) -> Result<()> {
        let (name, origin) = (kind.name().to_owned(), origin.into());
        self.check_kind_name("mixer kind", &name, &origin)?;
        self.mixers.insert(name, Slot { item: kind, origin });
        Ok(())
    }

    /// The mixer kind called `name`, if one is registered.
    pub fn mixer_kind(&self, name: &str) -> Option<Arc<dyn MixerKind>> {
        self.mixers.get(name).map(|s| s.item.clone())
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
                known: {
                    let mut k: Vec<String> = self
                        .kinds
                        .keys()
                        .chain(self.mixers.keys())
                        .cloned()
                        .collect();
                    k.sort();
                    k
                },
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
        // Layer and mixer kinds list alike: name, origin, summary, options.
        let layers = self.kinds.iter().map(|(n, s)| {
            let (summary, keys) = (s.item.summary(), s.item.option_keys());
            ("layer kind", n, &s.origin, summary, keys)
        });
        let mixers = self.mixers.iter().map(|(n, s)| {
            let (summary, keys) = (s.item.summary(), s.item.option_keys());
            ("mixer kind", n, &s.origin, summary, keys)
        });
        out.extend(
            layers
                .chain(mixers)
                .map(|(what, name, origin, summary, keys)| Listing {
                    what,
                    name: name.clone(),
                    origin: origin.clone(),
                    summary: summary.to_owned(),
                    config_keys: keys.iter().map(|k| (*k).to_owned()).collect(),
                }),
        );
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
