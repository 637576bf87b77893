#!/bin/bash
# One device call for the fused projections (q/k/v, gate/up and a Gated
# DeltaNet's inputs as one product each): GPU kernels per decode token with
# MLEX_FUSE_PROJECTIONS=0 and =1 (CUPTI, kcount.c), decode and batched-decode
# rates fused against unfused (the same binary, alternating), then mlex
# against mlx-lm on the same checkpoints (bench_vs_mlxlm.py, alternating).
# Run from the repository root with the CUDA bundle's files in .gpu/, the
# mlx-cuda-pack archive in .mlx-cuda/ and the mlx / mlx-lm wheels in .whl/.
#
#   [KCOUNT=0] [BATCH=0] [VS_SHAPES=..] [QUANTS=bf16,4] bash xtask/gpu/fused.sh SHAPES ROUNDS PAIRS END_S
#
# KCOUNT=0 skips the kernel counts, BATCH=0 the batch-8 rates; VS_SHAPES
# and QUANTS choose the mlx-lm comparison (default: SHAPES, bf16).
# END_S: seconds after the start by which the last mlx-lm comparison run
# has begun (the sweep before it takes what it needs).
set -u
SHAPES=${1:-qwen3-0.6b,qwen3_5,nemotron_h}; ROUNDS=${2:-2}; PAIRS=${3:-3}; END=${4:-480}
B=.gpu; M=$B/mlex
eval "$(sh $B/mlex-cuda-env.sh .mlx-cuda/mlx-cuda-sm90.tar /tmp/mlex-cuda)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
O=${OUT:-/tmp/out}; mkdir -p "$O"
exec > >(tee "$O/fused.log") 2>&1
$M env | head -3
python3 $B/make_bench_models.py /tmp/models --scale real --shapes "$SHAPES" 2>&1 | tail -1
hdr=$(dirname "$(find /usr/local/cuda*/ /opt /usr/lib/python3* -name cupti.h 2>/dev/null | head -1)")
lib=$(dirname "$(find /usr/local/cuda*/ /opt /usr/lib/python3* -name 'libcupti.so*' 2>/dev/null | head -1)")
cuda_h=$(dirname "$(find /usr/local/cuda*/ /opt -name cuda.h 2>/dev/null | head -1)")
cc -shared -fPIC -O2 -I"$hdr" -I"$cuda_h" xtask/gpu/kcount.c -L"$lib" -lcupti -Wl,-rpath,"$lib" -o /tmp/libkcount.so || echo "no CUPTI counter"
count() { LD_PRELOAD=/tmp/libkcount.so timeout 120 $M bench --model "$@" --prompt-len 16 2>&1 | grep -o 'kcount: [0-9]*' | tail -1 | grep -o '[0-9]*'; }
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
python3 $B/bench_vs_mlxlm.py --mlex $M --models /tmp/models --device gpu --scale real \
  --shapes "${VS_SHAPES:-$SHAPES}" --quants "${QUANTS:-bf16}" --prompt-lens 128 --gen 256 --pairs "$PAIRS" \
  --timeout 120 --deadline $(( END - SECONDS > 30 ? END - SECONDS : 30 )) --out "$O/fused-vs-mlxlm" 2>&1 | tail -30
