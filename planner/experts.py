"""Mixture-of-Experts models (model.moe) in the plan: the parameters of an expert-parallel rank, the optimizer
states' split over the expert-data-parallel group, and the all-to-all of the dispatch and the links it takes.

E experts, k = top_k, F = moe_ffn_hidden_size, F_s = shared_expert_ffn_hidden_size, h hidden, e bytes of the model
dtype; t, p, d: tensor-, pipeline-, data-parallel sizes; P = parallelism.expert_parallel_size (EP), E_l = E / P the
local experts of each sparse block on one GPU; T = s b the tokens of a micro-batch on one EP rank: every TP rank of
it routes them all, but under sequence parallelism at EP > 1 (the sequence-split dispatch) each routes and sends its
own T / t (model/moe.py).

Parameters of one TP rank of stage i (model/moe.py's tensors; a rank holds only its own E_l experts)
    each layer but the sparse blocks as model/summary.py counts it; each sparse block
        attention and norms (a dense block's, /t) + router E h + E_l x 3 h F / t + (3 h F_s / t + h: the shared
        expert and its gate, when F_s > 0; no gate: shared_expert_gate false)
    the router and the shared gate replicated over TP; model.mtp's module (last stage) as model/summary.py
    mtp_parameters counts it, its sparse blocks (L + k) with E_l experts too. N^e_i = (sparse blocks of the stage,
    model.mtp's included) x E_l x 3 h F / t are its expert parameters. Counted from the config (model/summary.py
    sparse_block_parameters, the block count the model's total and active counts use too); tests/test_planner_moe.py
    checks the count against the model built on the meta device at EP 2. DeepSeek-V3 at EP 64: each sparse block 187,121,664 (MLA and its norms) +
    1,835,008 (router) + 4 x 44,040,192 (its experts) + 44,040,192 (the shared expert) = 409,157,632 per GPU.
Optimizer states (ZeRO-1). DeepSpeed's optimizers hold the experts in a parameter group of their own
    (training/engine.py) and partition it over the expert-data-parallel group, the d / P data ranks that hold the
    same experts (BF16_Optimizer._configure_moe_settings: groups._get_expert_data_parallel_group); the dense
    parameters over DP as before:
        master 4 ((N_i - N^e_i) / d + N^e_i / (d / P)), Adam 8 (same), ZeRO's fp32 gradient partition 4 (same);
    weights, .grad and BF16_Optimizer's fp32 accumulation buffer are full size: N_i, local experts only. At P = 1
    the expert-data-parallel group is DP and this is the dense formula applied to the MoE's count. The gradient
    reduction follows the groups: the dense part over DP, the expert part over d / P ranks (their DP-group links).
All-to-all (model/moe.py steps 5 and 7: dispatch the rows to the experts' ranks, bring the outputs back), per sparse
    block and micro-batch on every GPU: dispatch and combine in the forward and their gradients in the backward, 4;
    2 more where the block is fully recomputed (its forward reruns in the backward; "selective" reruns attention
    only). Each moves, per GPU (whole rows of h: every TP rank dispatches its own copy to its TP coordinate's ranks,
    or under the sequence-split dispatch its own T / t tokens' rows),
        bytes = e k' T h (P - 1) / P   (T / t split),   k' = k min(1, capacity_factor) (the assignments kept)
    The split dispatch's gather of the received rows over TP and their reduce-scatter back (e k' T h (t - 1) / t
    each, inside the node: NVLink) are not counted.
    the routing assumed balanced (each rank sends 1/P of its rows to each rank; a skewed router sends more to the
    busiest rank, which paces the group). Timed at one GPU's per-direction bandwidth times comm_efficiency, like
    the other collectives: NVLink when every EP group lies inside a node, InfiniBand when one spans nodes (the
    share of a spanning group's traffic that stays inside a node would go over NVLink at the same time; not
    modelled: the slower link paces it). The counts' all-to-all (E integers) and the host synchronisation of the
    uneven splits are latency, not counted. Not overlapped with compute: the dispatch waits for its counts.
EP groups are P consecutive data ranks with the same TP and PP coordinates (model/parallel.py, DeepSpeed's
    _create_expert_data_and_model_parallel); DeepSpeed's topology numbers a GPU pipe x (d t) + data x t + model, so
    a group spans the ranks first .. first + (P - 1) t, which leave a node of g GPUs when first // g differs from
    last // g (expert_group_spans_nodes).
FLOPs and MFU count the active parameters (model/flops.py, mean_mlp_active_weights: the router, k experts and the
    shared expert per sparse block), as Megatron-LM counts MFU for MoE; the experts' GEMMs (model/moe.py: a matmul
    pair per local expert, or a grouped GEMM where it uses one) are assumed to run at the same matmul_efficiency as
    the dense ones, not measured: a small F / t (Qwen3-30B-A3B: 768) or few rows per expert will run below it; lower
    --matmul-efficiency to see. Load imbalance is not modelled (balanced routing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from model.config import ModelConfig, stages_per_rank
from model.summary import (
    StageCount,
    analytic_layer_parameters,
    check_split,
    dense_block_parameters,
    layer_block_numbers,
    mtp_parameters,
    sparse_block_parameters,
    stage_boundaries,
)
from planner.hardware import DTYPE_BYTES


@dataclass(frozen=True)
class ExpertStageCount(StageCount):
    """A StageCount of a Mixture-of-Experts model at one expert-parallel size (module docstring)."""

    expert_parameters_per_tp_rank: int = 0
    """N^e_i: of parameters_per_tp_rank, the local experts' (sharded over the expert-data-parallel group)."""
    sparse_blocks: int = 0
    """The stage's blocks with experts."""
    local_experts: int = 0
    """E / P: the experts of each sparse block this GPU holds."""


