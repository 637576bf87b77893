//! A loaded model with its tokenizer: loading (with a progress bar while
//! the weights are read), prompts, sampling options.

use crate::args::{ModelArgs, SamplingArgs};
use indicatif::{ProgressBar, ProgressStyle};
use mlex_core::dispatch::Dispatch;
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_generate::{GenerateOptions, SamplerConfig, Tokenizer};
use mlex_models::load::{LoadedModel, ModelSource};
use std::io::IsTerminal;

/// The backend policy of a command: the process's
/// ([`mlex_models::dispatch`]) with the shared model options applied.
pub fn dispatch(m: Option<&ModelArgs>) -> Result<Dispatch> {
    let mut d = mlex_models::dispatch()?;
    if let Some(m) = m {
        d.tensor_parallel = tensor_parallel(m.tp)?;
        match m.prefill_chunk {
            Some(n) => d.prefill_chunk = n as usize,
            None if m.max_kv_size.is_some() => {
                d.prefill_chunk = d
                    .prefill_chunk
                    .min(mlex_core::dispatch::WINDOW_PREFILL_CHUNK)
            }
            None => {}
        }
    }
    Ok(d)
}

/// This process's rank when `tp` ranks split the model (MLX's environment
/// names the group; see [`crate::tp`]).
pub fn tensor_parallel(tp: u32) -> Result<Option<mlex_core::distributed::Shard>> {
    match crate::tp::role(tp) {
        crate::tp::Role::Single => Ok(None),
        crate::tp::Role::Rank(n) => crate::tp::join(n).map(Some),
        crate::tp::Role::Launch(n) => Err(Error::invalid(
            "--tp",
            format!("{n} ranks must be started by the launcher (MLX_RANK is not set)"),
        )),
    }
}

/// Loads the model at `spec` under `dispatch`, materialising its weights
/// behind a progress bar (shown on a terminal only).
pub fn load_model(spec: &str, registry: &Registry, dispatch: &Dispatch) -> Result<LoadedModel> {
    load_model_mtp(spec, registry, dispatch, false)
}

/// [`load_model`], with the multi-token-prediction head when `mtp`.
pub fn load_model_mtp(
    spec: &str,
    registry: &Registry,
    dispatch: &Dispatch,
    mtp: bool,
) -> Result<LoadedModel> {
    let show = std::io::stderr().is_terminal();
    let spinner = show.then(|| {
        let pb = ProgressBar::new_spinner();
        pb.set_message(format!("opening {spec}"));
        pb.enable_steady_tick(std::time::Duration::from_millis(120));
        pb
    });
    let loaded = mlex_models::load::load_with_mtp(spec, registry, dispatch, mtp);
    if let Some(pb) = spinner {
        pb.finish_and_clear();
    }
    let loaded = loaded?;
    let total: u64 = loaded.model.params.nbytes() as u64;
    let bar = show.then(|| {
        let pb = ProgressBar::new(total);
        pb.set_style(
            ProgressStyle::with_template("loading weights {bar:30} {bytes}/{total_bytes} ({eta})")
                .expect("valid template"),
        );
        pb
    });
    let tensors: Vec<_> = loaded.model.params.iter().map(|(_, a)| a.clone()).collect();
    for chunk in tensors.chunks(16) {
        mlx_rs::transforms::eval(chunk.iter())?;
        if let Some(pb) = &bar {
            pb.inc(chunk.iter().map(|a| a.nbytes() as u64).sum());
        }
    }
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    Ok(loaded)
}

/// Loads the model of `m` and quantizes it when `--quantize` asks.
pub fn load_with(m: &ModelArgs, registry: &Registry) -> Result<LoadedModel> {
    load_for(m, None, registry)
}

