"""ModelConfig: the shape and numerics of a decoder, each field choosing one piece of the block; its derived sizes;
the named presets (model/presets.py) and the renamed fields of earlier versions."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from common.dtypes import PRECISIONS
from model.config.attention import resolve_attention
from model.config.checks import require
from model.config.moe import MoEConfig
from model.config.mtp import MTPConfig
from model.config.parallel import check_layout
from model.config.positions import check_positions
from model.presets import PRESETS

ACTIVATIONS = ("gelu", "gelu_tanh")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
BIASES = ("all", "none", "qkv")
RECOMPUTE = ("none", "selective", "full")
GPT2_VOCAB_SIZE = 50257


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
    attention_type: str = "mha"
    """The block's attention: "mha" (multi-head: one column-parallel QKV projection, num_key_value_heads groups of
    head_dim; model/attention.py) or "mla" (multi-head latent attention, DeepSeek-V2/V3's and Kimi-K2's; model/mla.py):
    queries and keys/values projected through low-rank latents (the fields below, transformers' DeepseekV3Config
    names), RoPE on a qk_rope_head_dim part of each head, the key's one part shared by all heads. Under "mla"
    num_key_value_heads is the heads and head_dim qk_nope_head_dim + qk_rope_head_dim (both resolved so); it needs
    position_embedding "rope" and refuses, until they are built, qk_layernorm, bias "qkv" and context parallelism. Its
    KV cache holds the latent (model/mla.py); it converts to and from Hugging Face as DeepseekV3ForCausalLM."""
    q_lora_rank: int | None = None
    """MLA: width of the query latent, h -> q_lora_rank (q_a_proj, replicated) -> RMSNorm -> heads x (qk_nope_head_dim
    + qk_rope_head_dim) (q_b_proj, column-parallel); null: one q_proj h -> heads x (qk_nope_head_dim +
    qk_rope_head_dim) (DeepSeek-V2-Lite). DeepSeek-V3: 1536."""
    kv_lora_rank: int | None = None
    """MLA: width of the key/value latent every head's key and value are expanded from (kv_b_proj); DeepSeek-V3: 512."""
    qk_nope_head_dim: int | None = None
    """MLA: the part of each query and key head without RoPE; DeepSeek-V3: 128."""
    qk_rope_head_dim: int | None = None
    """MLA: the rotated part of each query head, and of the one key head all heads share (even); DeepSeek-V3: 64."""
    v_head_dim: int | None = None
    """MLA: width of each value head (the output projection reads heads x v_head_dim); DeepSeek-V3: 128."""
    rope_interleave: bool | None = None
    """MLA: RoPE rotates the pairs (x0, x1), (x2, x3), .. of the rope part (DeepSeek's layout; null: true, as
    DeepseekV3Config) rather than (x_i, x_{i + d/2}) (Llama's rotate_half, false)."""
    moe: MoEConfig | None = None
    """None: every block has the dense MLP. Else the experts of the sparse blocks (MoEConfig: which blocks, how many
    experts of what width, the router), in JSON an object of its fields; the other blocks keep the dense MLP of
    ffn_hidden_size. Needs mlp "swiglu": the experts are SwiGLU MLPs (Mixtral's, Qwen-MoE's)."""
    mtp: MTPConfig | None = None
    """None: the next token only. Else DeepSeek-V3's multi-token prediction (MTPConfig: depth D, loss weight and its
    schedule in tokens), in JSON an object of its fields: D modules on the last pipeline stage (model/mtp.py)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"model.{name} must be a positive integer, got {value!r}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        require(isinstance(self.init_std_multiple, (int, float)) and self.init_std_multiple > 0,
                f"model.init_std_multiple must be a positive number, got {self.init_std_multiple!r}")
        recipe_std = math.sqrt(1.0 / (3.0 * self.hidden_size))
        if self.init_method_std is None:
            self.init_method_std = self.init_std_multiple * recipe_std
        elif self.init_std_multiple != 1.0:
            require(math.isclose(self.init_method_std, self.init_std_multiple * recipe_std, rel_tol=1e-9),
                    f"model.init_method_std ({self.init_method_std}) and model.init_std_multiple "
                    f"({self.init_std_multiple}) disagree: {self.init_std_multiple} x sqrt(1/(3 x {self.hidden_size})) "
                    f"is {self.init_std_multiple * recipe_std:.6g}; set one of them only")
        require(self.ffn_hidden_size > 0, f"model.ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        require(self.max_position_embeddings >= self.seq_length,
                f"model.seq_length ({self.seq_length}) is longer than model.max_position_embeddings "
                f"({self.max_position_embeddings}): raise max_position_embeddings or shorten seq_length")
        resolve_attention(self)  # head_dim, key/value heads, the document-mask kernel, q/k norms
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"model.{name} must be in [0, 1), got {value}")
        require(self.layernorm_epsilon > 0, f"model.layernorm_epsilon must be positive, got {self.layernorm_epsilon}")
        require(self.init_method_std > 0, f"model.init_method_std must be positive, got {self.init_method_std}")
        require(self.activation in ACTIVATIONS, f"model.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        require(self.precision in PRECISIONS, f"model.precision must be one of {PRECISIONS}, got {self.precision!r}")
        require(self.recompute in RECOMPUTE, f"model.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.recompute_num_layers is not None:
            n = self.recompute_num_layers
            require(isinstance(n, int) and not isinstance(n, bool) and n > 0,
                    f"model.recompute_num_layers must be a positive integer (or null for every block), got {n!r}")
            require(self.recompute != "none",
                    f"model.recompute_num_layers is {n} but model.recompute is \"none\": set recompute to "
                    f"\"selective\" or \"full\", or recompute_num_layers to null")
        self._check_architecture()

    def _check_architecture(self) -> None:
        """The fields that choose the pieces of the block (Llama-family options)."""
        for name, choices in (("norm", NORMS), ("mlp", MLPS), ("bias", BIASES)):
            value = getattr(self, name)
            require(value in choices, f"model.{name} must be one of {choices}, got {value!r}")
        require(isinstance(self.tie_word_embeddings, bool),
                f"model.tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        check_positions(self)
        if self.mtp is not None:
            self.mtp = MTPConfig.from_dict(self.mtp)
        if self.moe is not None:
            self.moe = MoEConfig.from_dict(self.moe)
            require(self.mlp == "swiglu",
                    f"model.moe needs model.mlp \"swiglu\" (the experts are SwiGLU MLPs), got {self.mlp!r}: set "
                    f"model.mlp to \"swiglu\", or remove model.moe")

    @property
    def attention_size(self) -> int:
        """Width of the attention's output before its projection, heads x head_dim (h unless head_dim is free);
        heads x v_head_dim under MLA."""
        return self.num_attention_heads * (self.v_head_dim if self.attention_type == "mla" else self.head_dim)

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head that RoPE rotates: head_dim, or MLA's qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.attention_type == "mla" else self.head_dim

    @property
    def queries_per_key_value_head(self) -> int:
        """Query heads that share one key/value head (1: multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV projection: (query heads + 2 key/value heads) x head_dim (3h for multi-head). MLA has
        no fused projection: there, the widths of the q, k and v the core reads per token, heads x (2 head_dim +
        v_head_dim) (what estimates of the stored activations read)."""
        if self.attention_type == "mla":
            return self.num_attention_heads * (2 * self.head_dim + self.v_head_dim)
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
        """Raise ValueError if this model cannot be split so (model/config/parallel.py check_layout)."""
        check_layout(self, tensor_parallel_size, pipeline_parallel_size, sequence_parallel, stages_per_rank,
                     expert_parallel_size, context_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _gpt2_model(**kwargs: Any) -> ModelConfig:
    return ModelConfig(**{"vocab_size": GPT2_VOCAB_SIZE, **kwargs})


def upgrade_model_fields(values: dict[str, Any], where: str = "model") -> dict[str, Any]:
    """A "model" block with the fields of earlier versions renamed (run configs and the run config saved in older
    checkpoints): activation_checkpointing true/false is recompute "full"/"none"."""
    values = dict(values)  # a copy: the caller's block stays as it was
    if "activation_checkpointing" not in values:
        return values
    legacy = values.pop("activation_checkpointing")
    require(isinstance(legacy, bool), f"{where}.activation_checkpointing must be true or false, got {legacy!r} "
                                      f"(it is now {where}.recompute: \"full\" or \"none\")")
    implied = "full" if legacy else "none"
    require(values.get("recompute", implied) == implied,
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
