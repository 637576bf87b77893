//! Backend policy: every choice between an ops form and a kernel, the chunk
//! and step sizes, the few-row product, fusion and dtype workarounds, in one
//! value.
//!
//! A [`Dispatch`] is built once per process (or per test) from the
//! backend's measured defaults ([`Dispatch::for_backend`]), the `MLEX_`
//! environment variables ([`Dispatch::from_env`], the one reader of `MLEX_`
//! runtime variables; a repository rule checks it) and the command line,
//! then passed down: the model keeps it, and every layer and product takes
//! what it needs from it when it is built ([`crate::layer::BuildCtx`],
//! [`crate::weights::WeightLoader`]). `mlex env` prints it and every bench
//! JSON records it. The measurements behind each default are in
//! `docs/BENCHMARKS.md`.

use crate::device::Backend;
use crate::error::{Error, Result};
use mlx_rs::Array;
use serde_json::{json, Value};

/// A dense `x @ w^T` for row counts in `rows` that beats MLX's matmul on
/// some backend (`mlex_kernels::skinny::matmul`); `Ok(None)` hands the
/// product back to MLX. Carried by value in a [`Dispatch`], so this crate
/// holds no kernels and nothing is installed globally.
pub type DenseProduct = fn(x: &Array, w: &Array, rows: (i32, i32)) -> Result<Option<Array>>;

/// The implementation choices of one process.
#[derive(Clone, Debug)]
pub struct Dispatch {
    /// The loaded backend.
    pub backend: Backend,
    /// Chunk size of the chunked gated delta rule; `None` runs every
    /// sequence token by token (`MLEX_GATED_DELTA_CHUNK`, `0` for none).
    pub gated_delta_chunk: Option<usize>,
    /// Sequences shorter than this run token by token (the chunked form's
    /// fixed cost only pays from a few tokens on).
    pub gated_delta_min_len: usize,
    /// Recurrent decode steps as one custom kernel each instead of a dozen
    /// ops (CUDA only; `MLEX_FUSED_DECODE=0` turns it off).
    pub fused_decode: bool,
    /// Dense products whose row count is in this range run as the few-row
    /// kernel (CUDA only; `MLEX_SKINNY_ROWS`, `0` or `LO-HI`).
    pub skinny_rows: Option<(i32, i32)>,
    /// Causal attention of this many query rows over a longer KV cache
    /// runs as ops instead of MLX's fused kernel (CUDA only: there MLX
    /// builds a cuDNN plan per key length, which a speculative verify
    /// forward changes every round; `MLEX_OPS_ATTENTION_ROWS`, `0` or
    /// `LO-HI`).
    pub ops_attention_rows: Option<(i32, i32)>,
    /// Those calls run as one custom kernel (`mlex_kernels::attention`)
    /// where it takes the shapes, instead of a dozen ops a layer (CUDA only;
    /// `MLEX_ATTENTION_ROWS_KERNEL=0` keeps the ops form).
    pub attention_rows_kernel: bool,
    /// The few-row kernel, when a kernels crate provides one.
    pub dense_product: Option<DenseProduct>,
    /// Projections of one input (q/k/v, gate/up) concatenated into one
    /// product at load (`MLEX_FUSE_PROJECTIONS=0` keeps them apart).
    pub fuse_projections: bool,
    /// Quantized products with float32 activations run on the dequantized
    /// weight: MLX's CUDA backend (0.32) has quantized-matmul kernels for
    /// float32 activations only at some shapes and none for a gathered
    /// (MoE) product. True when the default device is a CUDA GPU.
    pub dequantize_f32_products: bool,
    /// Quantized products of a few rows (decode, a verify) with bfloat16
    /// or float16 activations run as float32 quantized matmuls (the
    /// activations cast up, the product cast back). MLX's CPU quantized
    /// matmul (0.32) is 5-7x slower for half-precision activations at one
    /// row and accumulates in half precision; the float32 route decodes
    /// 4-bit models 1.5-6x faster on the CPU but leaves mlx-lm's numbers
    /// (greedy tokens of the random-weight fixtures part after 4-26
    /// steps), so it is off unless asked for (`MLEX_REROUTE_HALF_QUANTIZED=1`,
    /// CPU only; docs/BENCHMARKS.md, 2026-12-07).
    pub reroute_half_quantized: bool,
    /// Attention over a quantized KV cache (`--kv-bits`) dequantizes the
    /// layer's keys and values and runs the fused attention, instead of
    /// mlx-lm's quantized products: MLX's CUDA backend (0.32) has no
    /// quantized-matmul kernel at attention's shapes (mlx-lm's own
    /// `kv_bits` fails there). The cache stays quantized; only one
    /// layer's keys are dequantized at a time. True when the default
    /// device is a CUDA GPU.
    pub dequantize_kv_reads: bool,
    /// Attention under an array mask (a `--max-kv-size` window's prefill)
    /// runs as ops in blocks of query rows: MLX's CUDA attention keeps a
    /// `[H, T, L]` buffer of each masked call until the forward has run.
    /// True on the CUDA backend.
    pub masked_attention_ops: bool,
    /// Prompt tokens per prefill step (`--prefill-chunk`).
    pub prefill_chunk: usize,
    /// A forward of several tokens a row and at least this many rows
    /// (batch x tokens: a prefill piece, not a decode step or a verify
    /// forward) hands each layer to MLX as it is built and waits for the
    /// one before, so that one layer runs while the next is built (CUDA
    /// only; `MLEX_LAYER_SYNC_ROWS`, `0` for none). Why: MLX's CUDA backend keeps
    /// every buffer a batch of kernels used until the batch completes, and
    /// the host builds batches far ahead of the GPU, so one graph of a
    /// whole prefill step held the intermediates of many layers at once
    /// (measured on the H100: 2.5 GB over the weights and cache at a 2,048
    /// step of the dense bench model, where one layer needs 0.13 GB).
    pub layer_sync_rows: Option<usize>,
    /// Under [`Dispatch::layer_sync_rows`], a Gated DeltaNet layer's
    /// chunked scan runs over at most this many tokens at a time (rounded
    /// to whole chunks), one piece in flight: its intermediates are some
    /// 0.5 MB a token.
    pub scan_piece: usize,
    /// A batch speculates (`--lookup`, `--draft-model` with `--prompts-file`
    /// or `mlex serve`) while at most this many sequences are active; a
    /// fuller batch decodes plain steps (`MLEX_SPECULATIVE_ROWS`).
    pub speculative_rows: usize,
    /// A quantized mixture-of-experts product of a few (row, expert) pairs
    /// goes to MLX in calls of at most this many pairs, cut along the
    /// expert axis (CUDA only; `MLEX_GATHER_PAIRS`, `0` for one call). Why:
    /// MLX's CUDA `gather_qmm` (0.32.2) runs its vector kernel below 8
    /// pairs a call and a tiled one from 8 on, whose grid at one row an
    /// expert is a few dozen blocks walking the input in steps of 64: a
    /// decode step's expert products of the Qwen3-Next-80B-like shape (10
    /// experts a token) had half the step's kernel time (CUPTI, H100).
    /// Off by default: not yet timed end to end.
    pub gather_pairs: Option<usize>,
    /// This process's rank of a tensor-parallel group (`--tp`): layers
    /// load their part of each split weight and sum their products over
    /// the ranks ([`crate::distributed`]). `None`: one device.
    pub tensor_parallel: Option<crate::distributed::Shard>,
}

