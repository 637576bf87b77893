# fused projections: kernels per token, rates on / off, against mlx-lm
#
# One device call for the fused projections (q/k/v, gate/up and a Gated
# DeltaNet's inputs as one product each): GPU kernels per decode token with
# MLEX_FUSE_PROJECTIONS=0 and =1 (CUPTI, kcount.c), decode and batched-decode
# rates fused against unfused (the same binary, alternating), then mlex
# against mlx-lm on the same checkpoints (bench_vs_mlxlm.py, alternating).
# Run from the repository root with the CUDA bundle's files in .gpu/, the
# mlx-cuda-pack archive in .mlx-cuda/ and the mlx / mlx-lm wheels in .whl/.
#
#   [KCOUNT=0] [BATCH=0] [VS_SHAPES=..] [QUANTS=bf16,4] bash xtask/gpu/run.sh fused SHAPES ROUNDS PAIRS END_S
#
# KCOUNT=0 skips the kernel counts, BATCH=0 the batch-8 rates; VS_SHAPES
# and QUANTS choose the mlx-lm comparison (default: SHAPES, bf16).
# END_S: seconds after the start by which the last mlx-lm comparison run
# has begun (the sweep before it takes what it needs).
SHAPES=${1:-qwen3-0.6b,qwen3_5,nemotron_h}; ROUNDS=${2:-2}; PAIRS=${3:-3}; END=${4:-480}
wheels
$M env | head -3
models "$SHAPES"
cupti
kcount_so || echo "no CUPTI counter"
if [ "${KCOUNT:-1}" != 0 ]; then
echo "== kernels per decode token (single sequence: 20 steps apart; batch 8: 16 steps apart)"
for s in ${SHAPES//,/ }; do for f in 0 1; do
  a=$(MLEX_FUSE_PROJECTIONS=$f count /tmp/models/$s-real --gen 4); b=$(MLEX_FUSE_PROJECTIONS=$f count /tmp/models/$s-real --gen 20)
  echo "$s fuse=$f: $a / $b -> $(( (b - a) / 20 )) per token"
  a=$(MLEX_FUSE_PROJECTIONS=$f count /tmp/models/$s-real --batch 8 --gen 4); b=$(MLEX_FUSE_PROJECTIONS=$f count /tmp/models/$s-real --batch 8 --gen 20)
  echo "$s fuse=$f batch 8: $a / $b -> $(( (b - a) / 16 )) per step"
done; done
fi
echo "== fused (1) against unfused (0), alternating, $ROUNDS rounds: prompt 128, 256 tokens; then batch 8, 128 tokens each"
for r in $(seq "$ROUNDS"); do for s in ${SHAPES//,/ }; do for f in 1 0; do
  printf "%s fuse=%s single " "$s" "$f"; MLEX_FUSE_PROJECTIONS=$f timeout 120 $M bench --model /tmp/models/$s-real --prompt-len 128 --gen 256 --format json | tail -1
  if [ "${BATCH:-1}" != 0 ]; then
    printf "%s fuse=%s batch8 " "$s" "$f"; MLEX_FUSE_PROJECTIONS=$f timeout 120 $M bench --model /tmp/models/$s-real --batch 8 --prompt-len 128 --gen 128 --format json | tail -1
  fi
done; done; done
echo "== mlex (fused) against mlx-lm"
vs_mlxlm --shapes "${VS_SHAPES:-$SHAPES}" --quants "${QUANTS:-bf16}" --prompt-lens 128 --gen 256 --pairs "$PAIRS" \
  --timeout 120 --deadline $(( END - SECONDS > 30 ? END - SECONDS : 30 )) --out "$O/fused-vs-mlxlm" 2>&1 | tail -30
