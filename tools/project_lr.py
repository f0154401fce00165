#!/usr/bin/env python
"""Project the learning rate of a large run from a sweep of small ones: best LR per size, lr = a N^b, the target.

    python tools/project_lr.py --results runs/sweep/results.csv --target ds_configs/530b.json
    python tools/project_lr.py --results a.csv b.csv --by compute --target ds_configs/530b.json --plot lr.png
    python tools/project_lr.py --results runs/sweep/results.csv --where model.init_method_std=0.02

--results: the sweep's results.csv files, one row per run. Columns read here:
    schedule.lr    the run's peak learning rate
    parameters     N, the run's non-embedding parameters (lab.projection.non_embedding_parameters)
    tokens         tokens trained (a diverged run stops early: a size's D is the most any of its runs trained)
    final_loss     the loss at the end of the run
    diverged       true/false: a diverged run (or one without a finite final_loss) has no loss
Every other column whose name holds a dot (model.hidden_size, training.seed, ...) is another swept config path.
Rows are grouped by size, the `parameters` column. Within a size every row must differ only in schedule.lr; where
another path varies too, choose one value of it with --where PATH=VALUE (repeatable; numbers compare as numbers).

Per size: the best learning rate, the vertex of a parabola in ln(lr) through the lowest loss and its neighbours,
or the grid's minimum when that is at the edge of the finite runs (then left out of the fit: extend the grid, or
pass --include-edges). Across sizes: lr = a x^b by least squares in logs, x = N (--by parameters) or C = 6 N D
(--by compute), with a bootstrap interval over the sizes. With --target, the projection at the target's x beside
its own schedule.lr, GPT-3's Table 2.1 fit at its N and DeepSeek LLM's law at its C = M D. The formulas and the
references: lab/projection.py. Results on stdout; exit status 1 with the reason on stderr for invalid input.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections import defaultdict
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

LR_COLUMN = "schedule.lr"
REQUIRED_COLUMNS = (LR_COLUMN, "parameters", "tokens", "final_loss", "diverged")
BOOLEANS = {"true": True, "1": True, "false": False, "0": False}
LEVEL = 0.9


@dataclass(frozen=True)
class Run:
    where: str
    """"FILE line K": where the row came from, for messages."""
    lr: float
    parameters: float
    tokens: float
    loss: float | None
    """The final loss; None for a diverged run."""
    axes: dict[str, str]
    """The row's other swept config paths (columns with a dot, schedule.lr aside) and their values, as written."""


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


# ------------------------------------------------------------------------------------------------ reading


