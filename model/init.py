"""Initialisation that does not depend on how the model is split.

Every weight is N(0, std^2). Each index along the dimension a tensor is sharded on (a row of a column-parallel
weight, a column of a row-parallel weight, a row of the vocabulary) draws from its own generator, seeded from
(base seed, layer, parameter name, global index). A shard therefore holds exactly the slice of the unsharded
tensor, for any tensor-parallel size, and a stage builds exactly the layers of the unsplit model, for any
pipeline split: the same seed gives the same full model whatever TP x PP runs it.
"""

from __future__ import annotations

import zlib

import torch

from common.device import HOST

_SEED_BITS = (1 << 63) - 1


def mix_seed(*values: int) -> int:
    """Combine integers into a 63-bit seed (splitmix64 steps; the same on every machine and Python version)."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
        state = state * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 29
    return state & _SEED_BITS


def parameter_seed(base_seed: int, layer_number: int, name: str) -> int:
    """The seed of one parameter of one layer."""
    return mix_seed(base_seed, layer_number, zlib.crc32(name.encode()))


@torch.no_grad()
def normal_sharded_(tensor: torch.Tensor, std: float, seed: int, shard_dim: int = 0, shard_offset: int = 0) -> None:
    """Fill ``tensor``, the slice [shard_offset, shard_offset + n) along ``shard_dim`` of a full tensor, with N(0, std^2).

    The values equal that slice of the full tensor filled by the same call with shard_offset 0. Meta tensors are
    left alone (nothing is allocated for a meta-device build).
    """
    if tensor.is_meta:
        return
    moved = tensor.movedim(shard_dim, 0)  # (n, *rest): one generator per global index along the shard dim
    generator = torch.Generator(device=HOST)  # host: the same draws at any split and on any device
    row_shape = moved.shape[1:]
    for local_index in range(moved.shape[0]):
        generator.manual_seed(mix_seed(seed, shard_offset + local_index))
        row = torch.randn(row_shape, generator=generator, dtype=torch.float32, device=HOST)  # host: its generator's
        moved[local_index].copy_(row.mul_(std))
