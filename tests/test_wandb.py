"""Weights & Biases logging (training.wandb, training/wandb_sink.py), launched as users launch it: TP 2 x PP 2.

One offline run stopped at step 4 and resumed to step 8: W&B's offline run files, read back record by record, hold
TensorBoard's scalars step for step (the training metrics, the stability monitors, the evaluation, the committed
checkpoints), the run config, and the resumed half continues the same W&B run id with steps 5..8. One run with
``import wandb`` failing, as where the extra is not installed: one line says so and the run trains to its end.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from runconfig.run import parse_run_config
from tests.launch import run_training

pytest.importorskip("wandb", reason="the wandb extra: pip install '.[wandb]' (scripts/setup.sh installs it)")

WANDB = {"mode": "offline", "project": "mtnlg-tests", "name": "tp2-pp2", "group": "tests"}
EXTRA = [f"training.wandb={json.dumps(WANDB)}", "training.stability_interval=2", "training.eval_iters=1"]


def wandb_records(path: Path) -> list:
    """The records of a run-<id>.wandb file: W&B's log format (LevelDB's: 32 KiB blocks of chunks, each a 7-byte
    header of CRC32C, length and type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4) after a 7-byte ":W&B" header, each
    record a wandb_internal_pb2.Record. wandb 0.31 has no Python reader of its own (the Go core reads them)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    records, position, pending = [], 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (kind == 0 and length == 0):  # the block's zero padding
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(records: list) -> list[dict]:
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]
    return rows


def tensorboard_scalars(directory: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {(tag, event.step): event.value for tag in events.Tags()["scalars"] for event in events.Scalars(tag)}


@pytest.fixture(scope="module")
def resumed_run(corpus, tmp_path_factory):
    """Steps 1..4 (a checkpoint at 4), then a second launch resumes to 8: two offline W&B run directories."""
    save = tmp_path_factory.mktemp("wandb") / "checkpoints"
    first = run_training(corpus, save, max_steps=4, extra=EXTRA)
    second = run_training(corpus, save, max_steps=8, extra=EXTRA)
    return save, first.stdout + first.stderr, second.stdout + second.stderr


@pytest.mark.distributed
def test_offline_history_is_tensorboard_step_for_step_and_a_resume_continues_the_run(resumed_run):
    save, first, second = resumed_run
    runs = sorted((save / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    run_id = json.loads((save / "wandb-run.json").read_text())["id"]
    assert all(run.name.endswith(f"-{run_id}") for run in runs)  # one W&B run, in two offline directories
    assert f"W&B: offline, new run {run_id}" in first and f"W&B: offline, continues run {run_id}" in second
    records = [wandb_records(run / f"run-{run_id}.wandb") for run in runs]
    for part in records:  # finished: the exit record is written, so `wandb sync` takes the whole run
        assert part[-1].WhichOneof("record_type") == "exit" and part[-1].exit.exit_code == 0
    started = [next(r.run for r in part if r.WhichOneof("record_type") == "run") for part in records]
    assert [run.run_id for run in started] == [run_id, run_id]
    config = {item.key: json.loads(item.value_json) for item in started[0].config.update}
    assert config["parallelism"]["tensor_parallel_size"] == 2 and config["world_size"] == 4
    assert config["training"]["wandb"] == WANDB and config["train_batch_size"] == 16  # the whole run config

    halves = [history(part) for part in records]
    assert [row["_step"] for row in halves[0]] == [1, 2, 3, 4]
    assert [row["_step"] for row in halves[1]] == [5, 6, 7, 8]  # the step counter goes on across the resume
    logged = {}
    for row in halves[0] + halves[1]:
        for key, value in row.items():
            kind, _, name = key.partition("/")
            if name == "loss_vs_tokens":  # charted against the tokens, as TensorBoard's
                logged[(key, row[f"{kind}/consumed_tokens"])] = value
            elif not key.startswith("_"):
                logged[(key, row["_step"])] = value
    board = tensorboard_scalars(save / "tensorboard")
    assert logged.keys() == board.keys()
    assert all(np.float32(logged[key]) == board[key] for key in board)  # TensorBoard stores float32
    assert {step: value for (tag, step), value in logged.items() if tag == "checkpoint/committed_step"} in (
        {4: 4, 8: 8}, {5: 4, 8: 8})  # async: step 4's checkpoint may commit while step 5 runs
    tags = {tag for tag, _ in logged}
    assert {"train/loss", "train/lr", "train/grad_norm", "train/max_attention_logit", "train/log_z_mean",
            "train/attention_logit_per_layer/1", "valid/loss"} <= tags
    assert [step for tag, step in logged if tag == "train/max_attention_logit"] == [2, 4, 6, 8]


@pytest.mark.distributed
def test_without_wandb_installed_one_line_says_so_and_the_run_finishes(corpus, tmp_path, monkeypatch):
    hidden = tmp_path / "hide-wandb"
    hidden.mkdir()
    (hidden / "wandb.py").write_text("raise ImportError('wandb is hidden by tests/test_wandb.py')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")])))
    save = tmp_path / "checkpoints"
    result = run_training(corpus, save, max_steps=2, extra=[f"training.wandb={json.dumps(WANDB)}"])
    said = [line for line in result.stdout.splitlines() if "W&B" in line]
    assert said == ["W&B: not logging, wandb is not installed: pip install '.[wandb]' (or remove training.wandb)"]
    assert (save / "latest").read_text() == "global_step2" and not (save / "wandb").exists()


