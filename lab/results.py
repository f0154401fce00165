"""results.csv, the table a sweep writes (lab/report.py) and the learning-rate projection reads: its columns, defined
here once, and the reading of its rows.

One row per run, in grid order: a column per grid axis, named by its config path (schedule.lr, model.hidden_size,
...), then RESULT_COLUMNS; an empty cell where a run did not log the field.

    column                read by the projection   meaning
    parameters            yes                      N, the run's non-embedding parameters
                                                   (lab.projection.non_embedding_parameters)
    tokens                yes                      consumed tokens at the last logged step (a diverged run stops
                                                   early: a size's D is the most any of its runs trained)
    steps                                          optimizer steps at the last logged step
    loss_0                                         the first logged loss (at initialisation with log_interval 1)
    final_loss            yes                      the last logged loss
    min_loss                                       the smallest finite logged loss
    diverged              yes                      true/false: a diverged run (or one without a finite final_loss)
                                                   has no loss
    status                (failed rows skipped)    finished, diverged or failed
    spikes                                         the last logged cumulative count of loss spikes
    max_attention_logit                            the largest "max_attention_logit" logged
    min_log_z                                      the smallest "log_z_min" logged
    seconds                                        wall time from launch to exit

The projection also reads LR_COLUMN (schedule.lr, the run's peak learning rate), and every other column whose name
holds a dot is another swept config path (model.hidden_size, training.seed, ...).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

LR_COLUMN = "schedule.lr"
"""The learning-rate axis of a sweep and its column (lab.grid.LR_AXIS)."""
RESULT_COLUMNS = ("parameters", "tokens", "steps", "loss_0", "final_loss", "min_loss", "diverged", "status", "spikes",
                  "max_attention_logit", "min_log_z", "seconds")
"""After the axes, in this order: each is a field of lab.sweep.RunResult."""
PROJECTION_COLUMNS = (LR_COLUMN, "parameters", "tokens", "final_loss", "diverged")
"""The columns the projection needs (the table above)."""
BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


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
            missing = [c for c in PROJECTION_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{path}: no column {', '.join(missing)} (it has {', '.join(reader.fieldnames or [])})"
                                 f": give the results.csv the sweep wrote, with {', '.join(PROJECTION_COLUMNS)}")
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


def canonical(value: str) -> str:
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
    kept = [run for run in runs if all(canonical(run.axes.get(p, "")) == canonical(v) for p, v in where.items())]
    if not kept:
        raise ValueError(f"no run of {files} has {', '.join(f'{p}={v}' for p, v in where.items())}")
    return kept
