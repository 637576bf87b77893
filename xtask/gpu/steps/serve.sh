# mlex serve under load against mlx-lm's server; batched CUDA exactness
#
# One device call for the server and the batched engine's CUDA exactness:
#  1. the batched-equals-one-at-a-time tests on the f32 fixtures (test
#     binary .gpu/batch-test, fixtures in .gpu/fixtures) with MLX's default
#     numerics and with MLX_ENABLE_TF32=0 (MLX runs float32 matrix products
#     of two or more rows in TF32 on CUDA by default, one row in full f32);
#  2. the loopback load test (xtask/py/serve_load.py): 32 concurrent openai
#     clients x 20 streamed requests, `mlex serve` against mlx-lm's server on
#     the tiny Qwen3 with a real tokenizer (fixture qwen3-chat cast to bf16),
#     alternating, PAIRS pairs;
#  3. the same load once per engine on the model cast to float32 with TF32
#     off, where batched answers must equal one-at-a-time answers.
# Run from the repository root with the CUDA bundle's files in .gpu/, the
# mlx-cuda-pack archive in .mlx-cuda/ and the wheels (mlx, mlx-lm, openai
# and its needs) in .whl/; writes under $OUT.
#
#  4. `mlex bench --batch 1|32` on the same model: the engine without HTTP;
#  5. the load on bf16 (mlex and mlx-lm, then mlex without the few-row
#     kernel) and on the float32 cast with MLX's default numerics ($VARIANTS
#     picks among bf16, bf16-no-skinny and f32);
#  6. the few-row kernel's CUDA test (.gpu/skinny-test).
#
#   [ENGINES=..] [VARIANTS=..] bash xtask/gpu/run.sh serve PAIRS DEADLINE_S [STEPS]   (STEPS: any of 1-6)
PAIRS=${1:-2}; DEADLINE=${2:-300}; STEPS=${3:-1,2,3}; ENGINES=${ENGINES:-mlex,mlx-lm}
wheels --upgrade || exit 1
export PYTHONUNBUFFERED=1 MLEX_FIXTURES=$PWD/$B/fixtures
$M env | head -3
# The fixture (float32 as `cargo xtask fixtures` makes it, or already cast)
# in bfloat16 and in float32, written beside and then moved into place.
cast() { # DTYPE DIR
  [ -d "$2" ] && return
  cp -r $B/fixtures/qwen3-chat "$2"
  python3 -c "
import mlx.core as mx, sys
mx.set_default_device(mx.cpu)  # a CUDA context here aborted at exit once
w = mx.load('$2/model.safetensors')
mx.save_safetensors('$2/new.safetensors', {k: v.astype(getattr(mx, sys.argv[1])) for k, v in w.items()}, metadata={'format': 'mlx'})" "$1" \
    && mv "$2/new.safetensors" "$2/model.safetensors"
}
cast bfloat16 /tmp/qwen3-chat-bf16
cast float32 /tmp/qwen3-chat-f32
if [[ $STEPS == *1* ]]; then
  for tf32 in 1 0; do
    echo "== batched vs one at a time on the f32 fixtures, MLX_ENABLE_TF32=$tf32"
    MLX_ENABLE_TF32=$tf32 timeout 200 $B/batch-test a_row_taken --nocapture > "$O/rows-tf32-$tf32.log" 2>&1
    grep -E "differs|test result" "$O/rows-tf32-$tf32.log" | sed 's/^ *//' | sort | uniq | tail -12
    MLX_ENABLE_TF32=$tf32 timeout 200 $B/batch-test batched_greedy_equals --nocapture > "$O/greedy-tf32-$tf32.log" 2>&1
    grep -E "panicked|assertion|left|right|test result" "$O/greedy-tf32-$tf32.log" | head -6
  done
fi
if [[ $STEPS == *2* ]]; then
  echo "== load: 32 clients x 20 requests, mlex serve vs mlx_lm server, bf16, $PAIRS pairs"
  python3 xtask/py/serve_load.py --model /tmp/qwen3-chat-bf16 --mlex $M --pairs "$PAIRS" --engines "$ENGINES" \
    --deadline "$DEADLINE" --logs "$O" --out "$O/serve-load.json" 2>&1 | grep -v "^    client"
fi
if [[ $STEPS == *3* ]]; then
  echo "== load on the float32 cast, MLX_ENABLE_TF32=0: answers under load vs one at a time"
  mkdir -p "$O/f32"
  MLX_ENABLE_TF32=0 python3 xtask/py/serve_load.py --model /tmp/qwen3-chat-f32 --mlex $M --pairs 1 \
    --logs "$O/f32" --out "$O/serve-load-f32.json" 2>&1 | grep -v "^    client"
fi
if [[ $STEPS == *4* ]]; then
  echo "== mlex bench on qwen3-chat (bf16): prompt 32, 32 tokens"
  for b in 1 8 32; do $M bench --model /tmp/qwen3-chat-bf16 --batch $b --prompt-len 32 --gen 32 2>&1 | tail -1; done
fi
if [[ $STEPS == *6* ]]; then
  echo "== few-row kernel against MLX's matmul on CUDA"
  timeout 120 $B/skinny-test --ignored 2>&1 | grep -E "^test |test result|panicked|diff"
fi
if [[ $STEPS == *5* ]]; then
  # bf16 with and without the few-row kernel, and the float32 cast with
  # MLX's default numerics (TF32 on), each engine once, in one call.
  run() { # LABEL MODEL ENGINES [ENV...]
    local label=$1 model=$2 engines=$3; shift 3
    mkdir -p "$O/$label"; echo "== $label ($engines${*:+, $*})"
    env "$@" python3 xtask/py/serve_load.py --model "$model" --mlex $M --engines "$engines" \
      --logs "$O/$label" --out "$O/$label/serve-load.json" 2>&1 | grep -v "^    client" | grep -v '^  \$'
  }
  for v in ${VARIANTS:-bf16 bf16-no-skinny f32}; do
    case $v in
      bf16) run bf16 /tmp/qwen3-chat-bf16 mlex,mlx-lm ;;
      bf16-no-skinny) run bf16-no-skinny /tmp/qwen3-chat-bf16 mlex MLEX_SKINNY_ROWS=0 ;;
      f32) run f32 /tmp/qwen3-chat-f32 mlex,mlx-lm ;;
    esac
  done
fi
for f in "$O"/mlex-*.log "$O"/*/mlex-*.log; do
  if [ -f "$f" ]; then echo "$f: $(grep totals "$f")"; fi
done
