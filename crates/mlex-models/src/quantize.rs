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
    quantize_with(model, arch, registry, &spec, None)
}

/// mlx-lm's mixed quantization recipes (`mlx_lm.convert --quant-predicate`,
/// after llama.cpp's `Q4_K_M` choices): the value projections and
/// `down_proj` of the first and last eighth of the layers and of every
/// third layer between, and the output head, get the high bits; the rest
/// the low.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recipe {
    /// 2 and 6 bits.
    Mixed2_6,
    /// 3 and 4 bits.
    Mixed3_4,
    /// 3 and 6 bits.
    Mixed3_6,
    /// 4 and 6 bits.
    Mixed4_6,
}

impl Recipe {
    /// (low, high) bits.
    pub fn bits(self) -> (i32, i32) {
        match self {
            Recipe::Mixed2_6 => (2, 6),
            Recipe::Mixed3_4 => (3, 4),
            Recipe::Mixed3_6 => (3, 6),
            Recipe::Mixed4_6 => (4, 6),
        }
    }

    /// Its name (`mixed_3_6`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Recipe::Mixed2_6 => "mixed_2_6",
            Recipe::Mixed3_4 => "mixed_3_4",
            Recipe::Mixed3_6 => "mixed_3_6",
            Recipe::Mixed4_6 => "mixed_4_6",
        }
    }

    /// The bits of `module` (`model.layers.3.mlp.down_proj`) in a model of
    /// `layers` layers whose layer index is component `at` of a module path.
    fn bits_of(self, module: &str, layers: usize, at: usize) -> i32 {
        let (low, high) = self.bits();
        let index: usize = module
            .split('.')
            .nth(at)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let more = index < layers / 8
            || index >= 7 * layers / 8
            || (index as i64 - (layers / 8) as i64).rem_euclid(3) == 2;
        let value = ["v_proj", "v_a_proj", "v_b_proj"]
            .iter()
            .any(|v| module.contains(v));
        if (value || module.contains("down_proj")) && more || module.contains("lm_head") {
            high
        } else {
            low
        }
    }
}

/// [`quantize`] with groups of `spec.group_size`, `spec.bits` bits, or by a
/// mixed `recipe`: then every quantized module gets its own entry in the
/// model's quantization, as mlx-lm writes it.
pub fn quantize_with(
    model: &Model,
    arch: &dyn Architecture,
    registry: &Registry,
    spec: &QuantSpec,
    recipe: Option<Recipe>,
) -> Result<Model> {
    let (group_size, bits) = (spec.group_size, spec.bits);
    let spec = spec.clone();
    spec.validate("quantize", &model.config)?;
    if !model.quantization.is_none() {
        return Err(Error::invalid(
            "quantization",
            "the model is already quantized",
        ));
    }
    let mut targets: BTreeSet<ParamId> = BTreeSet::new();
    targets.extend(model.embed.quantizable());
    if let Head::Linear(l) | Head::SplitLinear(l, _) = &model.output.head {
        targets.extend(l.quantizable());
    }
    for slot in &model.layers {
        targets.extend(slot.layer.quantizable());
    }
    // Where a module path holds the layer index (mlx-lm looks at its first
    // `down_proj`).
    let layer_at = match recipe {
        None => 0,
        Some(r) => model
            .params
            .iter()
            .map(|(n, _)| n)
            .find(|n| n.contains("down_proj"))
            .and_then(|n| n.split('.').position(|c| c.parse::<usize>().is_ok()))
            .ok_or_else(|| {
                Error::invalid(
                    "quant recipe",
                    format!(
                        "{}: the model has no `down_proj` with a layer index",
                        r.name()
                    ),
                )
            })?,
    };
    let mut overrides = model.quantization.overrides.clone();
    let mut weights = WeightMap::new();
    let file = weights.add_file("(quantized in memory)".into());
    let mut packed = 0;
    for (i, (name, array)) in model.params.iter().enumerate() {
        let id = ParamId(i as u32);
        let cols = array.shape().last().copied().unwrap_or(0);
        let module = name.strip_suffix(".weight");
        match module {
            Some(module) if targets.contains(&id) && cols % group_size == 0 => {
                let bits = match recipe {
                    Some(r) => {
                        let b = r.bits_of(module, model.layers.len(), layer_at);
                        overrides.insert(
                            module.to_owned(),
                            Some(QuantSpec {
                                group_size,
                                bits: b,
                            }),
                        );
                        b
                    }
                    None => bits,
                };
                let (w, s, b) = ops::quantize(array, group_size, bits)?;
                weights.insert(format!("{module}.weight"), w, file);
                weights.insert(format!("{module}.scales"), s, file);
                weights.insert(format!("{module}.biases"), b, file);
                packed += 1;
            }
            // A rank's part that is not whole groups would stay dense where
            // one device quantizes the whole: not the same model.
            Some(_) if targets.contains(&id) && model.dispatch.tensor_parallel.is_some() => {
                return Err(Error::invalid(
                    "--quantize",
                    format!(
                        "`{name}` has {cols} columns on a rank of --tp {}, not whole groups of \
                         {group_size} (--group-size)",
                        model
                            .dispatch
                            .tensor_parallel
                            .as_ref()
                            .map_or(1, |s| s.size())
                    ),
                ));
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
        overrides,
    };
    // A split model's weights are its rank's parts already.
    weights.mark_rank_parts();
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
    // A split model's weights are its rank's parts already.
    weights.mark_rank_parts();
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