def expert_parameters_of(count: StageCount) -> int:
    """N^e_i; 0 for a dense model's count."""
    return getattr(count, "expert_parameters_per_tp_rank", 0)


def expert_matrix_parameters(model: ModelConfig, tensor_parallel_size: int) -> int:
    """One routed expert on one TP rank: gate_up 2 F h / t + down h F / t."""
    return 3 * model.hidden_size * model.moe.moe_ffn_hidden_size // tensor_parallel_size


VOCABULARY_PARALLEL = ("WordEmbedding", "OutputHead")


def count_expert_stages(model: ModelConfig, tensor_parallel_size: int, pipeline_parallel_size: int,
                        expert_parallel_size: int = 1, pipeline_schedule: str = "1f1b",
                        uneven_stages: bool = False) -> list[ExpertStageCount]:
    """model/summary.py's count_stages for a Mixture-of-Experts model, from the config: one count per pipeline rank
    of one TP rank and one EP rank (every EP rank holds as many experts), DeepSpeed's partition of the blocks, under
    DualPipeV the rank's two stages in ``phases`` and the tied embedding once on rank 0. ``uneven_stages``: a PP
    that does not divide the layers (model/summary.py check_split; DeepSeek-V3's 61 over PP 16)."""
    from model.gpt import gpt_layer_specs
    from model.parallel import ParallelContext

    tp, pp, ep = tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
    per_rank = stages_per_rank(pipeline_schedule)
    check_split(model, tp, pp, stages_per_rank=per_rank, expert_parallel_size=ep, uneven_stages=uneven_stages)
    stages = pp * per_rank
    bounds = stage_boundaries(model, stages)
    specs = gpt_layer_specs(model, ParallelContext(), seed=0)
    local = model.moe.num_experts // ep
    names = [spec.typename.__name__ for spec in specs]
    # (name, tie key, the block numbers it holds: (n,) for block n, L + 1 .. L + D for model.mtp's layer)
    layers = [(name, getattr(spec, "key", None), numbers)
              for name, spec, numbers in zip(names, specs, layer_block_numbers(model, names), strict=True)]

    def per_tp_rank(name: str, numbers: tuple[int, ...]) -> int:
        if name == "MultiTokenPrediction":
            return mtp_parameters(model, tp, local)
        if numbers and model.moe.is_sparse(numbers[0]):
            return sparse_block_parameters(model, tp, local)
        return analytic_layer_parameters(model, name, tp)

    def whole(name: str, numbers: tuple[int, ...]) -> int:  # all TP ranks of the stage, the replicated ones once
        if name == "MultiTokenPrediction":
            return mtp_parameters(model, 1, local)
        if numbers:
            return sparse_block_parameters(model, 1, local) if model.moe.is_sparse(numbers[0]) \
                else dense_block_parameters(model, 1)
        return analytic_layer_parameters(model, name, tp) * (tp if name in VOCABULARY_PARALLEL else 1)

    def count(stage: int, stage_ids: list[int], phases: tuple = ()) -> ExpertStageCount:
        held, seen = [], set()
        for s in stage_ids:
            for name, key, numbers in layers[bounds[s]:bounds[s + 1]]:
                if key is None or key not in seen:  # a rank holding both ends of a tied layer builds it once
                    held.append((name, numbers))
                seen.add(key)
        blocks = tuple(number for _, numbers in held for number in numbers)
        sparse = sum(model.moe.is_sparse(number) for number in blocks)
        parameters = sum(per_tp_rank(name, number) for name, number in held)
        return ExpertStageCount(
            stage=stage, layers=[name for name, _ in held], parameters_per_tp_rank=parameters,
            analytic_per_tp_rank=parameters, parameters_per_stage=sum(whole(name, number) for name, number in held),
            blocks=blocks, phases=phases, expert_parameters_per_tp_rank=sparse * local * expert_matrix_parameters(
                model, tp), sparse_blocks=sparse, local_experts=local)

    if per_rank == 1:
        return [count(stage, [stage]) for stage in range(stages)]
    return [count(rank, [rank, stages - 1 - rank], (count(rank, [rank]), count(stages - 1 - rank, [stages - 1 - rank])))
            for rank in range(pp)]


