"""The benchmark shapes at the sizes people run: three MoE hybrids of 30-80B
parameters with about 3B active, and a 9B dense hybrid, written 4-bit (the
way they are run: MLX-community checkpoints), with a stated fraction of
their layers at the ``real`` scale (per-layer cost is what an engine ratio
needs, and a run loads a few GB instead of tens) or all of them at ``full``.

Used by ``make_bench_models.py`` (``--shapes qwen3_next-80b-a3b,...``) and
``bench_vs_mlxlm.py``. Unlike the 0.6B shapes, the tensors' names and shapes
are not tabled here: the checkpoint is mlx-lm's own model class for the
config, its weights replaced by ``make_bench_models.draw``'s, quantized by
mlx-lm's ``quantize_model`` (affine, group 64, 4 bits, with the model's own
``quant_predicate``: the routers at 8 bits), and saved as ``mlx_lm.convert``
saves, so the layout is the one both engines load from the Hub. Needs mlx
and mlx-lm (an mlx-lm whose MoE layers run on that MLX).

Shapes (``real`` scale; ``full`` is the same at the real depth; ``tiny``
keeps each layer pattern and expert routing at widths of 64, for a CPU
check of both engines in seconds):

* ``qwen3_next-80b-a3b`` — Qwen3-Next-80B-A3B-like ``qwen3_next``: hidden
  2048, 512 experts of 512 (top 10) and a shared expert of 512 in every
  layer, gated attention 16 q / 2 kv heads of 256 every 4th layer, Gated
  DeltaNet 32 value / 16 key heads of 128; vocab 151936, untied head.
  **8 of 48 layers.**
* ``qwen3_5_moe-35b-a3b`` — Qwen3.5-35B-A3B-like ``qwen3_5_moe``: hidden
  2048, 256 experts of 512 (top 8) and a shared expert of 512, the same
  attention and Gated DeltaNet heads; vocab 248320. **8 of 40 layers.**
* ``nemotron_h-30b-a3b`` — Nemotron-3-Nano-30B-A3B-like ``nemotron_h``:
  hidden 2688, the pattern ``MEMEM*EMEMEM*...`` (Mamba2 64 heads of 64,
  8 groups, state 128; MoE 128 experts of 1856, top 6, one shared expert
  of 3712; attention 32 q / 2 kv heads of 128); vocab 131072.
  **13 of 52 layers** (the pattern's first 13: 6 Mamba2, 5 MoE, 2 attention).
* ``qwen3_5-9b`` — Qwen3.5-9B-like dense ``qwen3_5``: hidden 4096,
  intermediate 12288, attention 16 q / 4 kv heads of 256 every 4th layer,
  Gated DeltaNet 32 value / 16 key heads of 128; vocab 248320, untied head.
  **8 of 32 layers.**
"""
from __future__ import annotations

BITS = 4
GROUP_SIZE = 64
# ``real``: the real widths at the stated fraction of the layers; ``full``:
# the real widths at the real depth (the 80B one is about 45 GB at 4 bits);
# ``tiny``: the structure at width 64.
SCALES = ("real", "full", "tiny")

# The released Nemotron-3-Nano-30B-A3B's layer pattern (52 layers).
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

# name -> (layers made, layers of the real model)
DEPTH = {
    "qwen3_next-80b-a3b": (8, 48),
    "qwen3_5_moe-35b-a3b": (8, 40),
    "nemotron_h-30b-a3b": (13, 52),
    "qwen3_5-9b": (8, 32),
}
SHAPES = tuple(DEPTH)

# Widths a row: name, real, tiny. The tiny scale keeps expert counts and
# top-k (so routing gathers as many experts) at hidden 64.
WIDTHS = (
    ("hidden", 2048, 64),
    ("heads", 16, 4),
    ("kv_heads", 2, 2),
    ("head_dim", 256, 16),
    ("lin_v_heads", 32, 4),
    ("lin_k_heads", 16, 2),
    ("lin_dim", 128, 16),
    ("expert", 512, 64),
    ("vocab", 151936, 2048),
    ("vocab_3_5", 248320, 2048),
    # Qwen3.5-9B
    ("hidden_9b", 4096, 128),
    ("intermediate_9b", 12288, 256),
    ("kv_heads_9b", 4, 2),
    # Nemotron 3 Nano
    ("nh_hidden", 2688, 64),
    ("nh_vocab", 131072, 2048),
    ("nh_heads", 32, 4),
    ("nh_head_dim", 128, 16),
    ("mamba_heads", 64, 4),
    ("mamba_head_dim", 64, 16),
    ("mamba_groups", 8, 2),
    ("ssm_state", 128, 16),
    ("nh_expert", 1856, 64),
    ("nh_shared", 3712, 128),
)
DIMS = {scale: {name: values[i] for name, *values in WIDTHS} for i, scale in enumerate(("real", "tiny"))}
DIMS["full"] = DIMS["real"]
MAX_POSITIONS = 131072


def _linear_attention(d: dict) -> dict:
    return dict(
        linear_num_value_heads=d["lin_v_heads"],
        linear_num_key_heads=d["lin_k_heads"],
        linear_key_head_dim=d["lin_dim"],
        linear_value_head_dim=d["lin_dim"],
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
    )


def _attention(d: dict, hidden: str = "hidden", kv: str = "kv_heads") -> dict:
    return dict(
        hidden_size=d[hidden],
        num_attention_heads=d["heads"],
        num_key_value_heads=d[kv],
        head_dim=d["head_dim"],
        rms_norm_eps=1e-6,
        max_position_embeddings=MAX_POSITIONS,
    )


