//! Finding and loading a model: a directory (`config.json` + safetensors,
//! one file or shards with `model.safetensors.index.json`), a `.gguf`
//! file, or a Hugging Face repo id resolved through the shared cache and
//! downloaded into it when missing (`mlex-hub`).

use crate::gguf::{self, GgufTokenizer};
use mlex_core::config::ModelConfig;
use mlex_core::dispatch::Dispatch;
use mlex_core::error::{Error, Result};
use mlex_core::model::Model;
use mlex_core::registry::Registry;
use mlex_core::weights::WeightMap;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Where a model comes from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A checkpoint directory.
    Dir(PathBuf),
    /// A GGUF file.
    Gguf(PathBuf),
}

/// How a model was found: the path given, or a Hugging Face repo id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelOrigin {
    /// A local directory or file named on the command line.
    Local,
    /// A repo id (`org/name[@revision]`), resolved through the Hugging Face
    /// cache; `downloaded` when this run fetched some of it.
    Hub {
        /// `org/name`.
        repo: String,
        /// The revision asked for.
        revision: String,
        /// Whether files were downloaded by this run.
        downloaded: bool,
    },
}

impl std::fmt::Display for ModelOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelOrigin::Local => f.write_str("local"),
            ModelOrigin::Hub {
                repo,
                revision,
                downloaded,
            } => write!(
                f,
                "{} {repo}@{revision}",
                if *downloaded {
                    "downloaded from the Hugging Face Hub:"
                } else {
                    "Hugging Face cache:"
                }
            ),
        }
    }
}

/// A loaded model with what came beside it.
pub struct LoadedModel {
    /// The model.
    pub model: Model,
    /// Where it came from.
    pub source: ModelSource,
    /// How it was found (local path, Hugging Face cache, download).
    pub origin: ModelOrigin,
    /// Tokenizer metadata when the model is a GGUF file.
    pub gguf_tokenizer: Option<GgufTokenizer>,
    /// GGUF only: the GGML type each weight had in the file, under its
    /// mlx-lm name (for `inspect`).
    pub gguf_tensor_types: Vec<(String, String)>,
    /// Identifies this model's weights layout (for prompt-cache files).
    pub fingerprint: String,
}

/// Resolves `spec`: an existing directory or `.gguf` file, else a repo id
/// (`org/name[@revision][:FILE.gguf|:QUANT]`) from the Hugging Face cache,
/// downloaded into it when missing (unless `HF_HUB_OFFLINE=1`).
pub fn resolve(spec: &str) -> Result<(ModelSource, ModelOrigin)> {
    let p = Path::new(spec);
    if p.is_dir() {
        return Ok((ModelSource::Dir(p.to_owned()), ModelOrigin::Local));
    }
    if p.is_file() {
        return if p
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            Ok((ModelSource::Gguf(p.to_owned()), ModelOrigin::Local))
        } else {
            Err(Error::invalid(
                "model",
                format!(
                    "{spec} is a file but not a .gguf; pass a checkpoint directory or a .gguf file"
                ),
            ))
        };
    }
    if let Some(hub) = mlex_hub::HubSpec::parse(spec) {
        let fetched = mlex_hub::fetch(&hub, &mlex_hub::HubConfig::from_env())?;
        let origin = ModelOrigin::Hub {
            repo: hub.repo,
            revision: hub.revision,
            downloaded: fetched.origin == mlex_hub::Origin::Downloaded,
        };
        let source = if fetched.is_gguf {
            ModelSource::Gguf(fetched.path)
        } else {
            ModelSource::Dir(fetched.path)
        };
        return Ok((source, origin));
    }
    Err(Error::invalid(
        "model",
        format!(
            "`{spec}` does not exist (expected a directory, a .gguf file or an org/name repo id)"
        ),
    ))
}

