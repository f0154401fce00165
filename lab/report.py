"""What a sweep found (lab/sweep.py): DIR/results.csv, DIR/report.md and its plots, beside each other.

    file                       what
    results.csv                one row per run, in grid order: a column per axis (named by its path), then
                               RESULT_COLUMNS (lab/results.py: the columns and their meaning)
    report.md                  the grid, the LR sensitivity per configuration, the runs, the loss spikes, and the
                               end of each failed run's log
    final_loss_vs_lr.png       final loss against schedule.lr (log x), one line per configuration; a diverged run is
                               an x at its configuration's loss_0
    loss.png                   the logged loss against step, one line per run (log y)
    max_attention_logit.png    the largest attention logit against step, one line per run (when the runs log it)

A configuration is the values of every axis except schedule.lr. Its loss_0 is the mean of its runs' loss_0, the
first logged loss (they share the seed, the model and the first batch: the values are equal unless the learning
rate changes the first forward, which it does not). Its LR sensitivity is lab.sensitivity.lr_sensitivity of its runs'
final losses, a diverged run counting as loss_0; failed runs are left out of it (a crash says nothing of the
learning rate).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.files import atomic_open
from lab.grid import LR_AXIS, format_value
from lab.results import RESULT_COLUMNS
from lab.sensitivity import lr_sensitivity
from lab.sweep import RunResult, SweepOutcome, read_train_records

FINAL_LOSS_PLOT = "final_loss_vs_lr.png"
LOSS_PLOT = "loss.png"
LOGIT_PLOT = "max_attention_logit.png"


def cell(value: Any) -> str:
    """A CSV cell: empty for None, true/false, floats as Python writes them (they read back exactly)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def result_rows(axes: Sequence[str], results: Sequence[RunResult]) -> list[dict[str, str]]:
    return [{**{axis: cell(result.point.get(axis)) for axis in axes},
             **{column: cell(getattr(result, column)) for column in RESULT_COLUMNS}} for result in results]


def write_results_csv(outcome: SweepOutcome) -> Path:
    """DIR/results.csv of the runs that have a result so far (all of them once the sweep is over)."""
    axes = list(outcome.grid.axes)
    path = outcome.output / "results.csv"
    with atomic_open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=[*axes, *RESULT_COLUMNS])
        writer.writeheader()
        writer.writerows(result_rows(axes, [r for r in outcome.results if r is not None]))
    return path


@dataclass
class Configuration:
    """The runs of one configuration (every axis but schedule.lr) and their LR sensitivity."""

    values: dict[str, Any]
    results: list[RunResult]
    loss_0: float | None
    sensitivity: float | None
    best: RunResult | None

    @property
    def label(self) -> str:
        return ", ".join(f"{path.split('.')[-1]}={format_value(v)}" for path, v in self.values.items()) or "all runs"


def configurations(outcome: SweepOutcome) -> list[Configuration]:
    """Group the runs by configuration, in grid order; the sensitivity where the grid has a schedule.lr axis."""
    groups: dict[str, list[RunResult]] = {}
    for result in outcome.results:
        values = {k: v for k, v in result.point.items() if k != LR_AXIS}
        groups.setdefault(json.dumps(values), []).append(result)
    found = []
    for key, results in groups.items():
        counted = [r for r in results if r.status != "failed"]
        starts = [r.loss_0 for r in counted if r.loss_0 is not None and math.isfinite(r.loss_0)]
        loss_0 = sum(starts) / len(starts) if starts else None
        sensitivity = None
        if LR_AXIS in outcome.grid.axes and counted and loss_0 is not None and loss_0 > 0:
            sensitivity = lr_sensitivity([None if r.diverged else r.final_loss for r in counted], loss_0)
        finite = [r for r in counted if not r.diverged and r.final_loss is not None and math.isfinite(r.final_loss)]
        best = min(finite, key=lambda r: r.final_loss) if finite else None
        found.append(Configuration(json.loads(key), results, loss_0, sensitivity, best))
    return found


