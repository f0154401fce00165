"""The learning-rate projection of tools/project_lr.py: a sweep's results.csv files -> best LR per size -> the power
law lr = a x^b -> the target's learning rate beside the published references, as text and a plot.

    step              what                                                                  function
    read, select      the runs of every results.csv (lab/results.py), those matching        read_results, select
                      every --where PATH=VALUE
    per size          rows grouped by `parameters`; within a size only schedule.lr may      best_per_size
                      vary, across sizes only the shape paths (SHAPE_PATHS); the best LR
                      of each (lab.projection.best_learning_rate); x = N, or C = 6 N D with
                      D the most tokens a run of the size trained
    fitted sizes      at least 2; those whose best LR is the grid's minimum at its edge     fitted_sizes
                      are left out unless include_edges
    the target        a run config: its N, D (schedule.train_tokens), schedule.lr and        load_target
                      DeepSeek's C = M D
    report            the sizes table, the fit and its bootstrap interval, the projection   project
                      beside GPT-3's Table 2.1 fit and DeepSeek LLM's law; the plot          plot

Every invalid input is a ValueError naming the file, the column or the row, and the fix.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lab.projection import (
    CONSTANTS_DO_NOT_CARRY_OVER,
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
from lab.results import LR_COLUMN, Run, canonical, parse_where, read_results, select

LEVEL = 0.9
"""The bootstrap intervals' probability."""
BY = ("parameters", "compute")
"""What the power law runs over: N, or C = 6 N D."""


@dataclass(frozen=True)
class Size:
    parameters: float
    x: float
    """What the fit runs over: N, or C = 6 N D with D the most tokens any run of the size trained."""
    runs: list[Run]
    best: BestLearningRate


@dataclass(frozen=True)
class Target:
    path: str
    parameters: int
    tokens: float
    lr: float
    deepseek_compute: float
    """DeepSeek's C = M D: M = 72 l h^2 + 6 l h s non-embedding FLOPs per token, D = schedule.train_tokens."""



# ------------------------------------------------------------------------------------------------ per size


def _check_one_axis(parameters: float, runs: list[Run]) -> None:
    """Every run of one size differs only in schedule.lr, at most one run per learning rate."""
    varying = {}  # path -> {canonical value: the first run with it}
    for path in sorted({path for run in runs for path in run.axes}):
        examples = {}
        for run in runs:
            examples.setdefault(canonical(run.axes.get(path, "")), run)
        if len(examples) > 1:
            varying[path] = examples
    if varying:
        path, examples = next(iter(varying.items()))
        shown = ", ".join(f"{run.axes.get(path, '')} ({run.where})" for run in examples.values())
        first = next(iter(examples.values())).axes.get(path, "")
        raise ValueError(f"the runs of parameters={parameters:g} differ in {', '.join(varying)} besides {LR_COLUMN} "
                         f"({path}: {shown}): choose one with --where {path}={first}")
    seen: dict[float, Run] = {}
    for run in runs:
        if run.lr in seen:
            raise ValueError(f"two runs at {LR_COLUMN}={run.lr:g} for parameters={parameters:g}: "
                             f"{seen[run.lr].where} and {run.where}; keep one (or tell them apart with a column)")
        seen[run.lr] = run


SHAPE_PATHS = ("model.hidden_size", "model.num_layers", "model.num_attention_heads", "model.num_key_value_heads",
               "model.ffn_hidden_size", "model.head_dim", "model.preset")
"""Swept paths that make a model size; any other swept path (besides schedule.lr) must be one value for the fit."""


def _check_sizes_share_the_recipe(runs: list[Run]) -> None:
    """Across sizes too, only the shape may differ: an option that changes the parameter count a little (qk_layernorm
    adds 2 d per block) would otherwise pass for another size."""
    for path in sorted({path for run in runs for path in run.axes} - set(SHAPE_PATHS)):
        values: dict[str, Run] = {}
        for run in runs:
            values.setdefault(canonical(run.axes.get(path, "")), run)  # the first run with each value
        if len(values) > 1:
            shown = ", ".join(f"{run.axes.get(path, '')} ({run.where})" for run in values.values())
            first = next(iter(values.values())).axes.get(path, "")
            raise ValueError(f"the runs differ in {path} ({shown}), which is not a model size: the fit is over "
                             f"sizes of one recipe; choose one with --where {path}={first}")


