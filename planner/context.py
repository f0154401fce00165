"""Long context: one layout at several Ulysses context-parallel sizes, and the longest sequence each one fits.

For each CP (tools/plan.py --context-parallel 1,2,4,8), the config's own layout (TP, PP, micro-batch, recompute,
the global batch in sequences) with parallelism.context_parallel_size = CP and DP = GPUs / (TP x PP x CP):

    the plan at the config's sequence length      peak memory of the peak stage, fits or not, the full batch's
                                                  iteration time, its MFU and the share of Ulysses' all-to-alls
    the longest sequence that fits                the largest multiple of ``granularity`` x CP (x TP with sequence
                                                  parallelism) whose plan fits the GPU's memory, by bisection; the
                                                  global batch keeps its sequences, so its tokens grow with it

Activations per rank fall as 1 / CP (planner/memory.py, measured in tests/test_context_parallel.py); the weights,
gradients and the ZeRO-1 shards over DP x CP do not change with CP, so past some CP the longest sequence is bounded
by what the weights leave. The attention FLOPs, which grow with s^2, are model/flops.py's 4 s a per token and block
(counted in the MFU, causality not discounted, as Narayanan et al. count them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.hardware import Assumptions, Hardware
from planner.memory import count_parameters
from planner.plan import Plan, plan_cluster
from runconfig.run import RunConfig


@dataclass(frozen=True)
class ContextParallelRow:
    context_parallel_size: int
    plan: Plan
    """At the config's sequence length."""
    longest_sequence: int | None
    """The longest sequence (a multiple of the granularity) whose plan fits; None when none does."""
    longest_plan: Plan | None


def with_sequence(config: RunConfig, seq_length: int, context_parallel_size: int) -> RunConfig:
    """The config at ``seq_length`` positions (max_position_embeddings as many: the learned position table grows with
    it; RoPE has no table) and CP."""
    model = dataclasses.replace(config.model, seq_length=seq_length, max_position_embeddings=seq_length)
    parallelism = dataclasses.replace(config.parallelism, context_parallel_size=context_parallel_size)
    return dataclasses.replace(config, model=model, parallelism=parallelism)


def context_parallel_rows(config: RunConfig, nodes: int, hardware: Hardware, assumptions: Assumptions,
                          sizes: list[int], granularity: int = 1024, longest: int = 1 << 24) -> list[ContextParallelRow]:
    """One row per CP in ``sizes`` (module docstring); a CP the model cannot be split into is a plan with its error."""
    parameters = count_parameters(config)  # RoPE: the same at every length; learned positions: counted per length
    learned = config.model.position_embedding == "learned"

    def plan(seq_length: int, cp: int) -> Plan:
        candidate = with_sequence(config, seq_length, cp)
        try:
            candidate.check_layout()
        except ValueError as error:
            failed = plan_cluster(candidate, nodes, hardware, assumptions, parameters)
            failed.errors.insert(0, str(error))
            return failed
        counts = count_parameters(candidate) if learned else parameters
        return plan_cluster(candidate, nodes, hardware, assumptions, counts)

    rows = []
    for cp in sizes:
        tp = config.parallelism.tensor_parallel_size
        unit = granularity * cp * (tp if config.parallelism.sequence_parallel else 1)
        at_config = plan(config.model.seq_length, cp)
        low, high = 0, unit  # low fits (0: nothing yet), high is the next to try
        while high <= longest and plan(high, cp).ok:
            low, high = high, 2 * high
        high = min(high, longest + unit)
        while high - low > unit:  # low fits, high does not: bisect on multiples of the unit
            middle = (low + high) // 2 // unit * unit
            low, high = (middle, high) if plan(middle, cp).ok else (low, middle)
        rows.append(ContextParallelRow(cp, at_config, low or None, plan(low, cp) if low else None))
    return rows


def format_context_parallel(config: RunConfig, nodes: int, hardware: Hardware, rows: list[ContextParallelRow]) -> str:
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    gib = 2 ** 30
    lines = [f"{config.source} at {nodes} nodes ({nodes * hardware.gpus_per_node} GPUs, {hardware.name}, "
             f"{hardware.memory_gib:g} GiB): TP {tp} x PP {pp}, micro-batch {config.micro_batch_size}, recompute "
             f"{config.model.recompute}, {config.global_batch_size} sequences per batch",
             f"{'CP':>3} {'DP':>5} | at {config.model.seq_length:,} positions: {'fits':>4} {'peak GiB':>9} {'iter s':>8} "
             f"{'MFU':>6} {'a2a':>6} | longest that fits: {'positions':>10} {'peak GiB':>9} {'iter s':>8} {'MFU':>6}"]
    for row in rows:
        p, q = row.plan, row.longest_plan
        dp = p.data_parallel_size or "-"
        if p.full_batch is not None:
            a2a = p.full_batch.context_all_to_all / p.full_batch.seconds
            here = (f"{'yes' if p.ok else 'no':>4} {p.peak_memory().total / gib:>9.2f} {p.full_batch.seconds:>8.2f} "
                    f"{p.full_batch.mfu:>6.1%} {a2a:>6.1%}")
        else:
            here = f"{'no':>4} {'impossible':>32}"
        if q is not None:
            there = (f"{row.longest_sequence:>10,} {q.peak_memory().total / gib:>9.2f} {q.full_batch.seconds:>8.2f} "
                     f"{q.full_batch.mfu:>6.1%}")
        else:
            there = f"{'none':>10}"
        lines.append(f"{row.context_parallel_size:>3} {dp!s:>5} | {' ' * 14}{here} | {' ' * 19}{there}")
    return "\n".join(lines)
