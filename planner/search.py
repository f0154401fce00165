"""Search the layouts of one cluster size: every TP, PP, micro-batch, sequence parallelism and recompute choice.


Search (``search_layouts``, tools/plan.py --search, one node count)
    TP in 1 .. GPUs per node dividing the heads, key/value heads and FFN; PP dividing the layers with TP x PP
    dividing the GPUs; micro-batch 1, 2, 4, 8 where micro-batch x DP divides the full batch; SP off, and on when
    TP > 1 and TP divides the sequence; recompute "none", and "selective" and "full" on all blocks of each stage or
    on n of them (every n when a stage has <= 8 blocks, else 7 spread); the pipeline schedule "1f1b", and
    "dualpipev" where PP >= 2, each rank holds at least 2 blocks and the full batch gives at least 2 PP
    micro-batches per pipeline. A Mixture-of-Experts model (model.moe): TP also dividing the experts' widths, and
    every such layout at each expert-parallel size EP dividing both the experts and DP (planner.experts,
    expert_parallel_choices); a dense model's layouts are EP 1, as before. Ulysses context parallelism CP in 1, 2,
    4, ... dividing the heads and key/value heads of a TP rank and the sequence (x TP with SP), with TP x CP within a
    node (Ulysses' all-to-alls on NVLink) and TP x PP x CP dividing the GPUs, under 1F1B and at EP 1: each layout at
    every such CP, DP what is left. Of these, the splits the model's own checks accept (MLA refuses CP > 1; the
    sequence-wise balance loss the sequence-split dispatch). With --uneven-stages also every PP that does not divide
    the layers (model/summary.py check_split), under 1F1B, recomputing all blocks or none. The layouts that fit are
    ranked by their
    predicted full-batch iteration time (not the whole training: the ramp's share is the same for every layout
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from model.config import ModelConfig, stages_per_rank
from model.summary import StageCount, check_split, count_stages
from planner.experts import count_expert_stages, expert_parallel_choices
from planner.hardware import Assumptions, Hardware, deepspeed_layout
from planner.memory import stage_memory
from planner.timing import IterationTime, iteration_time
from runconfig.run import RunConfig


@dataclass(frozen=True)
class Layout:
    """One way to run the config on a cluster: the parallel sizes, the micro-batch and what is recomputed."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    micro_batch_size: int
    sequence_parallel: bool
    recompute: str
    recompute_num_layers: int | None
    """Blocks of each stage that recompute; None: all of them (and with recompute "none")."""
    pipeline_schedule: str = "1f1b"
    expert_parallel_size: int = 1
    """A Mixture-of-Experts model's EP (1 for a dense model; then absent from --json)."""
    context_parallel_size: int = 1
    """Ulysses context parallelism (parallelism.context_parallel_size; absent from --json at 1)."""


@dataclass(frozen=True)
class LayoutResult:
    layout: Layout
    peak_memory_bytes: int
    """The peak stage's total (StageMemory.total)."""
    fits: bool
    full_batch: IterationTime


def layout_config(config: RunConfig, layout: Layout) -> RunConfig:
    """The run config with the layout's sizes, micro-batch and recompute in place of its own."""
    model = dataclasses.replace(config.model, recompute=layout.recompute,
                                recompute_num_layers=layout.recompute_num_layers)
    parallelism = dataclasses.replace(config.parallelism, tensor_parallel_size=layout.tensor_parallel_size,
                                      pipeline_parallel_size=layout.pipeline_parallel_size,
                                      sequence_parallel=layout.sequence_parallel,
                                      pipeline_schedule=layout.pipeline_schedule,
                                      expert_parallel_size=layout.expert_parallel_size,
                                      context_parallel_size=layout.context_parallel_size)
    deepspeed = {**config.deepspeed, "train_micro_batch_size_per_gpu": layout.micro_batch_size}
    return dataclasses.replace(config, model=model, parallelism=parallelism, deepspeed=deepspeed)


