"""Hugging Face interop: a checkpoint of this project <-> a ``transformers`` causal LM, one layer at a time.

Four architectures, each the same function as this project's GPT with the matching ModelConfig fields:

    GPT2LMHeadModel      position_embedding "learned", norm "layernorm", mlp "gelu", tied, bias "all", multi-head
    LlamaForCausalLM     position_embedding "rope" (llama3 scaling or none), norm "rmsnorm", mlp "swiglu", grouped KV
                         heads, tied or not, bias "none" (or "all": attention_bias and mlp_bias)
    MistralForCausalLM   as Llama, bias "none"; a sliding window shorter than the context is refused
    Qwen2ForCausalLM     as Llama, bias "qkv" (q, k and v projections only); no sliding window

Each architecture is one table below (``ARCHITECTURES``): our (layer, tensor) -> the HF name(s), ``{}`` standing for
the block index, and the transform that turns one into the other. The transforms, and nowhere else:

    here (TP shards merged)                              Hugging Face                                  transform
    word embedding / untied head [V_padded, h]           embed_tokens / wte / lm_head [V, h]           "vocab"
      rows split over TP                                   the padding rows dropped (zeros on import)
    Linear weights [out, in]                             GPT-2's Conv1D [in, out]: the transpose       "conv1d"
    GPT-2 qkv [3h, h], rows [heads, 3 (q,k,v), d]        c_attn [h, 3h], columns [3 (q,k,v), heads, d]  "conv1d_qkv"
    grouped qkv [(nh + 2 g) d, h], rows per KV group     q_proj [nh d, h], k_proj, v_proj [g d, h]      "grouped_qkv"
      [g, nh/g + 2, d]: the group's query heads, k, v    (query head j in group j // (nh/g))
    gate_up [2 f, h]: TP rank r holds [gate_r; up_r]     gate_proj, up_proj [f, h]                     "gate_up"
    everything else                                      the same tensor                               "copy"
    blocks are layers 2..L+1 of the pipeline             transformer.h.{i} / model.layers.{i}, i = 0..L-1

RoPE is HF's non-interleaved rotate_half here too, so q_proj and k_proj need no row permutation.

The padded vocabulary rows (ids >= vocab_size, whose logits this project forces to -inf) are dropped on export: the
HF model has exactly the tokenizer's vocabulary and gives the same distribution. On import they are zeros.

The checkpoint layout (DeepSpeed's pipeline engine, via training/checkpoint.py), read and written here:

    <dir>/latest                                     the tag of the newest complete checkpoint, e.g. global_step1000
    <dir>/<tag>/layer_XX-model_YY-model_states.pt   layer XX of gpt_layer_specs on TP rank YY (a plain state_dict):
                                                     0 word embedding (tied: saved once), 1 positions (RoPE: an
                                                     empty state_dict), 2..L+1 transformer blocks, L+2 final norm,
                                                     L+3 the untied output head
    <dir>/<tag>/mp_rank_MM_model_states.pt           one per stage x TP rank, MM = stage * TP + YY: DeepSpeed's
                                                     bookkeeping and the client_state (run_config, train_state)
    <dir>/<tag>/[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt   ZeRO fp32 master weights and Adam moments
    <dir>/hf_import.json, <dir>/hf_tokenizer/        an imported checkpoint only: the import record, and the HF
                                                     model's tokenizer files (the export ships them again)

Memory: only one layer's shards are read at a time (memory-mapped) and each output tensor is written as soon as it is
merged, into safetensors files whose headers are planned up front; peak memory follows the largest layer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from model.checkpoint_files import layer_file, model_states_file, read_latest, write_latest
from model.config import GPT2_VOCAB_SIZE, LLAMA3_SCALING_KEYS, ModelConfig, ParallelConfig, preset, upgrade_model_fields

HF_ARCHITECTURE = "GPT2LMHeadModel"  # the default architecture of this project's default (GPT-2) shape
IMPORT_TAG = "global_step0"
IMPORT_RECORD = "hf_import.json"
TOKENIZER_DIRECTORY = "hf_tokenizer"
# What save_pretrained of a tokenizer may write (slow and fast, SentencePiece and BPE); copied as they are
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
DEFAULT_MAX_SHARD_SIZE = "5GB"
ACTIVATION_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
ACTIVATION_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                      "gelu_fast": "gelu_tanh"}  # the three tanh approximations agree to ~1e-7
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


# -- the map between the two models ----------------------------------------------------------------------------------

# Our tensors, by (layer kind, state_dict key): unsharded dims (symbols of ``_dimensions``) and the dimension split
# over TP ranks (None: replicated). Which of them a model has follows from its config (``_our_keys``).
OUR_TENSORS: dict[tuple[str, str], tuple[tuple[str, ...], int | None]] = {
    ("embedding", "weight"): (("padded_vocab", "h"), 0),
    ("positions", "weight"): (("positions", "h"), None),
    ("block", "ln1.weight"): (("h",), None),
    ("block", "ln1.bias"): (("h",), None),
    ("block", "attention.qkv.weight"): (("qkv", "h"), 0),
    ("block", "attention.qkv.bias"): (("qkv",), 0),
    ("block", "attention.dense.weight"): (("h", "h"), 1),
    ("block", "attention.dense.bias"): (("h",), None),
    ("block", "ln2.weight"): (("h",), None),
    ("block", "ln2.bias"): (("h",), None),
    ("block", "mlp.fc1.weight"): (("f", "h"), 0),
    ("block", "mlp.fc1.bias"): (("f",), 0),
    ("block", "mlp.fc2.weight"): (("h", "f"), 1),
    ("block", "mlp.fc2.bias"): (("h",), None),
    ("block", "mlp.gate_up.weight"): (("2f", "h"), 0),
    ("block", "mlp.gate_up.bias"): (("2f",), 0),
    ("block", "mlp.down.weight"): (("h", "f"), 1),
    ("block", "mlp.down.bias"): (("h",), None),
    ("final_norm", "weight"): (("h",), None),
    ("final_norm", "bias"): (("h",), None),
    ("head", "weight"): (("padded_vocab", "h"), 0),
}

# transform name -> (HF stores the transpose, layout); the layouts are handled by split_from_hf / merge_to_hf
TRANSFORMS = {"copy": (False, "plain"), "vocab": (False, "vocab"), "conv1d": (True, "plain"),
              "conv1d_qkv": (True, "qkv"), "grouped_qkv": (False, "grouped_qkv"), "gate_up": (False, "gate_up")}

GPT2_TENSORS = {
    ("embedding", "weight"): ("transformer.wte.weight", "vocab"),
    ("positions", "weight"): ("transformer.wpe.weight", "copy"),
    ("block", "ln1.weight"): ("transformer.h.{}.ln_1.weight", "copy"),
    ("block", "ln1.bias"): ("transformer.h.{}.ln_1.bias", "copy"),
    ("block", "attention.qkv.weight"): ("transformer.h.{}.attn.c_attn.weight", "conv1d_qkv"),
    ("block", "attention.qkv.bias"): ("transformer.h.{}.attn.c_attn.bias", "conv1d_qkv"),
    ("block", "attention.dense.weight"): ("transformer.h.{}.attn.c_proj.weight", "conv1d"),
    ("block", "attention.dense.bias"): ("transformer.h.{}.attn.c_proj.bias", "copy"),
    ("block", "ln2.weight"): ("transformer.h.{}.ln_2.weight", "copy"),
    ("block", "ln2.bias"): ("transformer.h.{}.ln_2.bias", "copy"),
    ("block", "mlp.fc1.weight"): ("transformer.h.{}.mlp.c_fc.weight", "conv1d"),
    ("block", "mlp.fc1.bias"): ("transformer.h.{}.mlp.c_fc.bias", "copy"),
    ("block", "mlp.fc2.weight"): ("transformer.h.{}.mlp.c_proj.weight", "conv1d"),
    ("block", "mlp.fc2.bias"): ("transformer.h.{}.mlp.c_proj.bias", "copy"),
    ("final_norm", "weight"): ("transformer.ln_f.weight", "copy"),
    ("final_norm", "bias"): ("transformer.ln_f.bias", "copy"),
}

_ATTENTION = "model.layers.{}.self_attn."
LLAMA_TENSORS = {  # LlamaForCausalLM; MistralForCausalLM and Qwen2ForCausalLM name their tensors the same way
    ("embedding", "weight"): ("model.embed_tokens.weight", "vocab"),
    ("block", "ln1.weight"): ("model.layers.{}.input_layernorm.weight", "copy"),
    ("block", "attention.qkv.weight"): ((_ATTENTION + "q_proj.weight", _ATTENTION + "k_proj.weight",
                                         _ATTENTION + "v_proj.weight"), "grouped_qkv"),
    ("block", "attention.qkv.bias"): ((_ATTENTION + "q_proj.bias", _ATTENTION + "k_proj.bias",
                                       _ATTENTION + "v_proj.bias"), "grouped_qkv"),
    ("block", "attention.dense.weight"): (_ATTENTION + "o_proj.weight", "copy"),
    ("block", "attention.dense.bias"): (_ATTENTION + "o_proj.bias", "copy"),
    ("block", "ln2.weight"): ("model.layers.{}.post_attention_layernorm.weight", "copy"),
    ("block", "mlp.gate_up.weight"): (("model.layers.{}.mlp.gate_proj.weight", "model.layers.{}.mlp.up_proj.weight"),
                                      "gate_up"),
    ("block", "mlp.gate_up.bias"): (("model.layers.{}.mlp.gate_proj.bias", "model.layers.{}.mlp.up_proj.bias"),
                                    "gate_up"),
    ("block", "mlp.down.weight"): ("model.layers.{}.mlp.down_proj.weight", "copy"),
    ("block", "mlp.down.bias"): ("model.layers.{}.mlp.down_proj.bias", "copy"),
    ("final_norm", "weight"): ("model.norm.weight", "copy"),
    ("head", "weight"): ("lm_head.weight", "vocab"),
}


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture: its names and its tensor table."""

    name: str
    """config.json's ``architectures`` entry (the transformers class)."""
    model_type: str
    base_prefix: str
    """Prefix of the base model's weights: a directory saved from the base model (GPT2Model) lacks it."""
    tensors: dict[tuple[str, str], tuple[str | tuple[str, ...], str]]
    """(our layer kind, our key) -> (HF name or names, ``{}`` for the block index; transform name)."""


