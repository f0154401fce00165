"""model.mtp: DeepSeek-V3's multi-token prediction (its paper's section 2.2), depth and loss weight; model/mtp.py
builds the modules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from model.config.checks import is_positive_int, require, require_block


@dataclass(frozen=True)
class MTPConfig:
    """D sequential modules after the last block: module k combines the hidden state of depth k - 1 (the trunk's, for
    k = 1) with the embedding of token t+k and predicts token t+k+1 through the shared output head. The training
    objective adds loss_weight / D x the sum of the D depths' cross-entropies (the paper's L_MTP, eq. 25)."""

    depth: int = 1
    """D, the extra tokens predicted (DeepSeek-V3: 1; its checkpoint's num_nextn_predict_layers)."""
    loss_weight: float = 0.3
    """lambda, the MTP loss's weight from the first token (the paper: 0.3 for the first 10T tokens)."""
    loss_weight_changes: tuple[tuple[float, float], ...] = field(default_factory=tuple)
    """[[tokens, weight], ...] in increasing tokens: from a step that starts with at least that many tokens consumed,
    lambda is that weight (the paper: [[1e13, 0.1]]). ``weight_at`` reads it."""

    def __post_init__(self) -> None:
        require(is_positive_int(self.depth), f"model.mtp.depth must be a positive integer, got {self.depth!r}")
        changes = self.loss_weight_changes
        require(isinstance(changes, (list, tuple)) and all(
            isinstance(change, (list, tuple)) and len(change) == 2 for change in changes),
            f"model.mtp.loss_weight_changes must be a list of [tokens, weight] pairs (the paper: [[1e13, 0.1]]), "
            f"got {changes!r}")
        object.__setattr__(self, "loss_weight_changes", tuple((float(t), float(w)) for t, w in changes))
        for where, weight in [("loss_weight", self.loss_weight)] + [
                (f"loss_weight_changes[{i}]", w) for i, (_, w) in enumerate(self.loss_weight_changes)]:
            require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight >= 0,
                    f"model.mtp.{where}: the weight must be a non-negative number, got {weight!r}")
        tokens = [t for t, _ in self.loss_weight_changes]
        require(all(t >= 0 for t in tokens) and tokens == sorted(set(tokens)),
                f"model.mtp.loss_weight_changes: the token counts must be non-negative and increasing, got {tokens}")

    @classmethod
    def from_dict(cls, values: Any) -> MTPConfig:
        """model.mtp from its JSON object (a run config, or the run config saved in a checkpoint), or as given."""
        if isinstance(values, MTPConfig):
            return values
        require_block(values, "model.mtp", [f.name for f in dataclasses.fields(cls)],
                      "its fields (depth, loss_weight, loss_weight_changes)")
        return cls(**values)

    def weight_at(self, tokens: float) -> float:
        """lambda for a step that starts with ``tokens`` consumed (a step function of the tokens, as the batch
        ramp is: runconfig/schedules.py)."""
        weight = self.loss_weight
        for start, changed in self.loss_weight_changes:
            if tokens >= start:
                weight = changed
        return weight