def best_per_size(runs: list[Run], by: str) -> list[Size]:
    """One Size per distinct `parameters`, smallest first."""
    _check_sizes_share_the_recipe(runs)
    groups: dict[float, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.parameters].append(run)
    sizes = []
    for parameters, group in sorted(groups.items()):
        _check_one_axis(parameters, group)
        best = best_learning_rate([run.lr for run in group], [run.loss for run in group])
        tokens = max(run.tokens for run in group)
        if by == "compute" and tokens <= 0:
            raise ValueError(f"--by compute: every run of parameters={parameters:g} has tokens 0 ({group[0].where})")
        sizes.append(Size(parameters, parameters if by == "parameters" else 6 * parameters * tokens, group, best))
    return sizes


def fitted_sizes(sizes: list[Size], include_edges: bool, files: str) -> list[Size]:
    """The sizes the power law runs over: at least 2, those whose best LR is inside the grid unless include_edges."""
    if len(sizes) < 2:
        found = ", ".join(f"{s.parameters:g}" for s in sizes)
        raise ValueError(f"{files}: {len(sizes)} size (parameters {found}): a power law needs at least 2 sizes; "
                         f"add sizes to the sweep (or give the results.csv of another one with --results)")
    used = sizes if include_edges else [s for s in sizes if s.best.fitted]
    if len(used) < 2:
        raise ValueError(f"only {len(used)} of {len(sizes)} sizes have their best learning rate inside the grid: "
                         f"extend the grid where the table says so, or pass --include-edges to fit the grid minima")
    return used


# ------------------------------------------------------------------------------------------------ the target


def load_target(path: str, overrides: list[str]) -> Target:
    from runconfig.run import load_run_config  # imports torch: only with --target

    config = load_run_config(path, overrides)
    model, tokens = config.model, config.schedule.train_tokens
    flops_per_token = deepseek_flops_per_token(model.num_layers, model.hidden_size, model.seq_length)
    return Target(path, non_embedding_parameters(model), tokens, config.schedule.lr, flops_per_token * tokens)


def target_x(target: Target, by: str) -> float:
    return target.parameters if by == "parameters" else 6 * target.parameters * target.tokens


# ------------------------------------------------------------------------------------------------ output


X_NAMES = {"parameters": ("N", "non-embedding parameters"), "compute": ("C", "6 N D, training FLOPs")}


def format_sizes(sizes: list[Size], used: list[Size], files: str) -> str:
    lines = [f"best learning rate per size ({files})",
             f"{'parameters':>12} {'runs':>5} {'diverged':>9} {'best lr':>10} {'loss':>8}   how"]
    for size in sizes:
        diverged = sum(run.loss is None for run in size.runs)
        how = ("fitted: " if size.best.fitted else "grid minimum: ") + size.best.reason
        if size not in used:
            how += " (left out of the fit)"
        lines.append(f"{size.parameters:>12.4g} {len(size.runs):>5} {diverged:>9} {size.best.lr:>10.3e} "
                     f"{size.best.loss:>8.4f}   {how}")
    return "\n".join(lines)


def format_fit(a: float, b: float, spread: PowerLawBootstrap, used: list[Size], by: str) -> str:
    symbol, meaning = X_NAMES[by]
    low, high = spread.exponent
    kept = len(spread.log_coefficients)
    fit = f"fit over {len(used)} sizes: lr = {a:.4g} {symbol}^{b:.4f}   ({symbol}: {meaning})\n"
    if len(used) < 3:  # every resample of two points that keeps both is the same line: no spread to report
        return fit + "  no bootstrap interval: two sizes give one line through them; sweep a third size for one"
    return (fit + f"  {LEVEL:.0%} bootstrap interval of the exponent: [{low:.4f}, {high:.4f}] ({kept} resamples of "
                  f"the sizes, {spread.skipped} with one size only skipped)")


