#!/usr/bin/env python3
"""Independent NumPy reference for the DharaAR architecture (`model_type: dhara_ar`).

mlx-lm has no DharaAR class, so this script is the reference for mlex's port:
it writes tiny random-weight DharaAR checkpoints in the real checkpoints' tensor
naming plus reference logits computed with NumPy alone (float64 arithmetic on the
stored float32 weights).

    python dhara_ref.py --out DIR          # writes DIR/<fixture>/... and DIR/dhara-manifest.json

Needs only `numpy` and `safetensors`. Deterministic (fixed seeds).

Architecture (as implemented here; see the module-level notes in `forward`):
a LLaMA-3-style pre-norm GQA decoder plus "Canon layers" (Physics of Language
Models part 4.1): a causal depthwise conv1d at positions chosen by `canon_set`:

  A  on input_layernorm(x), before the attention block          (dim hidden_size)
  B  on q, k and v separately, right after their projections,   (dims Hq*D, Hkv*D, Hkv*D)
     on the flat [L, heads*head_dim] tensors, before the reshape into heads and RoPE
  C  on post_attention_layernorm(h), before the MLP              (dim hidden_size)
  D  on silu(gate_proj(x)) * up_proj(x), before down_proj        (dim intermediate_size)

  canon(x) = conv(x) (+ bias if canon_bias); then silu(.) if canon_activation;
             then x + (.) if canon_residual            ->  x + silu(conv(x)) with both on.
  conv(x)[t, c] = sum_{j=0}^{K-1} w[c, j] * x[t - (K-1) + j, c]   (zeros before t=0)
  i.e. w[c, K-1] multiplies the current token (PyTorch/MLX cross-correlation with K-1
  zeros of left padding).

Attention: RoPE (rotate-half / MLX `traditional=False`: pairs (i, i + D/2)) on q and k,
THEN per-head RMSNorm q_norm / k_norm (weights [head_dim]) when use_qk_norm, scale
head_dim**-0.5, causal, GQA (query head h uses kv head h // (Hq/Hkv)).
Logits: tied to embed_tokens (unless tie_word_embeddings is false -> lm_head), then
c * tanh(logits / c) when use_logit_softcap and c = logit_softcap > 0.
RMSNorm everywhere: x / sqrt(mean(x^2) + rms_norm_eps) * w (plain weight, no 1+w).

RoPE frequencies: the real checkpoints ship a per-layer buffer
`model.layers.N.self_attn.rotary_emb.inv_freq` [head_dim/2]. OptiQ's MLX port uses it
(its comment: the buffers "don't match the plain theta^(-2i/d) schedule"); crates.io
mlex 0.1.3 drops it and recomputes from rope_theta. The fixtures ship the buffer; in all
but `dhara-invfreq` it equals rope_theta^(-2i/d), so both readings agree there, while
`dhara-invfreq` has perturbed buffers and its reference uses them.

Fixtures (float32, 4 layers, hidden 64, 4 heads / 2 kv heads, head_dim 16, I 128, V 256):
  dhara-f32        real defaults (ABCD, residual, no activation, qk-norm, softcap 30, tied)
  dhara-hf         dhara-f32's model in the PyTorch layout: conv [C,1,K], lm_head duplicated
  dhara-act-nores  canon_set AC, canon = silu(conv(x)), head_dim omitted, theta 1e4, eps 1e-5
  dhara-switches   canon_set BD, kernel 3, x + silu(conv(x)), no qk-norm, no softcap, untied
  dhara-invfreq    dhara-f32 settings with non-standard rotary_emb.inv_freq buffers
Each: DIR/<name>/{config.json, model.safetensors, reference.safetensors}; the reference
holds prompt i32[16], logits_full f32[16,V], greedy i32[32] (argmax, full re-forward per
step, no cache) and step_logits f32[32,V] (the logits each greedy token came from).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np
from safetensors.numpy import save_file

PROMPT_LEN = 16
GEN_LEN = 32

# ---------------------------------------------------------------------------
# Config handling (keys and defaults of the real `dhara_ar` config.json)
# ---------------------------------------------------------------------------

# The real model's features (tied embeddings, qk-norm, logit softcap, Canon
# layers): part of DEFAULTS, and what the fixtures write.
FEATURE_DEFAULTS = {
    "tie_word_embeddings": True,
    "use_qk_norm": True,
    "use_logit_softcap": True,
    "logit_softcap": 30.0,
    "canon_set": "ABCD",
    "canon_kernel": 4,
    "canon_residual": True,
    "canon_activation": False,
    "canon_bias": False,
}

# Defaults as read by both existing ports (OptiQ's MLX `dhara_ar.py`, crates.io mlex
# 0.1.3 `models/dhara.rs`). rope_theta: OptiQ default 8e6 (the real value); mlex 0.1.3
# falls back to 1e5 if the key is missing -- the real config carries it, so it never
# matters; fixtures always write it.
DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 8_000_000.0,
    **FEATURE_DEFAULTS,
}


def resolve(cfg: dict) -> dict:
    c = dict(DEFAULTS)
    c.update(cfg)
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    if c.get("head_dim") is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    return c


# ---------------------------------------------------------------------------
# NumPy forward (float64)
# ---------------------------------------------------------------------------


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def linear(x, w):
    # w is [out, in] (PyTorch / MLX nn.Linear layout)
    return x @ w.T


def canon(x, w, bias, c):
    """Causal depthwise conv over the time axis. x: [L, C]; w: [C, K] (w[:, K-1] = current)."""
    L, C = x.shape
    K = w.shape[1]
    xp = np.concatenate([np.zeros((K - 1, C), dtype=x.dtype), x], axis=0)
    out = np.zeros_like(x)
    for j in range(K):
        out += xp[j : j + L] * w[:, j]
    if bias is not None:
        out = out + bias
    if c["canon_activation"]:
        out = silu(out)
    return x + out if c["canon_residual"] else out


def rope(x, inv_freq, positions):
    """Rotate-half RoPE (== mx.fast.rope(traditional=False) with freqs 1/inv_freq).

    x: [H, L, D]; inv_freq: [D/2]; positions: [L].
    out[i]       = x[i] cos(p f_i) - x[i+D/2] sin(p f_i)
    out[i+D/2]   = x[i+D/2] cos(p f_i) + x[i] sin(p f_i)
    """
    half = x.shape[-1] // 2
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [L, D/2]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def default_inv_freq(head_dim, theta):
    return theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def conv_weight_ck(w, layout):
    """Return a conv weight as [C, K] from the stored layout."""
    if layout == "mlx":  # MLX conv1d weight [C_out, K, C_in/groups] = [C, K, 1]
        assert w.ndim == 3 and w.shape[2] == 1, w.shape
        return w[:, :, 0]
    # PyTorch nn.Conv1d weight [C_out, C_in/groups, K] = [C, 1, K]
    assert w.ndim == 3 and w.shape[1] == 1, w.shape
    return w[:, 0, :]


class Model:
    def __init__(self, cfg: dict, weights: dict, layout: str, rope_from_buffers: bool):
        self.c = resolve(cfg)
        self.w = {k: v.astype(np.float64) for k, v in weights.items()}
        self.layout = layout
        self.rope_from_buffers = rope_from_buffers

    def _canon(self, x, path):
        w = conv_weight_ck(self.w[f"{path}.conv.weight"], self.layout)
        b = self.w.get(f"{path}.conv.bias") if self.c["canon_bias"] else None
        return canon(x, w, b, self.c)

    def _inv_freq(self, i):
        c = self.c
        key = f"model.layers.{i}.self_attn.rotary_emb.inv_freq"
        if self.rope_from_buffers and key in self.w:
            return self.w[key]
        return default_inv_freq(c["head_dim"], c["rope_theta"])

    def forward(self, tokens):
        """tokens: int array [L] -> logits float64 [L, V] (after soft-cap)."""
        c, w = self.c, self.w
        L = len(tokens)
        Hq, Hkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        eps = c["rms_norm_eps"]
        cs = c["canon_set"]
        pos = np.arange(L)
        causal = np.triu(np.ones((L, L), dtype=bool), k=1)  # True = masked

        x = w["model.embed_tokens.weight"][np.asarray(tokens)]  # [L, H]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}"
            # --- attention block -------------------------------------------------
            h = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
            if "A" in cs:
                h = self._canon(h, f"{p}.canon_a")
            a = f"{p}.self_attn"
            q = linear(h, w[f"{a}.q_proj.weight"])  # [L, Hq*D]
            k = linear(h, w[f"{a}.k_proj.weight"])  # [L, Hkv*D]
            v = linear(h, w[f"{a}.v_proj.weight"])  # [L, Hkv*D]
            if "B" in cs:  # on the flat projections, before the head split and RoPE
                q = self._canon(q, f"{a}.canon_b_q")
                k = self._canon(k, f"{a}.canon_b_k")
                v = self._canon(v, f"{a}.canon_b_v")
            q = q.reshape(L, Hq, D).transpose(1, 0, 2)  # [Hq, L, D]
            k = k.reshape(L, Hkv, D).transpose(1, 0, 2)
            v = v.reshape(L, Hkv, D).transpose(1, 0, 2)
            inv_freq = self._inv_freq(i)
            q = rope(q, inv_freq, pos)
            k = rope(k, inv_freq, pos)
            if c["use_qk_norm"]:  # per head over head_dim, AFTER RoPE
                q = rms_norm(q, w[f"{a}.q_norm.weight"], eps)
                k = rms_norm(k, w[f"{a}.k_norm.weight"], eps)
            rep = Hq // Hkv
            k = np.repeat(k, rep, axis=0)  # head h -> kv head h // rep
            v = np.repeat(v, rep, axis=0)
            s = (q @ k.transpose(0, 2, 1)) * (D**-0.5)  # [Hq, L, L]
            s = np.where(causal[None], -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            pr = np.exp(s)
            pr = pr / pr.sum(axis=-1, keepdims=True)
            o = (pr @ v).transpose(1, 0, 2).reshape(L, Hq * D)
            x = x + linear(o, w[f"{a}.o_proj.weight"])
            # --- MLP block -------------------------------------------------------
            h = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
            if "C" in cs:
                h = self._canon(h, f"{p}.canon_c")
            m = f"{p}.mlp"
            inter = silu(linear(h, w[f"{m}.gate_proj.weight"])) * linear(h, w[f"{m}.up_proj.weight"])
            if "D" in cs:
                inter = self._canon(inter, f"{m}.canon_d")
            x = x + linear(inter, w[f"{m}.down_proj.weight"])

        x = rms_norm(x, w["model.norm.weight"], eps)
        if c["tie_word_embeddings"]:
            logits = x @ w["model.embed_tokens.weight"].T
        else:
            logits = linear(x, w["lm_head.weight"])
        cap = c["logit_softcap"]
        if c["use_logit_softcap"] and cap > 0:
            logits = cap * np.tanh(logits / cap)
        return logits

    # Incremental decode with a KV cache and per-canon conv state: used only as a
    # self-check that the full forward is causal and cache-consistent.
    def decode_incremental(self, tokens):
        c, w = self.c, self.w
        Hq, Hkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        eps, cs, K = c["rms_norm_eps"], c["canon_set"], c["canon_kernel"]
        n = c["num_hidden_layers"]
        kv = [([], []) for _ in range(n)]
        state = {}

        def step_canon(x, path):  # x: [C] one token
            hist = state.setdefault(path, [np.zeros_like(x) for _ in range(K - 1)])
            window = np.stack(hist + [x], axis=0)  # [K, C]
            wck = conv_weight_ck(w[f"{path}.conv.weight"], self.layout)
            out = (window * wck.T).sum(axis=0)
            if c["canon_bias"] and f"{path}.conv.bias" in w:
                out = out + w[f"{path}.conv.bias"]
            if c["canon_activation"]:
                out = silu(out)
            state[path] = (hist + [x])[1:]
            return x + out if c["canon_residual"] else out

        outs = []
        for t, tok in enumerate(tokens):
            x = w["model.embed_tokens.weight"][tok]
            for i in range(n):
                p = f"model.layers.{i}"
                a = f"{p}.self_attn"
                h = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
                if "A" in cs:
                    h = step_canon(h, f"{p}.canon_a")
                q = w[f"{a}.q_proj.weight"] @ h
                k = w[f"{a}.k_proj.weight"] @ h
                v = w[f"{a}.v_proj.weight"] @ h
                if "B" in cs:
                    q = step_canon(q, f"{a}.canon_b_q")
                    k = step_canon(k, f"{a}.canon_b_k")
                    v = step_canon(v, f"{a}.canon_b_v")
                q = rope(q.reshape(Hq, 1, D), self._inv_freq(i), np.array([t]))
                k = rope(k.reshape(Hkv, 1, D), self._inv_freq(i), np.array([t]))
                if c["use_qk_norm"]:
                    q = rms_norm(q, w[f"{a}.q_norm.weight"], eps)
                    k = rms_norm(k, w[f"{a}.k_norm.weight"], eps)
                kv[i][0].append(k[:, 0])
                kv[i][1].append(v.reshape(Hkv, D))
                Ks = np.stack(kv[i][0], axis=1)  # [Hkv, T, D]
                Vs = np.stack(kv[i][1], axis=1)
                o = np.zeros((Hq, D))
                for hh in range(Hq):
                    g = hh // (Hq // Hkv)
                    sc = Ks[g] @ q[hh, 0] * D**-0.5
                    pr = np.exp(sc - sc.max())
                    o[hh] = (pr / pr.sum()) @ Vs[g]
                x = x + w[f"{a}.o_proj.weight"] @ o.reshape(-1)
                h = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
                if "C" in cs:
                    h = step_canon(h, f"{p}.canon_c")
                m = f"{p}.mlp"
                inter = silu(w[f"{m}.gate_proj.weight"] @ h) * (w[f"{m}.up_proj.weight"] @ h)
                if "D" in cs:
                    inter = step_canon(inter, f"{m}.canon_d")
                x = x + w[f"{m}.down_proj.weight"] @ inter
            x = rms_norm(x, w["model.norm.weight"], eps)
            head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
            lg = head @ x
            cap = c["logit_softcap"]
            if c["use_logit_softcap"] and cap > 0:
                lg = cap * np.tanh(lg / cap)
            outs.append(lg)
        return np.stack(outs, axis=0)


# ---------------------------------------------------------------------------
# Random checkpoints
# ---------------------------------------------------------------------------


def make_weights(cfg: dict, rng: np.random.Generator, inv_freq_mode: str) -> dict:
    """Random float32 weights in canonical MLX layout (conv weights [C, K, 1])."""
    c = resolve(cfg)
    H, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    Hq, Hkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    K, cs = c["canon_kernel"], c["canon_set"]

    def n(*shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def lin(out, inp, gain=1.0):
        return n(out, inp, std=gain / np.sqrt(inp))

    def norm_w(dim):
        return (1.0 + 0.2 * rng.standard_normal(dim)).astype(np.float32)

    # Without the canon residual the conv is the only path, so it gets larger taps.
    conv_std = 0.35 if c["canon_residual"] else 1.5

    def conv(dim):
        return n(dim, K, 1, std=conv_std)

    w = {"model.embed_tokens.weight": n(V, H, std=0.6)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        m = f"{p}.mlp"
        w[f"{p}.input_layernorm.weight"] = norm_w(H)
        w[f"{p}.post_attention_layernorm.weight"] = norm_w(H)
        w[f"{a}.q_proj.weight"] = lin(Hq * D, H, 1.5)
        w[f"{a}.k_proj.weight"] = lin(Hkv * D, H, 1.5)
        w[f"{a}.v_proj.weight"] = lin(Hkv * D, H)
        w[f"{a}.o_proj.weight"] = lin(H, Hq * D, 2.0)
        if c["use_qk_norm"]:
            w[f"{a}.q_norm.weight"] = norm_w(D)
            w[f"{a}.k_norm.weight"] = norm_w(D)
        w[f"{m}.gate_proj.weight"] = lin(I, H)
        w[f"{m}.up_proj.weight"] = lin(I, H)
        w[f"{m}.down_proj.weight"] = lin(H, I, 3.0)
        canon_paths = []
        if "A" in cs:
            canon_paths.append((f"{p}.canon_a", H))
        if "B" in cs:
            canon_paths += [(f"{a}.canon_b_q", Hq * D), (f"{a}.canon_b_k", Hkv * D), (f"{a}.canon_b_v", Hkv * D)]
        if "C" in cs:
            canon_paths.append((f"{p}.canon_c", H))
        if "D" in cs:
            canon_paths.append((f"{m}.canon_d", I))
        for path, dim in canon_paths:
            w[f"{path}.conv.weight"] = conv(dim)
            if c["canon_bias"]:
                w[f"{path}.conv.bias"] = n(dim, std=0.1)
        # The real checkpoints ship a per-layer RoPE buffer under this name.
        base = default_inv_freq(D, c["rope_theta"])
        if inv_freq_mode == "standard":
            w[f"{a}.rotary_emb.inv_freq"] = base.astype(np.float32)
        elif inv_freq_mode == "perturbed":
            fac = rng.uniform(0.5, 2.0, size=D // 2)
            w[f"{a}.rotary_emb.inv_freq"] = (base * fac).astype(np.float32)
    w["model.norm.weight"] = norm_w(H)
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = n(V, H, std=0.6)
    return w


def to_hf_layout(weights: dict, tied: bool) -> dict:
    """PyTorch-checkpoint layout: conv weights [C, 1, K]; tied lm_head duplicated."""
    out = {}
    for k, v in weights.items():
        if k.endswith(".conv.weight"):
            v = np.ascontiguousarray(v.transpose(0, 2, 1))
        out[k] = v
    if tied:
        out["lm_head.weight"] = weights["model.embed_tokens.weight"].copy()
    return out


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------

BASE_CONFIG = {
    "architectures": ["DharaARForCausalLM"],
    "model_type": "dhara_ar",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 8000000.0,
    "hidden_act": "silu",
    **FEATURE_DEFAULTS,
    "mask_token_id": 255,
    "torch_dtype": "float32",
}

FIXTURES = [
    {
        "name": "dhara-f32",
        "seed": 1000,
        "config": {},
        "layout": "mlx",
        "inv_freq": "standard",
        "notes": "NumPy reference (xtask/py/dhara_ref.py), not mlx-lm; real defaults: canon ABCD, "
        "residual, no activation, qk-norm after RoPE, softcap 30, tied; conv weights MLX [C,K,1]",
    },
    {
        "name": "dhara-hf",
        "same_as": "dhara-f32",
        "layout": "hf",
        "notes": "NumPy reference (xtask/py/dhara_ref.py), not mlx-lm; dhara-f32's model in the PyTorch "
        "checkpoint layout: conv weights [C,1,K], duplicate tied lm_head.weight; same reference",
    },
    {
        "name": "dhara-act-nores",
        "seed": 2000,
        "config": {
            "canon_set": "AC",
            "canon_activation": True,
            "canon_residual": False,
            "head_dim": None,  # omitted: must default to hidden_size / num_attention_heads
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
        },
        "layout": "mlx",
        "inv_freq": "standard",
        "notes": "NumPy reference (xtask/py/dhara_ref.py), not mlx-lm; canon_set AC, "
        "canon = silu(conv(x)) (activation on, no residual), head_dim omitted, theta 1e4, eps 1e-5",
    },
    {
        "name": "dhara-switches",
        "seed": 3000,
        "config": {
            "canon_set": "BD",
            "canon_kernel": 3,
            "canon_activation": True,
            "canon_residual": True,
            "use_qk_norm": False,
            "use_logit_softcap": False,
            "tie_word_embeddings": False,
        },
        "layout": "mlx",
        "inv_freq": "standard",
        "notes": "NumPy reference (xtask/py/dhara_ref.py), not mlx-lm; canon_set BD, kernel 3, "
        "canon = x + silu(conv(x)), no qk-norm, no softcap, untied lm_head",
    },
    {
        "name": "dhara-invfreq",
        "seed": 4000,
        "config": {},
        "layout": "mlx",
        "inv_freq": "perturbed",
        "rope_from_buffers": True,
        "notes": "NumPy reference (xtask/py/dhara_ref.py), not mlx-lm; as dhara-f32 but each layer's "
        "self_attn.rotary_emb.inv_freq differs from rope_theta^(-2i/d): RoPE must use the "
        "checkpoint buffers (OptiQ port behaviour; mlex 0.1.3 recomputes and would fail)",
    },
]


def greedy(model: Model, prompt: np.ndarray):
    seq = list(int(t) for t in prompt)
    toks, step_logits, gaps = [], [], []
    for _ in range(GEN_LEN):
        lg = model.forward(np.array(seq))[-1]
        t = int(np.argmax(lg))
        top2 = np.sort(lg)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        toks.append(t)
        step_logits.append(lg)
        seq.append(t)
    return np.array(toks), np.stack(step_logits), min(gaps)


def build(fx: dict, min_distinct=10, min_gap=0.04, tries=200):
    """Pick the first seed (fx.seed, fx.seed+1, ...) giving non-degenerate greedy output."""
    cfg_in = dict(BASE_CONFIG)
    for k, v in fx["config"].items():
        if v is None:
            cfg_in.pop(k, None)
        else:
            cfg_in[k] = v
    for seed in range(fx["seed"], fx["seed"] + tries):
        rng = np.random.default_rng(seed)
        weights = make_weights(cfg_in, rng, fx["inv_freq"])
        prompt = rng.integers(0, cfg_in["vocab_size"], size=PROMPT_LEN).astype(np.int32)
        model = Model(cfg_in, weights, "mlx", fx.get("rope_from_buffers", False))
        logits_full = model.forward(prompt)
        toks, step_logits, gap = greedy(model, prompt)
        distinct = len(set(toks.tolist()))
        if distinct >= min_distinct and gap >= min_gap:
            return dict(cfg=cfg_in, weights=weights, prompt=prompt, logits_full=logits_full,
                        greedy=toks, step_logits=step_logits, seed=seed, min_gap=gap,
                        distinct=distinct, model=model)
    raise RuntimeError(f"{fx['name']}: no non-degenerate seed found")


def self_check(b: dict, name: str):
    """Consistency checks of the reference itself (not against another implementation)."""
    m = b["model"]
    full = np.concatenate([b["prompt"], b["greedy"][:-1]])
    lf = m.forward(full)
    # step logits = last-position logits of the prefix forward
    assert np.allclose(lf[PROMPT_LEN - 1 :], b["step_logits"], atol=1e-9), name
    assert np.allclose(lf[:PROMPT_LEN], b["logits_full"], atol=1e-9), name
    # an independent token-by-token decoder with KV cache + conv state agrees
    inc = m.decode_incremental(full.tolist())
    err = float(np.abs(inc - lf).max())
    assert err < 1e-9, (name, err)
    return err


def write_fixture(out_dir: str, name: str, b: dict, layout: str):
    d = os.path.join(out_dir, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    cfg = dict(b["cfg"])
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    if layout == "mlx":
        save_file(b["weights"], os.path.join(d, "model.safetensors"), metadata={"format": "mlx"})
    else:
        hf = to_hf_layout(b["weights"], resolve(cfg)["tie_word_embeddings"])
        save_file(hf, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    ref = {
        "prompt": b["prompt"].astype(np.int32),
        "logits_full": b["logits_full"].astype(np.float32),
        "greedy": b["greedy"].astype(np.int32),
        "step_logits": b["step_logits"].astype(np.float32),
    }
    save_file(ref, os.path.join(d, "reference.safetensors"),
              # one metadata key: safetensors writes several in hash order (not byte-stable)
              metadata={"dhara_ref": json.dumps({"generator": "xtask/py/dhara_ref.py", "seed": b["seed"],
                                                 "min_top2_gap": round(b["min_gap"], 6)})})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--only", nargs="*", help="fixture names to build (default: all)")
    ap.add_argument("--no-self-check", action="store_true", help="skip the incremental-decode check")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    built, manifest = {}, []
    for fx in FIXTURES:
        name = fx["name"]
        if args.only and name not in args.only:
            continue
        if "same_as" in fx:
            src = fx["same_as"]
            if src not in built:
                built[src] = build(next(f for f in FIXTURES if f["name"] == src))
            b = built[src]
        else:
            b = built.get(name) or build(fx)
            built[name] = b
        if not args.no_self_check:
            err = self_check(b, name)
        else:
            err = float("nan")
        write_fixture(args.out, name, b, fx["layout"])
        manifest.append({
            "name": name, "arch": "dhara_ar", "dtype": "float32", "quant": None,
            "layout": fx["layout"], "path": name, "reference": f"{name}/reference.safetensors",
            "notes": fx["notes"],
        })
        print(f"{name}: seed {b['seed']}, greedy {b['greedy'].tolist()}, distinct {b['distinct']}, "
              f"min top-2 gap {b['min_gap']:.4f}, incremental-vs-full max err {err:.2e}",
              file=sys.stderr)

    with open(os.path.join(args.out, "dhara-manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
