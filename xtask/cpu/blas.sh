#!/usr/bin/env bash
# CPU engines on the wheel's reference BLAS and on OpenBLAS, alternating, in
# one run (docs/BENCHMARKS.md, "CPU: the wheel's BLAS against OpenBLAS").
#   bash xtask/cpu/blas.sh OUT.jsonl PAIRS MODEL... 
# Each MODEL is DIR[:weights] (a checkpoint for both engines; `weights` is
# mlex's --weights). Needs `cargo xtask setup` (OpenBLAS in target/native/blas),
# target/release/mlex, and MLEX_REFERENCE_MLEX=a mlex binary built with
# MLEX_BLAS=reference (optional: that column is left out without it).
set -euo pipefail
out=$1; pairs=$2; shift 2
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$(ls -d ~/.cache/mlex/pyenv-*/bin/python | head -1)}
blas="$root/target/native/blas/libblas.so.3:$root/target/native/blas/liblapack.so.3"
P=${PROMPT_LEN:-128}; G=${GEN:-16}
: > "$out"
row() { # engine blas model weights json
  python3 -c 'import json,sys; d=json.loads(sys.argv[5]); print(json.dumps({"engine":sys.argv[1],"blas":sys.argv[2],"model":sys.argv[3],"weights":sys.argv[4],"prefill_tok_s":d["prefill_tok_s"],"decode_tok_s":d["decode_tok_s"],"peak_memory_bytes":d.get("peak_memory_bytes")}))' "$@" >> "$out"
}
for i in $(seq "$pairs"); do
  for spec in "$@"; do
    dir=${spec%%:*}; w=stored; [[ $spec == *:* ]] && w=${spec##*:}
    j=$("$root/target/release/mlex" bench --model "$dir" --weights "$w" --prompt-len "$P" --gen "$G" --format json 2>/dev/null | tail -1)
    row mlex openblas "$dir" "$w" "$j"
    if [[ -n ${MLEX_REFERENCE_MLEX:-} ]]; then
      j=$("$MLEX_REFERENCE_MLEX" bench --model "$dir" --prompt-len "$P" --gen "$G" --format json 2>/dev/null | tail -1)
      row mlex reference "$dir" stored "$j"
    fi
    if [[ -f $dir/config.json ]]; then
      j=$("$py" "$root/xtask/py/mlxlm_bench.py" "$dir" --prompt-len "$P" --gen "$G" | tail -1)
      row mlx-lm reference "$dir" stored "$j"
      j=$(LD_PRELOAD=$blas "$py" "$root/xtask/py/mlxlm_bench.py" "$dir" --prompt-len "$P" --gen "$G" | tail -1)
      row mlx-lm openblas "$dir" stored "$j"
    fi
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
g = collections.defaultdict(list)
for r in rows:
    g[(r["model"].rstrip("/").split("/")[-1], r["weights"], r["engine"], r["blas"])].append(r)
print("| model | --weights | engine | BLAS | prefill tok/s (median, min-max) | decode tok/s | peak MB |")
print("|---|---|---|---|---|---|---|")
for k, v in g.items():
    p = [r["prefill_tok_s"] for r in v]; d = [r["decode_tok_s"] for r in v]
    pk = max((r["peak_memory_bytes"] or 0) for r in v) / 1e6
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {statistics.median(p):.1f} ({min(p):.1f}-{max(p):.1f}) | {statistics.median(d):.1f} ({min(d):.1f}-{max(d):.1f}) | {pk:.0f} |")
PY
