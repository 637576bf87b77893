# expert products cut by experts (Dispatch::gather_pairs) against one call at real sizes; short prompts a layer at a time
#
# One device call. On the 4-bit real-size checkpoints of real_shapes.py's
# SHAPES (default the Qwen3-Next-80B-A3B-, Qwen3.5-35B-A3B- and
# Nemotron-3-Nano-30B-A3B-like ones; the last takes 6 experts a token, not
# cut, so it is the control): a warm-up run each (a fresh machine compiles
# its CUDA kernels there), then PAIRS alternating pairs of fresh
# `mlex bench` processes (prompt 128, GEN tokens) with MLEX_GATHER_PAIRS=0
# (one call a product) and =7 (the cut), at batch 1; then, on the bf16
# Qwen3-0.6B-like checkpoint at prompts 128 and 512 and the Qwen3-Next-like
# one at 128, MLEX_LAYER_SYNC_ROWS=$SYNC (default 64) against 1024, alternating; then the pairs
# at batch 2. Then
# bench_vs_mlxlm.py at prompt 128 on the shapes the cut changes, in what is
# left of TOTAL_S seconds. Writes $OUT/moecut.jsonl (bench JSON lines with
# "shape", "label" and "batch" added), a table of medians in the log, and
# $OUT/moecut-vs.{json,md}.
#
#   [SHAPES=a,b,...] [SYNC=64] bash xtask/gpu/run.sh moecut [PAIRS] [GEN] [TOTAL_S]
PAIRS=${1:-3}; GEN=${2:-128}; TOTAL=${3:-560}
SHAPES=${SHAPES:-qwen3_next-80b-a3b,qwen3_5_moe-35b-a3b,nemotron_h-30b-a3b}
SYNC=${SYNC:-64}
END=$(( $(date +%s) + TOTAL ))
wheels
python3 $B/make_bench_models.py /tmp/models --scale real --shapes "$SHAPES,qwen3-0.6b" 2>&1 | tail -1
J=$O/moecut.jsonl; : > "$J"
# One bench process: SHAPE LABEL BATCH PROMPT ENV... (ENV: VAR=VALUE words).
one() {
  local shape=$1 label=$2 batch=$3 prompt=$4; shift 4
  env "$@" timeout 150 $M bench --model /tmp/models/$shape-real --prompt-len "$prompt" --gen "$GEN" \
    --batch "$batch" --repeats 1 --format json 2>/dev/null | tail -1 |
    sed "s/^{/{\"shape\":\"$shape\",\"label\":\"$label\",\"batch\":$batch,/" >> "$J"
}
for s in ${SHAPES//,/ }; do
  t0=$(date +%s)
  timeout 200 $M bench --model /tmp/models/$s-real --prompt-len 16 --gen 4 --repeats 1 --format json > /dev/null 2>&1
  echo "warm-up $s: $(( $(date +%s) - t0 )) s"
done
# PAIRS alternating pairs at batch B of every shape.
pairs_at() {
  for s in ${SHAPES//,/ }; do
    for _ in $(seq "$PAIRS"); do
      one "$s" one-call "$1" 128 MLEX_GATHER_PAIRS=0
      one "$s" cut "$1" 128 MLEX_GATHER_PAIRS=7
    done
  done
}
pairs_at 1
for sp in qwen3-0.6b:128 qwen3-0.6b:512 qwen3_next-80b-a3b:128; do
  for _ in 1 2; do
    one "${sp%:*}" default 1 "${sp#*:}" MLEX_LAYER_SYNC_ROWS=1024
    one "${sp%:*}" "sync$SYNC" 1 "${sp#*:}" MLEX_LAYER_SYNC_ROWS="$SYNC"
  done
done
pairs_at 2
python3 - "$J" <<'PY'
import json, statistics as st, sys
rows = {}
for l in open(sys.argv[1]):
    if l.startswith("{"):
        r = json.loads(l)
        rows.setdefault((r["shape"], r["batch"], r["prompt_tokens"], r["label"]), []).append(r)
print("| shape | batch | prompt | label | runs | decode tok/s median (min-max) | prefill tok/s | peak MB |")
print("|---|---|---|---|---|---|---|---|")
for (s, b, p, lab), rs in sorted(rows.items()):
    d = [r["decode_tok_s"] for r in rs]
    print(f"| {s} | {b} | {p} | {lab} | {len(rs)} | {st.median(d):.0f} ({min(d):.0f}-{max(d):.0f}) | "
          f"{st.median(r['prefill_tok_s'] for r in rs):.0f} | {max(r['peak_memory_bytes'] for r in rs) / 1e6:,.1f} |")
PY
left=$(( END - $(date +%s) ))
echo "vs mlx-lm: $left s left"
cut=$(echo "$SHAPES" | tr , '\n' | grep -v nemotron | paste -sd,)
[ "$left" -gt 60 ] && vs_mlxlm --shapes "$cut" --prompt-lens 128 --gen "$GEN" --pairs 2 \
  --timeout 150 --deadline "$left" --out "$O/moecut-vs"
