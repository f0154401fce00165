"""The pipeline bubble by simulation: every rank's DeepSpeed instruction stream replayed with forward/backward costs.

The streams are DeepSpeed's own (``deepspeed.runtime.pipe.schedule``): ``TrainSchedule`` (1F1B, p stages of L/p
blocks) and ``DualPipeVSchedule`` (DeepSeek-V3's DualPipeV: rank r holds stage r and stage 2p - 1 - r, each of
L/(2p) blocks; micro-batches go out in phase 0 and come back in phase 1, rank 0 embeds and computes the loss). One
micro-batch's work per rank is the same in both: F + B, with F and B the forward and backward of L/p blocks.

    instruction                    time on its rank
    ForwardPass / BackwardPass     F / B (1F1B); under DualPipeV each of the rank's two stages its share of F and B
                                   (by default half each; the planner gives each stage its share of the FLOPs)
    SendActivation, SendGrad       none: the tensor leaves at the rank's clock (1F1B: at the instruction; DualPipeV:
                                   at the next CommitP2P, which launches the queued sends and receives as one batch)
    RecvActivation, RecvGrad       waits for its tensor (1F1B: at the instruction; DualPipeV: at the next CommitP2P)
    anything else                  none (loading data, the reductions and the optimizer come after the pipeline; p2p
                                   transfer time is the planner's separate term)

Channels are FIFO per (sender, receiver, activation or gradient, phase). Activations travel towards the next stage:
1F1B rank s -> s + 1, DualPipeV phase 0 r -> r + 1 and phase 1 r -> r - 1; gradients the other way. A rank's idle
time is the makespan (when the last rank ends) minus its busy time. For 1F1B every rank idles (p - 1)(F + B) of
(m + p - 1)(F + B), the bubble (p - 1) / m of the compute (tests/test_pipeline_schedule.py holds it to the formula).

The planner's bubble (``pipeline_bubble``) is this idle time: (p - 1)(F + B) for 1F1B, the replay otherwise. For
DualPipeV it replays m = 2p: from there on every extra micro-batch adds one chunk of the main step (F0 B1 F1 B0) to
every rank, busy throughout, so the idle time no longer depends on m (the tests hold it equal at m = 2p, 4p, 16p).
Below 2p (the V-shaped schedule of the ramp's first steps) it replays the m of the batch.

Activations in flight (``activations_in_flight``) come from the same streams, counted as DualPipeVEngine keeps its
tensors: a ForwardPass keeps its stage's activations until its BackwardPass; a RecvActivation allocates the input
buffer, which stays until the SendGrad of its gradient (the forward works on a clone of it); a RecvGrad allocates a
gradient buffer until its BackwardPass; the input gradient a BackwardPass makes stays until the CommitP2P that sends
it (on the last rank, the turn-around's, until the phase-0 BackwardPass that takes it). On the loss stage (rank 0,
phase 1) the input and its gradient stay until the next loss-stage ForwardPass: the engine keeps the last loss
(``engine.loss``), whose graph holds its leaf, the input, with its ``.grad`` (measured at PP 4,
tests/test_activation_memory.py).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


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
    return [list(stream) for stream in _streams(schedule, stages, micro_batches)]


@lru_cache(maxsize=32)
def _streams(schedule: str, stages: int, micro_batches: int) -> tuple[tuple[Any, ...], ...]:
    from model.pipe_schedules import schedule_for, train_schedule

    name = schedule_for(schedule, micro_batches, stages)
    return tuple(tuple(instruction for step in train_schedule(name, micro_batches, stages, rank).steps()
                       for instruction in step) for rank in range(stages))


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
    def __init__(self, schedule: str, streams: list[list[Any]], forward: float, backward: float,
                 phase_shares: tuple[float, float]) -> None:
        self.schedule, self.streams = schedule, streams
        shares = (1.0, 0.0) if schedule == "1f1b" else phase_shares
        self.cost = {("ForwardPass", phase): forward * share for phase, share in enumerate(shares)}
        self.cost.update({("BackwardPass", phase): backward * share for phase, share in enumerate(shares)})
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
        if name in ("ForwardPass", "BackwardPass"):
            cost = self.cost[(name, getattr(instruction, "phase", 0))]
            self.clock[rank] += cost
            self.busy[rank] += cost
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


def simulate(schedule: str, stages: int, micro_batches: int, forward: float, backward: float,
             phase_shares: tuple[float, float] = (0.5, 0.5)) -> ScheduleSimulation:
    """Replay the schedule of ``micro_batches`` on ``stages`` pipeline ranks; ``forward`` and ``backward``: the time
    of one rank's forward and backward of one micro-batch (L/p blocks); ``phase_shares``: under DualPipeV the parts
    of it that its two stages take."""
    replay = _Replay(schedule, instruction_streams(schedule, stages, micro_batches), forward, backward, phase_shares)
    replay.run()
    return ScheduleSimulation(schedule, stages, micro_batches, max(replay.clock), tuple(replay.busy))


def pipeline_bubble(schedule: str, stages: int, micro_batches: int, forward: float, backward: float,
                    phase_shares: tuple[float, float] = (0.5, 0.5)) -> float:
    """Seconds the slowest rank idles in one batch (the module docstring says how): (p - 1)(F + B) for 1F1B."""
    if schedule == "1f1b" or stages == 1:
        return (stages - 1) * (forward + backward)
    replayed = min(micro_batches, 2 * stages)
    return forward * _unit_idle(schedule, stages, replayed, backward / forward, tuple(phase_shares))


@lru_cache(maxsize=4096)
def _unit_idle(schedule: str, stages: int, micro_batches: int, ratio: float, phase_shares: tuple[float, float]
               ) -> float:
    """The largest idle time of a rank with F = 1, B = ratio: every time scales with the costs."""
    return max(simulate(schedule, stages, micro_batches, 1.0, ratio, phase_shares).idle)


@dataclass(frozen=True)
class InFlight:
    """One rank's tensors at the instruction boundary where their bytes peak."""

    held: tuple[int, ...]
    """Micro-batches whose forward has run and backward has not, per phase."""
    buffers: int
    """Received activations and gradients, and gradients waiting to be sent: one (b, s, h) tensor each."""
    peak_bytes: float
    """sum(held x per_micro_batch) + buffers x buffer_bytes there."""


