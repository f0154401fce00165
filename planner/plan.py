"""The plan for one cluster size: errors (impossible) and warnings, memory per stage, iteration and training time.

``plan_cluster`` composes the other modules: the ramp checked against DP (planner.ramp), the memory of every stage
(planner.memory), the iteration at the ramp's first and full batch (planner.timing) and the whole training. A
Mixture-of-Experts model's EP is checked against its experts and DP first (one error naming
parallelism.expert_parallel_size and the sizes that divide), and its plan carries ExpertFigures (planner.experts).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from model.config import check_expert_parallel, set_option, stages_per_rank
from model.flops import flops_per_iteration, model_flops_per_iteration, tflops_per_gpu
from model.summary import analytic_active_parameters, analytic_total_parameters, check_split, whole_stages
from planner.checkpointing import CheckpointCost, Storage, checkpoint_cost
from planner.experts import all_to_all_bytes, expert_group_spans_nodes, expert_parameters_of
from planner.hardware import GIB, Assumptions, Hardware, deepspeed_layout
from planner.memory import ParameterCounts, StageMemory, stage_memory
from planner.published import PublishedRun, published_run
from planner.ramp import TrainingTime, ramp_sizes_not_dividing, suggest_ramp, training_time
from planner.timing import IterationTime, iteration_time
from runconfig.run import RunConfig
from runconfig.schedules import BatchRamp


@dataclass(frozen=True)
class ExpertFigures:
    """What a plan says of a Mixture-of-Experts model's experts (planner/experts.py), per GPU."""

    expert_parallel_size: int
    expert_data_parallel_size: int
    """d / EP: the ranks holding the same experts, over which their optimizer states are sharded."""
    num_experts: int
    experts_per_gpu: int
    """E / EP local experts of each sparse block."""
    top_k: int
    sparse_blocks: int
    total_parameters: int
    """One replica with every expert (model.summary.analytic_total_parameters)."""
    active_parameters: int
    """What one token uses: top_k experts of each sparse block (model.summary.analytic_active_parameters)."""
    expert_parameters_per_gpu: int
    """The peak stage's local experts (N^e_i), of its parameters_per_tp_rank."""
    all_to_all_bytes: float
    """One all-to-all of one sparse block's micro-batch, per GPU: e k' s b h (EP - 1) / EP."""
    all_to_all_spans_nodes: bool
    """An EP group leaves its node: the all-to-all is timed at InfiniBand, else NVLink."""
    all_to_all_seconds: float
    """Per full-batch iteration (IterationTime.expert_all_to_all)."""
    all_to_all_share: float
    """Of the full-batch iteration."""
    mfu_active: float
    """The full batch's MFU, on the active parameters' FLOPs (IterationTime.mfu)."""


@dataclass
class Plan:
    """Everything the planner says about one cluster size."""

    nodes: int
    gpus: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int | None
    micro_batch_size: int
    global_batch_size: int
    schedule: str = "1f1b"
    """parallelism.pipeline_schedule."""
    context_parallel_size: int = 1
    """parallelism.context_parallel_size: data_parallel_size counts the replicas, DP x CP the data axis."""
    micro_batches: int | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ramp: dict[str, Any] | None = None
    memory: list[StageMemory] = field(default_factory=list)
    flops: dict[str, float] = field(default_factory=dict)
    first_batch: IterationTime | None = None
    full_batch: IterationTime | None = None
    training: TrainingTime | None = None
    measured: dict[str, float] | None = None
    checkpoint: CheckpointCost | None = None
    experts: ExpertFigures | None = None
    """A Mixture-of-Experts model's figures (None for a dense model, and then absent from --json)."""
    gpu_hours: float | None = None
    """The whole training on all the plan's GPUs: GPUs x training seconds / 3600."""
    gpu_hours_per_trillion_tokens: float | None = None
    """gpu_hours per 1e12 of the training's tokens (the ramp's slower steps included)."""
    published: PublishedRun | None = None
    """A published run of a model of this shape (planner/published.py), to set the GPU-hours beside."""
    published_mfu: float | None = None
    """The MFU the published run's GPU-hours per trillion tokens come to at this plan's model FLOPs per token and
    this GPU's peak: model FLOPs per token x 1e12 / (GPU-hours x 3600 x peak)."""

    @property
    def ok(self) -> bool:
        return not self.errors

    def peak_memory(self) -> StageMemory | None:
        return max(self.memory, key=lambda m: m.total) if self.memory else None


