//! Command-line interface (clap).

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// Run hybrid language models (attention + Gated DeltaNet / Mamba2 / canon
/// layers) on Apple's MLX: Linux CPU, NVIDIA CUDA, macOS Metal.
#[derive(Parser, Debug)]
#[command(name = "mlex", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Device to run on (default: MLX's default, the GPU when there is one).
    #[arg(long, global = true, value_enum)]
    pub device: Option<DeviceArg>,
    /// Extra architecture spec files, or directories of them (also
    /// $MLEX_ARCH_PATH); `--arch-dir` is the same option.
    #[arg(
        long = "arch-file",
        visible_alias = "arch-dir",
        global = true,
        value_name = "PATH"
    )]
    pub arch_files: Vec<PathBuf>,
}

/// Where MLX runs.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DeviceArg {
    /// The CPU.
    Cpu,
    /// The GPU (CUDA or Metal).
    Gpu,
}

/// Output format.
#[derive(Clone, Copy, Debug, Default, ValueEnum, PartialEq, Eq)]
pub enum Format {
    /// Human-readable.
    #[default]
    Text,
    /// JSON (the last line of output).
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a completion for one prompt.
    #[command(after_help = "Examples:
  mlex generate --model ~/.cache/mlex/models/SmolLM2-135M-Instruct.Q4_1.gguf --prompt \"What is the capital of France?\"
  mlex generate --model ./my-model --prompt-ids 1,2,3 --max-tokens 32 --temp 0 --format json
  mlex generate --model Qwen/Qwen3-0.6B --prompt \"Write a haiku\" --temp 0.7 --top-p 0.9 --seed 1
  mlex generate --model ./my-model --prompts-file prompts.txt --batch 16 --format json")]
    Generate(GenerateArgs),
    /// Chat interactively (multi-turn; /reset and /quit); reads piped stdin too.
    #[command(after_help = "Examples:
  mlex chat --model ~/.cache/mlex/models/SmolLM2-135M-Instruct.Q4_1.gguf
  printf 'Hi\\nWhat did I just say?\\n' | mlex chat --model ./my-model --format json")]
    Chat(ChatArgs),
    /// Measure prefill and decode speed and peak memory.
    #[command(after_help = "Examples:
  mlex bench --model ./my-model --prompt-len 128 --gen 256
  mlex bench --model ./my-model --prompt-len 512 --gen 128 --no-compile --format json
  mlex bench --model ./my-model --prompt-len 128 --gen 128 --batch 32")]
    Bench(BenchArgs),
    /// Show a model's architecture, layer plan, segment schedule and weights.
    #[command(after_help = "Examples:
  mlex inspect --model ./my-model
  mlex inspect --model model.gguf --format json")]
    Inspect(InspectArgs),
    /// List registered architectures and layer kinds, with where each came from.
    #[command(after_help = "Examples:
  mlex list
  mlex list --arch-file my_hybrid.toml --format json")]
    List(ListArgs),
    /// Write the float32 logits of every prompt position (one full forward) to .npy.
    #[command(after_help = "Examples:
  mlex logits --model ./my-model --prompt-ids 1,2,3 --out logits.npy")]
    Logits(LogitsArgs),
    /// Report the MLX runtime (backend, device) and check a matmul against the CPU.
    #[command(after_help = "Examples:
  mlex env
  mlex env --format json")]
    Env(EnvArgs),
    /// Serve an OpenAI-compatible HTTP API (chat and completions, streamed or not) on the batched engine.
    #[command(after_help = "Examples:
  mlex serve --model ./my-model
  mlex serve --model ./my-model --host 0.0.0.0 --port 8080 --batch 32 --api-key secret
  curl localhost:8080/v1/chat/completions -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'")]
    Serve(ServeArgs),
    /// Write a model as an MLX-community checkpoint (what mlx-lm and mlex load): quantized, dequantized or cast.
    #[command(after_help = "Examples:
  mlex convert --model ./my-model --out ./my-model-4bit --quantize 4
  mlex convert --model model.gguf --out ./from-gguf --dequantize --dtype bfloat16
  mlex convert --model ./my-model --out ./mixed --quant-recipe mixed-3-6 --group-size 64")]
    Convert(ConvertArgs),
    /// Measure a model's perplexity on a text file (mlx_lm.perplexity's windows, with an optional stride).
    #[command(after_help = "Examples:
  mlex perplexity --model ./my-model --data book.txt --context 512
  mlex perplexity --model ./my-model --data docs.jsonl --context 1024 --stride 512 --format json")]
    Perplexity(PerplexityArgs),
}