ARCHITECTURES = {arch.name: arch for arch in (
    Architecture("GPT2LMHeadModel", "gpt2", "transformer.", GPT2_TENSORS),
    Architecture("LlamaForCausalLM", "llama", "model.", LLAMA_TENSORS),
    Architecture("MistralForCausalLM", "mistral", "model.", LLAMA_TENSORS),
    Architecture("Qwen2ForCausalLM", "qwen2", "model.", LLAMA_TENSORS),
)}


def compatible_architectures(config: ModelConfig) -> list[Architecture]:
    """The HF architectures that compute this model's function, preferred first (none for a mixed shape)."""
    if (config.position_embedding, config.norm, config.mlp, config.tie_word_embeddings, config.bias) == (
            "learned", "layernorm", "gelu", True, "all") and config.num_key_value_heads == config.num_attention_heads:
        return [ARCHITECTURES["GPT2LMHeadModel"]]
    if (config.position_embedding, config.norm, config.mlp) != ("rope", "rmsnorm", "swiglu"):
        return []
    names = {"none": ["LlamaForCausalLM", "MistralForCausalLM"], "all": ["LlamaForCausalLM"],
             "qkv": ["Qwen2ForCausalLM"]}[config.bias]
    return [ARCHITECTURES[name] for name in names]


def resolve_architecture(config: ModelConfig, name: str | None = None) -> Architecture:
    """``name`` (checked against the model's shape), or the first architecture that fits the shape."""
    fits = compatible_architectures(config)
    if name is not None and name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r} is not supported: choose one of {sorted(ARCHITECTURES)}")
    if not fits:
        fields = {key: getattr(config, key) for key in ("position_embedding", "norm", "mlp", "tie_word_embeddings",
                                                        "bias", "num_key_value_heads")}
        raise ValueError(f"this model's shape ({', '.join(f'model.{k} = {v!r}' for k, v in fields.items())}) is no "
                         f"Hugging Face architecture converted here: GPT-2's is learned/layernorm/gelu/tied/bias all, "
                         f"the Llama family's rope/rmsnorm/swiglu")
    if name is None:
        return fits[0]
    if ARCHITECTURES[name] not in fits:
        raise ValueError(f"this model's shape converts only to {' / '.join(a.name for a in fits)}, not {name}")
    return ARCHITECTURES[name]


class TensorMap(NamedTuple):
    """One tensor of one layer, here and in Hugging Face."""

    ours: str
    """Key in the layer's state_dict (one layer_XX file)."""
    hf: str | tuple[str, ...]
    """Key in the HF state_dict; several for a tensor fused here ("grouped_qkv": q, k, v; "gate_up": gate, up)."""
    dims: tuple[str, ...]
    """Unsharded shape here, in the symbols of ``_dimensions`` (h, qkv, f, 2f, positions, padded_vocab)."""
    partition_dim: int | None = None
    """Dimension split over TP ranks here; None: replicated on every TP rank."""
    transposed: bool = False
    """HF's Conv1D stores [in, out], the transpose of our Linear's [out, in]."""
    layout: str = "plain"
    """"qkv": GPT-2's rows per head [heads, 3, d] here, [3, heads, d] in HF; "grouped_qkv": rows per KV group here,
    HF's q, k, v apart; "gate_up": [gate_r; up_r] per TP rank here, HF's gate and up apart; "vocab": padding rows
    here only."""

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,) if isinstance(self.hf, str) else self.hf


