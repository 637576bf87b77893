# speculation in a batch against plain batches, and plain decode against the previous build
#
# One device call on the real-shape bf16 Qwen3.5-like checkpoint (prompt
# 128): plain decode of the new binary (.gpu/mlex) and of the previous
# build (.gpu/mlex-old, when present) alternating ROUNDS times (256
# tokens); single-sequence speculation at A = 0.8 and 1.0, K = 3, forced
# acceptance; then `mlex bench --batch B --draft-acceptance A
# --force-acceptance --draft-tokens 3 --repeats 2` for each B of BATCHES
# (plain and speculative batches alternating in one process). No run
# starts after DEADLINE_S seconds. Needs the CUDA bundle's files in .gpu/,
# the mlx-cuda-pack archive in .mlx-cuda/ and the mlx wheel in .whl/;
# writes $OUT/batchspec.jsonl (field "build" on the plain runs).
#
#   bash xtask/gpu/run.sh batchspec [ROUNDS] [BATCHES] [A] [DEADLINE_S]
ROUNDS=${1:-3}; BATCHES=${2:-"1 4 8 16"}; ACC=${3:-0.8}; DEADLINE=${4:-300}
$M env | head -3
wheels
models qwen3_5
start=$(date +%s)
J=$O/batchspec.jsonl; : > "$J"
late() { [ $(( $(date +%s) - start )) -gt "$DEADLINE" ]; }
H=/tmp/models/qwen3_5-real
tag() { sed "s/^{/{\"build\":\"$1\",/"; }
builds="new"; [ -x $B/mlex-old ] && builds="new old"
for r in $(seq "$ROUNDS"); do for b in $builds; do
  late && break 2
  bin=$M; [ "$b" = old ] && bin=$B/mlex-old
  timeout 90 $bin bench --model $H --prompt-len 128 --gen 256 --format json | tail -1 | tag $b | tee -a "$J"
done; done
for a in $ACC 1.0; do
  late && break
  timeout 90 $M bench --model $H --prompt-len 128 --gen 128 --repeats 2 --draft-acceptance $a \
    --draft-tokens 3 --force-acceptance --format json | tail -1 | tee -a "$J"
done
for bsz in $BATCHES; do
  late && break
  timeout 150 $M bench --model $H --prompt-len 128 --gen 128 --batch $bsz --repeats 2 \
    --draft-acceptance $ACC --force-acceptance --draft-tokens 3 --format json | tail -1 | tee -a "$J"
done
echo "batchspec: $(wc -l < "$J") results in $(( $(date +%s) - start )) s"
