"""Plan against reality: every run on a GPU the planner knows is a measurement of its own plan (docs/planning.md).

At start-up, one line: the planner's (planner/plan.py plan_cluster) iteration time, tokens/s and peak memory of
this run's layout (its TP x PP x DP, micro-batch, recompute, schedule) on this hardware, at the full batch. At each
log interval, the log record gains the plan at the batches the window actually trained and the ratios

    iteration_seconds           measured: the window's wall seconds / its steps (training/trainer.py _Window)
    planned_iteration_seconds   the planner's iteration time (planner/timing.py iteration_time) of each of the
                                window's steps at that step's own global batch (the ramp's), averaged over the window
    plan_iteration_ratio        iteration_seconds / planned_iteration_seconds      (> 1: slower than planned)
    planned_tokens_per_second   the window's tokens / the sum of its steps' planned seconds
    plan_tokens_per_second_ratio  tokens_per_second (the log's) / planned_tokens_per_second  (< 1: slower)
    planned_peak_memory_gib     the plan's bytes on pipeline rank 0 (the rank that logs) at the full batch: weights,
                                gradients, optimizer states, activations and the framework allowance
    plan_memory_ratio           peak_memory_reserved_gib (rank 0's, this window; CUDA only) / planned_peak_memory_gib

The hardware: ``training.plan_hardware``, a planner/hardware.py GPU_PRESETS name or a dict of Hardware's fields
(name optional); else the preset of the visible GPU, recognised by name (training/metrics.py match_gpu): the SXM
A100 (40 or 80 GB by its memory), H100 and H200. On CPU, or on another GPU, nothing unless it is set. The nodes:
the world size over the GPUs per node (the hardware's gpus_per_node when the dict gives it, else the launcher's
local process count, LOCAL_SIZE / LOCAL_WORLD_SIZE).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from runconfig.run import RunConfig

GIB = 2**30
SXM_PRESETS = {"H100 SXM": "h100-80gb", "H200 SXM": "h200"}
"""training/metrics.py GPU_PEAKS products -> planner/hardware.py GPU_PRESETS (A100 SXM: by its memory)."""


def hardware_of(value: str | dict[str, Any] | None):
    """``training.plan_hardware`` as a planner Hardware (None: not set); a ValueError naming the field otherwise."""
    if value is None:
        return None
    from planner.hardware import GPU_PRESETS, Hardware
    from runconfig.fields import build_block

    if isinstance(value, str):
        if value not in GPU_PRESETS:
            raise ValueError(f"training.plan_hardware {value!r} is not a planner/hardware.py GPU_PRESETS name: choose "
                             f"one of {sorted(GPU_PRESETS)}, or give a dict of the hardware's fields")
        return GPU_PRESETS[value]
    if not isinstance(value, dict):
        raise ValueError(f"training.plan_hardware must be a GPU preset name or a dict of hardware fields, got "
                         f"{value!r}")
    try:
        return build_block(Hardware, "training.plan_hardware", {"name": "training.plan_hardware", **value})
    except TypeError as error:  # a required field missing
        required = [f.name for f in dataclasses.fields(Hardware) if f.default is dataclasses.MISSING and f.name != "name"]
        raise ValueError(f"training.plan_hardware: {error}; a hardware dict needs {required}") from None


def detected_hardware(device_name: str | None, memory_gib: float | None):
    """The planner preset of a GPU by its name, or None (CPU, or a GPU the planner has no preset for)."""
    if device_name is None:
        return None
    from planner.hardware import GPU_PRESETS
    from training.metrics import match_gpu

    gpu = match_gpu(device_name)
    product = gpu.product if gpu else ""
    if product.startswith("A100 SXM"):
        return GPU_PRESETS["a100-40gb" if (memory_gib or 80) < 60 else "a100-80gb"]
    return GPU_PRESETS.get(SXM_PRESETS.get(product, ""))


def ratio(measured: float | None, planned: float | None) -> float | None:
    return None if measured is None or not planned else measured / planned


class PlanCheck:
    """The plan of this run's layout, and the comparison of each log window with it (module docstring)."""

    def __init__(self, config: RunConfig, hardware, source: str, world_size: int, gpus_per_node: int,
                 info: Callable[[str], None]) -> None:
        from planner.hardware import Assumptions, deepspeed_layout
        from planner.memory import count_parameters
        from planner.plan import plan_cluster
        from planner.timing import iteration_time

        self.config, self.seq_length = config, config.model.seq_length
        self.hardware = dataclasses.replace(hardware, gpus_per_node=gpus_per_node)
        nodes, assumptions = world_size // gpus_per_node, Assumptions()
        parameters = count_parameters(config)
        self.plan = plan_cluster(config, nodes, self.hardware, assumptions, parameters)
        self.ok = self.plan.full_batch is not None
        if not self.ok:
            info(f"[plan] no plan of this layout on {hardware.name}: {'; '.join(self.plan.errors)}")
            return
        layout, d = deepspeed_layout(config), self.plan.data_parallel_size
        self._seconds: dict[int, float] = {}
        self._time = lambda batch: iteration_time(config, layout, parameters.stages, d, batch, self.hardware,
                                                  assumptions).seconds
        full = self.plan.full_batch
        self.planned_memory_gib = self.plan.memory[0].total / GIB
        peak = self.plan.peak_memory()
        info(f"[plan] {hardware.name} ({source}), {nodes} node(s) x {gpus_per_node} GPU(s), TP "
             f"{self.plan.tensor_parallel_size} x PP {self.plan.pipeline_parallel_size} x DP {d}, full batch "
             f"{full.global_batch}: iteration {full.seconds:.4g} s | {self.tokens_per_second(full.global_batch):,.1f} "
             f"tokens/s | peak memory {peak.total / GIB:.3f} GiB (stage {peak.stage}; rank 0's stage "
             f"{self.planned_memory_gib:.3f} GiB) | each log line compares with the plan at its own batch")
        for problem in self.plan.errors + self.plan.warnings:
            info(f"[plan] {problem}")

    def summary(self) -> dict[str, float]:
        """The start-up figures, at the full batch, for TensorBoard and W&B (``plan/<name>``)."""
        full = self.plan.full_batch
        return {"full_batch": full.global_batch, "iteration_seconds": full.seconds,
                "tokens_per_second": self.tokens_per_second(full.global_batch),
                "peak_memory_gib": self.plan.peak_memory().total / GIB, "rank0_memory_gib": self.planned_memory_gib,
                "mfu": full.mfu}

    def seconds(self, batch: int) -> float:
        """The planned iteration time at this global batch (cached)."""
        if batch not in self._seconds:
            self._seconds[batch] = self._time(batch)
        return self._seconds[batch]

    def tokens_per_second(self, batch: int) -> float:
        return batch * self.seq_length / self.seconds(batch)

    def compare(self, batches: list[int], seconds: float, record: dict[str, Any]) -> dict[str, Any]:
        """The planned figures of a window that trained ``batches`` (one global batch per step) in ``seconds``, and
        the ratios of the record's measured figures to them."""
        planned_seconds = sum(self.seconds(batch) for batch in batches)
        planned = {"planned_iteration_seconds": planned_seconds / len(batches),
                   "planned_tokens_per_second": sum(batches) * self.seq_length / planned_seconds,
                   "planned_peak_memory_gib": self.planned_memory_gib}
        return {**planned,
                "plan_iteration_ratio": ratio(record.get("iteration_seconds"), planned["planned_iteration_seconds"]),
                "plan_tokens_per_second_ratio": ratio(record.get("tokens_per_second"),
                                                      planned["planned_tokens_per_second"]),
                "plan_memory_ratio": ratio(record.get("peak_memory_reserved_gib"),
                                           planned["planned_peak_memory_gib"])}


def open_plan_check(config: RunConfig, world_size: int, info: Callable[[str], None]) -> PlanCheck | None:
    """The plan check of this run, or None: no hardware given and none recognised (CPU), or no plan possible."""
    import torch

    configured = hardware_of(config.training.plan_hardware)
    if configured is not None:
        hardware, source = configured, "training.plan_hardware"
    else:
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
        hardware, source = detected_hardware(name, memory), f"detected from {torch.cuda.get_device_name()!r}"
        if hardware is None:
            info(f"[plan] no comparison with the plan: the planner has no preset for {name!r}; set "
                 f"training.plan_hardware to a planner/hardware.py GPU_PRESETS name or a dict of its fields")
            return None
    per_node = isinstance(config.training.plan_hardware, dict) and "gpus_per_node" in config.training.plan_hardware
    local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    gpus_per_node = hardware.gpus_per_node if per_node else min(local, world_size)
    if world_size % gpus_per_node:
        info(f"[plan] no comparison with the plan: {world_size} processes are not whole nodes of {gpus_per_node}")
        return None
    check = PlanCheck(config, hardware, source, world_size, gpus_per_node, info)
    return check if check.ok else None