/// [`load_with`] for a command that may decode speculatively: with the
/// multi-token-prediction head when `s` asks for `--mtp`.
pub fn load_for(
    m: &ModelArgs,
    s: Option<&crate::args::SpeculativeArgs>,
    registry: &Registry,
) -> Result<LoadedModel> {
    let mtp = s.is_some_and(|s| s.mtp);
    let kv = m.kv_quantization()?;
    let window = m.max_kv_size()?;
    let mut loaded = load_model_mtp(&m.model, registry, &dispatch(Some(m))?, mtp)?;
    if let Some(bits) = m.quantize {
        let arch = registry.architecture(&loaded.model.arch)?;
        loaded.model = mlex_models::quantize::quantize(
            &loaded.model,
            arch.as_ref(),
            registry,
            m.group_size,
            bits,
        )?;
        loaded.fingerprint = mlex_models::load::fingerprint(&loaded.model)?;
    } else if dense_weights(m.weights, &loaded.model)? {
        let arch = registry.architecture(&loaded.model.arch)?;
        if let Some(model) = mlex_models::quantize::dequantize(
            &loaded.model,
            arch.as_ref(),
            registry,
            mlx_rs::Dtype::Float32,
        )? {
            loaded.model = model;
            loaded.fingerprint = mlex_models::load::fingerprint(&loaded.model)?;
        }
    }
    if let Some(max) = window {
        loaded.model.max_kv_size = Some(max);
        loaded.fingerprint = format!("{}-window{max}", loaded.fingerprint);
    }
    if let Some(q) = kv {
        loaded.model.kv_quantization = Some(q);
        // A prompt-cache file holds caches of one form.
        loaded.fingerprint = format!(
            "{}-kv{}g{}s{}",
            loaded.fingerprint, q.bits, q.group_size, q.start
        );
    }
    if let Some(shard) = &loaded.model.dispatch.tensor_parallel {
        // Each rank's caches hold its heads: one prompt-cache file a rank.
        loaded.fingerprint = format!(
            "{}-tp{}of{}",
            loaded.fingerprint,
            shard.rank(),
            shard.size()
        );
    }
    Ok(loaded)
}

/// Whether `--weights` (its `auto` rule included) dequantizes `model`.
fn dense_weights(form: crate::args::WeightForm, model: &mlex_core::model::Model) -> Result<bool> {
    use crate::args::WeightForm;
    Ok(match form {
        WeightForm::Stored => false,
        WeightForm::Dense => !model.quantization.is_none(),
        WeightForm::Auto => {
            if model.quantization.is_none()
                || mlex_core::device::runtime_info()?.default_device != "cpu"
                || mlex_core::device::cpu_blas() != mlex_core::device::CpuBlas::OpenBlas
            {
                return Ok(false);
            }
            // The f32 size: a packed matrix holds 32 / bits weights per u32.
            let names: std::collections::HashSet<&str> =
                model.params.iter().map(|(n, _)| n).collect();
            let dense_bytes: u64 = model
                .params
                .iter()
                .filter(|(n, _)| !n.ends_with(".scales") && !n.ends_with(".biases"))
                .map(|(n, a)| {
                    let module = n.strip_suffix(".weight").unwrap_or(n);
                    let per_element = match model.quantization.for_module(module) {
                        Some(q) if names.contains(format!("{module}.scales").as_str()) => {
                            32.0 / f64::from(q.bits.max(1))
                        }
                        _ => 1.0,
                    };
                    a.size() as f64 * per_element * 4.0
                })
                .sum::<f64>() as u64;
            // Packed and dense copies coexist while dequantizing.
            dense_bytes + model.params.nbytes() as u64 <= physical_memory() / 4
        }
    })
}

fn physical_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || size <= 0 {
        return 0;
    }
    pages as u64 * size as u64
}

/// The model's tokenizer (from the directory or the GGUF metadata).
pub fn tokenizer_for(loaded: &LoadedModel) -> Result<Tokenizer> {
    match (&loaded.source, &loaded.gguf_tokenizer) {
        (ModelSource::Gguf(_), Some(g)) => Tokenizer::from_gguf(g),
        (ModelSource::Dir(d), _) => Tokenizer::from_dir(d),
        (ModelSource::Gguf(p), None) => Err(Error::Other(format!(
            "{} has no tokenizer metadata",
            p.display()
        ))),
    }
}