def recompute_groups(model: ModelConfig, count: StageCount, pipeline_parallel_size: int | None) -> int:
    """The pipeline-parallel size ModelConfig.recomputes_block counts recompute_num_layers over: the run's, or
    without it the stage's trunk blocks taken as one stage's share."""
    trunk = sum(number <= model.num_layers for number in count.blocks)
    return pipeline_parallel_size or (model.num_layers // trunk if trunk else 1)


def expert_parallel_choices(model: ModelConfig, data_parallel_size: int) -> list[int]:
    """The EP sizes --search tries: the divisors of both E and d; [1] for a dense model."""
    if model.moe is None:
        return [1]
    return [ep for ep in range(1, data_parallel_size + 1)
            if model.moe.num_experts % ep == 0 and data_parallel_size % ep == 0]


@functools.lru_cache(maxsize=1024)
def expert_group_spans_nodes(tensor_parallel_size: int, pipeline_parallel_size: int, data_parallel_size: int,
                             expert_parallel_size: int, gpus_per_node: int) -> bool:
    """Whether an EP group leaves its node: its ranks are pipe x (d t) + data x t + model for P consecutive data
    ranks (module docstring)."""
    tp, dp, ep = tensor_parallel_size, data_parallel_size, expert_parallel_size
    if ep <= 1:
        return False
    for pipe in range(pipeline_parallel_size):
        for group in range(dp // ep):
            for model in range(tp):
                first = pipe * dp * tp + group * ep * tp + model
                if first // gpus_per_node != (first + (ep - 1) * tp) // gpus_per_node:
                    return True
    return False


def kept_assignments_per_token(model: ModelConfig) -> float:
    """k' = k min(1, capacity_factor): the rows a token sends to the experts (k when dropless)."""
    moe = model.moe
    return moe.top_k * min(1.0, moe.capacity_factor if moe.capacity_factor is not None else 1.0)


def splits_the_sequence(tensor_parallel_size: int, sequence_parallel: bool, expert_parallel_size: int) -> bool:
    """model/moe.py's sequence-split dispatch: each TP rank routes and sends its own T / t tokens (MoEBlock's
    splits_the_sequence: sequence parallelism at t > 1 with EP > 1)."""
    return sequence_parallel and tensor_parallel_size > 1 and expert_parallel_size > 1


def all_to_all_bytes(model: ModelConfig, micro_batch: int, expert_parallel_size: int, tensor_parallel_size: int = 1,
                     sequence_parallel: bool = False) -> float:
    """What one GPU sends in one all-to-all of one sparse block's micro-batch: e k' T h (P - 1) / P, T / t tokens
    under the sequence-split dispatch."""
    ep = expert_parallel_size
    tokens = model.seq_length * micro_batch
    if splits_the_sequence(tensor_parallel_size, sequence_parallel, ep):
        tokens /= tensor_parallel_size
    return (DTYPE_BYTES[model.precision] * kept_assignments_per_token(model) * tokens * model.hidden_size
            * (ep - 1) / ep)


def all_to_alls_per_micro_batch(model: ModelConfig, count: StageCount, pipeline_parallel_size: int | None) -> int:
    """4 per sparse block of the stage (dispatch and combine, forward and backward), 2 more per fully recomputed
    one (module docstring); 0 for a dense model."""
    if model.moe is None:
        return 0
    groups = recompute_groups(model, count, pipeline_parallel_size)
    rerun = model.recompute == "full"
    return sum(4 + 2 * (rerun and model.recomputes_block(n, groups)) for n in count.blocks if model.moe.is_sparse(n))
