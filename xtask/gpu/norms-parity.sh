#!/bin/bash
# The parity suite (mlex against mlx-lm's logits and greedy tokens) on CUDA
# for the fixtures in .gpu/fixtures, with the fused norm kernels off (0)
# and on (1), float32 products kept in float32 (MLX_ENABLE_TF32=0, so that
# the suite's float32 tolerances apply); then kernels per decode token on
# and off, and decode rates on, off and mlx-lm's, alternating. Run from the repository root with the CUDA
# bundle's files, the kernel test binary (test-fused_norms, run with
# TESTS=1), the parity test binary (parity) and fixtures/ (with
# manifest.json, dhara-manifest.json and the references) in .gpu/, the
# mlx-cuda-pack archive in .mlx-cuda/ and the wheels in .whl/.
#
#   bash xtask/gpu/norms-parity.sh ROUNDS END_S
set -u
ROUNDS=${1:-2}; END=${2:-300}
B=.gpu; M=$B/mlex
eval "$(sh $B/mlex-cuda-env.sh .mlx-cuda/mlx-cuda-sm90.tar /tmp/mlex-cuda)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
O=${OUT:-/tmp/out}; mkdir -p "$O"
exec > >(tee "$O/norms-parity.log") 2>&1
if [ "${TESTS:-0}" = 1 ]; then
  echo "== kernel tests"
  timeout 150 $B/test-fused_norms --include-ignored --test-threads 1 2>&1 | grep -E "^test |result|panicked|differs"
fi
echo "== parity on CUDA (MLX_ENABLE_TF32=0), fused norms off / on"
for d in $B/fixtures/*/; do f=$(basename $d); for on in 0 1; do
  printf "fused=%s " $on; MLX_ENABLE_TF32=0 MLEX_FUSED_NORMS=$on MLEX_FIXTURES=$PWD/$B/fixtures MLEX_ONLY=$f timeout 60 $B/parity --nocapture 2>&1 | grep -E "ok \(|differ|panicked|FAIL" | head -2
done; done
python3 $B/make_bench_models.py /tmp/models --scale real --shapes qwen3-0.6b,qwen3_5 2>&1 | tail -1
hdr=$(dirname "$(find /usr/local/cuda*/ /opt /usr/lib/python3* -name cupti.h 2>/dev/null | head -1)")
lib=$(dirname "$(find /usr/local/cuda*/ /opt /usr/lib/python3* -name 'libcupti.so*' 2>/dev/null | head -1)")
cuda_h=$(dirname "$(find /usr/local/cuda*/ /opt -name cuda.h 2>/dev/null | head -1)")
cc -shared -fPIC -O2 -I"$hdr" -I"$cuda_h" xtask/gpu/kcount.c -L"$lib" -lcupti -Wl,-rpath,"$lib" -o /tmp/libkcount.so || echo "no CUPTI counter"
count() { LD_PRELOAD=/tmp/libkcount.so timeout 120 $M bench --model "$@" --prompt-len 16 2>&1 | grep -E '^k(count|busy):' | tr '\n' ' '; }
# (--gen 4 and --gen 68 runs: warm-ups of min(gen, 8) tokens make them 68 decode steps apart)
echo "== kernels and GPU time per decode token (runs 68 steps apart)"
for s in qwen3-0.6b qwen3_5; do for on in 0 1; do
  a=$(MLEX_FUSED_NORMS=$on count /tmp/models/$s-real --gen 4); b=$(MLEX_FUSED_NORMS=$on count /tmp/models/$s-real --gen 68)
  python3 -c "import sys,re; a,b=[list(map(int,re.findall(r'\d+',x))) for x in sys.argv[2:4]]; print(f'{sys.argv[1]}: {(b[0]-a[0])/68:.1f} kernels, {(b[1]-a[1])/68/1e3:.1f} us GPU per token')" "$s fused=$on" "$a" "$b"
done; done
echo "== decode: mlex fused norms on (1), off (0), then mlx-lm, alternating (prompt 128, 256 tokens)"
for r in $(seq "$ROUNDS"); do
  [ $SECONDS -gt $(( END - 40 )) ] && { echo "deadline: stop at round $r"; break; }
  for s in qwen3-0.6b qwen3_5; do
    for on in 1 0; do
      printf "%s fused=%s single " "$s" "$on"; MLEX_FUSED_NORMS=$on timeout 60 $M bench --model /tmp/models/$s-real --prompt-len 128 --gen 256 --format json | tail -1
    done
    printf "%s mlx-lm " "$s"; timeout 60 python3 $B/mlxlm_bench.py /tmp/models/$s-real --prompt-len 128 --gen 256 --device gpu | tail -1
  done
  for on in 1 0; do
    printf "qwen3-0.6b fused=%s batch8 " "$on"; MLEX_FUSED_NORMS=$on timeout 60 $M bench --model /tmp/models/qwen3-0.6b-real --batch 8 --prompt-len 128 --gen 128 --format json | tail -1
  done
done
echo "done in $SECONDS s"
