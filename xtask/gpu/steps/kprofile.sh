# a speculative round against plain decode steps: kernels and GPU busy time, by kernel (CUPTI)
#
# One device call: on the real-shape bf16 checkpoints SHAPES (default
# "qwen3-0.6b-real qwen3_5-real"), `mlex bench --prompt-len 16` under
# libkcount.so with KCOUNT_NAMES=1, plain at --gen 32 and 160 (128 steps
# apart), then speculative (`--draft-acceptance 1.0 --force-acceptance
# --draft-tokens K --repeats 1`, which runs one plain and one speculative
# generation, after a plain one that makes the drafter's script) at the
# same two lengths. The speculative pair's difference less twice the plain
# pair's is what 128 / (K + 1) extra rounds ran. Prints,
# per plain step and per round: kernels, GPU busy time, and wall time from
# the bench's tok/s; then a plain step's kernels by GPU time and the kernels that account for most of the round's
# busy time against K + 1 plain steps. Needs the CUDA bundle's files in
# .gpu/, the mlx-cuda-pack archive in .mlx-cuda/, the mlx wheel in .whl/
# and CUPTI on the machine. Writes $OUT/kprofile.txt.
#
#   [SHAPES="..."] [K=3] bash xtask/gpu/run.sh kprofile
K=${K:-3}
SHAPES=${SHAPES:-"qwen3-0.6b-real qwen3_5-real"}
wheels
python3 $B/make_bench_models.py /tmp/models --scale real --shapes $(echo ${SHAPES//-real/} | tr ' ' ,) | tail -1
cupti
kcount_so || exit 1
for m in $SHAPES; do
  d=/tmp/kp/$m; mkdir -p $d
  for g in 32 160; do
    KCOUNT_NAMES=1 kbench /tmp/models/$m --gen $g --format json > $d/plain-$g.txt
    KCOUNT_NAMES=1 kbench /tmp/models/$m --gen $g --format json --draft-acceptance 1.0 \
      --force-acceptance --draft-tokens $K --repeats 1 > $d/spec-$g.txt
  done
  python3 - $d $K $m <<'EOF' | tee -a $O/kprofile.txt
import json, sys
d, k, m = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def read(name):
    names, busy, bench = {}, 0, {}
    for l in open(f"{d}/{name}.txt"):
        if l.startswith("kname: "):
            c, ns, n = l[7:].rstrip("\n").split(" ", 2)
            names[n] = (int(c), int(ns))
        elif l.startswith("kbusy: "):
            busy = int(l[7:])
        elif l.startswith("{"):
            bench = json.loads(l)
    return names, busy, bench
def diff(a, b):
    out = {}
    for n in set(a[0]) | set(b[0]):
        c0, t0 = a[0].get(n, (0, 0)); c1, t1 = b[0].get(n, (0, 0))
        out[n] = (c1 - c0, t1 - t0)
    return out, b[1] - a[1]
p32, p160, s32, s160 = (read(x) for x in ("plain-32", "plain-160", "spec-32", "spec-160"))
plain, pbusy = diff(p32, p160)
spec, sbusy = diff(s32, s160)
rounds = 128 / (k + 1)
# The speculative run made two plain generations (the script, the timed one).
round_k = {n: ((spec[n][0] - 2 * plain.get(n, (0, 0))[0]) / rounds, (spec[n][1] - 2 * plain.get(n, (0, 0))[1]) / rounds) for n in spec}
step_k = {n: (c / 128, t / 128) for n, (c, t) in plain.items()}
rbusy = (sbusy - 2 * pbusy) / rounds / 1e6
sbusy1 = pbusy / 128 / 1e6
b = s160[2]
pw = 1e3 / b.get("plain_decode_tok_s", {}).get("median", float("nan"))
sw = 1e3 * (k + 1) / b.get("speculative_decode_tok_s", {}).get("median", float("nan"))
print(f"== {m}, K = {k}")
print(f"plain step: {sum(c for c, _ in step_k.values()):.0f} kernels, GPU busy {sbusy1:.3f} ms, wall {pw:.3f} ms")
print(f"round (T = {k + 1}): {sum(c for c, _ in round_k.values()):.0f} kernels, GPU busy {rbusy:.3f} ms, wall {sw:.3f} ms "
      f"= {sw / pw:.2f} steps; busy {rbusy / sbusy1:.2f} steps")
print("a plain step's kernels by GPU time (launches, us):")
for n in sorted(step_k, key=lambda n: -step_k[n][1])[:12]:
    print(f"  {step_k[n][0]:6.1f}  {step_k[n][1] / 1e3:8.1f}  {n[:110]}")
print("kernels by extra busy time a round over one plain step (launches round / step, us round / step):")
rows = sorted(round_k, key=lambda n: -(round_k[n][1] - step_k.get(n, (0, 0))[1]))
for n in rows[:15]:
    rc, rt = round_k[n]; pc, pt = step_k.get(n, (0, 0))
    print(f"  {rc:6.1f} / {pc:6.1f}  {rt / 1e3:8.1f} / {pt / 1e3:8.1f}  {n[:110]}")
EOF
done