/// A size such as `5GiB`, `500MB` or `4096`.
fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (5GiB, 500MB, 4096)"))?;
    let scale: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        u => return Err(format!("`{u}` is not a unit (KB, MB, GB, KiB, MiB, GiB)")),
    };
    let bytes = (n * scale) as u64;
    if bytes == 0 {
        return Err(format!("`{s}` is empty"));
    }
    Ok(bytes)
}

/// A floating dtype to cast to.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum DtypeArg {
    /// IEEE half precision.
    Float16,
    /// bfloat16.
    Bfloat16,
    /// Single precision.
    Float32,
}

/// mlx-lm's mixed quantization recipes.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum RecipeArg {
    /// 2 bits, 6 for the sensitive layers.
    #[value(name = "mixed-2-6")]
    Mixed26,
    /// 3 bits, 4 for the sensitive layers.
    #[value(name = "mixed-3-4")]
    Mixed34,
    /// 3 bits, 6 for the sensitive layers.
    #[value(name = "mixed-3-6")]
    Mixed36,
    /// 4 bits, 6 for the sensitive layers.
    #[value(name = "mixed-4-6")]
    Mixed46,
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// A model directory, a .gguf file, or a Hugging Face repo id.
    #[arg(long, short)]
    pub model: String,
    /// The folder to write (must not exist).
    #[arg(long)]
    pub out: PathBuf,
    /// Quantize every linear and embedding matrix to this many bits (affine: 2, 3, 4, 5, 6, 8).
    #[arg(long, short = 'q', allow_negative_numbers = true, value_name = "BITS", conflicts_with_all = ["dequantize", "quant_recipe"])]
    pub quantize: Option<i32>,
    /// Quantize by a mixed recipe: more bits for the value and down projections of some layers and the head.
    #[arg(long, value_enum, conflicts_with = "dequantize")]
    pub quant_recipe: Option<RecipeArg>,
    /// Group size for --quantize and --quant-recipe (32, 64, 128).
    #[arg(long, allow_negative_numbers = true, default_value_t = 64)]
    pub group_size: i32,
    /// Dequantize every packed matrix.
    #[arg(long, short = 'd')]
    pub dequantize: bool,
    /// Cast the floating weights (but A_log and e_score_correction_bias) to this dtype.
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Largest weight shard: bytes, or with KB, MB, GB (powers of 1000) or KiB, MiB, GiB.
    #[arg(long, default_value = "5GiB", value_parser = parse_size)]
    pub shard_size: u64,
    /// Output format of the summary.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text: a .txt file (one document) or .jsonl (a `text` field per line).
    #[arg(long)]
    pub data: PathBuf,
    /// Tokens per window (mlx_lm.perplexity's --sequence-length).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(2..))]
    pub context: u64,
    /// Tokens between window starts (default: the context, windows apart); a window after the first scores only its last `stride` tokens.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub stride: Option<u64>,
    /// Windows per forward.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch: u64,
    /// Most windows to score (0: all).
    #[arg(long, default_value_t = 0)]
    pub num_samples: u64,
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (loopback unless you open it).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most sequences decoding together.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: u32,
    /// Most requests waiting beyond --batch; more get 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Require `Authorization: Bearer KEY` on every request (also $MLEX_API_KEY).
    #[arg(long, env = "MLEX_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model id clients use (default: the --model argument's last component).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// max_tokens for requests that give none.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub default_max_tokens: u32,
    /// After SIGTERM, seconds that requests in flight may take before they are cancelled.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Bytes the prompt cache may hold to share prefixes across requests.
    #[arg(long, default_value_t = 4 << 30)]
    pub prompt_cache_bytes: usize,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
}

/// How a quantized checkpoint's weights are held in memory.
#[derive(Clone, Copy, Debug, Default, ValueEnum, PartialEq, Eq)]
pub enum WeightForm {
    /// Dense f32 on the CPU with OpenBLAS when they fit in a quarter of the
    /// memory, else as stored.
    #[default]
    Auto,
    /// As stored (packed quantized matrices stay packed).
    Stored,
    /// Dequantized to dense matrices.
    Dense,
}

