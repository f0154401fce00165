"""How the model is split (ParallelConfig: tensor x pipeline x expert x context parallelism, data over the rest),
and the model's checks against a layout: each ValueError names the model's numbers, the parallel field and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from model.config.checks import is_positive_int, require
from model.config.moe import check_expert_parallel

PIPELINE_SCHEDULES = ("1f1b", "dualpipev")  # parallelism.pipeline_schedule; what each runs: model/pipe_schedules.py


def stages_per_rank(pipeline_schedule: str) -> int:
    """Pipeline stages a PP rank holds: 2 under DualPipeV (stage r and 2 PP - 1 - r), else 1."""
    return 2 if pipeline_schedule == "dualpipev" else 1


@dataclass
class ParallelConfig:
    """How the model is split: tensor x pipeline inside the world, data parallelism over what is left, the experts
    of an MoE model over groups of data-parallel ranks (expert parallelism)."""

    tensor_parallel_size: int = 1
    """Ranks that share each layer's matrices (Megatron tensor slicing; keep it inside a node)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages; each holds num_layers / PP consecutive transformer blocks."""
    partition_method: str = field(default="type:TransformerLayer")
    """DeepSpeed partition method: balance the transformer blocks over the stages."""
    sequence_parallel: bool = False
    """Split the sequence over the TP ranks outside the tensor-parallel matmuls (norms, dropouts, residual adds, the
    tensor sent between stages): each rank holds seq_length / TP positions there (Korthikanti et al. 2022). Entering
    a column-parallel layer all-gathers the sequence, leaving a row-parallel one reduce-scatters it: the same bytes
    as the all-reduce it replaces. No effect at TP 1."""
    pipeline_schedule: str = "1f1b"
    """"1f1b": DeepSpeed's PipelineModule of PP stages, 1F1B. "dualpipev": DeepSpeed's DualPipeVModule of 2 PP stages,
    rank r holding stage r and 2PP-1-r, run with DualPipeV (DeepSeek-V3's schedule) from 2PP micro-batches per
    pipeline up, and the V-shaped 1F1B below (model/pipe_schedules.py). Checkpoints are the same files under both."""
    expert_parallel_size: int = 1
    """Data-parallel ranks of the same TP and PP coordinates that share the experts of each sparse block, each holding
    model.moe.num_experts / EP of them (model/moe.py). Must divide the experts and the data-parallel size; only with
    model.moe."""
    context_parallel_size: int = 1
    """Ranks that split each sample's sequence (Ulysses context parallelism, Jacobs et al. 2023): each holds
    seq_length / CP positions everywhere but inside attention, where an all-to-all gives it every position of
    heads / CP heads (model/attention.py). CP peers are consecutive ranks of DeepSpeed's data axis (DP x CP), with
    the same TP and PP coordinates; DP is what is left: world / (TP x PP x CP) replicas of the batch."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size",
                     "context_parallel_size"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0,
                    f"parallelism.{name} must be a positive integer, got {value!r}")
        require(isinstance(self.sequence_parallel, bool),
                f"parallelism.sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        require(self.pipeline_schedule in PIPELINE_SCHEDULES,
                f"parallelism.pipeline_schedule must be one of {', '.join(map(json.dumps, PIPELINE_SCHEDULES))}, "
                f"got {self.pipeline_schedule!r}")
        cp = self.context_parallel_size
        require(cp == 1 or self.expert_parallel_size == 1,
                f"parallelism.context_parallel_size {cp} with expert_parallel_size {self.expert_parallel_size}: both "
                f"are carved out of the data axis and their combination is not built; use one of them")
        require(cp == 1 or self.pipeline_schedule == "1f1b",
                f"parallelism.context_parallel_size {cp} runs with the \"1f1b\" pipeline schedule; DualPipeV under "
                f"context parallelism is not built: use \"1f1b\"")
        require(self.pipeline_schedule == "1f1b" or self.pipeline_parallel_size >= 2,
                "parallelism.pipeline_schedule \"dualpipev\" needs parallelism.pipeline_parallel_size >= 2 (it "
                "fills the bubble between pipeline stages; with one stage there is none): use \"1f1b\"")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """The replicas of the batch, world size / (TP x PP x CP), or a ValueError showing every factor."""
        return self.data_axis_size(world_size) // self.context_parallel_size

    def data_axis_size(self, world_size: int) -> int:
        """DeepSpeed's data-parallel world, DP x CP = world size / (TP x PP): what averages the gradients, shards
        ZeRO-1 and names a checkpoint's layout."""
        split = self.model_parallel_size * self.context_parallel_size
        require(world_size % split == 0,
                f"world size {world_size} is not divisible by tensor_parallel_size ({self.tensor_parallel_size}) x "
                f"pipeline_parallel_size ({self.pipeline_parallel_size})"
                + (f" x context_parallel_size ({self.context_parallel_size})" if self.context_parallel_size > 1 else "")
                + f" = {split}: launch a multiple of {split} processes")
        return world_size // self.model_parallel_size