class LayerMap(NamedTuple):
    index: int
    """Position in gpt_layer_specs, the XX of layer_XX files."""
    name: str
    tensors: tuple[TensorMap, ...]


def _our_keys(config: ModelConfig, kind: str) -> list[str]:
    """The state_dict keys of one layer of this model (layer kinds as in OUR_TENSORS)."""
    norm = ["weight", "bias"] if config.norm == "layernorm" else ["weight"]
    if kind == "embedding":
        return ["weight"]
    if kind == "positions":
        return ["weight"] if config.position_embedding == "learned" else []
    if kind == "final_norm":
        return norm
    if kind == "head":
        return [] if config.tie_word_embeddings else ["weight"]
    first, second = ("fc1", "fc2") if config.mlp == "gelu" else ("gate_up", "down")
    keys = [f"ln1.{p}" for p in norm] + ["attention.qkv.weight"]
    keys += ["attention.qkv.bias"] if config.qkv_has_bias else []
    keys += ["attention.dense.weight"] + (["attention.dense.bias"] if config.other_linears_have_bias else [])
    keys += [f"ln2.{p}" for p in norm]
    for linear in (first, second):
        keys += [f"mlp.{linear}.weight"] + ([f"mlp.{linear}.bias"] if config.other_linears_have_bias else [])
    return keys


def _layer_tensors(config: ModelConfig, architecture: Architecture, kind: str, block: int = 0
                   ) -> tuple[TensorMap, ...]:
    tensors = []
    for key in _our_keys(config, kind):
        if (kind, key) not in architecture.tensors:
            raise ValueError(f"{architecture.name} has no tensor for this model's {kind} {key}: the model's shape "
                             f"is not a {architecture.name}")
        hf, transform = architecture.tensors[kind, key]
        names = hf.format(block) if isinstance(hf, str) else tuple(name.format(block) for name in hf)
        dims, partition_dim = OUR_TENSORS[kind, key]
        transposed, layout = TRANSFORMS[transform]
        tensors.append(TensorMap(key, names, dims, partition_dim, transposed, layout))
    return tuple(tensors)


def layer_maps(config: ModelConfig, architecture: Architecture | None = None) -> list[LayerMap]:
    """Every saved layer, in pipeline order (the tied output head is the embedding, layer 0: not saved again).

    ``architecture`` defaults to the first that fits the model's shape (the tensor names of Llama, Mistral and
    Qwen2 are the same)."""
    architecture = architecture or resolve_architecture(config)
    last = config.num_layers + 2
    maps = [LayerMap(0, "word embedding", _layer_tensors(config, architecture, "embedding")),
            LayerMap(1, "position embedding" if config.position_embedding == "learned" else "embedding dropout",
                     _layer_tensors(config, architecture, "positions")),
            *[LayerMap(2 + i, f"transformer block {i}", _layer_tensors(config, architecture, "block", i))
              for i in range(config.num_layers)],
            LayerMap(last, "final norm", _layer_tensors(config, architecture, "final_norm"))]
    if not config.tie_word_embeddings:
        maps.append(LayerMap(last + 1, "output head", _layer_tensors(config, architecture, "head")))
    return maps


def _dimensions(config: ModelConfig, tensor_parallel_size: int) -> dict[str, int]:
    f = config.ffn_hidden_size
    return {"h": config.hidden_size, "qkv": config.qkv_size, "f": f, "2f": 2 * f,
            "positions": config.max_position_embeddings, "padded_vocab": config.padded_vocab_size(tensor_parallel_size)}


def full_shape(tensor: TensorMap, config: ModelConfig, tensor_parallel_size: int) -> tuple[int, ...]:
    """The unsharded shape here (the vocabulary padded for this TP size)."""
    sizes = _dimensions(config, tensor_parallel_size)
    return tuple(sizes[d] for d in tensor.dims)


def shard_shape(tensor: TensorMap, config: ModelConfig, tensor_parallel_size: int) -> tuple[int, ...]:
    shape = list(full_shape(tensor, config, tensor_parallel_size))
    if tensor.partition_dim is not None:
        shape[tensor.partition_dim] //= tensor_parallel_size
    return tuple(shape)


def hf_shape(tensor: TensorMap, config: ModelConfig) -> tuple[int, ...]:
    """The HF shape of a tensor that is one tensor in HF too."""
    shape = full_shape(tensor, config, 1)
    if tensor.layout == "vocab":
        shape = (config.vocab_size, *shape[1:])
    return tuple(reversed(shape)) if tensor.transposed else shape