/// The model to load.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A model directory, a .gguf file, or a Hugging Face repo id in the local cache.
    #[arg(long, short)]
    pub model: String,
    /// Run decode steps eagerly instead of through compiled segments.
    #[arg(long, conflicts_with = "compile_recurrent")]
    pub no_compile: bool,
    /// Compile only the decode segments with recurrent layers (the others run eagerly).
    #[arg(long)]
    pub compile_recurrent: bool,
    /// Quantize the weights on load to this many bits (2, 3, 4, 5, 6, 8).
    #[arg(long, allow_negative_numbers = true, value_name = "BITS")]
    pub quantize: Option<i32>,
    /// Group size for --quantize (32, 64, 128).
    #[arg(long, allow_negative_numbers = true, default_value_t = 64)]
    pub group_size: i32,
    /// How quantized weights run: `auto` dequantizes them to f32 on the CPU
    /// when OpenBLAS is in use and the dense weights take at most a quarter of
    /// the memory (measured faster there); `stored` keeps them packed; `dense`
    /// always dequantizes.
    #[arg(long, value_enum, default_value_t = WeightForm::Auto)]
    pub weights: WeightForm,
    /// Prompt tokens per prefill step (default: 4096 on a GPU, 64 on the CPU).
    #[arg(long, allow_negative_numbers = true, value_name = "TOKENS", value_parser = clap::value_parser!(u32).range(1..))]
    pub prefill_chunk: Option<u32>,
    /// Snapshot recurrent state every N prompt tokens for prefix reuse (0: only at each prompt's end).
    #[arg(long, value_name = "TOKENS", default_value_t = mlex_generate::DEFAULT_CHECKPOINT_EVERY)]
    pub checkpoint_every: usize,
    /// Store attention keys and values quantized to this many bits (2, 3,
    /// 4, 5, 6, 8) once a sequence has --quantized-kv-start tokens, as
    /// mlx-lm's --kv-bits (single sequences: generate, chat, bench).
    #[arg(long, value_name = "BITS", allow_negative_numbers = true)]
    pub kv_bits: Option<i32>,
    /// Values per scale and bias for --kv-bits (32, 64, 128; must divide
    /// the attention head dim).
    #[arg(
        long,
        value_name = "N",
        allow_negative_numbers = true,
        default_value_t = 64,
        requires = "kv_bits"
    )]
    pub kv_group_size: i32,
    /// With --kv-bits: tokens kept in full precision before the cache is
    /// quantized (mlx-lm's default).
    #[arg(
        long,
        value_name = "TOKENS",
        default_value_t = 5000,
        requires = "kv_bits"
    )]
    pub quantized_kv_start: usize,
    /// Keep at most this many tokens in each full-attention KV cache,
    /// rotating (the first 4 always kept), as mlx-lm's --max-kv-size; for
    /// hybrids too (single sequences: generate, chat, bench).
    #[arg(long, value_name = "TOKENS", conflicts_with = "kv_bits")]
    pub max_kv_size: Option<usize>,
    /// Split the model across N ranks (tensor parallelism over MLX's
    /// distributed layer): started here as N local processes, or this
    /// process is one rank when MLX_RANK is set (generate and bench).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tp: u32,
}

impl ModelArgs {
    /// The KV-cache quantization `--kv-bits` asks for, checked.
    pub fn kv_quantization(
        &self,
    ) -> mlex_core::error::Result<Option<mlex_core::cache::KvQuantization>> {
        self.kv_bits
            .map(|b| {
                mlex_core::cache::KvQuantization::new(
                    b,
                    self.kv_group_size,
                    self.quantized_kv_start,
                )
            })
            .transpose()
    }

    /// The `--max-kv-size` window, checked.
    pub fn max_kv_size(&self) -> mlex_core::error::Result<Option<usize>> {
        self.max_kv_size
            .map(mlex_core::cache::check_max_kv_size)
            .transpose()
    }

