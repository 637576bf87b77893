"""The reference for ``hybrid_mix``, a hybrid no released model has: Gated
DeltaNet, Mamba2 and gated attention layers in one stack, MoE on some of
them. mlex serves it from a spec file alone (``examples/specs/hybrid_mix.toml``);
this reference is built from mlx-lm's own layer modules, none of mlex's code:

  * ``G`` and ``A`` layers are ``mlx_lm.models.qwen3_next.Qwen3NextDecoderLayer``
    (pre-norm Gated DeltaNet or gated attention, then a SwiGLU MLP or the
    sparse MoE with a shared expert, chosen by ``decoder_sparse_step``);
  * ``M`` layers are ``mlx_lm.models.nemotron_h.NemotronHBlock`` of type ``M``
    (pre-norm Mamba2 mixer with a residual);
  * embedding, final RMS norm and untied head as in Qwen3-Next.

The stack is ``layer_pattern`` (one letter per layer). A Qwen3-Next layer
picks linear or full attention from its index and ``full_attention_interval``,
so the pattern must put ``A`` exactly where ``(i + 1) % interval == 0``;
``fixtures.hybrid_mix_config`` does.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import nemotron_h, qwen3_next
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache


class MixModel(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        q = qwen3_next.ModelArgs.from_dict(cfg)
        n = nemotron_h.ModelArgs.from_dict(dict(cfg, hybrid_override_pattern=cfg["layer_pattern"]))
        self.pattern = cfg["layer_pattern"]
        self.model_type = cfg["model_type"]
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(q.vocab_size, q.hidden_size)
        layers = []
        for i, code in enumerate(self.pattern):
            if code == "M":
                layers.append(nemotron_h.NemotronHBlock(n, "M"))
            else:
                layer = qwen3_next.Qwen3NextDecoderLayer(q, layer_idx=i)
                if layer.is_linear != (code == "G"):
                    raise ValueError(f"layer {i} ({code}) disagrees with full_attention_interval")
                layers.append(layer)
        self.model.layers = layers
        self.model.norm = nn.RMSNorm(q.hidden_size, eps=q.rms_norm_eps)
        self.lm_head = nn.Linear(q.hidden_size, q.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[Any] = None) -> mx.array:
        h = self.model.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.pattern)
        fa = self.pattern.index("A")
        ssm = self.pattern.index("G")
        fa_mask = create_attention_mask(h, cache[fa])
        ssm_mask = create_ssm_mask(h, cache[ssm])
        for code, layer, c in zip(self.pattern, self.model.layers, cache):
            h = layer(h, mask=fa_mask if code == "A" else ssm_mask, cache=c)
        return self.lm_head(self.model.norm(h))

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return [KVCache() if code == "A" else ArraysCache(size=2) for code in self.pattern]