/// Parses `ID=BIAS` pairs.
fn parse_bias(items: &[String]) -> Result<Vec<(u32, f32)>> {
    items
        .iter()
        .map(|s| {
            let (id, b) = s
                .split_once('=')
                .ok_or_else(|| Error::invalid("--logit-bias", format!("`{s}` is not ID=BIAS")))?;
            let id: u32 = id
                .trim()
                .parse()
                .map_err(|_| Error::invalid("--logit-bias", format!("`{id}` is not a token id")))?;
            let b: f32 = match b.trim() {
                "-inf" => f32::NEG_INFINITY,
                v => v.parse().map_err(|_| {
                    Error::invalid("--logit-bias", format!("`{v}` is not a number"))
                })?,
            };
            Ok((id, b))
        })
        .collect()
}

/// Generation options from the command line.
pub fn generate_options(
    s: &SamplingArgs,
    tokenizer: Option<&Tokenizer>,
    vocab: usize,
) -> Result<GenerateOptions> {
    let sampler = SamplerConfig {
        temp: s.temp,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        repetition_context: s.repetition_context,
        logit_bias: parse_bias(&s.logit_bias)?,
        seed: s.seed,
    };
    sampler.validate(vocab)?;
    if s.max_tokens == 0 {
        return Err(Error::invalid("--max-tokens", "must be at least 1"));
    }
    let stop_ids = if s.ignore_eos {
        Default::default()
    } else {
        tokenizer.map(|t| t.eos_ids.clone()).unwrap_or_default()
    };
    Ok(GenerateOptions {
        max_tokens: s.max_tokens,
        sampler,
        stop_ids,
        use_prompt_cache: true,
        ..Default::default()
    })
}

/// The generator every command decodes with: `model` under the shared
/// model options (compile policy, prefill step, checkpoint interval).
pub fn generator(model: mlex_core::model::Model, m: &ModelArgs) -> mlex_generate::Generator {
    let mut g = mlex_generate::Generator::with_policy(model, compile(m));
    g.checkpoint_every = m.checkpoint_every;
    g
}

/// Turns on the drafter `s` asks for (if any) in `generator`, whose model
/// was loaded with `m`; a draft model loads with the same options.
/// `prompt_cache`: the command reuses prefixes (`--prompt-cache`), which
/// the MTP head cannot draft after yet.
pub fn speculative(
    generator: &mut mlex_generate::Generator,
    s: &crate::args::SpeculativeArgs,
    m: &ModelArgs,
    registry: &Registry,
    prompt_cache: bool,
) -> Result<()> {
    let k = mlex_generate::check_draft_tokens(s.draft_tokens)?;
    if s.mtp && prompt_cache {
        // The head drafts from every prompt position's state, which a
        // restored prefix does not have.
        return Err(Error::invalid(
            "--mtp",
            "cannot be used with --prompt-cache yet: the head needs the states of every prompt position",
        ));
    }
    let drafter: Box<dyn mlex_generate::Drafter> = if let Some(path) = &s.draft_model {
        Box::new(draft_model(generator, path, m, registry)?)
    } else if s.lookup {
        Box::new(mlex_generate::PromptLookup::default())
    } else if s.mtp {
        Box::new(mlex_generate::MtpDrafter::new())
    } else {
        return Ok(());
    };
    generator.speculative = Some((drafter, k));
    Ok(())
}