/// The safetensors files of a checkpoint directory.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let cfg = ModelConfig::from_file(&index)?;
        let map = cfg
            .value()
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| cfg.error("weight_map", "missing or not an object"))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect();
        files.sort();
        files.dedup();
        // Shards lie beside the index: a name that leaves the directory is
        // a broken or hostile index, not a file to open.
        if let Some(f) = files
            .iter()
            .find(|f| f.contains('/') || f.contains('\\') || f.contains("..") || f.is_empty())
        {
            return Err(Error::Config {
                file: index.clone(),
                key: "weight_map".into(),
                message: format!("names `{f}`, which is not a file name in this directory"),
            });
        }
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        for (f, p) in files.iter().zip(&paths) {
            if !p.is_file() {
                return Err(Error::Config {
                    file: index.clone(),
                    key: "weight_map".into(),
                    message: format!("names shard `{f}`, which does not exist"),
                });
            }
        }
        // A shard beside the others that the index leaves out would be
        // skipped, and its tensors reported missing with no word of why.
        // Only shards of the same series count (`model-00002-of-00003` next
        // to an index of `-of-00003` shards); variants such as
        // `model.fp16-00001-of-00002.safetensors` have their own index.
        let totals: Vec<&str> = files.iter().filter_map(|f| shard_total(f)).collect();
        for p in model_safetensors(dir)? {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            let stray = |n: &String| {
                shard_total(n).is_some_and(|t| totals.contains(&t)) && !files.contains(n)
            };
            if let Some(name) = name.filter(stray) {
                return Err(Error::Config {
                    file: index.clone(),
                    key: "weight_map".into(),
                    message: format!(
                        "does not name shard `{name}`, which is in the directory (a stale index?)"
                    ),
                });
            }
        }
        return Ok(paths);
    }
    let files = model_safetensors(dir)?;
    if files.is_empty() {
        return Err(Error::MissingTensor {
            name: "(any weights)".into(),
            files: vec![dir.join("model*.safetensors")],
            nearest: Vec::new(),
        });
    }
    Ok(files)
}

/// Every tensor of a checkpoint directory's safetensors files, each file
/// validated first and a sharded checkpoint's index checked against its
/// shards.
pub fn load_weights(dir: &Path) -> Result<WeightMap> {
    let weights = WeightMap::load_safetensors(&weight_files(dir)?)?;
    check_index(dir, &weights)?;
    Ok(weights)
}

/// `NNNNN` of a shard named `model-MMMMM-of-NNNNN.safetensors` (five
/// digits each, as `transformers` writes them).
fn shard_total(name: &str) -> Option<&str> {
    let (part, total) = name
        .strip_prefix("model-")?
        .strip_suffix(".safetensors")?
        .split_once("-of-")?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    (digits(part) && digits(total)).then_some(total)
}

