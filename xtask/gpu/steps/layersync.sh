# layer-by-layer prefill (MLEX_LAYER_SYNC_ROWS) against whole-step graphs: same tokens, peak, speed
#
# One device call: on the real-shape bf16 checkpoints of SHAPES (default
# qwen3-0.6b,qwen3_5,nemotron_h): greedy tokens of a 3,000-token prompt with
# the layer sync on (the CUDA default) and off, compared; then `mlex bench`
# at prompt P (default 4096), 16 tokens, alternating on / off PAIRS times
# (default 2); then, sync on, prompt LONG (default 16384) for the first two
# shapes and a batch of 32 prompts of 128 tokens for qwen3_5. Lines of
# $OUT/layersync.jsonl (bench JSON with `shape`, `sync` and `case` added).
# Needs the CUDA bundle's files in .gpu/, the mlx-cuda-pack archive in
# .mlx-cuda/ and the mlx wheel in .whl/.
#
#   [SHAPES=...] [PAIRS=2] [LONG=16384] [EXTRA=0: no long prompt, no batch] bash xtask/gpu/run.sh layersync [P]
P=${1:-4096}
SHAPES=${SHAPES:-qwen3-0.6b,qwen3_5,nemotron_h}
wheels
models "$SHAPES"
J=$O/layersync.jsonl; : > "$J"
ids=$(python3 -c 'import random; random.seed(0); print(",".join(str(random.randrange(1000, 30000)) for _ in range(3000)))')
tag() { sed "s/^{/{\"shape\":\"$1\",\"sync\":$2,\"case\":\"$3\",/" | tee -a "$J"; }
bench() { # SHAPE SYNC CASE ARGS...
  local s=$1 y=$2 c=$3; shift 3
  env $( [ "$y" = 0 ] && echo MLEX_LAYER_SYNC_ROWS=0 ) timeout 150 $M bench --model /tmp/models/$s-real --gen 16 \
    --repeats 1 --format json "$@" | tail -1 | tag "$s" "$y" "$c"
}
for s in ${SHAPES//,/ }; do
  for y in 1 0; do
    env $( [ "$y" = 0 ] && echo MLEX_LAYER_SYNC_ROWS=0 ) timeout 150 $M generate --model /tmp/models/$s-real \
      --prompt-ids "$ids" --max-tokens 24 --temp 0 --format json | tail -1 > "$O/tokens-$s-$y.json"
  done
  python3 -c "import json,sys; a,b=(json.load(open(f))['token_ids'] for f in sys.argv[1:]); print('== $s tokens with sync on and off:', 'identical' if a==b else f'DIFFER {a} {b}')" \
    "$O/tokens-$s-1.json" "$O/tokens-$s-0.json"
  # mlx-lm's greedy tokens of the same prompt: how far each agrees.
  timeout 120 python3 - "$ids" /tmp/models/$s-real "$O/tokens-$s-1.json" "$O/tokens-$s-0.json" <<'PY'
import json, pathlib, sys
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
ids = [int(t) for t in sys.argv[1].split(",")]
model, _ = load_model(pathlib.Path(sys.argv[2]))
ref = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(ids), model, max_tokens=24,
        sampler=lambda l: mx.argmax(l, -1))), range(24))]
def agree(f):
    got = json.load(open(f))["token_ids"]
    return next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
print(f"== {pathlib.Path(sys.argv[2]).name}: tokens equal to mlx-lm's before the first difference: sync on {agree(sys.argv[3])}, off {agree(sys.argv[4])} of {len(ref)}")
PY
  for _ in $(seq "${PAIRS:-2}"); do
    bench "$s" 1 "prompt$P" --prompt-len "$P"
    bench "$s" 0 "prompt$P" --prompt-len "$P"
  done
done
[ "${EXTRA:-1}" = 0 ] && { echo "layersync: $(wc -l < "$J") results"; return 0; }
for s in $(echo "${SHAPES//,/ }" | cut -d' ' -f1-2); do
  bench "$s" 1 "prompt${LONG:-16384}" --prompt-len "${LONG:-16384}" --prefill-chunk 4096
done
for y in 1 0; do
  bench qwen3_5 "$y" batch32 --prompt-len 128 --batch 32
done
echo "layersync: $(wc -l < "$J") results"
