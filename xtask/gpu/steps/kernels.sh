# custom kernels' CUDA tests and the sweeps behind the dispatch defaults
#
# One device call: the custom kernels' tests on CUDA, then the measurements
# that choose the dispatch defaults (gated-delta chunk size, prefill step,
# fused decode on/off) and the GPU kernels launched per decode token (ncu).
# Run from the repository root with mlex and mlex-cuda-env.sh of the CUDA bundle,
# and the kernel test binaries (test-*) in .gpu/, the mlx-cuda-pack archive in .mlx-cuda/
# and the mlx / mlx-lm wheels in .whl/; writes under $OUT.
#
#   bash xtask/gpu/run.sh kernels
wheels
$M env
kernel_tests "test |result|panicked|differs"
python3 xtask/py/make_bench_models.py /tmp/models --scale real 2>&1 | tail -1
bench() { timeout 150 $M bench --format json "$@" | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"prefill {d['prefill_tok_s']:9.0f}  decode {d['decode_tok_s']:7.1f}  peak {d['peak_memory_bytes']/1e9:.2f} GB\")"; }
H=/tmp/models/qwen3_5-real; D=/tmp/models/qwen3-0.6b-real; N=/tmp/models/nemotron_h-real
echo "== hybrid prefill 4096 by gated-delta chunk (0 = token loop)"
for c in 0 32 64 128; do printf "chunk %4s  " $c; MLEX_GATED_DELTA_CHUNK=$c bench --model $H --prompt-len 4096 --gen 4; done
echo "== hybrid prefill 16384, chunk 64 / 128"
for c in 64 128; do printf "chunk %4s  " $c; MLEX_GATED_DELTA_CHUNK=$c bench --model $H --prompt-len 16384 --gen 4; done
echo "== decode 256, fused recurrent kernels on / off, alternating"
for i in 1 2 3; do for m in $H $N; do
  printf "%-16s fused  " $(basename $m); bench --model $m --prompt-len 128 --gen 256
  printf "%-16s ops    " $(basename $m); MLEX_FUSED_DECODE=0 bench --model $m --prompt-len 128 --gen 256
done; done
printf "%-16s        " dense; bench --model $D --prompt-len 128 --gen 256
echo "== dense prefill by prefill step"
for P in 4096 16384; do for pc in 512 2048 4096 8192; do printf "P %5s step %4s  " $P $pc; bench --model $D --prompt-len $P --gen 4 --prefill-chunk $pc; done; done
echo "== mlx-lm for reference"
for m in $H $D; do printf "mlx-lm %s P 4096 " $(basename $m); timeout 200 python3 xtask/py/mlxlm_bench.py $m --prompt-len 4096 --gen 4 --device gpu | tail -1; done
echo "== GPU kernels per decode token (ncu; (count at gen 12 - count at gen 4) / 8)"
ncu_count() { timeout 50 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$@" 2>/dev/null | grep -c 'gpu__time_duration.sum'; }
for spec in "$D:" "$H:" "$H:MLEX_FUSED_DECODE=0" "$N:" "$N:MLEX_FUSED_DECODE=0"; do
  m=${spec%%:*}; e=${spec#*:}
  ( [ -n "$e" ] && export "$e"
    a=$(ncu_count $M bench --model $m --prompt-len 16 --gen 4); b=$(ncu_count $M bench --model $m --prompt-len 16 --gen 12)
    echo "$(basename $m) ${e:-default}: $a / $b kernels -> $(( (b - a) / 8 )) per token" )
done
