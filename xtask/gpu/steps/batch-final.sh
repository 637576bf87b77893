# batched f32 exactness with fused decode off, then the batch step
#
# The batched engine's f32 exactness on CUDA with the fused recurrent decode
# kernels off (to tell them apart from the rest of the path), then
# the batch step's alternating sweep against mlx-lm's BatchGenerator.
#   bash xtask/gpu/run.sh batch-final PAIRS DEADLINE_S
echo "== batched f32 exactness on CUDA, MLEX_FUSED_DECODE=0" | tee "$O/exact.log"
MLEX_FUSED_DECODE=0 MLEX_FIXTURES=$PWD/$B/fixtures timeout 120 $B/batch-test batched_greedy --test-threads 1 2>&1 | grep -E "^test |result|panicked|left|right" | head -12 | tee -a "$O/exact.log"
bash xtask/gpu/run.sh batch qwen3-0.6b,qwen3_5 8,32,64 "${1:-3}" "${2:-400}"
