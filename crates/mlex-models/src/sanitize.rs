//! The weight translation steps an architecture spec's `[[sanitize]]`
//! names (see [`crate::spec`]), as mlx-lm's `sanitize` methods do them.

use mlex_core::error::Result;
use mlex_core::weights::WeightMap;
use mlx_rs::ops;
use mlx_rs::ops::indexing::TryIndexOp;

/// Drops every tensor under `prefix` (e.g. a tied `lm_head`).
pub fn drop_prefix(weights: &mut WeightMap, prefix: &str) -> Result<()> {
    let p = format!("{prefix}.");
    weights.rename_all(|n| (!n.starts_with(&p) && n != prefix).then(|| n.to_owned()))
}

/// Drops tensors whose name satisfies `pred`.
pub fn drop_where(weights: &mut WeightMap, pred: impl Fn(&str) -> bool) -> Result<()> {
    weights.rename_all(|n| (!pred(n)).then(|| n.to_owned()))
}

/// PyTorch conv weights `[C, 1, K]` → MLX `[C, K, 1]` for every tensor
/// named `*{marker}*weight` whose last axis is not 1 (mlx-lm's rule).
pub fn conv_to_mlx(weights: &mut WeightMap, marker: &str) -> Result<()> {
    weights.update_where(
        |n, s| n.contains(marker) && n.ends_with("weight") && s.len() == 3 && s[2] != 1,
        |a| Ok(ops::move_axis(a, 2, 1)?),
    )
}

/// True when some `*{marker}*weight` still has the PyTorch layout.
pub fn has_torch_conv(weights: &WeightMap, marker: &str) -> bool {
    weights.names().iter().any(|n| {
        n.contains(marker)
            && n.ends_with("weight")
            && weights
                .shape_of(n)
                .is_some_and(|s| s.len() == 3 && s[2] != 1)
    })
}

/// Adds 1 to 1-D norm weights stored as offsets (HF Qwen3-Next/3.5).
pub fn norm_plus_one(weights: &mut WeightMap, suffixes: &[&str]) -> Result<()> {
    weights.update_where(
        |n, s| s.len() == 1 && suffixes.iter().any(|x| n.ends_with(x)),
        |a| Ok(ops::add(a, mlex_core::nn::scalar(1.0, a.dtype())?)?),
    )
}

/// Stacks per-expert weights `{prefix}.experts.{e}.{from}.weight` into
/// `{prefix}.switch_mlp.{to}.weight` (`[E, out, in]`).
pub fn stack_experts(
    weights: &mut WeightMap,
    prefix: &str,
    experts: usize,
    names: &[(&str, &str)],
) -> Result<()> {
    for (from, to) in names {
        let first = format!("{prefix}.experts.0.{from}.weight");
        if !weights.contains(&first) {
            continue;
        }
        let mut parts = Vec::with_capacity(experts);
        let mut file = 0;
        for e in 0..experts {
            let name = format!("{prefix}.experts.{e}.{from}.weight");
            let (a, f) = weights.remove_required(&name)?;
            file = f;
            parts.push(a);
        }
        weights.insert(
            format!("{prefix}.switch_mlp.{to}.weight"),
            ops::stack(&parts, 0)?,
            file,
        );
    }
    Ok(())
}

/// HF Qwen3.5-MoE stores experts fused: `experts.gate_up_proj` `[E, 2I, H]`
/// and `experts.down_proj`; split into `switch_mlp.{gate,up,down}_proj`.
pub fn split_gate_up(weights: &mut WeightMap, prefix: &str) -> Result<()> {
    let key = format!("{prefix}.experts.gate_up_proj");
    let Some((gate_up, file)) = weights.remove(&key)? else {
        return Ok(());
    };
    let mid = gate_up.shape()[gate_up.ndim() - 2] / 2;
    weights.insert(
        format!("{prefix}.switch_mlp.gate_proj.weight"),
        gate_up.try_index((.., ..mid, ..))?,
        file,
    );
    weights.insert(
        format!("{prefix}.switch_mlp.up_proj.weight"),
        gate_up.try_index((.., mid.., ..))?,
        file,
    );
    let down = format!("{prefix}.experts.down_proj");
    let (d, f) = weights.remove_required(&down)?;
    weights.insert(format!("{prefix}.switch_mlp.down_proj.weight"), d, f);
    Ok(())
}

/// `name` with the dotted parts `from` replaced by `to` where they stand as
/// whole parts (`a.from.b`, `from.b`, `a.from`); other names unchanged.
pub fn rename_part(name: &str, from: &str, to: &str) -> String {
    let padded = format!(".{name}.");
    let needle = format!(".{from}.");
    match padded.find(&needle) {
        Some(at) => {
            let out = format!("{}.{to}.{}", &padded[..at], &padded[at + needle.len()..]);
            out[1..out.len() - 1].to_owned()
        }
        None => name.to_owned(),
    }
}

#[cfg(test)]
mod rename_part_tests {
    use super::rename_part;

    #[test]
    fn renames_whole_parts_only() {
        let r = |n: &str| rename_part(n, "mlp.gate_up_proj", "mlp.gate_proj+up_proj");
        assert_eq!(
            r("model.layers.0.mlp.gate_up_proj.weight"),
            "model.layers.0.mlp.gate_proj+up_proj.weight"
        );
        assert_eq!(r("mlp.gate_up_proj.weight"), "mlp.gate_proj+up_proj.weight");
        assert_eq!(r("x.mlp.gate_up_proj"), "x.mlp.gate_proj+up_proj");
        // Not a whole part: unchanged.
        assert_eq!(
            r("x.mlp.gate_up_projection.weight"),
            "x.mlp.gate_up_projection.weight"
        );
        assert_eq!(
            r("x.smlp.gate_up_proj.weight"),
            "x.smlp.gate_up_proj.weight"
        );
    }
}
