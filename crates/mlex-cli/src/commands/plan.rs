//! `mlex inspect --spec`: the resolved plan of one checkpoint as one
//! readable text. Layers with the same block (same name, options and
//! weights up to their index) are shown once, with their indices, so a
//! newcomer can answer "what does layer 5 compute" without reading Rust.

use mlex_core::arch::{HeadPlan, LayerPlan, ModelPlan};
use mlex_core::model::Model;
use serde_json::{json, Map, Value};

/// One group of layers that compute the same thing.
struct Group<'a> {
    indices: Vec<usize>,
    plan: &'a LayerPlan,
    /// Weight names relative to the layer prefix, with shape and dtype.
    weights: Vec<String>,
}

fn relative_weights(model: &Model, i: usize) -> Vec<String> {
    let slot = &model.layers[i];
    let prefix = format!("{}.", slot.prefix);
    let mut names: Vec<String> = slot
        .layer
        .params()
        .into_iter()
        .map(|id| {
            let a = model.params.get(id);
            let name = model.params.name(id);
            format!(
                "{} {:?} {}",
                name.strip_prefix(&prefix).unwrap_or(name),
                a.shape(),
                format!("{:?}", a.dtype()).to_lowercase()
            )
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

fn groups<'a>(model: &Model, plan: &'a ModelPlan) -> Vec<Group<'a>> {
    let mut out: Vec<Group<'a>> = Vec::new();
    for (i, lp) in plan.layers.iter().enumerate() {
        let weights = relative_weights(model, i);
        match out.iter_mut().find(|g| {
            g.plan.name == lp.name && g.plan.options == lp.options && g.weights == weights
        }) {
            Some(g) => g.indices.push(i),
            None => out.push(Group {
                indices: vec![i],
                plan: lp,
                weights,
            }),
        }
    }
    out
}

/// `0-2, 4-6, 8`.
fn ranges(ix: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut k = 0;
    while k < ix.len() {
        let mut j = k;
        while j + 1 < ix.len() && ix[j + 1] == ix[j] + 1 {
            j += 1;
        }
        parts.push(if j == k {
            ix[k].to_string()
        } else {
            format!("{}-{}", ix[k], ix[j])
        });
        k = j + 1;
    }
    parts.join(", ")
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn str_opt<'v>(o: &'v Map<String, Value>, key: &str, default: Option<&'v str>) -> Option<&'v str> {
    match o.get(key) {
        Some(Value::String(s)) => Some(s),
        Some(Value::Null) | Some(Value::Bool(false)) => None,
        _ => default,
    }
}

/// The block's two lines of arithmetic, from its options.
fn block_formula(o: &Map<String, Value>) -> Vec<String> {
    let mult = o
        .get("residual_multiplier")
        .and_then(Value::as_f64)
        .map(|m| format!("{m} * "))
        .unwrap_or_default();
    let wrap = |f: &str, inner: String| match f {
        "" => inner,
        f => format!("{f}({inner})"),
    };
    let mut lines = Vec::new();
    let mixer = o.get("mixer").and_then(Value::as_str);
    if let Some(m) = mixer {
        let pre = str_opt(o, "mixer_norm", Some("input_layernorm")).unwrap_or("");
        let post = str_opt(o, "post_mixer_norm", None).unwrap_or("");
        let inner = wrap(post, format!("{m}({})", wrap(pre, "x".into())));
        lines.push(format!("h   = x + {mult}{inner}"));
    } else {
        lines.push("h   = x".into());
    }
    let ffn = o.get("ffn").and_then(Value::as_str).unwrap_or("swiglu");
    if ffn != "none" {
        let pre = str_opt(o, "ffn_norm", Some("post_attention_layernorm")).unwrap_or("");
        let post = str_opt(o, "post_ffn_norm", None).unwrap_or("");
        let module = str_opt(o, "ffn_prefix", Some("mlp")).unwrap_or("mlp");
        let inner = wrap(post, format!("{ffn}[{module}]({})", wrap(pre, "h".into())));
        lines.push(format!("out = h + {mult}{inner}"));
    } else {
        lines.push("out = h".into());
    }
    lines
}

fn options_lines(o: &Map<String, Value>, skip: &[&str]) -> Vec<String> {
    o.iter()
        .filter(|(k, _)| !skip.contains(&k.as_str()))
        .map(|(k, v)| format!("{k} = {}", text(v)))
        .collect()
}

/// The plan as JSON (for `--format json`).
pub fn to_json(model: &Model, plan: &ModelPlan) -> Value {
    json!({
        "architecture": model.arch,
        "embed": plan.embed,
        "final_norm": plan.final_norm,
        "head": match &plan.head { HeadPlan::Tied => "tied".to_owned(), HeadPlan::Linear(h) => h.clone() },
        "groups": groups(model, plan).iter().map(|g| json!({
            "layers": g.indices,
            "name": g.plan.name,
            "kind": g.plan.kind,
            "options": g.plan.options,
            "weights": g.weights,
        })).collect::<Vec<_>>(),
    })
}

/// The plan as text.
pub fn render(model: &Model, summary: &str, plan: &ModelPlan) -> String {
    let mut out = Vec::new();
    out.push(format!("{} — {summary}", model.arch));
    out.push(format!(
        "x = {}[tokens]                      (vocabulary {}, width {})",
        plan.embed, plan.vocab_size, plan.hidden_size
    ));
    let layer_groups = groups(model, plan);
    out.push(format!(
        "then {} layers, each a block below; then {} ({:?}, eps {}) and the head {}",
        plan.layers.len(),
        plan.final_norm,
        plan.norm_type,
        plan.norm_eps,
        match &plan.head {
            HeadPlan::Tied => "tied to the embedding".to_owned(),
            HeadPlan::Linear(h) => h.clone(),
        }
    ));
    if let Some(c) = plan.logit_softcap {
        out.push(format!("logits = {c} * tanh(logits / {c})"));
    }
    for g in &layer_groups {
        let prefix = &model.layers[g.indices[0]].prefix;
        let template = prefix
            .rsplit_once('.')
            .map(|(p, _)| format!("{p}.{{i}}"))
            .unwrap_or_else(|| prefix.clone());
        out.push(String::new());
        out.push(format!(
            "{} {} ({}, at {template}):",
            if g.indices.len() == 1 {
                "layer"
            } else {
                "layers"
            },
            ranges(&g.indices),
            g.plan.name
        ));
        match (&g.plan.options, g.plan.kind.as_str()) {
            (Value::Object(o), "block") => {
                for l in block_formula(o) {
                    out.push(format!("  {l}"));
                }
                if let Some(Value::Object(m)) = o.get("mixer_options") {
                    if let Some(name) = o.get("mixer").and_then(Value::as_str) {
                        out.push(format!("  mixer {name}:"));
                        out.extend(
                            options_lines(m, &[])
                                .into_iter()
                                .map(|l| format!("    {l}")),
                        );
                    }
                }
                out.push("  block:".into());
                // What a missing part would have used is noise here.
                let no_ffn = o.get("ffn").and_then(Value::as_str) == Some("none");
                let no_mixer = o.get("mixer").is_none_or(Value::is_null);
                out.extend(
                    options_lines(o, &["mixer", "mixer_options"])
                        .into_iter()
                        .filter(|l| !(no_ffn && l.starts_with("ffn_")))
                        .filter(|l| !(no_mixer && l.contains("mixer_norm")))
                        .map(|l| format!("    {l}")),
                );
            }
            (options, kind) => {
                out.push(format!("  layer kind {kind} (a whole layer, not a block)"));
                if let Value::Object(o) = options {
                    out.extend(
                        options_lines(o, &[])
                            .into_iter()
                            .map(|l| format!("    {l}")),
                    );
                }
            }
        }
        out.push(format!(
            "  weights (under {template}; fused products load as one `a+b` tensor):"
        ));
        out.extend(g.weights.iter().map(|w| format!("    {w}")));
    }
    out.join("\n")
}
