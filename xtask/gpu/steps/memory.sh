# where prefill memory goes: peak and MLX's counters against the prefill step and the gated-delta chunk
#
# One device call: on the real-shape bf16 checkpoints of qwen3_5 and
# qwen3-0.6b, `mlex bench --prompt-len P --gen 16 --repeats 1` at each
# prefill step of STEPS (`--prefill-chunk`), and for qwen3_5 at the first
# step with the gated-delta chunk at each of GD_CHUNKS
# (MLEX_GATED_DELTA_CHUNK). Each line of $OUT/memory.jsonl is the bench
# JSON (peak, the `memory` object: MLX peak, active and cache bytes, RSS)
# with the settings added. Run from the repository root with the CUDA
# bundle's files in .gpu/, the mlx-cuda-pack archive in .mlx-cuda/ and the
# mlx wheel in .whl/ (for make_bench_models.py).
#
#   [STEPS="4096 2048 1024"] [GD_CHUNKS="64 256"] bash xtask/gpu/run.sh memory [P]
P=${1:-4096}
wheels
models qwen3_5,qwen3-0.6b
J=$O/memory.jsonl; : > "$J"
for s in qwen3_5 qwen3-0.6b; do
  for c in ${STEPS:-4096 2048 1024}; do
    timeout 120 $M bench --model /tmp/models/$s-real --prompt-len "$P" --gen 16 --repeats 1 --prefill-chunk "$c" \
      --format json | tail -1 | sed "s/^{/{\"prefill_chunk\":$c,/" | tee -a "$J"
  done
done
c=${STEPS%% *}; c=${c:-4096}
for g in ${GD_CHUNKS:-64 256}; do
  MLEX_GATED_DELTA_CHUNK=$g timeout 120 $M bench --model /tmp/models/qwen3_5-real --prompt-len "$P" --gen 16 --repeats 1 \
    --prefill-chunk "$c" --format json | tail -1 | sed "s/^{/{\"prefill_chunk\":$c,\"gated_delta_chunk\":$g,/" | tee -a "$J"
done
echo "memory: $(wc -l < "$J") results"