    /// An error naming `--kv-bits` or `--max-kv-size` for `what` (a mode
    /// whose caches are neither quantized nor bounded yet) when one is set.
    pub fn refuse_kv_options(&self, what: &str) -> mlex_core::error::Result<()> {
        let option = match (self.kv_bits, self.max_kv_size) {
            (Some(_), _) => "--kv-bits",
            (None, Some(_)) => "--max-kv-size",
            (None, None) => return Ok(()),
        };
        Err(mlex_core::error::Error::invalid(
            option,
            format!(
                "not yet with {what}: the batched engine's caches are unbounded and full precision \
                 ({option} runs one sequence at a time: generate, chat, bench)"
            ),
        ))
    }
}

/// Speculative decoding: a drafter proposes tokens and the model verifies
/// several per forward; the output is what plain decoding gives (token for
/// token when greedy, in distribution when sampling).
#[derive(Args, Debug, Clone)]
pub struct SpeculativeArgs {
    /// Draft with this smaller model of the same tokenizer (a directory, a
    /// .gguf file or a Hugging Face repo id); hybrids on either side.
    #[arg(long, value_name = "PATH", conflicts_with = "lookup")]
    pub draft_model: Option<String>,
    /// Draft by prompt lookup: n-grams of the prompt and the text so far
    /// (no second model); stands down while acceptance stays low.
    #[arg(long, conflicts_with = "mtp")]
    pub lookup: bool,
    /// Draft with the checkpoint's own multi-token-prediction head
    /// (Qwen3-Next, Qwen3.5: `mtp.*` in a Hugging Face checkpoint).
    #[arg(long, conflicts_with = "draft_model")]
    pub mtp: bool,
    /// Most tokens drafted per step (1..=16).
    #[arg(long, value_name = "K", default_value_t = 3)]
    pub draft_tokens: usize,
}

/// Sampling options.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    pub temp: f32,
    /// Nucleus sampling mass (0, 1].
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens below min-p times the top probability (0: off).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalise tokens of the recent context (1: off).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Subtract this from the logit of every token of the recent context
    /// (OpenAI's presence penalty; 0: off).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Subtract this per occurrence in the recent context (OpenAI's
    /// frequency penalty; 0: off).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Tokens the penalties look back over (prompt and output).
    #[arg(long, allow_negative_numbers = true, default_value_t = 20)]
    pub repetition_context: usize,
    /// Add a bias to a token's logit: ID=BIAS (repeatable).
    #[arg(long, value_name = "ID=BIAS")]
    pub logit_bias: Vec<String>,
    /// Seed for sampling (same seed, same output).
    #[arg(long, allow_negative_numbers = true)]
    pub seed: Option<u64>,
    /// Most tokens to generate.
    #[arg(long, allow_negative_numbers = true, default_value_t = 256)]
    pub max_tokens: usize,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text ("-" reads stdin).
    #[arg(long, short, conflicts_with_all = ["prompt_ids", "prompts_file"])]
    pub prompt: Option<String>,
    /// Many prompts, one per line, decoded together (see --batch): text, or
    /// token ids with --ids, or a JSON object {"prompt"|"ids", "max_tokens",
    /// "temp", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
    /// "stop"} whose options override the command line's. One JSON line per
    /// prompt comes out as each finishes, with its `index` (line, from 0).
    #[arg(long, value_name = "FILE", conflicts_with = "prompt_ids")]
    pub prompts_file: Option<PathBuf>,
    /// With --prompts-file: lines are token ids (1,2,3 or 1 2 3), not text.
    #[arg(long, requires = "prompts_file")]
    pub ids: bool,
    /// With --prompts-file: at most N sequences in flight.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: u32,
    /// The prompt as token ids: 1,2,3 (no template, no tokenizer needed).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// A system prompt for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Send the prompt as raw text, without the chat template.
    #[arg(long)]
    pub no_chat_template: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// Keep the prompt cache in DIR across runs (one file per model, written atomically).
    #[arg(long, value_name = "DIR", conflicts_with = "prompts_file")]
    pub prompt_cache: Option<std::path::PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

/// What `generate` and `chat` build their generator from
/// ([`crate::session::decoder`]).
pub trait DecoderArgs {
    /// The model and how to load it.
    fn model(&self) -> &ModelArgs;
    /// The drafter, if any.
    fn speculative(&self) -> &SpeculativeArgs;
    /// The `--prompt-cache` folder.
    fn prompt_cache(&self) -> Option<&std::path::Path>;
}

