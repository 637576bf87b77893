"""GGUF files of the hybrid families in llama.cpp's layout, and back.

``hf_to_gguf`` does to a Hugging Face checkpoint what llama.cpp's converter
does (convert_hf_to_gguf.py; since 2026-05 its classes live in
conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase,
Qwen3_5TextModel, Qwen3_5MoeTextModel, and conversion/nemotron.py:
NemotronHModel; read at upstream llama.cpp 1425386f, 2026-07-23):

* qwen3next / qwen35 / qwen35moe: the norms Hugging Face stores as offsets
  (every ``*norm.weight`` but ``linear_attn.norm``) get +1; ``A_log``
  becomes ``ssm_a = -exp(A_log)``; ``dt_bias`` becomes ``ssm_dt.bias``;
  conv weights are squeezed to ``[channels, K]``; Qwen3-Next's fused
  ``in_proj_qkvz`` (rows grouped per key head) is split into ``attn_qkv``
  (all q, all k, all v) and ``attn_gate`` (z); Qwen3.5 moves its value
  heads from grouped order (head ``g*r + j`` for key head ``g``) to tiled
  order (slot ``j*nk + g``) in every linear-attention tensor; experts are
  stacked; ``mtp.*`` is dropped (``--no-mtp`` for Qwen3.5) except in the
  ``mtp`` variant, which writes it as the converter does (``mtp_block``).
* nemotron_h / nemotron_h_moe: ``ssm_a = -exp(A_log)`` and ``ssm_d`` as
  ``[heads, 1]``; the gated norm as ``[groups, d_inner / groups]``; conv
  squeezed; attention q/k rows in LLaMA's rotary permutation (although the
  model has no RoPE); experts stacked; per-layer ``head_count_kv`` and
  ``feed_forward_length`` arrays encode the layer pattern.

``gguf_to_mlx`` is the inverse into mlx-lm's (sanitized) layout, applied to
the gguf package's dequantization: mlx-lm on its result is the reference
the Rust reader is compared with. The transforms were checked once against
llama.cpp's own converter on the ``*-hf`` fixtures (same tensor names,
shapes and bytes at F32 and Q8_0); the converter needs torch and is not
run here.
"""

from __future__ import annotations

import re

import gguf
import numpy as np

# mlx-lm model_type -> llama.cpp general.architecture
HYBRID_ARCH = {
    "qwen3_next": "qwen3next",
    "qwen3_5": "qwen35",
    "qwen3_5_moe": "qwen35moe",
    "nemotron_h": "nemotron_h",
}


def text_of(cfg: dict) -> dict:
    return {**cfg, **cfg["text_config"]} if "text_config" in cfg else cfg


def gguf_arch(cfg: dict) -> str:
    if cfg["model_type"] == "nemotron_h":
        # The converter switches on the presence of num_experts_per_tok.
        return "nemotron_h_moe" if "num_experts_per_tok" in cfg else "nemotron_h"
    return HYBRID_ARCH[cfg["model_type"]]


# ---------------------------------------------------------------------------
# Head reorders
# ---------------------------------------------------------------------------


def v_tiled(t: np.ndarray, dim: int, nk: int, r: int, hd: int) -> np.ndarray:
    """Grouped value heads (head g*r+j) -> tiled (slot j*nk+g) along ``dim``."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [nk, r, hd] + shape[dim + 1 :])
    return np.ascontiguousarray(np.swapaxes(t, dim, dim + 1)).reshape(shape)


def v_grouped(t: np.ndarray, dim: int, nk: int, r: int, hd: int) -> np.ndarray:
    """Inverse of ``v_tiled``."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [r, nk, hd] + shape[dim + 1 :])
    return np.ascontiguousarray(np.swapaxes(t, dim, dim + 1)).reshape(shape)


def v_reordered(order, t: dict, name: str, v: np.ndarray) -> np.ndarray:
    """The value-head rows (columns of ``out_proj``) of the Gated DeltaNet
    tensor ``name`` (``conv1d`` squeezed to [C, K]) put in ``order``
    (``v_tiled`` or ``v_grouped``); other tensors as they are."""
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    r, dv = nv // nk, t["linear_value_head_dim"]
    q_k = 2 * nk * t["linear_key_head_dim"]
    if name in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        return np.concatenate([v[:q_k], order(v[q_k:], 0, nk, r, dv)])
    if name == "linear_attn.in_proj_z.weight":
        return order(v, 0, nk, r, dv)
    if name in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.A_log", "linear_attn.dt_bias"):
        return order(v, 0, nk, r, 1)
    if name == "linear_attn.out_proj.weight":
        return order(v, 1, nk, r, dv)
    return v


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: within each head, row p*hd/2+i -> row 2i+p."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------
# Hugging Face -> GGUF
# ---------------------------------------------------------------------------

