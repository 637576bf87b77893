#!/usr/bin/env bash
# Host work per decode step without a GPU (docs/BENCHMARKS.md, "Host work
# per decode step"): the real models' depth at tiny widths
# (make_bench_models.py --scale host), so a step is almost all graph
# construction and evaluation. mlex and mlx-lm alternate ROUNDS times; then,
# where `perf` is installed, one mlex run per shape is sampled and the
# samples are split by shared object (how much is mlex's own code).
#   bash xtask/cpu/host.sh OUT_DIR [ROUNDS] [GEN]      (ROUNDS 0: the profile only)
# Needs target/release/mlex and the reference venv (`cargo xtask test` makes it).
set -euo pipefail
out=$1; rounds=${2:-3}; gen=${3:-256}
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$(ls -d ~/.cache/mlex/pyenv-*/bin/python | head -1)}
mlex=$root/target/release/mlex
shapes=(qwen3-0.6b qwen3_5 nemotron_h)
mkdir -p "$out"
"$py" "$root/xtask/py/make_bench_models.py" "$out/models" --scale host \
  --shapes "$(IFS=,; echo "${shapes[*]}")" >&2
# A profile-only call (ROUNDS 0) keeps the rounds measured before.
if (( rounds > 0 )); then : > "$out/rounds.jsonl"; fi
for r in $(seq "$rounds"); do
  for s in "${shapes[@]}"; do
    m=$out/models/$s-host
    a=$("$mlex" bench --model "$m" --gen "$gen" --format json 2>/dev/null | tail -1)
    b=$("$py" "$root/xtask/py/mlxlm_bench.py" "$m" --gen "$gen" | tail -1)
    python3 -c 'import json,sys; a,b=json.loads(sys.argv[3]),json.loads(sys.argv[4]); print(json.dumps({"round":int(sys.argv[1]),"shape":sys.argv[2],"mlex_decode":a["decode_tok_s"],"mlxlm_decode":b["decode_tok_s"],"ratio":a["decode_tok_s"]/b["decode_tok_s"]}))' \
      "$r" "$s" "$a" "$b" | tee -a "$out/rounds.jsonl"
  done
done
command -v perf >/dev/null || exit 0
lib=$(dirname "$(find "$root/target/release" -name libmlx.so | head -1)")
for s in "${shapes[@]}"; do
  LD_LIBRARY_PATH=$lib perf record -q -o "$out/perf-$s.data" \
    "$mlex" bench --model "$out/models/$s-host" --gen "$gen" >/dev/null 2>&1
  echo "== $s: samples by shared object"
  perf report -i "$out/perf-$s.data" --no-children --sort dso -g none \
    > "$out/perf-$s.txt" 2>/dev/null
  grep -E '^ +[0-9]' "$out/perf-$s.txt" | awk 'NR <= 6 || $2 == "mlex" {print "  " $1, $2}'
done | tee "$out/perf.txt"
