"""Which instruction stream a pipeline rank runs for a batch: DeepSpeed's 1F1B, DeepSpeed's DualPipeV, or the V-shaped
schedule below for the batches DualPipeV cannot run.

    parallelism.pipeline_schedule   micro-batches m per pipeline   stream (one per rank)           from
    "1f1b"                          any                             TrainSchedule (1F1B)            DeepSpeed
    "dualpipev"                     m >= 2p                         DualPipeVSchedule               DeepSpeed
    "dualpipev"                     m < 2p (the ramp's first steps) VShapeSchedule                  this module

Under "dualpipev" the model is a ``DualPipeVModule``: 2p stages, rank r holding stage r (phase 0) and stage 2p-1-r
(phase 1), so micro-batches go out to the last rank and come back to rank 0, which embeds and computes the loss.
DeepSpeed's DualPipeVSchedule needs at least 2p micro-batches; the recipe's ramp starts far below (4 per pipeline
at 280 nodes, against 70). ``VShapeSchedule`` runs any m on the same two-stage module and the same engine
(DeepSpeed's DualPipeVEngine executes its instructions: the same ForwardPass/BackwardPass/Send/Recv with a ``phase``,
sends and receives launched in batches by CommitP2P).

How VShapeSchedule is made, and why it is this simple. The 2p stages form one pipeline of virtual stages
v = 0 .. 2p-1 on ranks min(v, 2p-1-v). Time is cut into ticks; at each tick every rank does at most one stage's
forward or backward of one micro-batch, chosen greedily among the ready ones:

    1. a backward before a forward (it frees activations);
    2. the oldest micro-batch first;
    3. the one further along the V (it reaches the loss, or finishes, sooner).

A tensor made at tick t is sent and received in the CommitP2P that ends tick t on both ranks, so each rank's
CommitP2P of tick t waits only for its neighbours' CommitP2P of the same tick: no rank can wait for one that waits
for it, whatever m and p. Within a CommitP2P the sends and receives between two ranks are queued in one global
order, so they pair up in the order they were posted. The first tensor of each phase also carries its shape
(DeepSpeed's blocking meta-data exchange, at the Send/Recv instruction itself): micro-batch 0 travels the V alone,
one stage per tick, so each rank meets at most one such exchange per tick and its partner is in the same tick.
It is 1F1B's rule on the V (every micro-batch takes 4p stage passes, one rank at a time), no zero-bubble tricks:
these are the ramp's first steps, where the batch is small and the run short. The bubble of every schedule is
measured by replaying these same streams (planner/pipeline_schedule.py).
"""

from __future__ import annotations

from functools import lru_cache

from deepspeed.runtime.pipe import schedule as ds

from model.config import PIPELINE_SCHEDULES

PIPELINE_SCHEDULE_NAMES = {"1f1b": "1F1B", "dualpipev": "DualPipeV", "vshape": "the V-shaped 1F1B on DualPipeV's stages"}


def virtual_stage_rank(virtual_stage: int, stages: int) -> int:
    """The rank holding virtual stage v of 2p: v on the way out, 2p-1-v on the way back."""
    return min(virtual_stage, 2 * stages - 1 - virtual_stage)


def schedule_for(schedule: str, micro_batches: int, stages: int) -> str:
    """The stream a batch of ``micro_batches`` runs under ``parallelism.pipeline_schedule``: "1f1b", "dualpipev" or
    "vshape" (DualPipeV's module with fewer than 2p micro-batches)."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"parallelism.pipeline_schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    if schedule == "dualpipev" and micro_batches < 2 * stages:
        return "vshape"
    return schedule


def train_schedule(name: str, micro_batches: int, stages: int, stage_id: int,
                   forward_only: bool = False) -> ds.PipeSchedule:
    """The DeepSpeed PipeSchedule of ``name`` (as ``schedule_for`` names them) for one rank."""
    if name == "1f1b":
        if forward_only:
            return ds.InferenceSchedule(micro_batches, stages, stage_id)
        return ds.TrainSchedule(micro_batches, stages, stage_id)
    if name == "dualpipev":
        return ds.DualPipeVSchedule(micro_batches, stages, stage_id, forward_only=forward_only)
    if name == "vshape":
        return VShapeSchedule(micro_batches, stages, stage_id, forward_only=forward_only)
    raise ValueError(f"unknown pipeline schedule {name!r}: expected 1f1b, dualpipev or vshape")


class VShapeSchedule(ds.PipeSchedule):
    """DualPipeV's two-stages-per-rank pipeline run for any number of micro-batches (the module docstring says how).

    Buffers are DualPipeVEngine's: phase * micro_batches + micro_batch.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, forward_only: bool = False) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.forward_only = forward_only

    def num_pipe_buffers(self) -> int:
        return 2 * self.micro_batches

    def steps(self):
        for tick in _ticks(self.micro_batches, self.stages, self.forward_only)[self.stage_id]:
            yield list(tick)
        if not self.forward_only:
            yield [ds.CommitP2P(), ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]


