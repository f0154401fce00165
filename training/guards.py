"""Skipped steps and the loss-spike guard: one mechanism for every update that must not be applied.

A step is skipped by DeepSpeed's own overflow path: when any gradient is inf or NaN, its ZeRO-1 and BF16 optimizers
(all-reducing the flag over data- and model-parallel ranks) clear the gradients, leave weights and Adam moments
untouched, and count the step in ``engine.skipped_steps``. Three things lead there:

- a non-finite loss (a poisoned batch, an fp32/bf16 blow-up): its gradients are non-finite already;
- an fp16 loss-scale overflow: DeepSpeed's dynamic loss scaler, as usual;
- a loss spike: on the last pipeline stage, at the step's last micro-batch, the guard compares the mean loss of the
  step's micro-batches with its window of recent step losses and, for a spike, multiplies that micro-batch's loss
  by NaN, so the step's accumulated gradients become NaN on every stage and the update is skipped like the others.
  The guard reads training losses only (evaluation runs the same loss function outside a step) and reads them on
  the host once per step, not once per micro-batch.

The trainer learns what happened from ``engine.skipped_steps`` and one small all-reduce per step (the spike flag and
loss travel from the last stage with the stop flag).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SpikeGuardConfig:
    enabled: bool = False
    """Off by default: a spike then trains like any other step."""
    window: int = 32
    """Recent (applied) step losses the current one is compared with."""
    threshold_std: float = 5.0
    """A spike is a step loss above mean + max(threshold_std x std, min_increase x mean) of the window..."""
    min_increase: float = 0.1
    """...so a window of nearly equal losses does not flag ordinary noise."""
    rollback: bool = False
    """On a spike, also reload the latest checkpoint and skip the data from there to the spike (PaLM's practice)."""
    max_rollbacks: int = 10
    """Stop the run after this many rollbacks: spikes that come back are not a data problem."""

    def __post_init__(self) -> None:
        if self.max_rollbacks < 1:
            raise ValueError(f"training.spike_guard.max_rollbacks must be >= 1, got {self.max_rollbacks}")
        if self.window < 2:
            raise ValueError(f"training.spike_guard.window must be >= 2, got {self.window}")
        if self.threshold_std <= 0 or self.min_increase < 0:
            raise ValueError("training.spike_guard.threshold_std must be positive and min_increase >= 0, got "
                             f"{self.threshold_std} and {self.min_increase}")


@dataclass
class SpikeGuard:
    """Lives in the loss function of the last pipeline stage (one per data-parallel replica).

    Active only from ``begin_step`` to ``end_step``, the training step: evaluation (DeepSpeed's ``eval_batch`` calls
    the same loss function) neither feeds the window nor is judged by it. Within a step the micro-batch losses are
    summed on the device; at the last one the comparison with the threshold (a host number, from the window) also
    runs on the device, and its outcome multiplies that loss by 1 or NaN. The host reads the step's mean loss and
    the outcome once, in ``end_step``, after DeepSpeed's own read of the step's loss.
    """

    config: SpikeGuardConfig
    history: deque = field(default_factory=deque)
    """Recent step losses (mean of the step's micro-batch losses on this replica), the latest last."""
    micro_batches: int = 0
    seen: int = 0
    spike_loss: float | None = None
    active: bool = False
    _loss_sum: torch.Tensor | None = None  # on the device: the step's micro-batch losses so far
    _outcome: torch.Tensor | None = None  # on the device, after the last micro-batch: [step loss, 1.0 if a spike]
    _limit: float | None = None

    def begin_step(self, micro_batches: int) -> None:
        self.micro_batches, self.seen, self.spike_loss, self.active = micro_batches, 0, None, True
        self._loss_sum = self._outcome = None
        self._limit = self.threshold() if self.config.enabled else None

    def threshold(self) -> float | None:
        if len(self.history) < self.config.window:
            return None
        mean, std = statistics.fmean(self.history), statistics.stdev(self.history)
        return mean + max(self.config.threshold_std * std, self.config.min_increase * mean)

    def observe(self, loss: torch.Tensor) -> torch.Tensor:
        """Called with each micro-batch loss; returns it, or NaN x it at the last micro-batch of a spike."""
        if not self.active or self.seen >= self.micro_batches:
            return loss
        detached = loss.detach().float()
        self._loss_sum = detached.clone() if self._loss_sum is None else self._loss_sum + detached
        self.seen += 1
        if self.seen < self.micro_batches:
            return loss
        step_loss = self._loss_sum / self.seen  # as DeepSpeed averages the step's loss: the same bits
        if self._limit is None:  # disabled, or the window is not full yet
            self._outcome = torch.stack([step_loss, torch.zeros_like(step_loss)])
            return loss
        # A non-finite step is skipped by DeepSpeed anyway: not a spike, and not part of the window.
        spike = torch.isfinite(step_loss) & (step_loss > self._limit)
        self._outcome = torch.stack([step_loss, spike.float()])
        return loss * torch.where(spike, float("nan"), 1.0).to(loss.dtype)

    def end_step(self) -> None:
        """Close the step: one host read of [step loss, spike], then the window or ``spike_loss`` is updated."""
        self.active = False
        if self._outcome is None:  # not the last stage, or the step did not finish
            return
        step_loss, spike = self._outcome.tolist()
        self._loss_sum = self._outcome = None
        if spike:
            self.spike_loss = step_loss
        elif math.isfinite(step_loss):
            self.history.append(step_loss)
            while len(self.history) > self.config.window:
                self.history.popleft()

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(state.get("history", []))


def attach_spike_guard(engine: Any, guard: SpikeGuard) -> None:
    """Route the pipeline's loss function through the guard (only the last stage computes a loss)."""
    loss_fn = engine.module.loss_fn

    def guarded_loss(outputs, labels):
        return guard.observe(loss_fn(outputs, labels))

    engine.module.loss_fn = guarded_loss
