#!/usr/bin/env python3
"""Random-weight checkpoints for the mlex vs mlx-lm benchmark
(``bench_vs_mlxlm.py``): MLX-community layout (the names mlx-lm's model
classes use, ``conv1d`` weights as ``[channels, kernel, 1]``), bfloat16
weights (``A_log`` float32, as ``mlx_lm.convert`` keeps it), one
``model.safetensors`` and a ``config.json`` that both mlx-lm 0.32.2 and mlex
load. Only ``mlx.core`` is needed, so it runs in the reference venv and on a
GPU machine alike. 4-bit variants are not written: both engines quantize on
load (``mlex bench --quantize 4``, mlx-lm ``quantize_model``, group 64).

    python make_bench_models.py OUT_DIR [--scale tiny|small|host|real] [--shapes qwen3-0.6b,qwen3_5,nemotron_h] [--force]

The real-size shapes of ``real_shapes.py`` (``--shapes qwen3_next-80b-a3b,
qwen3_5_moe-35b-a3b,nemotron_h-30b-a3b,qwen3_5-9b``, scales real and tiny)
are written 4-bit with a fraction of their layers, and need mlx-lm too.

Writes ``OUT_DIR/<shape>-<scale>/``. A model whose ``bench_model.json`` stamp
matches what would be written is kept (rerunning does no work).

Shapes (``real``; ``tiny`` keeps the layer structure, 8 layers, at width 64,
see ``DIMS``):

* ``qwen3-0.6b`` — Qwen3-0.6B-like dense ``qwen3``: 28 layers, hidden 1024,
  intermediate 3072, 16 heads / 8 KV heads of 128, vocab 151936, tied
  embeddings, rope_theta 1e6.
* ``qwen3_5`` — Qwen3.5-like hybrid ``qwen3_5`` (text model
  ``qwen3_5_text``): the same sizes, 28 layers with full_attention_interval 4
  (7 gated attention layers, 21 Gated DeltaNet layers with 16 value heads,
  8 key heads, key/value head dims 128/128, conv kernel 4), partial rotary
  factor 0.25, tied embeddings.
* ``nemotron_h`` — NemotronH-like hybrid ``nemotron_h``: hidden 1024,
  28 layers in the pattern ``M-M-M*-`` repeated (12 Mamba2, 4 attention,
  12 ReLU² MLP layers); Mamba2 mixers with 32 heads of 64 (expand 2,
  inner 2048), 8 groups, state 128, conv kernel 4 (the group count, state
  size, head size and expansion of the released Nemotron-H models);
  attention 8 heads / 2 KV heads of 128 (the 4:1 ratio of Nemotron-H-8B);
  MLP intermediate 4096; vocab 131072; untied ``lm_head``.

Weights: matrices ~ N(0, 1/fan_in) (the kernel size for the depthwise convolutions),
embeddings ~ 0.1 N(0, 1), norm weights ~ 1 + 0.1 N(0, 1), other vectors
~ 0.1 N(0, 1), ``A_log`` ~ U(-1, 1); each tensor from ``mx.random`` with a key
derived from the seed and its name, so the files are reproducible.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shapes  # noqa: E402

SEED = 0
# Bump when the weights or configs written for an unchanged shape change.
MAKER_VERSION = 1

SHAPES = ("qwen3-0.6b", "qwen3_5", "nemotron_h")
HYBRIDS = ("qwen3_5", "nemotron_h")
# The sizes people run (real_shapes.py): MoE hybrids and a 9B hybrid, written
# 4-bit with a fraction of their layers; made only when asked for.
REAL_SIZE = real_shapes.SHAPES
# For mlex alone (mlx-lm does not load `mtp.*`): qwen3_5 with a random
# multi-token-prediction head.
MLEX_ONLY = ("qwen3_5-mtp",)

# The widths of each scale, a row a width: its name, then its value at the
# ``real``, ``small`` and ``tiny`` scales. ``small`` is wide enough that the
# CPU's products, not its per-op overhead, set the pace (the CPU BLAS
# comparison in docs/BENCHMARKS.md); ``tiny`` small enough that the whole
# default sweep runs in minutes on a 2-core CPU (MLX's CPU quantized matmul is
# slow), every quantized input width still a multiple of the group size 64.
WIDTH_SCALES = ("real", "small", "tiny")
WIDTHS = (
    ("hidden", 1024, 512, 64),
    ("intermediate", 3072, 1536, 192),
    ("layers", 28, 8, 8),
    ("heads", 16, 8, 4),
    ("kv_heads", 8, 4, 2),
    ("head_dim", 128, 64, 16),
    ("vocab", 151936, 8192, 2048),
    # qwen3_5 Gated DeltaNet
    ("lin_v_heads", 16, 8, 4),
    ("lin_k_heads", 8, 4, 2),
    ("lin_k_dim", 128, 64, 16),
    ("lin_v_dim", 128, 64, 16),
    # nemotron_h
    ("nh_vocab", 131072, 8192, 2048),
    ("nh_intermediate", 4096, 1536, 256),
    ("nh_heads", 8, 8, 4),
    ("nh_kv_heads", 2, 4, 2),
    ("nh_head_dim", 128, 64, 16),
    ("mamba_heads", 32, 8, 4),
    ("mamba_head_dim", 64, 64, 16),
    ("mamba_groups", 8, 2, 2),
    ("ssm_state", 128, 64, 16),
)
DIMS = {scale: {name: values[i] for name, *values in WIDTHS} for i, scale in enumerate(WIDTH_SCALES)}
# The real models' depth (28 layers, so as many graph nodes a token) at the
# tiny widths: a step costs almost no arithmetic, so its time is the host's
# graph construction and evaluation, the cost that bounds small-model decode
# on the H200. Measures host work on a machine without a GPU.
DIMS["host"] = dict(DIMS["tiny"], layers=28)
CONV_KERNEL = 4
# Room for the 64k-token runs of xtask/gpu/steps/kvq.sh (mlex refuses a
# prompt longer than max_position_embeddings).
MAX_POSITIONS = 131072
NEMOTRON_UNIT = "M-M-M*-"


def nemotron_pattern(layers: int) -> str:
    """``M-M-M*-`` repeated and trimmed to ``layers`` characters."""
    return (NEMOTRON_UNIT * (layers // len(NEMOTRON_UNIT) + 1))[:layers]


# --------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------


def qwen3_text_config(d: dict) -> dict:
    """The keys that ``qwen3`` and ``qwen3_5``'s text model share (all but
    ``model_type``), in their order."""
    return dict(
        hidden_size=d["hidden"],
        intermediate_size=d["intermediate"],
        num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        vocab_size=d["vocab"],
        rms_norm_eps=1e-6,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
    )


def qwen3_config(d: dict) -> dict:
    return dict(model_type="qwen3", **qwen3_text_config(d), rope_theta=1000000.0)


def qwen3_5_config(d: dict) -> dict:
    text = dict(
        model_type="qwen3_5_text",
        **qwen3_text_config(d),
        linear_num_value_heads=d["lin_v_heads"],
        linear_num_key_heads=d["lin_k_heads"],
        linear_key_head_dim=d["lin_k_dim"],
        linear_value_head_dim=d["lin_v_dim"],
        linear_conv_kernel_dim=CONV_KERNEL,
        full_attention_interval=4,
        rope_parameters={"type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25},
    )
    return dict(model_type="qwen3_5", text_config=text, tie_word_embeddings=True)


def nemotron_h_config(d: dict) -> dict:
    pattern = nemotron_pattern(d["layers"])
    return dict(
        model_type="nemotron_h",
        vocab_size=d["nh_vocab"],
        hidden_size=d["hidden"],
        intermediate_size=d["nh_intermediate"],
        num_hidden_layers=len(pattern),
        hybrid_override_pattern=pattern,
        max_position_embeddings=MAX_POSITIONS,
        num_attention_heads=d["nh_heads"],
        num_key_value_heads=d["nh_kv_heads"],
        head_dim=d["nh_head_dim"],
        attention_bias=False,
        mamba_num_heads=d["mamba_heads"],
        mamba_head_dim=d["mamba_head_dim"],
        mamba_proj_bias=False,
        ssm_state_size=d["ssm_state"],
        conv_kernel=CONV_KERNEL,
        n_groups=d["mamba_groups"],
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=False,
    )


def config(shape: str, scale: str) -> dict:
    """The ``config.json`` of ``shape`` at ``scale`` (of a real-size shape:
    before quantization)."""
    if shape in REAL_SIZE:
        return real_shapes.config(shape, scale)
    d = DIMS[scale]
    return {
        "qwen3-0.6b": qwen3_config,
        "qwen3_5": qwen3_5_config,
        "nemotron_h": nemotron_h_config,
        "qwen3_5-mtp": qwen3_5_mtp_config,
    }[shape](d)


# --------------------------------------------------------------------------
# Weight shapes (MLX-community names)
# --------------------------------------------------------------------------


def attention_dims(c: dict) -> tuple:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    return tuple(c[k] for k in keys)


def qwen3_shapes(c: dict) -> dict[str, tuple]:
    H, I, NH, KV, HD = attention_dims(c)
    s = {"model.embed_tokens.weight": (c["vocab_size"], H), "model.norm.weight": (H,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        s.update({
            f"{p}.input_layernorm.weight": (H,),
            f"{p}.post_attention_layernorm.weight": (H,),
            f"{p}.self_attn.q_proj.weight": (NH * HD, H),
            f"{p}.self_attn.k_proj.weight": (KV * HD, H),
            f"{p}.self_attn.v_proj.weight": (KV * HD, H),
            f"{p}.self_attn.o_proj.weight": (H, NH * HD),
            f"{p}.self_attn.q_norm.weight": (HD,),
            f"{p}.self_attn.k_norm.weight": (HD,),
            f"{p}.mlp.gate_proj.weight": (I, H),
            f"{p}.mlp.up_proj.weight": (I, H),
            f"{p}.mlp.down_proj.weight": (H, I),
        })
    return s


def qwen3_5_shapes(cfg: dict) -> dict[str, tuple]:
    c = cfg["text_config"]
    H, I, NH, KV, HD = attention_dims(c)
    nv, nk = c["linear_num_value_heads"], c["linear_num_key_heads"]
    kd, vd = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"]
    K = c["linear_conv_kernel_dim"]
    P = "language_model.model"
    s = {f"{P}.embed_tokens.weight": (c["vocab_size"], H), f"{P}.norm.weight": (H,)}
    for i in range(c["num_hidden_layers"]):
        p = f"{P}.layers.{i}"
        s.update({
            f"{p}.input_layernorm.weight": (H,),
            f"{p}.post_attention_layernorm.weight": (H,),
            f"{p}.mlp.gate_proj.weight": (I, H),
            f"{p}.mlp.up_proj.weight": (I, H),
            f"{p}.mlp.down_proj.weight": (H, I),
        })
        if (i + 1) % c["full_attention_interval"] != 0:
            a = f"{p}.linear_attn"
            s.update({
                f"{a}.in_proj_qkv.weight": (2 * kd + vd, H),
                f"{a}.in_proj_z.weight": (vd, H),
                f"{a}.in_proj_b.weight": (nv, H),
                f"{a}.in_proj_a.weight": (nv, H),
                f"{a}.conv1d.weight": (2 * kd + vd, K, 1),
                f"{a}.dt_bias": (nv,),
                f"{a}.A_log": (nv,),
                f"{a}.norm.weight": (c["linear_value_head_dim"],),
                f"{a}.out_proj.weight": (H, vd),
            })
        else:
            a = f"{p}.self_attn"
            s.update({
                f"{a}.q_proj.weight": (2 * NH * HD, H),  # queries and the output gate
                f"{a}.k_proj.weight": (KV * HD, H),
                f"{a}.v_proj.weight": (KV * HD, H),
                f"{a}.o_proj.weight": (H, NH * HD),
                f"{a}.q_norm.weight": (HD,),
                f"{a}.k_norm.weight": (HD,),
            })
    return s


def nemotron_h_shapes(c: dict) -> dict[str, tuple]:
    H = c["hidden_size"]
    heads, inner = c["mamba_num_heads"], c["mamba_num_heads"] * c["mamba_head_dim"]
    conv_dim = inner + 2 * c["n_groups"] * c["ssm_state_size"]
    NH, KV, HD = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    s = {
        "backbone.embeddings.weight": (c["vocab_size"], H),
        "backbone.norm_f.weight": (H,),
        "lm_head.weight": (c["vocab_size"], H),
    }
    for i, kind in enumerate(c["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}"
        m = f"{p}.mixer"
        s[f"{p}.norm.weight"] = (H,)
        if kind == "M":
            s.update({
                f"{m}.in_proj.weight": (inner + conv_dim + heads, H),
                f"{m}.conv1d.weight": (conv_dim, c["conv_kernel"], 1),
                f"{m}.conv1d.bias": (conv_dim,),
                f"{m}.dt_bias": (heads,),
                f"{m}.A_log": (heads,),
                f"{m}.D": (heads,),
                f"{m}.norm.weight": (inner,),
                f"{m}.out_proj.weight": (H, inner),
            })
        elif kind == "*":
            s.update({
                f"{m}.q_proj.weight": (NH * HD, H),
                f"{m}.k_proj.weight": (KV * HD, H),
                f"{m}.v_proj.weight": (KV * HD, H),
                f"{m}.o_proj.weight": (H, NH * HD),
            })
        elif kind == "-":
            s.update({
                f"{m}.up_proj.weight": (c["intermediate_size"], H),
                f"{m}.down_proj.weight": (H, c["intermediate_size"]),
            })
        else:
            raise ValueError(f"layer kind {kind!r} is not made here")
    return s


def qwen3_5_mtp_config(d: dict) -> dict:
    c = qwen3_5_config(d)
    c["text_config"]["mtp_num_hidden_layers"] = 1
    return c


def qwen3_5_mtp_shapes(cfg: dict) -> dict[str, tuple]:
    """qwen3_5's tensors and an MTP head (``mtp.*``, MLX layout: norms as
    they multiply): ``fc`` [H, 2H], its three norms, and one layer shaped
    as the trunk's first full-attention layer."""
    s = qwen3_5_shapes(cfg)
    c = cfg["text_config"]
    H = c["hidden_size"]
    first = f"language_model.model.layers.{c['full_attention_interval'] - 1}."
    for name, shp in list(s.items()):
        if name.startswith(first):
            s["mtp.layers.0." + name[len(first):]] = shp
    s.update({
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
    })
    return s


