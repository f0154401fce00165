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
    # DeepSeek-V3 and its descendants: multi-head latent attention (model.attention_type "mla", model/mla.py) and
    # fine-grained experts routed by sigmoid scores plus a balancing bias, within groups (model.moe.router
    # "sigmoid_bias"), one shared expert without a gate, the first blocks dense. Counts equal transformers'
    # DeepseekV3ForCausalLM built from the same numbers (tests/test_llama_presets.py), which leave DeepSeek-V3's
    # multi-token prediction module out (model.mtp: the paper's D 1, lambda 0.3, 0.1 after 10T tokens; Kimi-K2 and
    # Moonlight have none); model/summary.py prints it apart.
    # DeepSeek-V3 (its technical report, arXiv:2412.19437, and transformers' DeepseekV3Config defaults, which are V3's):
    # 61 layers, h 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128, the first 3
    # blocks dense (intermediate 18432), then 256 routed experts of 2048 and 1 shared (2048), top 8 in at most 4 of 8
    # groups, routed_scaling_factor 2.5, norm_topk_prob, vocab 129280, theta 1e4, rms eps 1e-6, untied. No auxiliary
    # loss: the paper's sequence-wise balance loss, alpha 1e-4, and its bias update speed gamma 1e-3. The YaRN
    # rope_scaling (factor 40 over 4096, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1; max positions 163840)
    # is the released checkpoint's config.json, from memory: DeepseekV3Config's defaults have none (and max
    # positions 4096), and the paper pre-trains at 4K before its two YaRN extensions. Precision bf16 here (the paper
    # trains in FP8).
    "deepseek-v3": dict(_LLAMA, num_layers=61, hidden_size=7168, num_attention_heads=128, attention_type="mla",
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, ffn_hidden_size=18432, vocab_size=129280, seq_length=4096,
                        max_position_embeddings=163840, rope_theta=10000.0, layernorm_epsilon=1e-6,
                        rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                          beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                        moe=dict(num_experts=256, top_k=8, moe_ffn_hidden_size=2048, router="sigmoid_bias",
                                 norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                                 shared_expert_ffn_hidden_size=2048, shared_expert_gate=False, first_dense_layers=3,
                                 aux_loss_coeff=0.0, sequence_aux_loss_coeff=1e-4, bias_update_rate=1e-3),
                        mtp=dict(depth=1, loss_weight=0.3, loss_weight_changes=[[1e13, 0.1]])),
    # Kimi-K2 (Moonshot AI's config.json, from memory): DeepSeek-V3's trunk with 64 heads, 384 routed experts of
    # 2048 and 1 shared, top 8 without groups, routed_scaling_factor 2.827, only the first block dense, vocab 163840,
    # theta 5e4, rms eps 1e-6, YaRN factor 32 over 4096 (max positions 131072; beta_fast 1, beta_slow 1, mscale 1,
    # mscale_all_dim 1, from memory and the least sure of these numbers). Its balance-loss weights are not published:
    # the router's bias alone (aux_loss_coeff 0).
    "kimi-k2": dict(_LLAMA, num_layers=61, hidden_size=7168, num_attention_heads=64, attention_type="mla",
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    ffn_hidden_size=18432, vocab_size=163840, seq_length=4096, max_position_embeddings=131072,
                    rope_theta=50000.0, layernorm_epsilon=1e-6,
                    rope_scaling=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                      beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                    moe=dict(num_experts=384, top_k=8, moe_ffn_hidden_size=2048, router="sigmoid_bias",
                             norm_topk_prob=True, routed_scaling_factor=2.827, shared_expert_ffn_hidden_size=2048,
                             shared_expert_gate=False, first_dense_layers=1, aux_loss_coeff=0.0)),
    # Moonlight-16B-A3B (Moonshot AI's config.json, from memory): 27 layers, h 2048, 16 heads, MLA without a query
    # latent (q_lora_rank null: one q_proj), kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128, the first block dense
    # (intermediate 11264), then 64 routed experts of 1408 and 2 shared (one SwiGLU of 2816), top 6 without groups,
    # routed_scaling_factor 2.446, vocab 163840, theta 5e4, no YaRN, max positions 8192, untied; rms eps 1e-5 (from
    # memory, unsure; it changes no count). As for Kimi-K2, the router's bias alone.
    "moonlight-16b-a3b": dict(_LLAMA, num_layers=27, hidden_size=2048, num_attention_heads=16, attention_type="mla",
                              q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                              v_head_dim=128, ffn_hidden_size=11264, vocab_size=163840, seq_length=8192,
                              rope_theta=50000.0,
                              moe=dict(num_experts=64, top_k=6, moe_ffn_hidden_size=1408, router="sigmoid_bias",
                                       norm_topk_prob=True, routed_scaling_factor=2.446,
                                       shared_expert_ffn_hidden_size=2816, shared_expert_gate=False,
                                       first_dense_layers=1, aux_loss_coeff=0.0)),
    # A DeepSeek-V3 shape for CPU tests and demos: GPT-2 vocabulary, 4 blocks (the first dense), MLA with small
    # latents (q 32, kv 32; q and k heads 16 + 8 rope, v 16), 8 experts of 32 in 4 groups (top 2 in at most 2
    # groups) and a shared expert of 32 without gate; every width divides by TP 2 and EP 2.
    "deepseek-tiny": dict(_LLAMA, num_layers=4, hidden_size=128, num_attention_heads=4, attention_type="mla",
                          q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                          ffn_hidden_size=256, seq_length=64, layernorm_epsilon=1e-6, precision="fp32",
                          moe=dict(num_experts=8, top_k=2, moe_ffn_hidden_size=32, router="sigmoid_bias",
                                   norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4, topk_group=2,
                                   shared_expert_ffn_hidden_size=32, shared_expert_gate=False, first_dense_layers=1,
                                   aux_loss_coeff=0.0, sequence_aux_loss_coeff=1e-4)),
    # A Llama shape for CPU tests and demos: GPT-2 vocabulary, 4 query heads per KV group, untied head.
    "llama-tiny": dict(_LLAMA, num_layers=4, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                       ffn_hidden_size=256, seq_length=64, precision="fp32"),
}