/// The `model*.safetensors` files of a directory (mlx-lm's rule), sorted.
fn model_safetensors(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "safetensors")
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("model"))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// The index of a sharded checkpoint agrees with its shards: every tensor
/// it maps is in the shard it names, and every tensor of a shard is mapped.
/// A stale index is a broken download or a hand edit; reading past it would
/// load weights nobody asked for or report them missing under the wrong
/// file.
fn check_index(dir: &Path, weights: &WeightMap) -> Result<()> {
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Ok(());
    }
    let cfg = ModelConfig::from_file(&index)?;
    let Some(map) = cfg.value().get("weight_map").and_then(Value::as_object) else {
        return Err(cfg.error("weight_map", "missing or not an object"));
    };
    for (name, file) in map {
        let Some(file) = file.as_str() else {
            return Err(cfg.error("weight_map", format!("`{name}` maps to a non-string")));
        };
        let shard = dir.join(file);
        match weights.file_of(name) {
            None => {
                return Err(cfg.error(
                    "weight_map",
                    format!("maps `{name}` to `{file}`, which does not hold it"),
                ))
            }
            Some(found) if found != shard => {
                return Err(cfg.error(
                    "weight_map",
                    format!(
                        "maps `{name}` to `{file}`, but it is in `{}`",
                        found.file_name().unwrap_or_default().to_string_lossy()
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    if let Some(extra) = weights.names().into_iter().find(|n| !map.contains_key(n)) {
        let shard = weights
            .file_of(&extra)
            .map(Path::to_path_buf)
            .unwrap_or_default();
        return Err(cfg.error(
            "weight_map",
            format!(
                "does not map tensor `{extra}`, which is in `{}`",
                shard.file_name().unwrap_or_default().to_string_lossy()
            ),
        ));
    }
    Ok(())
}

/// FNV-1a over bytes (a stable, dependency-free fingerprint).
fn fnv(hash: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *hash ^= u64::from(*b);
        *hash = hash.wrapping_mul(0x100000001b3);
    }
}

/// A fingerprint of a model: architecture, config, every tensor's name,
/// shape and dtype, and a sample of the values (the first elements of the
/// first tensors), so two checkpoints of one shape differ.
pub fn fingerprint(model: &Model) -> Result<String> {
    let mut h = 0xcbf29ce484222325u64;
    fnv(&mut h, model.arch.as_bytes());
    fnv(&mut h, model.config.value().to_string().as_bytes());
    for (i, (name, a)) in model.params.iter().enumerate() {
        fnv(&mut h, name.as_bytes());
        fnv(&mut h, format!("{:?}{:?}", a.shape(), a.dtype()).as_bytes());
        if i < 8 && a.size() > 0 {
            use mlx_rs::ops::indexing::TryIndexOp;
            let flat = mlx_rs::ops::reshape(a, &[-1])?;
            let n = (flat.size() as i32).min(64);
            let sample = flat.try_index(..n)?.as_dtype(mlx_rs::Dtype::Float32)?;
            sample.eval()?;
            for v in sample.try_as_slice::<f32>()? {
                fnv(&mut h, &v.to_le_bytes());
            }
        }
    }
    Ok(format!("{}-{h:016x}", model.arch))
}

/// Loads the model at `spec` with the architectures of `registry`.
pub fn load(spec: &str, registry: &Registry) -> Result<LoadedModel> {
    load_with(spec, registry, &crate::dispatch()?)
}

/// [`load`] with the backend policy `dispatch` (the command line's).
pub fn load_with(spec: &str, registry: &Registry, dispatch: &Dispatch) -> Result<LoadedModel> {
    load_with_mtp(spec, registry, dispatch, false)
}

/// [`load_with`], with the checkpoint's multi-token-prediction head when
/// `mtp` (`--mtp`; an error naming it when there is none).
pub fn load_with_mtp(
    spec: &str,
    registry: &Registry,
    dispatch: &Dispatch,
    mtp: bool,
) -> Result<LoadedModel> {
    let (source, origin) = resolve(spec)?;
    let (config, weights, gguf_tokenizer, gguf_tensor_types) = match &source {
        ModelSource::Dir(dir) => {
            let cfg_path = dir.join("config.json");
            if !cfg_path.is_file() {
                return Err(Error::not_found(
                    &cfg_path,
                    "no config.json in the model directory",
                ));
            }
            let config = ModelConfig::from_file(&cfg_path)?;
            // Check the architecture before reading any weights.
            let model_type = config.model_type()?.to_owned();
            registry
                .architecture(&model_type)
                .map_err(|e| with_file(e, &cfg_path))?;
            let weights = load_weights(dir)?;
            (config, weights, None, Vec::new())
        }
        ModelSource::Gguf(path) => {
            let ck = gguf::load(path)?;
            (ck.config, ck.weights, Some(ck.tokenizer), ck.tensor_types)
        }
    };
    let arch = registry
        .architecture(config.model_type()?)
        .map_err(|e| with_file(e, config.file()))?;
    let model = Model::build_with(arch.as_ref(), &config, weights, registry, dispatch, mtp)?;
    let fingerprint = fingerprint(&model)?;
    Ok(LoadedModel {
        model,
        source,
        origin,
        gguf_tokenizer,
        gguf_tensor_types,
        fingerprint,
    })
}

fn with_file(e: Error, file: &Path) -> Error {
    match e {
        Error::UnknownArchitecture {
            model_type, known, ..
        } => Error::UnknownArchitecture {
            model_type,
            file: Some(file.to_owned()),
            known,
        },
        e => e,
    }
}
