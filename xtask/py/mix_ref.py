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
so the pattern must put ``A`` exactly where ``(i + 1) % interval == 0``; the
config below does.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import nemotron_h, qwen3_next
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache


def config() -> dict:
    """Six layers G M A G M A; MoE on layers 3 and 5 (decoder_sparse_step 2;
    layer 1 is Mamba2, which has no feed-forward)."""
    return dict(
        model_type="hybrid_mix",
        layer_pattern="GMAGMA",
        num_hidden_layers=6,
        full_attention_interval=3,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=256,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        # gated attention
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        attention_bias=False,
        # Gated DeltaNet
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        # MoE (Qwen routing, shared expert)
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=2,
        mlp_only_layers=[],
        norm_topk_prob=True,
        # Mamba2
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=2,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        mlp_bias=False,
        use_bias=False,
    )


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
