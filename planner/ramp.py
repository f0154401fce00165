"""The batch ramp and the whole training: each ramp segment's tokens at its batch's iteration time.

    stages repeat stage 1 with fewer micro-batches held).

Whole training
    time = integral over tokens of seconds(batch(t)) / (batch(t) s): each ramp segment's tokens at its batch size's
    iteration time, then the rest at the full batch. If a ramp size does not divide by b d, the plan warns, names
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runconfig.schedules import BatchRamp


def ramp_sizes_not_dividing(ramp: BatchRamp, unit: int) -> list[int]:
    """The ramp's global batch sizes that are not a whole number of micro-batches on every DP rank."""
    return [size for size in ramp.sizes() if size % unit]


def suggest_ramp(ramp: BatchRamp, unit: int) -> BatchRamp:
    """A ramp to the same end whose every size is a multiple of unit (micro-batch x DP): the increment is the
    multiple of unit nearest the configured one (ties: the larger), the start the size nearest the configured start."""
    candidates = range(unit, ramp.end + 1, unit)
    increment = min(candidates, key=lambda c: (abs(c - ramp.increment), -c))
    steps = max(0, round((ramp.end - ramp.start) / increment))
    start = ramp.end - steps * increment
    if start <= 0:
        start += increment
    return BatchRamp(start=start, increment=increment, end=ramp.end, ramp_tokens=ramp.ramp_tokens)


@dataclass(frozen=True)
class TrainingTime:
    tokens: float
    steps: float
    """Optimizer steps (fractional: segments are integrated in token space)."""
    seconds: float
    ramp_tokens: float
    ramp_steps: float
    ramp_seconds: float
    ramp_seconds_at_full_batch_rate: float
    """What the ramp's tokens would take at the full batch's seconds per token; the difference is the ramp's cost."""


def ramp_segments(ramp: BatchRamp, train_tokens: float) -> list[tuple[int, float]]:
    """(global batch, tokens trained at it), in order, up to train_tokens."""
    segments = []
    if ramp.num_increments and ramp.ramp_tokens:
        for k, size in enumerate(ramp.sizes()[:-1]):
            begin, end = k * ramp.tokens_per_increment, min((k + 1) * ramp.tokens_per_increment, train_tokens)
            if end > begin:
                segments.append((size, end - begin))
    done = sum(tokens for _, tokens in segments)
    if train_tokens > done:
        segments.append((ramp.end, train_tokens - done))
    return segments


def training_time(ramp: BatchRamp, train_tokens: float, seq_length: int,
                  seconds_per_step: Callable[[int], float]) -> TrainingTime:
    """Integrate seconds(batch(t)) / (batch(t) s) over the tokens: each segment's steps at its batch's step time."""
    segments = ramp_segments(ramp, train_tokens)
    steps = [tokens / (batch * seq_length) for batch, tokens in segments]
    seconds = [n * seconds_per_step(batch) for n, (batch, _) in zip(steps, segments, strict=True)]
    in_ramp = [i for i, (batch, _) in enumerate(segments) if batch != ramp.end]
    ramp_tokens = sum(segments[i][1] for i in in_ramp)
    full_rate = seconds_per_step(ramp.end) / (ramp.end * seq_length)
    return TrainingTime(tokens=train_tokens, steps=sum(steps), seconds=sum(seconds), ramp_tokens=ramp_tokens,
                        ramp_steps=sum(steps[i] for i in in_ramp), ramp_seconds=sum(seconds[i] for i in in_ramp),
                        ramp_seconds_at_full_batch_rate=ramp_tokens * full_rate)

