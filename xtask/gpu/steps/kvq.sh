# quantized KV cache (--kv-bits) and KV window (--max-kv-size) against full precision and mlx-lm: peak memory and speed at long prompts
#
# One device call on a real-shape bf16 checkpoint SHAPE (make_bench_models.py):
# at each prompt length of LENS, `mlex bench --gen GEN` with full-precision
# KV, with --kv-bits 8 and 4 (groups of 64, mlx-lm's default start of
# 5,000 tokens) and with a --max-kv-size 4096 window (KVS: the forms, w<N>
# a window of N), alternating with mlxlm_bench.py in the same form for the
# lengths in VS (mlx-lm's own QuantizedKVCache / RotatingKVCache; it
# ignores max_kv_size for models with a cache layout of their own, such as
# qwen3_5 and nemotron_h), PAIRS pairs each. Every
# run is a line of $OUT/kvq-SHAPE.jsonl (the engine's JSON with engine, kv
# and prompt length added); a table of medians follows. Needs the CUDA
# bundle in .gpu/, the mlx-cuda-pack archive in .mlx-cuda/ and the mlx /
# mlx-lm wheels in .whl/.
#
#   [GEN=64] [PAIRS=2] [VS="16384"] [KVS="none 8 4 w4096"] bash xtask/gpu/run.sh kvq SHAPE "LENS"
SHAPE=${1:-qwen3-0.6b}; LENS=${2:-"16384 65536"}; GEN=${GEN:-64}; PAIRS=${PAIRS:-2}; VS=${VS-16384}
KVS=${KVS:-"none 8 4 w4096"}
wheels
models "$SHAPE"
m=/tmp/models/$SHAPE-real
J=$O/kvq-$SHAPE.jsonl; : > "$J"
tag() {
  python3 -c "
import json, sys
text = sys.stdin.read().strip().splitlines() or ['(no output)']
try:
    v = json.loads(text[-1]); v.update(engine='$1', kv='$2', prompt_len=$3); print(json.dumps(v))
except ValueError:
    print('FAILED $1 kv=$2 prompt $3:', *text[-3:], sep='\\n  ', file=sys.stderr)"
}
for p in $LENS; do
  for kv in $KVS; do
    ours=()
    case $kv in none) ;; w*) ours=(--max-kv-size "${kv#w}") ;; *) ours=(--kv-bits "$kv") ;; esac
    theirs=("${ours[@]}")
    for _ in $(seq "$PAIRS"); do
      timeout 200 $M bench --model "$m" --prompt-len "$p" --gen "$GEN" --repeats 1 "${ours[@]}" --format json 2>&1 | tag mlex "$kv" "$p" >> "$J"
      if [[ " $VS " == *" $p "* ]]; then
        timeout 300 python3 $B/mlxlm_bench.py "$m" --prompt-len "$p" --gen "$GEN" --device gpu "${theirs[@]}" 2>&1 | tag mlx-lm "$kv" "$p" >> "$J"
      fi
    done
  done
done
medians "$J" "prompt_len kv engine" "prompt | kv | engine | peak MB | prefill tok/s | decode tok/s | runs" <<'PY'
for (p, kv, e), vs in sorted(rows.items()):
    print(f"| {p} | {kv} | {e} | {med(vs, 'peak_memory_bytes') / 1e6:,.0f} | {med(vs, 'prefill_tok_s'):,.0f} | "
          f"{med(vs, 'decode_tok_s'):,.1f} | "
          f"{len(vs)} (decode {min(x['decode_tok_s'] for x in vs):.0f}-{max(x['decode_tok_s'] for x in vs):.0f}) |")
PY
