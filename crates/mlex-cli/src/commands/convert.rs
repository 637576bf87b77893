//! `mlex convert`: a model (safetensors or GGUF) written as an
//! MLX-community checkpoint (`mlex_models::save`), quantized (affine, or
//! by one of mlx-lm's mixed recipes), dequantized or cast on the way, with
//! the tokenizer files beside it. The folder is written beside its target
//! and renamed into place at the end: an error or an interrupt leaves no
//! half-written checkpoint.

use crate::args::{ConvertArgs, DtypeArg, Format, RecipeArg};
use crate::session::{load_model, tokenizer_for};
use mlex_core::error::{Error, Result};
use mlex_core::quant::QuantSpec;
use mlex_core::registry::Registry;
use mlex_models::load::ModelSource;
use mlex_models::quantize::Recipe;
use mlx_rs::Dtype;
use serde_json::json;
use std::path::{Path, PathBuf};

/// Tokenizer and generation files a checkpoint folder may hold, copied as
/// they are (mlx-lm's `save_pretrained` writes these, and copies `*.py`).
const TOKENIZER_FILES: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
];

/// Parameters that keep their dtype when a model is cast (mlx-lm's
/// `cast_predicate`s of the hybrids: Qwen3.5, NemotronH).
const KEEP_DTYPE: [&str; 2] = ["A_log", "e_score_correction_bias"];

fn recipe(r: RecipeArg) -> Recipe {
    match r {
        RecipeArg::Mixed26 => Recipe::Mixed2_6,
        RecipeArg::Mixed34 => Recipe::Mixed3_4,
        RecipeArg::Mixed36 => Recipe::Mixed3_6,
        RecipeArg::Mixed46 => Recipe::Mixed4_6,
    }
}

fn dtype(d: DtypeArg) -> Dtype {
    match d {
        DtypeArg::Float16 => Dtype::Float16,
        DtypeArg::Bfloat16 => Dtype::Bfloat16,
        DtypeArg::Float32 => Dtype::Float32,
    }
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32)
}

pub fn run(a: ConvertArgs, registry: &Registry) -> Result<()> {
    if a.out.exists() {
        return Err(Error::invalid(
            "--out",
            format!(
                "{} already exists; remove it or name another folder",
                a.out.display()
            ),
        ));
    }
    let parent = a
        .out
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(Error::invalid(
            "--out",
            format!("folder {} does not exist", parent.display()),
        ));
    }
    // Projections apart: the store then holds mlx-lm's names.
    let mut dispatch = crate::session::dispatch(None)?;
    dispatch.fuse_projections = false;
    let loaded = load_model(&a.model, registry, &dispatch)?;
    let tokenizer = tokenizer_for(&loaded).ok();
    let arch = registry.architecture(&loaded.model.arch)?;
    let source = loaded.source.clone();
    let model = loaded.model;
    let model = transform(&a, model, arch.as_ref(), registry)?;
    let partial = a.out.with_file_name(format!(
        ".{}.partial-{}",
        a.out
            .file_name()
            .map(|f| f.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).map_err(|e| Error::io(&partial, e))?;
    let written = write(&source, &model, tokenizer.as_ref(), &partial, a.shard_size);
    let saved = match written {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&partial);
            return Err(e);
        }
    };
    if let Err(e) = std::fs::rename(&partial, &a.out) {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(Error::io(&a.out, e));
    }
    let quant = mlex_models::save::quantization_json(&model.quantization);
    match a.format {
        Format::Json => println!(
            "{}",
            json!({
                "out": a.out, "files": saved.files, "total_size": saved.total_size,
                "total_parameters": saved.total_parameters, "quantization": quant,
            })
        ),
        Format::Text => eprintln!(
            "wrote {} ({} weight file{}, {:.1} MB, {} parameters{})",
            a.out.display(),
            saved.files.len(),
            if saved.files.len() == 1 { "" } else { "s" },
            saved.total_size as f64 / 1e6,
            saved.total_parameters,
            match &model.quantization.default {
                Some(q) if a.quant_recipe.is_some() => format!(
                    ", {} with groups of {}",
                    a.quant_recipe
                        .map(recipe)
                        .map(Recipe::name)
                        .unwrap_or_default(),
                    q.group_size
                ),
                Some(q) => format!(", {} bits in groups of {}", q.bits, q.group_size),
                None => String::new(),
            }
        ),
    }
    Ok(())
}

