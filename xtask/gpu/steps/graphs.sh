# MLX's CUDA graphs: a decode token's kernels, rates by graph setting
#
# One device call on how MLX's CUDA backend batches kernels into CUDA graphs
# and what that costs a decode token: (1) the kernels one decode token runs,
# by name, with their GPU time (CUPTI, kcount.c with KCOUNT_NAMES=1; the
# difference of runs 64 steps apart); (2) decode and batch-8 rates under
# MLX's graph settings (MLX_MAX_OPS_PER_BUFFER, MLX_USE_CUDA_GRAPHS=0),
# alternating configurations round by round; (3) mlx-lm under the same
# settings. Run from the repository root with the CUDA bundle's files in
# .gpu/, the mlx-cuda-pack archive in .mlx-cuda/ and the mlx / mlx-lm wheels
# in .whl/.
#
#   [CONFIGS="default ops500 nographs"] bash xtask/gpu/run.sh graphs SHAPES ROUNDS END_S
SHAPES=${1:-qwen3-0.6b,qwen3_5}; ROUNDS=${2:-3}; END=${3:-520}
CONFIGS=${CONFIGS:-default ops50 ops500 ops1000 nographs}
wheels
$M env | head -3
models "$SHAPES"
cupti
for kr in CUpti_ActivityKernel4 CUpti_ActivityKernel9 CUpti_ActivityKernel10 CUpti_ActivityKernel11; do
  kcount_so -DKREC=$kr 2>/dev/null && { echo "kcount with $kr"; break; }
done
env_of() { case $1 in
  default) echo "MLEX_X=1";; nographs) echo "MLX_USE_CUDA_GRAPHS=0";;
  ops*) echo "MLX_MAX_OPS_PER_BUFFER=${1#ops}";; esac; }
names() { KCOUNT_NAMES=1 kbench "$@" | grep -E '^k(name|busy|count):'; }
# (--gen 4 and --gen 68 runs: warm-ups of min(gen, 8) tokens make them 68 decode steps apart)
echo "== kernels of one decode token by name (runs 68 decode steps apart), default settings"
for s in ${SHAPES//,/ }; do
  names /tmp/models/$s-real --gen 4 > /tmp/ka; names /tmp/models/$s-real --gen 68 > /tmp/kb
  python3 - "$s" /tmp/ka /tmp/kb <<'PY'
import sys
def read(p):
    d, busy, n = {}, 0, 0
    for line in open(p):
        k, rest = line.split(":", 1)
        if k == "kname":
            c, ns, name = rest.strip().split(" ", 2)
            d[name] = (int(c), int(ns))
        elif k == "kbusy":
            busy = int(rest)
        elif k == "kcount":
            n = int(rest.split()[0])
    return d, busy, n
a, ba, na = read(sys.argv[2]); b, bb, nb = read(sys.argv[3])
steps = 68
print(f"{sys.argv[1]}: {(nb - na) / steps:.1f} kernels and {(bb - ba) / steps / 1e3:.1f} us of GPU time per token")
rows = []
for name, (c, ns) in b.items():
    c0, ns0 = a.get(name, (0, 0))
    if c - c0 > 0:
        rows.append(((c - c0) / steps, (ns - ns0) / steps / 1e3, name))
for c, us, name in sorted(rows, key=lambda r: -r[0])[:40]:
    print(f"  {c:6.1f} x {us / max(c, 1e-9):6.2f} us  {name[:150]}")
PY
done
echo "== decode under graph settings, alternating: single (prompt 128, 256 tokens), batch 8 (128 each)"
for r in $(seq "$ROUNDS"); do
  [ $SECONDS -gt $(( END - 120 )) ] && { echo "deadline: stop at round $r"; break; }
  for s in ${SHAPES//,/ }; do for c in $CONFIGS; do
    printf "%s %s single " "$s" "$c"; env $(env_of $c) timeout 60 $M bench --model /tmp/models/$s-real --prompt-len 128 --gen 256 --format json | tail -1
  done; done
  for c in $CONFIGS; do
    printf "qwen3-0.6b %s batch8 " "$c"; env $(env_of $c) timeout 60 $M bench --model /tmp/models/qwen3-0.6b-real --batch 8 --prompt-len 128 --gen 128 --format json | tail -1
  done
  for c in ${MLXLM_CONFIGS:-default ops1000 nographs}; do
    [ $SECONDS -gt $(( END - 30 )) ] && break
    printf "mlx-lm qwen3-0.6b %s " "$c"; env $(env_of $c) timeout 60 python3 $B/mlxlm_bench.py /tmp/models/qwen3-0.6b-real --prompt-len 128 --gen 256 --device gpu | tail -1
  done
done
echo "done in $SECONDS s"