def check_layout(model: Any, tensor_parallel_size: int, pipeline_parallel_size: int, sequence_parallel: bool = False,
                 stages_per_rank: int = 1, expert_parallel_size: int = 1, context_parallel_size: int = 1) -> None:
    """Raise ValueError if ``model`` (a ModelConfig) cannot be split TP x PP ways (with the sequence split TP ways
    too, and the experts EP ways: their split over the data-parallel ranks is checked once the world is known,
    RunConfig's check_world); ``stages_per_rank``: 2 under DualPipeV, whose PP ranks hold 2 PP stages."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    require(isinstance(tp, int) and tp > 0, f"parallelism.tensor_parallel_size must be a positive integer, got {tp!r}")
    require(isinstance(pp, int) and pp > 0,
            f"parallelism.pipeline_parallel_size must be a positive integer, got {pp!r}")
    require(model.num_attention_heads % tp == 0,
            f"model.num_attention_heads ({model.num_attention_heads}) is not divisible by "
            f"parallelism.tensor_parallel_size ({tp}): use a tensor-parallel size that divides the heads")
    require(model.num_key_value_heads % tp == 0,
            f"model.num_key_value_heads ({model.num_key_value_heads}) is not divisible by "
            f"parallelism.tensor_parallel_size ({tp}): each TP rank holds whole key/value groups, so use a "
            f"tensor-parallel size that divides the key/value heads")
    require(model.ffn_hidden_size % tp == 0,
            f"model.ffn_hidden_size ({model.ffn_hidden_size}) is not divisible by "
            f"parallelism.tensor_parallel_size ({tp})")
    _check_experts(model, tp, expert_parallel_size, sequence_parallel, context_parallel_size)
    divisors = [d for d in range(1, model.num_layers + 1) if model.num_layers % d == 0]
    require(model.num_layers % pp == 0,
            f"model.num_layers ({model.num_layers}) cannot be split evenly over "
            f"parallelism.pipeline_parallel_size ({pp}) "
            + ("stages" if stages_per_rank == 1 else "ranks of DualPipeV")
            + f": use a pipeline-parallel size that divides the layers (divisors: {divisors})")
    # DualPipeV cuts the blocks into 2 PP stages (DeepSpeed's partition_balanced: the first PP take one block more
    # when L / PP is odd); rank r's stages r and 2 PP - 1 - r then hold L / PP blocks together, as long as each
    # stage has one (tests/test_dualpipev.py checks DeepSpeed's partition)
    require(stages_per_rank == 1 or model.num_layers // pp >= 2,
            f"model.num_layers ({model.num_layers}) gives each of the parallelism.pipeline_parallel_size ({pp}) "
            f"ranks {model.num_layers // pp} block, and under DualPipeV a rank holds two stages, one on the way out "
            f"and one on the way back: use at least 2 blocks per rank (a pipeline-parallel size of at most "
            f"{model.num_layers // 2} that divides the layers: {[d for d in divisors if 2 * d <= model.num_layers]})")
    _check_context_parallel(model, tp, context_parallel_size, sequence_parallel)
    _check_multi_token_prediction(model, stages_per_rank, context_parallel_size)
    if sequence_parallel:
        require(model.seq_length % tp == 0,
                f"model.seq_length ({model.seq_length}) is not divisible by parallelism.tensor_parallel_size "
                f"({tp}): with parallelism.sequence_parallel each TP rank holds seq_length / TP positions; use a "
                f"sequence length that divides, or turn sequence_parallel off")
    per_stage = model.num_layers // pp  # under DualPipeV too: the blocks of 1F1B's stages (recomputes_block)
    if model.recompute_num_layers is not None:
        require(model.recompute_num_layers <= per_stage,
                f"model.recompute_num_layers ({model.recompute_num_layers}) is more than the {per_stage} blocks of "
                f"each of the {pp} pipeline stages: use at most {per_stage}, or null for every block")


def _check_context_parallel(model: Any, tp: int, cp: int, sequence_parallel: bool) -> None:
    """Ulysses' all-to-all gives each CP rank whole heads of this TP rank's (whole key/value groups under GQA) and
    each rank seq_length / CP positions (/ TP more with sequence parallelism)."""
    require(is_positive_int(cp), f"parallelism.context_parallel_size must be a positive integer, got {cp!r}")
    if cp == 1:
        return
    require(model.attention_type != "mla",
            f"parallelism.context_parallel_size {cp} with model.attention_type \"mla\" is not built (Ulysses' "
            f"all-to-all of MLA's q, k and v, whose widths differ, and of its shared rope key): set "
            f"context_parallel_size to 1, or use attention_type \"mha\"")
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(model, name)
        require(heads // tp % cp == 0,
                f"model.{name} ({heads}) / parallelism.tensor_parallel_size ({tp}) = {heads // tp} heads per TP "
                f"rank is not divisible by parallelism.context_parallel_size ({cp}): Ulysses gives each CP rank "
                f"whole heads (whole key/value groups under GQA); use a context-parallel size that divides "
                f"{heads // tp}, or a smaller tensor-parallel size")
    positions = cp * (tp if sequence_parallel else 1)
    require(model.seq_length % positions == 0,
            f"model.seq_length ({model.seq_length}) is not divisible by parallelism.context_parallel_size ({cp})"
            + (f" x tensor_parallel_size ({tp}) under sequence_parallel" if sequence_parallel and tp > 1 else "")
            + f" = {positions}: each rank holds seq_length / {positions} positions; use a multiple of {positions}")


def _check_multi_token_prediction(model: Any, stages_per_rank: int, cp: int) -> None:
    """model.mtp's modules sit on the last 1F1B stage beside the head (model/mtp.py); each depth reads the tokens
    k positions ahead of its own, which a CP rank's slice does not hold."""
    if model.mtp is None:
        return
    require(stages_per_rank == 1,
            "model.mtp under parallelism.pipeline_schedule \"dualpipev\" is not built (its modules would sit on rank "
            "0's returning stage): use pipeline_schedule \"1f1b\", or remove model.mtp")
    require(cp == 1,
            f"model.mtp with parallelism.context_parallel_size {cp} is not built (depth k embeds the token k "
            f"positions ahead, on the next CP rank's slice at the slice's end): set context_parallel_size to 1, or "
            f"remove model.mtp")


