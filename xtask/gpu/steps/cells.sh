# the bench-vs-mlxlm memory cells not yet measured: 4-bit at prompts 128 and 4096, bf16 batch 8
#
# One device call: on the real-shape checkpoints of SHAPES (default
# qwen3-0.6b,qwen3_5), mlex against mlx-lm (bench_vs_mlxlm.py, PAIRS
# alternating pairs a case, GEN tokens): 4-bit weights (quantized on load)
# at prompts of 128 and 4,096 tokens, then bf16 batch 8 of 128-token
# prompts against mlx-lm's BatchGenerator. No run starts after DEADLINE_S
# seconds of each comparison. Needs the CUDA bundle's files in .gpu/, the
# mlx-cuda-pack archive in .mlx-cuda/ and the mlx / mlx-lm wheels in .whl/;
# writes $OUT/cells/{quant4,batch8}.{json,md}.
#
#   [SHAPES=...] bash xtask/gpu/run.sh cells [PAIRS] [GEN] [DEADLINE_S]
PAIRS=${1:-2}; GEN=${2:-128}; DEADLINE=${3:-200}
SHAPES=${SHAPES:-qwen3-0.6b,qwen3_5}
wheels
models "$SHAPES"
mkdir -p "$O/cells"
vs_mlxlm --shapes "$SHAPES" --quants 4 --prompt-lens 128,4096 --gen "$GEN" --pairs "$PAIRS" \
  --timeout 120 --deadline "$DEADLINE" --out "$O/cells/quant4"
vs_mlxlm --shapes "$SHAPES" --quants bf16 --batches 8 --prompt-lens 128 --gen "$GEN" --pairs "$PAIRS" \
  --timeout 120 --deadline "$DEADLINE" --out "$O/cells/batch8"