def test_online_without_a_login_says_so_in_one_line(tmp_path, monkeypatch):
    from runconfig.monitors import WandbConfig
    from training.wandb_sink import open_wandb

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    said = []
    assert open_wandb(WandbConfig(mode="online"), str(tmp_path), {}, False, said.append) is None
    assert len(said) == 1 and "training.wandb.mode is \"online\" but there is no W&B login" in said[0]


def test_every_sink_gets_the_same_scalars_and_is_closed_as_failed_on_the_error_path():
    from training.metrics_log import MetricsLogger

    class Sink:
        def __init__(self):
            self.written, self.closed = [], None

        def write(self, kind, step, scalars):
            self.written.append((kind, step, scalars))

        def close(self, failed=False):
            self.closed = failed

    raw = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / "tiny-cpu.json").read_text())
    raw["training"].pop("save"), raw["training"].pop("save_interval")  # no files: only the two sinks
    logger = MetricsLogger(parse_run_config(raw), is_writer=True)
    logger.sinks = [Sink(), Sink()]
    sinks = list(logger.sinks)
    logger.log("train", {"step": 3, "consumed_tokens": 96, "loss": 2.5, "lr": None, "per_layer": [1.0, 2.0],
                         "pipeline_schedule": "1f1b"})
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("a step failed")
        finally:
            logger.close()
    expected = [("train", 3, {"consumed_tokens": 96, "loss": 2.5, "per_layer/1": 1.0, "per_layer/2": 2.0})]
    assert [sink.written for sink in sinks] == [expected, expected] and [sink.closed for sink in sinks] == [True, True]


@pytest.mark.parametrize("value, message", [
    ({"mode": "shared"}, "training.wandb.mode must be \"online\", \"offline\" or \"disabled\", got 'shared'"),
    ({"projet": "x"}, "unknown key(s) ['projet'] in block \"training.wandb\""),
    ({"name": 3}, "training.wandb.name = 3 is an integer: expected a string or null"),
    ("offline", "training.wandb = \"offline\" is a string: expected an object {...} or null"),
])
def test_a_bad_wandb_block_is_refused_naming_the_field(value, message):
    raw = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / "tiny-cpu.json").read_text())
    raw["training"]["wandb"] = value
    with pytest.raises(ValueError) as error:
        parse_run_config(raw)
    assert message in str(error.value)