def weight_shapes(shape: str, cfg: dict) -> dict[str, tuple]:
    """Every tensor of the checkpoint: name -> shape."""
    return {
        "qwen3-0.6b": qwen3_shapes,
        "qwen3_5": qwen3_5_shapes,
        "nemotron_h": nemotron_h_shapes,
        "qwen3_5-mtp": qwen3_5_mtp_shapes,
    }[shape](cfg)


# --------------------------------------------------------------------------
# Drawing and writing
# --------------------------------------------------------------------------


def draw(name: str, shape: tuple, seed: int):
    """One tensor, from a key of (seed, name): bfloat16, ``A_log`` float32."""
    import mlx.core as mx

    key = mx.random.key((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 32))
    if name.endswith("A_log"):
        return mx.random.uniform(-1.0, 1.0, shape, key=key)
    n = mx.random.normal(shape, key=key)
    if len(shape) == 1 and "norm" in name:
        a = 1.0 + 0.1 * n
    elif len(shape) == 1:
        a = 0.1 * n
    elif name.endswith(("embed_tokens.weight", "embeddings.weight")):
        a = 0.1 * n
    else:
        # [out, in] matrices, stacked experts [experts, out, in]; depthwise
        # conv1d [channels, kernel, 1]
        fan_in = shape[-1] if len(shape) == 3 and shape[-1] != 1 else shape[1]
        a = n * (fan_in**-0.5)
    return a.astype(mx.bfloat16)