def _check_batches(config: RunConfig, plan: Plan) -> BatchRamp | None:
    """Errors for a full batch that does not split; a warning and a working ramp for ramp sizes that do not."""
    unit = config.micro_batch_size * plan.data_parallel_size
    if config.global_batch_size % unit:
        plan.errors.append(
            f"the full batch train_batch_size={config.global_batch_size} is not divisible by micro-batch x DP = "
            f"{config.micro_batch_size} x {plan.data_parallel_size} = {unit}: choose a batch that is a multiple of "
            f"{unit} or another node count")
        return None
    ramp = config.batch_schedule()
    bad = ramp_sizes_not_dividing(ramp, unit)
    if not bad:
        return ramp
    better = suggest_ramp(ramp, unit)
    shown = ", ".join(map(str, bad[:10]))
    if len(bad) > 10:
        shown += f", ... ({len(bad)} of {len(ramp.sizes())} sizes)"
    plan.warnings.append(
        f"ramp batch sizes not divisible by micro-batch x DP = {unit} (training.config.check_world would refuse "
        f"them): {shown}. A ramp that works: {set_option('schedule.batch.start', better.start)} "
        f"{set_option('schedule.batch.increment', better.increment)} ({better.start} -> {better.end} in steps of "
        f"{better.increment}); the training time below assumes it")
    return better


def _check_memory(plan: Plan, hardware: Hardware) -> None:
    worst = plan.peak_memory()
    if worst is None or worst.fits:
        return
    parts = {"activations": worst.activations, "weights": worst.weights, "gradients": worst.gradients,
             "fp32 gradient accumulation": worst.gradient_accumulation, "Adam states": worst.adam_states,
             "master weights": worst.master_weights}
    largest = max(parts, key=parts.get)
    plan.errors.append(
        f"memory exceeded: stage {worst.stage} needs {worst.total / GIB:.1f} GiB of the {hardware.name}'s "
        f"{hardware.memory_gib:g} GiB (over by {-worst.margin / GIB:.1f} GiB); its largest part is {largest} "
        f"({parts[largest] / GIB:.1f} GiB)")


def _flops(config: RunConfig, first: int, full: int) -> dict[str, float]:
    """Hardware FLOPs (the configured recompute counted) and model FLOPs (none) at the first and the full batch."""
    model, tp = config.model, config.parallelism.tensor_parallel_size
    pp = config.parallelism.pipeline_parallel_size
    figures = {}
    for name, batch in (("first_batch", first), ("full_batch", full)):
        figures[name] = flops_per_iteration(model, batch, tp, pipeline_parallel_size=pp)
        figures[f"{name}_model"] = model_flops_per_iteration(model, batch, tp)
    return figures


def measured_throughput(config: RunConfig, gpus: int, iteration_seconds: float, hardware: Hardware,
                        predicted_seconds: float | None = None) -> dict[str, float]:
    """A measured full-batch iteration: TFLOP/s per GPU and HFU (hardware FLOPs, the configured recompute counted)
    and MFU (model FLOPs, no recompute), as the trainer logs them."""
    if iteration_seconds <= 0:
        raise ValueError(f"--iteration-seconds must be positive, got {iteration_seconds}")
    tp, batch = config.parallelism.tensor_parallel_size, config.global_batch_size
    pp = config.parallelism.pipeline_parallel_size
    achieved = tflops_per_gpu(flops_per_iteration(config.model, batch, tp, pipeline_parallel_size=pp),
                              iteration_seconds, gpus)
    model = tflops_per_gpu(model_flops_per_iteration(config.model, batch, tp), iteration_seconds, gpus)
    figures = {"iteration_seconds": iteration_seconds, "tflops_per_gpu": achieved, "model_tflops_per_gpu": model,
               "hfu": achieved / hardware.peak_tflops, "mfu": model / hardware.peak_tflops}
    if predicted_seconds:
        figures["predicted_over_measured"] = predicted_seconds / iteration_seconds
    return figures


