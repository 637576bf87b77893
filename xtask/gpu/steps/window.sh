# a --max-kv-size window's prefill against the prefill step: peak memory and speed
#
# One device call on a real-shape bf16 checkpoint SHAPE (make_bench_models.py):
# `mlex bench --prompt-len P --gen 32 --max-kv-size W` at each --prefill-chunk
# of CHUNKS, PAIRS runs each, alternating. A step of C tokens over a window of
# W attends to W - 1 + C keys a row, of which W are visible (masked attention
# as ops, in row blocks), so smaller steps do less attention work and more
# steps. Every run is a line of $OUT/window-SHAPE.jsonl; a table of medians
# follows. Needs the CUDA bundle in .gpu/ and the mlx-cuda-pack archive in
# .mlx-cuda/ and the mlx wheels (make_bench_models.py) in .whl/.
#
#   [PAIRS=2] [W=4096] [P=16384] bash xtask/gpu/run.sh window SHAPE "CHUNKS"
SHAPE=${1:-qwen3-0.6b}; CHUNKS=${2:-"1024 2048 4096"}; PAIRS=${PAIRS:-2}; W=${W:-4096}; P=${P:-16384}
wheels
models "$SHAPE"
m=/tmp/models/$SHAPE-real
J=$O/window-$SHAPE.jsonl; : > "$J"
for _ in $(seq "$PAIRS"); do
  for c in $CHUNKS; do
    timeout 200 $M bench --model "$m" --prompt-len "$P" --gen 32 --repeats 1 --max-kv-size "$W" \
      --prefill-chunk "$c" --format json 2>&1 | tail -1 |
      python3 -c "import json,sys; v=json.loads(sys.stdin.read()); v['chunk']=$c; print(json.dumps(v))" >> "$J" ||
      echo "FAILED chunk $c"
  done
done
medians "$J" chunk "prefill step | peak MB | prefill tok/s | decode tok/s | runs" <<'PY'
for (c,), vs in sorted(rows.items()):
    print(f"| {c} | {med(vs, 'peak_memory_bytes') / 1e6:,.0f} | {med(vs, 'prefill_tok_s'):,.0f} "
          f"({min(x['prefill_tok_s'] for x in vs):,.0f}-{max(x['prefill_tok_s'] for x in vs):,.0f}) | "
          f"{med(vs, 'decode_tok_s'):,.1f} | {len(vs)} |")
PY
