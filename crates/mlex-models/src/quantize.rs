//! Affine quantization of a loaded model, as mlx-lm's `quantize_model`:
//! every dense linear and expert matrix (and the embedding) whose input
//! width is a multiple of the group size is packed to `bits`, the rest
//! stays as it is. The result is a new model (new weight store): compiled
//! segments built for the old one are rebuilt on their next call.

use mlex_core::arch::Architecture;
use mlex_core::error::{Error, Result};
use mlex_core::model::{Head, Model};
use mlex_core::params::ParamId;
use mlex_core::quant::{QuantSpec, Quantization};
use mlex_core::registry::Registry;
use mlex_core::weights::WeightMap;
use mlx_rs::ops;
use std::collections::BTreeSet;

/// Quantizes `model` (built by `arch`) to `bits` with groups of `group_size`.
pub fn quantize(
    model: &Model,
    arch: &dyn Architecture,
    registry: &Registry,
    group_size: i32,
    bits: i32,
) -> Result<Model> {
    let spec = QuantSpec { group_size, bits };
    spec.validate("quantize", &model.config)?;
    if !model.quantization.is_none() {
        return Err(Error::invalid(
            "quantization",
            "the model is already quantized",
        ));
    }
    let mut targets: BTreeSet<ParamId> = BTreeSet::new();
    targets.extend(model.embed.quantizable());
    if let Head::Linear(l) = &model.output.head {
        targets.extend(l.quantizable());
    }
    for slot in &model.layers {
        targets.extend(slot.layer.quantizable());
    }
    let mut weights = WeightMap::new();
    let file = weights.add_file("(quantized in memory)".into());
    let mut packed = 0;
    for (i, (name, array)) in model.params.iter().enumerate() {
        let id = ParamId(i as u32);
        let cols = array.shape().last().copied().unwrap_or(0);
        let module = name.strip_suffix(".weight");
        match module {
            Some(module) if targets.contains(&id) && cols % group_size == 0 => {
                let (w, s, b) = ops::quantize(array, group_size, bits)?;
                weights.insert(format!("{module}.weight"), w, file);
                weights.insert(format!("{module}.scales"), s, file);
                weights.insert(format!("{module}.biases"), b, file);
                packed += 1;
            }
            _ => weights.insert(name, array.clone(), file),
        }
    }
    if packed == 0 {
        return Err(Error::invalid(
            "quantization",
            format!("no weight of this model can be quantized with group size {group_size}"),
        ));
    }
    let quantization = Quantization {
        default: Some(spec),
        overrides: model.quantization.overrides.clone(),
    };
    let plan = arch.plan(&model.config)?;
    Model::build_from_plan(
        &model.arch,
        model.config.clone(),
        plan,
        weights,
        quantization,
        registry,
        &model.dispatch,
    )
}

/// Undoes affine quantization: every packed matrix of `model` becomes a
/// dense one of `dtype` (the rest is cast to `dtype` as well when it is a
/// float), so products run through the platform's BLAS instead of the
/// quantized kernels. On the CPU with OpenBLAS that is the faster path
/// for models whose dense weights fit in memory (see `docs/BENCHMARKS.md`).
/// `None` when the model is not quantized.
pub fn dequantize(
    model: &Model,
    arch: &dyn Architecture,
    registry: &Registry,
    dtype: mlx_rs::Dtype,
) -> Result<Option<Model>> {
    if model.quantization.is_none() {
        return Ok(None);
    }
    // One map, not a scan of the store per module.
    let by_name: std::collections::HashMap<&str, &mlx_rs::Array> = model.params.iter().collect();
    let names: BTreeSet<&str> = by_name.keys().copied().collect();
    let mut weights = WeightMap::new();
    let file = weights.add_file("(dequantized in memory)".into());
    let get = |n: &str| by_name.get(n).map(|a| (*a).clone());
    for (name, array) in model.params.iter() {
        if name.ends_with(".scales") || name.ends_with(".biases") {
            let module = &name[..name.len() - 7];
            if names.contains(format!("{module}.weight").as_str()) {
                continue;
            }
        }
        let module = name.strip_suffix(".weight");
        let spec = module.and_then(|m| {
            names
                .contains(format!("{m}.scales").as_str())
                .then(|| model.quantization.for_module(m))
                .flatten()
        });
        let dense = match (module, spec) {
            (Some(m), Some(q)) => {
                let scales = get(&format!("{m}.scales")).expect("present");
                let biases = get(&format!("{m}.biases")).ok_or_else(|| {
                    Error::Other(format!("`{m}` has scales but no biases: not affine"))
                })?;
                ops::dequantize(array, &scales, &biases, q.group_size, q.bits)?
            }
            _ => array.clone(),
        };
        let dense = if is_float(dense.dtype()) {
            dense.as_dtype(dtype)?
        } else {
            dense
        };
        weights.insert(name, dense, file);
    }
    let plan = arch.plan(&model.config)?;
    let mut config = model.config.clone();
    if let Some(o) = config.value_mut().as_object_mut() {
        o.remove("quantization");
        o.remove("quantization_config");
    }
    Model::build_from_plan(
        &model.arch,
        config,
        plan,
        weights,
        Quantization::default(),
        registry,
        &model.dispatch,
    )
    .map(Some)
}

fn is_float(d: mlx_rs::Dtype) -> bool {
    use mlx_rs::Dtype::*;
    matches!(d, Float16 | Bfloat16 | Float32 | Float64)
}
