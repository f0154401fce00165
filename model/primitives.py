"""Differentiable tensor-parallel communication, in dual pairs (Megatron's names).

Each forward is the backward of its dual:

    copy_to_tensor_parallel_region      forward: identity         backward: all-reduce
    reduce_from_tensor_parallel_region  forward: all-reduce       backward: identity
    scatter_to_tensor_parallel_region   forward: split last dim   backward: all-gather last dim
    gather_from_tensor_parallel_region  forward: all-gather last  backward: split last dim

and with sequence parallelism (Korthikanti et al. 2022), where activations outside the TP matmuls are split along
the sequence (dim 1 of (b, s, h)), each rank holding s/R positions:

    gather_from_sequence_parallel_region      forward: all-gather seq   backward: reduce-scatter seq
    reduce_scatter_to_sequence_parallel_region forward: reduce-scatter  backward: all-gather seq

and over the expert-parallel group (model/moe.py), rows exchanged with uneven splits, and the rows each TP rank
received gathered over TP for the TP-sharded experts (uneven too):

    all_to_all                                      forward: all-to-all        backward: the reverse all-to-all
    gather_rows_from_tensor_parallel_region         forward: all-gather rows   backward: reduce-scatter rows
    reduce_scatter_rows_to_tensor_parallel_region   forward: reduce-scatter    backward: all-gather rows

An all-gather and a reduce-scatter move the bytes of the one all-reduce they replace. The column-parallel layers
fuse the all-gather with their matmul instead (model/layers.py), to store the shard rather than the gathered input.

The group is always an explicit argument. With no group, or a group of one rank, every primitive is the identity,
so TP = 1 is plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None

# torch 2.13 names the single-tensor collectives all_gather_single and reduce_scatter_single (the old names forward to
# them, with a deprecation warning); torch 2.11 and 2.12, as GPU images ship them, have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def all_gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(b, s/R, ...) on each rank -> (b, s, ...), the ranks' shards in rank order (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    gathered = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # (R b, s/R, ...)
    all_gather_single(gathered, x, group=group)
    gathered = gathered.view(world, *x.shape)  # (R, b, s/R, ...)
    return gathered.transpose(0, 1).reshape(x.shape[0], world * x.shape[1], *x.shape[2:])


def reduce_scatter_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(b, s, ...) partial sums on each rank -> (b, s/R, ...): this rank's positions, summed over the ranks."""
    world = group_size(group)
    if world == 1:
        return x
    b, s = x.shape[:2]
    if s % world:
        raise ValueError(f"sequence length {s} is not divisible by the tensor-parallel size {world}")
    chunks = x.reshape(b, world, s // world, *x.shape[2:]).transpose(0, 1).contiguous()  # (R, b, s/R, ...)
    shard = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_single(shard, chunks.view(world * b, *chunks.shape[2:]), group=group)
    return shard


def _identity(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x


Op = Callable[[torch.Tensor, Group], torch.Tensor]


def _region(forward: Op, backward: Op, doc: str) -> Op:
    """The differentiable primitive whose forward is ``forward`` and whose backward is ``backward`` (its dual)."""

    class Region(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group), None

    def primitive(x: torch.Tensor, group: Group) -> torch.Tensor:
        return x if group_size(group) == 1 else Region.apply(x, group)

    primitive.__doc__ = doc
    return primitive


copy_to_tensor_parallel_region = _region(
    _identity, _all_reduce,
    "Enter a TP region with a replicated input: the gradients of the shards are summed on the way back.")
reduce_from_tensor_parallel_region = _region(
    lambda x, group: _all_reduce(x.clone(), group), _identity,
    "Leave a TP region by summing the partial results of the shards.")
scatter_to_tensor_parallel_region = _region(
    _split_last_dim, _gather_last_dim, "Keep this rank's slice of the last dimension.")
gather_from_tensor_parallel_region = _region(
    _gather_last_dim, _split_last_dim, "Concatenate the ranks' slices of the last dimension.")
gather_from_sequence_parallel_region = _region(
    all_gather_sequence, reduce_scatter_sequence,
    "Sequence shards (b, s/R, h) -> the whole sequence (b, s, h); gradients are reduce-scattered back.")
reduce_scatter_to_sequence_parallel_region = _region(
    reduce_scatter_sequence, all_gather_sequence,
    "Partial sums (b, s, h) -> this rank's positions (b, s/R, h), summed over the ranks.")


def _gather_rows(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    """(sizes[r], ...) rows on rank r -> (sum(sizes), ...) on every rank, in rank order. Each rank's rows are padded
    to the largest size for one all-gather of equal parts (the sizes are host numbers the caller has read)."""
    largest = max(sizes)
    padded = x.new_zeros((largest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    gathered = x.new_empty((len(sizes) * largest, *x.shape[1:]))
    all_gather_single(gathered, padded, group=group)
    return torch.cat([gathered[r * largest:r * largest + size] for r, size in enumerate(sizes)])


def _reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    """(sum(sizes), ...) partial sums on every rank -> rank r's (sizes[r], ...) rows, summed over the ranks."""
    largest = max(sizes)
    padded = x.new_zeros((len(sizes), largest, *x.shape[1:]))
    for r, part in enumerate(x.split(sizes)):
        padded[r, : part.shape[0]] = part
    mine = x.new_empty((largest, *x.shape[1:]))
    reduce_scatter_single(mine, padded.view(len(sizes) * largest, *x.shape[1:]), group=group)
    return mine[: sizes[group_rank(group)]]


class _RowRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group, gather):
        ctx.sizes, ctx.group, ctx.gather = sizes, group, gather
        return _gather_rows(x, sizes, group) if gather else _reduce_scatter_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        dual = _reduce_scatter_rows if ctx.gather else _gather_rows
        return dual(grad.contiguous(), ctx.sizes, ctx.group), None, None, None


def gather_rows_from_tensor_parallel_region(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    """Each rank's rows, uneven (``sizes[r]`` on rank r, host numbers) -> all of them on every rank, in rank order;
    the gradients are reduce-scattered back (the TP-sharded experts' inputs, model/moe.py)."""
    return x if group_size(group) == 1 else _RowRegion.apply(x, sizes, group, True)


def reduce_scatter_rows_to_tensor_parallel_region(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    """Partial sums of every rank's rows -> this rank's own ``sizes[rank]`` rows, summed over the ranks; the gradients
    are all-gathered (the TP-sharded experts' outputs, back to the ranks whose rows they are)."""
    return x if group_size(group) == 1 else _RowRegion.apply(x, sizes, group, False)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Group) -> torch.Tensor:
    received = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(received, x.contiguous(), output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
    return received


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None  # the rows go back


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Group) -> torch.Tensor:
    """Rows of x (n, ...) exchanged over the group: the next input_splits[q] rows go to rank q, and the result
    (sum(output_splits), ...) holds output_splits[q] rows from rank q, in rank order. Splits may be uneven or zero
    (host lists: the caller exchanges the counts first). Gradients take the reverse exchange, its own dual."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)
