"""Tokens per parameter and the compute-optimal size for the run's compute, whatever the cluster.

    and times the training with that ramp.

Tokens per parameter and the compute-optimal size (config-level, whatever the cluster)
    N = ParameterCounts.total (embeddings included, as Hoffmann et al. count), D = schedule.train_tokens, C = 6 N D.
    For that C: Hoffmann et al. 2022 (arXiv:2203.15556) approach 3, L(N, D) = E + A / N^alpha + B / D^beta with
    E = 1.69, A = 406.4, B = 410.7, alpha = 0.34, beta = 0.28 (section 3.3), minimised along 6 N D = C:
    N_opt = G (C/6)^a, D_opt = G^-1 (C/6)^b, a = beta / (alpha + beta), b = alpha / (alpha + beta),
    G = (alpha A / (beta B))^(1 / (alpha + beta)); and the rule of thumb of 20 tokens per parameter (Chinchilla
    itself, 70B on 1.4T tokens; approaches 1 and 2): N = sqrt(C / 120), D = 20 N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.memory import ParameterCounts
from runconfig.run import RunConfig


@dataclass(frozen=True)
class ScalingLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta: the loss of N parameters trained on D tokens."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float


CHINCHILLA = ScalingLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
"""Hoffmann et al. 2022 (arXiv:2203.15556), approach 3 (section 3.3), as published. Besiroglu et al. 2024
(arXiv:2404.10102) find these rounded values biased away from the paper's approaches 1 and 2, which give about 20
tokens per parameter: the planner prints that rule beside it."""


@dataclass(frozen=True)
class Allocation:
    """A model size and the tokens it is trained on."""

    parameters: float
    tokens: float
    tokens_per_parameter: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens_per_parameter", self.tokens / self.parameters)


def training_flops_6nd(parameters: float, tokens: float) -> float:
    """C = 6 N D, the budget the scaling laws are fitted in (the planner's hardware FLOPs also count attention and
    recompute: not comparable)."""
    return 6.0 * parameters * tokens


def chinchilla_optimal(flops: float, law: ScalingLaw = CHINCHILLA) -> Allocation:
    """The N and D minimising L(N, D) along 6 N D = C, Hoffmann et al.'s closed form: dL/dN = 0 with
    D = C / (6 N) gives N^(alpha + beta) = (alpha A / (beta B)) (C/6)^beta, so N = G (C/6)^a, D = G^-1 (C/6)^b."""
    exponents = law.alpha + law.beta
    g = (law.alpha * law.A / (law.beta * law.B)) ** (1.0 / exponents)
    budget = flops / 6.0
    return Allocation(g * budget ** (law.beta / exponents), budget ** (law.alpha / exponents) / g)


def twenty_tokens_per_parameter(flops: float) -> Allocation:
    """D = 20 N at C = 6 N D = 120 N^2: N = sqrt(C / 120)."""
    parameters = math.sqrt(flops / 120.0)
    return Allocation(parameters, 20.0 * parameters)


@dataclass(frozen=True)
class ComputeOptimal:
    """The run's tokens per parameter, and what its training compute would buy compute-optimally."""

    flops: float
    """C = 6 N D of the run."""
    run: Allocation
    """N = ParameterCounts.total (embeddings included, as Hoffmann et al. count), D = schedule.train_tokens."""
    chinchilla: Allocation
    """Hoffmann et al.'s approach-3 fit (CHINCHILLA) at that C."""
    twenty_tokens_per_parameter: Allocation
    """The rule of thumb at that C."""
    law: ScalingLaw = CHINCHILLA


def compute_optimal(config: RunConfig, parameters: ParameterCounts) -> ComputeOptimal:
    run = Allocation(parameters.total, config.schedule.train_tokens)
    flops = training_flops_6nd(run.parameters, run.tokens)
    return ComputeOptimal(flops, run, chinchilla_optimal(flops), twenty_tokens_per_parameter(flops))

