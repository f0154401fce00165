"""The recipe's schedules, counted in tokens (the batch size changes, so steps mean nothing).

Learning rate
    lr(t) = peak * t / warmup                                    for t < warmup
          = min + (peak - min) * (1 + cos(pi * (t - warmup) / decay)) / 2     for warmup <= t < warmup + decay
          = min                                                  afterwards,   min = min_lr_ratio * peak
    Which t: a step's learning rate is lr(tokens consumed once this step's batch is consumed), i.e. the tokens
    before the step plus this step's batch. The step that reaches the end of warmup trains at the peak, and the
    first step does not waste its batch at lr 0. (Counting only the tokens before the step, as the public code
    does, runs every step with the learning rate of the step before it.)

Global batch size (the ramp)
    batch(t) = min(end, start + increment * floor(t / tokens_per_increment)),
    tokens_per_increment = ramp_tokens / ((end - start) / increment), t = tokens consumed before the step.
    MT-NLG: 32 -> 1920 in 59 increments of 32 over 12e9 tokens, one increment per 203,389,830.5 tokens
    (99,311.4 samples of 2048).

Both are pure functions of the token count, so their "state" is that count, which the checkpoint holds.

Global batch size from the gradient noise scale (schedule.batch.type "noise_scale", NoiseScaleBatchSchedule)
    factor x B_simple, B_simple measured by training/noise_scale.py: its state is the batch in force and the step it
    changed, which the checkpoint holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LearningRateSchedule:
    peak: float
    """The learning rate at the end of warmup."""
    warmup_tokens: float
    """Linear warmup from 0 over these tokens."""
    decay_tokens: float
    """Cosine decay to the minimum over these tokens, after warmup; then constant."""
    min_lr_ratio: float = 0.1
    """The minimum as a fraction of the peak."""

    def __post_init__(self) -> None:
        if self.peak <= 0:
            raise ValueError(f"schedule.lr must be positive, got {self.peak}")
        if self.warmup_tokens < 0:
            raise ValueError(f"schedule.warmup_tokens must be >= 0, got {self.warmup_tokens}")
        if self.decay_tokens <= 0:
            raise ValueError(f"schedule.decay_tokens must be positive, got {self.decay_tokens}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @property
    def min_lr(self) -> float:
        return self.peak * self.min_lr_ratio

    def __call__(self, tokens: float) -> float:
        if tokens < self.warmup_tokens:
            return self.peak * tokens / self.warmup_tokens
        progress = (tokens - self.warmup_tokens) / self.decay_tokens
        if progress >= 1.0:
            return self.min_lr
        return self.min_lr + (self.peak - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class BatchRamp:
    start: int
    """Global batch (sequences) at token 0."""
    increment: int
    """Sequences added at each increment."""
    end: int
    """The full global batch (DeepSpeed's train_batch_size)."""
    ramp_tokens: float
    """Tokens over which the batch climbs from start to end; 0 disables the ramp."""

    def __post_init__(self) -> None:
        for name in ("start", "increment", "end"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"schedule.batch.{name} must be a positive integer, got {value!r}")
        if self.start > self.end:
            raise ValueError(f"schedule.batch.start ({self.start}) is larger than the full batch "
                             f"train_batch_size ({self.end})")
        if (self.end - self.start) % self.increment:
            raise ValueError(f"the ramp from schedule.batch.start ({self.start}) to train_batch_size ({self.end}) is "
                             f"not a whole number of schedule.batch.increment ({self.increment}) steps")
        if self.ramp_tokens < 0:
            raise ValueError(f"schedule.batch.ramp_tokens must be >= 0, got {self.ramp_tokens}")

    @property
    def num_increments(self) -> int:
        return (self.end - self.start) // self.increment

    @property
    def tokens_per_increment(self) -> float:
        return self.ramp_tokens / self.num_increments if self.num_increments else 0.0

    def __call__(self, tokens: float) -> int:
        if self.num_increments == 0 or self.ramp_tokens == 0 or tokens >= self.ramp_tokens:
            return self.end
        return min(self.end, self.start + self.increment * int(tokens // self.tokens_per_increment))

    def sizes(self) -> list[int]:
        """Every global batch size the ramp will use."""
        return list(range(self.start, self.end + 1, self.increment)) if self.ramp_tokens else [self.end]

    def check_divisible(self, micro_batch_size: int, data_parallel_size: int) -> None:
        """Every batch of the ramp must split into whole micro-batches on every data-parallel rank."""
        unit = micro_batch_size * data_parallel_size
        bad = [size for size in self.sizes() if size % unit]
        if bad:
            shown = ", ".join(map(str, bad[:12])) + (f", ... ({len(bad)} sizes)" if len(bad) > 12 else "")
            raise ValueError(
                f"global batch sizes of the ramp are not multiples of micro-batch x data-parallel size = "
                f"{micro_batch_size} x {data_parallel_size} = {unit}: {shown}. Choose schedule.batch.start and "
                f"increment as multiples of {unit} (e.g. {unit * math.ceil(self.start / unit)}), or another "
                f"data-parallel size")


def future_batches(ramp: BatchRamp, consumed_tokens: float, train_tokens: float, seq_length: int
                   ) -> list[tuple[int, int]]:
    """The global batches still to run, as (batch, steps) runs: the ramp's real sizes step by step while it climbs,
    then the full batch for as many steps as reach ``train_tokens`` (the last step may pass it, as the trainer's)."""
    runs: list[tuple[int, int]] = []
    while consumed_tokens < train_tokens:
        batch = ramp(consumed_tokens)
        if batch == ramp.end:  # no more increments: the rest in one run
            runs.append((batch, math.ceil((train_tokens - consumed_tokens) / (batch * seq_length))))
            break
        if runs and runs[-1][0] == batch:
            runs[-1] = (batch, runs[-1][1] + 1)
        else:
            runs.append((batch, 1))
        consumed_tokens += batch * seq_length
    return runs


def pipeline_slots(micro_batches: int, pipeline_parallel_size: int) -> int:
    """How long a 1F1B step of ``micro_batches`` takes, in one micro-batch's forward and backward on one stage: the
    micro-batches and the pipeline's fill and drain (p - 1)."""
    return micro_batches + pipeline_parallel_size - 1


@dataclass
class NoiseScaleBatchSchedule:
    """``schedule.batch.type = "noise_scale"``: the global batch follows factor x B_simple.

    Before each step, ``__call__(step, noise_scale)`` returns the global batch:
        target = floor(factor x B_simple / unit) x unit,  unit = micro-batch x DP (whole micro-batches per replica)
        batch  = min(end, max(start, target, the current batch))     never decreasing, bounded by start and end
    and the batch changes only if at least ``interval_steps`` steps have run since the last change (the start of
    the run counts as one). Without a measurement (None: DP = 1, the first step, or |G|^2 not yet positive) the
    batch stays where it is.
    """

    start: int
    """Global batch of the first steps (schedule.batch.start)."""
    end: int
    """The maximum, DeepSpeed's train_batch_size."""
    micro_batch_size: int
    data_parallel_size: int
    factor: float = 1.0
    """The batch aimed for, as a multiple of the measured B_simple (schedule.batch.factor)."""
    interval_steps: int = 1
    """Change the batch at most every this many steps (schedule.batch.interval_steps)."""
    batch: int = field(init=False)
    """The batch in force (state)."""
    last_change_step: int = field(init=False, default=0)
    """Completed steps when the batch last changed (state)."""

    def __post_init__(self) -> None:
        for name in ("start", "end", "micro_batch_size", "data_parallel_size", "interval_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"schedule.batch.{name} must be a positive integer, got {value!r}")
        if not self.factor > 0:
            raise ValueError(f"schedule.batch.factor must be positive, got {self.factor}")
        if self.start > self.end:
            raise ValueError(f"schedule.batch.start ({self.start}) is larger than the full batch "
                             f"train_batch_size ({self.end})")
        bad = [f"{name} ({value})" for name, value in (("schedule.batch.start", self.start),
                                                        ("train_batch_size", self.end)) if value % self.unit]
        if bad:
            raise ValueError(f"{' and '.join(bad)} must be {'multiples' if len(bad) > 1 else 'a multiple'} of "
                             f"micro-batch x data-parallel size = {self.micro_batch_size} x {self.data_parallel_size} "
                             f"= {self.unit}")
        self.batch = self.start

    @property
    def unit(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def target(self, noise_scale: float) -> int:
        """factor x B_simple rounded down to a multiple of the unit, within [start, end]."""
        wanted = self.factor * noise_scale
        rounded = int(wanted // self.unit) * self.unit if math.isfinite(wanted) else self.end
        return min(self.end, max(self.start, rounded))

    def __call__(self, step: int, noise_scale: float | None) -> int:
        """The global batch of the step after ``step`` completed steps, given the latest measured B_simple."""
        if noise_scale is None or step - self.last_change_step < self.interval_steps:
            return self.batch
        wanted = max(self.batch, self.target(noise_scale))
        if wanted != self.batch:
            self.batch, self.last_change_step = wanted, step
        return self.batch

    def state_dict(self) -> dict[str, int]:
        return {"batch": self.batch, "last_change_step": self.last_change_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        batch = int(state["batch"])
        if not self.start <= batch <= self.end or batch % self.unit:
            raise ValueError(f"the checkpoint's noise-scale batch {batch} is not a multiple of {self.unit} within "
                             f"[schedule.batch.start {self.start}, train_batch_size {self.end}] of this run")
        self.batch, self.last_change_step = batch, int(state["last_change_step"])