def hf_tensor_shapes(tensor: TensorMap, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each HF tensor of one of ours, by name, in the order of ``tensor.hf_names``."""
    rest = full_shape(tensor, config, 1)[1:]  # () for a bias, (h,) for a weight
    if tensor.layout == "grouped_qkv":
        d = config.head_dim
        sizes = (config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d)
        return {name: (size, *rest) for name, size in zip(tensor.hf_names, sizes, strict=True)}
    if tensor.layout == "gate_up":
        return {name: (config.ffn_hidden_size, *rest) for name in tensor.hf_names}
    return {tensor.hf: hf_shape(tensor, config)}


def hf_shapes(config: ModelConfig, architecture: Architecture | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor of the exported model, in the order the export writes them."""
    return {name: shape for layer in layer_maps(config, architecture) for t in layer.tensors
            for name, shape in hf_tensor_shapes(t, config).items()}


def _qkv_hf_to_heads(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows [3, heads, d] -> [heads, 3, d] (any trailing dims)."""
    return tensor.reshape(3, num_heads, -1, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


def _grouped_qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """q [nh d, ...], k and v [g d, ...] -> rows [g, nh/g + 2, d]: each group's query heads, its k, its v."""
    groups, d = config.num_key_value_heads, config.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(groups, config.queries_per_key_value_head, d, *rest), k.reshape(groups, 1, d, *rest),
             v.reshape(groups, 1, d, *rest))
    return torch.cat(parts, dim=1).reshape(config.qkv_size, *rest)


def _grouped_qkv_to_hf(full: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, ...]:
    per_group, rest = config.queries_per_key_value_head, full.shape[1:]
    grouped = full.reshape(config.num_key_value_heads, per_group + 2, config.head_dim, *rest)
    return (grouped[:, :per_group].reshape(-1, *rest).clone(), grouped[:, per_group].reshape(-1, *rest).clone(),
            grouped[:, per_group + 1].reshape(-1, *rest).clone())


def merge_to_hf(tensor: TensorMap, shards: list[torch.Tensor], config: ModelConfig
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The TP shards of one tensor (rank order) -> the HF tensor (a tuple in ``tensor.hf_names`` order for a tensor
    fused here). Replicated: rank 0's copy.

    One allocation for a single HF tensor: each shard is copied straight into its place in the output.
    """
    if tensor.layout == "grouped_qkv":  # whole KV groups per rank: the full tensor is the concatenation
        return _grouped_qkv_to_hf(torch.cat(shards), config)
    if tensor.layout == "gate_up":  # rank r: [gate_r; up_r]
        halves = [shard.chunk(2) for shard in shards]
        return torch.cat([gate for gate, _ in halves]), torch.cat([up for _, up in halves])
    out = torch.empty(hf_shape(tensor, config), dtype=shards[0].dtype)
    ours = out.t() if tensor.transposed else out  # the output seen in our [out, in] orientation
    if tensor.partition_dim is None:
        ours.copy_(shards[0])
    elif tensor.layout == "qkv":  # rows [3, heads, d] in the output, [heads/R, 3, d] in each shard
        heads = config.num_attention_heads // len(shards)
        ours = ours.unflatten(0, (3, config.num_attention_heads, -1))
        for rank, shard in enumerate(shards):
            ours.narrow(1, rank * heads, heads).copy_(shard.unflatten(0, (heads, 3, -1)).transpose(0, 1))
    else:
        for rank, shard in enumerate(shards):
            size = shard.shape[tensor.partition_dim]
            start = rank * size
            size = min(size, ours.shape[tensor.partition_dim] - start)  # the vocabulary padding is dropped
            if size > 0:
                ours.narrow(tensor.partition_dim, start, size).copy_(shard.narrow(tensor.partition_dim, 0, size))
    return out


def split_from_hf(tensor: TensorMap, value: torch.Tensor | Sequence[torch.Tensor], config: ModelConfig,
                  tensor_parallel_size: int) -> list[torch.Tensor]:
    """An HF tensor (a sequence in ``tensor.hf_names`` order for a tensor fused here) -> this project's shard for
    each TP rank (rank order), each its own storage."""
    if tensor.layout == "gate_up":  # rank r: [gate rows of r; up rows of r]
        gate, up = (part.chunk(tensor_parallel_size) for part in value)
        return [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
    if tensor.layout == "grouped_qkv":
        full = _grouped_qkv_from_hf(*value, config)
    else:
        full = value.t() if tensor.transposed else value
    if tensor.layout == "qkv":
        full = _qkv_hf_to_heads(full, config.num_attention_heads)
    elif tensor.layout == "vocab":
        padding = config.padded_vocab_size(tensor_parallel_size) - full.shape[0]
        full = torch.cat([full, full.new_zeros(padding, *full.shape[1:])])  # padded ids: logits are -inf anyway
    if tensor.partition_dim is None:
        return [full.clone(memory_format=torch.contiguous_format) for _ in range(tensor_parallel_size)]
    # clone: torch.save of a view would write the whole underlying storage into every shard file
    return [chunk.clone(memory_format=torch.contiguous_format)
            for chunk in full.chunk(tensor_parallel_size, dim=tensor.partition_dim)]


# -- reading a checkpoint of this project ----------------------------------------------------------------------------

def _load(path: Path) -> Any:
    """Tensors and plain containers only (no pickled code); memory-mapped, so only what is used is read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: the checkpoint is incomplete; convert another tag") from None
    except Exception as error:
        raise ValueError(f"{path} cannot be read as a PyTorch checkpoint file ({error}): it is truncated or was not "
                         "written by DeepSpeed; convert another tag") from None


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """A run config's "model" block (a preset name plus overrides, or every field) -> ModelConfig."""
    values = upgrade_model_fields(values)
    name = values.pop("preset", None)
    return preset(name, **values) if name else ModelConfig(**values)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint of this project on disk, checked against the split its run config claims."""

    directory: Path
    """The checkpoint directory, the one holding ``latest``."""
    tag: str
    model: ModelConfig
    parallel: ParallelConfig
    client_state: dict[str, Any]
    """What the trainer saved beside the model: run_config, train_state."""

    @property
    def tag_directory(self) -> Path:
        return self.directory / self.tag

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallel.tensor_parallel_size


def _resolve_tag(directory: Path, tag: str | None) -> str:
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory {directory} does not exist")
    if tag is None:
        tag = read_latest(directory)
        if tag is None:
            raise ValueError(f"{directory} has no `latest` file, so no complete checkpoint: point --checkpoint at the "
                             f"run's checkpoint directory (training.save), or pass --tag global_stepN to convert a "
                             f"specific checkpoint")
    elif not (directory / tag).is_dir():
        found = sorted(p.name for p in directory.iterdir() if p.is_dir())
        raise ValueError(f"{directory} has no checkpoint {tag!r}: found {found}")
    return tag


def open_checkpoint(directory: str | Path, tag: str | None = None) -> Checkpoint:
    """Find and check a checkpoint: ``latest`` (or ``tag``), the run config, every shard file present and no extra.

    Raises ValueError naming the file and the fix. Shapes are checked as each layer is read (``read_layer``).
    """
    directory = Path(directory)
    tag = _resolve_tag(directory, tag)
    states_file = model_states_file(directory / tag, 0)
    states = _load(states_file)
    if not isinstance(states, dict) or "run_config" not in states:
        raise ValueError(f"{states_file} has no run_config in its client_state: it was not written by this project's "
                         "trainer (training/checkpoint.py), so its model shape and split are unknown")
    run_config = states["run_config"]
    client_state = {key: states[key] for key in ("run_config", "train_state") if key in states}
    del states
    try:
        model = model_config_from_dict(run_config["model"])
        parallel = ParallelConfig(**{k: v for k, v in run_config.get("parallelism", {}).items()
                                     if k in ("tensor_parallel_size", "pipeline_parallel_size")})
        model.check_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{states_file}: its run_config does not describe a valid model and split: {error}") from None
    _check_files(directory / tag, model, parallel)
    return Checkpoint(directory, tag, model, parallel, client_state)


def _check_files(tag_directory: Path, model: ModelConfig, parallel: ParallelConfig) -> None:
    """Every layer file of every TP rank present, none beyond."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    claim = f"the run_config's tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
    states = sorted(p.name for p in tag_directory.glob("mp_rank_*_model_states.pt"))
    if len(states) != tp * pp:
        raise ValueError(f"{tag_directory} holds {len(states)} mp_rank_*_model_states.pt files but {claim} means "
                         f"{tp * pp}: the files come from another split, or some are missing")
    maps = layer_maps(model)
    expected = {layer_file(tag_directory, layer.index, rank).name for layer in maps for rank in range(tp)}
    present = {p.name for p in tag_directory.glob("layer_*-model_states.pt")}
    extra = sorted(present - expected)
    if extra:
        raise ValueError(f"{tag_directory} holds layer files that {claim} with {model.num_layers} layers does not "
                         f"have: {extra[:6]}: the run_config does not match the files (another TP size or depth)")
    missing = sorted(expected - present)
    if missing:
        raise ValueError(f"{tag_directory} is missing {len(missing)} shard file(s) of {claim}: {missing[:6]}: the "
                         f"checkpoint is incomplete (copy the missing files, or convert an earlier tag)")


def read_layer(checkpoint: Checkpoint, layer: LayerMap) -> list[dict[str, torch.Tensor]]:
    """The state_dict of each TP rank of one layer, shapes checked (memory-mapped: read as used)."""
    tp = checkpoint.tensor_parallel_size
    shards = []
    for rank in range(tp):
        path = layer_file(checkpoint.tag_directory, layer.index, rank)
        state = _load(path)
        _check_layer_state(path, state, layer, checkpoint.model, tp)
        shards.append(state)
    return shards


def _check_layer_state(path: Path, state: Any, layer: LayerMap, config: ModelConfig, tp: int) -> None:
    names = {t.ours for t in layer.tensors}
    if not isinstance(state, dict) or set(state) != names:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path}: expected the {layer.name} tensors {sorted(names)}, found {found}: the file does "
                         f"not belong at layer index {layer.index} of a {config.num_layers}-layer model")
    for tensor in layer.tensors:
        expected = shard_shape(tensor, config, tp)
        if tuple(state[tensor.ours].shape) != expected:
            raise ValueError(f"{path}: {tensor.ours} has shape {tuple(state[tensor.ours].shape)}, but the "
                             f"checkpoint's run_config (tensor_parallel_size {tp}, hidden {config.hidden_size}, "
                             f"ffn {config.ffn_hidden_size}, vocab {config.vocab_size}) means {expected}: the file "
                             f"was written with another split or model shape than the run_config claims")


