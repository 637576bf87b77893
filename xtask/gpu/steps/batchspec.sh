# speculation in a batch, NCCL with one rank, and plain decode against the previous build
#
# One device call on the real-shape bf16 Qwen3.5-like checkpoint (prompt
# 128): plain decode of the new binary (.gpu/mlex) and of the previous
# build (.gpu/mlex-old, when present) alternating ROUNDS times (256
# tokens); the tensor-parallel code path on NCCL with a group of one rank
# (`--tp 1` under MLX_RANK) against plain decode, alternating, and its
# greedy tokens against one device's; single-sequence speculation at
# A = 0.8, K = 3, forced acceptance; then `mlex bench --batch B
# --draft-acceptance A --force-acceptance --draft-tokens 3 --repeats R`
# for each B of BATCHES (plain and speculative batches alternating in one
# process). No run starts after DEADLINE_S seconds. Needs the CUDA
# bundle's files in .gpu/, the mlx-cuda-pack archive in .mlx-cuda/ and the
# mlx wheel in .whl/; writes $OUT/batchspec.jsonl (field "run" on each line).
#
#   bash xtask/gpu/run.sh batchspec [ROUNDS] [BATCHES] [A] [DEADLINE_S] [R]
ROUNDS=${1:-2}; BATCHES=${2:-"1 4 8 16"}; ACC=${3:-0.8}; DEADLINE=${4:-300}; REPEATS=${5:-2}
$M env | head -3
wheels
models qwen3_5
start=$(date +%s)
J=$O/batchspec.jsonl; : > "$J"
late() { [ $(( $(date +%s) - start )) -gt "$DEADLINE" ]; }
H=/tmp/models/qwen3_5-real
tag() { sed "s/^{/{\"run\":\"$1\",/"; }
builds="new"; [ -x $B/mlex-old ] && builds="new old"
for r in $(seq "$ROUNDS"); do for b in $builds; do
  late && break 2
  bin=$M; [ "$b" = old ] && bin=$B/mlex-old
  timeout 90 $bin bench --model $H --prompt-len 128 --gen 256 --format json | tail -1 | tag "plain-$b" | tee -a "$J"
done; done
port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
# (a function: `timeout` runs it through env, not as a command of its own)
nccl1() { MLX_RANK=0 MLX_WORLD_SIZE=1 NCCL_HOST_IP=127.0.0.1 NCCL_PORT=$port NCCL_NVLS_ENABLE=0 timeout 90 "$@" --tp 1; }
for r in $(seq "$ROUNDS"); do
  late && break
  timeout 90 $M bench --model $H --prompt-len 128 --gen 256 --format json | tail -1 | tag "one-device" | tee -a "$J"
  nccl1 $M bench --model $H --prompt-len 128 --gen 256 --format json | tail -1 | tag "nccl-1-rank" | tee -a "$J"
done
ids=$(seq -s, 1 64)
for run in one nccl; do
  cmd="$M generate --model $H --prompt-ids $ids --max-tokens 64 --format json"
  if [ $run = nccl ]; then nccl1 $cmd; else $cmd; fi | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({'run': 'tokens-$run', 'token_ids': d['token_ids']}))" | tee -a "$J"
done
late || timeout 90 $M bench --model $H --prompt-len 128 --gen 128 --repeats 2 --draft-acceptance $ACC \
  --draft-tokens 3 --force-acceptance --format json | tail -1 | tag "spec-1" | tee -a "$J"
for bsz in $BATCHES; do
  late && break
  timeout 150 $M bench --model $H --prompt-len 128 --gen 128 --batch $bsz --repeats $REPEATS \
    --draft-acceptance $ACC --force-acceptance --draft-tokens 3 --format json | tail -1 | tag "batch-$bsz" | tee -a "$J"
done
echo "batchspec: $(wc -l < "$J") results in $(( $(date +%s) - start )) s"
