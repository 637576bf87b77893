# few-row matmul of batched decode: tests, sweep, bench with it on / off
#
# One device call for the few-row matmul of batched decode: the CUDA kernel
# tests, the kernel against MLX's matmul by row count (skinny_sweep), the
# batched-engine tests on CUDA (f32 fixtures exact, bf16/4-bit near-ties),
# and `mlex bench --batch B` with the kernel on and off (MLEX_SKINNY_ROWS=0).
# Files from the CUDA bundle, the test binaries (test-*, batch-test), the
# example skinny_sweep and fixtures/ in .gpu/; writes under $OUT.
#
#   bash xtask/gpu/run.sh skinny
wheels
kernel_tests "^test |result|panicked|diff"
echo "== few-row matmul against MLX's matmul (bf16, H200)"
timeout 120 $B/skinny_sweep
echo "== batched engine tests on CUDA"
MLEX_FIXTURES=$PWD/$B/fixtures timeout 240 $B/batch-test --test-threads 1 --nocapture 2>&1 | grep -E "^test |result|panicked|identical|diverges|left|right" | head -40
models qwen3_5,qwen3-0.6b
echo "== mlex bench --batch B (128 + 128 tokens), few-row kernel on / off, alternating"
for s in qwen3-0.6b qwen3_5; do for b in 1 8 32 64; do for rows in on 0; do
  printf "%-11s b%-3s skinny %-3s " $s $b $rows
  if [ $rows = on ]; then env=""; else env="MLEX_SKINNY_ROWS=0"; fi
  env $env timeout 60 $M bench --model /tmp/models/$s-real --batch $b --prompt-len 128 --gen 128 --format json | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"agg {d['agg_tok_s']:8.0f}  prefill {d['prefill_tok_s']:8.0f}  decode {d['decode_tok_s']:8.0f}  peak {d['peak_memory_bytes']/1e9:.2f} GB\")"
done; done; done