QWEN_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
}

NEMOTRON_LAYER = {
    "norm.weight": "attn_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.conv1d.weight": "ssm_conv1d.weight",
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.dt_bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.D": "ssm_d",
    "mixer.norm.weight": "ssm_norm.weight",
    "mixer.out_proj.weight": "ssm_out.weight",
    "mixer.q_proj.weight": "attn_q.weight",
    "mixer.k_proj.weight": "attn_k.weight",
    "mixer.v_proj.weight": "attn_v.weight",
    "mixer.o_proj.weight": "attn_output.weight",
    "mixer.up_proj.weight": "ffn_up.weight",
    "mixer.down_proj.weight": "ffn_down.weight",
    "mixer.gate.weight": "ffn_gate_inp.weight",
    "mixer.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mixer.experts.up_proj.weight": "ffn_up_exps.weight",
    "mixer.experts.down_proj.weight": "ffn_down_exps.weight",
    "mixer.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mixer.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}

GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "backbone.embeddings.weight": "token_embd.weight",
    "backbone.norm_f.weight": "output_norm.weight",
}


def stack_hf_experts(hf: dict[str, np.ndarray], root: str) -> dict[str, np.ndarray]:
    """Per-expert ``{root}.experts.E.X.weight`` -> ``{root}.experts.X.weight``
    stacked in expert order (Qwen2MoeModel / NemotronH ``torch.stack``);
    fused ``experts.gate_up_proj`` [E, 2F, H] split, gate first."""
    out: dict[str, np.ndarray] = {}
    per: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for k, v in hf.items():
        m = re.fullmatch(rf"(.*\.{root})\.experts\.(\d+)\.(\w+)\.weight", k)
        if m:
            per.setdefault((m[1], m[3]), {})[int(m[2])] = v
        elif k.endswith(f".{root}.experts.gate_up_proj"):
            base = k[: -len(".gate_up_proj")]
            half = v.shape[1] // 2
            out[f"{base}.gate_proj.weight"] = v[:, :half]
            out[f"{base}.up_proj.weight"] = v[:, half:]
        elif k.endswith(f".{root}.experts.down_proj"):
            out[f"{k}.weight"] = v
        else:
            out[k] = v
    for (prefix, w), experts in per.items():
        out[f"{prefix}.experts.{w}.weight"] = np.stack([experts[e] for e in range(len(experts))])
    return out


VARIANTS = {
    # llama.cpp before 2026-01-11 (506bb6e01): Qwen3-Next's in_proj_qkvz
    # stored whole as ssm_in, and no full_attention_interval key.
    "legacy": "qwen3_next",
    # --fuse-gate-up-exps (since 2026-02-26): ffn_gate_up_exps [E, 2F, H].
    "fused": "qwen3_5_moe",
    # Since 2026-05-16 the converter keeps Qwen3.5's multi-token-prediction
    # block as an extra blk.L (block_count counts it) with nextn.* tensors.
    "mtp": "qwen3_5",
}


