#!/usr/bin/env python3
"""Aggregate throughput of mlx-lm's continuous batching (``BatchGenerator``),
measured the way ``mlex bench --batch B`` measures: B prompts of
--prompt-len random ids, --gen greedy tokens each, no stop tokens, wall time
from insertion to the last token (prefill included). As in
``shared/tools/mlxlm_batch.py`` (the reference the batching issue quotes):
``completion_batch_size = B``, ``prefill_batch_size = min(B, 8)``. One
warm-up at the same B (4 tokens), then the best of --repeats.

    python mlxlm_batch_bench.py MODEL_DIR --batch 32 --prompt-len 128 --gen 128 [--device gpu]

Prints one JSON object: agg_tok_s (generated / wall), prefill_tok_s (prompt
tokens / time until every prompt has its first token), decode_tok_s (the
tokens after each first / the rest of the wall time), peak_memory_bytes.
"""
import argparse
import json
import pathlib
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load_model

from mlxlm_compat import patch as compat_patch


def once(model, vocab, b, prompt_len, gen, seed):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, size=prompt_len).tolist() for _ in range(b)]
    g = BatchGenerator(model, stop_tokens=None, completion_batch_size=max(b, 1), prefill_batch_size=min(b, 8))
    t0 = time.perf_counter()
    n = 0
    seen = set()
    t_first = None
    g.insert(prompts, [gen] * b)
    while rs := g.next_generated():
        n += len(rs)
        for r in rs:
            seen.add(r.uid)
        if t_first is None and len(seen) == b:
            t_first = time.perf_counter()
    end = time.perf_counter()
    g.close()
    t_first = t_first or end
    return {
        "seconds": end - t0,
        "generated_tokens": n,
        "agg_tok_s": n / (end - t0),
        "prefill_tok_s": b * prompt_len / max(t_first - t0, 1e-9),
        "decode_tok_s": max(n - b, 0) / max(end - t_first, 1e-9),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--quantize", type=int, help="quantize on load to this many bits (group 64)")
    a = p.parse_args()
    mx.set_default_device(mx.cpu if a.device == "cpu" else mx.gpu)
    compat = compat_patch()
    model, cfg = load_model(pathlib.Path(a.model))
    if a.quantize:
        from mlx_lm.utils import quantize_model
        model, cfg = quantize_model(model, cfg, group_size=64, bits=a.quantize)
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    once(model, vocab, a.batch, a.prompt_len, min(a.gen, 4), 1)
    mx.reset_peak_memory()
    best = min((once(model, vocab, a.batch, a.prompt_len, a.gen, 0) for _ in range(max(a.repeats, 1))),
               key=lambda r: r["seconds"])
    best.update(batch=a.batch, peak_memory_bytes=mx.get_peak_memory(), mlx=mx.__version__, compat=compat,
                device=str(mx.default_device()))
    print(json.dumps(best))


if __name__ == "__main__":
    main()