def qwen3_next_config(d: dict, layers: int) -> dict:
    return dict(
        model_type="qwen3_next",
        **_attention(d),
        **_linear_attention(d),
        num_hidden_layers=layers,
        intermediate_size=d["expert"] * 10,
        vocab_size=d["vocab"],
        num_experts=512 if d["hidden"] > 64 else 64,
        num_experts_per_tok=10,
        moe_intermediate_size=d["expert"],
        shared_expert_intermediate_size=d["expert"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rope_theta=10000000.0,
        partial_rotary_factor=0.25,
        attention_bias=False,
        tie_word_embeddings=False,
    )


def qwen3_5_text(d: dict, layers: int, *, moe: bool) -> dict:
    rope = {"type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
    if moe:
        sizes = dict(
            _attention(d),
            intermediate_size=d["expert"] * 8,
            num_experts=256 if d["hidden"] > 64 else 32,
            num_experts_per_tok=8,
            moe_intermediate_size=d["expert"],
            shared_expert_intermediate_size=d["expert"],
            norm_topk_prob=True,
        )
    else:
        sizes = dict(_attention(d, "hidden_9b", "kv_heads_9b"), intermediate_size=d["intermediate_9b"])
    return dict(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        **sizes,
        **_linear_attention(d),
        num_hidden_layers=layers,
        vocab_size=d["vocab_3_5"],
        rope_parameters=rope,
        tie_word_embeddings=False,
    )


def qwen3_5_config(d: dict, layers: int, *, moe: bool) -> dict:
    return dict(
        model_type="qwen3_5_moe" if moe else "qwen3_5",
        text_config=qwen3_5_text(d, layers, moe=moe),
        tie_word_embeddings=False,
    )


def nemotron_config(d: dict, layers: int) -> dict:
    """make_bench_models' NemotronH config at these widths, with Nemotron 3
    Nano's pattern and its experts."""
    import make_bench_models as bench  # here: it imports this module

    pattern = NANO_PATTERN[:layers]
    widths = {k: d[k] for k in ("nh_vocab", "nh_heads", "nh_head_dim", "mamba_heads", "mamba_head_dim",
                                "mamba_groups", "ssm_state")}
    c = bench.nemotron_h_config(dict(widths, layers=layers, hidden=d["nh_hidden"], nh_intermediate=d["nh_expert"],
                                     nh_kv_heads=d["kv_heads"]))
    c.update(
        hybrid_override_pattern=pattern,
        num_hidden_layers=len(pattern),
        n_routed_experts=128 if d["nh_hidden"] > 64 else 16,
        num_experts_per_tok=6,
        moe_intermediate_size=d["nh_expert"],
        moe_shared_expert_intermediate_size=d["nh_shared"],
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    return c


def config(shape: str, scale: str) -> dict:
    """The bf16 ``config.json`` of ``shape`` at ``scale`` (before
    quantization adds its block)."""
    if scale not in SCALES:
        raise ValueError(f"{shape} is made at the scales {', '.join(SCALES)}, not {scale!r}")
    d, layers = DIMS[scale], DEPTH[shape][1 if scale == "full" else 0]
    return {
        "qwen3_next-80b-a3b": lambda: qwen3_next_config(d, layers),
        "qwen3_5_moe-35b-a3b": lambda: qwen3_5_config(d, layers, moe=True),
        "nemotron_h-30b-a3b": lambda: nemotron_config(d, layers),
        "qwen3_5-9b": lambda: qwen3_5_config(d, layers, moe=False),
    }[shape]()


def write(cfg: dict, path, draw, seed: int) -> dict:
    """mlx-lm's model of ``cfg`` with ``draw(name, shape, seed)``'s weights,
    quantized 4-bit as ``mlx_lm.convert -q`` does, saved to ``path``
    (``model.safetensors`` and ``config.json``). Returns the written
    sizes. The draws and the quantization are one lazy graph, evaluated a
    layer at a time: only one layer's bf16 weights exist at once, so a
    full-depth 80B model is made in its 4-bit size (about 45 GB)."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes, quantize_model

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    # The constructor's own random init stays lazy and is never evaluated.
    drawn = [(n, draw(n, tuple(p.shape), seed)) for n, p in tree_flatten(model.parameters())]
    model.update(tree_unflatten(drawn))
    del drawn
    model, qcfg = quantize_model(model, cfg, GROUP_SIZE, BITS)
    weights = dict(tree_flatten(model.parameters()))
    groups: dict[str, list] = {}
    for name, a in weights.items():
        parts = name.split(".")
        key = ".".join(parts[: parts.index("layers") + 2]) if "layers" in parts else "rest"
        groups.setdefault(key, []).append(a)
    for group in groups.values():
        mx.eval(group)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
    return {
        "params": sum(v.size for v in weights.values()),
        "nbytes": sum(v.nbytes for v in weights.values()),
        "active_bytes_per_token": active_bytes(cfg, {n: (v.shape, v.nbytes) for n, v in weights.items()}),
    }


def active_bytes(cfg: dict, tensors: dict) -> int:
    """The weight bytes one decoded token reads: every tensor, but of the
    routed experts (stacked ``[experts, ...]``) top-k of them and of the
    embedding table one row. Divided into the memory bandwidth, the
    floor under a decode step's time."""
    c = cfg.get("text_config", cfg)
    experts = c.get("num_experts") or c.get("n_routed_experts")
    top_k = c.get("num_experts_per_tok")
    vocab = c["vocab_size"]
    total = 0.0
    for name, (shape, nbytes) in tensors.items():
        if experts and ("switch_mlp." in name or ".experts." in name) and shape[0] == experts:
            total += nbytes * top_k / experts
        elif "embed_tokens." in name or "embeddings." in name:
            total += nbytes / vocab
        else:
            total += nbytes
    return int(total)
