#!/usr/bin/env python3
"""Where mlx-lm's peak memory falls in one generation: MLX's peak after the
prompt (prefill) and after the whole generation, at each prefill step, and
for dense models the peak of the prefill when every layer is evaluated on its own (which
bounds what one layer's transient costs, apart from what a whole-step graph
keeps alive). The same random prompt as `mlxlm_bench.py` (seed 0).

    python mlxlm_memwhere.py MODEL_DIR --prompt-len 4096 --gen 16 --steps 2048,4096 [--device gpu]

Prints one JSON object a line.
"""
import argparse
import json
import pathlib

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

MB = 1e6


def whole(model, prompt, n, step):
    """generate_step as mlx-lm runs it: peak after the first token, after all."""
    mx.clear_cache()
    mx.reset_peak_memory()
    after_prefill = None
    for i, _ in enumerate(generate_step(prompt, model, max_tokens=n, prefill_step_size=step,
                                        sampler=lambda l: mx.argmax(l, -1))):
        if i == 0:
            after_prefill = mx.get_peak_memory()
    return {"mode": "generate_step", "step": step, "prefill_peak_mb": after_prefill / MB,
            "peak_mb": mx.get_peak_memory() / MB, "active_mb": mx.get_active_memory() / MB}


def per_layer(model, prompt, step):
    """The prompt in pieces of `step`, each layer evaluated on its own."""
    mx.clear_cache()
    inner = model.model
    cache = make_prompt_cache(model)
    mx.reset_peak_memory()
    layer_peaks = []
    for s in range(0, prompt.size, step):
        h = inner.embed_tokens(prompt[s:s + step][None])
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(inner.layers, cache):
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            h = layer(h, mask, c)
            mx.eval(h, c.state)
            layer_peaks.append((mx.get_peak_memory() - before) / MB)
    return {"mode": "per_layer", "step": step, "layer_transient_max_mb": max(layer_peaks),
            "active_mb": mx.get_active_memory() / MB}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--steps", default="2048,4096")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    a = p.parse_args()
    mx.set_default_device(mx.cpu if a.device == "cpu" else mx.gpu)
    model, cfg = load_model(pathlib.Path(a.model))
    mx.eval(model.parameters())
    weights = mx.get_active_memory()
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    prompt = mx.array(np.random.default_rng(0).integers(0, vocab, size=a.prompt_len).astype(np.int32))
    whole(model, prompt, 4, 512)  # warm-up
    for step in (int(s) for s in a.steps.split(",")):
        runs = [whole(model, prompt, a.gen, step)]
        if cfg.get("model_type") in ("qwen3", "qwen2", "llama"):
            runs.append(per_layer(model, prompt, step))
        for r in runs:
            r.update({"engine": "mlx-lm", "weights_mb": weights / MB, "prompt_len": a.prompt_len})
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
