"""Skipped steps and the loss-spike guard: one mechanism for every update that must not be applied.

A step is skipped by DeepSpeed's own overflow path: when any gradient is inf or NaN, its ZeRO-1 and BF16 optimizers
(all-reducing the flag over data- and model-parallel ranks) clear the gradients, leave weights and Adam moments
untouched, and count the step in ``engine.skipped_steps``. Three things lead there:

- a non-finite loss (a poisoned batch, an fp32/bf16 blow-up): its gradients are non-finite already;
- an fp16 loss-scale overflow: DeepSpeed's dynamic loss scaler, as usual;
- a loss spike, by the rule of training/spikes.py: on the last pipeline stage, at the step's last micro-batch, the
  guard compares the mean loss of the step's micro-batches with its detector's limit (a host number, computed
  before the step) and, for a spike, multiplies that micro-batch's loss by NaN, so the step's accumulated gradients
  become NaN on every stage and the update is skipped like the others. The guard reads training losses only
  (evaluation runs the same loss function outside a step) and reads them on the host once per step, not once per
  micro-batch.

    where                         what the guard does                                               host reads
    begin_step                    limit = detector.limit() (None: disabled, or no EWM yet);         none
                                  inactive for an ignored step (the start of warmup)
    loss function, each           add the micro-batch loss to the step's sum, on the device         none
      micro-batch
    loss function, the last       step loss = sum / micro-batches; spike = step loss > limit, in    none
      micro-batch                 float64 on the device; that micro-batch's loss x NaN on a spike
    end_step                      read the step loss; detector.update(step loss) makes the same     one
                                  comparison, so the same decision; spike_loss = a finite spike's

A non-finite step counts as a spike in the detector's ``spikes`` (the rule's table) but stays DeepSpeed's to skip:
the trainer reports it as a non-finite step and does not roll back for it. The trainer learns what happened from
``engine.skipped_steps`` and one small all-reduce per step (the spike flag and loss travel from the last stage with
the stop flag); the step's logged loss is then the spike's (the largest over the last stages), not the NaN that
skipped it. Under fp16 the NaN gradients also take DeepSpeed's overflow path: a skipped spike halves the dynamic
loss scale, as an overflow does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from common import deepspeed_internals as ds_internals
from runconfig.monitors import SpikeGuardConfig
from training.spikes import SpikeDetector


@dataclass
class SpikeGuard:
    """Lives in the loss function of the last pipeline stage (one per data-parallel replica), with its own detector.

    Active only from ``begin_step`` to ``end_step`` of a judged training step: evaluation (DeepSpeed's ``eval_batch``
    calls the same loss function) and the ignored start of warmup neither feed the detector nor are judged by it.
    Within a step the micro-batch losses are summed on the device; at the last one the comparison with the limit
    also runs on the device, and its outcome multiplies that loss by 1 or NaN. The host reads the step's mean loss
    once, in ``end_step``, after DeepSpeed's own read of the step's loss, and feeds it to the detector.
    """

    config: SpikeGuardConfig
    detector: SpikeDetector = field(init=False)
    """Fed the step losses of this replica (the mean of its micro-batch losses), judged steps only."""
    micro_batches: int = 0
    seen: int = 0
    spike_loss: float | None = None
    """After end_step: the step loss of a (finite) spike the guard skipped, else None."""
    active: bool = False
    _loss_sum: torch.Tensor | None = None  # on the device: the step's micro-batch losses so far
    _step_loss: torch.Tensor | None = None  # on the device, after the last micro-batch
    _limit: float | None = None

    def __post_init__(self) -> None:
        self.detector = SpikeDetector.of(self.config)

    def begin_step(self, micro_batches: int, ignore: bool = False) -> None:
        """``ignore``: the step is in the ignored start of warmup (training/spikes.py in_ignored_warmup)."""
        self.micro_batches, self.seen, self.spike_loss, self.active = micro_batches, 0, None, not ignore
        self._loss_sum = self._step_loss = None
        self._limit = self.detector.limit() if self.config.enabled else None

    def observe(self, loss: torch.Tensor) -> torch.Tensor:
        """Called with each micro-batch loss; returns it, or NaN x it at the last micro-batch of a spike."""
        if not self.active or self.seen >= self.micro_batches:
            return loss
        detached = loss.detach().float()
        self._loss_sum = detached.clone() if self._loss_sum is None else self._loss_sum + detached
        self.seen += 1
        if self.seen < self.micro_batches:
            return loss
        self._step_loss = self._loss_sum / self.seen  # as DeepSpeed averages the step's loss: the same bits
        if self._limit is None:  # disabled, or no EWM yet
            return loss
        # float64, as the host compares in end_step: a float32 comparison would round the limit first and could
        # disagree with the detector right at the limit. A non-finite step: NaN > limit is False, inf x NaN is NaN.
        spike = self._step_loss.double() > self._limit
        return loss * torch.where(spike, float("nan"), 1.0).to(loss.dtype)

    def end_step(self) -> None:
        """Close the step: one host read of the step loss, judged and fed by the detector."""
        self.active = False
        if self._step_loss is None:  # not the last stage, an ignored step, or the step did not finish
            return
        step_loss = self._step_loss.tolist()
        self._loss_sum = self._step_loss = None
        if self.detector.update(step_loss) and math.isfinite(step_loss):
            self.spike_loss = step_loss

    def state_dict(self) -> dict[str, Any]:
        return self.detector.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint of the window rule ({"history": [...]}) holds no EWM: the detector starts afresh."""
        self.detector.load_state_dict(state)


def attach_spike_guard(engine: Any, guard: SpikeGuard) -> None:
    """Route the pipeline's loss function through the guard (only the last stage computes a loss)."""
    def guarded(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def guarded_loss(outputs, labels):
            return guard.observe(loss_fn(outputs, labels))

        return guarded_loss

    ds_internals.wrap_loss(engine, guarded)
