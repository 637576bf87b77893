# mlex against mlx-lm at real sizes: the MoE hybrids and the 9B hybrid of real_shapes.py, 4-bit
#
# One device call: the 4-bit checkpoints /tmp/models/SHAPE-real of
# real_shapes.py's SHAPES (default all four: Qwen3-Next-80B-A3B-,
# Qwen3.5-35B-A3B- and Nemotron-3-Nano-30B-A3B-like MoE hybrids and a
# Qwen3.5-9B-like dense hybrid, each a stated fraction of its layers; made
# once per machine, with their sizes.json: bytes read per decoded token),
# the GPU's copy bandwidth (MLX, a 2 GiB bf16 array read and written, best
# of 5), then mlex against mlx-lm (bench_vs_mlxlm.py, PAIRS alternating pairs
# a case, GEN tokens) in PHASES (default "p128 batch8 p4096", in that order):
#   p128, p4096  one sequence at a prompt of 128 / 4,096 tokens;
#   batch8       8 prompts of 128 tokens against mlx-lm's BatchGenerator.
# The phases share what is left of TOTAL_S seconds (from the call's start)
# after the checkpoints: each gets its share as bench_vs_mlxlm.py's
# --deadline, so a slow phase cannot starve the next one of all its time.
# mlx-lm's quantized MoE layers run on the same MLX 0.32.2 through
# mlxlm_compat.py. Needs the CUDA bundle's files in .gpu/, the mlx-cuda-pack
# archive in .mlx-cuda/ and the mlx / mlx-lm wheels in .whl/; writes
# $OUT/realsize/{sizes.json,bandwidth.json,PHASE.json,PHASE.md}.
#
# SCALE=full makes and runs them at their real depth instead (one shape a
# call: Qwen3-Next-80B-A3B-like is about 45 GB at 4 bits).
#
#   [SHAPES=...] [SCALE=real|full] [PHASES="p128 batch8 p4096"] bash xtask/gpu/run.sh realsize [PAIRS] [GEN] [TOTAL_S]
PAIRS=${1:-2}; GEN=${2:-128}; TOTAL=${3:-560}
SHAPES=${SHAPES:-qwen3_next-80b-a3b,qwen3_5_moe-35b-a3b,nemotron_h-30b-a3b,qwen3_5-9b}
PHASES=${PHASES:-p128 batch8 p4096}
SCALE=${SCALE:-real}
END=$(( $(date +%s) + TOTAL ))
wheels
mkdir -p "$O/realsize"
t0=$(date +%s)
python3 $B/make_bench_models.py /tmp/models --scale "$SCALE" --shapes "$SHAPES" 2>&1 | grep -v '^\[INFO\]'
echo "checkpoints ready after $(( $(date +%s) - t0 )) s"
python3 - "$SHAPES" "$SCALE" > "$O/realsize/sizes.json" <<'PY'
import json, sys
print(json.dumps({s: json.load(open(f"/tmp/models/{s}-{sys.argv[2]}/sizes.json")) for s in sys.argv[1].split(",")}, indent=1))
PY
python3 - > "$O/realsize/bandwidth.json" <<'PY'
import json, time
import mlx.core as mx
a = mx.random.normal((1 << 14, 1 << 16)).astype(mx.bfloat16)
mx.eval(a)
best = None
for _ in range(5):
    t = time.perf_counter(); b = a * 1; mx.eval(b); t = time.perf_counter() - t
    best = t if best is None else min(best, t)
    del b
print(json.dumps({"bytes_moved": 2 * a.nbytes, "seconds": best, "tb_per_s": 2 * a.nbytes / best / 1e12}))
PY
cat "$O/realsize/bandwidth.json"
set -- $PHASES
while [ $# -gt 0 ]; do
  left=$(( END - $(date +%s) ))
  share=$(( left / $# ))
  echo "phase $1: $share s of the $left s left"
  case "$1" in
    p128 | p4096)
      vs_mlxlm --scale "$SCALE" --shapes "$SHAPES" --prompt-lens "${1#p}" --gen "$GEN" --pairs "$PAIRS" \
        --timeout 150 --deadline "$share" --out "$O/realsize/$1" ;;
    batch8)
      vs_mlxlm --scale "$SCALE" --shapes "$SHAPES" --batches 8 --prompt-lens 128 --gen "$GEN" --pairs "$PAIRS" \
        --timeout 150 --deadline "$share" --out "$O/realsize/batch8" ;;
    *) echo "realsize: no phase '$1' (p128, p4096, batch8)" >&2 ;;
  esac
  shift
done
