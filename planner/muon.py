"""What Muon (optimizer.type "Muon", training/muon.py) changes in a plan: one optimizer state instead of two, a
transient gather buffer at the step, and the Newton-Schulz FLOPs and gathers of each step.

Per GPU of pipeline rank i (t, d: TP and DP sizes; EDP = d / EP; M_i the Muon matrices of the rank's TP shard,
dense M^d_i and its experts' M^e_i; the rule and the HF matrices: hf/muon_matrices.py):

    states       Adam's exp_avg + exp_avg_sq (8 bytes) for the rest, one fp32 momentum (4 bytes) for M_i, sharded as
                 ZeRO-1 shards them: 4 M^d_i / d + 4 M^e_i / EDP
    workspace    at the step, after the activations are gone: the group's update gathered whole over DP (4 M^d_i, or
                 the experts' group's 4 M^e_i, one group at a time), one parameter's TP shards gathered (4 t x its
                 shard) and Newton-Schulz's fp32 buffers (the matrix, X X^T and its square: 3 x 4 x the largest HF
                 matrix)
    FLOPs        every whole HF matrix orthogonalised on the t TP ranks of the DP rank whose partition holds it:
                 sum of newton_schulz_flops over the stage's matrices / d (the experts' / EDP), run in fp32 on the
                 CUDA cores (torch's default matmul precision: no TF32), at Hardware.fp32_tflops x matmul_efficiency
    traffic      an fp32 all-gather of the update over DP (4 M^d_i, 4 M^e_i over EDP) and, per matrix, of its TP
                 shards over TP (4 (t - 1) / t of each parameter the rank orthogonalises)

Counted on the meta device from the blocks the stage builds (model/gpt.py's layer specs), through the optimizer's
own rule and merge, so the plan prices the matrices the optimizer will orthogonalise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf.muon_matrices import hf_matrix_shapes, muon_parameters, newton_schulz_flops
from model.config import ModelConfig
from model.parallel import ParallelContext
from model.summary import StageCount, layer_block_numbers
from runconfig.optimizer import muon_config
from runconfig.run import RunConfig

MOMENTUM_BYTES = 4
"""One fp32 momentum per Muon parameter of the ZeRO partition."""


@dataclass(frozen=True)
class MuonStage:
    """Muon's matrices of one TP rank of one pipeline rank (its two stages under DualPipeV)."""

    dense_parameters: int
    """M^d_i: the Muon matrices' parameters outside the experts, this TP rank's shards."""
    expert_parameters: int
    """M^e_i: this rank's experts' (E / EP of each sparse block), this TP rank's shards."""
    dense_flops: int
    """Newton-Schulz FLOPs of one step over every whole HF matrix of the dense part (done once per DP group)."""
    expert_flops: int
    """The same over this rank's experts' matrices."""
    largest_parameter: int
    """Elements of the largest Muon parameter of the TP rank (a fused qkv or gate_up shard)."""
    largest_matrix: int
    """Elements of the largest whole HF matrix."""

    def states_bytes(self, data_parallel_size: int, expert_data_parallel_size: int) -> int:
        return (MOMENTUM_BYTES * self.dense_parameters // data_parallel_size
                + MOMENTUM_BYTES * self.expert_parameters // expert_data_parallel_size)

    def workspace_bytes(self, tensor_parallel_size: int) -> int:
        return 4 * (max(self.dense_parameters, self.expert_parameters)
                    + tensor_parallel_size * self.largest_parameter + 3 * self.largest_matrix)

    def flops_per_rank(self, data_parallel_size: int, expert_data_parallel_size: int) -> float:
        return self.dense_flops / data_parallel_size + self.expert_flops / expert_data_parallel_size


def muon_stage(model: ModelConfig, count: StageCount, tensor_parallel_size: int, expert_parallel_size: int = 1,
               ns_steps: int = 5) -> MuonStage:
    """Build the rank's blocks on the meta device (every expert, EP 1) and count what Muon takes of them; the
    experts scaled to the rank's E / EP."""
    from model.gpt import gpt_layer_specs

    ctx = ParallelContext(tensor_parallel_size=tensor_parallel_size)
    specs = gpt_layer_specs(model, ctx, seed=0)
    numbers = layer_block_numbers(model, [spec.typename.__name__ for spec in specs])
    holder = nn.Module()
    with torch.device("meta"):
        for index, spec in enumerate(specs):
            if numbers[index] and set(numbers[index]) <= set(count.blocks) and max(numbers[index]) <= model.num_layers:
                holder.add_module(str(index), spec.build())
    names = {id(param): name for name, param in holder.named_parameters()}
    dense = expert = dense_flops = expert_flops = largest_parameter = largest_matrix = 0
    for param, tensor in muon_parameters(holder, model).items():
        shapes = hf_matrix_shapes(tensor, param, model, tensor_parallel_size)
        flops = sum(newton_schulz_flops(*shape, ns_steps) for shape in shapes)
        largest_parameter = max(largest_parameter, param.numel())
        largest_matrix = max(largest_matrix, *(shape.numel() for shape in shapes))
        if ".experts." in names[id(param)]:
            expert += param.numel() // expert_parallel_size
            expert_flops += flops // expert_parallel_size
        else:
            dense += param.numel()
            dense_flops += flops
    return MuonStage(dense, expert, dense_flops, expert_flops, largest_parameter, largest_matrix)


def optimizer_states(config: RunConfig, count: StageCount, dense: int, experts: int,
                     data_parallel_size: int) -> tuple[int, int]:
    """A rank's optimizer states (bytes; ZeRO-1 shards the dense parameters over DP, the experts over EDP) and its
    transient step buffers: Adam's exp_avg and exp_avg_sq, 8 bytes a parameter; under Muon its matrices one fp32
    momentum (``MuonStage``)."""
    d, ep = data_parallel_size, config.parallelism.expert_parallel_size
    muon = muon_config(config.deepspeed)
    if muon is None:
        return 8 * dense // d + 8 * experts // (d // ep), 0
    step = muon_stage(config.model, count, config.parallelism.tensor_parallel_size, ep, muon.ns_steps)
    return (8 * (dense - step.dense_parameters) // d + step.states_bytes(d, d // ep),
            step.workspace_bytes(config.parallelism.tensor_parallel_size))
