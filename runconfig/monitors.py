"""The blocks of ``training`` that configure a monitor or a guard, as typed dataclasses: what each field means and
which values are refused, without the code that runs them (training/profiling.py, training/wandb_sink.py,
training/guards.py and training/spikes.py, training/memory_snapshot.py), so that a config is read without torch.

    training.profile           ProfileConfig          torch profiler traces of chosen steps and ranks
    training.wandb             WandbConfig            Weights & Biases logging
    training.spike_guard       SpikeGuardConfig       the loss-spike rule and the guard that skips a spike's update
    training.memory_snapshot   MemorySnapshotConfig   CUDA allocator snapshots
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runconfig.fields import build_block

WANDB_MODES = ("online", "offline", "disabled")
DEFAULT_RATIO = 1.2
"""r of the spike rule (training/spikes.py): a spike is a step loss above r x the EWM of recent losses..."""
DEFAULT_MIN_INCREASE_NATS = 0.3
"""...and d nats above it."""
SNAPSHOT_STACKS = ("python", "all")


@dataclass(frozen=True)
class ProfileConfig:
    steps: list[int]
    """[first, last]: the 1-based optimizer steps profiled, both included."""
    ranks: list[int] | str = field(default_factory=lambda: [0])
    """The global ranks that profile, or "all"."""

    def __post_init__(self) -> None:
        steps = self.steps
        if (not isinstance(steps, list) or len(steps) != 2 or not all(isinstance(s, int) for s in steps)
                or not 1 <= steps[0] <= steps[1]):
            raise ValueError(f"training.profile.steps must be [first, last] with 1 <= first <= last (1-based steps, "
                             f"as logged), got {steps!r}")
        if self.ranks != "all" and (not isinstance(self.ranks, list) or not self.ranks
                                    or not all(isinstance(r, int) and r >= 0 for r in self.ranks)):
            raise ValueError(f"training.profile.ranks must be a list of global ranks or \"all\", got {self.ranks!r}")

    def profiles(self, rank: int) -> bool:
        return self.ranks == "all" or rank in self.ranks


@dataclass(frozen=True)
class WandbConfig:
    project: str | None = None
    """The W&B project (None: W&B's default, "uncategorized")."""
    name: str | None = None
    """The run's display name (None: W&B makes one up)."""
    group: str | None = None
    """Groups runs in the W&B UI (e.g. the runs of one model size)."""
    mode: str = "online"
    """"online": stream to the W&B server (needs `wandb login` or WANDB_API_KEY); "offline": write the run's files
    only, for `wandb sync` later; "disabled": no W&B."""
    dir: str | None = None
    """Where W&B writes its files, under ``wandb/`` (None: training.save, else the working directory)."""

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"training.wandb.mode must be \"online\", \"offline\" or \"disabled\", got {self.mode!r}")


RETIRED_KEYS = ("window", "threshold_std", "min_increase")
"""training.spike_guard keys of the window rule, replaced by ratio and min_increase_nats (no translation: another
rule)."""


@dataclass
class SpikeGuardConfig:
    enabled: bool = False
    """Off by default: a spike then trains like any other step (the log counts it all the same)."""
    ratio: float = DEFAULT_RATIO
    """r of the spike rule (training/spikes.py): a spike is a step loss above r x the EWM of recent losses..."""
    min_increase_nats: float = DEFAULT_MIN_INCREASE_NATS
    """...and d nats above it. Both apply to the log's spike count on every run, and to the guard when enabled."""
    rollback: bool = False
    """On a spike, also reload the latest checkpoint and skip the data from there to the spike (PaLM's practice)."""
    max_rollbacks: int = 10
    """Stop the run after this many rollbacks: spikes that come back are not a data problem."""

    def __post_init__(self) -> None:
        if self.max_rollbacks < 1:
            raise ValueError(f"training.spike_guard.max_rollbacks must be >= 1, got {self.max_rollbacks}")
        if not self.ratio > 1:
            raise ValueError(f"training.spike_guard.ratio must be > 1 (a spike is a loss above ratio x its recent "
                             f"mean), got {self.ratio}")
        if not self.min_increase_nats >= 0:
            raise ValueError(f"training.spike_guard.min_increase_nats must be >= 0, got {self.min_increase_nats}")

    @staticmethod
    def refuse_retired_keys(values: dict[str, Any]) -> None:
        """A block of the window rule (a run config from before, or one saved in a checkpoint) is refused, naming
        what replaced its keys."""
        retired = [key for key in RETIRED_KEYS if key in values]
        if retired:
            raise ValueError(
                f"training.spike_guard.{', '.join(retired)}: the window rule is gone; a spike is now a step loss "
                f"above max(ratio x EWM, EWM + min_increase_nats) of the recent losses (training/spikes.py). Remove "
                f"{', '.join(retired)} and set ratio (default {DEFAULT_RATIO}) and min_increase_nats (default "
                f"{DEFAULT_MIN_INCREASE_NATS}) if the defaults do not suit")


@dataclass(frozen=True)
class MemorySnapshotConfig:
    step: int | None = None
    """Dump a snapshot after this optimizer step (1-based, as logged); None: only on OOM."""
    on_oom: bool = True
    """Dump a snapshot when a step runs out of CUDA memory, then raise the error again."""
    stacks: str = "python"
    """"python": Python frames only (fast dumps); "all": C++ frames too."""
    max_entries: int = 100000
    """The most allocator events kept in the history."""

    def __post_init__(self) -> None:
        if self.step is not None and (isinstance(self.step, bool) or self.step < 1):
            raise ValueError(f"training.memory_snapshot.step must be a step >= 1 (1-based, as logged) or null, got "
                             f"{self.step!r}")
        if self.stacks not in SNAPSHOT_STACKS:
            raise ValueError(f"training.memory_snapshot.stacks must be \"python\" or \"all\", got {self.stacks!r}")
        if self.max_entries < 1:
            raise ValueError(f"training.memory_snapshot.max_entries must be >= 1, got {self.max_entries!r}")
        if self.step is None and not self.on_oom:
            raise ValueError("training.memory_snapshot has neither a step nor on_oom: it would never dump; set "
                             "training.memory_snapshot.step or on_oom true, or remove the block")


def snapshot_config(training: Any) -> MemorySnapshotConfig | None:
    """``training.memory_snapshot`` of a TrainingConfig, checked (None: off); a ValueError naming the field."""
    values = training.memory_snapshot
    if values is None:
        return None
    if not isinstance(values, dict):
        raise ValueError(f"training.memory_snapshot must be a dict like {{\"step\": 3}}, got {values!r}")
    if not training.save:
        raise ValueError("training.memory_snapshot writes its snapshots beside the checkpoints: set training.save")
    return build_block(MemorySnapshotConfig, "training.memory_snapshot", values)
