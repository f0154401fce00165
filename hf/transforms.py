"""The transforms between a tensor here (TP shards) and in Hugging Face, named in the tables (hf/tables.py):

    here (TP shards merged)                              Hugging Face                                  transform
    word embedding / untied head [V_padded, h]           embed_tokens / wte / lm_head [V, h]           "vocab"
      rows split over TP                                   the padding rows dropped (zeros on import)
    Linear weights [out, in]                             GPT-2's Conv1D [in, out]: the transpose       "conv1d"
    GPT-2 qkv [3h, h], rows [heads, 3 (q,k,v), d]        c_attn [h, 3h], columns [3 (q,k,v), heads, d]  "conv1d_qkv"
    grouped qkv [(nh + 2 g) d, h], rows per KV group     q_proj [nh d, h], k_proj, v_proj [g d, h]      "grouped_qkv"
      [g, nh/g + 2, d]: the group's query heads, k, v    (query head j in group j // (nh/g))
    gate_up [2 f, h]: TP rank r holds [gate_r; up_r]     gate_proj, up_proj [f, h]                     "gate_up"
    experts.gate_up [E, 2 F, h]: per expert as gate_up   per expert e: gate (w1), up (w3) [F, h]       "experts_gate_up"
    experts.down [E, h, F], columns split over TP        per expert e: down (w2) [h, F]                "experts"
    everything else                                      the same tensor                               "copy"

RoPE is HF's non-interleaved rotate_half here too, so q_proj and k_proj need no row permutation.

The padded vocabulary rows (ids >= vocab_size, whose logits this project forces to -inf) are dropped on export: the
HF model has exactly the tokenizer's vocabulary and gives the same distribution. On import they are zeros.

Between two TP sizes of this project no HF tensor is needed: ``merge_shards`` joins a tensor's shards into the whole
tensor in our own layout and ``split_shards`` cuts it again, from the layer maps' dims alone, so they serve every
tensor of our layer files, those with no HF name too (the sigmoid_bias router's expert_bias).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf.tables import EXPERT_LAYOUTS, TensorMap, hf_shape
from model.config import ModelConfig


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


def _expert_slice(tensor: TensorMap) -> TensorMap:
    """The map of one expert's slice [...] of an [E, ...] tensor (its first HF name(s) stand for any expert's)."""
    layout = EXPERT_LAYOUTS[tensor.layout]
    parts = 2 if layout == "gate_up" else 1
    names = tensor.hf_names[:parts]
    fields = {name: getattr(tensor, name) for name in TensorMap.__annotations__}
    fields.update(hf=names[0] if parts == 1 else names, dims=tensor.dims[1:], layout=layout,
                  partition_dim=None if tensor.partition_dim is None else tensor.partition_dim - 1)
    return TensorMap(**fields)


def merge_to_hf(tensor: TensorMap, shards: list[torch.Tensor], config: ModelConfig
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The TP shards of one tensor (rank order) -> the HF tensor (a tuple in ``tensor.hf_names`` order for a tensor
    fused here). Replicated: rank 0's copy.

    One allocation for a single HF tensor: each shard is copied straight into its place in the output.
    """
    if tensor.layout in EXPERT_LAYOUTS:  # each expert's slices merged as one tensor of its layout, expert-major
        one = _expert_slice(tensor)
        merged = [merge_to_hf(one, [shard[expert] for shard in shards], config) for expert in range(len(shards[0]))]
        return tuple(part for each in merged for part in ((each,) if torch.is_tensor(each) else each))
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
    if tensor.layout in EXPERT_LAYOUTS:  # each expert split as one tensor of its layout; rank r stacks its slices
        one = _expert_slice(tensor)
        parts = len(one.hf_names)
        per_expert = [split_from_hf(one, value[start] if parts == 1 else value[start:start + parts], config,
                                    tensor_parallel_size) for start in range(0, len(value), parts)]
        return [torch.stack([shards[rank] for shards in per_expert]) for rank in range(tensor_parallel_size)]
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


# -- our tensors between TP sizes, no HF in between ---------------------------------------------------------------

def _is_halves(tensor: TensorMap) -> bool:
    """Split on a "2f" / "2fe" / "2fs" dimension: each TP rank holds [gate_r; up_r] (hf/tables.py OUR_TENSORS)."""
    return tensor.partition_dim is not None and tensor.dims[tensor.partition_dim].startswith("2")


def merge_shards(tensor: TensorMap, shards: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The TP shards of one of our tensors (rank order) -> the whole tensor in our layout, whatever TP wrote it:
    the vocabulary padding cut off, a gate_up's rows [gate; up]; rows per head or per KV group stay whole heads and
    groups, so they join in rank order. Replicated (a norm, a router, its expert_bias): rank 0's copy. Needs no HF
    name: any shape, ``split_shards`` its inverse."""
    dim = tensor.partition_dim
    if dim is None:
        return shards[0]
    if _is_halves(tensor):
        halves = [shard.chunk(2, dim) for shard in shards]
        return torch.cat([torch.cat([pair[part] for pair in halves], dim) for part in (0, 1)], dim)
    whole = torch.cat(shards, dim)
    return whole.narrow(dim, 0, config.vocab_size) if tensor.dims[dim] == "padded_vocab" else whole


def split_shards(tensor: TensorMap, whole: torch.Tensor, config: ModelConfig,
                 tensor_parallel_size: int) -> list[torch.Tensor]:
    """The whole tensor (``merge_shards``) -> each TP rank's shard (rank order), each its own storage; the
    vocabulary padded with zeros for this TP size (padded ids' logits are -inf anyway)."""
    dim, contiguous = tensor.partition_dim, torch.contiguous_format
    if dim is None:
        return [whole.clone(memory_format=contiguous) for _ in range(tensor_parallel_size)]
    if _is_halves(tensor):
        gate, up = (half.chunk(tensor_parallel_size, dim) for half in whole.chunk(2, dim))
        return [torch.cat([g, u], dim) for g, u in zip(gate, up, strict=True)]
    if tensor.dims[dim] == "padded_vocab":
        shape = list(whole.shape)
        shape[dim] = config.padded_vocab_size(tensor_parallel_size) - whole.shape[dim]
        whole = torch.cat([whole, whole.new_zeros(shape)], dim)
    return [chunk.clone(memory_format=contiguous) for chunk in whole.chunk(tensor_parallel_size, dim)]
