"""The pipeline bubble by simulation: every rank's DeepSpeed instruction stream replayed with forward/backward costs.

The streams are DeepSpeed's own (``deepspeed.runtime.pipe.schedule``): ``TrainSchedule`` (1F1B, p stages of L/p
blocks) and ``DualPipeVSchedule`` (DeepSeek-V3's DualPipeV: rank r holds stage r and stage 2p - 1 - r, each of
L/(2p) blocks; micro-batches go out in phase 0 and come back in phase 1, rank 0 embeds and computes the loss). One
micro-batch's work per rank is the same in both: F + B, with F and B the forward and backward of L/p blocks.

    instruction                    time on its rank
    ForwardPass / BackwardPass     F / B (1F1B); F/2 / B/2 for one of DualPipeV's two half-size stages
    SendActivation, SendGrad       none: the tensor leaves at the rank's clock (1F1B: at the instruction; DualPipeV:
                                   at the next CommitP2P, which launches the queued sends and receives as one batch)
    RecvActivation, RecvGrad       waits for its tensor (1F1B: at the instruction; DualPipeV: at the next CommitP2P)
    anything else                  none (loading data, the reductions and the optimizer come after the pipeline; p2p
                                   transfer time is the planner's separate term)

Channels are FIFO per (sender, receiver, activation or gradient, phase). Activations travel towards the next stage:
1F1B rank s -> s + 1, DualPipeV phase 0 r -> r + 1 and phase 1 r -> r - 1; gradients the other way. A rank's idle
time is the makespan (when the last rank ends) minus its busy time. For 1F1B every rank idles (p - 1)(F + B) of
(m + p - 1)(F + B), the bubble (p - 1) / m of the compute (tests/test_pipeline_schedule.py holds it to the formula).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from model.config import PIPELINE_SCHEDULES as SCHEDULES


@dataclass(frozen=True)
class ScheduleSimulation:
    schedule: str
    stages: int
    micro_batches: int
    makespan: float
    busy: tuple[float, ...]
    """Compute time of each pipeline rank."""

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - busy for busy in self.busy)

    @property
    def bubble(self) -> float:
        """The largest idle time of a rank over its compute: (p - 1) / m for 1F1B."""
        return max(idle / busy for idle, busy in zip(self.idle, self.busy, strict=True))


def instruction_streams(schedule: str, stages: int, micro_batches: int) -> list[list[Any]]:
    """Each pipeline rank's instructions, in order: the streams the engine runs for this batch (model/pipe_schedules.py:
    DeepSpeed's TrainSchedule or DualPipeVSchedule, or the V-shaped schedule of "dualpipev" below 2p micro-batches)."""
    from model.pipe_schedules import schedule_for, train_schedule

    name = schedule_for(schedule, micro_batches, stages)
    return [[instruction for step in train_schedule(name, micro_batches, stages, rank).steps() for instruction in step]
            for rank in range(stages)]


def message_channel(schedule: str, rank: int, instruction: Any) -> tuple[int, int, str, int]:
    """(sender, receiver, kind, phase) of a send or receive on ``rank``."""
    name = type(instruction).__name__
    phase = getattr(instruction, "phase", 0)
    towards_next = 1 if schedule == "1f1b" or phase == 0 else -1  # where activations go
    kind = "activation" if name.endswith("Activation") else "gradient"
    direction = towards_next if kind == "activation" else -towards_next
    if name.startswith("Send"):
        return rank, rank + direction, kind, phase
    return rank - direction, rank, kind, phase


class _Replay:
    def __init__(self, schedule: str, streams: list[list[Any]], forward: float, backward: float) -> None:
        self.schedule, self.streams = schedule, streams
        scale = 1.0 if schedule == "1f1b" else 0.5  # DualPipeV's stages are half as deep
        self.cost = {"ForwardPass": forward * scale, "BackwardPass": backward * scale}
        ranks = len(streams)
        self.clock, self.busy, self.next = [0.0] * ranks, [0.0] * ranks, [0] * ranks
        self.channels: dict[tuple, deque] = defaultdict(deque)
        self.queued_sends: list[list[tuple]] = [[] for _ in range(ranks)]
        self.queued_receives: list[list[tuple]] = [[] for _ in range(ranks)]

    def run(self) -> None:
        while any(self.next[r] < len(stream) for r, stream in enumerate(self.streams)):
            moved = False
            for rank, stream in enumerate(self.streams):
                while self.next[rank] < len(stream) and self._execute(rank, stream[self.next[rank]]):
                    self.next[rank] += 1
                    moved = True
            if not moved:
                raise RuntimeError(f"{self.schedule}: every rank waits (at instructions "
                                   f"{[s[i] for s, i in zip(self.streams, self.next, strict=True) if i < len(s)]})")

    def _execute(self, rank: int, instruction: Any) -> bool:
        """Run one instruction; False if it must wait for a tensor not sent yet."""
        name = type(instruction).__name__
        batched = self.schedule != "1f1b"
        if name in self.cost:
            self.clock[rank] += self.cost[name]
            self.busy[rank] += self.cost[name]
        elif name in ("SendActivation", "SendGrad"):
            channel = message_channel(self.schedule, rank, instruction)
            if batched:
                self.queued_sends[rank].append(channel)
            else:
                self.channels[channel].append(self.clock[rank])
        elif name in ("RecvActivation", "RecvGrad"):
            channel = message_channel(self.schedule, rank, instruction)
            if batched:
                self.queued_receives[rank].append(channel)
            else:
                return self._receive(rank, [channel])
        elif name == "CommitP2P":
            for channel in self.queued_sends[rank]:  # launched once, even if the receives make it wait
                self.channels[channel].append(self.clock[rank])
            self.queued_sends[rank] = []
            if not self._receive(rank, self.queued_receives[rank]):
                return False
            self.queued_receives[rank] = []
        return True

    def _receive(self, rank: int, channels: list[tuple]) -> bool:
        needed: dict[tuple, int] = defaultdict(int)
        for channel in channels:
            needed[channel] += 1
        if any(len(self.channels[channel]) < count for channel, count in needed.items()):
            return False
        for channel in channels:
            self.clock[rank] = max(self.clock[rank], self.channels[channel].popleft())
        return True


def simulate(schedule: str, stages: int, micro_batches: int, forward: float, backward: float) -> ScheduleSimulation:
    """Replay the schedule of ``micro_batches`` on ``stages`` pipeline ranks; ``forward`` and ``backward``: the time
    of L/p blocks' forward and backward for one micro-batch."""
    replay = _Replay(schedule, instruction_streams(schedule, stages, micro_batches), forward, backward)
    replay.run()
    return ScheduleSimulation(schedule, stages, micro_batches, max(replay.clock), tuple(replay.busy))
