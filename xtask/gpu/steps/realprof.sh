# the real-size MoE hybrids on the GPU: the cold start and a decode step's kernels (CUPTI), then shortpeak
#
# One device call, for issue 26's missed real-size goals: the 4-bit
# checkpoints /tmp/models/SHAPE-real of real_shapes.py's SHAPES (default
# the Qwen3-Next-80B-A3B- and Nemotron-3-Nano-30B-A3B-like ones), each
# benched twice at prompt 16, 8 tokens, in a fresh MLX_PTX_CACHE_DIR:
# the first run JIT-compiles every CUDA kernel it uses (MLX's and mlex's,
# NVRTC), the second finds them in that cache; the wall time of both and
# the cache's files after (names, so the split between MLX's kernels and
# mlex's is read from them). Then kprofile.sh on the same checkpoints (a
# plain step's kernels and GPU busy time against its wall time, a
# speculative round's) and shortpeak.sh. Writes $OUT/realprof/ and what
# those steps write.
#
#   [SHAPES="..."] bash xtask/gpu/run.sh realprof
SHAPES=${SHAPES:-qwen3_next-80b-a3b nemotron_h-30b-a3b}
export MLX_PTX_CACHE_DIR=/tmp/ptx-realprof
mkdir -p "$MLX_PTX_CACHE_DIR" "$O/realprof"
# MLX writes a module as NAME.cu, NAME.ptx and NAME.txt, a name of more than
# 245 characters split into folders: the modules are the .ptx files.
modules() { find "$MLX_PTX_CACHE_DIR" -name '*.ptx' | wc -l; }
wheels
python3 $B/make_bench_models.py /tmp/models --scale real --shapes "$(echo $SHAPES | tr ' ' ,)" 2>&1 | tail -1
for m in $SHAPES; do
  for run in cold warm; do
    n0=$(modules); t0=$(date +%s%N)
    timeout 240 $M bench --model /tmp/models/$m-real --prompt-len 16 --gen 8 --repeats 1 --format json \
      > "$O/realprof/$m-$run.txt" 2>&1
    rc=$?
    echo "$m $run: rc $rc, $(( ($(date +%s%N) - t0) / 1000000 )) ms, kernel modules cached $n0 -> $(modules)" |
      tee -a "$O/realprof/cold.txt"
  done
  find "$MLX_PTX_CACHE_DIR" -type f -printf '%s %P\n' | sort -k2 > "$O/realprof/ptx-after-$m.txt"
done
SHAPES="$(for m in $SHAPES; do printf '%s-real ' "$m"; done)"
. "$STEP_DIR/kprofile.sh"
. "$STEP_DIR/shortpeak.sh"
