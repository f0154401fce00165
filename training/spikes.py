"""What a loss spike is: one rule, used by the training log (every run) and by the spike guard (training/guards.py).

A step's loss L_t (nats; the mean over the step's micro-batches) is judged against E_{t-1}, the exponentially
weighted mean of the losses fed before it:

    spike  <=>  L_t / E_{t-1} > r   and   L_t - E_{t-1} > d      <=>   L_t > limit_t = max(r E_{t-1}, E_{t-1} + d)
    E_t    =  E_{t-1} + alpha (L_t - E_{t-1}),   alpha = 2 / (span + 1) = 0.2         (the first fed loss: E = L)

(The equivalence holds for E > 0, which a cross-entropy's mean is.) r is ``ratio`` (default 1.2), d is
``min_increase_nats`` (default 0.3), both in ``training.spike_guard``: r sets the bar while the loss is high, d once it
is low (below d / (r - 1) = 1.5 nats with the defaults), where a 20% rise is a small absolute one. The span (9
steps) and the ignored start of warmup (10% of ``schedule.warmup_tokens``) are the rule's constants, below.

    the step                                judged   counted in ``spikes``   fed to the EWM
    ignored (starts in the first 10% of     no       no                      no
      warmup: tokens consumed before it
      < 0.1 x schedule.warmup_tokens)
    the first fed one (no EWM yet)          no       no                      yes: E = L
    ordinary (finite, L <= limit)           yes      no                      yes
    spike (finite, L > limit)               yes      yes                     no
    non-finite (inf, NaN)                   yes      yes                     no

The early losses fall from ln(vocabulary) within a few steps: no level to compare with, hence the ignored start. A
spike stays out of the EWM, so a run of spikes is judged against the level before them, not against each other. The
limit is one host number per step: the guard compares with it on the device, in float64, the same comparison as
``update`` makes on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runconfig.monitors import DEFAULT_MIN_INCREASE_NATS, DEFAULT_RATIO, SpikeGuardConfig

SPAN = 9
"""The EWM's span, in steps: alpha = 2 / (SPAN + 1) (pandas' ``ewm(span=...)``, adjust=False)."""
ALPHA = 2 / (SPAN + 1)
IGNORED_WARMUP_FRACTION = 0.1
"""Steps that start in this first fraction of ``schedule.warmup_tokens`` are neither judged nor fed."""


def in_ignored_warmup(consumed_tokens: float, warmup_tokens: float) -> bool:
    """Whether the step that starts after ``consumed_tokens`` tokens is in the ignored start of warmup."""
    return consumed_tokens < IGNORED_WARMUP_FRACTION * warmup_tokens


@dataclass
class SpikeDetector:
    """The rule of the module docstring, fed one step loss at a time (a host float)."""

    ratio: float = DEFAULT_RATIO
    """r: a spike is more than r x the EWM..."""
    min_increase_nats: float = DEFAULT_MIN_INCREASE_NATS
    """...and more than d nats above it."""
    ewm: float | None = None
    """E: the exponentially weighted mean of the losses fed so far; None before the first."""
    spikes: int = 0
    """Spikes (non-finite steps included) seen so far."""

    @classmethod
    def of(cls, guard: SpikeGuardConfig) -> SpikeDetector:
        """The rule of training.spike_guard's ratio and min_increase_nats."""
        return cls(ratio=guard.ratio, min_increase_nats=guard.min_increase_nats)

    def limit(self) -> float | None:
        """The loss above which the next step is a spike; None while there is no EWM (nothing is judged)."""
        if self.ewm is None:
            return None
        return max(self.ratio * self.ewm, self.ewm + self.min_increase_nats)

    def update(self, loss: float, ignore: bool = False) -> bool:
        """Judge the step's loss, then feed it to the EWM unless it is a spike; True for a spike. ``ignore``: the
        step is in the ignored start of warmup (``in_ignored_warmup``), nothing happens."""
        if ignore:
            return False
        limit = self.limit()
        if not math.isfinite(loss) or (limit is not None and loss > limit):
            self.spikes += 1
            return True
        self.ewm = loss if self.ewm is None else self.ewm + ALPHA * (loss - self.ewm)
        return False

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers (a checkpoint reads them back with torch.load(weights_only=True)); r and d are config."""
        return {"ewm": self.ewm, "spikes": self.spikes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """An empty state (a checkpoint from before this rule) starts afresh: no EWM, no spikes."""
        self.ewm = state.get("ewm")
        self.spikes = int(state.get("spikes", 0))
