"""The stability lab: sweeps of short runs through the real trainer, and what they say about the learning rate.

    module           concern
    sensitivity.py   LR sensitivity of one size (Wortsman et al. 2023): the mean loss lost over a grid of learning
                     rates, diverged runs counted at the loss at initialisation; the default grid
    projection.py    the best learning rate of each size (a parabola in ln lr), the power law lr = a N^b across
                     sizes (or a C^b), its bootstrap interval, the published references (GPT-3's Table 2.1,
                     DeepSeek LLM's law) and why their constants do not carry over
    results.py       results.csv: its columns (defined there once) and the reading of its rows
    projection_report.py  tools/project_lr.py's steps: sweep -> best LR per size -> the power law -> the target,
                     as text and a plot
    grid.py          the grid file (YAML): its axes, the runs' names, every run's config checked before any launch
    sweep.py         the grid of short runs through the real trainer: launching, watching, resume, divergence
    report.py        results.csv, report.md and the plots

tools/project_lr.py (a thin main() over lab.projection_report.project) reads the sweep's results.csv and projects
the learning rate to a run config's size.
"""

from lab.projection import (
    CONSTANTS_DO_NOT_CARRY_OVER,
    DEEPSEEK_LR_COEFFICIENT,
    DEEPSEEK_LR_EXPONENT,
    GPT3_LEARNING_RATES,
    GPT3_TRAIN_TOKENS,
    BestLearningRate,
    PowerLawBootstrap,
    best_learning_rate,
    bootstrap,
    deepseek_flops_per_token,
    deepseek_learning_rate,
    fit_power_law,
    gpt3_power_law,
    non_embedding_parameters,
)
from lab.sensitivity import DEFAULT_LR_GRID, capped_losses, lr_sensitivity

__all__ = [
    "CONSTANTS_DO_NOT_CARRY_OVER", "DEEPSEEK_LR_COEFFICIENT", "DEEPSEEK_LR_EXPONENT", "DEFAULT_LR_GRID",
    "GPT3_LEARNING_RATES", "GPT3_TRAIN_TOKENS", "BestLearningRate", "PowerLawBootstrap", "best_learning_rate",
    "bootstrap", "capped_losses", "deepseek_flops_per_token", "deepseek_learning_rate", "fit_power_law",
    "gpt3_power_law", "lr_sensitivity", "non_embedding_parameters",
]