/// Prompt tokens per prefill step, at most, under a `--max-kv-size`
/// window when `--prefill-chunk` is not given: a step of `C` tokens over a
/// window of `W` attends to `W - 1 + C` keys a row, `W` of them visible, so
/// smaller steps do less attention work (measured on the H200 at 16k
/// tokens over a 4,096 window, `docs/BENCHMARKS.md`: 1,024 prefilled
/// fastest, in 62% of the memory of 4,096).
pub const WINDOW_PREFILL_CHUNK: usize = 1024;

/// The environment variables [`Dispatch::from_env`] reads, with what each
/// sets (for `mlex env` and the README's table).
pub const ENV_VARS: &[(&str, &str)] = &[
    (
        "MLEX_GATED_DELTA_CHUNK",
        "gated delta chunk size: a power of two, or 0 for the token loop",
    ),
    (
        "MLEX_FUSED_DECODE",
        "0 turns the fused recurrent decode kernels off",
    ),
    (
        "MLEX_SKINNY_ROWS",
        "row range of the few-row product: 0 (off) or LO-HI within 1-64",
    ),
    (
        "MLEX_OPS_ATTENTION_ROWS",
        "causal query rows over a longer cache that attend as ops: 0 (off) or LO-HI within 1-64",
    ),
    (
        "MLEX_ATTENTION_ROWS_KERNEL",
        "0 runs a verify's few causal attention rows as ops instead of one kernel",
    ),
    (
        "MLEX_SPECULATIVE_ROWS",
        "most active sequences a batch speculates with (1-256)",
    ),
    (
        "MLEX_FUSE_PROJECTIONS",
        "0 keeps q/k/v and gate/up as separate products",
    ),
    (
        "MLEX_REROUTE_HALF_QUANTIZED",
        "1 runs few-row quantized products with half-precision activations in float32 (CPU)",
    ),
    (
        "MLEX_GATHER_PAIRS",
        "most (row, expert) pairs of a quantized expert product in one MLX call: 1-64, or 0 for one call",
    ),
    (
        "MLEX_LAYER_SYNC_ROWS",
        "forwards of several tokens a row and at least this many rows run one layer ahead of the GPU: a count, or 0 for whole-step graphs",
    ),
];