def recompute_layer_choices(blocks_per_stage: int) -> list[int | None]:
    """recompute_num_layers to try: every count when a stage has at most 8 blocks, else 7 spread over them;
    None (all blocks) first."""
    if blocks_per_stage <= 8:
        counts = range(1, blocks_per_stage)
    else:
        counts = sorted({max(1, round(blocks_per_stage * k / 8)) for k in range(1, 8)})
    return [None, *counts]


def candidate_layouts(config: RunConfig, gpus: int, gpus_per_node: int,
                      uneven_stages: bool = False) -> list[Layout]:
    """TP dividing the heads, key/value heads and FFN, up to a node; PP dividing the layers with TP x PP dividing the
    GPUs; micro-batches 1, 2, 4, 8 that split the full batch over DP; SP on or off (on: TP > 1 and a sequence that
    divides); recompute none, selective and full, the latter two on some or all blocks of each stage; 1F1B, and
    DualPipeV where it can run; a Mixture-of-Experts model's experts' widths divided by TP, and each layout at every
    EP dividing both the experts and DP (module docstring). ``uneven_stages``: also every PP up to the layers that
    does not divide them, under 1F1B, recomputing all blocks or none (model/summary.py check_split)."""
    model, batch = config.model, config.global_batch_size
    widths = () if model.moe is None else (model.moe.moe_ffn_hidden_size, model.moe.shared_expert_ffn_hidden_size)
    layouts = []
    for tp in range(1, gpus_per_node + 1):
        if model.num_attention_heads % tp or model.num_key_value_heads % tp or model.ffn_hidden_size % tp:
            continue
        if any(width % tp for width in widths):
            continue
        for pp, cp in ((p, c) for p in range(1, model.num_layers + 1) for c in context_parallel_choices(model, tp, gpus_per_node // tp)
                       if (uneven_stages or model.num_layers % p == 0) and gpus % (tp * p * c) == 0):
            dp = gpus // (tp * pp * cp)
            even = model.num_layers % pp == 0
            for micro_batch in (m for m in (1, 2, 4, 8) if batch % (m * dp) == 0):
                for sequence_parallel in (False, True) if tp > 1 and model.seq_length % (tp * cp) == 0 else (False,):
                    modes = [("none", None)] + [(mode, n) for mode in ("selective", "full")
                                                for n in (recompute_layer_choices(model.num_layers // pp) if even
                                                          else [None])]
                    schedules = ["1f1b"]
                    if even and pp >= 2 and model.num_layers // pp >= 2 and batch // (micro_batch * dp) >= 2 * pp \
                            and cp == 1:
                        schedules.append("dualpipev")
                    layouts += [Layout(tp, pp, dp, micro_batch, sequence_parallel, mode, n, schedule, ep, cp)
                                for ep in (expert_parallel_choices(model, dp) if cp == 1 else [1])
                                for schedule in schedules for mode, n in modes]
    return _accepted(model, layouts, uneven_stages)


def _accepted(model: ModelConfig, layouts: list[Layout], uneven_stages: bool) -> list[Layout]:
    """The layouts whose split the trainer accepts (model/summary.py check_split: the model's own checks, such as
    MLA refusing context parallelism, or the sequence-wise balance loss the sequence-split dispatch), once per
    split; their recompute_num_layers fit their stages by construction."""
    model = dataclasses.replace(model, recompute_num_layers=None)
    verdicts: dict[tuple, bool] = {}

    def accepted(layout: Layout) -> bool:
        split = (layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.sequence_parallel,
                 layout.pipeline_schedule, layout.expert_parallel_size, layout.context_parallel_size)
        if split not in verdicts:
            try:
                check_split(model, split[0], split[1], sequence_parallel=split[2],
                            stages_per_rank=stages_per_rank(split[3]), expert_parallel_size=split[4],
                            context_parallel_size=split[5], uneven_stages=uneven_stages)
                verdicts[split] = True
            except ValueError:
                verdicts[split] = False
        return verdicts[split]

    return [layout for layout in layouts if accepted(layout)]


def context_parallel_choices(model, tensor_parallel_size: int, largest: int) -> list[int]:
    """CP sizes up to ``largest`` that Ulysses can split this model into at this TP (model/config/parallel.py,
    _check_context_parallel): powers of 2 dividing the heads and key/value heads of a TP rank, and the sequence."""
    heads, groups = model.num_attention_heads // tensor_parallel_size, model.num_key_value_heads // tensor_parallel_size
    choices, cp = [], 1
    while cp <= min(groups, largest) and heads % cp == 0 and groups % cp == 0 and model.seq_length % cp == 0:
        choices.append(cp)
        cp *= 2
    return choices


def _distinct_stages(counts: list[StageCount]) -> list[StageCount]:
    """1F1B: stages 0, 1 and the last: the middle stages repeat stage 1 with fewer micro-batches held (the blocks
    divide evenly), so these three carry the peak memory and the slowest slot. DualPipeV, or stages of unequal
    blocks: every rank (what each holds in flight follows its own stream; the middle stages differ)."""
    if counts and (counts[0].phases or len({len(c.blocks) for c in counts[1:-1]}) > 1):
        return counts
    return [counts[i] for i in sorted({0, min(1, len(counts) - 1), len(counts) - 1})]


def search_layouts(config: RunConfig, nodes: int, hardware: Hardware, assumptions: Assumptions,
                   counts: Callable[[int, int, str], list[StageCount]] | None = None,
                   uneven_stages: bool = False) -> tuple[int, list[LayoutResult]]:
    """Every candidate layout at ``nodes``: (how many were tried, those that fit, fastest full-batch iteration
    first). ``counts(tp, pp, schedule)`` gives the ranks' parameter counts (default: count_stages, once per (tp, pp,
    schedule)); for a Mixture-of-Experts model ``counts(tp, pp, schedule, ep)`` (default:
    planner.experts.count_expert_stages, once per (tp, pp, schedule, ep)). ``uneven_stages``: PP sizes that do not
    divide the layers too (candidate_layouts)."""
    cache: dict[tuple, list[StageCount]] = {}
    experts = config.model.moe is not None

    def default_counts(tp: int, pp: int, schedule: str, *ep: int) -> list[StageCount]:
        if experts:
            return count_expert_stages(config.model, tp, pp, *ep, pipeline_schedule=schedule,
                                       uneven_stages=uneven_stages)
        return count_stages(config.model, tp, pp, pipeline_schedule=schedule, uneven_stages=uneven_stages)

    def stages(tp: int, pp: int, schedule: str, ep: int) -> list[StageCount]:
        key = (tp, pp, schedule, ep) if experts else (tp, pp, schedule)
        if key not in cache:
            cache[key] = _distinct_stages((counts or default_counts)(*key))
        return cache[key]

    layouts = candidate_layouts(config, nodes * hardware.gpus_per_node, hardware.gpus_per_node, uneven_stages)
    results = []
    for layout in layouts:
        candidate = layout_config(config, layout)
        chosen = stages(layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.pipeline_schedule,
                        layout.expert_parallel_size)
        ds_layout, d = deepspeed_layout(candidate), layout.data_parallel_size
        m = config.global_batch_size // (layout.micro_batch_size * d)
        peak = max((stage_memory(candidate, ds_layout, c, d, m, hardware, assumptions) for c in chosen),
                   key=lambda memory: memory.total)
        if not peak.fits:
            continue
        timed = iteration_time(candidate, ds_layout, chosen, d, config.global_batch_size, hardware, assumptions)
        results.append(LayoutResult(layout, peak.total, peak.fits, timed))
    results.sort(key=lambda r: (r.full_batch.seconds, r.peak_memory_bytes))
    return len(layouts), results
