# GPU kernels per decode token (or batched step), counted with CUPTI
#
# GPU kernels launched per decode token, per model, counted with CUPTI
# (kcount.c): (kernels at --gen 20 - kernels at --gen 4) / 20 decode steps,
# `mlex bench` with a 16-token prompt (its warm-up is min(gen, 8) tokens, so
# the runs make 7 + 19 and 3 + 3 decode steps: 20 apart). Run from the repository root
# with mlex and the CUDA bundle's scripts in .gpu/, the mlx-cuda-pack
# archive in .mlx-cuda/ and the mlx wheel in .whl/ (for make_bench_models.py).
# With BATCHES="1 8" (and SHAPES, checkpoint folder names), kernels per
# batched decode step instead.
#
#   [BATCHES="1 8"] [SHAPES="qwen3-0.6b-real ..."] bash xtask/gpu/run.sh kcount
wheels
python3 $B/make_bench_models.py /tmp/models --scale real ${SHAPES:+--shapes $(echo ${SHAPES//-real/} | tr ' ' ,)} | tail -1
cupti
echo "cupti: $hdr $lib"
kcount_so || exit 1
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