/// The model dequantized, cast and quantized as the options ask, in that
/// order.
fn transform(
    a: &ConvertArgs,
    mut model: mlex_core::model::Model,
    arch: &dyn mlex_core::arch::Architecture,
    registry: &Registry,
) -> Result<mlex_core::model::Model> {
    if a.dequantize {
        // Dequantized matrices take their scales' dtype, as in mlx-lm.
        let to = model
            .params
            .iter()
            .find(|(n, _)| n.ends_with(".scales"))
            .map(|(_, s)| s.dtype())
            .unwrap_or(model.dtype);
        match mlex_models::quantize::dequantize(&model, arch, registry, to)? {
            Some(m) => model = m,
            None => eprintln!(
                "mlex convert: {} is not quantized; nothing to dequantize",
                a.model
            ),
        }
    }
    if let Some(d) = a.dtype {
        model = cast(&model, arch, registry, dtype(d))?;
    }
    if a.quantize.is_some() || a.quant_recipe.is_some() {
        if !model.quantization.is_none() {
            return Err(Error::invalid(
                "--quantize",
                format!(
                    "{} is already quantized (add --dequantize to requantize it)",
                    a.model
                ),
            ));
        }
        let spec = QuantSpec {
            group_size: a.group_size,
            bits: a.quantize.unwrap_or(4),
        };
        model = mlex_models::quantize::quantize_with(
            &model,
            arch,
            registry,
            &spec,
            a.quant_recipe.map(recipe),
        )
        .map_err(|e| match e {
            Error::Config { message, .. } if message.contains("group_size") => {
                Error::invalid("--group-size", message)
            }
            Error::Config { message, .. } if message.contains("bits") => {
                Error::invalid("--quantize", message)
            }
            e => e,
        })?;
    }
    Ok(model)
}

/// The model with every floating parameter (but those of [`KEEP_DTYPE`])
/// in `to`.
fn cast(
    model: &mlex_core::model::Model,
    arch: &dyn mlex_core::arch::Architecture,
    registry: &Registry,
    to: Dtype,
) -> Result<mlex_core::model::Model> {
    let mut weights = mlex_core::weights::WeightMap::new();
    let file = weights.add_file("(cast in memory)".into());
    for (name, a) in model.params.iter() {
        let keep = KEEP_DTYPE.iter().any(|k| name.contains(k));
        // Scales and biases are floats too, cast as mlx-lm casts them.
        let a = if is_float(a.dtype()) && !keep {
            a.as_dtype(to)?
        } else {
            a.clone()
        };
        weights.insert(name, a, file);
    }
    let plan = arch.plan(&model.config)?;
    mlex_core::model::Model::build_from_plan(
        &model.arch,
        model.config.clone(),
        plan,
        weights,
        model.quantization.clone(),
        registry,
        &model.dispatch,
    )
}

/// Weights, config and tokenizer files into `dir`.
fn write(
    source: &ModelSource,
    model: &mlex_core::model::Model,
    tokenizer: Option<&mlex_generate::Tokenizer>,
    dir: &Path,
    shard_bytes: u64,
) -> Result<mlex_models::save::Saved> {
    // The whole config a directory has (a wrapper's, not the lifted text
    // part the model keeps); a GGUF file's is the one mlex made of it.
    let config = match source {
        ModelSource::Dir(src) => {
            let path = src.join("config.json");
            let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
            serde_json::from_str(&text).map_err(|e| Error::Config {
                file: path.clone(),
                key: format!("line {}", e.line()),
                message: e.to_string(),
            })?
        }
        ModelSource::Gguf(_) => model.config.value().clone(),
    };
    let saved = mlex_models::save::save(model, &config, dir, shard_bytes as usize)?;
    match source {
        ModelSource::Dir(src) => {
            for f in TOKENIZER_FILES {
                let from = src.join(f);
                if from.is_file() {
                    copy(&from, &dir.join(f))?;
                }
            }
            for entry in std::fs::read_dir(src).map_err(|e| Error::io(src, e))? {
                let p: PathBuf = entry.map_err(|e| Error::io(src, e))?.path();
                if p.extension().is_some_and(|e| e == "py") {
                    copy(&p, &dir.join(p.file_name().expect("a file")))?;
                }
            }
        }
        ModelSource::Gguf(_) => {
            // The tokenizer of the GGUF metadata, as Hugging Face files.
            if let Some(tok) = tokenizer {
                tok.save_json(&dir.join("tokenizer.json"))?;
                let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i));
                let eos = name(tok.eos_id);
                let cfg = json!({
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "chat_template": tok.chat_template_source(),
                    "bos_token": name(tok.bos_id),
                    "eos_token": eos,
                    "add_bos_token": tok.add_bos,
                    "clean_up_tokenization_spaces": false,
                });
                mlex_models::save::write_json(&dir.join("tokenizer_config.json"), &cfg)?;
            }
        }
    }
    Ok(saved)
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| Error::io(from, e))
}