def stamp(shape: str, scale: str, seed: int) -> dict:
    s = {
        "shape": shape,
        "scale": scale,
        "seed": seed,
        "maker_version": MAKER_VERSION,
        "config": config(shape, scale),
    }
    if shape in REAL_SIZE:
        s.update(bits=real_shapes.BITS, group_size=real_shapes.GROUP_SIZE, layers_of=real_shapes.DEPTH[shape][1])
    return s


def checkpoint_bits(path: Path) -> int | None:
    """The bits of a checkpoint written quantized (the real-size shapes),
    from its stamp; None for a bf16 one."""
    try:
        return json.loads((path / "bench_model.json").read_text()).get("bits")
    except (OSError, json.JSONDecodeError):
        return None


def make(shape: str, scale: str, out_dir: Path, *, seed: int = SEED, force: bool = False) -> Path:
    """Writes ``out_dir/<shape>-<scale>`` unless an identical one is there."""
    import mlx.core as mx  # here, so that importing the shape tables needs no MLX

    path = out_dir / f"{shape}-{scale}"
    want = stamp(shape, scale, seed)
    stamp_file = path / "bench_model.json"
    if not force and stamp_file.exists() and (path / "model.safetensors").exists():
        try:
            if json.loads(stamp_file.read_text()) == want:
                print(f"make_bench_models: {path} is up to date", file=sys.stderr)
                return path
        except json.JSONDecodeError:
            pass
    # Made beside, then renamed into place: a run cut short leaves the old
    # checkpoint or none, never a half-written one under the real name.
    partial = path.with_name(path.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    cfg = want["config"]
    if shape in REAL_SIZE:
        sizes = real_shapes.write(cfg, partial, draw, seed)
        params, nbytes = sizes["params"], sizes["nbytes"]
        (partial / "sizes.json").write_text(json.dumps(sizes, indent=2) + "\n")
    else:
        weights = {}
        for name, shp in sorted(weight_shapes(shape, cfg).items()):
            t = draw(name, shp, seed)
            mx.eval(t)
            weights[name] = t
        mx.save_safetensors(str(partial / "model.safetensors"), weights, metadata={"format": "mlx"})
        (partial / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        params = sum(v.size for v in weights.values())
        nbytes = sum(v.nbytes for v in weights.values())
        del weights
    (partial / "bench_model.json").write_text(json.dumps(want, indent=2) + "\n")
    if path.exists():
        shutil.rmtree(path)
    os.replace(partial, path)
    print(f"make_bench_models: {path}: {params / 1e6:.1f}M parameters, {nbytes / 1e9:.2f} GB", file=sys.stderr)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for <shape>-<scale>/ checkpoints")
    p.add_argument("--scale", choices=sorted(DIMS) + ["full"], default="tiny",
                   help="full: the real-size shapes at their real depth")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--force", action="store_true", help="rewrite even when up to date")
    a = p.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s]
    known = SHAPES + MLEX_ONLY + REAL_SIZE
    for s in shapes:
        if s not in known:
            p.error(f"unknown shape {s!r} (known: {', '.join(known)})")
        if s in REAL_SIZE and a.scale not in real_shapes.SCALES:
            p.error(f"{s} is made at --scale {' or '.join(real_shapes.SCALES)}, not {a.scale}")
        if s not in REAL_SIZE and a.scale == "full":
            p.error(f"--scale full is the real-size shapes' real depth ({', '.join(REAL_SIZE)}); {s} has --scale real")
    for s in shapes:
        make(s, a.scale, a.out, seed=a.seed, force=a.force)


if __name__ == "__main__":
    main()
