#!/usr/bin/env python3
"""Speed of mlx-lm (the Python reference) on a checkpoint, measured the way
`mlex bench` measures: a random prompt of --prompt-len ids (fixed seed),
greedy decoding of --gen tokens, one warm-up run, then the best of
--repeats timed runs. prefill tok/s = prompt tokens / time to the first
token; decode tok/s = (tokens - 1) / time from the first token to the last.

    python mlxlm_bench.py MODEL_DIR --prompt-len 128 --gen 128 [--device gpu] [--quantize 4]
        [--kv-bits 4 [--kv-group-size 64] [--quantized-kv-start 5000]] [--max-kv-size N]

Prints one JSON object.
"""
import argparse
import json
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from mlxlm_compat import patch as compat_patch


def run(model, prompt, n, kv):
    t0 = time.perf_counter()
    first = None
    count = 0
    for _tok, _ in generate_step(prompt, model, max_tokens=n, sampler=lambda l: mx.argmax(l, -1), **kv):
        if first is None:
            first = time.perf_counter()
        count += 1
    end = time.perf_counter()
    return len(prompt) / (first - t0), (count - 1) / (end - first), count


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--quantize", type=int, help="quantize on load to this many bits (group 64)")
    p.add_argument("--kv-bits", type=int, help="mlx-lm's quantized KV cache (generate_step's kv_bits)")
    p.add_argument("--kv-group-size", type=int, default=64)
    p.add_argument("--quantized-kv-start", type=int, default=5000)
    p.add_argument("--max-kv-size", type=int, help="generate_step's max_kv_size (models without a cache layout of their own)")
    a = p.parse_args()
    kv = {}
    if a.kv_bits:
        kv = {"kv_bits": a.kv_bits, "max_kv_size": a.max_kv_size, "kv_group_size": a.kv_group_size, "quantized_kv_start": a.quantized_kv_start}
    if a.max_kv_size:
        kv["max_kv_size"] = a.max_kv_size
    mx.set_default_device(mx.cpu if a.device == "cpu" else mx.gpu)
    compat = compat_patch()
    model, cfg = load_model(__import__("pathlib").Path(a.model))
    if a.quantize:
        from mlx_lm.utils import quantize_model
        model, cfg = quantize_model(model, cfg, group_size=64, bits=a.quantize)
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    prompt = mx.array(np.random.default_rng(0).integers(0, vocab, size=a.prompt_len).astype(np.int32))
    run(model, prompt, min(a.gen, 8), kv)
    mx.reset_peak_memory()
    best = max((run(model, prompt, a.gen, kv) for _ in range(max(a.repeats, 1))), key=lambda r: r[1])
    print(json.dumps({
        "prefill_tok_s": best[0], "decode_tok_s": best[1], "generated_tokens": best[2],
        "peak_memory_bytes": mx.get_peak_memory(), "mlx": mx.__version__, "compat": compat,
        "device": str(mx.default_device()), "kv_bits": a.kv_bits, "max_kv_size": a.max_kv_size,
    }))


if __name__ == "__main__":
    main()
