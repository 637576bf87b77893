"""Writes the hybrid GGUF seeds of the gguf_header fuzz target
(fuzz/corpus/gguf_header/hybrid-*.gguf): F32 files of a few kB in llama.cpp's
qwen35moe, nemotron_h_moe and pre-2026 qwen3next layouts, so that mutations
start inside the hybrid conversion (the hybrid specs' [gguf] tables, crates/mlex-models/src/gguf).

    python xtask/py/fuzz_seeds.py   (with the reference venv's python)
"""
from pathlib import Path
import sys; sys.path.insert(0, str(Path(__file__).parent))
OUT = Path(__file__).resolve().parents[2] / "fuzz/corpus/gguf_header"
import fixtures as F, gguf_hybrid as G, numpy as np, gguf
from mlx.utils import tree_flatten
def tiny_vocab(w):
    w.add_tokenizer_model("gpt2"); w.add_token_list([chr(97+i) for i in range(8)]); w.add_token_merges([])
cases = {}
c = F.qwen3_5_config(moe=True); t = c["text_config"]
t.update(hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
         vocab_size=8, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=4, linear_value_head_dim=4,
         linear_conv_kernel_dim=2, full_attention_interval=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=4,
         shared_expert_intermediate_size=4)
cases["hybrid-qwen35moe.gguf"] = (c, F.hf_qwen3_5_moe, "")
c = F.nemotron_h_config("ME*")
c.update(hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, mamba_num_heads=2,
         mamba_head_dim=4, ssm_state_size=2, conv_kernel=2, n_groups=1, vocab_size=8, n_routed_experts=2, num_experts_per_tok=1,
         moe_intermediate_size=4, moe_shared_expert_intermediate_size=4, n_group=1, topk_group=1)
cases["hybrid-nemotron_h_moe.gguf"] = (c, F.hf_nemotron_h, "")
c = F.qwen3_next_config(moe=True)
c.update(hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
         vocab_size=8, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=4, linear_value_head_dim=4,
         linear_conv_kernel_dim=2, full_attention_interval=4, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=4,
         shared_expert_intermediate_size=4, decoder_sparse_step=1)
c["num_hidden_layers"] = 4
cases["hybrid-qwen3next-legacy.gguf"] = (c, F.hf_qwen3_next, "legacy")
for name, (cfg, to_hf, variant) in cases.items():
    m = F.random_model(cfg, 1)
    w = dict(tree_flatten(m.parameters()))
    hf = {k: np.array(v) for k, v in to_hf(dict(w), cfg, np.random.default_rng(0)).items()}
    hf = {k: v for k, v in hf.items() if not k.startswith(("mtp.", "model.visual."))}
    G.write_hybrid_gguf(f"{OUT}/{name}", cfg, hf, gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32, tiny_vocab, variant=variant)