/// The batch's speculation `s` asks for (if any), for a batched engine on
/// `generator`'s model (loaded with `m`): one drafter per admitted
/// request, a draft model loaded once and shared by them; rounds while at
/// most the model's `Dispatch::speculative_rows` sequences are active.
/// `--mtp` needs the model loaded with its head ([`load_for`]); its rows
/// prefill on their own, never from the prompt cache.
pub fn batch_speculation(
    generator: &mlex_generate::Generator,
    s: &crate::args::SpeculativeArgs,
    m: &ModelArgs,
    registry: &Registry,
) -> Result<Option<mlex_generate::BatchSpeculation>> {
    let k = mlex_generate::check_draft_tokens(s.draft_tokens)?;
    let make: Box<dyn FnMut() -> Result<Box<dyn mlex_generate::Drafter>>> = if s.mtp {
        Box::new(|| {
            Ok(Box::new(mlex_generate::MtpDrafter::new()) as Box<dyn mlex_generate::Drafter>)
        })
    } else if let Some(path) = &s.draft_model {
        let base = draft_model(generator, path, m, registry)?;
        Box::new(move || Ok(Box::new(base.share()) as Box<dyn mlex_generate::Drafter>))
    } else if s.lookup {
        Box::new(|| {
            Ok(Box::new(mlex_generate::PromptLookup::default()) as Box<dyn mlex_generate::Drafter>)
        })
    } else {
        return Ok(None);
    };
    Ok(Some(mlex_generate::BatchSpeculation {
        make,
        k,
        max_rows: generator.model.dispatch.speculative_rows,
    }))
}

/// The draft model at `path` (`--draft-model`), loaded with the target's
/// options `m`, checked against `generator`'s vocabulary; it keeps no
/// prefix checkpoints of its own.
fn draft_model(
    generator: &mlex_generate::Generator,
    path: &str,
    m: &ModelArgs,
    registry: &Registry,
) -> Result<mlex_generate::DraftModel> {
    let dm = ModelArgs {
        model: path.to_owned(),
        ..m.clone()
    };
    let draft = load_with(&dm, registry)?;
    let mut g = mlex_generate::Generator::with_policy(draft.model, compile(m));
    g.checkpoint_every = 0;
    mlex_generate::DraftModel::new(g, generator.model.vocab_size() as usize, path)
}

/// Shared model options → the compile policy (`None`: eager decode).
pub fn compile(m: &ModelArgs) -> Option<mlex_compile::CompilePolicy> {
    match (m.no_compile, m.compile_recurrent) {
        (true, _) => None,
        (false, true) => Some(mlex_compile::CompilePolicy::Recurrent),
        (false, false) => Some(mlex_compile::CompilePolicy::All),
    }
}

/// The generator of `generate` and `chat`: [`generator`] with the drafter
/// `a` asks for ([`speculative`]) and, with `prompt_cache` (the
/// `--prompt-cache` folder), this model's cache file there loaded when it
/// exists; a file that is truncated, of another format or for another model
/// is an error naming it.
pub fn decoder(
    loaded: LoadedModel,
    a: &impl crate::args::DecoderArgs,
    registry: &Registry,
) -> Result<(mlex_generate::Generator, Option<PromptCacheFile>)> {
    let (m, s, prompt_cache) = (a.model(), a.speculative(), a.prompt_cache());
    let mut g = generator(loaded.model, m);
    speculative(&mut g, s, m, registry, prompt_cache.is_some())?;
    let file = match prompt_cache {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
            let file = PromptCacheFile {
                path: dir.join(format!("{}.safetensors", loaded.fingerprint)),
                fingerprint: loaded.fingerprint,
            };
            if file.path.exists() {
                g.prompt_cache.load(&file.path, &file.fingerprint)?;
            }
            Some(file)
        }
        None => None,
    };
    Ok((g, file))
}

/// One model's prompt-cache file (`<fingerprint>.safetensors` in the
/// `--prompt-cache` folder).
pub struct PromptCacheFile {
    path: std::path::PathBuf,
    fingerprint: String,
}

impl PromptCacheFile {
    /// Writes `generator`'s prompt cache to the file.
    pub fn save(&self, generator: &mlex_generate::Generator) -> Result<()> {
        generator.prompt_cache.save(&self.path, &self.fingerprint)
    }
}
