# MTP speculative decoding on CUDA: exactness and the mechanism's speed at set acceptances
#
# One device call on the Qwen3.5-like real-shape bf16 checkpoint with a
# random multi-token-prediction head (make_bench_models.py's qwen3_5-mtp):
# greedy `mlex generate --mtp` against plain on a few prompts (bf16: a near
# tie may break apart; the first differing token is reported), then `mlex
# bench --draft-acceptance A --force-acceptance --draft-tokens K` with the
# head drafting (`--mtp`: its time counts) and with the scripted drafter
# (no drafting cost) at each A and K, PAIRS alternating plain/speculative
# runs inside each. Needs the CUDA bundle in .gpu/, the mlx-cuda-pack
# archive in .mlx-cuda/ and the mlx wheel in .whl/.
#
#   bash xtask/gpu/run.sh mtp PAIRS "A:K ..."
PAIRS=${1:-3}; CELLS=${2:-"0.8:3 1.0:3 0.8:2 0.6:2 1.0:5"}
wheels
$M env | head -3
models qwen3_5-mtp
m=/tmp/models/qwen3_5-mtp-real
for ids in 5,6,7,8,9,10,11,12 1,2,3,4,1,2,3,4,1,2,3 777,12,9000,151,33,8; do
  a=$($M generate --model $m --prompt-ids $ids --max-tokens 64 --format json | tail -1)
  b=$($M generate --model $m --prompt-ids $ids --max-tokens 64 --mtp --draft-tokens 3 --format json | tail -1)
  python3 - "$a" "$b" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1])["token_ids"], json.loads(sys.argv[2])
s = b["speculative"]
t = b["token_ids"]
first = next((i for i, (x, y) in enumerate(zip(a, t)) if x != y), None)
print(f"== greedy --mtp vs plain (bf16, 64 tokens): {'identical' if a == t else f'first differs at token {first}'}; "
      f"{s['rounds']} verify rounds, acceptance {s['acceptance']:.2f} (a random head)")
PY
done
J=$O/mtp.jsonl; : > "$J"
for c in $CELLS; do
  acc=${c%%:*}; k=${c##*:}
  for d in mtp scripted; do
    extra=(); [ $d = mtp ] && extra=(--mtp)
    timeout 150 $M bench --model $m --prompt-len 128 --gen 128 --repeats "$PAIRS" --draft-acceptance "$acc" \
      --force-acceptance --draft-tokens "$k" "${extra[@]}" --format json 2>/dev/null | tail -1 |
      python3 -c "import json,sys; v=json.load(sys.stdin); v['drafter_kind']='$d'; print(json.dumps(v))" >> "$J"
  done
done
python3 - "$J" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    v = json.loads(l)
    s, sp, pl = v["speculative"], v["speedup"], v["plain_decode_tok_s"]
    print(f"== {v['drafter_kind']:8s} A={v['draft_acceptance']} K={v['draft_tokens']}: speedup {sp['median']:.2f}x "
          f"({sp['min']:.2f}-{sp['max']:.2f}); plain {pl['median']:.0f} tok/s, speculative {v['speculative_decode_tok_s']['median']:.0f}; "
          f"draft {s['draft_s']:.3f} s, verify {s['verify_s']:.3f} s, commit {s['commit_s']:.3f} s in the last run; "
          f"peak {v['peak_memory_bytes'] / 1e9:.2f} GB (plain {v['plain_peak_memory_bytes'] / 1e9:.2f})")
PY
