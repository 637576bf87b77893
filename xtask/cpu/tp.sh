#!/usr/bin/env bash
# Two ranks against one on the CPU (docs/BENCHMARKS.md, "Tensor
# parallelism on the CPU"): `mlex bench --tp 1` and `--tp 2` alternate
# ROUNDS times on the bench models at --scale SCALE (bf16); one JSON line a
# run with prefill and decode tok/s, rank 0's MLX peak, its weights and its
# peak resident set and the bytes it read from files.
#   bash xtask/cpu/tp.sh OUT_DIR [ROUNDS] [PROMPT] [GEN] [SCALE] [SHAPES]
# (SCALE: a make_bench_models.py scale, default small; SHAPES: comma-separated,
# default all three).
# Needs an mlex binary (MLEX=..., default target/release/mlex) and the
# reference venv (`cargo xtask test` makes it).
set -euo pipefail
out=$1; rounds=${2:-3}; prompt=${3:-512}; gen=${4:-64}; scale=${5:-small}
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$(ls -d ~/.cache/mlex/pyenv-*/bin/python | head -1)}
mlex=${MLEX:-$root/target/release/mlex}
IFS=, read -r -a shapes <<< "${6:-qwen3-0.6b,qwen3_5,nemotron_h}"
mkdir -p "$out"
"$py" "$root/xtask/py/make_bench_models.py" "$out/models" --scale "$scale" \
  --shapes "$(IFS=,; echo "${shapes[*]}")" >&2
: > "$out/tp.jsonl"
for s in "${shapes[@]}"; do
  for r in $(seq "$rounds"); do
    for tp in 1 2; do
      j=$("$mlex" bench --model "$out/models/$s-$scale" --prompt-len "$prompt" --gen "$gen" \
        --format json --tp "$tp" 2>/dev/null | tail -1)
      python3 -c 'import json,sys; d=json.loads(sys.argv[4]); print(json.dumps({"shape":sys.argv[1],"round":int(sys.argv[2]),"tp":int(sys.argv[3]),"prefill_tok_s":d["prefill_tok_s"],"decode_tok_s":d["decode_tok_s"],"mlx_peak_bytes":d["peak_memory_bytes"],"weight_bytes":d["weight_bytes"],"rss_peak_bytes":d["memory"]["rss_peak_bytes"],"load_read_bytes":d.get("load_read_bytes"),"collective":d.get("collective")}))' \
        "$s" "$r" "$tp" "$j" | tee -a "$out/tp.jsonl"
    done
  done
done
