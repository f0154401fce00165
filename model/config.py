"""Model and parallelism configuration: typed, validated, and free of heavy imports.

Every derived value (padded vocabulary, FFN size, init std, data-parallel size) is computed here and nowhere
else. Every invalid combination raises ``ValueError`` naming the field and the fix, before any process group or
tensor exists.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from dataclasses import dataclass, field
from typing import Any

from common.dtypes import PRECISIONS
from model.presets import PRESETS

ACTIVATIONS = ("gelu", "gelu_tanh")
POSITION_EMBEDDINGS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
BIASES = ("all", "none", "qkv")
RECOMPUTE = ("none", "selective", "full")
ATTENTION_BACKENDS = ("auto", "blockwise", "sdpa", "flex")  # model/document_attention.py tabulates them
ROPE_SCALING_TYPES = ("llama3", "yarn")
LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_OPTIONAL_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
SCALING_KEYS = {"llama3": LLAMA3_SCALING_KEYS, "yarn": ("factor", "original_max_position_embeddings")}  # required
ROUTERS = ("softmax", "sigmoid_bias")  # model.moe.router
GPT2_VOCAB_SIZE = 50257


def set_option(path: str, value: Any) -> str:
    """The --set option that gives a config field this value, as one shell word that pastes: compact JSON, quoted
    where the shell needs it (--set reads the value as JSON: training/config.py apply_overrides).

    >>> set_option("model.num_attention_heads", 6)
    '--set model.num_attention_heads=6'
    >>> set_option("model.rope_scaling", {"rope_type": "llama3", "factor": 8.0})
    '--set \'model.rope_scaling={"rope_type":"llama3","factor":8.0}\''
    """
    return "--set " + shlex.quote(f"{path}={json.dumps(value, separators=(',', ':'))}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class MoEConfig:
    """The experts of the sparse layers (``model.moe``); model/moe.py's docstring says what the block does with them."""

    num_experts: int
    """Routed experts E of each sparse layer. Must divide by parallelism.expert_parallel_size."""
    top_k: int
    """Experts each token is routed to (Mixtral 2, Qwen3-MoE 8); at most num_experts."""
    moe_ffn_hidden_size: int
    """Inner width F of each routed SwiGLU expert. Must divide by the tensor-parallel size."""
    router: str = "softmax"
    """"softmax" (Mixtral, Qwen: softmax scores select and weight) or "sigmoid_bias" (DeepSeek-V3's aux-loss-free
    router: sigmoid scores weight, scores plus a per-expert bias select, the bias moved by update_bias each step)."""
    norm_topk_prob: bool = True
    """Divide the k selected scores by their sum (Mixtral always; Qwen's norm_topk_prob)."""
    shared_expert_ffn_hidden_size: int = 0
    """Inner width of a dense SwiGLU expert every token passes through, its output scaled by sigmoid(x w_gate^T)
    (Qwen2-MoE); 0: none."""
    aux_loss_coeff: float = 1e-3
    """Weight of the Switch/GShard load-balancing loss E sum_e f_e P_e (f_e: fraction of the assignments routed to
    e, P_e: mean router probability of e). transformers' load_balancing_loss_func is k times this loss, so its
    router_aux_loss_coef c is aux_loss_coeff = c k here."""
    router_z_loss_coeff: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); 0: off."""
    capacity_factor: float | None = None
    """None: dropless (every assignment is computed). A positive number: each expert takes at most
    ceil(capacity_factor T k / E) of the T tokens of an EP rank, the rest are dropped (model/moe.py's docstring)."""
    sparse_every: int = 1
    """Layer n (1-based, model/gpt.py's layer_number) is sparse when n % sparse_every == 0 (transformers'
    decoder_sparse_step); 1: every layer."""
    first_dense_layers: int = 0
    """The first this many layers are dense whatever sparse_every says (DeepSeek's first_k_dense_replace; Qwen's
    mlp_only_layers = [0 .. k-1])."""
    bias_update_rate: float = 1e-3
    """"sigmoid_bias" only: each step moves every expert's bias by this much towards balance (DeepSeek-V3's gamma)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "moe_ffn_hidden_size", "sparse_every"):
            value = getattr(self, name)
            _require(_is_positive_int(value), f"model.moe.{name} must be a positive integer, got {value!r}")
        _require(self.top_k <= self.num_experts,
                 f"model.moe.top_k ({self.top_k}) is larger than model.moe.num_experts ({self.num_experts}): "
                 f"route each token to at most num_experts experts")
        _require(self.router in ROUTERS, f"model.moe.router must be one of {ROUTERS}, got {self.router!r}")
        _require(isinstance(self.norm_topk_prob, bool),
                 f"model.moe.norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        for name in ("shared_expert_ffn_hidden_size", "first_dense_layers"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                     f"model.moe.{name} must be a non-negative integer (0: none), got {value!r}")
        for name in ("aux_loss_coeff", "router_z_loss_coeff", "bias_update_rate"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and value >= 0,
                     f"model.moe.{name} must be a non-negative number (0: off), got {value!r}")
        if self.capacity_factor is not None:
            _require(isinstance(self.capacity_factor, (int, float)) and self.capacity_factor > 0,
                     f"model.moe.capacity_factor must be a positive number, or null for dropless routing, got "
                     f"{self.capacity_factor!r}")

    @classmethod
    def from_dict(cls, values: Any) -> MoEConfig:
        """model.moe from its JSON object (a run config, or the run config saved in a checkpoint), or as given."""
        if isinstance(values, MoEConfig):
            return values
        _require(isinstance(values, dict), f"model.moe must be an object of the experts' fields (num_experts, top_k, "
                                           f"moe_ffn_hidden_size, ...) or null, got {values!r}")
        fields = dataclasses.fields(cls)
        unknown = sorted(set(values) - {f.name for f in fields})
        _require(not unknown, f"unknown key(s) {unknown} in block \"model.moe\": known keys are "
                              f"{sorted(f.name for f in fields)}")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in values]
        _require(not missing, f"model.moe lacks {missing}: give num_experts, top_k and moe_ffn_hidden_size")
        return cls(**values)

    def is_sparse(self, layer_number: int) -> bool:
        """Whether block ``layer_number`` (1-based) has experts instead of the dense MLP."""
        return layer_number > self.first_dense_layers and layer_number % self.sparse_every == 0

    def capacity(self, tokens: int) -> int | None:
        """Assignments each expert takes from ``tokens`` tokens of one EP rank; None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder: GPT-2 by default (pre-LayerNorm, learned positions, GeLU MLP, tied
    embeddings, biases everywhere); the Llama family (RoPE, RMSNorm, SwiGLU, grouped KV heads, untied head, no or
    QKV-only biases) by the fields from ``position_embedding`` on, each of which selects one piece of the block."""

    num_layers: int
    """Transformer blocks. Must divide evenly over the pipeline stages."""
    hidden_size: int
    """Width h of the residual stream."""
    num_attention_heads: int
    """Attention heads. Must divide by the tensor-parallel size."""
    seq_length: int
    """Tokens per training sample (each sample holds seq_length + 1 tokens: inputs and shifted labels)."""
    max_position_embeddings: int | None = None
    """Rows of the learned position table (with RoPE: no parameters, only the longest sequence allowed); defaults
    to seq_length. Must be >= seq_length."""
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
    """Epsilon of every norm of the model, LayerNorm or RMSNorm (``norm``): Llama's rms_norm_eps goes here."""
    init_method_std: float | None = None
    """Std of the N(0, std^2) weight init; defaults to init_std_multiple x sqrt(1 / (3 h)), the MT-NLG rule (0.00403
    at h = 20480)."""
    init_std_multiple: float = 1.0
    """The default init std as a multiple of sqrt(1 / (3 h)): what a sweep varies to ask whether a larger sigma still
    converges at every width (the paper's failed larger init). With init_method_std set, they must agree."""
    scale_output_layer_init: bool = True
    """Divide the init std of each block's two output projections by sqrt(2 x num_layers) (Megatron's rule)."""
    activation: str = "gelu"
    """MLP activation: "gelu" (exact, Megatron's) or "gelu_tanh" (GPT-2's tanh approximation, for imported models)."""
    recompute: str = "none"
    """What the backward pass recomputes instead of storing (model/gpt.py, TransformerLayer): "none" (store every
    activation), "selective" (recompute the attention core, softmax(QK^T)V with its dropout, from the stored q, k,
    v: Korthikanti et al. 2022) or "full" (store each block's input only and rerun the whole block; MT-NLG's)."""
    recompute_num_layers: int | None = None
    """With recompute "selective" or "full": how many blocks of each pipeline stage recompute, its first ones (the
    others store everything); None: all of them."""
    precision: str = "fp32"
    """Training precision: "fp32", "bf16" or "fp16". Must agree with the DeepSpeed bf16/fp16 sections."""
    position_embedding: str = "learned"
    """"learned" (GPT-2's absolute table, max_position_embeddings rows) or "rope" (rotary, applied to q and k in
    attention; no parameters)."""
    rope_theta: float = 10000.0
    """RoPE base wavelength (Llama 2: 1e4, Llama 3: 5e5, Qwen2.5: 1e6). Only with position_embedding "rope"."""
    rope_scaling: dict[str, Any] | None = None
    """None, or Hugging Face's rope_scaling dict of type "llama3" (Llama 3.1+): {"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, or "yarn" (Qwen's long-context
    setting; Peng et al. 2023): {"rope_type": "yarn", "factor", "original_max_position_embeddings"} and optionally
    "beta_fast" (32), "beta_slow" (1), "mscale", "mscale_all_dim", "attention_factor", "truncate" (true), as
    transformers reads them. Other types are refused."""
    norm: str = "layernorm"
    """"layernorm" (weight and bias) or "rmsnorm" (weight only); epsilon: layernorm_epsilon."""
    mlp: str = "gelu"
    """"gelu" (h -> ffn -> activation -> h) or "swiglu" (down(silu(gate(x)) * up(x)), ffn_hidden_size wide; the
    activation field is then unused)."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); defaults to num_attention_heads (multi-head), 1 is multi-query.
    Must divide num_attention_heads, and be divisible by the tensor-parallel size."""
    tie_word_embeddings: bool = True
    """The output head shares the input embedding (GPT-2); False gives the last stage its own head (Llama)."""
    bias: str = "all"
    """Which linear layers have a bias: "all" (GPT-2), "none" (Llama, Mistral) or "qkv" (Qwen2: the QKV projection
    only). Norms are not linear layers: LayerNorm always has its bias, RMSNorm never."""
    head_dim: int | None = None
    """Width d of each attention head; defaults to hidden_size / num_attention_heads. Set on its own it frees the
    attention width (heads x d) from h (Qwen3-0.6B: h 1024, 16 heads of 128): QKV is h -> (heads + 2 kv heads) d and
    the output projection heads d -> h."""
    attention_backend: str = "auto"
    """The kernel of document masks (data.reset_attention_mask; model/document_attention.py): "blockwise" (memory
    linear in s: each block of queries against its documents' keys), "flex" (FlexAttention, compiled, CUDA), "sdpa"
    (the (b, 1, s, s) mask, the reference and the one kernel with attention dropout), or "auto": flex on CUDA,
    blockwise elsewhere, sdpa under attention dropout. Without document masks: SDPA's causal kernel, always."""
    qk_layernorm: bool = False
    """A norm on each query and key head before the dot product (and before RoPE), of width head_dim, its weights
    shared by the heads: "layernorm" or "rmsnorm" following ``norm`` (Qwen3's q_norm / k_norm; Wortsman et al. 2023:
    it bounds the attention logits, |q.k| / sqrt(d) <= sqrt(d) with unit gains)."""
    moe: MoEConfig | None = None
    """None: every block has the dense MLP. Else the experts of the sparse blocks (MoEConfig: which blocks, how many
    experts of what width, the router), in JSON an object of its fields; the other blocks keep the dense MLP of
    ffn_hidden_size. Needs mlp "swiglu": the experts are SwiGLU MLPs (Mixtral's, Qwen-MoE's)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"model.{name} must be a positive integer, got {value!r}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        _require(isinstance(self.init_std_multiple, (int, float)) and self.init_std_multiple > 0,
                 f"model.init_std_multiple must be a positive number, got {self.init_std_multiple!r}")
        recipe_std = math.sqrt(1.0 / (3.0 * self.hidden_size))
        if self.init_method_std is None:
            self.init_method_std = self.init_std_multiple * recipe_std
        elif self.init_std_multiple != 1.0:
            _require(math.isclose(self.init_method_std, self.init_std_multiple * recipe_std, rel_tol=1e-9),
                     f"model.init_method_std ({self.init_method_std}) and model.init_std_multiple "
                     f"({self.init_std_multiple}) disagree: {self.init_std_multiple} x sqrt(1/(3 x {self.hidden_size})) "
                     f"is {self.init_std_multiple * recipe_std:.6g}; set one of them only")
        _require(self.ffn_hidden_size > 0, f"model.ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        _require(self.max_position_embeddings >= self.seq_length,
                 f"model.seq_length ({self.seq_length}) is longer than model.max_position_embeddings "
                 f"({self.max_position_embeddings}): raise max_position_embeddings or shorten seq_length")
        if self.head_dim is None:
            _require(self.hidden_size % self.num_attention_heads == 0,
                     f"model.hidden_size ({self.hidden_size}) is not divisible by model.num_attention_heads "
                     f"({self.num_attention_heads}): choose heads that divide the hidden size, or set model.head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        _require(isinstance(self.head_dim, int) and not isinstance(self.head_dim, bool) and self.head_dim > 0,
                 f"model.head_dim must be a positive integer (or null for hidden_size / num_attention_heads), got "
                 f"{self.head_dim!r}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"model.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _require(self.attention_backend in ("auto", "sdpa") or self.attention_dropout == 0.0,
                 f"model.attention_backend \"{self.attention_backend}\" has no attention dropout: set model."
                 f"attention_dropout to 0, or use \"sdpa\" (got attention_dropout {self.attention_dropout})")
        _require(isinstance(self.qk_layernorm, bool),
                 f"model.qk_layernorm must be true or false, got {self.qk_layernorm!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"model.{name} must be in [0, 1), got {value}")
        _require(self.layernorm_epsilon > 0, f"model.layernorm_epsilon must be positive, got {self.layernorm_epsilon}")
        _require(self.init_method_std > 0, f"model.init_method_std must be positive, got {self.init_method_std}")
        _require(self.activation in ACTIVATIONS, f"model.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        _require(self.precision in PRECISIONS, f"model.precision must be one of {PRECISIONS}, got {self.precision!r}")
        _require(self.recompute in RECOMPUTE, f"model.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.recompute_num_layers is not None:
            n = self.recompute_num_layers
            _require(isinstance(n, int) and not isinstance(n, bool) and n > 0,
                     f"model.recompute_num_layers must be a positive integer (or null for every block), got {n!r}")
            _require(self.recompute != "none",
                     f"model.recompute_num_layers is {n} but model.recompute is \"none\": set recompute to "
                     f"\"selective\" or \"full\", or recompute_num_layers to null")
        self._check_architecture()

    def _check_architecture(self) -> None:
        """The fields that choose the pieces of the block (Llama-family options)."""
        for name, choices in (("position_embedding", POSITION_EMBEDDINGS), ("norm", NORMS), ("mlp", MLPS),
                              ("bias", BIASES)):
            value = getattr(self, name)
            _require(value in choices, f"model.{name} must be one of {choices}, got {value!r}")
        _require(isinstance(self.tie_word_embeddings, bool),
                 f"model.tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        kv = self.num_key_value_heads
        _require(isinstance(kv, int) and not isinstance(kv, bool) and kv > 0,
                 f"model.num_key_value_heads must be a positive integer (or null for num_attention_heads), got {kv!r}")
        _require(self.num_attention_heads % kv == 0,
                 f"model.num_key_value_heads ({kv}) does not divide model.num_attention_heads "
                 f"({self.num_attention_heads}): choose key/value heads that divide the query heads")
        _require(self.rope_theta > 0, f"model.rope_theta must be positive, got {self.rope_theta}")
        if self.position_embedding == "rope":
            _require(self.head_dim % 2 == 0,
                     f"model.position_embedding \"rope\" needs an even head dimension, got model.head_dim = "
                     f"{self.head_dim}: choose another head count or head_dim")
        if self.rope_scaling is not None:
            _require(self.position_embedding == "rope",
                     f"model.rope_scaling is set but model.position_embedding is {self.position_embedding!r}: "
                     f"set position_embedding to \"rope\" or rope_scaling to null")
            self._check_rope_scaling(self.rope_scaling)
        if self.moe is not None:
            self.moe = MoEConfig.from_dict(self.moe)
            _require(self.mlp == "swiglu",
                     f"model.moe needs model.mlp \"swiglu\" (the experts are SwiGLU MLPs), got {self.mlp!r}: set "
                     f"model.mlp to \"swiglu\", or remove model.moe")

    @staticmethod
    def _check_rope_scaling(scaling: Any) -> None:
        _require(isinstance(scaling, dict), f"model.rope_scaling must be an object or null, got {scaling!r}")
        kind = scaling.get("rope_type", scaling.get("type"))
        _require(kind in ROPE_SCALING_TYPES,
                 f"model.rope_scaling type {kind!r} is not supported: only {ROPE_SCALING_TYPES} (give "
                 f"\"rope_type\": \"llama3\" with {list(LLAMA3_SCALING_KEYS)}, or \"yarn\" with "
                 f"{list(SCALING_KEYS['yarn'])}), or null for plain RoPE")
        required = SCALING_KEYS[kind]
        missing = [key for key in required if key not in scaling]
        _require(not missing, f"model.rope_scaling of type \"{kind}\" lacks {missing}: give all of {list(required)}")
        numbers = [*required, *(key for key in YARN_OPTIONAL_KEYS[:-1] if kind == "yarn" and key in scaling)]
        for key in numbers:
            value = scaling[key]
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                     f"model.rope_scaling.{key} must be a positive number, got {value!r}")
        _require(kind == "yarn" or scaling["high_freq_factor"] > scaling["low_freq_factor"],
                 f"model.rope_scaling.high_freq_factor ({scaling.get('high_freq_factor')}) must be greater than "
                 f"low_freq_factor ({scaling.get('low_freq_factor')}): the llama3 rule interpolates between them")

    @property
    def attention_size(self) -> int:
        """Width of the attention's output before its projection, heads x head_dim (h unless head_dim is free)."""
        return self.num_attention_heads * self.head_dim

    @property
    def queries_per_key_value_head(self) -> int:
        """Query heads that share one key/value head (1: multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV projection: (query heads + 2 key/value heads) x head_dim (3h for multi-head)."""
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    @property
    def qkv_has_bias(self) -> bool:
        return self.bias in ("all", "qkv")

    @property
    def other_linears_have_bias(self) -> bool:
        """Attention output and MLP projections."""
        return self.bias == "all"

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

    def recomputes_block(self, layer_number: int, pipeline_parallel_size: int) -> bool:
        """Whether block ``layer_number`` (1 .. L) runs the config's recompute mode: it is among the first
        recompute_num_layers of its group of L / PP consecutive blocks (1F1B's pipeline stage; under DualPipeV the
        same groups, so that the same blocks recompute under both schedules), or recompute_num_layers is null."""
        position_in_stage = (layer_number - 1) % (self.num_layers // pipeline_parallel_size)
        return self.recompute_num_layers is None or position_in_stage < self.recompute_num_layers

    def recompute_at(self, layer_number: int, pipeline_parallel_size: int) -> str:
        """The recompute mode of block ``layer_number`` (1 .. L): the config's for the first recompute_num_layers
        blocks of its pipeline stage, "none" for the others."""
        return self.recompute if self.recomputes_block(layer_number, pipeline_parallel_size) else "none"

    def check_parallel(self, tensor_parallel_size: int, pipeline_parallel_size: int,
                       sequence_parallel: bool = False, stages_per_rank: int = 1,
                       expert_parallel_size: int = 1, context_parallel_size: int = 1) -> None:
        """Raise ValueError if this model cannot be split TP x PP ways (with the sequence split TP ways too, and the
        experts EP ways: their split over the data-parallel ranks is checked once the world is known, RunConfig's
        check_world); ``stages_per_rank``: 2 under DualPipeV, whose PP ranks hold 2 PP stages."""
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        _require(isinstance(tp, int) and tp > 0, f"parallelism.tensor_parallel_size must be a positive integer, got {tp!r}")
        _require(isinstance(pp, int) and pp > 0,
                 f"parallelism.pipeline_parallel_size must be a positive integer, got {pp!r}")
        _require(self.num_attention_heads % tp == 0,
                 f"model.num_attention_heads ({self.num_attention_heads}) is not divisible by "
                 f"parallelism.tensor_parallel_size ({tp}): use a tensor-parallel size that divides the heads")
        _require(self.num_key_value_heads % tp == 0,
                 f"model.num_key_value_heads ({self.num_key_value_heads}) is not divisible by "
                 f"parallelism.tensor_parallel_size ({tp}): each TP rank holds whole key/value groups, so use a "
                 f"tensor-parallel size that divides the key/value heads")
        _require(self.ffn_hidden_size % tp == 0,
                 f"model.ffn_hidden_size ({self.ffn_hidden_size}) is not divisible by "
                 f"parallelism.tensor_parallel_size ({tp})")
        self._check_experts(tp, expert_parallel_size)
        divisors = [d for d in range(1, self.num_layers + 1) if self.num_layers % d == 0]
        _require(self.num_layers % pp == 0,
                 f"model.num_layers ({self.num_layers}) cannot be split evenly over "
                 f"parallelism.pipeline_parallel_size ({pp}) "
                 + ("stages" if stages_per_rank == 1 else "ranks of DualPipeV")
                 + f": use a pipeline-parallel size that divides the layers (divisors: {divisors})")
        # DualPipeV cuts the blocks into 2 PP stages (DeepSpeed's partition_balanced: the first PP take one block more
        # when L / PP is odd); rank r's stages r and 2 PP - 1 - r then hold L / PP blocks together, as long as each
        # stage has one (tests/test_dualpipev.py checks DeepSpeed's partition)
        _require(stages_per_rank == 1 or self.num_layers // pp >= 2,
                 f"model.num_layers ({self.num_layers}) gives each of the parallelism.pipeline_parallel_size ({pp}) "
                 f"ranks {self.num_layers // pp} block, and under DualPipeV a rank holds two stages, one on the way out "
                 f"and one on the way back: use at least 2 blocks per rank (a pipeline-parallel size of at most "
                 f"{self.num_layers // 2} that divides the layers: {[d for d in divisors if 2 * d <= self.num_layers]})")
        self._check_context_parallel(tp, context_parallel_size, sequence_parallel)
        if sequence_parallel:
            _require(self.seq_length % tp == 0,
                     f"model.seq_length ({self.seq_length}) is not divisible by parallelism.tensor_parallel_size "
                     f"({tp}): with parallelism.sequence_parallel each TP rank holds seq_length / TP positions; use a "
                     f"sequence length that divides, or turn sequence_parallel off")
        per_stage = self.num_layers // pp  # under DualPipeV too: the blocks of 1F1B's stages (recomputes_block)
        if self.recompute_num_layers is not None:
            _require(self.recompute_num_layers <= per_stage,
                     f"model.recompute_num_layers ({self.recompute_num_layers}) is more than the {per_stage} blocks of "
                     f"each of the {pp} pipeline stages: use at most {per_stage}, or null for every block")

    def _check_context_parallel(self, tp: int, cp: int, sequence_parallel: bool) -> None:
        """Ulysses' all-to-all gives each CP rank whole heads of this TP rank's (whole key/value groups under GQA) and
        each rank seq_length / CP positions (/ TP more with sequence parallelism)."""
        _require(_is_positive_int(cp), f"parallelism.context_parallel_size must be a positive integer, got {cp!r}")
        if cp == 1:
            return
        for name in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(self, name)
            _require(heads // tp % cp == 0,
                     f"model.{name} ({heads}) / parallelism.tensor_parallel_size ({tp}) = {heads // tp} heads per TP "
                     f"rank is not divisible by parallelism.context_parallel_size ({cp}): Ulysses gives each CP rank "
                     f"whole heads (whole key/value groups under GQA); use a context-parallel size that divides "
                     f"{heads // tp}, or a smaller tensor-parallel size")
        positions = cp * (tp if sequence_parallel else 1)
        _require(self.seq_length % positions == 0,
                 f"model.seq_length ({self.seq_length}) is not divisible by parallelism.context_parallel_size ({cp})"
                 + (f" x tensor_parallel_size ({tp}) under sequence_parallel" if sequence_parallel and tp > 1 else "")
                 + f" = {positions}: each rank holds seq_length / {positions} positions; use a multiple of {positions}")

    def _check_experts(self, tensor_parallel_size: int, expert_parallel_size: int) -> None:
        """The experts TP-sharded like the dense MLP, and split EP ways."""
        check_expert_parallel(self.moe, expert_parallel_size)
        if self.moe is None:
            return
        for name in ("moe_ffn_hidden_size", "shared_expert_ffn_hidden_size"):
            width = getattr(self.moe, name)
            _require(width % tensor_parallel_size == 0,
                     f"model.moe.{name} ({width}) is not divisible by parallelism.tensor_parallel_size "
                     f"({tensor_parallel_size}): each TP rank holds a slice of every expert")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PIPELINE_SCHEDULES = ("1f1b", "dualpipev")  # parallelism.pipeline_schedule; what each runs: model/pipe_schedules.py


def stages_per_rank(pipeline_schedule: str) -> int:
    """Pipeline stages a PP rank holds: 2 under DualPipeV (stage r and 2 PP - 1 - r), else 1."""
    return 2 if pipeline_schedule == "dualpipev" else 1


@dataclass
class ParallelConfig:
    """How the model is split: tensor x pipeline inside the world, data parallelism over what is left, the experts
    of an MoE model over groups of data-parallel ranks (expert parallelism)."""

    tensor_parallel_size: int = 1
    """Ranks that share each layer's matrices (Megatron tensor slicing; keep it inside a node)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages; each holds num_layers / PP consecutive transformer blocks."""
    partition_method: str = field(default="type:TransformerLayer")
    """DeepSpeed partition method: balance the transformer blocks over the stages."""
    sequence_parallel: bool = False
    """Split the sequence over the TP ranks outside the tensor-parallel matmuls (norms, dropouts, residual adds, the
    tensor sent between stages): each rank holds seq_length / TP positions there (Korthikanti et al. 2022). Entering
    a column-parallel layer all-gathers the sequence, leaving a row-parallel one reduce-scatters it: the same bytes
    as the all-reduce it replaces. No effect at TP 1."""
    pipeline_schedule: str = "1f1b"
    """"1f1b": DeepSpeed's PipelineModule of PP stages, 1F1B. "dualpipev": DeepSpeed's DualPipeVModule of 2 PP stages,
    rank r holding stage r and 2PP-1-r, run with DualPipeV (DeepSeek-V3's schedule) from 2PP micro-batches per
    pipeline up, and the V-shaped 1F1B below (model/pipe_schedules.py). Checkpoints are the same files under both."""
    expert_parallel_size: int = 1
    """Data-parallel ranks of the same TP and PP coordinates that share the experts of each sparse block, each holding
    model.moe.num_experts / EP of them (model/moe.py). Must divide the experts and the data-parallel size; only with
    model.moe."""
    context_parallel_size: int = 1
    """Ranks that split each sample's sequence (Ulysses context parallelism, Jacobs et al. 2023): each holds
    seq_length / CP positions everywhere but inside attention, where an all-to-all gives it every position of
    heads / CP heads (model/attention.py). CP peers are consecutive ranks of DeepSpeed's data axis (DP x CP), with
    the same TP and PP coordinates; DP is what is left: world / (TP x PP x CP) replicas of the batch."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size",
                     "context_parallel_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0,
                     f"parallelism.{name} must be a positive integer, got {value!r}")
        _require(isinstance(self.sequence_parallel, bool),
                 f"parallelism.sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        _require(self.pipeline_schedule in PIPELINE_SCHEDULES,
                 f"parallelism.pipeline_schedule must be one of {', '.join(map(json.dumps, PIPELINE_SCHEDULES))}, "
                 f"got {self.pipeline_schedule!r}")
        cp = self.context_parallel_size
        _require(cp == 1 or self.expert_parallel_size == 1,
                 f"parallelism.context_parallel_size {cp} with expert_parallel_size {self.expert_parallel_size}: both "
                 f"are carved out of the data axis and their combination is not built; use one of them")
        _require(cp == 1 or self.pipeline_schedule == "1f1b",
                 f"parallelism.context_parallel_size {cp} runs with the \"1f1b\" pipeline schedule; DualPipeV under "
                 f"context parallelism is not built: use \"1f1b\"")
        _require(self.pipeline_schedule == "1f1b" or self.pipeline_parallel_size >= 2,
                 "parallelism.pipeline_schedule \"dualpipev\" needs parallelism.pipeline_parallel_size >= 2 (it "
                 "fills the bubble between pipeline stages; with one stage there is none): use \"1f1b\"")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """The replicas of the batch, world size / (TP x PP x CP), or a ValueError showing every factor."""
        return self.data_axis_size(world_size) // self.context_parallel_size

    def data_axis_size(self, world_size: int) -> int:
        """DeepSpeed's data-parallel world, DP x CP = world size / (TP x PP): what averages the gradients, shards
        ZeRO-1 and names a checkpoint's layout."""
        split = self.model_parallel_size * self.context_parallel_size
        _require(world_size % split == 0,
                 f"world size {world_size} is not divisible by tensor_parallel_size ({self.tensor_parallel_size}) x "
                 f"pipeline_parallel_size ({self.pipeline_parallel_size})"
                 + (f" x context_parallel_size ({self.context_parallel_size})" if self.context_parallel_size > 1 else "")
                 + f" = {split}: launch a multiple of {split} processes")
        return world_size // self.model_parallel_size


def check_expert_parallel(moe: MoEConfig | None, expert_parallel_size: int,
                          data_parallel_size: int | None = None) -> None:
    """The expert-parallel size against the experts and the data-parallel size, before any process group exists.
    ``data_parallel_size`` None (the world not known yet: ModelConfig.check_parallel): the experts only."""
    ep = expert_parallel_size
    _require(_is_positive_int(ep), f"parallelism.expert_parallel_size must be a positive integer, got {ep!r}")
    if moe is None:
        _require(ep == 1, f"parallelism.expert_parallel_size is {ep} but model.moe is not set: expert parallelism "
                          f"splits the experts of a Mixture-of-Experts model; set it to 1, or give the experts in "
                          f"model.moe")
        return
    _require(moe.num_experts % ep == 0,
             f"parallelism.expert_parallel_size ({ep}) does not divide model.moe.num_experts ({moe.num_experts}): "
             f"choose one of {[d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0]}")
    if data_parallel_size is None:
        return
    _require(data_parallel_size % ep == 0,
             f"parallelism.expert_parallel_size ({ep}) does not divide the data-parallel size ({data_parallel_size}, "
             f"world / (TP x PP)): the EP groups are made of data-parallel ranks; choose one of "
             f"{[d for d in range(1, data_parallel_size + 1) if data_parallel_size % d == 0]}, or launch a world "
             f"whose data-parallel size it divides")


def _gpt2_model(**kwargs: Any) -> ModelConfig:
    return ModelConfig(**{"vocab_size": GPT2_VOCAB_SIZE, **kwargs})


def upgrade_model_fields(values: dict[str, Any], where: str = "model") -> dict[str, Any]:
    """A "model" block with the fields of earlier versions renamed (run configs and the run config saved in older
    checkpoints): activation_checkpointing true/false is recompute "full"/"none"."""
    values = dict(values)  # a copy: the caller's block stays as it was
    if "activation_checkpointing" not in values:
        return values
    legacy = values.pop("activation_checkpointing")
    _require(isinstance(legacy, bool), f"{where}.activation_checkpointing must be true or false, got {legacy!r} "
                                       f"(it is now {where}.recompute: \"full\" or \"none\")")
    implied = "full" if legacy else "none"
    _require(values.get("recompute", implied) == implied,
             f"{where}.activation_checkpointing ({str(legacy).lower()}) and {where}.recompute "
             f"({values.get('recompute')!r}) disagree: remove activation_checkpointing, which recompute replaces")
    values["recompute"] = implied
    return values


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named model shape, with any field overridden (model.moe's field by field)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}")
    fields = {**PRESETS[name], **overrides}
    if isinstance(overrides.get("moe"), dict) and PRESETS[name].get("moe") is not None:
        # a partial model.moe (--set model.moe.capacity_factor=1.25) changes those fields of the preset's experts
        fields["moe"] = {**PRESETS[name]["moe"], **overrides["moe"]}
    return _gpt2_model(**fields)
