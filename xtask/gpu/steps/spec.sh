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
# MODE `forced` (the default) passes --force-acceptance: each round keeps
# exactly the drafts before the first spoiled one, so that bf16 near ties
# on random weights do not move the acceptance. MODE `script`: the target
# judges, and the drafter continues its script with a second copy of the
# model when bf16 rounding takes the output off it (that copy's time is
# not counted; its weights are in the speculative peak memory). PARTS:
# `all`, or `acceptance` to skip the verify cost. The (A, K) cells run in
# order of the goals: a = 0.8 and 1.0 at k = 3 first; SPEC_CELLS="A:K ..."
# runs those instead, SPEC_SHAPES="..." those shapes (qwen3_5 qwen3-0.6b).
#
#   bash xtask/gpu/run.sh spec [PAIRS] [GEN] [DEADLINE_S] [PARTS] [MODE]
PAIRS=${1:-3}; GEN=${2:-128}; DEADLINE=${3:-480}; PARTS=${4:-all}; MODE=${5:-forced}
FORCE=; [ "$MODE" = forced ] && FORCE=--force-acceptance
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
# The A/B of the cuDNN plan cache (MLEX_OPS_ATTENTION_ROWS=0: MLX's fused
# attention for every verify), on one cell.
late || [ "$PARTS" = acceptance ] || MLEX_OPS_ATTENTION_ROWS=0 timeout 120 $M bench --model /tmp/models/qwen3-0.6b-real --prompt-len 128 \
  --gen "$GEN" --repeats "$PAIRS" --draft-acceptance 0.8 --draft-tokens 3 $FORCE --format json | tail -1 |
  sed 's/^{/{"ops_attention_rows_env":"0",/' | tee -a "$J"
CELLS=${SPEC_CELLS:-"0.8:3 1.0:3 0.6:3 0.9:3 1.0:1 1.0:2 1.0:4 1.0:6 0.8:1 0.8:2 0.8:4 0.8:6 0.6:1 0.6:2 0.6:4 0.6:6"}
for s in ${SPEC_SHAPES:-qwen3_5 qwen3-0.6b}; do
  for cell in $CELLS; do
    a=${cell%:*}; k=${cell#*:}
    late && break 2
    timeout 120 $M bench --model /tmp/models/$s-real --prompt-len 128 --gen "$GEN" --repeats "$PAIRS" \
      --draft-acceptance $a --draft-tokens $k $FORCE --format json | tail -1 | tee -a "$J"
  done
done
echo "spec: $(wc -l < "$J") results in $(( $(date +%s) - start )) s"
