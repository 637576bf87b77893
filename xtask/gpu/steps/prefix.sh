# prefix reuse of a 16k prompt: cold against warm, in-process and across runs
#
# One device call for prefix reuse across runs (issue: token-exact prefix
# reuse): on the real-shape Qwen3.5-like bf16 checkpoint, a 16,384-token
# prompt B that shares its first 15,000 tokens with an earlier prompt A.
# A is run once with `--prompt-cache DIR` (saving its KV caches and its
# recurrent-state checkpoints every 1,024 tokens); then, alternating PAIRS
# times, B cold (no cache) and B warm (from a fresh copy of DIR, so every
# warm run sees A only). Reports time to first token (`ttft_s`, in-process,
# after loading), the process wall time (loading the cache file included),
# reused/computed tokens, and what the file holds: KV caches against
# checkpoints. Run from the repository root with the CUDA bundle's files
# in .gpu/, the mlx-cuda-pack archive in .mlx-cuda/ and the mlx wheel in
# .whl/; writes under $OUT.
#
# First the same pair inside one process (`mlex bench --shared-prefix`),
# where neither run pays for process start or kernel compilation.
#
#   [ONLY_BENCH=1] bash xtask/gpu/run.sh prefix [PAIRS]
PAIRS=${1:-3}
wheels --upgrade || exit 1
models qwen3_5
MODEL=/tmp/models/qwen3_5-real
python3 - $MODEL <<'PY'
import json, random, sys
cfg = json.load(open(sys.argv[1] + "/config.json"))
# Ids under 100,000 keep the 16k-id argument under Linux's 128 KB limit.
top = min(100000, cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
r = random.Random(11)
a = [r.randrange(1, top) for _ in range(16384)]
b = a[:15000] + [r.randrange(1, top) for _ in range(16384 - 15000)]
open("/tmp/a.ids", "w").write(",".join(map(str, a)))
open("/tmp/b.ids", "w").write(",".join(map(str, b)))
PY
run() { # LABEL ARGS... : one JSON line (with wall_s and the label) to $O/prefix.jsonl
  local label=$1; shift
  local t0=$(date +%s.%N)
  local out=$($M generate --model $MODEL --max-tokens 1 --format json "$@" | tail -1)
  local t1=$(date +%s.%N)
  python3 -c "import json,sys; d=json.loads(sys.argv[1]); d.pop('token_ids',None); d.pop('text',None); d['label']=sys.argv[2]; d['wall_s']=float(sys.argv[4])-float(sys.argv[3]); print(json.dumps(d))" \
    "$out" "$label" "$t0" "$t1" | tee -a "$O/prefix.jsonl"
}
echo "== in one process (mlex bench --shared-prefix): cold against warm, 3 pairs after a warm-up pair"
$M bench --model $MODEL --prompt-len 16384 --shared-prefix 15000 --repeats 3 --format json | tail -1 | tee "$O/prefix-bench.json"
[ -n "${ONLY_BENCH:-}" ] && exit 0
echo "== across runs (--prompt-cache DIR): warm-up, then A into the prompt cache"
run warmup --prompt-ids "$(cut -d, -f1-2000 /tmp/a.ids)" > /dev/null
run A --prompt-ids "$(cat /tmp/a.ids)" --prompt-cache /tmp/pc-a
ls -l /tmp/pc-a
python3 - /tmp/pc-a <<'PY'
import json, os, struct, sys, glob
f = glob.glob(sys.argv[1] + "/*.safetensors")[0]
with open(f, "rb") as h:
    n = struct.unpack("<Q", h.read(8))[0]
    hdr = json.loads(h.read(n))
snap = kv = 0
for k, v in hdr.items():
    if k == "__metadata__":
        continue
    size = v["data_offsets"][1] - v["data_offsets"][0]
    if k.split(".")[1].startswith("s"):
        snap += size
    else:
        kv += size
print(f"== prompt-cache file {os.path.getsize(f) / 1e6:.1f} MB: entry caches {kv / 1e6:.1f} MB, checkpoints {snap / 1e6:.1f} MB")
PY
for i in $(seq 1 $PAIRS); do
  run "B cold" --prompt-ids "$(cat /tmp/b.ids)"
  rm -rf /tmp/pc-w && cp -r /tmp/pc-a /tmp/pc-w
  run "B warm" --prompt-ids "$(cat /tmp/b.ids)" --prompt-cache /tmp/pc-w
done
python3 - "$O/prefix.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for label in ["B cold", "B warm"]:
    r = [x for x in rows if x["label"] == label]
    t = sorted(x["ttft_s"] for x in r); w = sorted(x["wall_s"] for x in r)
    print(f"== {label}: ttft median {statistics.median(t):.3f} s ({t[0]:.3f}-{t[-1]:.3f}), process wall median {statistics.median(w):.2f} s, "
          f"reused {r[0]['prompt_tokens_reused']}, computed {r[0]['prompt_tokens_computed']}, peak {max(x['peak_memory_bytes'] for x in r) / 1e9:.2f} GB")
PY
