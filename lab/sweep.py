"""A sweep of short runs through the real trainer: one train.py launch per point of a grid (lab/grid.py).

The output directory:

    DIR/grid.yaml                 the grid file as given, for people
    DIR/sweep.json                the definition (grid, base config, processes per run, divergence rule): a rerun
                                  with another definition is refused
    DIR/runs/<name>/              the run's training.save: metrics.jsonl, train.log (its stdout and stderr),
                                  command.txt, TensorBoard's files, and result.json, written last and atomically
                                  (temporary file, rename); checkpoints deleted unless keep_checkpoints
    DIR/results.csv, report.md    lab/report.py

A run's life (``run_sweep``; ``parallel`` runs at a time):

    step     what                                                                      where
    launch   python -m deepspeed.launcher.launch (one node, TP x PP x DP processes)   a process group of its own,
             train.py --ds_config BASE --set ... --set training.save=DIR/runs/<name>  OMP_NUM_THREADS=1, in the cwd
    watch    every poll_s, the new "train" records of metrics.jsonl through the       DivergenceRule.judge
             divergence rule
    stop     the rule fires: SIGTERM to the group (the trainer checkpoints and        _stop
             exits), SIGKILL after stop_timeout_s
    end      result.json: diverged (the rule fires on the run's records), failed      _finish
             (a non-zero exit the sweep did not cause, or no record), else finished

Divergence rule: loss_0 is the first logged loss (the loss at initialisation when training.log_interval is 1: the
trainer logs the loss of a step's forward, before its update). A run diverges when a logged loss is not finite, or
when the loss stays above loss_0 + margin for ``patience`` consecutive logged steps.

Resume: a run with a result.json is done and is not launched again (delete its directory to rerun it); any other
run directory is deleted and the run starts from scratch.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

from common.deepspeed_internals import launcher_command
from common.files import write_json_atomically
from common.net import free_port
from lab.grid import Grid, GridError, RunSpec, load_grid, plan_runs, read_base

SCHEMA_VERSION = 1
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train.py"
LOG_TAIL_LINES = 30


# ------------------------------------------------------------------------------------------ watching and results


@dataclass(frozen=True)
class DivergenceRule:
    """Stop a run whose loss is not finite, or stays above loss_0 + margin for ``patience`` logged steps in a row."""

    patience: int = 20
    margin: float = 0.5

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise GridError(f"patience must be at least 1 logged step, got {self.patience}")
        if not self.margin >= 0:
            raise GridError(f"margin must be >= 0 (a loss above loss_0 + margin counts), got {self.margin}")

    def judge(self, records: Sequence[dict[str, Any]]) -> str | None:
        """Why the run diverged, or None. ``records``: the "train" records so far, in step order."""
        if not records:
            return None
        loss_0, above = records[0]["loss"], 0
        for record in records:
            loss = record["loss"]
            if loss is None or not math.isfinite(loss):
                return f"loss {loss} at step {record['step']}"
            above = above + 1 if loss > loss_0 + self.margin else 0
            if above >= self.patience:
                return (f"loss above loss_0 + margin = {loss_0:.4f} + {self.margin:g} for {self.patience} logged "
                        f"steps in a row, up to step {record['step']} (loss {loss:.4g})")
        return None


class MetricsTail:
    """The "train" records of a metrics.jsonl that is being written: complete lines only, the last of each step."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial, self.lines = path, 0, b"", 0
        self.by_step: dict[int, dict[str, Any]] = {}

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as stream:
                stream.seek(self.offset)
                chunk = stream.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            self.lines += 1
            try:
                record = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError as error:
                raise ValueError(f"{self.path}, line {self.lines}: not a JSON record ({error.msg})") from None
            if record.get("kind") == "train":
                self.by_step[record["step"]] = record
        return [self.by_step[step] for step in sorted(self.by_step)]


