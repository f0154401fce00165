"""The attention's shape and kernel: which attention (multi-head, or multi-head latent), heads, key/value groups
(GQA), the head width, MLA's latent ranks and head widths, the document-mask kernel, the norms of q and k. The
derived widths (attention_size, qkv_size, queries_per_key_value_head, rotary_dim) are ModelConfig's properties;
model/attention.py and model/mla.py build what these fields describe."""

from __future__ import annotations

from typing import Any

from model.config.checks import is_positive_int, require

ATTENTION_BACKENDS = ("auto", "blockwise", "sdpa", "flex")  # model/document_attention.py tabulates them
ATTENTION_TYPES = ("mha", "mla")  # model/gpt.py ATTENTIONS: model/attention.py SelfAttention, model/mla.py
LATENT_RANKS_AND_WIDTHS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""MLA's required fields (transformers' DeepseekV3Config names); q_lora_rank may be null (a plain q_proj)."""
MLA_FIELDS = ("q_lora_rank", *LATENT_RANKS_AND_WIDTHS, "rope_interleave")


def resolve_attention(config: Any) -> None:
    """Fill a ModelConfig's head_dim (h / heads; q and k's nope + rope width under MLA), num_key_value_heads (heads)
    and rope_interleave (true under MLA) defaults, and check every attention field: ValueError naming the field and
    the fix."""
    require(config.attention_type in ATTENTION_TYPES,
            f"model.attention_type must be one of {ATTENTION_TYPES}, got {config.attention_type!r}")
    if config.attention_type == "mla":
        _resolve_latent_attention(config)
    else:
        for name in MLA_FIELDS:
            require(getattr(config, name) is None,
                    f"model.{name} ({getattr(config, name)!r}) is a field of model.attention_type \"mla\", and "
                    f"attention_type is {config.attention_type!r}: remove it, or set attention_type to \"mla\"")
    if config.head_dim is None:
        require(config.hidden_size % config.num_attention_heads == 0,
                f"model.hidden_size ({config.hidden_size}) is not divisible by model.num_attention_heads "
                f"({config.num_attention_heads}): choose heads that divide the hidden size, or set model.head_dim")
        config.head_dim = config.hidden_size // config.num_attention_heads
    require(isinstance(config.head_dim, int) and not isinstance(config.head_dim, bool) and config.head_dim > 0,
            f"model.head_dim must be a positive integer (or null for hidden_size / num_attention_heads), got "
            f"{config.head_dim!r}")
    require(config.attention_backend in ATTENTION_BACKENDS,
            f"model.attention_backend must be one of {ATTENTION_BACKENDS}, got {config.attention_backend!r}")
    require(config.attention_backend in ("auto", "sdpa") or config.attention_dropout == 0.0,
            f"model.attention_backend \"{config.attention_backend}\" has no attention dropout: set model."
            f"attention_dropout to 0, or use \"sdpa\" (got attention_dropout {config.attention_dropout})")
    require(isinstance(config.qk_layernorm, bool),
            f"model.qk_layernorm must be true or false, got {config.qk_layernorm!r}")
    if config.num_key_value_heads is None:
        config.num_key_value_heads = config.num_attention_heads
    kv = config.num_key_value_heads
    require(isinstance(kv, int) and not isinstance(kv, bool) and kv > 0,
            f"model.num_key_value_heads must be a positive integer (or null for num_attention_heads), got {kv!r}")
    require(config.num_attention_heads % kv == 0,
            f"model.num_key_value_heads ({kv}) does not divide model.num_attention_heads "
            f"({config.num_attention_heads}): choose key/value heads that divide the query heads")


def _resolve_latent_attention(config: Any) -> None:
    """MLA's fields (model/mla.py), and what it does not build yet, refused by name. Its key and value heads are one
    per query head (expanded from the shared latent), and its q/k head width is qk_nope_head_dim + qk_rope_head_dim:
    num_key_value_heads and head_dim, when given, must say so (a saved config gives them resolved)."""
    for name in LATENT_RANKS_AND_WIDTHS:
        value = getattr(config, name)
        require(is_positive_int(value),
                f"model.{name} must be a positive integer with model.attention_type \"mla\", got {value!r} "
                f"(DeepSeek-V3: kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)")
    require(config.q_lora_rank is None or is_positive_int(config.q_lora_rank),
            f"model.q_lora_rank must be a positive integer, or null for one q_proj h -> heads x (qk_nope_head_dim + "
            f"qk_rope_head_dim), got {config.q_lora_rank!r}")
    require(config.qk_rope_head_dim % 2 == 0,
            f"model.qk_rope_head_dim ({config.qk_rope_head_dim}) must be even: RoPE rotates pairs of dimensions")
    require(config.position_embedding == "rope",
            f"model.attention_type \"mla\" rotates the qk_rope_head_dim part of every query and key, and model."
            f"position_embedding is {config.position_embedding!r}: set position_embedding to \"rope\"")
    if config.rope_interleave is None:
        config.rope_interleave = True  # DeepseekV3Config's default: DeepSeek's checkpoints rotate (x0, x1), (x2, x3)
    require(isinstance(config.rope_interleave, bool),
            f"model.rope_interleave must be true or false, got {config.rope_interleave!r}")
    width = config.qk_nope_head_dim + config.qk_rope_head_dim
    require(config.head_dim in (None, width),
            f"model.head_dim ({config.head_dim}) is set, and under model.attention_type \"mla\" the q and k heads "
            f"are qk_nope_head_dim + qk_rope_head_dim = {width} wide (v_head_dim {config.v_head_dim}): remove head_dim")
    config.head_dim = width
    require(config.num_key_value_heads in (None, config.num_attention_heads),
            f"model.num_key_value_heads ({config.num_key_value_heads}) is set, and under model.attention_type \"mla\" "
            f"every query head has its own key and value, expanded from the shared latent (kv_lora_rank): remove it "
            f"(or set it to num_attention_heads, {config.num_attention_heads})")
    require(not config.qk_layernorm,
            "model.qk_layernorm with model.attention_type \"mla\" is not built (MLA normalises its latents instead: "
            "q_a_layernorm, kv_a_layernorm): set qk_layernorm to false")
    require(config.bias in ("none", "all"),
            f"model.bias {config.bias!r} gives the fused QKV projection a bias, and model.attention_type \"mla\" has "
            f"none: use \"none\" (DeepSeek-V3), or \"all\" (transformers' attention_bias: q_a_proj, "
            f"kv_a_proj_with_mqa and the output projection, and the MLP)")
