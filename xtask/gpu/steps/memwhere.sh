# where a long prompt's peak falls, mlex against mlx-lm: the prefill's peak, the run's, one layer's transient
#
# One device call: on the real-shape bf16 checkpoints of SHAPES (default
# qwen3-0.6b,qwen3_5), prompt P (default 4096), 16 tokens, at each prefill
# step of STEPS (default "2048 4096"): mlx-lm's peak after the prompt and
# after the run (xtask/py/mlxlm_memwhere.py, which also evaluates the
# dense model layer by layer for one layer's transient), then `mlex bench`'s
# `prefill_peak_memory_bytes`, `peak_memory_bytes` and `memory` object, the
# same with MLEX_FUSE_PROJECTIONS=0, and, where the binary has the
# layer-by-layer hook of a diagnostic build (MLEXDIAG_LAYERS), its per-layer
# lines. Lines of $OUT/memwhere.jsonl; the per-layer lines in
# $OUT/memwhere-layers.txt. Needs the CUDA bundle's files in .gpu/, the
# mlx-cuda-pack archive in .mlx-cuda/ and the mlx / mlx-lm wheels in .whl/.
#
#   [SHAPES=...] [STEPS="2048 4096"] bash xtask/gpu/run.sh memwhere [P]
P=${1:-4096}
SHAPES=${SHAPES:-qwen3-0.6b,qwen3_5}
wheels
models "$SHAPES"
J=$O/memwhere.jsonl; : > "$J"
L=$O/memwhere-layers.txt; : > "$L"
steps=${STEPS:-2048 4096}
for s in ${SHAPES//,/ }; do
  d=/tmp/models/$s-real
  timeout 300 python3 xtask/py/mlxlm_memwhere.py "$d" --prompt-len "$P" --gen 16 --steps "${steps// /,}" |
    sed "s/^{/{\"shape\":\"$s\",/" | tee -a "$J"
  for c in $steps; do
    for fuse in 1 0; do
      MLEX_FUSE_PROJECTIONS=$fuse timeout 120 $M bench --model "$d" --prompt-len "$P" --gen 16 --repeats 1 \
        --prefill-chunk "$c" --format json | tail -1 |
        sed "s/^{/{\"shape\":\"$s\",\"engine\":\"mlex\",\"prefill_chunk\":$c,\"fuse_projections\":$fuse,/" | tee -a "$J"
    done
    echo "== $s step $c" >> "$L"
    MLEXDIAG_LAYERS=1 timeout 120 $M bench --model "$d" --prompt-len "$P" --gen 4 --repeats 1 \
      --prefill-chunk "$c" 2>&1 | grep '^diag' | tail -60 >> "$L"
  done
done
echo "memwhere: $(wc -l < "$J") results, $(grep -c '^diag' "$L") layer lines"
