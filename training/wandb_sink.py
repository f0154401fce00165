"""``training.wandb``: the logged scalars to Weights & Biases too, beside TensorBoard.

    {"project": "mtnlg", "name": "530b-1", "group": "530b", "mode": "online", "dir": null}

MetricsLogger (training/metrics_log.py) turns each record into its scalars once and hands them to each sink: the
TensorBoard writer there and WandbSink here, so W&B holds TensorBoard's scalars at TensorBoard's steps (``kind/name``,
e.g. ``train/loss``; ``train/loss_vs_tokens`` is charted against ``train/consumed_tokens``). Only the process that
writes TensorBoard, global rank 0, talks to W&B. The W&B run's config is the full run config, plus the world size and
data-parallel size.

Resuming: the run id is kept in ``<training.save>/wandb-run.json``. A run that resumes from a checkpoint in that
directory continues that W&B run (``wandb.init(id=..., resume="allow")``) at the checkpoint's step; a run that starts
from no checkpoint starts a new W&B run. W&B's steps only go up: steps it already holds (those after the checkpoint
of a run that was killed, or those retrained after a spike rollback) are not logged to it again; TensorBoard and
metrics.jsonl have them.

wandb is an optional extra (``pip install .[wandb]``). Without it, or in "online" mode without a W&B login, one line
says so and the run trains on without W&B. The run is finished at the end of training, on the error path too (exit
code 1), so that an offline run's files are complete (``wandb sync <dir>/wandb/offline-run-*`` uploads them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.files import write_json_atomically
from runconfig.monitors import WandbConfig

MODES = ("online", "offline", "disabled")
RUN_ID_FILE = "wandb-run.json"
"""In training.save: {"id": the W&B run id}, written by rank 0 when the W&B run starts."""


def read_run_id(save: str | Path) -> str | None:
    path = Path(save) / RUN_ID_FILE
    try:
        return json.loads(path.read_text())["id"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def open_wandb(config: WandbConfig, save: str | None, run_config: dict[str, Any], resumed: bool,
               info: Callable[[str], None]) -> WandbSink | None:
    """Start (or, ``resumed`` from a checkpoint in ``save``, continue) the W&B run; None, said in one line, when W&B
    cannot be used."""
    if config.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        info("W&B: not logging, wandb is not installed: pip install '.[wandb]' (or remove training.wandb)")
        return None
    run_id = read_run_id(save) if resumed and save else None
    try:
        if config.mode == "online" and not wandb.login(prompt=False, verify=False):
            info("W&B: not logging, training.wandb.mode is \"online\" but there is no W&B login: run `wandb login` or "
                 "set WANDB_API_KEY, or set training.wandb.mode to \"offline\" (and `wandb sync` later)")
            return None
        directory = Path(config.dir or save or ".")
        directory.mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=config.project, name=config.name, group=config.group, mode=config.mode,
                         dir=str(directory), id=run_id, resume="allow" if run_id else None, config=run_config,
                         settings=wandb.Settings(console="off", silent=True))
    except Exception as error:  # a bad key, no network: training goes on without W&B
        info(f"W&B: not logging, wandb.init failed ({type(error).__name__}: {error}); check training.wandb or set "
             f"its mode to \"offline\"")
        return None
    if save:
        write_json_atomically(Path(save) / RUN_ID_FILE, {"id": run.id})
    how = f"continues run {run.id}" if run_id else f"new run {run.id}"
    info(f"W&B: {config.mode}, {how}, files in {Path(run.dir).parent}")
    return WandbSink(wandb, run)


class WandbSink:
    """A MetricsLogger sink: one ``run.log`` per record, at the record's step."""

    def __init__(self, wandb: Any, run: Any) -> None:
        self.wandb, self.run = wandb, run
        self._by_tokens: set[str] = set()

    def write(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        values = {f"{kind}/{key}": value for key, value in scalars.items()}
        if "loss" in scalars and "consumed_tokens" in scalars:  # as TensorBoard's loss_vs_tokens
            if kind not in self._by_tokens:
                self.run.define_metric(f"{kind}/loss_vs_tokens", step_metric=f"{kind}/consumed_tokens")
                self._by_tokens.add(kind)
            values[f"{kind}/loss_vs_tokens"] = scalars["loss"]
        self.run.log(values, step=step)

    def close(self, failed: bool = False) -> None:
        """Finish the run (its offline files complete) and stop W&B's service process."""
        try:
            self.run.finish(exit_code=1 if failed else 0)
        finally:
            self.wandb.teardown()
