"""Learning-rate sensitivity: how much of the loss a sweep loses by missing the best learning rate.

Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities" (arXiv:2309.14322),
section 3: for one model size and a grid of learning rates eta,

    sensitivity = E_eta [ min(L(eta), L_0) - min_eta' min(L(eta'), L_0) ]

    L(eta)   the final loss of the run at eta; a diverged run (no loss, NaN or infinity) counts as L_0
    L_0      the loss at initialisation (about ln V for a vocabulary of V), the cap: a run that ends worse than
             where it started is no worse than one that diverged
    E_eta    the mean over the grid, every learning rate weighted alike
    min      over the capped losses (the same numbers the mean runs over), so every term is >= 0

Example: L = (4.5, 4.0, 9.0) at three learning rates, L_0 = 7: capped (4.5, 4.0, 7.0), best 4.0, terms (0.5, 0, 3.0),
sensitivity 7/6 = 1.1667. Equal losses give 0; a grid of diverged runs gives 0 too (all capped to L_0): read it
beside the count of diverged runs. Lower is better: a recipe whose loss stays near its best over a wide band of
learning rates is stable under a mis-set learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_LR_GRID: tuple[float, ...] = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
"""Half-decade steps from 3e-4 to 3e-1, as in Wortsman et al.'s sweeps: wide enough that small models find their
best value inside it and large ones diverge at its top."""


def capped_losses(losses: Sequence[float | None], loss_0: float) -> list[float]:
    """min(L(eta), L_0) per run, a diverged run (None, NaN, infinity) as L_0."""
    if not losses:
        raise ValueError("lr_sensitivity needs the losses of at least one run, got none")
    if not (math.isfinite(loss_0) and loss_0 > 0):
        raise ValueError(f"loss_0, the loss at initialisation, must be a positive finite number (about ln V for a "
                         f"vocabulary of V, 10.8 for GPT-2's), got {loss_0}")
    return [loss_0 if loss is None or not math.isfinite(loss) else min(loss, loss_0) for loss in losses]


def lr_sensitivity(losses: Sequence[float | None], loss_0: float) -> float:
    """Wortsman et al.'s LR sensitivity of one size: the mean over the grid of min(L, L_0) minus its minimum.

    ``losses`` holds one final loss per learning rate of the grid (their order does not matter); None or a
    non-finite loss is a diverged run.
    """
    capped = capped_losses(losses, loss_0)
    best = min(capped)
    return sum(loss - best for loss in capped) / len(capped)