impl Dispatch {
    /// The measured defaults of `backend` (chunk sizes measured against the
    /// token loop: on the CPU small chunks win, the `C²` work per token is
    /// paid on cores; on CUDA larger ones, fewer dependent steps; Metal
    /// takes the CUDA choice, untested here). `cuda_device` is whether the
    /// default device is a CUDA GPU.
    pub fn for_backend(backend: Backend, cuda_device: bool) -> Dispatch {
        let gpu = backend != Backend::Cpu;
        let cuda = backend == Backend::Cuda;
        Dispatch {
            gated_delta_chunk: Some(if gpu { 128 } else { 16 }),
            gated_delta_min_len: 8,
            fused_decode: cuda,
            skinny_rows: cuda.then_some((2, 32)),
            // Measured on the H200: causal calls of 2 rows and more over
            // a longer cache each built a cuDNN plan per key length.
            ops_attention_rows: cuda.then_some((2, 32)),
            attention_rows_kernel: cuda,
            dense_product: None,
            fuse_projections: true,
            dequantize_f32_products: cuda_device,
            reroute_half_quantized: false,
            dequantize_kv_reads: cuda_device,
            masked_attention_ops: cuda,
            // A 4,096-token step prefills 7.7x faster than 512 on the H200.
            // On the CPU prefill speed was flat from steps of 512 down to
            // 64 (within the 2-core machine's noise) while the peak fell
            // with the step (a step's attention scores and activations are
            // its transients): 64 (docs/BENCHMARKS.md, 2026-12-06, 12-07).
            prefill_chunk: if gpu { 4096 } else { 64 },
            layer_sync_rows: cuda.then_some(1024),
            scan_piece: 1024,
            // 7 is where MLX's vector kernel ends; off until the cut is
            // measured against one call (`bash xtask/gpu/run.sh moecut`).
            gather_pairs: None,
            // One row gained and fuller batches lost at A = 0.8, K = 3 on
            // both: the H100 (batch 2-32 0.3-0.9x, one row 1.9x) and the
            // 2-core CPU (batch 8 0.84-0.92x, 2-4 rows within 0.84-1.19x
            // of plain, one row 1.22-1.44x; docs/BENCHMARKS.md).
            speculative_rows: 1,
            tensor_parallel: None,
            backend,
        }
    }

    /// The loaded backend's defaults with the `MLEX_` variables applied; a
    /// value a variable cannot take is an error naming it.
    pub fn from_env() -> Result<Dispatch> {
        let backend = crate::device::runtime_info()
            .map(|i| i.backend)
            .unwrap_or(Backend::Cpu);
        let mut d = Dispatch::for_backend(backend, crate::device::default_is_cuda_gpu());
        d.apply_env(|k| std::env::var(k).ok())?;
        Ok(d)
    }