def read_train_records(path: str | Path) -> list[dict[str, Any]]:
    """A metrics.jsonl's "train" records (a torn last line, from a killed run, is left out)."""
    return MetricsTail(Path(path)).poll()


@dataclass
class RunResult:
    """One run's outcome: DIR/runs/<name>/result.json and a row of results.csv."""

    name: str
    point: dict[str, Any]
    status: str
    """finished, diverged or failed."""
    parameters: int
    tokens: int | None = None
    steps: int | None = None
    loss_0: float | None = None
    loss_0_step: int | None = None
    """The step of loss_0: 1 (the loss at initialisation) unless training.log_interval is larger."""
    final_loss: float | None = None
    min_loss: float | None = None
    diverged: bool = False
    spikes: int | None = None
    """The last logged cumulative count of loss spikes."""
    max_attention_logit: float | None = None
    min_log_z: float | None = None
    """The smallest log_z_min logged."""
    seconds: float = 0.0
    reason: str | None = None
    """Why it diverged or failed."""
    exit_code: int | None = None
    log_tail: str | None = None
    """The end of train.log, for a failed run."""
    schema_version: int = SCHEMA_VERSION


def summarise(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The RunResult fields a run's "train" records give; a monitor never logged leaves its field None."""
    if not records:
        return {}
    losses = [r["loss"] for r in records if r["loss"] is not None and math.isfinite(r["loss"])]

    def logged(key: str) -> list[Any]:
        return [r[key] for r in records if r.get(key) is not None]

    logits, log_z, spikes = logged("max_attention_logit"), logged("log_z_min"), logged("spikes")
    return {"tokens": records[-1].get("consumed_tokens"), "steps": records[-1]["step"], "loss_0": records[0]["loss"],
            "loss_0_step": records[0]["step"],
            "final_loss": records[-1]["loss"], "min_loss": min(losses) if losses else None,
            "spikes": spikes[-1] if spikes else None, "max_attention_logit": max(logits) if logits else None,
            "min_log_z": min(log_z) if log_z else None}


def read_result(run_dir: Path) -> RunResult | None:
    """The run's result.json, or None when it has none (or an unreadable one: the run is rerun)."""
    try:
        data = json.loads((run_dir / "result.json").read_text())
        return RunResult(**{f.name: data[f.name] for f in fields(RunResult) if f.name in data})
    except (OSError, ValueError, TypeError):
        return None


# ------------------------------------------------------------------------------------------------------ launching


def launch_command(spec: RunSpec, grid: Grid, port: int, slot: int = 0) -> list[str]:
    """What ``deepspeed --num_gpus N train.py ...`` starts on one node: DeepSpeed's per-node launcher. ``slot``: the
    run's place among those running at once; slot k gets devices k N .. k N + N - 1 (the launcher makes them the
    run's visible devices on GPUs), so runs side by side never share a GPU."""
    devices = list(range(slot * spec.world_size, (slot + 1) * spec.world_size))
    command = [*launcher_command(devices, port), str(TRAIN_SCRIPT), "--ds_config", grid.base]
    for item in spec.overrides:
        command += ["--set", item]
    return command


@dataclass
class RunningRun:
    spec: RunSpec
    run_dir: Path
    process: subprocess.Popen
    log: IO[bytes]
    started: float
    tail: MetricsTail
    slot: int = 0
    stop_reason: str | None = None
    kill_at: float | None = None


def _launch(spec: RunSpec, grid: Grid, output: Path, slot: int) -> RunningRun:
    run_dir = output / "runs" / spec.name
    run_dir.mkdir(parents=True)
    command = launch_command(spec, grid, free_port(), slot)
    (run_dir / "command.txt").write_text(" ".join(_quote(part) for part in command) + "\n")
    log = open(run_dir / "train.log", "wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return RunningRun(spec, run_dir, process, log, time.monotonic(), MetricsTail(run_dir / "metrics.jsonl"), slot)


def _quote(part: str) -> str:
    return part if re.fullmatch(r"[\w@%+=:,./-]+", part) else "'" + part.replace("'", "'\"'\"'") + "'"


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)  # the group the run's launcher leads (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(run: RunningRun, reason: str, stop_timeout_s: float) -> None:
    run.stop_reason = reason
    run.kill_at = time.monotonic() + stop_timeout_s
    _signal_group(run.process, signal.SIGTERM)


def _finish(run: RunningRun, rule: DivergenceRule, keep_checkpoints: bool) -> RunResult:
    """Judge the ended run from its complete records, write result.json (last), return it."""
    _signal_group(run.process, signal.SIGKILL)  # a rank the launcher left behind
    run.log.close()
    seconds = round(time.monotonic() - run.started, 3)
    records = run.tail.poll()
    reason = rule.judge(records) or run.stop_reason
    code = run.process.returncode
    if reason:
        status = "diverged"
    elif code != 0 or not records:
        status = "failed"
        reason = f"exit code {code}" if code != 0 else "no \"train\" record in metrics.jsonl"
    else:
        status = "finished"
    tail = None
    if status == "failed":
        lines = (run.run_dir / "train.log").read_text(errors="replace").splitlines()
        tail = "\n".join(lines[-LOG_TAIL_LINES:])
    result = RunResult(name=run.spec.name, point=run.spec.point, status=status, parameters=run.spec.parameters,
                       diverged=status == "diverged", seconds=seconds, reason=reason, exit_code=code, log_tail=tail,
                       **summarise(records))
    if not keep_checkpoints:
        remove_checkpoints(run.run_dir)
    write_json_atomically(run.run_dir / "result.json", asdict(result))
    return result


def remove_checkpoints(run_dir: Path) -> None:
    """The run's checkpoints (global_step<N>/, universal/, latest, DeepSpeed's zero_to_*.py beside them); the
    metrics, the log and TensorBoard's files stay."""
    from model.checkpoint_files import LATEST, UNIVERSAL

    for path in run_dir.iterdir():
        if path.is_dir() and (re.fullmatch(r"global_step\d+", path.name) or path.name == UNIVERSAL):
            shutil.rmtree(path)
        elif path.name == LATEST or re.fullmatch(r"zero_to_\w+\.py", path.name):
            path.unlink()


# ---------------------------------------------------------------------------------------------------- the sweep


@dataclass
class SweepOutcome:
    grid: Grid
    output: Path
    specs: list[RunSpec]
    rule: DivergenceRule
    results: list[RunResult]
    """In grid order."""
    launched: list[str] = field(default_factory=list)
    """The runs this call launched (a resumed sweep launches only the unfinished ones)."""


def prepare_output(output: Path, grid: Grid, specs: Sequence[RunSpec], settings: dict[str, Any]) -> None:
    """Store the sweep's definition in a new DIR, or check that an existing DIR holds the same sweep."""
    definition = {"schema_version": SCHEMA_VERSION, "grid": grid.definition(), "base_config": read_base(grid),
                  "runs": [{"name": s.name, "point": s.point, "world_size": s.world_size} for s in specs],
                  **settings}
    stored_path = output / "sweep.json"
    if stored_path.exists():
        stored = json.loads(stored_path.read_text())
        changed = [key for key in definition if key != "schema_version" and stored.get(key) != definition[key]]
        if changed:
            raise GridError(f"{output} holds another sweep ({stored_path} differs in: {', '.join(changed)}; "
                            f"{grid.path} or {grid.base} or the options changed): give a new --output, or delete "
                            f"{output} to start over")
        return
    output.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(grid.path, output / "grid.yaml")
    write_json_atomically(stored_path, definition)


def summary_line(result: RunResult) -> str:
    loss = "-" if result.final_loss is None else f"{result.final_loss:.4f}"
    why = f" ({result.reason})" if result.status != "finished" and result.reason else ""
    return (f"{result.name}: {result.status}, final loss {loss}, {result.steps or 0} steps, "
            f"{result.seconds:.1f} s{why}")


def run_sweep(grid_path: str | Path, output: str | Path, *, parallel: int = 1, rule: DivergenceRule | None = None,
              processes_per_run: int | None = None, keep_checkpoints: bool = False, progress: bool = True,
              poll_s: float = 0.2, stop_timeout_s: float = 60.0,
              on_result: Callable[[SweepOutcome], None] | None = None) -> SweepOutcome:
    """Check the whole grid, then run every unfinished run (``parallel`` at a time), watching for divergence.

    ``on_result`` is called after each run ends (the tool rewrites results.csv there). Ctrl-C stops the running
    runs (their directories, without result.json, are rerun next time) and re-raises.
    """
    from tqdm import tqdm

    if parallel < 1:
        raise GridError(f"parallel must be at least 1 run at a time, got {parallel}")
    rule = rule or DivergenceRule()
    output = Path(output).resolve()
    grid = load_grid(grid_path)
    specs = plan_runs(grid, output, processes_per_run)
    prepare_output(output, grid, specs, {"processes_per_run": processes_per_run, "rule": asdict(rule)})
    done = {spec.name: read_result(output / "runs" / spec.name) for spec in specs}
    outcome = SweepOutcome(grid, output, specs, rule, [])
    queue = [spec for spec in specs if done[spec.name] is None]
    for spec in queue:
        shutil.rmtree(output / "runs" / spec.name, ignore_errors=True)  # an interrupted run starts from scratch
    running: list[RunningRun] = []
    with tqdm(total=len(specs), initial=len(specs) - len(queue), desc="runs", unit="run", disable=not progress,
              file=sys.stderr) as bar:
        if len(queue) < len(specs):
            bar.write(f"{len(specs) - len(queue)} of {len(specs)} runs already have a result in {output}: skipped")
        try:
            while queue or running:
                while queue and len(running) < parallel:
                    slot = min(set(range(parallel)) - {run.slot for run in running})
                    running.append(_launch(queue.pop(0), grid, output, slot))
                    outcome.launched.append(running[-1].spec.name)
                time.sleep(poll_s)
                for run in _poll(running, rule, stop_timeout_s):
                    running.remove(run)
                    done[run.spec.name] = _finish(run, rule, keep_checkpoints)
                    bar.update(1)
                    bar.write(summary_line(done[run.spec.name]))
                    sys.stdout.flush()  # a line per run as it ends, also when stdout is a file
                    outcome.results = [done[s.name] for s in specs if done[s.name] is not None]
                    if on_result is not None:
                        on_result(outcome)
        except BaseException:
            for run in running:  # every run is told first, then all are waited for within one deadline
                _stop(run, "the sweep was interrupted", 0.0)
            deadline = time.monotonic() + stop_timeout_s
            try:
                for run in running:
                    _wait_group(run, max(deadline - time.monotonic(), 0.0))
            finally:  # a second interrupt while waiting still leaves no run behind
                for run in running:
                    _signal_group(run.process, signal.SIGKILL)
            raise
    outcome.results = [done[spec.name] for spec in specs]
    return outcome


def _poll(running: Sequence[RunningRun], rule: DivergenceRule, stop_timeout_s: float) -> list[RunningRun]:
    """Judge each running run's new records, stop the diverged ones, kill those past their stop deadline; return
    the runs whose launcher has exited."""
    ended = []
    for run in running:
        if run.stop_reason is None:
            reason = rule.judge(run.tail.poll())
            if reason is not None:
                _stop(run, reason, stop_timeout_s)
        elif run.kill_at is not None and time.monotonic() > run.kill_at:
            _signal_group(run.process, signal.SIGKILL)
        if run.process.poll() is not None:
            ended.append(run)
    return ended


def _wait_group(run: RunningRun, timeout_s: float) -> None:
    try:
        run.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(run.process, signal.SIGKILL)
        run.process.wait()
    _signal_group(run.process, signal.SIGKILL)
    run.log.close()
