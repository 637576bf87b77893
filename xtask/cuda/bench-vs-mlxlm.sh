#!/bin/bash
# mlex against mlx-lm on one GPU, on the same CUDA libmlx.so, real-shape
# random-weight checkpoints (the GPU side of `cargo xtask bench-vs-mlxlm`).
# Runs from the folder of `cargo xtask cuda-bundle`, which holds this script,
# the release `mlex`, mlex-cuda-env.sh, bench_vs_mlxlm.py, mlxlm_bench.py and
# make_bench_models.py. Needs only python3 (no cargo).
#
#   bash bench-vs-mlxlm.sh CUDA_RUNTIME WHEEL_DIR [bench_vs_mlxlm.py args...]
#
# CUDA_RUNTIME  what mlex-cuda-env.sh takes: a CUDA MLX runtime folder, or the
#               mlx-cuda-sm90.tar archive of mlx-cuda-pack (unpacked to /tmp/mlex-cuda)
# WHEEL_DIR     wheels installed with pip --no-index --no-deps into /tmp/site:
#               mlx (CUDA, the same version as the runtime), mlx-lm 0.32.2, and any
#               of their dependencies the system python lacks
# args          passed to bench_vs_mlxlm.py after --device gpu --scale real, e.g.
#               --shapes qwen3_5 --quants bf16 --prompt-lens 128 --pairs 3 --deadline 500
#
# Checkpoints go to $MODELS (default /tmp/models; made once, kept when up to
# date); results to $OUT/bench-vs-mlxlm.{json,md,log} when OUT is set, else
# next to this script.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUNTIME=${1:?usage: bench-vs-mlxlm.sh CUDA_RUNTIME WHEEL_DIR [args...]}
WHEELS=${2:?usage: bench-vs-mlxlm.sh CUDA_RUNTIME WHEEL_DIR [args...]}
shift 2
MODELS=${MODELS:-/tmp/models}
DEST=${OUT:-$HERE}
mkdir -p "$DEST"

eval "$(sh "$HERE/mlex-cuda-env.sh" "$RUNTIME" /tmp/mlex-cuda)"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

# The checkpoints the sweep needs, from --shapes/--scale in the passed-through
# arguments (the last one wins, as in the orchestrator).
SHAPES=""
SCALE=real
prev=""
for arg in "$@"; do
  case "$arg" in
    --shapes=*) SHAPES=${arg#--shapes=} ;;
    --scale=*) SCALE=${arg#--scale=} ;;
  esac
  if [ "$prev" = "--shapes" ]; then SHAPES=$arg; fi
  if [ "$prev" = "--scale" ]; then SCALE=$arg; fi
  prev=$arg
done

{
  python3 -c "import mlx.core as mx, mlx_lm; print('python mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device())"
  "$HERE/mlex" env
  python3 "$HERE/make_bench_models.py" "$MODELS" --scale "$SCALE" ${SHAPES:+--shapes "$SHAPES"}
  python3 "$HERE/bench_vs_mlxlm.py" --mlex "$HERE/mlex" --models "$MODELS" \
    --device gpu --scale real --out "$DEST/bench-vs-mlxlm" "$@"
} 2>&1 | tee "$DEST/bench-vs-mlxlm.log"
