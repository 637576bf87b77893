# the speculative verify path: its kernels' CUDA tests, then its cost against the previous build
#
# One device call: the custom kernels' tests on CUDA (.gpu/test-*), then on
# the real-shape bf16 checkpoints of qwen3-0.6b, qwen3_5 and nemotron_h,
# `mlex bench --verify-cost` (one verify forward over T = 1..8 tokens against
# one decode step, prompt 128) and `mlex bench --draft-acceptance A
# --draft-tokens K --force-acceptance` for the CELLS ("A:K ..."), then plain
# decode and `--lookup --draft-tokens 3` on qwen3_5 and qwen3-0.6b, each
# alternating the new binary (.gpu/mlex) with the previous build
# (.gpu/mlex-old, when present) in the same call, PAIRS rounds. No run
# starts after DEADLINE_S seconds. Needs the CUDA bundle's files in .gpu/,
# the mlx-cuda-pack archive in .mlx-cuda/ and the mlx wheel in .whl/;
# writes $OUT/verify.jsonl (a field "build": new or old on each line).
#
#   bash xtask/gpu/run.sh verify [PAIRS] [GEN] [DEADLINE_S] [CELLS]
PAIRS=${1:-3}; GEN=${2:-128}; DEADLINE=${3:-420}; CELLS=${4:-"0.8:3 1.0:3"}
$M env | head -3
kernel_tests "test |result|panicked|differs|error" | tee $O/kernel-tests.txt
# A kernel that fails its test makes the timings below meaningless.
grep -q "FAILED" $O/kernel-tests.txt && { echo "verify: a kernel test failed; no timings"; exit 1; }
wheels
models qwen3-0.6b,qwen3_5,nemotron_h
start=$(date +%s)
J=$O/verify.jsonl; : > "$J"
late() { [ $(( $(date +%s) - start )) -gt "$DEADLINE" ]; }
builds="new"; [ -x $B/mlex-old ] && builds="new old"
bin() { if [ "$1" = new ]; then echo $M; else echo $B/mlex-old; fi; }
tag() { sed "s/^{/{\"build\":\"$1\",/"; }
for s in qwen3-0.6b qwen3_5 nemotron_h; do
  for b in $builds; do
    late && break 2
    timeout 120 $(bin $b) bench --model /tmp/models/$s-real --prompt-len 128 --verify-cost --repeats 5 --format json | tail -1 | tag $b | tee -a "$J"
  done
done
for s in qwen3_5 qwen3-0.6b; do
  for cell in $CELLS; do
    a=${cell%:*}; k=${cell#*:}
    for r in $(seq "$PAIRS"); do
      for b in $builds; do
        late && break 4
        timeout 120 $(bin $b) bench --model /tmp/models/$s-real --prompt-len 128 --gen "$GEN" --repeats 1 \
          --draft-acceptance $a --draft-tokens $k --force-acceptance --format json | tail -1 | tag $b | tee -a "$J"
      done
    done
  done
done
# Prompt lookup on random weights (it stands down where the output does not
# repeat the prompt): plain decode and --lookup, each build, PAIRS rounds.
for s in qwen3_5 qwen3-0.6b; do
  for r in $(seq "$PAIRS"); do
    for b in $builds; do
      for x in "" "--lookup --draft-tokens 3"; do
        late && break 4
        timeout 120 $(bin $b) bench --model /tmp/models/$s-real --prompt-len 128 --gen "$GEN" --repeats 1 \
          $x --format json | tail -1 | tag $b | tee -a "$J"
      done
    done
  done
done
echo "verify: $(wc -l < "$J") results in $(( $(date +%s) - start )) s"
