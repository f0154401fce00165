"""``training.memory_snapshot`` and the log's peak CUDA memory per window.

    {"step": 3, "on_oom": true, "stacks": "python", "max_entries": 100000}

From the trainer's start, each rank records the CUDA caching allocator's history
(``torch.cuda.memory._record_memory_history(max_entries=..., stacks=...)``); a snapshot
(``torch.cuda.memory._dump_snapshot``) goes to ``<training.save>/memory/snapshot_step<N>_rank<R>.pickle`` after
optimizer step ``step`` (1-based, as logged) and, with ``on_oom``, when a step raises ``torch.OutOfMemoryError``
(then ``snapshot_oom_step<N>_rank<R>.pickle``, N the step that failed; the error is raised again). Drag a file onto
https://pytorch.org/memory_viz to read it. ``stacks`` "python" (the default) keeps Python frames only, which makes a
dump take seconds rather than minutes (torchtitan PR #3628); "all" adds C++ frames. ``max_entries`` bounds the
recorded history (the oldest events are dropped first); without ``on_oom`` the recording stops after the step's
dump. The model and optimizer states are built before the
trainer starts recording: they appear in the snapshot's segments, without the stack that allocated them.

On CPU (no CUDA) one line says that snapshots need CUDA, and the run goes on.

The log's ``peak_memory_allocated_gib`` and ``peak_memory_reserved_gib`` are rank 0's
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the log window (reset after each log line);
``peak_memory_gib`` stays the largest allocation since the start. None on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from runconfig.monitors import MemorySnapshotConfig

DIRECTORY = "memory"
STACKS = ("python", "all")
GIB = 2**30
CPU_MESSAGE = ("training.memory_snapshot: not recording, memory snapshots need CUDA (torch.cuda.is_available() is "
               "False); training goes on")


def snapshot_path(save: str | Path, step: int, rank: int, oom: bool = False) -> Path:
    """Where the snapshot of ``step`` on ``rank`` goes."""
    return Path(save) / DIRECTORY / f"snapshot_{'oom_' if oom else ''}step{step}_rank{rank}.pickle"


def due(config: MemorySnapshotConfig | None, step: int) -> bool:
    """Whether the snapshot is dumped after optimizer step ``step``."""
    return config is not None and config.step == step


class MemoryMonitor:
    """Records the allocator history when asked (CUDA only), dumps its snapshots, and reads the window's peaks."""

    def __init__(self, config: MemorySnapshotConfig | None, save: str | None, rank: int,
                 info: Callable[[str], None]) -> None:
        self.cuda = torch.cuda.is_available()
        self.config = config if self.cuda else None
        self.save, self.rank, self.info = save, rank, info
        self.peak_allocated = 0.0
        if config is not None and not self.cuda:
            info(CPU_MESSAGE)
        if self.config is not None:
            torch.cuda.memory._record_memory_history(max_entries=config.max_entries, stacks=config.stacks)

    def dump(self, step: int, oom: bool = False) -> Path:
        path = snapshot_path(self.save, step, self.rank, oom)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        print(f"[memory] rank {self.rank}: {'out of memory at' if oom else 'after'} step {step}: snapshot in "
              f"{path}", flush=True)
        return path

    @contextmanager
    def guard(self, step: int):
        """Around optimizer step ``step``: with on_oom, a snapshot when it runs out of CUDA memory (re-raised)."""
        try:
            yield
        except torch.OutOfMemoryError:
            if self.config is not None and self.config.on_oom:
                self.dump(step, oom=True)
            raise

    def after_step(self, step: int) -> None:
        if due(self.config, step):
            self.dump(step)
            if not self.config.on_oom:  # nothing more to dump: stop recording (and its cost per allocation)
                self.close()
                self.config = None

    def window_peaks(self) -> dict[str, float | None]:
        """This window's peak allocated and reserved GiB (then reset), and the peak allocated since the start."""
        if not self.cuda:
            return {"peak_memory_gib": None, "peak_memory_allocated_gib": None, "peak_memory_reserved_gib": None}
        allocated, reserved = torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB
        torch.cuda.reset_peak_memory_stats()
        self.peak_allocated = max(self.peak_allocated, allocated)
        return {"peak_memory_gib": self.peak_allocated, "peak_memory_allocated_gib": allocated,
                "peak_memory_reserved_gib": reserved}

    def close(self) -> None:
        if self.config is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