    /// Applies the variables `var` gives (a test passes its own).
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<()> {
        let bad = |key: &str, v: &str, expected: &str| {
            Error::invalid(key, format!("`{v}`: expected {expected}"))
        };
        if let Some(v) = var("MLEX_GATED_DELTA_CHUNK") {
            self.gated_delta_chunk = match v.trim().parse::<usize>() {
                Ok(0) => None,
                Ok(n) if n >= 2 && n.is_power_of_two() => Some(n),
                _ => return Err(bad("MLEX_GATED_DELTA_CHUNK", &v, "0 or a power of two")),
            };
        }
        if let Some(v) = var("MLEX_FUSED_DECODE") {
            self.fused_decode = self.fused_decode && flag("MLEX_FUSED_DECODE", &v)?;
        }
        if let Some(v) = var("MLEX_SKINNY_ROWS") {
            self.skinny_rows = parse_rows(&v)
                .ok_or_else(|| bad("MLEX_SKINNY_ROWS", &v, "0 or a range LO-HI within 1-64"))?;
        }
        if let Some(v) = var("MLEX_OPS_ATTENTION_ROWS") {
            self.ops_attention_rows = parse_rows(&v).ok_or_else(|| {
                bad(
                    "MLEX_OPS_ATTENTION_ROWS",
                    &v,
                    "0 or a range LO-HI within 1-64",
                )
            })?;
        }
        if let Some(v) = var("MLEX_ATTENTION_ROWS_KERNEL") {
            self.attention_rows_kernel =
                self.attention_rows_kernel && flag("MLEX_ATTENTION_ROWS_KERNEL", &v)?;
        }
        if let Some(v) = var("MLEX_SPECULATIVE_ROWS") {
            self.speculative_rows = match v.trim().parse::<usize>() {
                Ok(n) if (1..=256).contains(&n) => n,
                _ => return Err(bad("MLEX_SPECULATIVE_ROWS", &v, "a count within 1-256")),
            };
        }
        if let Some(v) = var("MLEX_REROUTE_HALF_QUANTIZED") {
            let on = flag("MLEX_REROUTE_HALF_QUANTIZED", &v)?;
            self.reroute_half_quantized = on && self.backend == Backend::Cpu;
        }
        if let Some(v) = var("MLEX_FUSE_PROJECTIONS") {
            self.fuse_projections = flag("MLEX_FUSE_PROJECTIONS", &v)?;
        }
        if let Some(v) = var("MLEX_LAYER_SYNC_ROWS") {
            self.layer_sync_rows = match v.trim().parse::<usize>() {
                Ok(0) => None,
                Ok(n) => Some(n),
                _ => return Err(bad("MLEX_LAYER_SYNC_ROWS", &v, "0 or a row count")),
            };
        }
        if let Some(v) = var("MLEX_GATHER_PAIRS") {
            self.gather_pairs = match v.trim().parse::<usize>() {
                Ok(0) => None,
                Ok(n @ 1..=64) => Some(n),
                _ => {
                    return Err(bad(
                        "MLEX_GATHER_PAIRS",
                        &v,
                        "0 or a pair count within 1-64",
                    ))
                }
            };
        }
        Ok(())
    }

    /// Whether a forward of `batch` rows of `tokens` tokens goes to MLX a
    /// layer at a time ([`Dispatch::layer_sync_rows`]).
    pub fn syncs_layers(&self, batch: usize, tokens: usize) -> bool {
        tokens > 1 && self.layer_sync_rows.is_some_and(|n| batch * tokens >= n)
    }

    /// The piece a chunked scan of `batch` rows of `tokens` tokens runs in,
    /// by `chunk` (whole chunks of it), when layers sync; `None` for one
    /// call over the whole sequence.
    pub fn scan_piece_of(
        &self,
        chunk: Option<usize>,
        batch: usize,
        tokens: usize,
    ) -> Option<usize> {
        let chunk = chunk?;
        self.syncs_layers(batch, tokens)
            .then(|| self.scan_piece.div_ceil(chunk).max(1) * chunk)
    }

    /// The few-row kernel and its row range, when both are set.
    pub fn few_row_product(&self) -> Option<(DenseProduct, (i32, i32))> {
        Some((self.dense_product?, self.skinny_rows?))
    }

    /// The choices as JSON (for `mlex env` and bench output).
    pub fn to_json(&self) -> Value {
        json!({
            "backend": self.backend.to_string(),
            "gated_delta_chunk": self.gated_delta_chunk,
            "gated_delta_min_len": self.gated_delta_min_len,
            "fused_decode": self.fused_decode,
            "skinny_rows": self.skinny_rows.map(|(lo, hi)| format!("{lo}-{hi}")),
            "few_row_kernel": self.dense_product.is_some() && self.skinny_rows.is_some(),
            "ops_attention_rows": self.ops_attention_rows.map(|(lo, hi)| format!("{lo}-{hi}")),
            "attention_rows_kernel": self.attention_rows_kernel,
            "fuse_projections": self.fuse_projections,
            "dequantize_f32_products": self.dequantize_f32_products,
            "reroute_half_quantized": self.reroute_half_quantized,
            "dequantize_kv_reads": self.dequantize_kv_reads,
            "masked_attention_ops": self.masked_attention_ops,
            "prefill_chunk": self.prefill_chunk,
            "layer_sync_rows": self.layer_sync_rows,
            "scan_piece": self.scan_piece,
            "gather_pairs": self.gather_pairs,
            "speculative_rows": self.speculative_rows,
            "tensor_parallel": self.tensor_parallel.as_ref().map(|s| json!({
                "rank": s.rank(),
                "size": s.size(),
                "backend": s.backend().name(),
            })),
        })
    }
}

/// `0`/`1` (also `false`/`true`).
fn flag(key: &str, v: &str) -> Result<bool> {
    match v.trim() {
        "0" | "false" => Ok(false),
        "1" | "true" => Ok(true),
        _ => Err(Error::invalid(key, format!("`{v}`: expected 0 or 1"))),
    }
}