def activations_in_flight(stages: int, micro_batches: int, rank: int, per_micro_batch: tuple[float, float],
                          buffer_bytes: float) -> InFlight:
    """What DualPipeVEngine keeps on ``rank`` through the batch (the module docstring's rules), with
    ``per_micro_batch`` the bytes each of its two stages keeps per micro-batch and ``buffer_bytes`` one received
    tensor's: the peak over the rank's instruction boundaries (1F1B's stages hold min(p - stage, m) instead)."""
    peak = max(_distinct_states(stages, micro_batches, rank), key=lambda state: (
        state[0] * per_micro_batch[0] + state[1] * per_micro_batch[1] + state[2] * buffer_bytes, state))
    return InFlight(held=peak[:2], buffers=peak[2],
                    peak_bytes=peak[0] * per_micro_batch[0] + peak[1] * per_micro_batch[1] + peak[2] * buffer_bytes)


@lru_cache(maxsize=256)
def _distinct_states(stages: int, micro_batches: int, rank: int) -> frozenset[tuple[int, int, int]]:
    return frozenset(in_flight_states(stages, micro_batches, rank))


@lru_cache(maxsize=256)
def in_flight_states(stages: int, micro_batches: int, rank: int) -> tuple[tuple[int, int, int], ...]:
    """(held in phase 0, held in phase 1, buffers) before the batch, then after each instruction of ``rank``'s
    DualPipeV stream. Rank 0 starts with the previous batch's last loss input and gradient (module docstring)."""
    first = rank == 0
    held, buffers, to_send, kept_by_the_loss = [0, 0], 2 * first, 0, 2 * first
    states = [(0, 0, buffers)]
    for instruction in _streams("dualpipev", stages, micro_batches)[rank]:
        name, phase = type(instruction).__name__, getattr(instruction, "phase", 0)
        loss_stage = first and phase == 1
        if name in ("RecvActivation", "RecvGrad"):
            buffers += 1
        elif name == "ForwardPass":
            held[phase] += 1
            if loss_stage:  # engine.loss is replaced: the previous loss's graph lets go of its input and gradient
                buffers -= kept_by_the_loss
                kept_by_the_loss = 0
        elif name == "BackwardPass":
            held[phase] -= 1
            if not loss_stage:
                buffers -= 1  # the received gradient (at the turn-around: phase 1's input gradient)
            if not (first and phase == 0):
                buffers += 1  # the gradient of the stage's input
        elif name == "SendGrad":
            if loss_stage:  # engine.loss keeps its graph, whose leaf is this input (and its .grad)
                kept_by_the_loss += 2
            else:
                buffers -= 1  # the received input buffer
                to_send += 1
        elif name == "CommitP2P":
            buffers -= to_send  # the input gradients sent
            to_send = 0
        states.append((held[0], held[1], buffers))
    return tuple(states)
