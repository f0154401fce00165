"""Where a token is: learned absolute positions or RoPE, RoPE's base and its long-context scaling (llama3, YaRN).

model/layers.py's RotaryEmbedding computes the frequencies these fields describe; hf/config_map.py reads and writes
them as transformers' rope_theta and rope_scaling.
"""

from __future__ import annotations

from typing import Any

from model.config.checks import require

POSITION_EMBEDDINGS = ("learned", "rope")
ROPE_SCALING_TYPES = ("llama3", "yarn")
LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_OPTIONAL_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
SCALING_KEYS = {"llama3": LLAMA3_SCALING_KEYS, "yarn": ("factor", "original_max_position_embeddings")}  # required


def check_positions(config: Any) -> None:
    """model.position_embedding, rope_theta and rope_scaling of a ModelConfig (head_dim already resolved)."""
    require(config.position_embedding in POSITION_EMBEDDINGS,
            f"model.position_embedding must be one of {POSITION_EMBEDDINGS}, got {config.position_embedding!r}")
    require(config.rope_theta > 0, f"model.rope_theta must be positive, got {config.rope_theta}")
    if config.position_embedding == "rope":  # MLA's rope part is checked with its fields (model/config/attention.py)
        require(config.rotary_dim % 2 == 0,
                f"model.position_embedding \"rope\" needs an even head dimension, got model.head_dim = "
                f"{config.head_dim}: choose another head count or head_dim")
    if config.rope_scaling is not None:
        require(config.position_embedding == "rope",
                f"model.rope_scaling is set but model.position_embedding is {config.position_embedding!r}: "
                f"set position_embedding to \"rope\" or rope_scaling to null")
        check_rope_scaling(config.rope_scaling)


def check_rope_scaling(scaling: Any) -> None:
    require(isinstance(scaling, dict), f"model.rope_scaling must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    require(kind in ROPE_SCALING_TYPES,
            f"model.rope_scaling type {kind!r} is not supported: only {ROPE_SCALING_TYPES} (give "
            f"\"rope_type\": \"llama3\" with {list(LLAMA3_SCALING_KEYS)}, or \"yarn\" with "
            f"{list(SCALING_KEYS['yarn'])}), or null for plain RoPE")
    required = SCALING_KEYS[kind]
    missing = [key for key in required if key not in scaling]
    require(not missing, f"model.rope_scaling of type \"{kind}\" lacks {missing}: give all of {list(required)}")
    numbers = [*required, *(key for key in YARN_OPTIONAL_KEYS[:-1] if kind == "yarn" and key in scaling)]
    for key in numbers:
        value = scaling[key]
        require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"model.rope_scaling.{key} must be a positive number, got {value!r}")
    require(kind == "yarn" or scaling["high_freq_factor"] > scaling["low_freq_factor"],
            f"model.rope_scaling.high_freq_factor ({scaling.get('high_freq_factor')}) must be greater than "
            f"low_freq_factor ({scaling.get('low_freq_factor')}): the llama3 rule interpolates between them")
