#!/usr/bin/env python3
"""A GGUF copy of a dense bench checkpoint (``make_bench_models.py``'s
``qwen3-0.6b``), written as llama.cpp's converter writes one
(``fixtures.write_llama_gguf``), for the GGUF side of the tensor-parallel
measurements (``xtask/cpu/tp.sh``'s GGUF variant).

    python bench_gguf.py MODEL_DIR OUT.gguf [--kind q8_0|f16|q4_0]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import fixtures  # noqa: E402


def padded_vocab(vocab_size: int):
    """The fixtures' 256-token byte-level vocabulary, padded with control
    tokens to the model's vocabulary (the bench feeds token ids)."""
    tokens, types, merges = tiny_vocab(256)
    pad = vocab_size - len(tokens)
    tokens += [f"<|pad_{i}|>" for i in range(pad)]
    types += [int(fixtures.gguf.TokenType.CONTROL)] * pad
    return tokens, types, merges


tiny_vocab = fixtures.tiny_gpt2_vocab


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--kind", default="q8_0")
    a = p.parse_args(argv)
    cfg = json.loads((a.model / "config.json").read_text())
    if cfg["model_type"] not in fixtures.GGUF_ARCH:
        sys.exit(f"{a.model}: model_type {cfg['model_type']} is not a llama-family GGUF architecture")
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(a.model / "model.safetensors")).items()}
    fixtures.tiny_gpt2_vocab = padded_vocab
    fixtures.write_llama_gguf(a.out, cfg, weights, a.kind)
    print(a.out)


if __name__ == "__main__":
    main()
