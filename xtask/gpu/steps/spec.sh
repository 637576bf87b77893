# speculative decoding by mechanism: verify cost, and speed against acceptance
#
# One device call: on the real-shape bf16 checkpoints of qwen3-0.6b and
# qwen3_5 (and nemotron_h for the verify cost), `mlex bench --verify-cost`
# (one verify forward over T = 1..8 tokens against one decode step, prompt
# 128), then `mlex bench --draft-acceptance A --draft-tokens K` (plain and
# speculative decode alternating, PAIRS pairs, prompt 128, GEN tokens; the
# bench-only drafter proposes the model's own greedy continuation, each
# token spoiled with probability 1 - A). No run starts after DEADLINE_S
# seconds. Run from the repository root with the CUDA bundle's files in
# .gpu/, the mlx-cuda-pack archive in .mlx-cuda/ and the mlx wheel in .whl/
# (for make_bench_models.py); writes $OUT/spec.jsonl.
#
# The drafter continues its script with a second copy of the model when
# bf16 rounding takes the output off it; that copy's time is not counted
# and its weights are in the speculative peak memory. PARTS: `all`, or
# `acceptance` to skip the verify cost.
#
#   bash xtask/gpu/run.sh spec [PAIRS] [GEN] [DEADLINE_S] [PARTS]
PAIRS=${1:-3}; GEN=${2:-128}; DEADLINE=${3:-480}; PARTS=${4:-all}
$M env | head -3
wheels
models qwen3-0.6b,qwen3_5,nemotron_h
start=$(date +%s)
J=$O/spec.jsonl; : > "$J"
late() { [ $(( $(date +%s) - start )) -gt "$DEADLINE" ]; }
for s in qwen3-0.6b qwen3_5 nemotron_h; do
  late || [ "$PARTS" = acceptance ] && break
  timeout 120 $M bench --model /tmp/models/$s-real --prompt-len 128 --verify-cost --repeats 5 --format json | tail -1 | tee -a "$J"
done
for s in qwen3_5 qwen3-0.6b; do
  for a in 1.0 0.8 0.6 0.9; do
    for k in 1 2 3 4 6; do
      late && break 3
      [ "$a" = 0.9 ] && [ "$k" != 3 ] && continue
      timeout 120 $M bench --model /tmp/models/$s-real --prompt-len 128 --gen "$GEN" --repeats "$PAIRS" \
        --draft-acceptance $a --draft-tokens $k --format json | tail -1 | tee -a "$J"
    done
  done
done
echo "spec: $(wc -l < "$J") results in $(( $(date +%s) - start )) s"
