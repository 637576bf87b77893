# the GGUF reader on CUDA: greedy ids and parity of the GGUF fixtures
#
# One device call: the GGUF reader on CUDA. Greedy ids of each GGUF fixture
# (to compare with the CPU's) and the parity test on those fixtures, with MLX's
# defaults and with TF32 off. Needs mlex and mlex-cuda-env.sh of the CUDA
# bundle, the parity test binary and a fixture subset (model.gguf +
# reference.safetensors + manifest.json) in .gpu/, the mlx-cuda-pack archive in
# .mlx-cuda/; writes under $OUT.
#
#   bash xtask/gpu/run.sh gguf
$M env
echo "== greedy ids on the GPU"
for f in $(ls $B/fixtures | grep gguf); do
  printf "%-24s " $f
  timeout 60 $M generate --model $B/fixtures/$f/model.gguf --prompt-ids 1,2,3,4 --max-tokens 8 --temp 0 --format json | tail -1 | python3 -c "import json,sys; print(json.load(sys.stdin)['token_ids'])"
done
echo "== parity, MLX defaults"
MLEX_FIXTURES=$B/fixtures timeout 300 $B/parity --nocapture 2>&1 | grep -E "gguf|result|fixtures failed"
echo "== parity, MLX_ENABLE_TF32=0"
MLX_ENABLE_TF32=0 MLEX_FIXTURES=$B/fixtures timeout 300 $B/parity --nocapture 2>&1 | grep -E "gguf|result|fixtures failed"
