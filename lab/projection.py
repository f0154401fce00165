"""From a sweep of short runs to the learning rate of a larger model: best LR per size, power law, bootstrap.

    step                 what                                                         function
    best LR of a size    parabola L = c2 x^2 + c1 x + c0 in x = ln(eta) through the    best_learning_rate
                         lowest loss and its two neighbours; vertex eta* = exp(-c1 /
                         (2 c2)), L* = c0 - c1^2 / (4 c2). Diverged runs (no loss, NaN,
                         infinity) are left out. Not fitted, the grid's minimum
                         returned with the reason, when the minimum is at either end
                         of the finite points or the parabola does not open upward.
    power law            ln eta* = ln a + b ln x, least squares (x = N, non-embedding   fit_power_law
                         parameters, or C = 6 N D, training FLOPs)
    its uncertainty      resample the (x, eta*) points with replacement, refit; the     bootstrap
                         central `level` interval of b and of a x_target^b.
                         Resamples with fewer than 2 distinct x are skipped (no line)
    the target's N       L blocks + the final norm: what the sweep's `parameters`       non_embedding_parameters
                         column counts (Kaplan et al. 2020's N: no token or position
                         embeddings, no output head)

Published references (their constants belong to their recipes: see CONSTANTS_DO_NOT_CARRY_OVER):

    source                                   law                                           here
    GPT-3, Brown et al. 2020 (arXiv:2005.14165),  Table 2.1: eight sizes, 125M to 175B,      GPT3_LEARNING_RATES,
      Table 2.1                              all 300B tokens; fitted, eta = 0.132 N^-0.305  gpt3_power_law
                                             (N the paper's total parameter counts)
    DeepSeek LLM, DeepSeek-AI 2024           eta_opt = 0.3118 C^-0.125, C = M D, M = 72 l   deepseek_learning_rate,
      (arXiv:2401.02954), section 3.1        h^2 + 6 l h s non-embedding FLOPs per token   deepseek_flops_per_token
                                             (l layers, h hidden, s sequence), D tokens;
                                             C = 1e20 gives 9.86e-4
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from model.config import ModelConfig

CONSTANTS_DO_NOT_CARRY_OVER = (
    "A fitted constant belongs to the recipe it was fitted on (data, tokenizer, batch size, schedule, "
    "parametrisation and initialisation): GPT-3's and DeepSeek's values, and this sweep's own coefficient a, do not "
    "carry over to another recipe. Only the exponent (the shape: how fast the best learning rate falls with size) "
    "is informative across recipes.")

GPT3_LEARNING_RATES: tuple[tuple[float, float], ...] = (
    (125e6, 6.0e-4), (350e6, 3.0e-4), (760e6, 2.5e-4), (1.3e9, 2.0e-4),
    (2.7e9, 1.6e-4), (6.7e9, 1.2e-4), (13e9, 1.0e-4), (175e9, 0.6e-4),
)
"""(parameters, peak learning rate) of GPT-3's eight models: Brown et al. 2020, "Language Models are Few-Shot
Learners" (arXiv:2005.14165), Table 2.1, with the paper's parameter counts (embeddings included)."""
GPT3_TRAIN_TOKENS = 300e9
"""Every GPT-3 model was trained on 300B tokens (Brown et al. 2020, section 2.2): C = 6 N x 300e9."""

DEEPSEEK_LR_COEFFICIENT = 0.3118
DEEPSEEK_LR_EXPONENT = -0.125
"""DeepSeek LLM (DeepSeek-AI 2024, arXiv:2401.02954, section 3.1): eta_opt = 0.3118 C^-0.125, C in FLOPs."""


@dataclass(frozen=True)
class BestLearningRate:
    lr: float
    """The best learning rate: the parabola's vertex when fitted, else the lowest-loss learning rate of the grid."""
    loss: float
    """The loss there: the parabola's value at its vertex, or the grid minimum's own loss."""
    fitted: bool
    """True when ``lr`` is the vertex of the parabola; False when it is the grid's minimum (``reason`` says why)."""
    reason: str
    """How ``lr`` was found, in words."""


def _finite(loss: float | None) -> bool:
    return loss is not None and math.isfinite(loss)


