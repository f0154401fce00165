"""Model and parallelism configuration: typed, validated, and free of heavy imports.

Every derived value (padded vocabulary, FFN size, init std, data-parallel size) is computed here and nowhere
else. Every invalid combination raises ``ValueError`` naming the field and the fix, before any process group or
tensor exists.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp16")
ACTIVATIONS = ("gelu", "gelu_tanh")
GPT2_VOCAB_SIZE = 50257


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class ModelConfig:
    """Shape and numerics of a GPT decoder (pre-LayerNorm, learned positions, GeLU MLP, tied embeddings)."""

    num_layers: int
    """Transformer blocks. Must divide evenly over the pipeline stages."""
    hidden_size: int
    """Width h of the residual stream."""
    num_attention_heads: int
    """Attention heads; hidden_size / heads is the head dimension. Must divide by the tensor-parallel size."""
    seq_length: int
    """Tokens per training sample (each sample holds seq_length + 1 tokens: inputs and shifted labels)."""
    max_position_embeddings: int | None = None
    """Rows of the learned position table; defaults to seq_length. Must be >= seq_length."""
    vocab_size: int = GPT2_VOCAB_SIZE
    """Tokenizer vocabulary (unpadded). The embedding is padded, see padded_vocab_size()."""
    make_vocab_size_divisible_by: int = 128
    """The embedding has a multiple of (this x tensor-parallel size) rows, so every shard is equal and aligned."""
    ffn_hidden_size: int | None = None
    """Inner MLP width; defaults to 4 x hidden_size. Must divide by the tensor-parallel size."""
    hidden_dropout: float = 0.0
    """Dropout on the embeddings and on each residual branch."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    init_method_std: float | None = None
    """Std of the N(0, std^2) weight init; defaults to sqrt(1 / (3 h)), the MT-NLG rule (0.00403 at h = 20480)."""
    scale_output_layer_init: bool = True
    """Divide the init std of each block's two output projections by sqrt(2 x num_layers) (Megatron's rule)."""
    activation: str = "gelu"
    """MLP activation: "gelu" (exact, Megatron's) or "gelu_tanh" (GPT-2's tanh approximation, for imported models)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in the backward pass instead of storing its activations."""
    precision: str = "fp32"
    """Training precision: "fp32", "bf16" or "fp16". Must agree with the DeepSpeed bf16/fp16 sections."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"model.{name} must be a positive integer, got {value!r}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.init_method_std is None:
            self.init_method_std = math.sqrt(1.0 / (3.0 * self.hidden_size))
        _require(self.ffn_hidden_size > 0, f"model.ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        _require(self.max_position_embeddings >= self.seq_length,
                 f"model.seq_length ({self.seq_length}) is longer than model.max_position_embeddings "
                 f"({self.max_position_embeddings}): raise max_position_embeddings or shorten seq_length")
        _require(self.hidden_size % self.num_attention_heads == 0,
                 f"model.hidden_size ({self.hidden_size}) is not divisible by model.num_attention_heads "
                 f"({self.num_attention_heads}): choose heads that divide the hidden size")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"model.{name} must be in [0, 1), got {value}")
        _require(self.layernorm_epsilon > 0, f"model.layernorm_epsilon must be positive, got {self.layernorm_epsilon}")
        _require(self.init_method_std > 0, f"model.init_method_std must be positive, got {self.init_method_std}")
        _require(self.activation in ACTIVATIONS, f"model.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        _require(self.precision in PRECISIONS, f"model.precision must be one of {PRECISIONS}, got {self.precision!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def output_layer_init_std(self) -> float:
        """Init std of the attention output and second MLP projections of every block."""
        if not self.scale_output_layer_init:
            return self.init_method_std
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by x TP (50257 -> 51200 at TP 8)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def check_parallel(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Raise ValueError if this model cannot be split TP x PP ways."""
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        _require(isinstance(tp, int) and tp > 0, f"parallelism.tensor_parallel_size must be a positive integer, got {tp!r}")
        _require(isinstance(pp, int) and pp > 0,
                 f"parallelism.pipeline_parallel_size must be a positive integer, got {pp!r}")
        _require(self.num_attention_heads % tp == 0,
                 f"model.num_attention_heads ({self.num_attention_heads}) is not divisible by "
                 f"parallelism.tensor_parallel_size ({tp}): use a tensor-parallel size that divides the heads")
        _require(self.ffn_hidden_size % tp == 0,
                 f"model.ffn_hidden_size ({self.ffn_hidden_size}) is not divisible by "
                 f"parallelism.tensor_parallel_size ({tp})")
        _require(self.num_layers % pp == 0,
                 f"model.num_layers ({self.num_layers}) cannot be split evenly over "
                 f"parallelism.pipeline_parallel_size ({pp}) stages: use a stage count that divides the layers "
                 f"(divisors: {[d for d in range(1, self.num_layers + 1) if self.num_layers % d == 0]})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ParallelConfig:
    """How the model is split: tensor x pipeline inside the world, data parallelism over what is left."""

    tensor_parallel_size: int = 1
    """Ranks that share each layer's matrices (Megatron tensor slicing; keep it inside a node)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages; each holds num_layers / PP consecutive transformer blocks."""
    partition_method: str = field(default="type:TransformerLayer")
    """DeepSpeed partition method: balance the transformer blocks over the stages."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0,
                     f"parallelism.{name} must be a positive integer, got {value!r}")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """World size / (TP x PP), or a ValueError showing every factor."""
        mp = self.model_parallel_size
        _require(world_size % mp == 0,
                 f"world size {world_size} is not divisible by tensor_parallel_size ({self.tensor_parallel_size}) x "
                 f"pipeline_parallel_size ({self.pipeline_parallel_size}) = {mp}: launch a multiple of {mp} processes")
        return world_size // mp


def _gpt2_model(**kwargs: Any) -> ModelConfig:
    return ModelConfig(**{"vocab_size": GPT2_VOCAB_SIZE, **kwargs})


PRESETS: dict[str, dict[str, Any]] = {
    # Megatron-Turing NLG 530B (Smith et al. 2022): 105 layers, h 20480, 128 heads, seq 2048.
    "530b": dict(num_layers=105, hidden_size=20480, num_attention_heads=128, seq_length=2048,
                 activation_checkpointing=True, precision="bf16"),
    # GPT-3 Small and XL shapes (Brown et al. 2020, table 2.1).
    "125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=2048, precision="bf16"),
    "1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, precision="bf16"),
    # For CPU tests and demos: the real GPT-2 vocabulary, a tiny trunk.
    "tiny": dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, precision="fp32"),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named model shape, with any field overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}")
    return _gpt2_model(**{**PRESETS[name], **overrides})
