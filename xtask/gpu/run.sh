#!/bin/bash
# The one-off GPU measurements, one step a device call, with the prelude they
# share. Run from the repository root of the device machine with the CUDA
# bundle's files (`cargo xtask cuda-bundle`, plus what a step's header names)
# in .gpu/ and the mlx-cuda-pack archive in .mlx-cuda/; a step that runs
# python with mlx / mlx-lm also needs the wheels in .whl/. A step's output
# goes to $OUT/STEP.log (OUT: default /tmp/out), its other files under $OUT.
#
#   bash xtask/gpu/run.sh STEP [ARGS...]      (no STEP: the steps, one line each)
#
# A step is xtask/gpu/steps/STEP.sh, sourced after the prelude with ARGS as
# its arguments: its first line says what it does, its header below that
# what it needs, what it takes and which environment knobs it reads.
set -u
STEP_DIR=$(dirname "${BASH_SOURCE[0]}")/steps
STEP=${1:-}
if [[ ! $STEP =~ ^[a-z0-9-]+$ ]] || [ ! -f "$STEP_DIR/$STEP.sh" ]; then
  [ -n "$STEP" ] && echo "run.sh: no step '$STEP'" >&2
  echo "usage: bash xtask/gpu/run.sh STEP [ARGS...]  (ARGS: the header of xtask/gpu/steps/STEP.sh)"
  for f in "$STEP_DIR"/*.sh; do
    printf '  %-12s %s\n' "$(basename "$f" .sh)" "$(sed -n '1s/^# *//p' "$f")"
  done
  exit 2
fi
shift

# Every step: the mlex binary of the bundle (M), its CUDA runtime, the log.
B=.gpu; M=$B/mlex
O=${OUT:-/tmp/out}; mkdir -p "$O"
exec > >(tee "$O/$STEP.log") 2>&1
eval "$(sh $B/mlex-cuda-env.sh .mlx-cuda/mlx-cuda-sm90.tar /tmp/mlex-cuda)"

# The carried wheels (.whl/: mlx, mlx-lm, ...) into /tmp/site, on PYTHONPATH;
# ARGS go to pip (--upgrade: over what an earlier call left there). Of the
# wheels built for one CPython (mlx for cp310..cp313), those of this python.
wheels() {
  local cp; cp=$(python3 -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  local w; w=$(ls .whl/*.whl | grep -E -- "-py3-none-|-$cp-")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@" --target /tmp/site $w &&
    export PYTHONPATH=/tmp/site
}

# The real-shape random-weight checkpoints /tmp/models/SHAPE-real of the
# comma-separated SHAPES (make_bench_models.py keeps those up to date): its
# last line only.
models() { python3 $B/make_bench_models.py /tmp/models --scale real --shapes "$1" 2>&1 | tail -1; }

# mlex against mlx-lm on those checkpoints, alternating (bench_vs_mlxlm.py;
# ARGS: its --shapes, --pairs, --out, ...).
vs_mlxlm() { python3 $B/bench_vs_mlxlm.py --mlex $M --models /tmp/models --device gpu --scale real "$@"; }

# A markdown table of the JSON lines of FILE, a row a group of them with the
# same values of the space-separated fields KEYS: the header of the
# |-separated COLUMNS, then what the python on stdin prints, with rows (the
# groups: {(key values): [run, ...]}) and med(vs, FIELD) (the median of a
# field over the runs vs) at hand.
medians() {
  python3 -c '
import json, sys, statistics as st
rows = {}
for l in open(sys.argv[1]):
    v = json.loads(l)
    rows.setdefault(tuple(v[k] for k in sys.argv[2].split()), []).append(v)
print(f"| {sys.argv[3]} |")
print("|" + "---|" * len(sys.argv[3].split("|")))
def med(vs, k):
    return st.median(x[k] for x in vs)
'"$(cat)" "$@"
}

# The custom kernels' tests (.gpu/test-*) on CUDA, ignored ones included:
# their lines that match the grep -E PATTERN.
kernel_tests() {
  echo "== kernel tests on CUDA"
  for t in $B/test-*; do timeout 120 $t --include-ignored --test-threads 1 2>&1 | grep -E "$1"; done
}

# Where CUPTI (hdr: cupti.h, lib: libcupti.so) and CUDA's cuda.h (cuda_h) are.
cupti() {
  hdr=$(dirname "$(find /usr/local/cuda*/ /opt /usr/lib/python3* -name cupti.h 2>/dev/null | head -1)")
  lib=$(dirname "$(find /usr/local/cuda*/ /opt /usr/lib/python3* -name 'libcupti.so*' 2>/dev/null | head -1)")
  cuda_h=$(dirname "$(find /usr/local/cuda*/ /opt -name cuda.h 2>/dev/null | head -1)")
}

# /tmp/libkcount.so from kcount.c, after cupti; ARGS go to cc.
kcount_so() {
  cc -shared -fPIC -O2 "$@" -I"$hdr" -I"$cuda_h" xtask/gpu/kcount.c -L"$lib" -lcupti -Wl,-rpath,"$lib" -o /tmp/libkcount.so
}

# `mlex bench --model ARGS... --prompt-len 16` under libkcount.so: all its
# output (kbench), or the number of kernels it ran (count).
kbench() { LD_PRELOAD=/tmp/libkcount.so timeout 120 $M bench --model "$@" --prompt-len 16 2>&1; }
count() { kbench "$@" | grep -o 'kcount: [0-9]*' | tail -1 | grep -o '[0-9]*'; }

# shellcheck source=/dev/null
. "$STEP_DIR/$STEP.sh" "$@"