def hf_to_gguf(cfg: dict, hf: dict[str, np.ndarray], variant: str = "") -> list[tuple[str, np.ndarray]]:
    """GGUF tensor names and float32 values, as the converter makes them
    (``variant``: one of VARIANTS, an older or optional layout)."""
    t = text_of(cfg)
    family = cfg["model_type"]
    nemotron = family == "nemotron_h"
    hf = {k.replace("language_model.", "", 1): np.asarray(v, dtype=np.float32) for k, v in hf.items()}
    mtp = {k: v for k, v in hf.items() if k.startswith("mtp.")}
    hf = {k: v for k, v in hf.items() if not k.startswith(("mtp.", "model.visual.", "model.mtp."))}
    hf = stack_hf_experts(hf, "mixer" if nemotron else "mlp")
    out = []
    for name, v in sorted(hf.items()):
        if name in GLOBAL:
            if family != "nemotron_h" and name == "model.norm.weight":
                v = v + 1
            out.append((GLOBAL[name], v))
            continue
        m = re.fullmatch(r"(?:model|backbone)\.layers\.(\d+)\.(.+)", name)
        if m is None:
            raise ValueError(f"{name}: not a tensor the converter maps")
        bid, rest = int(m[1]), m[2]
        table = NEMOTRON_LAYER if nemotron else QWEN_LAYER
        if rest not in table and rest != "linear_attn.in_proj_qkvz.weight":
            raise ValueError(f"{name}: not a tensor the converter maps")
        if nemotron:
            v = nemotron_tensor(cfg, rest, v)
        else:
            pieces = qwen_tensor(t, family, rest, v, variant)
            for gname, value in pieces:
                out.append((f"blk.{bid}.{gname}", value))
            continue
        out.append((f"blk.{bid}.{table[rest]}", v))
    if variant == "fused":
        names = dict(out)
        for bid in range(t["num_hidden_layers"]):
            gate = names.pop(f"blk.{bid}.ffn_gate_exps.weight")
            up = names.pop(f"blk.{bid}.ffn_up_exps.weight")
            names[f"blk.{bid}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
        out = sorted(names.items())
    if variant == "mtp":
        out += mtp_block(t, family, mtp)
    return out


# The head's own tensors (conversion/qwen.py, _Qwen35MtpMixin's remapper).
NEXTN = {
    "mtp.fc.weight": "nextn.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "mtp.norm.weight": "nextn.shared_head_norm.weight",
}


def mtp_block(t: dict, family: str, mtp: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """The checkpoint's multi-token-prediction block as the converter writes
    it: ``mtp.layers.i`` as the layer ``blk.{L+i}`` (its tensors converted
    as any layer's), the head's tensors beside it as ``nextn.*``, every norm
    with its +1."""
    L = t["num_hidden_layers"]
    out = []
    for name, v in sorted(stack_hf_experts(mtp, "mlp").items()):
        if name in NEXTN:
            out.append((f"blk.{L}.{NEXTN[name]}", v + 1 if "norm" in name else v))
            continue
        m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", name)
        if m is None:
            raise ValueError(f"{name}: not a tensor the converter maps")
        for gname, value in qwen_tensor(t, family, m[2], v):
            out.append((f"blk.{L + int(m[1])}.{gname}", value))
    return out


def qwen_tensor(t: dict, family: str, rest: str, v: np.ndarray, variant: str = "") -> list[tuple[str, np.ndarray]]:
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    r = nv // nk
    if family != "qwen3_next" and nk != nv and rest.startswith("linear_attn."):
        # _LinearAttentionVReorderBase, before the Qwen3-Next transforms.
        if rest == "linear_attn.conv1d.weight":
            v = v.squeeze()
        v = v_reordered(v_tiled, t, rest, v)
    if rest.endswith(".A_log"):
        v = -np.exp(v)
    elif "conv1d" in rest:
        v = v.squeeze()
    elif rest.endswith("norm.weight") and not rest.endswith("linear_attn.norm.weight"):
        v = v + 1
    if rest == "linear_attn.in_proj_qkvz.weight" and variant == "legacy":
        return [("ssm_in.weight", v)]
    if rest == "linear_attn.in_proj_qkvz.weight":
        split = [dk, dk, r * dv, r * dv]
        x = v.T.reshape(v.shape[1], nk, sum(split))
        bounds = np.cumsum(split)[:-1]
        q, k, val, z = np.split(x, bounds, axis=-1)
        q, k, val, z = (a.reshape(v.shape[1], -1) for a in (q, k, val, z))
        qkv = np.concatenate([q, k, val], axis=-1).T
        return [("attn_qkv.weight", np.ascontiguousarray(qkv)), ("attn_gate.weight", np.ascontiguousarray(z.T))]
    return [(QWEN_LAYER[rest], v)]


def nemotron_tensor(cfg: dict, rest: str, v: np.ndarray) -> np.ndarray:
    if rest == "mixer.A_log":
        return (-np.exp(v)).reshape(-1, 1)
    if rest == "mixer.D":
        return v.reshape(-1, 1)
    if rest == "mixer.norm.weight":
        return v.reshape(cfg["n_groups"], -1)
    if rest == "mixer.conv1d.weight":
        return v.squeeze()
    if rest == "mixer.q_proj.weight":
        return llama_permute(v, cfg["num_attention_heads"])
    if rest == "mixer.k_proj.weight":
        return llama_permute(v, cfg["num_key_value_heads"])
    return v


def tensor_type(name: str, value: np.ndarray, qtype) -> "gguf.GGMLQuantizationType":
    """ModelBase.prepare_tensors' choice of type for a tensor."""
    F32 = gguf.GGMLQuantizationType.F32
    if value.ndim <= 1 or name.endswith("_norm.weight"):
        return F32
    if re.search(r"\.(ffn_gate_inp|ffn_gate_inp_shexp|ssm_conv1d)\.weight$", name) or name[-7:] != ".weight":
        return F32
    return qtype


def write_hybrid_gguf(path, cfg: dict, hf: dict[str, np.ndarray], qtype, file_type, add_vocab, edit=None, variant: str = "", encode=None) -> None:
    """A GGUF of ``cfg``'s hybrid with the converter's metadata keys;
    ``edit(writer, arch)`` may then overwrite some (for broken files);
    ``encode(value)`` gives the bytes of a quantized tensor where the gguf
    package has no encoder (the K-quants)."""
    t = text_of(cfg)
    arch = gguf_arch(cfg)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"mlex tiny {arch}")
    if cfg["model_type"] == "nemotron_h":
        pattern = cfg["hybrid_override_pattern"]
        moe = arch == "nemotron_h_moe"
        heads = cfg["mamba_num_heads"]  # Mamba2 heads, also the time-step rank
        w.add_block_count(len(pattern))
        w.add_context_length(2**20)
        w.add_embedding_length(cfg["hidden_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_layer_norm_rms_eps(cfg["layer_norm_epsilon"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_ssm_conv_kernel(cfg["conv_kernel"])
        w.add_ssm_state_size(cfg["ssm_state_size"])
        w.add_ssm_group_count(cfg["n_groups"])
        w.add_ssm_inner_size(heads * cfg["mamba_head_dim"])
        w.add_ssm_time_step_rank(heads)
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if c == "*" else 0 for c in pattern])
        ff = cfg["moe_intermediate_size"] if moe else cfg["intermediate_size"]
        w.add_feed_forward_length([ff if c == ("E" if moe else "-") else 0 for c in pattern])
        if moe:
            w.add_expert_count(cfg["n_routed_experts"])
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
            w.add_expert_shared_count(cfg["n_shared_experts"])
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
            w.add_expert_group_count(cfg["n_group"])
            w.add_expert_group_used_count(cfg["topk_group"])
    else:
        rope = t.get("rope_parameters") or {}
        theta = rope.get("rope_theta", t.get("rope_theta"))
        prf = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
        w.add_block_count(t["num_hidden_layers"] + (variant == "mtp"))
        if variant == "mtp":
            w.add_nextn_predict_layers(1)
        w.add_context_length(t["max_position_embeddings"])
        w.add_embedding_length(t["hidden_size"])
        w.add_feed_forward_length(t["intermediate_size"])
        w.add_head_count(t["num_attention_heads"])
        w.add_head_count_kv(t["num_key_value_heads"])
        if "mrope_section" in rope:
            w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
        w.add_rope_freq_base(theta)
        w.add_layer_norm_rms_eps(t["rms_norm_eps"])
        w.add_key_length(t["head_dim"])
        w.add_value_length(t["head_dim"])
        if t.get("num_experts"):
            w.add_expert_count(t["num_experts"])
            w.add_expert_used_count(t["num_experts_per_tok"])
            w.add_expert_feed_forward_length(t["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(t["shared_expert_intermediate_size"])
        w.add_ssm_conv_kernel(t["linear_conv_kernel_dim"])
        w.add_ssm_state_size(t["linear_key_head_dim"])
        w.add_ssm_group_count(t["linear_num_key_heads"])
        w.add_ssm_time_step_rank(t["linear_num_value_heads"])
        w.add_ssm_inner_size(t["linear_value_head_dim"] * t["linear_num_value_heads"])
        if variant != "legacy":
            w.add_full_attention_interval(t.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(t["head_dim"] * prf))
    if cfg["model_type"] == "nemotron_h":
        w.add_vocab_size(t["vocab_size"])
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(w)
    if edit is not None:
        edit(w, arch)
    for name, value in hf_to_gguf(cfg, hf, variant):
        add_tensor(w, name, value, tensor_type(name, value, qtype), encode)
    write_out(w)


def add_tensor(w: "gguf.GGUFWriter", name: str, value: np.ndarray, ty, encode=None) -> None:
    """``value`` as a tensor of type ``ty``: F32 and F16 as arrays, another
    type as the bytes of ``encode(value)`` where given (the K-quants, which
    the gguf package cannot encode) or of the gguf package's quantizer."""
    if ty == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, value.astype(np.float32))
    elif ty == gguf.GGMLQuantizationType.F16:
        w.add_tensor(name, value.astype(np.float16))
    elif encode is not None:
        w.add_tensor(name, encode(value), raw_dtype=ty)
    else:
        w.add_tensor(name, gguf.quants.quantize(value, ty), raw_dtype=ty)


def write_out(w: "gguf.GGUFWriter") -> None:
    """Writes the file: header, metadata, tensors."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------
# GGUF -> mlx-lm (the reference's weights)
# ---------------------------------------------------------------------------


def gguf_to_mlx(cfg: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Dequantized GGUF tensors -> mlx-lm's sanitized names and layout."""
    t = text_of(cfg)
    family = cfg["model_type"]
    nemotron = family == "nemotron_h"
    prefix = "language_model." if family in ("qwen3_5", "qwen3_5_moe") else ""
    layer_names = {v: k for k, v in (NEMOTRON_LAYER if nemotron else QWEN_LAYER).items()}
    global_names = {
        "token_embd.weight": "backbone.embeddings.weight" if nemotron else f"{prefix}model.embed_tokens.weight",
        "output_norm.weight": "backbone.norm_f.weight" if nemotron else f"{prefix}model.norm.weight",
        "output.weight": f"{prefix}lm_head.weight",
    }
    out: dict[str, np.ndarray] = {}
    layers = t["num_hidden_layers"]
    for name, v in tensors.items():
        if re.fullmatch(rf"blk\.(\d+)\..*", name) and int(name.split(".")[1]) >= layers:
            continue  # a multi-token-prediction block
        if name in global_names:
            out[global_names[name]] = v
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        bid, rest = int(m[1]), m[2]
        if nemotron:
            hf = layer_names[rest]
            if hf == "mixer.A_log":
                v = np.log(-v.reshape(-1))
            elif hf == "mixer.D":
                v = v.reshape(-1)
            elif hf == "mixer.norm.weight":
                v = v.reshape(-1)
            elif hf == "mixer.conv1d.weight":
                v = v[:, :, None]
            elif hf == "mixer.q_proj.weight":
                v = llama_unpermute(v, cfg["num_attention_heads"])
            elif hf == "mixer.k_proj.weight":
                v = llama_unpermute(v, cfg["num_key_value_heads"])
            hf = hf.replace("mixer.experts.up_proj", "mixer.switch_mlp.fc1").replace("mixer.experts.down_proj", "mixer.switch_mlp.fc2")
            out[f"backbone.layers.{bid}.{hf}"] = v
            continue
        for hf, value in qwen_inverse(t, family, rest, v, tensors.get(f"blk.{bid}.attn_gate.weight")):
            out[f"{prefix}model.layers.{bid}.{hf}"] = value
    return out


def qwen_inverse(t: dict, family: str, rest: str, v: np.ndarray, gate):
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    r = nv // nk
    q_k = 2 * nk * dk
    if rest == "ssm_in.weight":
        return [("linear_attn.in_proj_qkvz.weight", v)]
    if rest == "ffn_gate_up_exps.weight":
        half = v.shape[1] // 2
        return [("mlp.switch_mlp.gate_proj.weight", v[:, :half]), ("mlp.switch_mlp.up_proj.weight", v[:, half:])]
    hf = {v_: k for k, v_ in QWEN_LAYER.items()}[rest]
    if family == "qwen3_next":
        if rest == "attn_gate.weight":
            return []  # folded into in_proj_qkvz with attn_qkv
        if rest == "attn_qkv.weight":
            h = v.shape[1]
            q = v[: nk * dk].T.reshape(h, nk, dk)
            k = v[nk * dk : q_k].T.reshape(h, nk, dk)
            val = v[q_k:].T.reshape(h, nk, r * dv)
            z = gate.T.reshape(h, nk, r * dv)
            v = np.concatenate([q, k, val, z], axis=-1).reshape(h, -1).T
            return [("linear_attn.in_proj_qkvz.weight", np.ascontiguousarray(v))]
    elif nk != nv and hf.startswith("linear_attn."):
        v = v_reordered(v_grouped, t, hf, v)
    if hf == "linear_attn.A_log":
        v = np.log(-v)
    elif hf == "linear_attn.conv1d.weight":
        v = v[:, :, None]
    hf = hf.replace("mlp.experts.", "mlp.switch_mlp.")
    # mlx-lm keeps the +1 of the offset norms in its sanitized weights.
    return [(hf, v)]
