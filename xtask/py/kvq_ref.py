"""Quantized-KV fixtures: tiny models whose attention head dim (32) a
quantization group divides, with mlx-lm's own `generate_step` traces at
``kv_bits`` (its ``QuantizedKVCache`` and ``quantized_scaled_dot_product_attention``,
switched on by ``maybe_quantize_kv_cache`` after ``quantized_kv_start``
tokens). Hybrids keep their recurrent caches as mlx-lm does. The WINDOWS
cases bound every full-attention cache to a rotating window
(`--max-kv-size`; ``window_cache``).

    DIR/<name>/kv_reference.safetensors, for each case C of CASES and WINDOWS:
        C.params    int32 [4]       bits, group size, quantized_kv_start, prefill step
                    (window cases: int32 [3] window, kept tokens, prefill step)
        C.tokens    int32 [N]       greedy tokens
        C.logprobs  f32 [N, V]      the log-probabilities each token was taken from

The prompt is the fixture's (reference.safetensors). mlx-lm prefills
``prompt[:-1]`` in steps of ``prefill step`` tokens, then the last token
alone; the Rust test runs the same schedule.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_model

# name: (bits, group size, quantized_kv_start, prefill step). `early`
# quantizes after the first prefill step and runs most of the prompt and
# every decode step on quantized keys; `late` switches during decoding.
CASES = {
    "early": (4, 32, 0, 5),
    "late": (8, 32, 20, 2048),
}
TOKENS = 24
# name: (window, prefill step). A bounded window (`--max-kv-size`) of 10
# tokens on the 16-token prompt: `window` prefills past it in one step,
# `window_steps` in steps of 4 that meet a full ring.
WINDOWS = {
    "window": (10, 2048),
    "window_steps": (10, 4),
}


def window_cache(model, window: int) -> list:
    """mlx-lm's own `make_prompt_cache(model, max_kv_size)` where the model
    has no cache layout of its own (llama: RotatingKVCache(window, keep=4)
    for every layer); a hybrid's layout with each full-attention KVCache
    replaced by that RotatingKVCache (mlx-lm ignores max_kv_size there)."""
    if not hasattr(model, "make_cache"):
        return make_prompt_cache(model, max_kv_size=window)
    return [RotatingKVCache(max_size=window, keep=4) if type(c) is KVCache else c for c in model.make_cache()]


def window_trace(model, prompt: np.ndarray, window: int, step: int) -> tuple[mx.array, mx.array]:
    tokens, logprobs = [], []
    cache = window_cache(model, window)
    if not any(isinstance(c, RotatingKVCache) for c in cache):
        raise RuntimeError("no full-attention cache to bound")
    for token, lp in generate_step(
        mx.array(prompt), model, max_tokens=TOKENS, prompt_cache=cache, prefill_step_size=step
    ):
        tokens.append(int(token))
        logprobs.append(lp.astype(mx.float32))
    return mx.array(tokens, dtype=mx.int32), mx.stack(logprobs)


def kv_trace(model, prompt: np.ndarray, bits: int, group: int, start: int, step: int) -> tuple[mx.array, mx.array]:
    tokens, logprobs = [], []
    for token, lp in generate_step(
        mx.array(prompt),
        model,
        max_tokens=TOKENS,
        kv_bits=bits,
        kv_group_size=group,
        quantized_kv_start=start,
        prefill_step_size=step,
    ):
        tokens.append(int(token))
        logprobs.append(lp.astype(mx.float32))
    return mx.array(tokens, dtype=mx.int32), mx.stack(logprobs)


def make_kvq_fixture(out: Path, name: str, config, h) -> dict:
    """``config()``: the model's config, head dim 32. ``h``: the fixture
    helpers (random_model, seed_for, reset_dir, save_model, save_config,
    random_prompt, text_config, write_reference, summarize, float32_entry,
    reference_facts, get_total_parameters)."""
    cfg = config()
    model = h.random_model(cfg, h.seed_for(name))
    path = h.reset_dir(out / name)
    h.save_model(path, model)
    h.save_config(cfg, path / "config.json")
    prompt = h.random_prompt(h.text_config(cfg)["vocab_size"])
    ref = h.write_reference(path, prompt, path / "reference.safetensors")

    model, _ = load_model(path)
    arrays = {}
    for case, (bits, group, start, step) in CASES.items():
        tokens, logprobs = kv_trace(model, prompt, bits, group, start, step)
        arrays[f"{case}.params"] = mx.array([bits, group, start, step], dtype=mx.int32)
        arrays[f"{case}.tokens"] = tokens
        arrays[f"{case}.logprobs"] = logprobs
    for case, (window, step) in WINDOWS.items():
        tokens, logprobs = window_trace(model, prompt, window, step)
        arrays[f"{case}.params"] = mx.array([window, 4, step], dtype=mx.int32)
        arrays[f"{case}.tokens"] = tokens
        arrays[f"{case}.logprobs"] = logprobs
    # The quantized cache and the window must have changed what the model computes, or the
    # traces test nothing.
    dense = ref["step_logits"]
    n = min(dense.shape[0], TOKENS)
    dense_lp = dense[:n] - mx.logsumexp(dense[:n], axis=-1, keepdims=True)
    for case in ["early", *WINDOWS]:
        if mx.abs(arrays[f"{case}.logprobs"][:n] - dense_lp).max().item() < 1e-3:
            raise RuntimeError(f"{name}: the {case} trace equals the full-precision one")
    mx.save_safetensors(str(path / "kv_reference.safetensors"), arrays)
    h.summarize(name, h.get_total_parameters(model), ref)
    return h.float32_entry(
        name,
        cfg["model_type"],
        "mlx",
        "head dim 32 (a quantization group divides it); kv_reference.safetensors: mlx-lm generate_step "
        "traces with kv_bits (QuantizedKVCache) and with a 10-token RotatingKVCache window, cases in xtask/py/kvq_ref.py",
        kv_reference=f"{name}/kv_reference.safetensors",
        **h.reference_facts(ref),
    )
