"""The named model shapes: each a dict of ModelConfig fields (model.moe as the object JSON would give), from the
published papers and Hugging Face config.json files; model/config/model.py's preset() builds one, with any field
overridden. It imports nothing of the project: the table reads on its own.
"""

from __future__ import annotations

from typing import Any

# What every Llama-family preset shares: RoPE, RMSNorm (eps 1e-5), SwiGLU, an untied head, no biases, bf16.
_LLAMA: dict[str, Any] = dict(position_embedding="rope", norm="rmsnorm", mlp="swiglu", tie_word_embeddings=False,
                              bias="none", layernorm_epsilon=1e-5, precision="bf16")

PRESETS: dict[str, dict[str, Any]] = {
    # Megatron-Turing NLG 530B (Smith et al. 2022): 105 layers, h 20480, 128 heads, seq 2048.
    "530b": dict(num_layers=105, hidden_size=20480, num_attention_heads=128, seq_length=2048,
                 recompute="full", precision="bf16"),
    # GPT-3 Small and XL shapes (Brown et al. 2020, table 2.1).
    "125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=2048, precision="bf16"),
    "1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, precision="bf16"),
    # For CPU tests and demos: the real GPT-2 vocabulary, a tiny trunk.
    "tiny": dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, precision="fp32"),
    # The Llama family, from the published Hugging Face config.json files (written from memory; the parameter count
    # of each equals transformers' model built from the same numbers: tests/test_llama_presets.py).
    # Llama-2-7B: 32 layers, h 4096, 32 heads (multi-head), ffn 11008, vocab 32000, theta 1e4, rms eps 1e-5.
    "llama2-7b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                      ffn_hidden_size=11008, vocab_size=32000, seq_length=4096, rope_theta=10000.0),
    # Meta-Llama-3-8B: 32 layers, h 4096, 32 heads, 8 KV heads, ffn 14336, vocab 128256, theta 5e5, rms eps 1e-5.
    "llama3-8b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      ffn_hidden_size=14336, vocab_size=128256, seq_length=8192, rope_theta=500000.0),
    # Meta-Llama-3-70B: 80 layers, h 8192, 64 heads, 8 KV heads, ffn 28672, vocab 128256, theta 5e5, rms eps 1e-5.
    "llama3-70b": dict(_LLAMA, num_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                       ffn_hidden_size=28672, vocab_size=128256, seq_length=8192, rope_theta=500000.0,
                       recompute="full"),
    # Mistral-7B-v0.1: 32 layers, h 4096, 32 heads, 8 KV heads, ffn 14336, vocab 32000, theta 1e4, rms eps 1e-5,
    # max positions 32768. Its 4096-token sliding window is not implemented: at seq_length <= 4096 it changes nothing.
    "mistral-7b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                       ffn_hidden_size=14336, vocab_size=32000, seq_length=4096, max_position_embeddings=32768,
                       rope_theta=10000.0),
    # Qwen2.5-7B: 28 layers, h 3584, 28 heads, 4 KV heads, ffn 18944, vocab 152064, theta 1e6, rms eps 1e-6, biases on
    # q, k and v only, untied, max positions 131072 (from memory; it changes no parameter).
    "qwen2.5-7b": dict(_LLAMA, num_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                       ffn_hidden_size=18944, vocab_size=152064, seq_length=4096, max_position_embeddings=131072,
                       rope_theta=1000000.0, layernorm_epsilon=1e-6, bias="qkv"),
    # Qwen3-0.6B: 28 layers, h 1024, 16 heads of head_dim 128 (2048 wide, not h), 8 KV heads, ffn 3072, vocab 151936,
    # theta 1e6, rms eps 1e-6, per-head RMSNorm on q and k, no bias, tied, max positions 40960 (from memory).
    "qwen3-0.6b": dict(_LLAMA, num_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, qk_layernorm=True, ffn_hidden_size=3072, vocab_size=151936, seq_length=4096,
                       max_position_embeddings=40960, rope_theta=1000000.0, layernorm_epsilon=1e-6,
                       tie_word_embeddings=True),
    # Mixture-of-Experts (model.moe; parameter counts equal transformers': tests/test_llama_presets.py). Each
    # aux_loss_coeff is the HF router_aux_loss_coef times top_k (MoEConfig.aux_loss_coeff says why).
    # Mixtral-8x7B-v0.1: 32 layers, h 4096, 32 heads, 8 KV heads, every block 8 experts of ffn 14336, top 2 (always
    # renormalised), vocab 32000, theta 1e6, rms eps 1e-5, untied, max positions 32768, no sliding window, aux coef
    # 0.02. ffn_hidden_size, the dense MLP's, serves no block: every one is sparse.
    "mixtral-8x7b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         ffn_hidden_size=14336, vocab_size=32000, seq_length=4096, max_position_embeddings=32768,
                         rope_theta=1000000.0,
                         moe=dict(num_experts=8, top_k=2, moe_ffn_hidden_size=14336, aux_loss_coeff=0.04)),
    # Qwen3-30B-A3B: 48 layers, h 2048, 32 heads of head_dim 128 (4096 wide, not h), 4 KV heads, per-head RMSNorm
    # on q and k, every block 128 experts of ffn 768, top 8, norm_topk_prob true, no shared expert, vocab 151936,
    # theta 1e6, no bias, untied; from memory: rms eps 1e-6, max positions 40960, the dense intermediate_size 6144
    # (no block uses it: mlp_only_layers is empty), aux coef 0.001.
    "qwen3-30b-a3b": dict(_LLAMA, num_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, qk_layernorm=True, ffn_hidden_size=6144, vocab_size=151936, seq_length=4096,
                          max_position_embeddings=40960, rope_theta=1000000.0, layernorm_epsilon=1e-6,
                          moe=dict(num_experts=128, top_k=8, moe_ffn_hidden_size=768, norm_topk_prob=True,
                                   aux_loss_coeff=0.008)),
    # A Llama shape for CPU tests and demos: GPT-2 vocabulary, 4 query heads per KV group, untied head.
    "llama-tiny": dict(_LLAMA, num_layers=4, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                       ffn_hidden_size=256, seq_length=64, precision="fp32"),
}
