#!/usr/bin/env python3
"""Make the parity fixtures of mlex: random-weight checkpoints plus reference
outputs computed by mlx-lm, the Python reference implementation on MLX.

    python fixtures.py --out DIR [--smollm2-gguf PATH] [--only NAME,...]

Every fixture is a folder DIR/<name>/ holding a checkpoint (config.json and
safetensors weights, or a .gguf file) and reference.safetensors with

    prompt       int32   [P]      token ids (P = 16 for the random models)
    logits_full  float32 [P, V]   one forward of the whole prompt, no cache
    greedy       int32   [32]     greedy tokens decoded with mlx-lm's prompt
                                  cache, the prompt in one pass (greedy[0] is
                                  the argmax of the last prompt position)
    step_logits  float32 [32, V]  the logits each greedy token was taken from

The reference is always computed from a checkpoint read back from disk with
``mlx_lm.utils.load_model``, so that it goes through mlx-lm's own ``sanitize``
and quantization loading, never from the in-memory model that wrote it.
DIR/manifest.json lists the fixtures for the Rust parity tests.

Kinds of fixture:
  * MLX-community layout (what ``mlx_lm.utils.save_model``/``save_config``
    write) for llama, qwen2, qwen3, qwen3_next, qwen3_5, nemotron_h in float32,
    bfloat16 and 4-bit, MoE variants, the other quantization widths and group
    sizes, per-layer quantization overrides, float16, and a sharded checkpoint;
  * Hugging Face layout: the inverse of mlx-lm's ``sanitize`` applied to an
    MLX-layout twin, checked to give the twin's logits;
  * GGUF: tiny llama files written with the ``gguf`` package (F32, F16, Q8_0,
    Q4_0, Q4_1), whose reference comes from their dequantized float32 weights;
  * SmolLM2-135M-Instruct Q4_1 GGUF (with --smollm2-gguf) exported to an
    MLX-community 4-bit checkpoint, checked by asking it a question.

Everything is seeded, so a rerun writes identical files.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import types
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import gguf
import gguf_hybrid
import mix_ref
import kvq_ref
import mtp_ref
import tool_fixture
import jinja2
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import (
    _get_classes,
    get_total_parameters,
    load_model,
    quantize_model,
    save_config,
    save_model,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

PROMPT_LEN = 16
DECODE_STEPS = 32
PROMPT_SEED = 20240601
HF_TWIN_TOLERANCE = 1e-5

# --------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
)

# Wide enough that every projection's input is a multiple of 128, so that a
# group size of 128 quantizes all of them.
WIDE = dict(TINY, hidden_size=128, intermediate_size=256, num_attention_heads=8)

COMMON = dict(rms_norm_eps=1e-6, max_position_embeddings=4096)

TINY_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    norm_topk_prob=True,
)

# Qwen3-Next's RoPE (its gated attention layers, also those of hybrid_mix):
# a quarter of each head rotated.
QWEN3_NEXT_ROPE = dict(rope_theta=10000.0, partial_rotary_factor=0.25)

LINEAR_ATTENTION = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
)

MAMBA2 = dict(
    mamba_num_heads=4,
    mamba_head_dim=16,
    mamba_proj_bias=False,
    ssm_state_size=16,
    conv_kernel=4,
    n_groups=2,
    mlp_bias=False,
    layer_norm_epsilon=1e-5,
    use_bias=False,
    use_conv_bias=True,
)


# TINY for the models that derive the head size (hidden / heads).
TINY_NO_HEAD_DIM = {k: v for k, v in TINY.items() if k != "head_dim"}


def tiny_config(model_type: str, dims: dict = TINY, **fields) -> dict:
    """A config of ``model_type``: ``dims``, then ``COMMON``, then ``fields``."""
    return dict(model_type=model_type, **dims, **COMMON, **fields)


def llama_config(dims: dict = TINY, *, tie: bool = True) -> dict:
    return tiny_config(
        "llama",
        dims,
        rope_theta=10000.0,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=tie,
    )


def qwen2_config() -> dict:
    return tiny_config("qwen2", TINY_NO_HEAD_DIM, rope_theta=1000000.0, tie_word_embeddings=True)


def qwen2_moe_config() -> dict:
    """Qwen2-MoE, served by ``examples/specs/qwen2_moe.toml``, a spec that
    extends ``qwen2``: every layer sparse, scores not renormalised, a shared
    expert behind a sigmoid gate (mlx-lm's qwen2_moe.py)."""
    moe = {k: v for k, v in TINY_MOE.items() if k != "norm_topk_prob"}
    return tiny_config(
        "qwen2_moe",
        TINY_NO_HEAD_DIM,
        **moe,
        shared_expert_intermediate_size=64,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )


def qwen3_config() -> dict:
    return tiny_config("qwen3", rope_theta=1000000.0, tie_word_embeddings=True)


def qwen3_moe_config() -> dict:
    return tiny_config(
        "qwen3_moe",
        **TINY_MOE,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )


def qwen3_next_config(*, moe: bool = False) -> dict:
    cfg = tiny_config(
        "qwen3_next",
        **LINEAR_ATTENTION,
        **QWEN3_NEXT_ROPE,
        num_experts=0,
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        mlp_only_layers=[],
        moe_intermediate_size=0,
        norm_topk_prob=False,
        tie_word_embeddings=True,
    )
    if moe:
        # Layers 1 and 3 sparse (decoder_sparse_step=2), 0 and 2 dense.
        cfg.update(TINY_MOE, decoder_sparse_step=2, shared_expert_intermediate_size=64)
        cfg["tie_word_embeddings"] = False
    return cfg


def qwen3_5_config(*, moe: bool = False) -> dict:
    text = tiny_config(
        "qwen3_5_moe_text" if moe else "qwen3_5_text",
        **LINEAR_ATTENTION,
        rope_parameters={
            "type": "default",
            "mrope_section": [1, 1, 0],
            "rope_theta": 100000.0,
            "partial_rotary_factor": 0.25,
        },
        tie_word_embeddings=True,
    )
    if moe:
        text.update(TINY_MOE, shared_expert_intermediate_size=64)
    return dict(
        model_type="qwen3_5_moe" if moe else "qwen3_5",
        text_config=text,
        tie_word_embeddings=True,
    )


def nemotron_h_config(pattern: str = "M-*EM*") -> dict:
    return dict(
        model_type="nemotron_h",
        vocab_size=TINY["vocab_size"],
        hidden_size=TINY["hidden_size"],
        intermediate_size=TINY["intermediate_size"],
        max_position_embeddings=4096,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=False,
        **MAMBA2,
        hybrid_override_pattern=pattern,
        num_hidden_layers=len(pattern),
        # TINY_MOE's experts under NemotronH's names, routed in groups.
        n_routed_experts=TINY_MOE["num_experts"],
        num_experts_per_tok=TINY_MOE["num_experts_per_tok"],
        moe_intermediate_size=TINY_MOE["moe_intermediate_size"],
        n_group=2,
        topk_group=1,
        norm_topk_prob=TINY_MOE["norm_topk_prob"],
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        moe_shared_expert_intermediate_size=128,
        tie_word_embeddings=False,
    )


def hybrid_mix_config() -> dict:
    """``hybrid_mix`` (a spec-only hybrid, see ``mix_ref.py``): six layers
    G M A G M A; MoE on layers 3 and 5 (decoder_sparse_step 2; layer 1 is
    Mamba2, which has no feed-forward)."""
    return dict(
        model_type="hybrid_mix",
        layer_pattern="GMAGMA",
        **dict(TINY, num_hidden_layers=6),
        **COMMON,
        **dict(LINEAR_ATTENTION, full_attention_interval=3),
        **MAMBA2,
        **TINY_MOE,
        **QWEN3_NEXT_ROPE,
        attention_bias=False,
        tie_word_embeddings=False,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=2,
        mlp_only_layers=[],
    )


def stablelm_config() -> dict:
    """StableLM: LayerNorm with biases, q/k/v biases, partial rotary (1/4 of
    a head, as StableLM-2), an untied head."""
    return dict(
        model_type="stablelm",
        **TINY_NO_HEAD_DIM,
        max_position_embeddings=4096,
        layer_norm_eps=1e-5,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        use_qkv_bias=True,
        use_parallel_residual=False,
        qk_layernorm=False,
        tie_word_embeddings=False,
    )


def olmo2_config() -> dict:
    """OLMo 2: post-norm blocks (norms on the attention and MLP outputs),
    q/k RMS norms over the whole projection; an untied head."""
    return tiny_config("olmo2", rope_theta=500000.0, tie_word_embeddings=False)


def olmo3_config() -> dict:
    """OLMo 3: OLMo 2's blocks, layers 0-2 sliding (window 8, shorter than
    the prompt), layer 3 full."""
    return tiny_config(
        "olmo3",
        rope_theta=500000.0,
        sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=False,
    )


def granite_config() -> dict:
    """Granite 3: Llama blocks with embedding, attention and residual
    multipliers and logits divided by a scale (none of them 1, so that
    each shows; the 3.x checkpoints' own values, with a random tied head,
    decode one token over and over)."""
    return tiny_config(
        "granite",
        rope_theta=10000.0,
        attention_bias=False,
        mlp_bias=False,
        embedding_multiplier=2.0,
        attention_multiplier=0.125,
        residual_multiplier=0.5,
        logits_scaling=4.0,
        tie_word_embeddings=False,
    )


def smollm3_config() -> dict:
    """SmolLM3: Llama blocks, layers 1 and 3 without RoPE."""
    return tiny_config(
        "smollm3",
        rope_theta=5000000.0,
        no_rope_layers=[1, 0, 1, 0],
        tie_word_embeddings=True,
    )


def phi3_config() -> dict:
    """Phi-3: fused qkv_proj and gate_up_proj; head_dim from hidden/heads;
    partial rotary 0.5 (as Phi-4-mini)."""
    return tiny_config(
        "phi3",
        TINY_NO_HEAD_DIM,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        tie_word_embeddings=False,
    )


ARCH_CONFIGS: dict[str, Callable[[], dict]] = {
    "llama": llama_config,
    "qwen2": qwen2_config,
    "qwen3": qwen3_config,
    "qwen3_next": qwen3_next_config,
    "qwen3_5": qwen3_5_config,
    "nemotron_h": nemotron_h_config,
}


def text_config(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def seed_for(key: str) -> int:
    """A stable seed from a name, so related fixtures share their weights."""
    return zlib.crc32(key.encode())


# --------------------------------------------------------------------------
# Random models
# --------------------------------------------------------------------------

# Small embeddings keep the input token from dominating the residual stream
# (with tied embeddings that makes greedy decoding repeat one token); the
# larger final norm then brings the logits back to a spread of a few units.
EMBED_STD = 0.1
FINAL_NORM_GAIN = 3.0
FINAL_NORMS = ("model.norm.weight", "backbone.norm_f.weight")


def random_parameters(model: nn.Module, seed: int) -> list[tuple[str, mx.array]]:
    """Draw every parameter of ``model`` from a seeded numpy RNG (float32).

    Norm weights ~ 1 + 0.1 N(0, 1) (the final norm times FINAL_NORM_GAIN),
    other 1-D parameters (biases, dt_bias, D, e_score_correction_bias)
    ~ 0.1 N(0, 1), ``A_log`` ~ U(-1, 1), embeddings ~ EMBED_STD N(0, 1), and
    every other weight ~ N(0, 1/fan_in) with fan_in its input width (times
    the kernel size for convolutions), which keeps activations of order one.
    """
    rng = np.random.default_rng(seed)
    drawn = []
    for name, value in sorted(tree_flatten(model.parameters())):
        shape = value.shape
        if name.endswith("A_log"):
            a = rng.uniform(-1.0, 1.0, shape)
        elif name.endswith("norm.bias"):
            # LayerNorm shifts (StableLM); no other model has them.
            a = 0.1 * rng.standard_normal(shape)
        elif value.ndim == 1 and "norm" in name:
            a = 1.0 + 0.1 * rng.standard_normal(shape)
            if name.endswith(FINAL_NORMS):
                a *= FINAL_NORM_GAIN
        elif value.ndim == 1:
            a = 0.1 * rng.standard_normal(shape)
        elif name.endswith(("embed_tokens.weight", "embeddings.weight")):
            a = EMBED_STD * rng.standard_normal(shape)
        else:
            fan_in = shape[-1] * (shape[-2] if "conv1d" in name else 1)
            a = rng.standard_normal(shape) / np.sqrt(fan_in)
        drawn.append((name, mx.array(a.astype(np.float32))))
    return drawn


def build_model(cfg: dict) -> nn.Module:
    model_class, args_class = _get_classes(cfg)
    return model_class(args_class.from_dict(copy.deepcopy(cfg)))


def random_model(cfg: dict, seed: int) -> nn.Module:
    model = build_model(cfg)
    model.load_weights(random_parameters(model, seed), strict=True)
    mx.eval(model.parameters())
    return model


def cast_model(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast floating parameters like ``mlx_lm.convert`` does: parameters that
    the model's ``cast_predicate`` rejects (e.g. ``A_log``) keep their dtype."""
    should_cast = getattr(model, "cast_predicate", lambda _: True)

    def cast(path, value):
        if should_cast(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))
    mx.eval(model.parameters())


def quantize(model: nn.Module, cfg: dict, bits: int, group_size: int, predicate=None):
    """``mlx_lm.utils.quantize_model``, without its progress print."""
    with contextlib.redirect_stdout(io.StringIO()):
        return quantize_model(model, cfg, group_size, bits, quant_predicate=predicate)


def save_sharded(path: Path, model: nn.Module, n_shards: int) -> None:
    """Write the weights as ``save_model`` does for a model over its shard
    size: model-0000i-of-0000N.safetensors plus model.safetensors.index.json."""
    weights = dict(tree_flatten(model.parameters()))
    names = list(weights)
    bounds = np.linspace(0, len(names), n_shards + 1).astype(int)
    weight_map = {}
    for i in range(n_shards):
        shard_name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        shard = {k: weights[k] for k in names[bounds[i] : bounds[i + 1]]}
        mx.save_safetensors(str(path / shard_name), shard, metadata={"format": "mlx"})
        weight_map.update({k: shard_name for k in shard})
    index = {
        "metadata": {
            "total_size": sum(v.nbytes for v in weights.values()),
            "total_parameters": get_total_parameters(model),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)


def reset_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def load_weight_files(path: Path) -> dict[str, mx.array]:
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


# --------------------------------------------------------------------------
# Reference outputs
# --------------------------------------------------------------------------


def random_prompt(vocab_size: int) -> np.ndarray:
    rng = np.random.default_rng(PROMPT_SEED)
    return rng.integers(0, vocab_size, size=PROMPT_LEN).astype(np.int32)


def run_reference(model: nn.Module, prompt: np.ndarray) -> dict[str, mx.array]:
    """One uncached forward of the prompt, then greedy decoding with the cache."""
    x = mx.array(prompt)[None]
    logits_full = model(x)[0].astype(mx.float32)
    mx.eval(logits_full)

    cache = make_prompt_cache(model)
    logits = model(x, cache=cache)[0, -1].astype(mx.float32)
    tokens, steps = [], []
    for i in range(DECODE_STEPS):
        token = mx.argmax(logits)
        mx.eval(token, logits)
        tokens.append(token.item())
        steps.append(logits)
        if i + 1 < DECODE_STEPS:
            logits = model(token.reshape(1, 1), cache=cache)[0, -1].astype(mx.float32)
    return {
        "prompt": mx.array(prompt, dtype=mx.int32),
        "logits_full": logits_full,
        "greedy": mx.array(tokens, dtype=mx.int32),
        "step_logits": mx.stack(steps),
    }


def write_reference(model_dir: Path, prompt: np.ndarray, out: Path, model: Optional[nn.Module] = None) -> dict[str, mx.array]:
    """Load ``model_dir`` with mlx-lm (or take ``model``, read back from it
    by the caller), run the reference, save it to ``out``."""
    if model is None:
        model, _ = load_model(model_dir)
    ref = run_reference(model, prompt)
    greedy = ref["greedy"].tolist()
    if len(set(greedy)) < 2:
        raise RuntimeError(f"{model_dir}: degenerate greedy decode {greedy}")
    check_cached_prompt(model_dir, model, ref)
    mx.save_safetensors(str(out), ref)
    return ref


# How far mlx-lm's cached prompt pass may be from its uncached one, relative
# to max(1, max |logit|). The two passes compute the same sums in different
# orders: the cache changes the shapes of some products (a conv window or a
# state prepended, keys concatenated), and a BLAS kernel's summation order
# depends on the shape and on the CPU (OpenBLAS picks kernels per CPU and
# OPENBLAS_CORETYPE), so bitwise equality holds on some CPUs and not on others
# (4.3e-6 on an AMD EPYC for gguf-nemotron_h_moe-q4_k). The bounds are the
# ones the Rust parity test holds mlex to for the same invariant (incremental
# decode against the full forward): 1e-4 in float32, a hundred times the
# ~1e-6 that reordering float32 sums of a few hundred terms over a few layers
# gives; 0.06 in bfloat16/float16, about 16 units in the last place of an
# 8-bit mantissa, which rounding every layer's output allows.
SELF_CHECK_TOL = {mx.float32: 1e-4, mx.bfloat16: 0.06, mx.float16: 0.06}


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model computes in: that of its embedding (quantized
    embeddings keep their scales in it)."""
    for path, value in tree_flatten(model.parameters()):
        if "embed" in path and mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))


def check_cached_prompt(model_dir: Path, model: nn.Module, ref: dict[str, mx.array]) -> float:
    """The reference's own sanity check: mlx-lm's cached prompt pass gives
    the uncached pass's last-position logits within ``SELF_CHECK_TOL``.
    Returns the relative difference."""
    full, step = ref["logits_full"][-1], ref["step_logits"][0]
    diff = mx.abs(full - step).max().item()
    scale = max(1.0, mx.abs(full).max().item())
    tol = SELF_CHECK_TOL[activation_dtype(model)]
    if not diff <= tol * scale:
        raise RuntimeError(
            f"{model_dir}: cached and uncached prompt logits differ by {diff:.3g} "
            f"(max |logit| {scale:.3g}, tolerance {tol} relative)"
        )
    return diff / scale


def greedy_margin(ref: dict[str, mx.array]) -> float:
    """The smallest gap between the best and second-best logit over the
    greedy steps: numeric noise above it may change the greedy tokens."""
    top2 = mx.sort(ref["step_logits"], axis=-1)[:, -2:]
    return float(f"{(top2[:, 1] - top2[:, 0]).min().item():.3g}")


def summarize(name: str, params: int, ref: dict[str, mx.array]) -> None:
    greedy = ref["greedy"].tolist()
    print(
        f"{name:<22} params={params:>9,}  P={ref['prompt'].size:<3} "
        f"distinct={len(set(greedy)):>2}  margin={greedy_margin(ref):<7} greedy={greedy[:8]}",
        flush=True,
    )


def manifest_entry(
    name: str,
    arch: str,
    dtype: str,
    quant: Optional[dict],
    layout: str,
    path: str,
    notes: str,
    reference: Optional[str] = None,
    **extra,
) -> dict:
    return dict(
        name=name,
        arch=arch,
        dtype=dtype,
        quant=quant,
        layout=layout,
        path=path,
        reference=reference or f"{name}/reference.safetensors",
        notes=notes,
        **extra,
    )


def float32_entry(name: str, arch: str, layout: str, notes: str, **extra) -> dict:
    """``manifest_entry`` of an unquantized float32 checkpoint in DIR/<name>/."""
    return manifest_entry(name, arch, "float32", None, layout, name, notes, **extra)


def reference_facts(ref: dict[str, mx.array]) -> dict:
    """Manifest keys describing a reference: ``greedy_margin``."""
    return {"greedy_margin": greedy_margin(ref)}


# --------------------------------------------------------------------------
# MLX-layout fixtures
# --------------------------------------------------------------------------


@dataclass
class MlxSpec:
    """A random checkpoint in the MLX-community layout."""

    name: str
    config: Callable[[], dict]
    weights_key: str  # fixtures with the same key share their float32 weights
    dtype: str = "float32"
    bits: Optional[int] = None
    group_size: int = 64
    predicate: Optional[Callable] = None
    shards: int = 1
    notes: str = ""
    post_quant_config: Optional[Callable[[dict], None]] = None
    # A folder of spec files the model_type needs (none is built in).
    arch_dir: Optional[str] = None


def make_mlx_fixture(out: Path, spec: MlxSpec) -> dict:
    cfg = spec.config()
    model = random_model(cfg, seed_for(spec.weights_key))
    params = get_total_parameters(model)
    if spec.dtype != "float32":
        cast_model(model, getattr(mx, spec.dtype))
    quant = None
    if spec.bits is not None:
        model, cfg = quantize(model, cfg, spec.bits, spec.group_size, spec.predicate)
        if spec.post_quant_config is not None:
            spec.post_quant_config(cfg)
        quant = {"bits": spec.bits, "group_size": spec.group_size}

    path = reset_dir(out / spec.name)
    if spec.shards > 1:
        save_sharded(path, model, spec.shards)
    else:
        save_model(path, model)
    save_config(cfg, path / "config.json")

    prompt = random_prompt(text_config(cfg)["vocab_size"])
    ref = write_reference(path, prompt, path / "reference.safetensors")
    summarize(spec.name, params, ref)
    extra = {"arch_dir": spec.arch_dir} if spec.arch_dir else {}
    return manifest_entry(
        spec.name, cfg["model_type"], spec.dtype, quant, "mlx", spec.name, spec.notes, **extra, **reference_facts(ref)
    )


def make_mix_fixture(out: Path) -> dict:
    """``hybrid_mix``: a hybrid served by a spec file only
    (``examples/specs/hybrid_mix.toml``), against a reference composed of
    mlx-lm's Qwen3-Next and NemotronH layer modules (``mix_ref.py``)."""
    name = "hybrid_mix-f32"
    cfg = hybrid_mix_config()
    model = mix_ref.MixModel(cfg)
    model.load_weights(random_parameters(model, seed_for(name)), strict=True)
    mx.eval(model.parameters())
    path = reset_dir(out / name)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    # The reference reads the checkpoint back from disk, strictly.
    ref_model = mix_ref.MixModel(json.loads((path / "config.json").read_text()))
    ref_model.load_weights(str(path / "model.safetensors"), strict=True)
    prompt = random_prompt(cfg["vocab_size"])
    ref = write_reference(path, prompt, path / "reference.safetensors", model=ref_model)
    summarize(name, get_total_parameters(ref_model), ref)
    return float32_entry(
        name,
        cfg["model_type"],
        "mlx",
        "a new mix no Rust knows (G M A G M A: Gated DeltaNet, Mamba2, gated attention; MoE on layers 3 and 5), "
        "served by examples/specs/hybrid_mix.toml; reference: mlx-lm's Qwen3NextDecoderLayer and NemotronHBlock "
        "composed in xtask/py/mix_ref.py",
        arch_dir="examples/specs",
        **reference_facts(ref),
    )


def mixed_quant_predicate(path: str, module: nn.Module):
    """Per-layer overrides: layer 1's MLP at 8 bits, layer 2's q_proj at group
    32, lm_head and layer 0's v_proj left unquantized."""
    if path in ("lm_head", "model.layers.0.self_attn.v_proj"):
        return False
    if path.startswith("model.layers.1.mlp."):
        return {"group_size": 64, "bits": 8}
    if path == "model.layers.2.self_attn.q_proj":
        return {"group_size": 32, "bits": 4}
    return True


def record_unquantized_lm_head(cfg: dict) -> None:
    """quantize_model records only dict overrides; write ``lm_head: false``
    explicitly (load_model honours it). Layer 0's v_proj is left unrecorded:
    load_model also skips layers without ``.scales``."""
    cfg["quantization"]["lm_head"] = False


def mlx_specs() -> list[MlxSpec]:
    specs = []
    for arch, config in ARCH_CONFIGS.items():
        bf16 = MlxSpec(f"{arch}-bf16", config, arch, dtype="bfloat16")
        if arch == "nemotron_h":
            # MLX's CPU GatherMM (unquantized SwitchMLP experts) runs only in
            # float32, so mlx-lm cannot run a bfloat16 MoE layer on the CPU.
            bf16 = MlxSpec(
                "nemotron_h-bf16",
                lambda: nemotron_h_config("M-*-M*"),
                "nemotron_h_dense",
                dtype="bfloat16",
                notes="pattern M-*-M* (no E layer): MLX's CPU gather_mm supports only float32",
            )
        specs += [
            MlxSpec(f"{arch}-f32", config, arch),
            bf16,
            MlxSpec(
                f"{arch}-q4",
                config,
                arch,
                dtype="bfloat16",
                bits=4,
                notes="4-bit affine, group 64, quantized from the bfloat16 model: scales, biases and "
                "unquantized tensors are bfloat16 except those the model's cast_predicate keeps float32",
            ),
        ]

    specs += [
        MlxSpec("qwen3_moe-f32", qwen3_moe_config, "qwen3_moe", notes="4 experts top-2; layer 0 dense (mlp_only_layers)"),
        MlxSpec(
            "qwen3_moe-q4",
            qwen3_moe_config,
            "qwen3_moe",
            bits=4,
            notes="from float32; router mlp.gate at 8 bits (model quant_predicate)",
        ),
        MlxSpec(
            "qwen3_5_moe-f32",
            lambda: qwen3_5_config(moe=True),
            "qwen3_5_moe",
            notes="4 experts top-2 + shared expert in every layer",
        ),
        MlxSpec(
            "qwen2_moe-f32",
            qwen2_moe_config,
            "qwen2_moe",
            notes="4 experts top-2 + gated shared expert; served by examples/specs/qwen2_moe.toml (extends qwen2)",
            arch_dir="examples/specs",
        ),
        MlxSpec(
            "stablelm-f32",
            stablelm_config,
            "stablelm",
            notes="LayerNorm with biases (the one built-in without RMS norm), partial rotary 0.25, q/k/v biases",
        ),
        MlxSpec(
            "stablelm-bf16",
            stablelm_config,
            "stablelm",
            dtype="bfloat16",
            notes="bfloat16; mlx-lm computes StableLM's attention with float32 queries and keys",
        ),
        MlxSpec("olmo2-f32", olmo2_config, "olmo2", notes="post-norm blocks, full-width q/k norms"),
        MlxSpec("olmo3-f32", olmo3_config, "olmo3", notes="olmo2 blocks; layers 0-2 sliding window 8, layer 3 full"),
        MlxSpec("granite-f32", granite_config, "granite", notes="embedding x2, attention scale 1/8, residual x0.5, logits / 4"),
        MlxSpec("granite-bf16", granite_config, "granite", dtype="bfloat16", notes="bfloat16: the multipliers applied in the activations' dtype"),
        MlxSpec("smollm3-f32", smollm3_config, "smollm3", notes="no RoPE on layers 1 and 3"),
        MlxSpec("phi3-f32", phi3_config, "phi3", notes="fused qkv_proj / gate_up_proj, partial rotary 0.5"),
        MlxSpec(
            "mistral-f32",
            lambda: dict(llama_config(tie=False), model_type="mistral"),
            "mistral",
            notes="model_type mistral: mlx-lm runs it with llama.py, mlex with the llama spec (also)",
        ),
        MlxSpec(
            "qwen3_next-moe-f32",
            lambda: qwen3_next_config(moe=True),
            "qwen3_next_moe",
            notes="4 experts top-2 + shared expert; decoder_sparse_step=2 (layers 1,3 sparse)",
        ),
    ]

    llama = "llama"
    for bits in (2, 3, 5, 6, 8):
        specs.append(
            MlxSpec(f"llama-q{bits}", llama_config, llama, bits=bits, notes=f"{bits}-bit affine, group 64, from float32")
        )
    def wide():
        return llama_config(WIDE)

    specs += [
        MlxSpec("llama-q4-g32", wide, "llama_wide", bits=4, group_size=32, notes="hidden 128; 4-bit group 32 from float32"),
        MlxSpec("llama-q4-g128", wide, "llama_wide", bits=4, group_size=128, notes="hidden 128; 4-bit group 128 from float32"),
        MlxSpec(
            "llama-mixed",
            lambda: llama_config(tie=False),
            "llama_untied",
            bits=4,
            predicate=mixed_quant_predicate,
            post_quant_config=record_unquantized_lm_head,
            notes="4-bit group 64 default with per-layer overrides in config quantization: "
            "model.layers.1.mlp.* 8-bit, model.layers.2.self_attn.q_proj group 32, "
            "lm_head false (recorded), model.layers.0.self_attn.v_proj unquantized (not recorded, no .scales)",
        ),
        MlxSpec("llama-f16", llama_config, llama, dtype="float16"),
        MlxSpec("llama-f32-sharded", llama_config, llama, shards=3, notes="llama-f32's weights in 3 shards"),
    ]
    return specs


# --------------------------------------------------------------------------
# Hugging Face layout fixtures: the inverse of mlx-lm's sanitize
# --------------------------------------------------------------------------

# Norm weights that Qwen3-Next / Qwen3.5 checkpoints store as (w - 1).
QWEN_OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def conv_to_torch(w: mx.array) -> mx.array:
    """MLX depthwise conv1d weight [C, K, 1] -> PyTorch [C, 1, K]."""
    return w.moveaxis(1, 2)


def unstack_experts(weights: dict, prefix: str, names: dict[str, str]) -> None:
    """Split stacked ``{prefix}.switch_mlp.<mlx>.weight`` [E, ...] into
    per-expert ``{prefix}.experts.<e>.<hf>.weight``."""
    for mlx_name, hf_name in names.items():
        stacked = weights.pop(f"{prefix}.switch_mlp.{mlx_name}.weight")
        for e in range(stacked.shape[0]):
            weights[f"{prefix}.experts.{e}.{hf_name}.weight"] = stacked[e]


def mtp_tensors(rng: np.random.Generator, hidden: int) -> dict[str, mx.array]:
    """A few multi-token-prediction tensors, which sanitize must drop."""
    return {
        "mtp.fc.weight": mx.array(rng.standard_normal((hidden, 2 * hidden)).astype(np.float32)),
        "mtp.norm.weight": mx.array(rng.standard_normal(hidden).astype(np.float32)),
    }


def hf_llama(weights: dict, cfg: dict, rng) -> dict:
    out = dict(weights)
    head_dim = cfg["head_dim"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim))
    for i in range(cfg["num_hidden_layers"]):
        out[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = mx.array(inv_freq.astype(np.float32))
    out["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return out


def qwen_hf_tensor(key: str, value: mx.array) -> mx.array:
    """How Qwen3-Next / Qwen3.5 HF checkpoints store an MLX tensor: conv1d
    in PyTorch order, the RMSNorms of QWEN_OFFSET_NORMS as (w - 1)."""
    if "conv1d.weight" in key:
        return conv_to_torch(value)
    if key.endswith(QWEN_OFFSET_NORMS) and value.ndim == 1:
        return value - 1.0
    return value


def hf_qwen3_5(weights: dict, cfg: dict, rng) -> dict:
    out = {
        k.replace("language_model.model.", "model.language_model.", 1): qwen_hf_tensor(k, v)
        for k, v in weights.items()
    }
    out.update(mtp_tensors(rng, text_config(cfg)["hidden_size"]))
    out["model.visual.patch_embed.proj.weight"] = mx.zeros((8, 3, 2, 2))
    return out


def hf_nemotron_h(weights: dict, cfg: dict, rng) -> dict:
    out = {k: conv_to_torch(v) if "conv1d.weight" in k else v for k, v in weights.items()}
    for i, block in enumerate(cfg["hybrid_override_pattern"]):
        if block == "E":
            unstack_experts(out, f"backbone.layers.{i}.mixer", {"fc1": "up_proj", "fc2": "down_proj"})
    out.update(mtp_tensors(rng, cfg["hidden_size"]))
    return out


def hf_qwen3_next(weights: dict, cfg: dict, rng) -> dict:
    out = {k: qwen_hf_tensor(k, v) for k, v in weights.items()}
    for i in range(cfg["num_hidden_layers"]):
        if f"model.layers.{i}.mlp.switch_mlp.up_proj.weight" in out:
            unstack_experts(
                out,
                f"model.layers.{i}.mlp",
                {n: n for n in ("gate_proj", "up_proj", "down_proj")},
            )
    out.update(mtp_tensors(rng, cfg["hidden_size"]))
    return out


@dataclass
class HfSpec:
    name: str
    twin: str
    to_hf: Callable[[dict, dict, np.random.Generator], dict]
    architecture: str
    notes: str


HF_SPECS = [
    HfSpec(
        "llama-hf",
        "llama-f32",
        hf_llama,
        "LlamaForCausalLM",
        "llama-f32 in HF layout: extra self_attn.rotary_emb.inv_freq per layer, tied lm_head.weight present",
    ),
    HfSpec(
        "qwen3_5-hf",
        "qwen3_5-f32",
        hf_qwen3_5,
        "Qwen3_5ForConditionalGeneration",
        "qwen3_5-f32 in HF layout: keys model.language_model.*, conv1d [C,1,K], "
        "input/post_attention/q/k/final norms stored as w-1, mtp.* and model.visual.* extras. "
        "No lm_head.weight: mlx-lm 0.32.2 prefixes it to language_model.lm_head.weight before its "
        "tied-embedding pop('lm_head.weight'), so a tied checkpoint carrying one fails strict loading",
    ),
    HfSpec(
        "nemotron_h-hf",
        "nemotron_h-f32",
        hf_nemotron_h,
        "NemotronHForCausalLM",
        "nemotron_h-f32 in HF layout: conv1d [C,1,K], per-expert mixer.experts.E.{up,down}_proj, mtp.* extras",
    ),
    HfSpec(
        "qwen3_next-moe-hf",
        "qwen3_next-moe-f32",
        hf_qwen3_next,
        "Qwen3NextForCausalLM",
        "qwen3_next-moe-f32 in HF layout: per-expert mlp.experts.E.{gate,up,down}_proj, conv1d [C,1,K], "
        "input/post_attention/q/k/final norms stored as w-1, mtp.* extras",
    ),
]


def make_hf_fixture(out: Path, spec: HfSpec) -> dict:
    twin_dir = out / spec.twin
    with open(twin_dir / "config.json") as f:
        cfg = json.load(f)
    cfg["architectures"] = [spec.architecture]
    cfg["torch_dtype"] = "float32"
    weights = spec.to_hf(load_weight_files(twin_dir), cfg, np.random.default_rng(seed_for(spec.name)))

    path = reset_dir(out / spec.name)
    mx.save_safetensors(str(path / "model.safetensors"), dict(sorted(weights.items())), metadata={"format": "pt"})
    with open(path / "config.json", "w") as f:
        json.dump(dict(sorted(cfg.items())), f, indent=4)

    twin_ref = mx.load(str(twin_dir / "reference.safetensors"))
    prompt = np.array(twin_ref["prompt"])
    ref = write_reference(path, prompt, path / "reference.safetensors")
    diff = mx.abs(ref["logits_full"] - twin_ref["logits_full"]).max().item()
    if diff >= HF_TWIN_TOLERANCE or ref["greedy"].tolist() != twin_ref["greedy"].tolist():
        raise RuntimeError(f"{spec.name}: differs from {spec.twin} by {diff}")
    params = sum(v.size for v in weights.values())
    summarize(spec.name, params, ref)
    return float32_entry(
        spec.name,
        cfg["model_type"],
        "hf",
        f"{spec.notes}; max |logits - twin| = {diff:.2e}",
        **reference_facts(ref),
    )


# --------------------------------------------------------------------------
# GGUF (llama family)
# --------------------------------------------------------------------------

GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}

# mlx-lm model_type -> llama.cpp's general.architecture.
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "granite": "granite"}
# The families whose q/k rows llama.cpp's converter interleaves (its
# LlamaModel.permute; GraniteModel is a LlamaModel).
GGUF_PERMUTED = ("llama", "granite")
# Granite's multipliers: config key -> metadata key after `granite.`.
GGUF_GRANITE_SCALES = {
    "embedding_multiplier": "embedding_scale",
    "attention_multiplier": "attention.scale",
    "residual_multiplier": "residual_scale",
    "logits_scaling": "logit_scale",
}
GGUF_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def mlx_to_gguf_name(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``."""
    module, suffix = name.rsplit(".", 1)
    if module in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[module]}.{suffix}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    return f"blk.{m[1]}.{GGUF_LAYER_NAMES[m[2]]}.{suffix}"


def gguf_to_mlx_name(name: str) -> str:
    """``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``."""
    module, suffix = name.rsplit(".", 1)
    for mlx_name, gguf_name in GGUF_GLOBAL_NAMES.items():
        if module == gguf_name:
            return f"{mlx_name}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", module)
    layer = {v: k for k, v in GGUF_LAYER_NAMES.items()}[m[2]]
    return f"model.layers.{m[1]}.{layer}.{suffix}"


def permute_qk(w, n_head: int):
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rows -> llama.cpp rows):
    within each head, row i*(d/2)+j moves to row 2j+i (halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w, n_head: int):
    """Inverse of ``permute_qk`` (llama.cpp rows -> HF rows)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def qk_heads(name: str, n_head: int, n_head_kv: int) -> Optional[int]:
    """Heads to (un)permute the rows of a q/k tensor by; None for others."""
    if ".attn_q." in name or ".self_attn.q_proj." in name:
        return n_head
    if ".attn_k." in name or ".self_attn.k_proj." in name:
        return n_head_kv
    return None


def gguf_llama_config(gguf_path: Path) -> tuple[dict, dict[str, mx.array], dict]:
    """Read a llama GGUF with MLX; return the mlx-lm config (without
    quantization), the raw tensors and the metadata."""
    tensors, meta = mx.load(str(gguf_path), return_metadata=True)
    if meta["general.architecture"] != "llama":
        raise ValueError(f"{gguf_path}: not a llama GGUF")

    def num(key):
        return meta[f"llama.{key}"].item()

    hidden, n_head = num("embedding_length"), num("attention.head_count")
    cfg = dict(
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=num("feed_forward_length"),
        num_hidden_layers=num("block_count"),
        num_attention_heads=n_head,
        num_key_value_heads=num("attention.head_count_kv"),
        head_dim=hidden // n_head,
        vocab_size=num("vocab_size") if "llama.vocab_size" in meta else len(meta["tokenizer.ggml.tokens"]),
        max_position_embeddings=num("context_length"),
        # GGUF stores float32: write the shortest decimal that rounds back to it.
        rms_norm_eps=float(str(np.float32(num("attention.layer_norm_rms_epsilon")))),
        rope_theta=float(str(np.float32(num("rope.freq_base")))),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings="output.weight" not in tensors,
    )
    return cfg, tensors, meta


def export_gguf_llama(gguf_path: Path, out_dir: Path) -> dict:
    """Export a llama GGUF, as MLX reads it, to an MLX-community checkpoint.

    mx.load returns Q4_0/Q4_1/Q8_0 tensors as MLX affine triples
    ``weight``/``scales``/``biases``; names are mapped to mlx-lm's and the q/k
    rows (of weight, scales and biases alike) un-permuted. Bits and group
    size are inferred from the shapes: the most common pair becomes
    ``quantization``'s default, others are recorded per layer (llama.cpp's
    Q4_1 files keep token_embd at Q8_0).
    """
    cfg, tensors, _ = gguf_llama_config(gguf_path)
    n_head, n_head_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    in_dims = {"ffn_down": cfg["intermediate_size"], "attn_output": n_head * cfg["head_dim"]}
    weights, formats = {}, {}
    for name, value in tensors.items():
        heads = qk_heads(name, n_head, n_head_kv)
        if heads is not None:
            value = unpermute_qk(value, heads)
        weights[gguf_to_mlx_name(name)] = value
        if name.endswith(".scales"):
            module = name.rsplit(".", 1)[0]
            width = in_dims.get(module.split(".")[-1], cfg["hidden_size"])
            bits = tensors[f"{module}.weight"].shape[-1] * 32 // width
            formats[gguf_to_mlx_name(name).rsplit(".", 1)[0]] = (bits, width // value.shape[-1])
    if formats:
        counts = Counter(formats.values())
        bits, group_size = max(sorted(counts), key=counts.get)
        cfg["quantization"] = {"group_size": group_size, "bits": bits}
        for module, (b, g) in sorted(formats.items()):
            if (b, g) != (bits, group_size):
                cfg["quantization"][module] = {"group_size": g, "bits": b}

    path = reset_dir(out_dir)
    mx.save_safetensors(str(path / "model.safetensors"), dict(sorted(weights.items())), metadata={"format": "mlx"})
    save_config(copy.deepcopy(cfg), path / "config.json")
    return cfg


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_gpt2_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A minimal byte-level BPE vocabulary of exactly ``vocab_size`` tokens:
    3 control tokens, the 188 printable byte characters and 'Ġ' (space), and
    64 merges of the letters 'etaoinsh'."""
    alphabet = bytes_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    singles = [c for c in alphabet if ord(c) < 256] + [alphabet[ord(" ")]]
    merges = [f"{a} {b}" for a in "etaoinsh" for b in "etaoinsh"]
    tokens = specials + singles + [m.replace(" ", "") for m in merges]
    assert len(tokens) == vocab_size and len(set(tokens)) == vocab_size
    types = [int(gguf.TokenType.CONTROL)] * len(specials) + [int(gguf.TokenType.NORMAL)] * (vocab_size - len(specials))
    return tokens, types, merges


def add_gpt2_vocab(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """``tiny_gpt2_vocab(vocab_size)`` as a GGUF's ``gpt2`` tokenizer."""
    tokens, types, merges = tiny_gpt2_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)


SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "A tokenizer splits text into pieces; the pieces are found in the vocabulary.",
    "Sentence pieces mark the start of a word with a special underscore character.",
    "Numbers like 12345 and 2026 are split too, and so is punctuation: ?!,;.",
    "Hybrid models mix attention layers with state space layers and linear attention.",
] * 4


def tiny_spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece-style vocabulary as llama.cpp writes one (`llama`
    tokenizer model): <unk>, <s>, </s>, the 256 byte-fallback tokens, then
    pieces learned by the `tokenizers` SentencePiece BPE trainer from a small
    corpus, scored by merge rank (no merges are stored: readers recover them
    from the scores)."""
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(SPM_CORPUS, vocab_size=400, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    learned = sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])
    pieces = [t for t, _ in learned if t not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    T = gguf.TokenType
    types = [int(T.UNKNOWN), int(T.CONTROL), int(T.CONTROL)] + [int(T.BYTE)] * 256 + [int(T.NORMAL)] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    assert len(set(tokens)) == len(tokens)
    return tokens, types, scores


SPM_TEXTS = [
    "The quick brown fox",
    "  leading spaces and trailing ",
    "Grüße, 東京! naïve café 🌍",
    "line one\nline two\tand a tab",
    "<s> a control token in text </s>",
    "tokenizer pieces 12345",
]


def write_spm_reference(gguf_file: Path, out: Path) -> None:
    """transformers' own GGUF tokenizer builder (the reference) on SPM_TEXTS.
    Its file reader needs torch, so the metadata comes from the gguf package
    and goes through transformers' key mapping and `convert_gguf_tokenizer`."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    reader = gguf.GGUFReader(str(gguf_file))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items() if f"tokenizer.{key}" in meta
    }
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    # transformers' default for a sentencepiece GGUF that has no flag: BOS on.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    bos = meta["tokenizer.ggml.bos_token_id"]
    cases = []
    for text in SPM_TEXTS:
        ids = ([bos] if add_bos else []) + backend.encode(text, add_special_tokens=False).ids
        cases.append({"text": text, "ids": ids, "decoded": backend.decode(ids, skip_special_tokens=True)})
    out.write_text(json.dumps({"add_bos": add_bos, "cases": cases}, indent=1, ensure_ascii=False))


GGUF_TYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "q4_k": (gguf.GGMLQuantizationType.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k": (gguf.GGMLQuantizationType.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M),
    "q6_k": (gguf.GGMLQuantizationType.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
}

K_QUANTS = ("q4_k", "q5_k", "q6_k")

# K-quant rows are super-blocks of 256: every projection's input is a
# multiple of 256 here.
K_DIMS = dict(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=16, num_key_value_heads=4)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes of eight 6-bit scales and mins (the inverse of
    llama.cpp's get_scale_min_k4), per super-block: sc, m are [n, 8]."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _quantize_k_affine(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits=4) or Q5_K (bits=5) blocks of a float32 matrix [rows, cols]:
    per 32-element sub-block w = d*sc*q - dmin*m, with sc, m 6-bit and d, dmin
    float16 per 256. A plain min/max fit, not llama.cpp's search: the
    reference is whatever the gguf package dequantizes these bytes to."""
    levels = (1 << bits) - 1
    rows, cols = x.shape
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    hi = sub.max(axis=2)
    scale = (hi - lo) / levels
    minv = -lo
    d = _f16(np.maximum(scale.max(axis=1), 1e-8) / 63.0)
    dmin = _f16(np.maximum(minv.max(axis=1), 1e-8) / 63.0)
    sc = np.clip(np.round(scale / d.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(minv / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[:, :, None]
    off = (dmin.astype(np.float32)[:, None] * m)[:, :, None]
    q = np.clip(np.round((sub + off) / step), 0, levels).astype(np.uint8)  # [n, 8, 32]
    n = sub.shape[0]
    low = q & 0xF
    qs = (low[:, 0::2, :] | (low[:, 1::2, :] << 4)).reshape(n, 128)
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _pack_k4_scales(sc, m)]
    if bits == 5:
        high = (q >> 4) & 1  # [n, 8, 32]
        qh = np.zeros((n, 32), dtype=np.uint8)
        for j in range(8):
            qh |= (high[:, j, :] << j).astype(np.uint8)
        parts.append(qh)
    parts.append(qs.astype(np.uint8))
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks: per 16-element sub-block w = d*sc*(q-32), sc int8 and d
    float16 per 256."""
    rows, cols = x.shape
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    n = sub.shape[0]
    amax = np.abs(sub).max(axis=2)
    scale = amax / 31.0
    d = _f16(np.maximum(scale.max(axis=1), 1e-8) / 127.0)
    sc = np.clip(np.round(scale / d.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc.astype(np.float32))[:, :, None]
    q = (np.clip(np.round(sub / step), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    ql = np.zeros((n, 128), dtype=np.uint8)
    qh = np.zeros((n, 64), dtype=np.uint8)
    for h in range(2):
        y = q[:, h * 128:(h + 1) * 128]
        q1, q2, q3, q4 = y[:, 0:32], y[:, 32:64], y[:, 64:96], y[:, 96:128]
        ql[:, h * 64:h * 64 + 32] = (q1 & 0xF) | ((q3 & 0xF) << 4)
        ql[:, h * 64 + 32:h * 64 + 64] = (q2 & 0xF) | ((q4 & 0xF) << 4)
        qh[:, h * 32:h * 32 + 32] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    return np.concatenate(
        [ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1
    ).reshape(rows, -1)


def quantize_k(x: np.ndarray, kind: str) -> np.ndarray:
    """K-quant bytes of ``x`` (the gguf package only dequantizes these)."""
    raw = {"q4_k": lambda v: _quantize_k_affine(v, 4), "q5_k": lambda v: _quantize_k_affine(v, 5), "q6_k": _quantize_q6_k}[kind](x)
    back = gguf.quants.dequantize(raw, GGUF_TYPES[kind][0])
    err = np.abs(back - x).max() / max(np.abs(x).max(), 1e-8)
    if err > 0.2:
        raise RuntimeError(f"{kind}: the encoding does not round-trip through gguf's dequantize (relative error {err:.3g})")
    return raw


def write_llama_gguf(path: Path, cfg: dict, weights: dict[str, np.ndarray], kind: str, vocab: str = "gpt2") -> None:
    """Write mlx-lm weights as llama.cpp would: GGUF names, q/k rows
    permuted (llama only: its converter leaves Qwen's rows alone), 2-D and
    3-D (expert) tensors in ``kind``'s type and 1-D norms in F32."""
    qtype, file_type = GGUF_TYPES[kind]
    arch = GGUF_ARCH[cfg["model_type"]]
    permute = arch in GGUF_PERMUTED
    writer = gguf.GGUFWriter(str(path), arch)
    if arch == "granite":
        for key, meta_key in GGUF_GRANITE_SCALES.items():
            writer.add_float32(f"{arch}.{meta_key}", cfg[key])
    writer.add_name(f"mlex tiny {arch}")
    if "head_dim" in cfg:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if "num_experts" in cfg:
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]))
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if vocab == "spm":
        tokens, types, scores = tiny_spm_vocab()
        assert len(tokens) == cfg["vocab_size"], (len(tokens), cfg["vocab_size"])
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
    else:
        add_gpt2_vocab(writer, cfg["vocab_size"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if cfg.get("rope_scaling", {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))

    encode = (lambda v: quantize_k(v.astype(np.float32), kind)) if kind in K_QUANTS else None
    for name, value in weights.items():
        gname = mlx_to_gguf_name(name)
        heads = qk_heads(gname, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        if heads is not None and permute and value.ndim == 2:
            value = permute_qk(value, heads)
        ty = gguf.GGMLQuantizationType.F32 if value.ndim == 1 else qtype
        gguf_hybrid.add_tensor(writer, gname, value, ty, encode)
    gguf_hybrid.write_out(writer)


def dequantized_gguf_weights(path: Path, cfg: dict) -> dict[str, mx.array]:
    """Read a GGUF with the gguf package, dequantize to float32, map to
    mlx-lm names and un-permute q/k."""
    weights = {}
    permute = GGUF_ARCH[cfg["model_type"]] in GGUF_PERMUTED
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == "rope_freqs.weight":
            continue  # becomes the config's rope_scaling, not a weight
        value = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        heads = qk_heads(t.name, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        if heads is not None and permute and value.ndim == 2:
            value = unpermute_qk(value, heads)
        weights[gguf_to_mlx_name(t.name)] = mx.array(value)
    return weights


def check_mlx_reads_gguf(path: Path, dequantized: dict[str, mx.array], cfg: dict, quant: Optional[dict]) -> None:
    """mx.load must return every tensor, and its affine triples must
    dequantize (with float32 scales) to the gguf package's float32 values."""
    tensors = mx.load(str(path))
    for name, ref in dequantized.items():
        gname = mlx_to_gguf_name(name)
        value = tensors[gname]
        base = gname.rsplit(".", 1)[0]
        if f"{base}.scales" in tensors:
            value = mx.dequantize(
                value,
                tensors[f"{base}.scales"].astype(mx.float32),
                tensors[f"{base}.biases"].astype(mx.float32),
                group_size=quant["group_size"],
                bits=quant["bits"],
            )
        heads = qk_heads(gname, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        if heads is not None:
            value = unpermute_qk(value, heads)
        err = mx.abs(value.astype(mx.float32) - ref).max().item()
        if err > 1e-6:
            raise RuntimeError(f"{path}: mx.load's {gname} differs from gguf's by {err}")


GGUF_FAMILY_CONFIGS = {"qwen2": qwen2_config, "qwen3": qwen3_config, "qwen3_moe": qwen3_moe_config, "granite": granite_config}


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny head's 8 frequencies fall in all three bands.
    "original_max_position_embeddings": 64,
}


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """`rope_freqs.weight` as llama.cpp's converter derives it from a llama3
    `rope_scaling` (the angle of pair i is divided by factor i)."""
    sc = cfg["rope_scaling"]
    base = cfg["rope_theta"]
    dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    out = []
    for f in inv:
        wav = 2 * math.pi / f
        if wav < old / high:
            out.append(1.0)
        elif wav > old / low:
            out.append(factor)
        else:
            smooth = (old / wav - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def make_gguf_fixture(out: Path, kind: str, family: str = "llama", vocab: str = "gpt2", rope: str = "default") -> dict:
    """A tiny GGUF of ``family`` (llama.cpp's names and layout), its
    dequantized float32 twin in MLX layout (the reference), and the logit
    distance of mlx-lm on mx.load's tensors."""
    name = f"gguf-{kind}" if family == "llama" else f"gguf-{family}-{kind}"
    if vocab != "gpt2":
        name = f"gguf-{family}-{vocab}-{kind}"
    if rope != "default":
        name = f"gguf-{family}-{rope}-{kind}"
    if family == "llama":
        cfg = llama_config(K_DIMS if kind in K_QUANTS else TINY, tie=False)
    else:
        cfg = GGUF_FAMILY_CONFIGS[family]()
    if vocab == "spm":
        cfg["vocab_size"] = len(tiny_spm_vocab()[0])
    if rope == "llama3":
        cfg["rope_scaling"] = dict(LLAMA3_ROPE)
    cfg["rms_norm_eps"] = 1e-5
    model = random_model(cfg, seed_for(f"gguf_{family}"))
    params = get_total_parameters(model)
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}

    path = reset_dir(out / name)
    gguf_file = path / "model.gguf"
    write_llama_gguf(gguf_file, cfg, weights, kind, vocab)
    if vocab == "spm":
        write_spm_reference(gguf_file, path / "tokenizer_reference.json")

    quant = {"bits": int(kind[1]), "group_size": 32} if kind.startswith("q") and kind != "q6_k" else None
    dequantized = dequantized_gguf_weights(gguf_file, cfg)
    if kind == "f32" and any(not np.array_equal(weights[k], dequantized[k]) for k in weights):
        raise RuntimeError(f"{gguf_file}: names or q/k permutation do not round-trip")
    mlx_readable = kind not in K_QUANTS and family == "llama" and vocab == "gpt2" and rope == "default"
    if mlx_readable:
        # mx.load reads Q4_K and Q6_K only as float16 and fails on Q5_K, and
        # the export below knows only llama: mlex reads GGUF itself.
        check_mlx_reads_gguf(gguf_file, dequantized, cfg, quant)
    deq_model = build_model(cfg)
    deq_model.load_weights(list(dequantized.items()), strict=True)
    deq_dir = path / "dequantized"
    deq_dir.mkdir()
    save_model(deq_dir, deq_model)
    save_config(copy.deepcopy(cfg), deq_dir / "config.json")

    prompt = random_prompt(cfg["vocab_size"])
    ref = write_reference(deq_dir, prompt, path / "reference.safetensors")
    if not mlx_readable:
        # What mlex stores: Q4_K/Q5_K/Q8_0 exactly (float32 or exact float16
        # scales), Q6_K rounded to float16 once.
        stored = {k: (v.astype(mx.float16).astype(mx.float32) if kind == "q6_k" and v.ndim == 2 else v) for k, v in dequantized.items()}
        other_model = build_model(cfg)
        other_model.load_weights(list(stored.items()), strict=True)
        other = run_reference(other_model, prompt)
        tolerance = float(f"{mx.abs(other['logits_full'] - ref['logits_full']).max().item():.3g}")
    else:
        tolerance = mlx_gguf_distance(gguf_file, prompt, ref)
    summarize(name, params, ref)
    return manifest_entry(
        name,
        cfg["model_type"],
        {"f16": "float16"}.get(kind, "float32"),
        quant,
        "gguf",
        f"{name}/model.gguf",
        f"llama.cpp naming{' and q/k permutation' if GGUF_ARCH[cfg['model_type']] in GGUF_PERMUTED else ''}, {kind.upper()} 2-D/3-D tensors, F32 norms. "
        f"Reference: mlx-lm on the gguf package's float32 dequantization ({name}/dequantized, un-permuted). "
        "tolerance_hint: max |logit| difference to mlx-lm on the MLX checkpoint built from mx.load's tensors "
        "(for quantized files it comes from QuantizedEmbedding returning float16, the scales' dtype)",
        tolerance_hint=tolerance,
        **reference_facts(ref),
    )


def hf_qwen3_5_moe(weights: dict, cfg: dict, rng) -> dict:
    """Qwen3.5-MoE in HF layout: hf_qwen3_5 plus the fused experts
    ``experts.gate_up_proj`` [E, 2F, H] (gate first) and ``experts.down_proj``."""
    out = hf_qwen3_5(weights, cfg, rng)
    for k in [k for k in out if k.endswith(".mlp.switch_mlp.gate_proj.weight")]:
        base = k[: -len(".switch_mlp.gate_proj.weight")]
        gate = out.pop(k)
        up = out.pop(f"{base}.switch_mlp.up_proj.weight")
        out[f"{base}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        out[f"{base}.experts.down_proj"] = out.pop(f"{base}.switch_mlp.down_proj.weight")
    return out


def nemotron_h_dense_config() -> dict:
    """NemotronH without experts (Nemotron-H 8B's kind of pattern): llama.cpp's
    converter makes ``nemotron_h`` of it; with experts it makes
    ``nemotron_h_moe``, which has no dense MLP layers."""
    moe_keys = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group",
                "norm_topk_prob", "routed_scaling_factor", "n_shared_experts", "moe_shared_expert_intermediate_size")
    return {k: v for k, v in nemotron_h_config("M-*-M*").items() if k not in moe_keys}


def qwen3_5_moe_gguf_config() -> dict:
    cfg = qwen3_5_config(moe=True)
    cfg["text_config"].update(linear_key_head_dim=32, linear_value_head_dim=32)
    return cfg


def hybrid_k_config(family: str) -> dict:
    """The family's GGUF config with every quantized projection's input a
    multiple of 256 (K-quant super-blocks), heads of 64."""
    cfg = HYBRID_GGUF[family][0]()
    if family == "qwen3_5":
        cfg["text_config"].update(
            hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_key_head_dim=64, linear_value_head_dim=64,
        )
    else:
        cfg.update(
            hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            mamba_num_heads=4, mamba_head_dim=64, moe_intermediate_size=256, moe_shared_expert_intermediate_size=256,
        )
    return cfg


# GGUF family -> (config, mlx-lm -> HF layout). Qwen3-Next with every layer
# MoE (llama.cpp's qwen3next has no dense MLP layers and always renormalizes
# the top-k weights).
HYBRID_GGUF = {
    "qwen3_next": (lambda: {**qwen3_next_config(moe=True), "decoder_sparse_step": 1, "norm_topk_prob": True}, hf_qwen3_next),
    "qwen3_5": (qwen3_5_config, hf_qwen3_5),
    # Heads of 32 (llama.cpp assumes key and value heads of one width): the
    # value-head reorder of ssm_out then moves whole Q8_0 blocks, the path
    # real checkpoints (heads of 128) take.
    "qwen3_5_moe": (qwen3_5_moe_gguf_config, hf_qwen3_5_moe),
    "nemotron_h": (nemotron_h_dense_config, hf_nemotron_h),
    "nemotron_h_moe": (lambda: nemotron_h_config("ME*EM*"), hf_nemotron_h),
}


# mlx-lm modules that llama.cpp's converter always writes in F32 (routers,
# convolutions; norms and 1-D tensors are never quantized either).
HYBRID_F32_MODULES = re.compile(r"(\.mlp\.gate|shared_expert_gate|\.mixer\.gate|conv1d)\.weight$")


def q8_0_affine(value: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The MLX affine triple (8 bits, group 32) that holds ``value``'s Q8_0
    blocks exactly, as mlex stores them: codes q+128, scale d, bias -128 d,
    float16 like the file's d. None when ``value`` is not such blocks.
    A block's largest |v| is 127 d (gguf's encoder sets d = amax / 127)."""
    rows = value.reshape(-1, value.shape[-1])
    blocks = rows.reshape(rows.shape[0], -1, 32)
    d = (np.abs(blocks).max(axis=-1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)
    q = np.round(np.divide(blocks, d32[..., None], out=np.zeros_like(blocks), where=d32[..., None] != 0))
    if np.abs(q).max() > 127 or not np.array_equal(q * d32[..., None], blocks):
        return None
    codes = (q + 128).astype(np.uint32).reshape(rows.shape[0], -1, 4)
    packed = codes[..., 0] | (codes[..., 1] << 8) | (codes[..., 2] << 16) | (codes[..., 3] << 24)
    lead = value.shape[:-1]
    return (
        packed.reshape(*lead, -1),
        d.reshape(*lead, -1),
        (-128.0 * d32).astype(np.float16).reshape(*lead, -1),
    )


def make_hybrid_gguf_fixture(out: Path, family: str, kind: str, variant: str = "") -> dict:
    """A tiny hybrid GGUF in llama.cpp's layout (gguf_hybrid.hf_to_gguf on
    the HF layout of a random mlx-lm model). The reference is mlx-lm on the
    gguf package's dequantization mapped back (gguf_hybrid.gguf_to_mlx):
    float32 for an F32 file; for Q8_0, 8-bit affine layers that hold the
    file's blocks exactly in float16, the precision mlex computes such a
    file in (recurrent layers carry float16 rounding along the sequence, so
    a float32 reference would be a test of float16, not of the layout)."""
    name = f"gguf-{family}-{variant}-{kind}" if variant else f"gguf-{family}-{kind}"
    make_cfg, to_hf = HYBRID_GGUF[family]
    cfg = hybrid_k_config(family) if kind in K_QUANTS else make_cfg()
    model = random_model(cfg, seed_for(f"gguf_{family}"))
    params = get_total_parameters(model)
    weights = dict(tree_flatten(model.parameters()))
    hf = {k: np.array(v) for k, v in to_hf(dict(weights), cfg, np.random.default_rng(seed_for(name))).items()}
    mtp = None
    if variant == "mtp":
        # A whole random MTP block, written as llama.cpp's converter writes
        # one (blk.L, nextn.*); its reference composes mlx-lm's layer.
        layer, text = mtp_ref.decoder_layer(cfg)
        mtp = mtp_ref.Mtp(layer, text["hidden_size"], text["rms_norm_eps"])
        mtp.load_weights(random_parameters(mtp, seed_for(name)), strict=True)
        hf = {k: v for k, v in hf.items() if not k.startswith("mtp.")}
        hf.update({k: np.array(v) for k, v in mtp_ref.hf_mtp_weights(mtp, text.get("num_experts", 0) or 0).items()})

    # The two directions must undo each other before quantization enters.
    back = gguf_hybrid.gguf_to_mlx(cfg, dict(gguf_hybrid.hf_to_gguf(cfg, hf)))
    if sorted(back) != sorted(weights):
        raise RuntimeError(f"{name}: names do not round-trip: {sorted(set(back) ^ set(weights))}")
    for k, v in weights.items():
        if back[k].shape != v.shape or not np.allclose(back[k], np.array(v), rtol=1e-6, atol=1e-6):
            raise RuntimeError(f"{name}: {k} does not round-trip")

    path = reset_dir(out / name)
    gguf_file = path / "model.gguf"
    qtype, file_type = GGUF_TYPES[kind]
    vocab = text_config(cfg)["vocab_size"]

    def add_vocab(writer):
        add_gpt2_vocab(writer, vocab)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)

    encode = (lambda v: quantize_k(v.reshape(-1, v.shape[-1]), kind).reshape(*v.shape[:-1], -1)) if kind in K_QUANTS else None
    gguf_hybrid.write_hybrid_gguf(gguf_file, cfg, hf, qtype, file_type, add_vocab, variant=variant, encode=encode)
    # Files that are wrong in one metadata key, for the error tests.
    broken = {
        "nemotron_h": ("attention.head_count_kv", lambda w, a: w.add_array(f"{a}.attention.head_count_kv", [0, 0, 2])),
        "qwen3_5": ("ssm.time_step_rank", lambda w, a: w.add_ssm_time_step_rank(3)),
    }
    if family in broken and kind == "q8_0" and not variant:
        key, edit = broken[family]
        gguf_hybrid.write_hybrid_gguf(path / f"broken-{key}.gguf", cfg, hf, qtype, file_type, add_vocab, edit)
    dequantized = {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(n) for n in reversed(t.shape)])
        for t in gguf.GGUFReader(str(gguf_file)).tensors
    }
    mapped = gguf_hybrid.gguf_to_mlx(cfg, dequantized)
    ref_model = build_model(cfg)
    ref_cfg = copy.deepcopy(cfg)
    quant = None
    if kind == "q8_0":
        triples = {}
        for k, v in mapped.items():
            if k.endswith(".weight") and v.ndim >= 2 and not HYBRID_F32_MODULES.search(k):
                t = q8_0_affine(v)
                if t is not None:
                    triples[k[: -len(".weight")]] = t
                elif not k.endswith("linear_attn.out_proj.weight"):
                    # Only Qwen3.5's ssm_out, its value heads moved across
                    # 32-column blocks, may stop being Q8_0 blocks (mlex
                    # dequantizes it too).
                    raise RuntimeError(f"{name}: {k} is not Q8_0 blocks")
        ref_model, ref_cfg = quantize(ref_model, ref_cfg, 8, 32, lambda p, m: p in triples)
        arrays = {}
        for k, v in mapped.items():
            module = k[: -len(".weight")] if k.endswith(".weight") else None
            if module in triples:
                w, sc, b = triples[module]
                arrays[k] = mx.array(w)
                arrays[f"{module}.scales"] = mx.array(sc)
                arrays[f"{module}.biases"] = mx.array(b)
            else:
                arrays[k] = mx.array(v)
        ref_model.load_weights(list(arrays.items()), strict=True)
        quant = {"bits": 8, "group_size": 32}
    else:
        # F32, and the K-quants (Q4_K/Q5_K are exact affine with float32
        # scales in mlex, computed in float32).
        ref_model.load_weights([(k, mx.array(v)) for k, v in mapped.items()], strict=True)
        if kind in K_QUANTS:
            quant = {"bits": int(kind[1]), "group_size": 32}
    deq_dir = path / "dequantized"
    deq_dir.mkdir()
    save_model(deq_dir, ref_model)
    save_config(ref_cfg, deq_dir / "config.json")
    prompt = random_prompt(vocab)
    ref = write_reference(deq_dir, prompt, path / "reference.safetensors")
    extra = {}
    if mtp is not None:
        mtp_ref.write_mtp_reference(path, mtp, ref_model, prompt, text_config(cfg))
        extra["mtp_reference"] = f"{name}/mtp_reference.safetensors"
    summarize(name, params, ref)
    reference = (
        "mlx-lm on the gguf package's float32 dequantization mapped back"
        if kind != "q8_0"
        else "mlx-lm with 8-bit affine layers (group 32, float16 scales) holding the file's Q8_0 blocks, mapped back"
    )
    return manifest_entry(
        name,
        cfg["model_type"],
        "float16" if kind == "q8_0" else "float32",
        quant,
        "gguf",
        f"{name}/model.gguf",
        f"llama.cpp's {gguf_hybrid.gguf_arch(cfg)} layout (xtask/py/gguf_hybrid.py: offset norms +1, ssm_a = -exp(A_log), "
        "squeezed convs, split qkvz / tiled value heads / permuted q,k as the converter does), "
        f"{kind.upper()} 2-D/3-D tensors, F32 norms, routers and convs"
        + (f"; variant `{variant}` (see gguf_hybrid.VARIANTS)" if variant else "")
        + f". Reference: {reference} ({name}/dequantized)",
        **extra,
        **reference_facts(ref),
    )


def mlx_gguf_distance(gguf_file: Path, prompt: np.ndarray, ref: dict[str, mx.array]) -> float:
    """Max |logit| difference between the reference and mlx-lm run on the
    GGUF as mx.load returns it (exported like the SmolLM2 checkpoint)."""
    with tempfile.TemporaryDirectory() as tmp:
        export_gguf_llama(gguf_file, Path(tmp) / "affine")
        model, _ = load_model(Path(tmp) / "affine")
        other = run_reference(model, prompt)
    diff = mx.abs(other["logits_full"] - ref["logits_full"]).max().item()
    if other["greedy"].tolist() == ref["greedy"].tolist():
        diff = max(diff, mx.abs(other["step_logits"] - ref["step_logits"]).max().item())
    return float(f"{diff:.3g}")


# --------------------------------------------------------------------------
# SmolLM2-135M-Instruct (real weights, Q4_1 GGUF)
# --------------------------------------------------------------------------

SMOLLM2_QUESTION = "What is the capital of France?"


def gguf_tokenizer(meta: dict) -> Tokenizer:
    """The GGUF's byte-level BPE (tokenizer.ggml.model = gpt2, pre = smollm:
    single digits, then GPT-2's byte-level split) with its control tokens."""
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    types = np.array(meta["tokenizer.ggml.token_type"])
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty == gguf.TokenType.CONTROL])
    return tok


def chat_prompt(meta: dict, tok: Tokenizer, question: str) -> np.ndarray:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(meta["tokenizer.chat_template"]).render(
        messages=[{"role": "user", "content": question}], add_generation_prompt=True
    )
    return np.array(tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)


def make_smollm2_fixtures(out: Path, gguf_path: Path) -> list[dict]:
    """Export the GGUF to DIR/smollm2-export, prove the export right by asking
    it a question, and record the reference from the chat prompt's ids."""
    name = "smollm2-export"
    path = out / name
    cfg = export_gguf_llama(gguf_path, path)
    quant = cfg.get("quantization", {})
    if (quant.get("bits"), quant.get("group_size")) != (4, 32):
        raise RuntimeError(f"{gguf_path}: expected 4-bit group 32 from Q4_1, got {quant}")

    _, _, meta = gguf_llama_config(gguf_path)
    tok = gguf_tokenizer(meta)
    prompt = chat_prompt(meta, tok, SMOLLM2_QUESTION)
    eos = meta["tokenizer.ggml.eos_token_id"].item()

    ref = write_reference(path, prompt, path / "reference.safetensors")
    greedy = ref["greedy"].tolist()
    answer = tok.decode(greedy[: greedy.index(eos)] if eos in greedy else greedy)
    print(f"smollm2: {SMOLLM2_QUESTION!r} -> {answer!r}")
    if "Paris" not in answer:
        raise RuntimeError("SmolLM2 export does not answer Paris: the export is wrong")
    summarize(name, get_total_parameters(load_model(path)[0]), ref)

    notes = f"SmolLM2-135M-Instruct; prompt = chat template around {SMOLLM2_QUESTION!r}; greedy answer {answer!r}"
    return [
        manifest_entry(
            name,
            "llama",
            "float16",
            {"bits": 4, "group_size": 32},
            "mlx",
            name,
            f"MLX-community export of the GGUF as mx.load returns it: Q4_1 tensors 4-bit group 32, "
            f"token_embd (Q8_0) 8-bit group 32 as a per-layer override, f16 scales/biases, f32 norms, "
            f"q/k rows un-permuted, tied embeddings. {notes}",
            **reference_facts(ref),
        ),
        manifest_entry(
            "smollm2-gguf",
            "llama",
            "float16",
            {"bits": 4, "group_size": 32},
            "gguf",
            str(gguf_path.resolve()),
            f"The Q4_1 GGUF itself; same tokens expected as smollm2-export. {notes}",
            reference=f"{name}/reference.safetensors",
            **reference_facts(ref),
        ),
    ]


def make_chat_fixture(out: Path, gguf_path: Path) -> list[dict]:
    """A tiny Qwen3-shaped model (random f32 weights) with a real tokenizer
    and chat template, SmolLM2's, so servers and clients that need text can
    run on a model small enough to load-test on a laptop CPU. Writes
    tokenizer.json and tokenizer_config.json as Hugging Face does, so
    mlx-lm (through transformers) and mlex read the same files."""
    name = "qwen3-chat"
    _, _, meta = gguf_llama_config(gguf_path)
    tok = gguf_tokenizer(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    eos = int(meta["tokenizer.ggml.eos_token_id"].item())
    cfg = dict(qwen3_config(), vocab_size=len(tokens), eos_token_id=eos)
    model = random_model(cfg, seed_for(name))
    path = reset_dir(out / name)
    save_model(path, model)
    save_config(cfg, path / "config.json")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": meta["tokenizer.chat_template"],
                "eos_token": tokens[eos],
                "bos_token": None,
                "pad_token": tokens[eos],
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": cfg["max_position_embeddings"],
            },
            indent=2,
        )
    )
    prompt = chat_prompt(meta, tok, SMOLLM2_QUESTION)
    ref = write_reference(path, prompt, path / "reference.safetensors")
    summarize(name, get_total_parameters(model), ref)
    return [
        float32_entry(
            name,
            "qwen3",
            "mlx",
            "tiny qwen3 (random weights) with SmolLM2-135M-Instruct's tokenizer and chat template, "
            "for server and client tests",
            **reference_facts(ref),
        )
    ]


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


@dataclass
class Fixture:
    name: str
    make: Callable[[Path], list[dict]]
    requires: list[str] = field(default_factory=list)


def all_fixtures(smollm2_gguf: Optional[Path], qwen3_tokenizer: Optional[Path] = None) -> list[Fixture]:
    fixtures = [Fixture(s.name, lambda out, s=s: [make_mlx_fixture(out, s)]) for s in mlx_specs()]
    fixtures += [Fixture(s.name, lambda out, s=s: [make_hf_fixture(out, s)], [s.twin]) for s in HF_SPECS]
    fixtures += [Fixture(f"gguf-{k}", lambda out, k=k: [make_gguf_fixture(out, k)]) for k in GGUF_TYPES]
    fixtures += [
        Fixture(f"gguf-{fam}-q8_0", lambda out, fam=fam: [make_gguf_fixture(out, "q8_0", fam)])
        for fam in GGUF_FAMILY_CONFIGS
    ]
    fixtures.append(Fixture("gguf-llama-spm-q8_0", lambda out: [make_gguf_fixture(out, "q8_0", "llama", "spm")]))
    fixtures.append(Fixture("gguf-llama-llama3-f32", lambda out: [make_gguf_fixture(out, "f32", "llama", rope="llama3")]))
    # A GGUF family added by its spec alone (architectures/granite.toml's [gguf]).
    fixtures.append(Fixture("gguf-granite-f32", lambda out: [make_gguf_fixture(out, "f32", "granite")]))
    fixtures += [
        Fixture(f"gguf-{fam}-{kind}", lambda out, fam=fam, kind=kind: [make_hybrid_gguf_fixture(out, fam, kind)])
        for fam in HYBRID_GGUF
        for kind in ("f32", "q8_0")
    ]
    # Q4_K_M is what most published GGUFs are.
    fixtures += [
        Fixture(f"gguf-{fam}-q4_k", lambda out, fam=fam: [make_hybrid_gguf_fixture(out, fam, "q4_k")])
        for fam in ("qwen3_5", "nemotron_h_moe")
    ]
    fixtures += [
        Fixture(f"gguf-{fam}-{v}-f32", lambda out, fam=fam, v=v: [make_hybrid_gguf_fixture(out, fam, "f32", v)])
        for v, fam in gguf_hybrid.VARIANTS.items()
    ]
    fixtures.append(Fixture("hybrid_mix-f32", lambda out: [make_mix_fixture(out)]))
    helpers = namespace(
        random_parameters,
        seed_for,
        reset_dir,
        write_reference,
        summarize,
        manifest_entry,
        float32_entry,
        reference_facts,
        load_weight_files,
    )
    kv_helpers = namespace(
        random_model,
        save_model,
        save_config,
        random_prompt,
        text_config,
        get_total_parameters,
        **vars(helpers),
    )

    def head_dim_32(cfg: dict) -> dict:
        t = text_config(cfg)
        t["head_dim"] = 32
        return cfg

    for name, config in [
        ("llama-kvq-f32", llama_config),
        ("qwen3_5-kvq-f32", qwen3_5_config),
        ("nemotron_h-kvq-f32", nemotron_h_config),
    ]:
        fixtures.append(
            Fixture(
                name,
                lambda out, n=name, c=config: [kvq_ref.make_kvq_fixture(out, n, lambda: head_dim_32(c()), kv_helpers)],
            )
        )
    for name, twin, to_hf, arch in [
        ("qwen3_next-mtp-hf", "qwen3_next-moe-f32", hf_qwen3_next, "Qwen3NextForCausalLM"),
        ("qwen3_5-mtp-hf", "qwen3_5-f32", hf_qwen3_5, "Qwen3_5ForConditionalGeneration"),
    ]:
        fixtures.append(
            Fixture(
                name,
                lambda out, n=name, t=twin, f=to_hf, a=arch: [mtp_ref.make_mtp_fixture(out, n, t, f, a, helpers)],
                [twin],
            )
        )
    if smollm2_gguf is not None:
        fixtures.append(Fixture("smollm2-export", lambda out: make_smollm2_fixtures(out, smollm2_gguf)))
        fixtures.append(Fixture("qwen3-chat", lambda out: make_chat_fixture(out, smollm2_gguf)))
    if qwen3_tokenizer is not None:
        fixtures.append(
            Fixture(
                tool_fixture.NAME,
                lambda out: tool_fixture.make_tools_fixture(
                    out, qwen3_tokenizer, qwen3_config, random_model, seed_for, save_model, save_config, reset_dir
                ),
            )
        )
    return fixtures


def namespace(*functions: Callable, **more) -> types.SimpleNamespace:
    """``functions`` under their own names, and ``more``: the helpers a
    reference module is handed."""
    return types.SimpleNamespace(**{f.__name__: f for f in functions}, **more)


def select(fixtures: list[Fixture], only: Optional[str]) -> list[Fixture]:
    """The fixtures named in ``only`` plus those they are derived from."""
    if not only:
        return fixtures
    by_name = {f.name: f for f in fixtures}
    wanted = set()
    pending = [n.strip() for n in only.split(",") if n.strip()]
    while pending:
        n = pending.pop()
        if n not in by_name:
            raise SystemExit(f"unknown fixture {n!r}; known: {', '.join(by_name)}")
        if n not in wanted:
            wanted.add(n)
            pending += by_name[n].requires
    return [f for f in fixtures if f.name in wanted]


def write_manifest(out: Path, entries: list[dict], merge: bool) -> None:
    """Write DIR/manifest.json; with ``merge`` (an --only run) keep the
    entries of fixtures that were not remade."""
    manifest_path = out / "manifest.json"
    by_name = {}
    if merge and manifest_path.exists():
        by_name = {e["name"]: e for e in json.loads(manifest_path.read_text())["fixtures"]}
    by_name.update({e["name"]: e for e in entries})
    manifest = {
        "fixtures": [by_name[n] for n in sorted(by_name)],
        # The reference venv's interpreter, for tests that drive Python
        # clients (the openai client against `mlex serve`).
        "python": sys.executable,
        "versions": {
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "gguf": importlib.metadata.version("gguf"),
        },
    }
    # Every test reads the manifest, and an --only run rewrites it in place:
    # written beside, then renamed, a reader sees the old one or the new.
    tmp = manifest_path.with_name(f".manifest.json.{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, manifest_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--smollm2-gguf", type=Path, help="SmolLM2-135M-Instruct Q4_1 .gguf")
    parser.add_argument("--qwen3-tokenizer", type=Path, help="folder with Qwen3's tokenizer.json and tokenizer_config.json")
    parser.add_argument("--only", help="comma-separated fixture names (plus what they derive from)")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    entries = []
    for fixture in select(all_fixtures(args.smollm2_gguf, args.qwen3_tokenizer), args.only):
        entries += fixture.make(args.out)
    write_manifest(args.out, entries, merge=bool(args.only))
    print(f"{len(entries)} fixtures in {args.out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
