# the dense model's peak at short prompts: what mlex's prefill transient over its weights scales with
#
# One device call: on the real-shape bf16 Qwen3-0.6B-like checkpoint,
# `mlex bench --gen 16 --repeats 1` at prompts PROMPTS (default
# "16 64 128 256 512") and, at 128 tokens, with MLEX_FUSE_PROJECTIONS=0,
# with --no-compile and with --prefill-chunk 64; then mlx-lm's
# mlxlm_bench.py at the same prompts. Lines of $OUT/shortpeak.jsonl (the
# bench JSON with the run's label added). The bf16 prompt-128 cell was the
# one memory cell of bench-vs-mlxlm above mlx-lm's (H100, 2026-12-07: 1,270
# against 1,252 MB, weights 1,192). Needs .gpu/, .mlx-cuda/ and .whl/.
#
#   [PROMPTS="16 64 128"] bash xtask/gpu/run.sh shortpeak
PROMPTS=${PROMPTS:-16 64 128 256 512}
wheels
models qwen3-0.6b
d=/tmp/models/qwen3-0.6b-real
J=$O/shortpeak.jsonl; : > "$J"
# mlex bench at prompt P with the label LABEL and extra ARGS; the environment
# of the call passes through (MLEX_FUSE_PROJECTIONS=0 run ...).
ours() { # LABEL P ARGS...
  local label=$1 p=$2; shift 2
  timeout 120 $M bench --model "$d" --prompt-len "$p" --gen 16 --repeats 1 --format json "$@" | tail -1 |
    sed "s/^{/{\"engine\":\"mlex\",\"label\":\"$label\",\"prompt_len\":$p,/" | tee -a "$J"
}
for p in $PROMPTS; do ours default "$p"; done
MLEX_FUSE_PROJECTIONS=0 ours unfused 128
ours eager 128 --no-compile
ours step64 128 --prefill-chunk 64
for p in $PROMPTS; do
  timeout 120 python3 $B/mlxlm_bench.py "$d" --prompt-len "$p" --gen 16 --device gpu | tail -1 |
    sed "s/^{/{\"engine\":\"mlx-lm\",\"label\":\"default\",\"prompt_len\":$p,/" | tee -a "$J"
done
echo "shortpeak: $(wc -l < "$J") results"
