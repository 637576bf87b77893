#!/bin/bash
# GPU kernels launched per decode token, per model, counted with CUPTI
# (kcount.c): (kernels at --gen 20 - kernels at --gen 4) / 20 decode steps,
# `mlex bench` with a 16-token prompt (its warm-up is min(gen, 8) tokens, so
# the runs make 7 + 19 and 3 + 3 decode steps: 20 apart). Run from the repository root
# with mlex and the CUDA bundle's scripts in .gpu/, the mlx-cuda-pack
# archive in .mlx-cuda/ and the mlx wheel in .whl/ (for make_bench_models.py).
# With BATCHES="1 8" (and SHAPES, checkpoint folder names), kernels per
# batched decode step instead.
set -u
B=.gpu; M=$B/mlex
eval "$(sh $B/mlex-cuda-env.sh .mlx-cuda/mlx-cuda-sm90.tar /tmp/mlex-cuda)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
O=${OUT:-/tmp/out}; mkdir -p "$O"
exec > >(tee "$O/kcount.log") 2>&1
python3 $B/make_bench_models.py /tmp/models --scale real ${SHAPES:+--shapes $(echo ${SHAPES//-real/} | tr ' ' ,)} | tail -1
hdr=$(dirname "$(find /usr/local/cuda*/ /opt /usr/lib/python3* -name cupti.h 2>/dev/null | head -1)")
lib=$(dirname "$(find /usr/local/cuda*/ /opt /usr/lib/python3* -name 'libcupti.so*' 2>/dev/null | head -1)")
cuda_h=$(dirname "$(find /usr/local/cuda*/ /opt -name cuda.h 2>/dev/null | head -1)")
echo "cupti: $hdr $lib"
cc -shared -fPIC -O2 -I"$hdr" -I"$cuda_h" xtask/gpu/kcount.c -L"$lib" -lcupti -Wl,-rpath,"$lib" -o /tmp/libkcount.so || exit 1
count() { LD_PRELOAD=/tmp/libkcount.so timeout 120 $M bench --model "$@" --prompt-len 16 2>&1 | grep -o 'kcount: [0-9]*' | tail -1 | grep -o '[0-9]*'; }
if [ -n "${BATCHES:-}" ]; then
  # Batched decode: `bench --batch B` warms up with 4 tokens and then times
  # --gen; --gen 20 and --gen 4 are 16 decode steps apart.
  for m in ${SHAPES:-qwen3-0.6b-real}; do for bsz in $BATCHES; do
    a=$(count /tmp/models/$m --batch $bsz --gen 4); b=$(count /tmp/models/$m --batch $bsz --gen 20)
    echo "$m batch $bsz: $a / $b kernels -> $(( (b - a) / 16 )) per decode step"
  done; done
  exit 0
fi
for spec in qwen3-0.6b-real: qwen3_5-real: qwen3_5-real:MLEX_FUSED_DECODE=0 nemotron_h-real: nemotron_h-real:MLEX_FUSED_DECODE=0; do
  m=${spec%%:*}; e=${spec#*:}
  ( [ -n "$e" ] && export "$e"
    for q in ""; do
      a=$(count /tmp/models/$m --gen 4 $q); b=$(count /tmp/models/$m --gen 20 $q)
      echo "$m ${q:-bf16} ${e:-default}: $a / $b kernels -> $(( (b - a) / 20 )) per decode token"
    done )
done