def check_run_layout(config: RunConfig, uneven_stages: bool = False) -> None:
    """RunConfig.check_layout, or with ``uneven_stages`` also a pipeline-parallel size that does not divide the
    layers (model/summary.py check_split: planned as DeepSpeed's partition_balanced splits it; the trainer refuses
    it). A ValueError names the field and the fix."""
    model, parallelism = config.model, config.parallelism
    pp = parallelism.pipeline_parallel_size
    if uneven_stages and model.num_layers % pp:
        check_split(model, parallelism.tensor_parallel_size, pp, sequence_parallel=parallelism.sequence_parallel,
                    stages_per_rank=stages_per_rank(parallelism.pipeline_schedule),
                    expert_parallel_size=parallelism.expert_parallel_size,
                    context_parallel_size=parallelism.context_parallel_size, uneven_stages=True)
        config = dataclasses.replace(config, model=whole_stages(model, pp))  # the run config's own checks
    config.check_layout()


def uneven_stages_warning(config: RunConfig, parameters: ParameterCounts) -> str | None:
    """The warning of a plan whose stages hold unequal blocks; None when PP divides the layers."""
    model, pp = config.model, config.parallelism.pipeline_parallel_size
    if model.num_layers % pp == 0:
        return None
    blocks = [len(c.blocks) for c in parameters.stages]
    mtp = "" if model.mtp is None else f" and model.mtp's {model.mtp.depth} depth{'s' if model.mtp.depth > 1 else ''}" \
        f", counted as blocks"
    sizes = ", ".join(f"{blocks.count(n)} of {n}" for n in sorted(set(blocks), reverse=True))
    return (f"model.num_layers ({model.num_layers}) does not divide over PP {pp}: planned as DeepSpeed's "
            f"partition_balanced splits it, stages of unequal blocks ({sizes}; the first stage also holds the "
            f"embedding, the last the head{mtp}), the slowest pacing the pipeline. The trainer refuses this split "
            f"(model/config/parallel.py): a plan to compare, not a run to launch")


