"""Random-weight checkpoints in real shapes (MLX-community layout, bf16) for GPU benchmarks."""
import json, os, sys, torch
from safetensors.torch import save_file

H, I, L, NH, KV, HD, V = 1024, 3072, 28, 16, 8, 128, 151936
g = torch.Generator().manual_seed(0)
def rnd(*shape, scale=0.02, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)
def ones(n):
    return (1.0 + 0.05 * torch.randn(n, generator=g)).to(torch.bfloat16)

def qwen35(out):
    nv, nk, dk, dv, K = 16, 8, 128, 128, 4
    kd, vd = nk * dk, nv * dv
    w, P = {}, "language_model.model"
    w[f"{P}.embed_tokens.weight"] = rnd(V, H)
    w[f"{P}.norm.weight"] = ones(H)
    for i in range(L):
        p = f"{P}.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = ones(H); w[f"{p}.post_attention_layernorm.weight"] = ones(H)
        w[f"{p}.mlp.gate_proj.weight"] = rnd(I, H); w[f"{p}.mlp.up_proj.weight"] = rnd(I, H); w[f"{p}.mlp.down_proj.weight"] = rnd(H, I)
        if (i + 1) % 4 != 0:
            a = f"{p}.linear_attn"
            w[f"{a}.in_proj_qkv.weight"] = rnd(2 * kd + vd, H); w[f"{a}.in_proj_z.weight"] = rnd(vd, H)
            w[f"{a}.in_proj_b.weight"] = rnd(nv, H); w[f"{a}.in_proj_a.weight"] = rnd(nv, H)
            w[f"{a}.conv1d.weight"] = rnd(2 * kd + vd, K, 1, scale=0.3); w[f"{a}.dt_bias"] = rnd(nv, scale=0.1)
            w[f"{a}.A_log"] = torch.rand(nv, generator=g) * 2 - 1; w[f"{a}.norm.weight"] = ones(dv)
            w[f"{a}.out_proj.weight"] = rnd(H, vd)
        else:
            a = f"{p}.self_attn"
            w[f"{a}.q_proj.weight"] = rnd(2 * NH * HD, H); w[f"{a}.k_proj.weight"] = rnd(KV * HD, H)
            w[f"{a}.v_proj.weight"] = rnd(KV * HD, H); w[f"{a}.o_proj.weight"] = rnd(H, NH * HD)
            w[f"{a}.q_norm.weight"] = ones(HD); w[f"{a}.k_norm.weight"] = ones(HD)
    text = dict(model_type="qwen3_5_text", hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                num_attention_heads=NH, num_key_value_heads=KV, head_dim=HD, vocab_size=V, rms_norm_eps=1e-6,
                max_position_embeddings=32768, tie_word_embeddings=True, linear_num_value_heads=nv,
                linear_num_key_heads=nk, linear_key_head_dim=dk, linear_value_head_dim=dv,
                linear_conv_kernel_dim=K, full_attention_interval=4,
                rope_parameters={"type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25})
    write(out, w, dict(model_type="qwen3_5", text_config=text, tie_word_embeddings=True))

def qwen3(out):
    w = {"model.embed_tokens.weight": rnd(V, H), "model.norm.weight": ones(H)}
    for i in range(L):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = ones(H); w[f"{p}.post_attention_layernorm.weight"] = ones(H)
        w[f"{p}.self_attn.q_proj.weight"] = rnd(NH * HD, H); w[f"{p}.self_attn.k_proj.weight"] = rnd(KV * HD, H)
        w[f"{p}.self_attn.v_proj.weight"] = rnd(KV * HD, H); w[f"{p}.self_attn.o_proj.weight"] = rnd(H, NH * HD)
        w[f"{p}.self_attn.q_norm.weight"] = ones(HD); w[f"{p}.self_attn.k_norm.weight"] = ones(HD)
        w[f"{p}.mlp.gate_proj.weight"] = rnd(I, H); w[f"{p}.mlp.up_proj.weight"] = rnd(I, H); w[f"{p}.mlp.down_proj.weight"] = rnd(H, I)
    write(out, w, dict(model_type="qwen3", hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                       num_attention_heads=NH, num_key_value_heads=KV, head_dim=HD, vocab_size=V, rms_norm_eps=1e-6,
                       max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0))

def write(out, w, cfg):
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, f"{out}/model.safetensors")
    json.dump(cfg, open(f"{out}/config.json", "w"))

qwen35(sys.argv[1] + "/qwen3_5-real"); qwen3(sys.argv[1] + "/qwen3-real")