def _number(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def render_markdown(outcome: SweepOutcome, groups: Sequence[Configuration], plots: Sequence[str]) -> str:
    grid, results, rule = outcome.grid, outcome.results, outcome.rule
    counts = {status: sum(r.status == status for r in results) for status in ("finished", "diverged", "failed")}
    lines = [f"# Sweep {grid.path.name}", "",
             f"{len(results)} runs of `{grid.base}`: {counts['finished']} finished, {counts['diverged']} diverged, "
             f"{counts['failed']} failed. Divergence: a non-finite loss, or a loss above loss_0 + {rule.margin:g} "
             f"for {rule.patience} logged steps in a row (loss_0: the first logged loss). Results: "
             f"[results.csv](results.csv).", "", "## Grid", ""]
    shared = {**grid.settings, **({"data.blend": grid.data} if grid.data is not None else {})}
    lines += _table(["axis", "values"], [[f"`{a}`", ", ".join(format_value(v) for v in vs)]
                                         for a, vs in grid.axes.items()])
    lines += ["", "Every run: " + (", ".join(f"`{k}={format_value(v)}`" for k, v in shared.items()) or "the base"), ""]
    lines += ["## LR sensitivity", ""]
    if LR_AXIS not in grid.axes:
        lines += [f"The grid has no `{LR_AXIS}` axis: no sensitivity to compute.", ""]
    else:
        lines += ["Wortsman et al. 2023: the mean over the learning rates of min(final loss, loss_0) minus its "
                  "minimum; a diverged run counts as loss_0, failed runs are left out. loss_0 is the mean of the "
                  "configuration's runs' first logged losses (equal: same seed, model and first batch).", ""]
        lines += _table(["configuration", "parameters", "loss_0", "LR sensitivity", "runs", "diverged", "best lr",
                         "best final loss"],
                        [[g.label, f"{g.results[0].parameters:,}", _number(g.loss_0), _number(g.sensitivity),
                          str(len(g.results)), str(sum(r.diverged for r in g.results)),
                          format_value(g.best.point[LR_AXIS]) if g.best else "-",
                          _number(g.best.final_loss if g.best else None)] for g in groups])
        lines += [""]
    late = sorted({r.loss_0_step for r in results if r.loss_0_step not in (None, 1)})
    if late:
        lines += [f"Note: some runs logged their first loss at step {', '.join(map(str, late))}, not at step 1 "
                  f"(training.log_interval > 1): their loss_0 is not the loss at initialisation.", ""]
    lines += [f"![{name}]({name})" for name in plots] + ["", "## Runs", ""]
    lines += _table(["run", "status", "steps", "final loss", "min loss", "spikes", "max logit", "min log Z",
                     "seconds"],
                    [[r.name, r.status, str(r.steps or 0), _number(r.final_loss), _number(r.min_loss),
                      "-" if r.spikes is None else str(r.spikes), _number(r.max_attention_logit, ".3g"),
                      _number(r.min_log_z, ".3g"), f"{r.seconds:.1f}"] for r in results])
    lines += ["", "## Loss spikes", ""] + _spike_lines(results) + _failure_lines(results)
    return "\n".join(lines) + "\n"


def _spike_lines(results: Sequence[RunResult]) -> list[str]:
    if all(r.spikes is None for r in results):
        return ["The runs did not log a spike count (the trainer's stability monitors were off).", ""]
    spiking = [r for r in results if r.spikes]
    if not spiking:
        return ["No run logged a loss spike.", ""]
    return _table(["run", "spikes", "final loss", "status"],
                  [[r.name, str(r.spikes), _number(r.final_loss), r.status] for r in spiking]) + [""]


def _failure_lines(results: Sequence[RunResult]) -> list[str]:
    lines = []
    for r in results:
        if r.status == "failed":
            lines += [f"## Failed: {r.name}", "", f"{r.reason}; the end of `runs/{r.name}/train.log`:", "", "```",
                      r.log_tail or "", "```", ""]
    return lines


def plot_final_loss(path: Path, groups: Sequence[Configuration]) -> None:
    """Final loss against the learning rate, one line per configuration; diverged runs as x at loss_0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for group in groups:
        kept = sorted((r.point[LR_AXIS], r.final_loss) for r in group.results
                      if r.status == "finished" and r.final_loss is not None and math.isfinite(r.final_loss))
        line, = axis.plot([lr for lr, _ in kept], [loss for _, loss in kept], "o-", label=group.label)
        diverged = [r.point[LR_AXIS] for r in group.results if r.diverged]
        if diverged and group.loss_0 is not None:
            axis.plot(diverged, [group.loss_0] * len(diverged), "x", color=line.get_color(), ms=9)
    axis.set_xscale("log")
    axis.set_xlabel("learning rate (schedule.lr)")
    axis.set_ylabel("final loss")
    axis.set_title("final loss against learning rate (x: diverged, drawn at loss_0)", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_per_step(path: Path, runs: dict[str, list[dict[str, Any]]], key: str, label: str, log_y: bool) -> bool:
    """``key`` against step, one line per run that logged it (log y when asked and every value is positive); False
    (and no file) when no run logged it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {name: [(r["step"], r[key]) for r in records if r.get(key) is not None and math.isfinite(r[key])]
              for name, records in runs.items()}
    series = {name: points for name, points in series.items() if points}
    if not series:
        return False
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        axis.plot([step for step, _ in points], [value for _, value in points], label=name, lw=1)
    if log_y and all(value > 0 for points in series.values() for _, value in points):
        axis.set_yscale("log")
    axis.set_xlabel("step")
    axis.set_ylabel(label)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_report(outcome: SweepOutcome) -> Path:
    """results.csv, the plots and report.md in the sweep's directory; returns report.md's path."""
    write_results_csv(outcome)
    groups = configurations(outcome)
    plots = []
    if LR_AXIS in outcome.grid.axes:
        plot_final_loss(outcome.output / FINAL_LOSS_PLOT, groups)
        plots.append(FINAL_LOSS_PLOT)
    runs = {r.name: read_train_records(outcome.output / "runs" / r.name / "metrics.jsonl") for r in outcome.results}
    if plot_per_step(outcome.output / LOSS_PLOT, runs, "loss", "loss", log_y=True):
        plots.append(LOSS_PLOT)
    if plot_per_step(outcome.output / LOGIT_PLOT, runs, "max_attention_logit", "max attention logit", log_y=True):
        plots.append(LOGIT_PLOT)
    path = outcome.output / "report.md"
    path.write_text(render_markdown(outcome, groups, plots))
    return path