def plan_cluster(config: RunConfig, nodes: int, hardware: Hardware, assumptions: Assumptions,
                 parameters: ParameterCounts, iteration_seconds: float | None = None,
                 storage: Storage | None = None) -> Plan:
    """The plan for one node count: errors (impossible) and warnings, memory, time and the whole training."""
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    gpus = nodes * hardware.gpus_per_node
    plan = Plan(nodes=nodes, gpus=gpus, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=None,
                micro_batch_size=config.micro_batch_size, global_batch_size=config.global_batch_size,
                schedule=config.parallelism.pipeline_schedule,
                context_parallel_size=config.parallelism.context_parallel_size)
    try:
        plan.data_parallel_size = config.parallelism.data_parallel_size(gpus)
    except ValueError as error:
        model_parallel = tp * pp * config.parallelism.context_parallel_size
        step = model_parallel // math.gcd(model_parallel, hardware.gpus_per_node)
        plan.errors.append(f"data parallelism is not a whole number: {nodes} nodes x {hardware.gpus_per_node} GPUs = "
                           f"{error}; use a multiple of {step} nodes")
        return plan
    try:  # EP against the experts and DP: one line naming the field and the choices (model/config/moe.py)
        check_expert_parallel(config.model.moe, config.parallelism.expert_parallel_size, plan.data_parallel_size)
    except ValueError as error:
        plan.errors.append(str(error))
        return plan
    if tp > hardware.gpus_per_node:
        plan.warnings.append(f"tensor parallelism {tp} spans nodes of {hardware.gpus_per_node} GPUs: its all-reduces "
                             f"are timed over InfiniBand")
    uneven = uneven_stages_warning(config, parameters)
    if uneven:
        plan.warnings.append(uneven)
    ramp = _check_batches(config, plan)
    if ramp is None:
        return plan
    layout, d = deepspeed_layout(config), plan.data_parallel_size
    plan.micro_batches = config.global_batch_size // (config.micro_batch_size * d)
    if config.parallelism.pipeline_schedule == "dualpipev" and plan.micro_batches < 2 * pp:
        plan.errors.append(
            f"parallelism.pipeline_schedule \"dualpipev\" needs at least 2 x PP = {2 * pp} micro-batches per pipeline "
            f"at the full batch, and train_batch_size {config.global_batch_size} / (micro-batch "
            f"{config.micro_batch_size} x DP {d}) gives {plan.micro_batches}: raise train_batch_size to "
            f"{2 * pp * config.micro_batch_size * d} or more, use fewer nodes, or \"1f1b\"")
        return plan
    plan.ramp = {**dataclasses.asdict(ramp), "suggested": ramp != config.batch_schedule()}
    plan.memory = [stage_memory(config, layout, c, d, plan.micro_batches, hardware, assumptions)
                   for c in parameters.stages]
    _check_memory(plan, hardware)
    plan.flops = _flops(config, ramp.sizes()[0], ramp.end)
    times: dict[int, IterationTime] = {}

    def seconds(batch: int) -> float:
        if batch not in times:
            times[batch] = iteration_time(config, layout, parameters.stages, d, batch, hardware, assumptions)
        return times[batch].seconds

    plan.training = training_time(ramp, config.schedule.train_tokens, config.model.seq_length, seconds)
    plan.gpu_hours = gpus * plan.training.seconds / 3600
    plan.gpu_hours_per_trillion_tokens = plan.gpu_hours / (plan.training.tokens / 1e12)
    plan.published = published_run(config.model)
    if plan.published is not None:  # the model FLOPs of 1e12 tokens over its GPU-seconds at the peak
        per_token = model_flops_per_iteration(config.model, 1, tp) / config.model.seq_length
        plan.published_mfu = per_token * 1e12 / (plan.published.gpu_hours_per_trillion_tokens * 3600
                                                 * hardware.peak_tflops * 1e12)
    seconds(ramp.sizes()[0])
    plan.first_batch, plan.full_batch = times[ramp.sizes()[0]], times[ramp.end]
    if iteration_seconds is not None:
        plan.measured = measured_throughput(config, gpus, iteration_seconds, hardware, plan.full_batch.seconds)
    plan.checkpoint = checkpoint_cost(config, parameters, d * plan.context_parallel_size, plan.full_batch.seconds, hardware, storage or Storage())
    if plan.checkpoint.async_overlaps_next_save:
        between = config.training.save_interval * plan.full_batch.seconds
        plan.warnings.append(f"a checkpoint takes {plan.checkpoint.write_seconds:.3g} s to write, more than "
                             f"training.save_interval = {config.training.save_interval} iterations ({between:.3g} s): "
                             f"each save waits for the previous one; raise save_interval or the storage bandwidth")
    if config.model.moe is not None:
        plan.experts = expert_figures(config, parameters, plan, hardware)
    return plan


def expert_figures(config: RunConfig, parameters: ParameterCounts, plan: Plan, hardware: Hardware) -> ExpertFigures:
    """The experts' figures of a finished plan of a Mixture-of-Experts model (planner/experts.py)."""
    moe, ep, d = config.model.moe, config.parallelism.expert_parallel_size, plan.data_parallel_size
    peak, full = plan.peak_memory(), plan.full_batch
    peak_count = next(c for c in parameters.stages if c.stage == peak.stage)
    return ExpertFigures(
        expert_parallel_size=ep, expert_data_parallel_size=d // ep, num_experts=moe.num_experts,
        experts_per_gpu=moe.num_experts // ep, top_k=moe.top_k,
        sparse_blocks=sum(moe.is_sparse(n) for n in range(1, config.model.num_layers + 1)),
        total_parameters=analytic_total_parameters(config.model, config.parallelism.tensor_parallel_size),
        active_parameters=analytic_active_parameters(config.model, config.parallelism.tensor_parallel_size),
        expert_parameters_per_gpu=expert_parameters_of(peak_count),
        all_to_all_bytes=all_to_all_bytes(config.model, config.micro_batch_size, ep,
                                          config.parallelism.tensor_parallel_size,
                                          config.parallelism.sequence_parallel),
        all_to_all_spans_nodes=expert_group_spans_nodes(
            config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size, d, ep,
            hardware.gpus_per_node),
        all_to_all_seconds=full.expert_all_to_all, all_to_all_share=full.expert_all_to_all / full.seconds,
        mfu_active=full.mfu)