# -- writing safetensors a tensor at a time --------------------------------------------------------------------------

def parse_size(size: str | int) -> int:
    """"5GB" -> 5e9 bytes (KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary), or plain bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            text, multiplier = text[: -len(unit)], factor
            break
    else:
        multiplier = 1
    try:
        value = float(text) * multiplier
    except ValueError:
        raise ValueError(f"size {size!r} is not a number of bytes like 5GB, 500MB or 2000000") from None
    if value <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return int(value)


class SafetensorsShardWriter:
    """Writes tensors whose names and shapes are known up front, one at a time and in that order, into safetensors
    files of at most ``max_shard_bytes`` each (a bigger tensor gets a file of its own), plus the index that
    ``from_pretrained`` reads when there is more than one file. Each file's header is written first, so no tensor is
    held after ``write`` returns."""

    def __init__(self, directory: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 max_shard_bytes: int) -> None:
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"cannot write dtype {dtype} to safetensors: use one of {list(_SAFETENSORS_DTYPES)}")
        self.directory, self.shapes, self.dtype = Path(directory), shapes, dtype
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.files = self._plan(max_shard_bytes)
        self.order = [name for names in self.files for name in names]
        self.position, self.file_number, self.handle = 0, -1, None

    def _bytes(self, name: str) -> int:
        return self.element_size * int(torch.Size(self.shapes[name]).numel())

    def _plan(self, max_shard_bytes: int) -> list[list[str]]:
        files, size = [[]], 0
        for name in self.shapes:
            if files[-1] and size + self._bytes(name) > max_shard_bytes:
                files.append([])
                size = 0
            files[-1].append(name)
            size += self._bytes(name)
        return files

    def file_name(self, number: int) -> str:
        if len(self.files) == 1:
            return "model.safetensors"
        return f"model-{number + 1:05d}-of-{len(self.files):05d}.safetensors"

    def _header(self, names: list[str]) -> bytes:
        entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            entries[name] = {"dtype": _SAFETENSORS_DTYPES[self.dtype], "shape": list(self.shapes[name]),
                             "data_offsets": [offset, offset + self._bytes(name)]}
            offset += self._bytes(name)
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        return struct.pack("<Q", len(header)) + header

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.position >= len(self.order) or name != self.order[self.position]:
            expected = self.order[self.position] if self.position < len(self.order) else "nothing more"
            raise RuntimeError(f"safetensors writer: got {name}, expected {expected}")
        if tuple(tensor.shape) != self.shapes[name]:
            raise RuntimeError(f"safetensors writer: {name} has shape {tuple(tensor.shape)}, planned {self.shapes[name]}")
        if self.file_number + 1 < len(self.files) and name == self.files[self.file_number + 1][0]:
            self._next_file()
        data = tensor.detach().to(self.dtype).contiguous().reshape(-1)
        self.handle.write(data.view(torch.uint8).numpy().data)
        self.position += 1

    def _next_file(self) -> None:
        if self.handle is not None:
            self.handle.close()
        self.file_number += 1
        self.handle = open(self.directory / self.file_name(self.file_number), "wb")
        self.handle.write(self._header(self.files[self.file_number]))

    def close(self) -> list[str]:
        """Finish (every planned tensor must have been written); returns the file names."""
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        if self.position != len(self.order):
            raise RuntimeError(f"safetensors writer closed after {self.position} of {len(self.order)} tensors")
        names = [self.file_name(number) for number in range(len(self.files))]
        if len(self.files) > 1:
            index = {"metadata": {"total_size": sum(self._bytes(n) for n in self.order)},
                     "weight_map": {n: self.file_name(i) for i, names_ in enumerate(self.files) for n in names_}}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


# -- export ----------------------------------------------------------------------------------------------------------

def hf_config(config: ModelConfig, dtype: torch.dtype, end_of_text_id: int | None,
              architecture: Architecture | None = None, begin_of_text_id: int | None = None):
    """The transformers config of this model as ``architecture`` (default: the first that fits; vocabulary
    unpadded). ``begin_of_text_id`` defaults to the end-of-text id (GPT-2's single <|endoftext|>)."""
    architecture = architecture or resolve_architecture(config)
    begin = end_of_text_id if begin_of_text_id is None else begin_of_text_id
    if architecture.model_type == "gpt2":
        from transformers import GPT2Config

        ffn = config.ffn_hidden_size
        return GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
            n_layer=config.num_layers, n_head=config.num_attention_heads,
            n_inner=None if ffn == 4 * config.hidden_size else ffn,
            activation_function=ACTIVATION_TO_HF[config.activation], layer_norm_epsilon=config.layernorm_epsilon,
            resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout,
            initializer_range=config.init_method_std, bos_token_id=begin, eos_token_id=end_of_text_id,
            architectures=[architecture.name], tie_word_embeddings=True, dtype=str(dtype).removeprefix("torch."))
    return _llama_family_config(config, dtype, architecture, begin, end_of_text_id)