_COMMIT = ds.CommitP2P()  # no arguments: one instance serves every tick


@lru_cache(maxsize=64)
def _ticks(micro_batches: int, stages: int, forward_only: bool) -> tuple[tuple[tuple, ...], ...]:
    """Every rank's instructions, one tuple per tick (each ending with CommitP2P).

    Each micro-batch's passes form one chain (F on virtual stages 0 .. 2p-1, then B back from 2p-1 to 0), so at a
    tick the only pass of a micro-batch that can be ready is the next one of its chain: ready when the one before it
    ran at an earlier tick. Each rank takes, of the ready passes on its stages, the first by the module docstring's
    rules."""
    m, p = micro_batches, stages
    last = 2 * p - 1  # the loss stage, on rank 0
    chain = [("F", v) for v in range(2 * p)] + ([] if forward_only else [("B", v) for v in range(last, -1, -1)])

    def phase(v: int) -> int:
        return 0 if v < p else 1

    def buffer(v: int, micro_batch: int) -> int:
        return phase(v) * m + micro_batch

    def priority(kind: str, b: int, v: int) -> tuple:
        progress = v if kind == "F" else 2 * p + last - v
        return (kind != "B", b, -progress)

    position = [0] * m  # the next pass of each micro-batch's chain
    finished_at = [-1] * m  # the tick its previous pass ran
    ranks: list[list[tuple]] = [[] for _ in range(p)]
    tick, remaining = 0, m * len(chain)
    while remaining:
        chosen: dict[int, tuple] = {}
        for b in range(m):
            if position[b] == len(chain) or finished_at[b] == tick:
                continue
            kind, v = chain[position[b]]
            rank = virtual_stage_rank(v, p)
            if rank not in chosen or priority(kind, b, v) < priority(*chosen[rank]):
                chosen[rank] = (kind, b, v)
        messages = []  # (sender, receiver, send instruction, receive instruction), in one global order
        for rank, (kind, b, v) in sorted(chosen.items()):
            position[b] += 1
            finished_at[b] = tick
            remaining -= 1
            if kind == "F" and v + 1 <= last and virtual_stage_rank(v + 1, p) != rank:
                messages.append((b, v, 0, rank, virtual_stage_rank(v + 1, p),
                                 ds.SendActivation(buffer(v, b), phase=phase(v)),
                                 ds.RecvActivation(buffer(v + 1, b), phase=phase(v + 1))))
            if kind == "B" and v >= 1 and virtual_stage_rank(v - 1, p) != rank:
                messages.append((b, v, 1, rank, virtual_stage_rank(v - 1, p),
                                 ds.SendGrad(buffer(v, b), phase=phase(v)),
                                 ds.RecvGrad(buffer(v - 1, b), phase=phase(v - 1))))
        messages.sort(key=lambda message: message[:3])
        for rank in range(p):
            instructions = []
            if rank in chosen:
                kind, b, v = chosen[rank]
                if kind == "F" and v == 0:
                    instructions.append(ds.LoadMicroBatch(buffer(0, b)))
                pass_ = ds.ForwardPass if kind == "F" else ds.BackwardPass
                instructions.append(pass_(buffer(v, b), phase=phase(v)))
            for *_, sender, receiver, send, receive in messages:
                if rank == sender:
                    instructions.append(send)
                if rank == receiver:
                    instructions.append(receive)
            instructions.append(_COMMIT)
            ranks[rank].append(tuple(instructions))
        tick += 1
    return tuple(tuple(rank) for rank in ranks)
