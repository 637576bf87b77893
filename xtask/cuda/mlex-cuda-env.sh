#!/bin/sh
# Prints the environment that makes the `mlex` binary use MLX's CUDA backend.
#
#   eval "$(sh mlex-cuda-env.sh RUNTIME [UNPACK_DIR])"
#
# RUNTIME is either an unpacked CUDA MLX runtime (a folder with lib/libmlx.so,
# include/ beside lib/ for MLX's run-time kernel compiler, and optionally
# libs/ with its BLAS), or the archive `mlx-cuda-sm90.tar` made by the
# workplace tool mlx-cuda-pack, which is unpacked into UNPACK_DIR
# (default /tmp/mlex-cuda).
#
# How the CUDA libmlx.so wins: the binary's run path is a RUNPATH
# ($ORIGIN/mlx/lib), and LD_LIBRARY_PATH is searched before any RUNPATH, so
# putting RUNTIME/lib first on LD_LIBRARY_PATH loads the CUDA build of the
# same MLX version instead of the CPU one. The NVIDIA libraries it needs
# (cuBLAS, cuDNN, NCCL, NVRTC, ...) are taken from the system's Python
# `nvidia` packages when present.
set -eu
SRC=${1:?usage: mlex-cuda-env.sh RUNTIME_DIR_OR_ARCHIVE [UNPACK_DIR]}
DST=${2:-/tmp/mlex-cuda}
if [ -f "$SRC" ]; then
  mkdir -p "$DST"
  tar -C "$DST" -xf "$SRC"
  if [ -f "$DST/lib/libmlx.so.xz" ]; then xz -d -f "$DST/lib/libmlx.so.xz"; fi
elif [ -d "$SRC" ] && [ -f "$SRC/mlx-cuda-sm90.tar" ]; then
  exec sh "$0" "$SRC/mlx-cuda-sm90.tar" "$DST"
else
  DST=$SRC
fi
[ -f "$DST/lib/libmlx.so" ] || { echo "no lib/libmlx.so in $DST" >&2; exit 1; }
NV=""
if command -v python3 >/dev/null 2>&1; then
  NV=$(python3 -c "import nvidia, glob, os; p=list(nvidia.__path__)[0]; print(':'.join(sorted(set(os.path.dirname(f) for f in glob.glob(p+'/**/lib/*.so*', recursive=True)))))" 2>/dev/null || true)
fi
echo "export MLX_CUDA_DIR=$DST"
echo "export LD_LIBRARY_PATH=$DST/lib:$DST/libs${NV:+:$NV}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
