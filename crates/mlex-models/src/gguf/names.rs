//! llama.cpp's tensor names → mlx-lm's: the one table (`names.toml`) every
//! GGUF loader here renames by. What the loaders do beyond renaming
//! (reorders, splits, transformed values) stays beside them.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// How a family's checkpoint names its modules (a column of the table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Scheme {
    /// `model.layers.N.self_attn/mlp/linear_attn`.
    Llama,
    /// `backbone.layers.N.mixer`.
    NemotronH,
}

impl Scheme {
    fn column(self) -> &'static str {
        match self {
            Scheme::Llama => "llama",
            Scheme::NemotronH => "nemotron_h",
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    layers: BTreeMap<String, String>,
    globals: BTreeMap<String, BTreeMap<String, String>>,
    blocks: BTreeMap<String, BTreeMap<String, String>>,
    nextn: BTreeMap<String, String>,
}

fn parse() -> Result<Table, toml::de::Error> {
    toml::from_str(include_str!("names.toml"))
}

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    // The file is compiled in; `the_table_parses_with_both_schemes` checks it.
    TABLE.get_or_init(|| parse().expect("gguf/names.toml parses"))
}

fn lookup<'t>(
    columns: &'t BTreeMap<String, BTreeMap<String, String>>,
    scheme: Scheme,
    module: &str,
) -> Option<&'t str> {
    columns
        .get(scheme.column())?
        .get(module)
        .map(String::as_str)
}

/// Where block N's modules go: `{layers}.N.{module}`.
pub(super) fn layers(scheme: Scheme) -> &'static str {
    table()
        .layers
        .get(scheme.column())
        .map_or("", String::as_str)
}

/// The module outside the blocks (`token_embd`, `output_norm`, `output`).
pub(super) fn global(scheme: Scheme, module: &str) -> Option<&'static str> {
    lookup(&table().globals, scheme, module)
}

/// The module a block's `module` (`attn_q`) is, under its layer.
pub(super) fn block(scheme: Scheme, module: &str) -> Option<&'static str> {
    lookup(&table().blocks, scheme, module)
}

/// The `mtp.*` module of a multi-token-prediction block's `nextn.*` one.
pub(super) fn nextn() -> impl Iterator<Item = (&'static str, &'static str)> {
    table().nextn.iter().map(|(k, v)| (k.as_str(), v.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_parses_with_both_schemes() {
        let t = parse().unwrap();
        for scheme in [Scheme::Llama, Scheme::NemotronH] {
            assert!(t.globals.contains_key(scheme.column()));
            assert!(t.blocks.contains_key(scheme.column()));
            assert!(t.layers.contains_key(scheme.column()));
        }
        assert_eq!(block(Scheme::Llama, "attn_q"), Some("self_attn.q_proj"));
        assert_eq!(block(Scheme::NemotronH, "attn_q"), Some("mixer.q_proj"));
        assert_eq!(
            global(Scheme::NemotronH, "output_norm"),
            Some("backbone.norm_f")
        );
        assert_eq!(block(Scheme::Llama, "no_such_module"), None);
    }
}