def format_projection(target: Target, by: str, a: float, b: float, spread: PowerLawBootstrap) -> str:
    x = target_x(target, by)
    gpt3_a, gpt3_b = gpt3_power_law()
    projected, (low, high) = a * x**b, spread.prediction
    rows = [
        (f"this sweep's fit at {X_NAMES[by][0]} = {x:.4g}", projected,
         f"{LEVEL:.0%} interval [{low:.3e}, {high:.3e}]" if low < high else "no interval (two sizes)"),
        ("the recipe's own schedule.lr", target.lr, f"{target.lr / projected:.3g} x the projection"),
        (f"GPT-3's Table 2.1 fit at N = {target.parameters:.4g}", gpt3_a * target.parameters**gpt3_b,
         f"lr = {gpt3_a:.4g} N^{gpt3_b:.4f} (Brown et al. 2020; total parameters)"),
        (f"DeepSeek LLM at C = M D = {target.deepseek_compute:.4g}", deepseek_learning_rate(target.deepseek_compute),
         "lr = 0.3118 C^-0.125 (arXiv:2401.02954)"),
    ]
    lines = [f"projection to {target.path}: N = {target.parameters:,} non-embedding parameters, "
             f"D = {target.tokens:.4g} tokens (schedule.train_tokens)"]
    lines += [f"  {name:<44} {lr:>10.3e}   {note}" for name, lr, note in rows]
    return "\n".join(lines)


def plot(path: str, sizes: list[Size], used: list[Size], by: str, law: tuple[float, float],
         spread: PowerLawBootstrap, target: Target | None) -> None:
    """Best LR per size (filled: in the fit), the fit lr = a x^b and its bootstrap band, GPT-3's table (at C = 6 N
    x 300e9 with --by compute), the target's x, the projection there with its interval, and its own schedule.lr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(figsize=(7, 4.5))
    xs = [s.x for s in sizes] + ([target_x(target, by)] if target else [])
    line = np.geomspace(min(xs) / 2, max(xs) * 2, 200)
    low, high = spread.interval_at(line)
    axes.fill_between(line, low, high, alpha=0.25, label=f"{LEVEL:.0%} bootstrap band")
    axes.plot(line, law[0] * line ** law[1], label=f"fit: lr = {law[0]:.3g} x^{law[1]:.3f}")
    for size in sizes:
        axes.scatter(size.x, size.best.lr, color="C0", facecolors="C0" if size in used else "none")
    gpt3 = [(n if by == "parameters" else 6 * n * GPT3_TRAIN_TOKENS, lr) for n, lr in GPT3_LEARNING_RATES]
    axes.scatter(*zip(*gpt3, strict=True), marker="s", color="C2", label="GPT-3, Table 2.1")
    if target is not None:
        x = target_x(target, by)
        projected, (low, high) = law[0] * x ** law[1], spread.prediction
        axes.axvline(x, color="C3", linestyle=":", label=f"target {Path(target.path).name}")
        # the full fit's value may fall just outside the bootstrap's percentiles: no negative bar
        bars = [[max(projected - low, 0.0)], [max(high - projected, 0.0)]]
        axes.errorbar([x], [projected], yerr=bars, fmt="*", color="C3", capsize=3, label="projection")
        axes.scatter([x], [target.lr], marker="x", color="C3", label="its schedule.lr")
    axes.set(xscale="log", yscale="log", xlabel=", ".join(X_NAMES[by]), ylabel="best learning rate")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)



# ------------------------------------------------------------------------------------------------ the whole report


def project(results: Sequence[str | Path], *, by: str = "parameters", where: Sequence[str] = (),
            include_edges: bool = False, target: str | None = None, overrides: Sequence[str] = (),
            plot_path: str | None = None, samples: int = 1000, seed: int = 0) -> str:
    """The whole report of ``results`` (results.csv files), or a ValueError naming the file, the column or the row.
    ``where``: PATH=VALUE filters; ``target``: a run config to project to, with ``overrides`` (BLOCK.FIELD=VALUE)."""
    if by not in BY:
        raise ValueError(f"by is {by!r}: use one of {', '.join(BY)}")
    files = ", ".join(map(str, results))
    runs = select([run for path in results for run in read_results(path)], parse_where(list(where)), files)
    sizes = best_per_size(runs, by)
    used = fitted_sizes(sizes, include_edges, files)
    projected_to = load_target(target, list(overrides)) if target else None
    x, lr = [s.x for s in used], [s.best.lr for s in used]
    a, b = fit_power_law(x, lr)
    # without a target the prediction interval is at the largest size, and not printed
    spread = bootstrap(x, lr, target_x(projected_to, by) if projected_to else x[-1], samples, seed, LEVEL)
    parts = [format_sizes(sizes, used, files), format_fit(a, b, spread, used, by)]
    if projected_to is not None:
        parts.append(format_projection(projected_to, by, a, b, spread))
    if plot_path:
        plot(plot_path, sizes, used, by, (a, b), spread, projected_to)
        parts.append(f"plot: {plot_path}")
    return "\n\n".join([*parts, f"note: {CONSTANTS_DO_NOT_CARRY_OVER}"])