def _finite_points(lrs: Sequence[float], losses: Sequence[float | None]) -> list[tuple[float, float]]:
    """(lr, loss) sorted by lr, diverged runs left out; a ValueError for a bad grid."""
    if len(lrs) != len(losses):
        raise ValueError(f"best_learning_rate got {len(lrs)} learning rates and {len(losses)} losses: give one "
                         f"loss per learning rate")
    if any(not (math.isfinite(lr) and lr > 0) for lr in lrs):
        raise ValueError(f"learning rates must be positive, got {list(lrs)}")
    if len(set(lrs)) != len(lrs):
        raise ValueError(f"a learning rate appears twice in {sorted(lrs)}: give one run per learning rate")
    points = sorted((lr, loss) for lr, loss in zip(lrs, losses, strict=True) if _finite(loss))
    if not points:
        raise ValueError(f"every run diverged (learning rates {sorted(lrs)}): no best learning rate; extend the "
                         f"grid downward")
    return points


def _edge_reason(points: list[tuple[float, float]], lrs: Sequence[float], lowest: int) -> str | None:
    """Why no parabola fits around the lowest loss, or None when it has a finite neighbour on each side."""
    lr = points[lowest][0]
    if lowest == 0:
        if lr == min(lrs):
            return f"the lowest loss is at the grid's smallest learning rate {lr:.3g}: extend the grid downward"
        return f"the lowest loss is at {lr:.3g}, and every smaller learning rate diverged"
    if lowest == len(points) - 1:
        if lr == max(lrs):
            return f"the lowest loss is at the grid's largest learning rate {lr:.3g}: extend the grid upward"
        return f"the lowest loss is at {lr:.3g}, next to a diverged run: the best value is at the edge of stability"
    return None


def best_learning_rate(lrs: Sequence[float], losses: Sequence[float | None]) -> BestLearningRate:
    """The best learning rate of one size from its sweep: the vertex of the parabola in ln(eta) through the lowest
    loss and its two finite neighbours; the grid's minimum, with the reason, where no such parabola opens upward."""
    points = _finite_points(lrs, losses)
    lowest = min(range(len(points)), key=lambda i: points[i][1])  # the first of equal minima
    grid_lr, grid_loss = points[lowest]
    reason = _edge_reason(points, lrs, lowest)
    if reason is not None:
        return BestLearningRate(grid_lr, grid_loss, fitted=False, reason=reason)
    low, high = points[lowest - 1][0], points[lowest + 1][0]
    skipped = [lr for lr, loss in zip(lrs, losses, strict=True) if low < lr < high and not _finite(loss)]
    if skipped:  # the bracket spans a diverged rate: the parabola would put the best value across it
        return BestLearningRate(grid_lr, grid_loss, fitted=False,
                                reason=f"the runs around {grid_lr:.3g} enclose the diverged {skipped[0]:.3g}: the grid "
                                       f"minimum")
    x = [math.log(lr) for lr, _ in points[lowest - 1:lowest + 2]]
    y = [loss for _, loss in points[lowest - 1:lowest + 2]]
    c2, c1, c0 = np.polyfit(x, y, 2)  # three points: the parabola through them
    if c2 <= 0:
        return BestLearningRate(grid_lr, grid_loss, fitted=False,
                                reason=f"the parabola around {grid_lr:.3g} does not open upward: the grid minimum")
    vertex = -c1 / (2 * c2)
    return BestLearningRate(float(math.exp(vertex)), float(c0 - c1 * c1 / (4 * c2)), fitted=True,
                            reason=f"parabola in ln(lr) through {points[lowest - 1][0]:.3g}, {grid_lr:.3g}, "
                                   f"{points[lowest + 1][0]:.3g}")


# ----------------------------------------------------------------------------------------------- the power law


