"""Fault injection for the reliability tests, off unless MTNLG_FAULTS is set (a JSON object).

    {"poison_steps": [5, 6]}        loss masks of those steps' micro-batches are NaN: a non-finite loss
    {"garbage_samples": [72, 88]}   samples [72, 88) of the data order are random ids from the last 256 of the
                                    vocabulary (rare tokens the model has learnt to expect little): a real loss
                                    spike, bound to the data (a rollback that skips those samples escapes it)
    {"kill_in_checkpoint": 8}       global rank 1 is SIGKILLed after writing its part of checkpoint 8, before `latest`
    {"checkpoint_oserror": 8}       global rank 0's checkpoint writer fails writing checkpoint 8 with ENOSPC ("no
                                    space left on device"), as a full disk fails it
    {"writer_delay_s": 2.0}         every rank's checkpoint writer waits this long before each file: the
                                    checkpoint stays in flight over the next steps

Steps are 1-based optimizer steps, as logged. The two writer faults wrap the checkpoint engine's per-file hook
(``SnapshotCheckpointEngine.write_file``, training/checkpoint_engine.py), which hands each file to the writer
process: a wrapped file reaches the writer late (a delay, a gate) or never (the ENOSPC raised in its place comes back
as the writer's own OSError would). The engine itself has no fault parameter.

    delay_writes(files, seconds)   each file waits ``seconds`` before it is written
    hold_writes(files, gate)       each file waits until ``gate`` (a threading.Event) is set
    fail_writes(files, tag)        the first file of checkpoint ``tag`` fails with ENOSPC; nothing of it is written
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.device import HOST
from model.checkpoint_files import tag_for_step

if TYPE_CHECKING:
    from training.checkpoint_engine import SnapshotCheckpointEngine, WrittenFile

ENVIRONMENT_VARIABLE = "MTNLG_FAULTS"


@dataclass
class FaultPlan:
    poison_steps: list[int] = field(default_factory=list)
    garbage_samples: list[int] = field(default_factory=list)
    kill_in_checkpoint: int | None = None
    checkpoint_oserror: int | None = None
    writer_delay_s: float = 0.0

    @classmethod
    def from_environment(cls) -> FaultPlan:
        text = os.environ.get(ENVIRONMENT_VARIABLE)
        return cls(**json.loads(text)) if text else cls()

    def before_checkpoint_commit(self, step: int, rank: int) -> None:
        """Called by every rank after writing its checkpoint files, before `latest` moves."""
        if self.kill_in_checkpoint == step and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def install_in_writer(self, files: SnapshotCheckpointEngine, rank: int) -> None:
        """The writer faults of the plan, on this rank's checkpoint engine (a full disk on global rank 0 only)."""
        if self.writer_delay_s:
            delay_writes(files, self.writer_delay_s)
        if self.checkpoint_oserror and rank == 0:
            fail_writes(files, tag_for_step(self.checkpoint_oserror))


def delay_writes(files: SnapshotCheckpointEngine, seconds: float) -> None:
    """Each file the engine's writer writes waits ``seconds`` first: a checkpoint stays in flight for longer."""
    write = files.write_file

    def slow(state: Any, path: Path, zipfile: bool) -> WrittenFile:
        time.sleep(seconds)
        return write(state, path, zipfile)

    files.write_file = slow


def hold_writes(files: SnapshotCheckpointEngine, gate: threading.Event) -> None:
    """The engine's writer waits for ``gate`` before each file: a checkpoint is in flight until the caller opens it."""
    write = files.write_file

    def held(state: Any, path: Path, zipfile: bool) -> WrittenFile:
        gate.wait()
        return write(state, path, zipfile)

    files.write_file = held


def fail_writes(files: SnapshotCheckpointEngine, tag: str) -> None:
    """The writer fails the first file of checkpoint ``tag`` with ENOSPC, as a full disk does."""
    write = files.write_file

    def full(state: Any, path: Path, zipfile: bool) -> WrittenFile:
        if path.parent.name == tag:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(state, path, zipfile)

    files.write_file = full


class FaultyLoader:
    """Wraps a micro-batch loader; the trainer sets ``step`` (the step being run) before each train_batch."""

    def __init__(self, loader: Iterator, plan: FaultPlan, vocab_size: int) -> None:
        self.loader, self.plan, self.vocab_size, self.step = loader, plan, vocab_size, 0

    def __iter__(self) -> FaultyLoader:
        return self

    def __next__(self):
        first_sample = self.loader.consumed_samples  # data position of this micro-batch (all DP ranks together)
        (tokens, *positions_and_documents), (labels, loss_mask, *rest) = next(self.loader)  # rest: DPO's reference
        if self.step in self.plan.poison_steps:
            loss_mask = torch.full_like(loss_mask, float("nan"))
        if self.plan.garbage_samples and self.plan.garbage_samples[0] <= first_sample < self.plan.garbage_samples[1]:
            generator = torch.Generator(device=HOST).manual_seed(first_sample)  # host: the same garbage anywhere
            rare, device = (self.vocab_size - 256, self.vocab_size), tokens.device
            # host: drawn from the host generator above, then moved to the batch's device
            tokens = torch.randint(*rare, tokens.shape, generator=generator, device=HOST).to(device)
            labels = torch.randint(*rare, labels.shape, generator=generator, device=HOST).to(device)  # host: as tokens
        return (tokens, *positions_and_documents), (labels, loss_mask, *rest)
