#!/bin/bash
# Same run, same GPU: mlex bench and mlx-lm (python mlx 0.32.2 on the same CUDA libmlx) on real-shape models.
set -u
cd "$(dirname "$0")"
eval "$(sh ./mlex-cuda-env.sh ../.mlx-cuda/mlx-cuda-sm90.tar /tmp/mlex-cuda)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site whl/*.whl && export PYTHONPATH=/tmp/site
python3 -c "import mlx.core as mx; print('python mlx', mx.__version__, mx.default_device())"
python3 make_models.py /tmp/models 2>&1 | tail -2
{
for spec in "qwen3_5-real:" "qwen3_5-real:4" "qwen3-real:" "qwen3-real:4"; do
  m=${spec%%:*}; q=${spec##*:}
  echo "== $m q=${q:-bf16}"
  if [ -n "$q" ]; then Q="--quantize $q"; else Q=""; fi
  timeout 160 ./mlex bench --model /tmp/models/$m --prompt-len 128 --gen 256 --repeats 2 --format json $Q | tail -1
  timeout 200 python3 mlxlm_bench.py /tmp/models/$m --prompt-len 128 --gen 256 --repeats 2 --device gpu $Q 2>&1 | tail -1
done
} 2>&1 | tee "$OUT/gpu-compare.log"