def _log_points(x: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    log_x, log_y = np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float))
    if len(log_x) != len(log_y):
        raise ValueError(f"a power law needs one y per x, got {len(log_x)} x and {len(log_y)} y")
    if not (np.all(np.isfinite(log_x)) and np.all(np.isfinite(log_y))):
        raise ValueError(f"a power law needs positive finite x and y, got x={list(x)}, y={list(y)}")
    if len(set(log_x.tolist())) < 2:
        raise ValueError(f"a power law needs at least 2 distinct x, got {list(x)}: sweep at least 2 sizes")
    return log_x, log_y


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(a, b) of y = a x^b: least squares of ln y = ln a + b ln x."""
    log_x, log_y = _log_points(x, y)
    b, log_a = np.polyfit(log_x, log_y, 1)
    return float(math.exp(log_a)), float(b)


@dataclass(frozen=True, eq=False)
class PowerLawBootstrap:
    exponent: tuple[float, float]
    """The central ``level`` interval of b."""
    prediction: tuple[float, float]
    """The central ``level`` interval of a x^b at ``target_x``."""
    target_x: float
    level: float
    log_coefficients: np.ndarray
    """(resamples kept, 2): ln a and b of each resample's fit."""
    skipped: int
    """Resamples left out for having fewer than 2 distinct x."""

    def interval_at(self, x: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The central ``level`` interval of a x^b at each x: the bootstrap band of the fit."""
        return _prediction_interval(self.log_coefficients, x, self.level)


def _central(values: np.ndarray, level: float) -> np.ndarray:
    """The central ``level`` interval along the first axis: (2, ...) low and high."""
    tail = (1 - level) / 2
    return np.quantile(values, [tail, 1 - tail], axis=0)


def _prediction_interval(log_coefficients: np.ndarray, x: float | np.ndarray,
                         level: float) -> tuple[np.ndarray, np.ndarray]:
    log_x = np.log(np.atleast_1d(np.asarray(x, dtype=float)))
    predictions = np.exp(log_coefficients[:, :1] + log_coefficients[:, 1:] * log_x)  # (resamples, len(x))
    low, high = _central(predictions, level)
    return low, high


def bootstrap(x: Sequence[float], y: Sequence[float], target_x: float, samples: int = 1000, seed: int = 0,
              level: float = 0.9) -> PowerLawBootstrap:
    """Intervals of the exponent b and of the prediction a target_x^b, by resampling the (x, y) points with
    replacement ``samples`` times (seeded) and refitting each resample by least squares in logs."""
    if not 0 < level < 1:
        raise ValueError(f"level is the interval's probability, in (0, 1), got {level}")
    if samples < 1 or not target_x > 0:
        raise ValueError(f"bootstrap needs samples >= 1 and target_x > 0, got {samples} and {target_x}")
    log_x, log_y = _log_points(x, y)
    picks = np.random.default_rng(seed).integers(len(log_x), size=(samples, len(log_x)))
    rx, ry = log_x[picks], log_y[picks]  # (samples, points)
    kept = rx.max(axis=1) > rx.min(axis=1)
    rx, ry = rx[kept], ry[kept]
    if len(rx) == 0:
        raise ValueError(f"no resample of {len(log_x)} points had 2 distinct x: use more sizes or more samples")
    dx = rx - rx.mean(axis=1, keepdims=True)
    b = (dx * ry).sum(axis=1) / (dx * dx).sum(axis=1)
    log_a = ry.mean(axis=1) - b * rx.mean(axis=1)
    coefficients = np.stack([log_a, b], axis=1)
    exponent_low, exponent_high = _central(b, level)
    low, high = _prediction_interval(coefficients, target_x, level)
    return PowerLawBootstrap((float(exponent_low), float(exponent_high)), (float(low[0]), float(high[0])),
                             float(target_x), level, coefficients, skipped=int(samples - kept.sum()))


# ----------------------------------------------------------------------------------------------- the references


def gpt3_power_law() -> tuple[float, float]:
    """(a, b) of eta = a N^b fitted to GPT-3's Table 2.1: about (0.132, -0.305)."""
    parameters, lrs = zip(*GPT3_LEARNING_RATES, strict=True)
    return fit_power_law(parameters, lrs)


def deepseek_flops_per_token(num_layers: int, hidden_size: int, seq_length: int) -> float:
    """DeepSeek LLM's M, non-embedding FLOPs per token (forward and backward, attention included):
    72 l h^2 + 6 l h s."""
    return 72.0 * num_layers * hidden_size**2 + 6.0 * num_layers * hidden_size * seq_length


def deepseek_learning_rate(compute: float) -> float:
    """DeepSeek LLM's eta_opt = 0.3118 C^-0.125 at C = M D FLOPs."""
    if not compute > 0:
        raise ValueError(f"compute C = M D must be positive, got {compute}")
    return DEEPSEEK_LR_COEFFICIENT * compute**DEEPSEEK_LR_EXPONENT


def non_embedding_parameters(model: ModelConfig) -> int:
    """N: the L transformer blocks and the final norm (model/summary.py's closed form at TP 1); no token or position
    embedding, no output head. The 530B recipe: 105 x 5,033,431,040 + 40,960 = 528,510,300,160."""
    from model.summary import analytic_layer_parameters  # imports torch: only when a model is counted

    final_norm = "FinalLayerNorm" if model.norm == "layernorm" else "FinalRMSNorm"
    return (model.num_layers * analytic_layer_parameters(model, "TransformerLayer", 1)
            + analytic_layer_parameters(model, final_norm, 1))
