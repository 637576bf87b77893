//! `mlex list`.

use crate::args::{Format, ListArgs};
use mlex_core::error::Result;
use mlex_core::registry::Registry;
use serde_json::json;

pub fn run(a: ListArgs, registry: &Registry) -> Result<()> {
    let items = registry.list();
    if a.format == Format::Json {
        let v: Vec<_> = items
            .iter()
            .map(|l| json!({"what": l.what, "name": l.name, "origin": l.origin, "summary": l.summary}))
            .collect();
        println!("{}", json!({ "registered": v }));
        return Ok(());
    }
    for what in ["architecture", "layer kind", "cache kind"] {
        println!("{what}s:");
        for l in items.iter().filter(|l| l.what == what) {
            println!("  {:<18} {}  [{}]", l.name, l.summary, l.origin);
        }
    }
    Ok(())
}