/// `0` (off) or `LO-HI` with `1 <= LO <= HI <= 64`.
fn parse_rows(v: &str) -> Option<Option<(i32, i32)>> {
    if v.trim() == "0" {
        return Some(None);
    }
    let (lo, hi) = v.split_once('-')?;
    let (lo, hi): (i32, i32) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
    (1 <= lo && lo <= hi && hi <= 64).then_some(Some((lo, hi)))
}

/// Extra architecture spec paths (`MLEX_ARCH_PATH`, separated like
/// `$PATH`); read here so that this module stays the one reader of `MLEX_`
/// runtime variables.
pub fn arch_path() -> Vec<std::path::PathBuf> {
    std::env::var_os("MLEX_ARCH_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<Dispatch> {
        let mut d = Dispatch::for_backend(Backend::Cuda, true);
        d.apply_env(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })?;
        Ok(d)
    }

    #[test]
    fn variables_override_the_defaults_and_bad_values_name_the_variable() {
        let d = with(&[]).unwrap();
        assert_eq!(d.gated_delta_chunk, Some(128));
        assert_eq!(d.skinny_rows, Some((2, 32)));
        assert_eq!(d.ops_attention_rows, Some((2, 32)));
        let d = with(&[
            ("MLEX_OPS_ATTENTION_ROWS", "0"),
            ("MLEX_GATED_DELTA_CHUNK", "0"),
            ("MLEX_FUSED_DECODE", "0"),
            ("MLEX_SKINNY_ROWS", "4-16"),
            ("MLEX_FUSE_PROJECTIONS", "0"),
            ("MLEX_LAYER_SYNC_ROWS", "0"),
        ])
        .unwrap();
        assert_eq!(d.layer_sync_rows, None);
        // The expert cut: off by default, a count turns it on, 0 off.
        assert_eq!(with(&[]).unwrap().gather_pairs, None);
        let mut cut = with(&[("MLEX_GATHER_PAIRS", "7")]).unwrap();
        assert_eq!(cut.gather_pairs, Some(7));
        cut.apply_env(|k| (k == "MLEX_GATHER_PAIRS").then(|| "0".to_owned()))
            .unwrap();
        assert_eq!(cut.gather_pairs, None);
        assert_eq!(with(&[]).unwrap().layer_sync_rows, Some(1024));
        assert_eq!(d.gated_delta_chunk, None);
        assert!(!d.fused_decode && !d.fuse_projections);
        assert_eq!(d.skinny_rows, Some((4, 16)));
        assert_eq!(d.ops_attention_rows, None);
        for (k, v) in [
            ("MLEX_GATED_DELTA_CHUNK", "48"),
            ("MLEX_SKINNY_ROWS", "0-8"),
            ("MLEX_OPS_ATTENTION_ROWS", "2-99"),
            ("MLEX_FUSED_DECODE", "yes"),
            ("MLEX_LAYER_SYNC_ROWS", "-3"),
            ("MLEX_GATHER_PAIRS", "65"),
            ("MLEX_REROUTE_HALF_QUANTIZED", "on"),
            ("MLEX_SPECULATIVE_ROWS", "0"),
            ("MLEX_SPECULATIVE_ROWS", "257"),
        ] {
            let e = with(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(v), "{e}");
        }
        // A batch drafts only while one sequence is active, on every
        // backend, unless the variable says otherwise.
        let mut cpu = Dispatch::for_backend(Backend::Cpu, false);
        assert_eq!(
            (with(&[]).unwrap().speculative_rows, cpu.speculative_rows),
            (1, 1)
        );
        let rows = with(&[("MLEX_SPECULATIVE_ROWS", "8")]).unwrap();
        assert_eq!(rows.speculative_rows, 8);
        // The CPU has no fused kernels to turn on.
        cpu.apply_env(|k| (k == "MLEX_FUSED_DECODE").then(|| "1".to_owned()))
            .unwrap();
        assert!(!cpu.fused_decode);
        // The float32 route of half-precision quantized products: asked
        // for, on the CPU only.
        assert!(!cpu.reroute_half_quantized);
        cpu.apply_env(|k| (k == "MLEX_REROUTE_HALF_QUANTIZED").then(|| "1".to_owned()))
            .unwrap();
        assert!(cpu.reroute_half_quantized);
        assert!(
            !with(&[("MLEX_REROUTE_HALF_QUANTIZED", "1")])
                .unwrap()
                .reroute_half_quantized
        );
    }
}
