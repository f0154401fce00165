"""Which parameters Muon orthogonalises, and as which Hugging Face matrices: the rule training/muon.py applies and
planner/muon.py prices, in one place.

Muon takes the block matrices (attention's and the MLP's, experts included); each is orthogonalised as the HF model's
matrices (q, k, v, o, gate, up, down apart; each expert's apart), whatever this project fuses or shards
(hf/tables.py's maps, hf/transforms.py's merge). Routers and the shared-expert gate are not maps between hidden
features and stay with AdamW, as do embeddings, the head, norms and biases (Moonlight; torch's docs).
"""

from __future__ import annotations

import torch
from torch import nn

from hf.tables import TensorMap, layer_maps, resolve_architecture
from hf.transforms import merge_to_hf
from model.config import ModelConfig

NOT_MUON = ("mlp.block.router.weight", "mlp.block.shared_expert.gate")
"""2-D block tensors that are not weight matrices of a linear map between hidden features: routers and the
shared-expert gate go to AdamW (Moonlight; torch's docs)."""


def muon_parameters(module: nn.Module, config: ModelConfig) -> dict[nn.Parameter, TensorMap]:
    """The stage's block matrices with their HF tensor maps (hf/tables.py), keyed by parameter. A pipeline module
    names a layer's parameters "<layer index>.<key>", the index and key of layer_XX files."""
    maps = {layer.index: {tensor.ours: tensor for tensor in layer.tensors}
            for layer in layer_maps(config, resolve_architecture(config))}
    blocks = range(2, config.num_layers + 2)
    found = {}
    for name, param in module.named_parameters():
        index, _, key = name.partition(".")
        if not index.isdigit() or int(index) not in blocks or param.ndim < 2 or key in NOT_MUON:
            continue
        tensor = maps[int(index)].get(key)
        if tensor is None:
            raise ValueError(f"Muon: the block parameter {name} has no Hugging Face tensor map (hf/tables.py)")
        found[param] = tensor
    return found


def hf_matrix_shapes(tensor: TensorMap, shard: torch.Tensor, config: ModelConfig,
                     tensor_parallel_size: int) -> list[torch.Size]:
    """The shapes of the HF matrices Muon orthogonalises for one parameter, ``shard`` being one TP rank's (any
    device; merged on the meta device)."""
    with torch.device("meta"):
        merged = merge_to_hf(tensor, [shard.to("meta")] * tensor_parallel_size, config)
    return [matrix.shape for matrix in ((merged,) if torch.is_tensor(merged) else merged)]


def newton_schulz_flops(rows: int, columns: int, steps: int = 5) -> int:
    """Multiply-adds x 2 of Newton-Schulz on an [rows, columns] matrix: per step X X^T (s^2 l), A A (s^3) and
    B X (s^2 l), with s the short side and l the long one."""
    short, long = min(rows, columns), max(rows, columns)
    return 2 * steps * (2 * short * short * long + short ** 3)