macro_rules! decoder_args {
    ($($t:ty),*) => {$(
        impl DecoderArgs for $t {
            fn model(&self) -> &ModelArgs {
                &self.model
            }
            fn speculative(&self) -> &SpeculativeArgs {
                &self.speculative
            }
            fn prompt_cache(&self) -> Option<&std::path::Path> {
                self.prompt_cache.as_deref()
            }
        }
    )*};
}
decoder_args!(GenerateArgs, ChatArgs);

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A system prompt.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// Keep the prompt cache in DIR across runs (one file per model, written atomically).
    #[arg(long, value_name = "DIR")]
    pub prompt_cache: Option<std::path::PathBuf>,
    /// Output format: json prints one object per turn.
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length in tokens (random ids).
    #[arg(long, allow_negative_numbers = true, default_value_t = 128)]
    pub prompt_len: usize,
    /// Tokens to generate.
    #[arg(long, allow_negative_numbers = true, default_value_t = 128)]
    pub gen: usize,
    /// Timed repetitions (the best is reported).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1)]
    pub repeats: usize,
    /// Decode N random prompts together (continuous batching) and report
    /// aggregate prefill, decode and overall tok/s.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: Option<u32>,
    /// Time to first token of a `--prompt-len` prompt that shares its first
    /// N tokens with one run before it (prefix reuse through the prompt
    /// cache), against the same prompt cold; `--repeats` alternating pairs,
    /// one process, after a warm-up of both.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "batch")]
    pub shared_prefix: Option<u32>,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// Speculative decoding at a set acceptance (0..=1): a bench-only
    /// drafter proposes the model's own greedy continuation, each token
    /// spoiled with probability 1 - A; `--repeats` alternating pairs of
    /// plain and speculative runs, medians and spread.
    /// With `--batch`: plain and speculative batches alternate (needs
    /// `--force-acceptance`).
    #[arg(long, value_name = "A", conflicts_with_all = ["shared_prefix", "lookup", "draft_model"])]
    pub draft_acceptance: Option<f64>,
    /// With `--draft-acceptance`: each round keeps exactly the drafts
    /// before the first spoiled one, whatever the model says (the output
    /// is then not the model's). On random weights in low precision, near
    /// ties make the model's own continuation an unreliable script; this
    /// measures the mechanism at the set acceptance.
    #[arg(long, requires = "draft_acceptance")]
    pub force_acceptance: bool,
    /// The cost of one verify forward over T = 1..=8 tokens against one
    /// decode step, after a `--prompt-len` prompt (`--repeats` timings
    /// each, medians).
    #[arg(long, conflicts_with_all = ["batch", "shared_prefix", "draft_acceptance"])]
    pub verify_cost: bool,
    /// With --batch: hold every sequence to this JSON schema (a file), to
    /// measure what constrained decoding costs per token.
    #[arg(long, value_name = "FILE", requires = "batch")]
    pub json_schema: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A model directory, a .gguf file, or a Hugging Face repo id.
    #[arg(long, short)]
    pub model: String,
    /// Print the resolved plan instead: every block with its norms, mixer,
    /// feed-forward, options and weight names, as one readable text.
    #[arg(long)]
    pub spec: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
    /// Print the registry as the Markdown of docs/architectures.md
    /// (`cargo xtask codegen` writes that file with it).
    #[arg(long, conflicts_with = "format")]
    pub markdown: bool,
}

#[derive(Args, Debug)]
pub struct LogitsArgs {
    /// A model directory, a .gguf file, or a Hugging Face repo id.
    #[arg(long, short)]
    pub model: String,
    /// Prompt token ids: 1,2,3.
    #[arg(long, value_delimiter = ',', required = true)]
    pub prompt_ids: Vec<u32>,
    /// Output .npy file.
    #[arg(long)]
    pub out: PathBuf,
    /// Split the model across N ranks (see `mlex generate --tp`).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tp: u32,
    /// The checkpoint's multi-token-prediction head's logits instead: row
    /// j predicts token j + 2 from the trunk's state at j and token j + 1
    /// (`[T - 1, V]`, what `--mtp` drafts first).
    #[arg(long)]
    pub mtp: bool,
}

#[derive(Args, Debug)]
pub struct EnvArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}