def _number(text: str, column: str, where: str, *, zero_allowed: bool = False) -> float:
    """A positive (or, with zero_allowed, non-negative) finite number from a cell."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
        kind = "a non-negative" if zero_allowed else "a positive"
        raise ValueError(f"{where}: column {column} is {text!r}, expected {kind} number")
    return value


def _run(row: dict[str, str | None], where: str) -> Run:
    cells = {column: (value or "").strip() for column, value in row.items() if column}  # a short row: None cells
    flag = cells["diverged"].lower()
    if flag not in BOOLEANS:
        raise ValueError(f"{where}: column diverged is {cells['diverged']!r}, expected true or false")
    try:
        loss = float(cells["final_loss"] or "nan")  # an empty cell, nan or inf: the run has no loss
    except ValueError:
        message = f"{where}: column final_loss is {cells['final_loss']!r}, expected a number (or nothing)"
        raise ValueError(message) from None
    axes = {column: value for column, value in cells.items() if "." in column and column != LR_COLUMN}
    return Run(where, _number(cells[LR_COLUMN], LR_COLUMN, where), _number(cells["parameters"], "parameters", where),
               _number(cells["tokens"], "tokens", where, zero_allowed=True),
               None if BOOLEANS[flag] or not math.isfinite(loss) else loss, axes)


def read_results(path: str | Path) -> list[Run]:
    """The runs of one results.csv, or a ValueError naming the file and the column or line."""
    path = Path(path)
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{path}: no column {', '.join(missing)} (it has {', '.join(reader.fieldnames or [])})"
                                 f": give the results.csv the sweep wrote, with {', '.join(REQUIRED_COLUMNS)}")
            # a run that crashed (status "failed") says nothing about its learning rate: left out
            runs = [_run(row, f"{path} line {reader.line_num}") for row in reader
                    if (row.get("status") or "").strip() != "failed"]
    except FileNotFoundError:
        raise ValueError(f"results file {path} does not exist") from None
    if not runs:
        raise ValueError(f"{path}: no runs (a header and no rows)")
    return runs


def parse_where(filters: list[str]) -> dict[str, str]:
    """["model.init_method_std=0.02"] -> {"model.init_method_std": "0.02"}."""
    parsed = {}
    for text in filters:
        path, sep, value = text.partition("=")
        if not sep or not path:
            raise ValueError(f"--where {text!r}: expected PATH=VALUE, e.g. model.init_method_std=0.02")
        parsed[path] = value
    return parsed


def _canonical(value: str) -> str:
    """One spelling per value: 0.01, 1e-2 and 1.0E-2 are one learning rate; text is compared as written."""
    try:
        return repr(float(value))
    except ValueError:
        return value.strip()


def select(runs: list[Run], where: dict[str, str], files: str) -> list[Run]:
    """The runs whose swept paths equal every --where value."""
    columns = {path for run in runs for path in run.axes}
    for path in where:
        if path not in columns:
            raise ValueError(f"--where {path}: no such column in {files} (swept paths besides {LR_COLUMN}: "
                             f"{', '.join(sorted(columns)) or 'none'})")
    kept = [run for run in runs if all(_canonical(run.axes.get(p, "")) == _canonical(v) for p, v in where.items())]
    if not kept:
        raise ValueError(f"no run of {files} has {', '.join(f'{p}={v}' for p, v in where.items())}")
    return kept


# ------------------------------------------------------------------------------------------------ per size


def _check_one_axis(parameters: float, runs: list[Run]) -> None:
    """Every run of one size differs only in schedule.lr, at most one run per learning rate."""
    varying = {}  # path -> {canonical value: the first run with it}
    for path in sorted({path for run in runs for path in run.axes}):
        examples = {}
        for run in runs:
            examples.setdefault(_canonical(run.axes.get(path, "")), run)
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
            values.setdefault(_canonical(run.axes.get(path, "")), run)  # the first run with each value
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
    from training.config import load_run_config  # imports torch: only with --target

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


# ------------------------------------------------------------------------------------------------ the program


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", required=True, metavar="CSV", help="the sweep's results.csv files")
    parser.add_argument("--by", choices=("parameters", "compute"), default="parameters",
                        help="fit lr against N, the non-embedding parameters (default), or C = 6 N D")
    parser.add_argument("--where", action="append", default=[], metavar="PATH=VALUE",
                        help="keep only the runs with this value of a swept config path (repeatable)")
    parser.add_argument("--include-edges", action="store_true",
                        help="fit the sizes whose best learning rate is at the edge of the grid too")
    parser.add_argument("--target", metavar="CONFIG", help="a run config, e.g. ds_configs/530b.json: project the "
                        "learning rate to its size and compare it with its schedule.lr")
    parser.add_argument("--set", action="append", default=[], metavar="BLOCK.FIELD=VALUE",
                        help="override a field of the --target config")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the sizes, the fit, GPT-3's table and the target")
    parser.add_argument("--samples", type=int, default=1000, help="bootstrap resamples (1000)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (0)")
    return parser


def project(args: argparse.Namespace) -> str:
    """The whole report, or a ValueError naming the file, the column or the row."""
    files = ", ".join(args.results)
    runs = select([run for path in args.results for run in read_results(path)], parse_where(args.where), files)
    sizes = best_per_size(runs, args.by)
    used = fitted_sizes(sizes, args.include_edges, files)
    target = load_target(args.target, args.set) if args.target else None
    x, lr = [s.x for s in used], [s.best.lr for s in used]
    a, b = fit_power_law(x, lr)
    # without a target the prediction interval is at the largest size, and not printed
    spread = bootstrap(x, lr, target_x(target, args.by) if target else x[-1], args.samples, args.seed, LEVEL)
    parts = [format_sizes(sizes, used, files), format_fit(a, b, spread, used, args.by)]
    if target is not None:
        parts.append(format_projection(target, args.by, a, b, spread))
    if args.plot:
        plot(args.plot, sizes, used, args.by, (a, b), spread, target)
        parts.append(f"plot: {args.plot}")
    return "\n\n".join([*parts, f"note: {CONSTANTS_DO_NOT_CARRY_OVER}"])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(project(args))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
