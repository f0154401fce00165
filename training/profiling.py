"""``training.profile``: torch profiler traces of chosen steps on chosen ranks, each pipeline instruction a range.

    {"steps": [first, last], "ranks": [0]}     steps are 1-based optimizer steps, as logged, both included;
                                                ranks are global ranks ("all": every rank)

Each chosen rank writes one trace, ``<training.save>/profile/rank<R>.<time>.pt.trace.json``, in the format TensorBoard's
profiler plugin and chrome://tracing / Perfetto read. On a profiled rank every instruction the pipeline engine runs
(LoadMicroBatch, ForwardPass, SendActivation, BackwardPass, ReduceGrads, OptimizerStep, ...) is a record_function
range of its name, so the trace shows the schedule as it ran; CUDA kernels are recorded too where there is a GPU.
Outside the window the profiler is off: what remains is the ranges' own cost, a few microseconds per instruction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common import deepspeed_internals as ds_internals
from runconfig.monitors import ProfileConfig

DIRECTORY = "profile"


class StepProfiler:
    """Starts the torch profiler before the first chosen step and writes its trace after the last, on chosen ranks."""

    def __init__(self, config: ProfileConfig | None, engine: Any, rank: int, save: str | None) -> None:
        self.config = config if config is not None and config.profiles(rank) else None
        self.rank, self.profiler = rank, None
        self.directory = Path(save or ".") / DIRECTORY
        if self.config is not None:
            ds_internals.wrap_instructions(engine, _instruction_range)

    def before_step(self, step: int) -> None:
        if self.config is None or step != self.config.steps[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.directory), worker_name=f"rank{self.rank}"))
        self.profiler.start()

    def after_step(self, step: int) -> Path | None:
        """After the last chosen step: the trace written (its directory), else None."""
        if self.profiler is None or step != self.config.steps[1]:
            return None
        self.profiler.stop()  # on_trace_ready writes the trace
        self.profiler = None
        return self.directory


def _instruction_range(name: str, execute: Any) -> Any:
    with torch.profiler.record_function(name):  # records only while a profiler runs
        return execute()
