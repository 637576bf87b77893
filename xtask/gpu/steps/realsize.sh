# mlex against mlx-lm at real sizes: the MoE hybrids and the 9B hybrid of real_shapes.py, 4-bit
#
# One device call per PHASE, so that a cut-short call keeps what it made: the
# 4-bit checkpoints /tmp/models/SHAPE-real of real_shapes.py's SHAPES
# (default all four: Qwen3-Next-80B-A3B-, Qwen3.5-35B-A3B- and
# Nemotron-3-Nano-30B-A3B-like MoE hybrids and a Qwen3.5-9B-like dense
# hybrid, each a stated fraction of its layers; made once per machine, with
# their sizes.json: bytes read per decoded token), the GPU's copy bandwidth
# (MLX, a 4 GiB bf16 array read and written, best of 5), then mlex against
# mlx-lm (bench_vs_mlxlm.py, PAIRS alternating pairs a case, GEN tokens, no
# run after DEADLINE_S seconds):
#   single  one sequence at prompts PROMPTS (default 128,4096);
#   batch8  8 prompts of 128 tokens against mlx-lm's BatchGenerator.
# mlx-lm's quantized MoE layers run on the same MLX 0.32.2 through
# mlxlm_compat.py. Needs the CUDA bundle's files in .gpu/, the mlx-cuda-pack
# archive in .mlx-cuda/ and the mlx / mlx-lm wheels in .whl/; writes
# $OUT/realsize/{sizes.json,bandwidth.json,PHASE.json,PHASE.md}.
#
#   [SHAPES=...] [PROMPTS=...] bash xtask/gpu/run.sh realsize PHASE [PAIRS] [GEN] [DEADLINE_S]
PHASE=${1:-single}; PAIRS=${2:-2}; GEN=${3:-128}; DEADLINE=${4:-400}
SHAPES=${SHAPES:-qwen3_next-80b-a3b,qwen3_5_moe-35b-a3b,nemotron_h-30b-a3b,qwen3_5-9b}
PROMPTS=${PROMPTS:-128,4096}
wheels
mkdir -p "$O/realsize"
t0=$(date +%s)
python3 $B/make_bench_models.py /tmp/models --scale real --shapes "$SHAPES" 2>&1 | grep -v '^\[INFO\]'
echo "checkpoints ready after $(( $(date +%s) - t0 )) s"
python3 - "$SHAPES" > "$O/realsize/sizes.json" <<'PY'
import json, sys
print(json.dumps({s: json.load(open(f"/tmp/models/{s}-real/sizes.json")) for s in sys.argv[1].split(",")}, indent=1))
PY
python3 - > "$O/realsize/bandwidth.json" <<'PY'
import json, time
import mlx.core as mx
a = mx.random.normal((1 << 31,)).astype(mx.bfloat16)
mx.eval(a)
best = None
for _ in range(5):
    t = time.perf_counter(); b = a * 1; mx.eval(b); t = time.perf_counter() - t
    best = t if best is None else min(best, t)
    del b
print(json.dumps({"bytes_moved": 2 * a.nbytes, "seconds": best, "tb_per_s": 2 * a.nbytes / best / 1e12}))
PY
cat "$O/realsize/bandwidth.json"
case "$PHASE" in
  single)
    vs_mlxlm --shapes "$SHAPES" --prompt-lens "$PROMPTS" --gen "$GEN" --pairs "$PAIRS" \
      --timeout 150 --deadline "$DEADLINE" --out "$O/realsize/single" ;;
  batch8)
    vs_mlxlm --shapes "$SHAPES" --batches 8 --prompt-lens 128 --gen "$GEN" --pairs "$PAIRS" \
      --timeout 150 --deadline "$DEADLINE" --out "$O/realsize/batch8" ;;
  *) echo "realsize: no phase '$PHASE' (single, batch8)" >&2; exit 2 ;;
esac
