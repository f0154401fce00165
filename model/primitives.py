"""Differentiable tensor-parallel communication, in dual pairs (Megatron's names).

Each forward is the backward of its dual:

    copy_to_tensor_parallel_region      forward: identity         backward: all-reduce
    reduce_from_tensor_parallel_region  forward: all-reduce       backward: identity
    scatter_to_tensor_parallel_region   forward: split last dim   backward: all-gather last dim
    gather_from_tensor_parallel_region  forward: all-gather last  backward: split last dim

The group is always an explicit argument. With no group, or a group of one rank, every primitive is the identity,
so TP = 1 is plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


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


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a TP region with a replicated input: the gradients of the shards are summed on the way back."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a TP region by summing the partial results of the shards."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dimension."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate the ranks' slices of the last dimension."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)
