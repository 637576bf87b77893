"""Lets mlx-lm 0.32.2's MoE layers run on MLX 0.32.2, the MLX that mlex
links: both engines then run the same kernels of the same ``libmlx.so``.

mlx-lm 0.32.2's ``QuantizedSwitchLinear`` passes ``mx.gather_qmm`` a
``global_scale`` keyword (the per-tensor scale of ``nvfp4`` weights, new in
MLX 0.32.4), which MLX 0.32.2 does not take, so every quantized MoE model
fails there. On such an MLX, ``patch()`` wraps ``gather_qmm`` so that the
keyword is dropped when it is ``None``, its default (affine weights have no
global scale): the call MLX runs is the one mlx-lm meant. A non-``None``
scale is refused. On an MLX that takes the keyword nothing is changed.
"""
from __future__ import annotations

import mlx.core as mx


def patch() -> str | None:
    """Wraps ``mx.gather_qmm`` where needed; returns what was done (for the
    bench's JSON) or None."""
    if "global_scale" in (mx.gather_qmm.__doc__ or "").split("\n", 1)[0]:
        return None
    inner = mx.gather_qmm

    def gather_qmm(*args, global_scale=None, **kwargs):
        if global_scale is not None:
            raise ValueError(f"MLX {mx.__version__}'s gather_qmm has no global_scale (nvfp4 weights)")
        return inner(*args, **kwargs)

    mx.gather_qmm = gather_qmm
    return f"gather_qmm's global_scale=None dropped (MLX {mx.__version__} lacks the keyword)"
