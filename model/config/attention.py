"""The attention's shape and kernel: heads, key/value groups (GQA), the head width, the document-mask kernel, the
norms of q and k. The derived widths (attention_size, qkv_size, queries_per_key_value_head) are ModelConfig's
properties; model/attention.py builds what these fields describe."""

from __future__ import annotations

from typing import Any

from model.config.checks import require

ATTENTION_BACKENDS = ("auto", "blockwise", "sdpa", "flex")  # model/document_attention.py tabulates them


def resolve_attention(config: Any) -> None:
    """Fill a ModelConfig's head_dim (h / heads) and num_key_value_heads (heads) defaults, and check every attention
    field: ValueError naming the field and the fix."""
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
