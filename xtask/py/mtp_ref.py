"""Multi-token-prediction fixtures: a Hugging Face-layout Qwen3-Next /
Qwen3.5 checkpoint with a whole random MTP block, and the block's logits
computed from mlx-lm's own modules (mlx-lm has no MTP code; this composes
it as vLLM, SGLang and llama.cpp run it):

    x = fc(cat[pre_fc_norm_embedding(embed(t[j+1])), pre_fc_norm_hidden(h[j])])
    y = decoder layer (the trunk's full-attention kind, with its MoE or MLP), own KV cache
    logits = lm_head(norm(y))                      (embedding and head shared)

where ``h[j]`` is the trunk's hidden state after its final norm at position
``j``. A draft after the first feeds ``norm(y)`` of the previous row back in
place of ``h``, one position on. Every RMSNorm of the block is stored as
Qwen's offset ``w - 1`` (the checkpoint's convention), as the trunk's are.

    DIR/<name>/mtp_reference.safetensors
        prompt        int32 [P]     the twin's prompt
        mtp_logits    f32 [P-1, V]  rows j = 0..P-2: (h[j], t[j+1])
        chain_token   int32 [1]     the argmax of the last row
        chain_logits  f32 [V]       one more row: (norm(y) of the last row, chain_token)
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model


class Mtp(nn.Module):
    def __init__(self, layer: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def rows(self, h: mx.array, e: mx.array, cache) -> mx.array:
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], axis=-1))
        mask = create_attention_mask(x, cache)
        y = self.layers[0](x, mask=mask, cache=cache)
        return self.norm(y)


def decoder_layer(cfg: dict) -> tuple[nn.Module, dict]:
    """The trunk's full-attention decoder layer, built by mlx-lm, and the
    text config it reads."""
    text = cfg.get("text_config", cfg)
    if cfg["model_type"] == "qwen3_next":
        from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextDecoderLayer as Layer
    else:
        from mlx_lm.models.qwen3_5 import DecoderLayer as Layer, TextModelArgs as ModelArgs
    args = ModelArgs.from_dict(dict(text))
    return Layer(args, layer_idx=args.full_attention_interval - 1), text


def hf_mtp_weights(mtp: Mtp, experts: int) -> dict[str, mx.array]:
    """The block's tensors as a Hugging Face checkpoint names and stores
    them: per-expert matrices, offset norms."""
    out = {}
    for name, value in tree_flatten(mtp.parameters()):
        key = f"mtp.{name}"
        if ".switch_mlp." in key:
            prefix, rest = key.split(".switch_mlp.")
            for e in range(experts):
                out[f"{prefix}.experts.{e}.{rest}"] = value[e]
            continue
        module = key.rsplit(".", 2)[-2]
        if value.ndim == 1 and "norm" in module and "linear_attn" not in key:
            value = value - 1.0
        out[key] = value
    return out


def write_mtp_reference(path: Path, mtp: Mtp, model: nn.Module, prompt: np.ndarray, text: dict) -> None:
    """``path/mtp_reference.safetensors`` for the block ``mtp`` on the
    mlx-lm trunk ``model`` (see the module doc)."""
    lm = getattr(model, "language_model", model)
    trunk = lm.model
    tokens = mx.array(prompt)[None]
    hs = trunk(tokens)

    def head(x):
        if text.get("tie_word_embeddings", False):
            return trunk.embed_tokens.as_linear(x)
        return lm.lm_head(x)

    cache = KVCache()
    normed = mtp.rows(hs[:, :-1], trunk.embed_tokens(tokens[:, 1:]), cache)
    logits = head(normed)[0].astype(mx.float32)
    chain_token = mx.argmax(logits[-1]).reshape(1).astype(mx.int32)
    chained = mtp.rows(normed[:, -1:], trunk.embed_tokens(chain_token[None]), cache)
    chain_logits = head(chained)[0, 0].astype(mx.float32)
    mx.eval(logits, chain_logits)
    mx.save_safetensors(
        str(path / "mtp_reference.safetensors"),
        {
            "prompt": mx.array(prompt.astype(np.int32)),
            "mtp_logits": logits,
            "chain_token": chain_token,
            "chain_logits": chain_logits,
        },
    )


def make_mtp_fixture(out: Path, name: str, twin: str, to_hf, architecture: str, h) -> dict:
    """``h``: the fixture helpers (random_parameters, seed_for, reset_dir,
    write_reference, summarize, manifest_entry, reference_facts,
    load_weight_files)."""
    twin_dir = out / twin
    cfg = json.loads((twin_dir / "config.json").read_text())
    cfg["architectures"] = [architecture]
    cfg["torch_dtype"] = "float32"
    layer, text = decoder_layer(cfg)
    hidden = text["hidden_size"]
    key = "num_nextn_predict_layers" if cfg["model_type"] == "qwen3_next" else "mtp_num_hidden_layers"
    text[key] = 1
    mtp = Mtp(layer, hidden, text["rms_norm_eps"])
    mtp.load_weights(h.random_parameters(mtp, h.seed_for(name)), strict=True)
    mx.eval(mtp.parameters())
    rng = np.random.default_rng(h.seed_for(name))
    weights = to_hf(h.load_weight_files(twin_dir), cfg, rng)
    weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    weights.update(hf_mtp_weights(mtp, text.get("num_experts", 0) or 0))

    path = h.reset_dir(out / name)
    mx.save_safetensors(str(path / "model.safetensors"), dict(sorted(weights.items())), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=4))

    twin_ref = mx.load(str(twin_dir / "reference.safetensors"))
    prompt = np.array(twin_ref["prompt"])
    ref = h.write_reference(path, prompt, path / "reference.safetensors")
    # The trunk from disk through mlx-lm (its sanitize drops `mtp.*`).
    model, _ = load_model(path)
    write_mtp_reference(path, mtp, model, prompt, text)
    h.summarize(name, sum(v.size for v in weights.values()), ref)
    return h.manifest_entry(
        name,
        cfg["model_type"],
        "float32",
        None,
        "hf",
        name,
        f"{twin} in HF layout with a whole random MTP block ({key} = 1); mtp_reference.safetensors "
        "from mlx-lm's decoder layer composed as vLLM/llama.cpp run the head (post-norm trunk hidden)",
        mtp_reference=f"{name}/mtp_reference.safetensors",
        **h.reference_facts(ref),
    )