def _llama_family_config(config: ModelConfig, dtype: torch.dtype, architecture: Architecture, begin: int | None,
                         end: int | None):
    from transformers import AutoConfig

    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    rope.pop("type", None)  # the legacy spelling of rope_type
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
        initializer_range=config.init_method_std, attention_dropout=config.attention_dropout,
        tie_word_embeddings=config.tie_word_embeddings, rope_parameters=rope, bos_token_id=begin,
        eos_token_id=end, architectures=[architecture.name], dtype=str(dtype).removeprefix("torch."))
    if architecture.model_type == "llama":
        fields.update(attention_bias=config.bias == "all", mlp_bias=config.bias == "all")
    elif architecture.model_type == "mistral":
        fields.update(sliding_window=None)
    else:  # qwen2: the q, k, v biases are always there; no sliding window
        fields.update(use_sliding_window=False, sliding_window=None)
    return AutoConfig.for_model(architecture.model_type, **fields)


def gpt2_tokenizer(model_max_length: int):
    """GPT-2's byte-level BPE from the files shipped in data/assets/gpt2, as a transformers tokenizer."""
    from transformers import GPT2Tokenizer

    from data.tokenizers import DEFAULT_MERGE_FILE, DEFAULT_VOCAB_FILE

    vocab = json.loads(Path(DEFAULT_VOCAB_FILE).read_text(encoding="utf-8"))
    lines = Path(DEFAULT_MERGE_FILE).read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    return GPT2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def write_tokenizer(directory: Path, config: ModelConfig, tokenizer_path: str | Path | None = None):
    """Tokenizer files that AutoTokenizer loads offline; returns the tokenizer (its eos/bos ids go in config.json).

    Default: the shipped GPT-2 BPE (this project's default tokenizer), which only fits a 50,257-token vocabulary.
    """
    if tokenizer_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path), trust_remote_code=False, local_files_only=True)
        tokenizer.model_max_length = config.max_position_embeddings
    elif config.vocab_size == GPT2_VOCAB_SIZE:
        tokenizer = gpt2_tokenizer(config.max_position_embeddings)
    else:
        raise ValueError(f"model.vocab_size is {config.vocab_size}, not GPT-2's {GPT2_VOCAB_SIZE}: pass --tokenizer "
                         f"with the Hugging Face tokenizer directory the training data was tokenized with")
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer {tokenizer_path} has {len(tokenizer)} tokens, more than the model's "
                         f"vocabulary {config.vocab_size}: it is not the tokenizer this model was trained with")
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def _staging_directory(output: Path) -> Path:
    """A sibling of ``output`` (same filesystem, so the final rename is atomic)."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"output {output} already exists and is not empty: remove it or choose another path")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _publish(staging: Path, output: Path) -> None:
    if output.exists():
        output.rmdir()  # empty (checked before starting)
    os.rename(staging, output)


def _progress(items: Iterable, description: str, enabled: bool):
    from tqdm.auto import tqdm

    items = list(items)
    return tqdm(items, desc=description, unit="layer", total=len(items), disable=not enabled, file=sys.stderr)


def _export_architecture(checkpoint: Checkpoint, name: str | None) -> Architecture:
    """``name``, else the architecture an imported checkpoint came from, else the first that fits the shape."""
    if name is None:
        record = read_import_record(checkpoint.directory)
        imported = record.get("architecture") if record else None
        if imported in ARCHITECTURES and ARCHITECTURES[imported] in compatible_architectures(checkpoint.model):
            name = imported
    return resolve_architecture(checkpoint.model, name)


def export_to_hf(checkpoint_dir: str | Path, output_dir: str | Path, *, tag: str | None = None,
                 max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, dtype: torch.dtype | None = None,
                 tokenizer: str | Path | None = None, architecture: str | None = None,
                 progress: bool = True) -> Path:
    """A checkpoint of this project (any TP x PP) -> an HF model directory (``architecture``, by default the one
    it was imported from or the first that fits its shape): config.json, generation_config.json, model.safetensors
    (sharded above ``max_shard_size``, with an index) and tokenizer files (``tokenizer``, else the ones an import
    carried in, else GPT-2's).

    One layer is read, merged and written at a time. The directory is written beside ``output_dir`` and renamed
    into place when complete. ``dtype`` defaults to the training precision.
    """
    checkpoint = open_checkpoint(checkpoint_dir, tag)
    config, output = checkpoint.model, Path(output_dir)
    target = _export_architecture(checkpoint, architecture)
    dtype = dtype or PRECISION_DTYPES[config.precision]
    max_bytes = parse_size(max_shard_size)
    carried = checkpoint.directory / TOKENIZER_DIRECTORY
    if tokenizer is None and carried.is_dir():
        tokenizer = carried
    staging = _staging_directory(output)
    try:
        text = write_tokenizer(staging, config, tokenizer)
        hf = hf_config(config, dtype, text.eos_token_id, target, text.bos_token_id)
        hf.save_pretrained(str(staging))
        _generation_config(hf).save_pretrained(str(staging))
        maps = layer_maps(config, target)
        writer = SafetensorsShardWriter(staging, hf_shapes(config, target), dtype, max_bytes)
        for layer in _progress(maps, f"export {checkpoint.tag}", progress):
            shards = read_layer(checkpoint, layer)
            for tensor in layer.tensors:
                merged = merge_to_hf(tensor, [shard.pop(tensor.ours) for shard in shards], config)
                values = (merged,) if torch.is_tensor(merged) else merged
                for name, value in zip(tensor.hf_names, values, strict=True):
                    writer.write(name, value)
            del shards
        writer.close()
        _publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _generation_config(config):
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(config)


# -- import ----------------------------------------------------------------------------------------------------------

def _architecture_of_config(path: Path, raw: dict[str, Any]) -> Architecture:
    """From config.json's ``architectures`` (or, without it, ``model_type``)."""
    architectures = raw.get("architectures") or []
    by_type = [a for a in ARCHITECTURES.values() if a.model_type == raw.get("model_type")]
    if len(architectures) == 1 and architectures[0] in ARCHITECTURES:
        architecture = ARCHITECTURES[architectures[0]]
    elif not architectures and len(by_type) == 1:
        architecture = by_type[0]
    else:
        raise ValueError(f"{path}: architecture {architectures or raw.get('model_type')!r} is not supported: only "
                         f"{', '.join(f'{a.name} (model_type {a.model_type})' for a in ARCHITECTURES.values())} "
                         f"convert to this project's GPT")
    if raw.get("model_type") not in (None, architecture.model_type):
        raise ValueError(f"{path}: architectures says {architecture.name} but model_type is {raw['model_type']!r}, "
                         f"not {architecture.model_type!r}")
    return architecture


def read_hf_config(hf_dir: str | Path):
    """The transformers config (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config) of an HF model directory;
    ValueError for any other architecture or an option this project's GPT does not have, naming the key."""
    path = Path(hf_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: --model must be a Hugging Face model directory") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    architecture = _architecture_of_config(path, raw)
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[architecture.model_type].from_dict(raw)  # its defaults for keys an older file lacks
    if architecture.model_type == "gpt2":
        _check_gpt2_options(path, config)
    else:
        _check_llama_family_options(path, config, architecture)
    return config


def _check_gpt2_options(path: Path, config) -> None:
    unsupported = {"activation_function": config.activation_function not in ACTIVATION_FROM_HF,
                   "scale_attn_weights": not config.scale_attn_weights,
                   "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
                   "add_cross_attention": config.add_cross_attention,
                   "tie_word_embeddings": not config.tie_word_embeddings}
    for key, bad in unsupported.items():
        if bad:
            raise ValueError(f"{path}: {key} = {getattr(config, key)!r} has no equivalent in this project's GPT "
                             f"(activations {sorted(ACTIVATION_FROM_HF)}, attention scaled by 1/sqrt(d), no cross "
                             "attention, output head tied to the embedding)")


def _hf_rope(config) -> dict[str, Any]:
    """transformers >= 5 keeps rope_theta and rope_scaling together in rope_parameters; older ones apart."""
    rope = getattr(config, "rope_parameters", None)
    if rope is None:
        rope = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    return dict(rope)


def _sliding_window(config) -> int | None:
    """The window that config attends within, None when it attends to the whole context."""
    if getattr(config, "model_type", None) == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None)


def _check_llama_family_options(path: Path, config, architecture: Architecture) -> None:
    window = _sliding_window(config)
    if window is not None and window < config.max_position_embeddings:
        raise ValueError(f"{path}: sliding_window = {window} is shorter than max_position_embeddings "
                         f"({config.max_position_embeddings}): this project's attention sees the whole context, so a "
                         f"sliding-window model (as {architecture.name} configs of Mistral 7B v0.1/v0.2 are) does not "
                         f"convert; only sliding_window null, or at least max_position_embeddings, does")
    kind = _hf_rope(config).get("rope_type", _hf_rope(config).get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"{path}: rope_scaling of type {kind!r} is not supported: only \"llama3\" scaling (Llama "
                         f"3.1+) or none")
    missing = [key for key in LLAMA3_SCALING_KEYS if kind == "llama3" and key not in _hf_rope(config)]
    head_dim = getattr(config, "head_dim", None)
    attention_bias, mlp_bias = getattr(config, "attention_bias", False), getattr(config, "mlp_bias", False)
    unsupported = {
        "rope_scaling": (bool(missing), f"lacks {missing}"),
        "hidden_act": (config.hidden_act != "silu", "only silu (SwiGLU) exists here"),
        "head_dim": (head_dim not in (None, config.hidden_size // config.num_attention_heads),
                     f"must be hidden_size / num_attention_heads = {config.hidden_size // config.num_attention_heads}"),
        "attention_bias": (attention_bias != mlp_bias, f"with mlp_bias = {mlp_bias}: biases here are on every "
                                                       f"linear layer, on none, or on q, k and v only (Qwen2)")}
    for key, (bad, why) in unsupported.items():
        if bad:
            raise ValueError(f"{path}: {key} = {getattr(config, key, None)!r} has no equivalent in this project's "
                             f"GPT: {why}")


def architecture_of(config) -> Architecture:
    """The Architecture of a transformers config read by read_hf_config."""
    names = getattr(config, "architectures", None) or []
    if len(names) == 1 and names[0] in ARCHITECTURES:
        return ARCHITECTURES[names[0]]
    return next(a for a in ARCHITECTURES.values() if a.model_type == config.model_type)


def model_fields_from_hf(config) -> dict[str, Any]:
    """The ModelConfig fields an HF config fixes."""
    if config.model_type == "gpt2":
        return {"num_layers": config.n_layer, "hidden_size": config.n_embd, "num_attention_heads": config.n_head,
                "max_position_embeddings": config.n_positions, "vocab_size": config.vocab_size,
                "ffn_hidden_size": config.n_inner or 4 * config.n_embd, "layernorm_epsilon": config.layer_norm_epsilon,
                "activation": ACTIVATION_FROM_HF[config.activation_function], "position_embedding": "learned",
                "norm": "layernorm", "mlp": "gelu", "num_key_value_heads": config.n_head, "tie_word_embeddings": True,
                "bias": "all"}
    rope = _hf_rope(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None if kind == "default" else {"rope_type": kind, **{k: rope[k] for k in LLAMA3_SCALING_KEYS}}
    if config.model_type == "qwen2":
        bias = "qkv"
    else:
        bias = "all" if getattr(config, "attention_bias", False) else "none"
    return {"num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads or config.num_attention_heads,
            "max_position_embeddings": config.max_position_embeddings, "vocab_size": config.vocab_size,
            "ffn_hidden_size": config.intermediate_size, "layernorm_epsilon": config.rms_norm_eps,
            "position_embedding": "rope", "rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_scaling": scaling,
            "norm": "rmsnorm", "mlp": "swiglu", "tie_word_embeddings": bool(config.tie_word_embeddings), "bias": bias}


def check_model_matches(model: ModelConfig, hf, config_source: str, hf_source: str) -> None:
    """ValueError naming every ModelConfig field that differs from the HF model's."""
    wanted = model_fields_from_hf(hf)
    different = {field: value for field, value in wanted.items() if getattr(model, field) != value}
    if not different:
        return
    fixes = " ".join(f"--set model.{field}={json.dumps(value)}" for field, value in different.items())
    architecture, fits = architecture_of(hf), compatible_architectures(model)
    if architecture not in fits:
        target = f"only {' / '.join(a.name for a in fits)}" if fits else "no Hugging Face architecture"
        raise ValueError(f"{hf_source} is a {architecture.name}, but the model of {config_source} fits {target}: "
                         f"set the model block to the HF model's shape (a preset of its family, or {fixes})")
    wrong = [f"model.{field} is {getattr(model, field)!r} in {config_source}, the HF model has {value!r}"
             for field, value in different.items()]
    raise ValueError(f"the run config's model does not match {hf_source}:\n  " + "\n  ".join(wrong) +
                     f"\nset these fields in the model block (or pass {fixes})")


class HFWeights:
    """The tensors of an HF model directory's safetensors file(s), read one at a time (never pickle)."""

    def __init__(self, hf_dir: str | Path, architecture: Architecture = ARCHITECTURES[HF_ARCHITECTURE]) -> None:
        from safetensors import safe_open

        self.directory, self.architecture = Path(hf_dir), architecture
        index, single = self.directory / "model.safetensors.index.json", self.directory / "model.safetensors"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif single.exists():
            files = [single.name]
        elif any(self.directory.glob("pytorch_model*.bin")):
            raise ValueError(f"{self.directory} holds pytorch_model.bin (pickle), which is not read here: save it as "
                             "safetensors first (from_pretrained(...).save_pretrained(dir), safetensors by default)")
        else:
            raise ValueError(f"{self.directory} has no model.safetensors or model.safetensors.index.json")
        self._stack = contextlib.ExitStack()
        self.location: dict[str, tuple[Any, str, str]] = {}
        prefix = architecture.base_prefix
        for file in files:
            handle = self._stack.enter_context(safe_open(str(self.directory / file), framework="pt"))
            for key in handle.keys():
                canonical = key if key.startswith((prefix, "lm_head.")) else prefix + key
                self.location[canonical] = (handle, key, file)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.location:
            raise ValueError(f"{self.directory}: the weights have no {name}: not a complete "
                             f"{self.architecture.name}")
        handle, key, file = self.location[name]
        tensor = handle.get_tensor(key)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{self.directory / file}: {key} has shape {tuple(tensor.shape)}, but config.json means "
                             f"{shape}: the weights do not match the config")
        return tensor

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()


def import_from_hf(hf_dir: str | Path, model: ModelConfig, parallel: ParallelConfig, output_dir: str | Path, *,
                   run_config: dict[str, Any] | None = None, config_source: str = "the run config",
                   start_tokens: int = 0, progress: bool = True) -> Path:
    """An HF model directory (one of ``ARCHITECTURES``) -> a checkpoint of this project split ``parallel`` ways
    (TP x PP), which ``engine.load_checkpoint(dir, load_module_only=True, load_optimizer_states=False,
    load_lr_scheduler_states=False)`` loads (the optimizer starts fresh). ``model`` must match the HF model.

    Writes ``<output>/latest`` -> ``global_step0``, the layer files, one mp_rank file per stage x TP rank (client
    state: run_config, hf_import), ``<output>/hf_import.json`` (the start token count; see ``read_import_record``)
    and ``<output>/hf_tokenizer/`` (the HF directory's tokenizer files, when it has any).
    """
    hf_dir, output = Path(hf_dir), Path(output_dir)
    hf = read_hf_config(hf_dir)
    architecture = architecture_of(hf)
    check_model_matches(model, hf, config_source, str(hf_dir / "config.json"))
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    model.check_parallel(tp, pp)
    if start_tokens < 0:
        raise ValueError(f"--start-tokens must be >= 0, got {start_tokens}")
    record = {"tag": IMPORT_TAG, "start_tokens": int(start_tokens), "source": str(hf_dir.resolve()),
              "architecture": architecture.name, "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    staging = _staging_directory(output)
    try:
        tag_directory = staging / IMPORT_TAG
        tag_directory.mkdir()
        with HFWeights(hf_dir, architecture) as weights:
            for layer in _progress(layer_maps(model, architecture), f"import {hf_dir.name}", progress):
                _write_layer(tag_directory, layer, weights, model, tp)
        if run_config is None:  # the least that open_checkpoint (and so the export) needs
            run_config = {"model": model.to_dict(), "parallelism": {"tensor_parallel_size": tp,
                                                                    "pipeline_parallel_size": pp}}
        client_state = {"run_config": run_config, "hf_import": record}
        for model_parallel_rank in range(tp * pp):
            torch.save(_model_states(client_state, tp * pp), model_states_file(tag_directory, model_parallel_rank))
        _copy_tokenizer(hf_dir, staging / TOKENIZER_DIRECTORY)
        (staging / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        write_latest(staging, IMPORT_TAG)
        _publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _copy_tokenizer(hf_dir: Path, destination: Path) -> None:
    """The tokenizer files of an HF model directory, byte for byte (none: nothing is written)."""
    files = [hf_dir / name for name in TOKENIZER_FILES if (hf_dir / name).is_file()]
    if files:
        destination.mkdir()
        for file in files:
            shutil.copy2(file, destination / file.name)


def _write_layer(tag_directory: Path, layer: LayerMap, weights: HFWeights, model: ModelConfig, tp: int) -> None:
    dtype = PRECISION_DTYPES[model.precision]
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for tensor in layer.tensors:
        values = [weights.get(name, shape) for name, shape in hf_tensor_shapes(tensor, model).items()]
        for rank, piece in enumerate(split_from_hf(tensor, values[0] if len(values) == 1 else values, model, tp)):
            shards[rank][tensor.ours] = piece.to(dtype)
    for rank, state in enumerate(shards):
        torch.save(state, layer_file(tag_directory, layer.index, rank))


def _model_states(client_state: dict[str, Any], model_parallel_world_size: int) -> dict[str, Any]:
    """What DeepSpeed's load_checkpoint reads from mp_rank_XX_model_states.pt for a pipeline module loaded with
    load_module_only=True ("module": None sends it to the layer files), plus the client state."""
    return {"module": None, "buffer_names": [], "optimizer": None, "lr_scheduler": None, "global_steps": 0,
            "global_samples": 0, "skipped_steps": 0, "dp_world_size": 1,
            "mp_world_size": model_parallel_world_size, **client_state}


def read_import_record(directory: str | Path) -> dict[str, Any] | None:
    """``<directory>/hf_import.json`` of an imported checkpoint, or None for any other directory.

    {"tag": "global_step0", "start_tokens": int, "source": HF dir, "architecture": an ARCHITECTURES name,
     "tensor_parallel_size": int, "pipeline_parallel_size": int}
    """
    path = Path(directory) / IMPORT_RECORD
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if not isinstance(record.get("start_tokens"), int) or record["start_tokens"] < 0:
        raise ValueError(f"{path}: start_tokens must be a non-negative integer, got {record.get('start_tokens')!r}")
    return record
