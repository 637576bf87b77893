# continuous batching: exactness, gain, against mlx-lm's BatchGenerator
#
# One device call for continuous batching: batched greedy output against one
# sequence at a time on the real-shape bf16 checkpoints (the fused CUDA decode
# kernels and the masked SDPA at batch > 1), the gain of batching over one at
# a time, then `mlex bench --batch B` against mlx-lm's BatchGenerator,
# alternating (bench_vs_mlxlm.py --batches). Run from the repository root
# with the CUDA bundle's files in .gpu/, the mlx-cuda-pack archive in
# .mlx-cuda/ and the mlx / mlx-lm wheels in .whl/; writes under $OUT.
#
#   bash xtask/gpu/run.sh batch SHAPES BATCHES PAIRS DEADLINE_S [check]
SHAPES=${1:-qwen3_5,qwen3-0.6b}; BATCHES=${2:-8,32,64}; PAIRS=${3:-3}; DEADLINE=${4:-400}; CHECK=${5:-}
wheels
$M env | head -3
models "$SHAPES"
if [ -n "$CHECK" ]; then
  for s in ${SHAPES//,/ }; do
    m=/tmp/models/$s-real
    python3 - "$m" > /tmp/prompts.txt <<'PY'
import random, sys, json
r = random.Random(7)
cfg = json.load(open(sys.argv[1] + "/config.json"))
vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
for n in [5, 130, 17, 64, 250, 1, 33, 90, 12, 200, 48, 7]:
    print(",".join(str(r.randrange(vocab)) for _ in range(n)))
PY
    $M generate --model $m --ids --prompts-file /tmp/prompts.txt --batch 4 --max-tokens 48 --format json > /tmp/batched.jsonl
    : > /tmp/single.jsonl
    while read -r ids; do $M generate --model $m --prompt-ids "$ids" --max-tokens 48 --format json | tail -1 >> /tmp/single.jsonl; done < /tmp/prompts.txt
    python3 - $s <<'PY'
import json, sys
b = {d["index"]: d for d in map(json.loads, open("/tmp/batched.jsonl"))}
s = [json.loads(l) for l in open("/tmp/single.jsonl")]
same = sum(b[i]["token_ids"] == x["token_ids"] for i, x in enumerate(s))
div = [next((k for k, (p, q) in enumerate(zip(b[i]["token_ids"], x["token_ids"])) if p != q), None)
       for i, x in enumerate(s) if b[i]["token_ids"] != x["token_ids"]]
print(f"== {sys.argv[1]} bf16 on CUDA: batched (4 slots, 12 prompts of 1-250 tokens, 48 tokens) vs one at a time: {same}/{len(s)} identical; first differing token of the others: {div}")
PY
  done
fi
echo "== one sequence (prompt 128, 128 tokens), for the gain of batching"
for s in ${SHAPES//,/ }; do printf "%-12s " $s; $M bench --model /tmp/models/$s-real --prompt-len 128 --gen 128 --format json | tail -1; done
# Untimed: each engine once per shape and batch size before the pairs, so
# that neither pays alone for the cold page cache of the checkpoint or for
# compiling kernels the other has already compiled (the first mlex run of a
# fresh machine was the slowest of its pairs before this).
echo "== warm-up, both engines (untimed)"
for s in ${SHAPES//,/ }; do for b in ${BATCHES//,/ }; do
  $M bench --model /tmp/models/$s-real --batch $b --prompt-len 128 --gen 16 --format json > /dev/null
  python3 $B/mlxlm_batch_bench.py /tmp/models/$s-real --batch $b --prompt-len 128 --gen 16 --device gpu > /dev/null
done; done
vs_mlxlm --shapes "$SHAPES" --quants bf16 --batches "$BATCHES" --prompt-lens 128 --gen 128 --pairs "$PAIRS" \
  --timeout 150 --deadline "$DEADLINE" --out "$O/batch-vs-mlxlm" 2>&1 | tail -40
