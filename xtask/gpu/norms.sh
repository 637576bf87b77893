#!/bin/bash
# One device call for the fused norm kernels (q/k norms + RoPE, residual add
# + RMS norm; MLEX_FUSED_NORMS=0 turns both off): their tests on CUDA, greedy
# output with and without them on f32/bf16 fixtures (one sequence and a
# batch), kernels per decode token on and off (CUPTI, kcount.c), decode
# rates on and off alternating, then mlex against mlx-lm (decode, and the
# dense shape at batch 8 against BatchGenerator). Run from the repository
# root with the CUDA bundle's files, the kernel test binaries (test-*) and
# a fixtures/ folder in .gpu/, the mlx-cuda-pack archive in .mlx-cuda/ and
# the mlx / mlx-lm wheels in .whl/; writes under $OUT.
#
#   bash xtask/gpu/norms.sh ROUNDS PAIRS END_S
set -u
ROUNDS=${1:-3}; PAIRS=${2:-3}; END=${3:-540}
B=.gpu; M=$B/mlex
eval "$(sh $B/mlex-cuda-env.sh .mlx-cuda/mlx-cuda-sm90.tar /tmp/mlex-cuda)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
O=${OUT:-/tmp/out}; mkdir -p "$O"
exec > >(tee "$O/norms.log") 2>&1
$M env | head -3
echo "== kernel tests on CUDA"
for t in $B/test-*; do timeout 120 $t --include-ignored --test-threads 1 2>&1 | grep -E "^test |result|panicked|differs"; done
echo "== greedy tokens, fused norms on (1) against off (0)"
printf '1 2 3 4 5\n7 8 9\n10 11 12 13 14 15 16 17 18 19 20\n21\n' > /tmp/p.txt
for f in $B/fixtures/*; do
  for mode in single batch; do
    for on in 0 1; do
      if [ $mode = single ]; then
        MLEX_FUSED_NORMS=$on $M generate --model $f --prompt-ids 3,1,4,1,5,9,2,6 --max-tokens 32 --format json 2>&1 | tail -1 | python3 -c "import json,sys; print(json.load(sys.stdin)['token_ids'])" > /tmp/out$on
      else
        MLEX_FUSED_NORMS=$on $M generate --model $f --prompts-file /tmp/p.txt --ids --batch 4 --max-tokens 32 --format json 2>/dev/null | python3 -c "import json,sys; print(sorted((d['index'], d.get('token_ids')) for d in map(json.loads, sys.stdin) if 'index' in d))" > /tmp/out$on
      fi
    done
    if cmp -s /tmp/out0 /tmp/out1; then r=same; else r=DIFFER; fi
    echo "$(basename $f) $mode: $r $(head -c 90 /tmp/out1)"
  done
done
python3 $B/make_bench_models.py /tmp/models --scale real --shapes qwen3-0.6b,qwen3_5 2>&1 | tail -1
hdr=$(dirname "$(find /usr/local/cuda*/ /opt /usr/lib/python3* -name cupti.h 2>/dev/null | head -1)")
lib=$(dirname "$(find /usr/local/cuda*/ /opt /usr/lib/python3* -name 'libcupti.so*' 2>/dev/null | head -1)")
cuda_h=$(dirname "$(find /usr/local/cuda*/ /opt -name cuda.h 2>/dev/null | head -1)")
cc -shared -fPIC -O2 -I"$hdr" -I"$cuda_h" xtask/gpu/kcount.c -L"$lib" -lcupti -Wl,-rpath,"$lib" -o /tmp/libkcount.so || echo "no CUPTI counter"
count() { LD_PRELOAD=/tmp/libkcount.so timeout 120 $M bench --model "$@" --prompt-len 16 2>&1 | grep -E '^k(count|busy):' | tr '\n' ' '; }
# (--gen 4 and --gen 68 runs: warm-ups of min(gen, 8) tokens make them 68 decode steps apart)
# (`bench --batch` warms up with 4 tokens: its runs are 64 steps apart)
echo "== kernels and GPU time per decode token (runs 68 steps apart; batch 8: 64 steps apart)"
for s in qwen3-0.6b qwen3_5; do for on in 0 1; do
  a=$(MLEX_FUSED_NORMS=$on count /tmp/models/$s-real --gen 4); b=$(MLEX_FUSED_NORMS=$on count /tmp/models/$s-real --gen 68)
  python3 -c "import sys,re; a,b=[list(map(int,re.findall(r'\d+',x))) for x in sys.argv[2:4]]; print(f'{sys.argv[1]}: {(b[0]-a[0])/68:.1f} kernels, {(b[1]-a[1])/68/1e3:.1f} us GPU per token')" "$s fused=$on" "$a" "$b"
  a=$(MLEX_FUSED_NORMS=$on count /tmp/models/$s-real --batch 8 --gen 4); b=$(MLEX_FUSED_NORMS=$on count /tmp/models/$s-real --batch 8 --gen 68)
  python3 -c "import sys,re; a,b=[list(map(int,re.findall(r'\d+',x))) for x in sys.argv[2:4]]; print(f'{sys.argv[1]}: {(b[0]-a[0])/64:.1f} kernels, {(b[1]-a[1])/64/1e3:.1f} us GPU per step')" "$s fused=$on batch 8" "$a" "$b"
done; done
echo "== fused norms on (1) against off (0), alternating: single (prompt 128, 256 tokens), dense batch 8 (128 each)"
for r in $(seq "$ROUNDS"); do
  [ $SECONDS -gt $(( END - 200 )) ] && { echo "deadline: stop at round $r"; break; }
  for s in qwen3-0.6b qwen3_5; do for on in 1 0; do
    printf "%s fused=%s single " "$s" "$on"; MLEX_FUSED_NORMS=$on timeout 60 $M bench --model /tmp/models/$s-real --prompt-len 128 --gen 256 --format json | tail -1
  done; done
  for on in 1 0; do
    printf "qwen3-0.6b fused=%s batch8 " "$on"; MLEX_FUSED_NORMS=$on timeout 60 $M bench --model /tmp/models/qwen3-0.6b-real --batch 8 --prompt-len 128 --gen 128 --format json | tail -1
  done
done
echo "== mlex (fused norms) against mlx-lm: decode"
python3 $B/bench_vs_mlxlm.py --mlex $M --models /tmp/models --device gpu --scale real \
  --shapes qwen3-0.6b,qwen3_5 --quants bf16 --prompt-lens 128 --gen 256 --pairs "$PAIRS" \
  --timeout 60 --deadline $(( END - 100 - SECONDS > 20 ? END - 100 - SECONDS : 20 )) --out "$O/norms-vs-mlxlm" 2>&1 | tail -12
echo "== dense batch 8 against BatchGenerator"
python3 $B/bench_vs_mlxlm.py --mlex $M --models /tmp/models --device gpu --scale real \
  --shapes qwen3-0.6b --quants bf16 --batches 8 --prompt-lens 128 --gen 128 --pairs "$PAIRS" \
  --timeout 60 --deadline $(( END - SECONDS > 20 ? END - SECONDS : 20 )) --out "$O/norms-batch-vs-mlxlm" 2>&1 | tail -8
echo "done in $SECONDS s"
