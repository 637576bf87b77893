# constrained decoding on CUDA: what a JSON-schema grammar costs a token, and the agent server
#
# One device call: the Qwen3-0.6B-like real-shape bf16 checkpoint with the
# real Qwen3 tokenizer (its vocabulary is Qwen3's, 151,936), `mlex bench
# --batch B` plain and under each schema, alternating, PAIRS rounds; then
# `mlex serve` on it answering xtask/py/openai_tools_check.py (forced tool
# calls, a JSON-schema answer, logprobs) through the CUDA sampler. Needs the
# CUDA bundle in .gpu/ (with qwen3-tokenizer/ holding tokenizer.json.xz and
# tokenizer_config.json), the mlx-cuda-pack archive in .mlx-cuda/, the mlx
# and mlx-lm wheels in .whl/.
#
# REPEATS (default 1) is `mlex bench --repeats`: the best of that many timed
# runs after the warm-up, so that segments traced for the smaller buckets a
# batch shrinks to (rows that end early) are not timed.
#
#   bash xtask/gpu/run.sh grammar PAIRS BATCHES [REPEATS]
PAIRS=${1:-3}; BATCHES=${2:-1,8}; REPEATS=${3:-1}
wheels
$M env | head -3
models qwen3-0.6b
m=/tmp/models/qwen3-0.6b-real
xz -dc $B/qwen3-tokenizer/tokenizer.json.xz > $m/tokenizer.json
cp $B/qwen3-tokenizer/tokenizer_config.json $m/
S=docs/data/prompts
for r in $(seq "$PAIRS"); do
  for b in ${BATCHES//,/ }; do
    for s in plain schema-array-100 schema-object; do
      extra=(); [ $s != plain ] && extra=(--json-schema $S/$s.json)
      timeout 120 $M bench --model $m --batch $b --prompt-len 128 --gen 128 --repeats "$REPEATS" "${extra[@]}" --format json 2>/dev/null |
        python3 -c "import json,sys; v=json.load(sys.stdin); v.update(round=$r, schema='$s'); print(json.dumps(v))" >> "$O/grammar.jsonl"
    done
  done
done
python3 - "$O/grammar.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for b in sorted({r["batch"] for r in rows}):
    plain = [r["decode_tok_s"] for r in rows if r["batch"] == b and r["schema"] == "plain"]
    for s in ("plain", "schema-array-100", "schema-object"):
        xs = [r for r in rows if r["batch"] == b and r["schema"] == s]
        t = [r["decode_tok_s"] for r in xs]
        ms = [r["grammar"]["mask_ms_per_token"] for r in xs if r.get("grammar")]
        print(f"== batch {b} {s:17s} decode {statistics.median(t):8.1f} tok/s ({min(t):.1f}-{max(t):.1f}), "
              f"{statistics.median(t) / statistics.median(plain):.2f}x plain, "
              f"mask {statistics.median(ms) if ms else 0:.3f} ms/token, peak {max(r['peak_memory_bytes'] for r in xs) / 1e9:.2f} GB, "
              f"{xs[0]['generated_tokens']} tokens")
PY
echo "== agent server on CUDA"
$M serve --model $m --port 18937 > "$O/serve.log" 2>&1 &
pid=$!
for _ in $(seq 120); do grep -q "http://" "$O/serve.log" && break; sleep 1; done
timeout 240 python3 xtask/py/openai_tools_check.py --base-url http://127.0.0.1:18937/v1 --model qwen3-0.6b-real
kill $pid; wait $pid 2>/dev/null
