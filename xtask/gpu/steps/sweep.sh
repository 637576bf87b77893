# speed check after a refactor: mlex against mlx-lm, bf16, batch 1
#
# One device call for a speed check after a refactor: `mlex env`, the
# real-shape bf16 checkpoints of qwen3-0.6b, qwen3_5 and nemotron_h, then
# mlex against mlx-lm on them (bench_vs_mlxlm.py, PAIRS alternating pairs a
# case): prompts of 128 and 4096 tokens, 128 generated, one sequence (no
# --batches, which would keep only the first prompt length); no run starts
# after DEADLINE_S seconds of the comparison. Run from the repository root
# with the CUDA bundle's files in .gpu/, the mlx-cuda-pack archive in
# .mlx-cuda/ and the mlx / mlx-lm wheels in .whl/; writes
# $OUT/sweep/bench-vs-mlxlm.{json,md}.
#
#   bash xtask/gpu/run.sh sweep [PAIRS] [DEADLINE_S]
PAIRS=${1:-3}; DEADLINE=${2:-420}
SHAPES=qwen3-0.6b,qwen3_5,nemotron_h
$M env
wheels
models "$SHAPES"
mkdir -p "$O/sweep"
vs_mlxlm --shapes "$SHAPES" --quants bf16 --prompt-lens 128,4096 --gen 128 --pairs "$PAIRS" \
  --timeout 120 --deadline "$DEADLINE" --out "$O/sweep"
