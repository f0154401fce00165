"""Checkpoints in the plan: how big, how long a save takes at a storage bandwidth, what it costs the run.

What DeepSpeed writes (training/checkpoint.py): DP rank 0 of each (stage, TP rank) its stage's weights, in the model
dtype (e bytes a parameter: N_i e); every rank its ZeRO-1 shard of the optimizer, fp32 master weights and both Adam
moments (12 N_i / d). A stage that holds the tied embedding keeps optimizer state for it too; the weight file of the
embedding is written once.

    bytes per rank        the busiest: DP rank 0 of the largest stage, e N_i + 12 N_i / d
    bytes per run         e (sum_i N_i t - the head's tied copy) + 12 sum_i N_i t: 7.4 TB for 530B in bf16
    a Mixture-of-Experts model (planner/experts.py): the experts' optimizer shard is 12 N^e_i / (d / EP), and the
                          run holds every EP rank's experts: N_i + (EP - 1) N^e_i in place of N_i in the sums
    a save, written       the slowest of: the busiest node's bytes (its GPUs' ranks) at the node's bandwidth to the
                          file system, and the run's bytes at the file system's aggregate bandwidth
    the stall, "sync"     the whole write: training waits for it
    the stall, "async"    what the save does on the training thread: the copy of the busiest rank's bytes into its
                          pinned host buffers at the device-to-host bandwidth, and one device synchronisation (no
                          term). No allocation: the buffers are allocated once, before the first step, and reused
                          (training/checkpoint_engine.py); that one-off allocation is not in the figure. The write
                          overlaps the next steps, and must end before the next save (else that save waits)
    the share lost        stall / (save_interval x full-batch iteration seconds + stall)
    host memory, "async"  one copy of what the rank writes: the pinned buffers, held for the whole run

The bandwidths are assumptions (``Storage``), stated in the report and overridable from tools/plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.experts import expert_parameters_of
from planner.hardware import DTYPE_BYTES, Hardware
from planner.memory import ParameterCounts
from runconfig.run import RunConfig

OPTIMIZER_BYTES = 12  # fp32 master weight + Adam's exp_avg and exp_avg_sq, per parameter of the DP shard


@dataclass(frozen=True)
class Storage:
    """Where checkpoints go, and how fast."""

    node_gbytes_per_s: float = 2.0
    """One node's write bandwidth to the shared file system, GB/s (a few client links to a parallel file system)."""
    aggregate_gbytes_per_s: float = 100.0
    """The file system's total write bandwidth, GB/s (BLOOM-176B's 2.3 TB saves took about 40 s: about 60 GB/s)."""
    host_gbytes_per_s: float = 20.0
    """Device-to-host copy into pinned memory, GB/s per GPU (PCIe Gen4 x16 sustains about 20-25)."""

    def __post_init__(self) -> None:
        for name in ("node_gbytes_per_s", "aggregate_gbytes_per_s", "host_gbytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"storage {name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class CheckpointCost:
    bytes_per_rank: int
    """The busiest rank's files (DP rank 0 of the largest stage): weights and its optimizer shard."""
    bytes_per_run: int
    bytes_per_node: int
    """The busiest node's ranks together."""
    write_seconds: float
    """The whole save, written: the stall of "sync", the background time of "async"."""
    async_stall_seconds: float
    """The copy into the host buffers (allocated before the first step, reused), what "async" stops training for."""
    save_interval: int
    """training.save_interval (0: no periodic checkpoint; the shares below are then 0)."""
    lost_share_sync: float
    lost_share_async: float
    async_host_bytes_per_rank: int
    """Host memory one rank holds for the snapshot: its buffers, from start-up to the end of the run."""
    async_overlaps_next_save: bool
    """The write outlasts save_interval iterations: the next save waits for it."""


def checkpoint_cost(config: RunConfig, parameters: ParameterCounts, data_parallel_size: int,
                    iteration_seconds: float, hardware: Hardware, storage: Storage) -> CheckpointCost:
    weight = DTYPE_BYTES[config.model.precision]
    tp, d = config.parallelism.tensor_parallel_size, data_parallel_size
    largest = max(parameters.stages, key=lambda count: count.parameters_per_tp_rank)
    n, experts, ep = largest.parameters_per_tp_rank, expert_parameters_of(largest), config.parallelism.expert_parallel_size
    # a Mixture-of-Experts model's experts: their optimizer shard over d / EP ranks, and every EP rank's own experts
    per_rank = weight * n + OPTIMIZER_BYTES * (n - experts) // d + OPTIMIZER_BYTES * experts // (d // ep)
    held = tp * sum(count.parameters_per_tp_rank + (ep - 1) * expert_parameters_of(count)
                    for count in parameters.stages)  # every TP rank's own copy
    # the last stage's copy of the tied embedding (the head's, or model.mtp's) is not saved (DualPipeV holds both
    # ends on rank 0, once)
    tied_again = (config.model.padded_vocab_size(tp) * config.model.hidden_size
                  if sum("WordEmbedding" in c.layers for c in parameters.stages) > 1
                  else 0)
    per_run = weight * (held - tied_again) + OPTIMIZER_BYTES * held
    per_node = min(hardware.gpus_per_node, tp * config.parallelism.pipeline_parallel_size * d) * per_rank
    write = max(per_node / (storage.node_gbytes_per_s * 1e9), per_run / (storage.aggregate_gbytes_per_s * 1e9))
    stall = per_rank / (storage.host_gbytes_per_s * 1e9)  # a copy into buffers that exist: no allocation counted
    interval = config.training.save_interval
    between = interval * iteration_seconds

    def share(seconds: float) -> float:
        return seconds / (between + seconds) if interval else 0.0

    return CheckpointCost(bytes_per_rank=per_rank, bytes_per_run=per_run, bytes_per_node=per_node,
                          write_seconds=write, async_stall_seconds=stall, save_interval=interval,
                          lost_share_sync=share(write), lost_share_async=share(stall), async_host_bytes_per_rank=per_rank,
                          async_overlaps_next_save=bool(interval) and write > between)
