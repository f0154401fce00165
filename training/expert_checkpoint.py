"""The experts of an expert-parallel run (EP > 1) in checkpoints: files of their own, one per EP rank.

At EP > 1 a data-parallel rank holds E / EP of each sparse layer's experts, and DeepSpeed's layer files are written
by data-parallel rank 0 alone (PipelineModule.save_state_dict), so a layer file could hold only its experts. The
experts stay out of the layer files then (model/moe.py Experts._save_to_state_dict), and the first rank of each
expert-data-parallel group (the ranks that hold the same experts; data-parallel ranks 0 .. EP - 1) writes its own:

    experts_<LL>-model_<TT>-ep_<EE>.pt      {name in layer LL: tensor}: the [E / EP, ...] experts of EP rank EE,
                                            TP rank TT (model/checkpoint_files.py expert_file)

through the same snapshot engine as every other file, so they are in the checkpoint's record and its commit.
Readers take the whole [E, ...] tensors from model/checkpoint_files.py read_experts: the Hugging Face export and
evaluation read any EP as if written at EP 1. Loading: DeepSpeed reads the layer files as ever (the experts'
absence leaves them ``awaiting_files``), then ``restore_experts`` copies each rank's [first, first + E_l) from the
assembled files, whatever the EP that wrote them. The optimizer states of the experts are in DeepSpeed's ZeRO files,
sharded over the expert-data-parallel groups; another layout reaches them through training/universal_conversion.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from common import deepspeed_internals as ds_internals
from model.checkpoint_files import expert_file, read_experts
from model.moe import Experts


def _stage_experts(module: Any) -> list[tuple[int, nn.Module, list[tuple[str, Experts]]]]:
    """(layer index, layer, [(name in the layer, Experts)]) of every layer of this stage that holds experts."""
    found = []
    for index in ds_internals.stage_layer_indices(module):
        try:
            layer = ds_internals.stage_layer(module, index)
        except KeyError:  # a function or a tied layer
            continue
        experts = [(name, child) for name, child in layer.named_modules() if isinstance(child, Experts)]
        if experts:
            found.append((index, layer, experts))
    return found


def save_expert_files(module: Any, tag_directory: Path, tensor_parallel_rank: int, expert_parallel_size: int,
                      save: Callable[[dict[str, Any], str], None]) -> None:
    """At EP > 1, on the first rank of each expert-data-parallel group: this stage's experts, one file per sparse
    layer, through ``save`` (the checkpoint engine's). Every rank calls it; the others write nothing."""
    if expert_parallel_size <= 1:
        return
    _, expert_data_parallel_ranks, _ = ds_internals.expert_parallel_ranks(expert_parallel_size)
    if dist.get_rank() != min(expert_data_parallel_ranks):
        return
    for index, _, experts in _stage_experts(module):
        state = {f"{name}.{key}": tensor.detach() for name, child in experts
                 for key, tensor in child.named_parameters(recurse=False)}
        ep_rank = experts[0][1].first // experts[0][1].gate_up.shape[0]
        save(state, str(expert_file(tag_directory, index, tensor_parallel_rank, ep_rank)))


def restore_experts(module: Any, tag_directory: Path, tensor_parallel_rank: int) -> bool:
    """After DeepSpeed loaded a checkpoint whose layer files hold no experts (written at EP > 1): each Experts'
    [first, first + E_l) from the layer's expert files, whatever their EP. Layers loaded whole are left alone.
    Returns whether any were restored (then an optimizer's fp32 copies of them are stale unless it loads its own)."""
    restored = False
    for index, _, experts in _stage_experts(module):
        waiting = [(name, child) for name, child in experts if child.awaiting_files]
        if not waiting:
            continue
        whole = read_experts(tag_directory, index, tensor_parallel_rank, waiting[0][1].num_experts)
        if whole is None:
            raise ValueError(f"{tag_directory}: the layer file of layer {index} holds no experts and there is no "
                             f"{expert_file(tag_directory, index, tensor_parallel_rank, 0).name}: the checkpoint is "
                             f"incomplete (copy its experts_* files) or was not written by this project")
        for name, child in waiting:
            child.load_state_dict({key: whole[f"{name}.{key}"] for key in ("gate_up", "down")})
        restored = True
    return restored