def _check_experts(model: Any, tensor_parallel_size: int, expert_parallel_size: int, sequence_parallel: bool = False,
                   context_parallel_size: int = 1) -> None:
    """The experts TP-sharded like the dense MLP, and split EP ways; the sequence-wise balance loss where each
    router sees whole sequences (model/router.py sequence_balance_loss)."""
    check_expert_parallel(model.moe, expert_parallel_size)
    if model.moe is None:
        return
    for name in ("moe_ffn_hidden_size", "shared_expert_ffn_hidden_size"):
        width = getattr(model.moe, name)
        require(width % tensor_parallel_size == 0,
                f"model.moe.{name} ({width}) is not divisible by parallelism.tensor_parallel_size "
                f"({tensor_parallel_size}): each TP rank holds a slice of every expert")
    if model.moe.sequence_aux_loss_coeff > 0:
        require(context_parallel_size == 1,
                f"model.moe.sequence_aux_loss_coeff ({model.moe.sequence_aux_loss_coeff}) with "
                f"parallelism.context_parallel_size {context_parallel_size}: each CP rank routes seq_length / CP "
                f"positions, and the sequence-wise loss needs every position of a sequence (its counts and mean "
                f"scores are not summed over CP); set context_parallel_size to 1, or the loss to 0")
        split = sequence_parallel and tensor_parallel_size > 1 and expert_parallel_size > 1
        require(not split,
                f"model.moe.sequence_aux_loss_coeff ({model.moe.sequence_aux_loss_coeff}) with "
                f"parallelism.sequence_parallel at tensor_parallel_size {tensor_parallel_size} and "
                f"expert_parallel_size {expert_parallel_size}: that is the sequence-split dispatch, where each TP "
                f"rank routes seq_length / TP positions, and the sequence-wise loss needs every position of a "
                f"sequence (its per-sequence counts are not summed over TP); turn sequence_parallel off, or the "
                f"loss to 0")
