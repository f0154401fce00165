"""tools/sweep.py and lab/: one real sweep of two tiny runs through DeepSpeed's launcher, its resume, its grid checks.

The sweep (GRID below): the tiny GPT cut to 2 layers, sequence 32, batch 4 (one micro-batch), TP 1 x PP 1 on one
process per run, 24 steps, warmup over the first step, the loss logged every step, two learning rates:

    schedule.lr  what happens                                                                   expected
    1e-3         the loss falls from ln(50257) ~ 11.07                                          finished, 24 steps
    10           Adam's first update moves every weight by about the learning rate (m/sqrt(v)  diverged, stopped
                 is +-1 at step 1, whatever the gradient's size or clipping): weights of std    before step 24
                 0.02 become +-10, the logits hundreds, and the loss of step 2 is in the
                 thousands (2,672 on the CPU this was written on), far above loss_0 + 0.5.
                 With --patience 2 the rule fires at step 3; the sweep polls every 0.2 s and
                 stops the run within a step or two, long before step 24 (a step costs 20 ms or
                 more on one CPU thread: the 50,257-word head alone is over 1 GFLOP a step).

Three launches in all (about 10 s each on 2 cores): the two runs, then one rerun of a run whose result.json was
removed. The grid checks launch nothing.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from lab.grid import GridError, load_grid, plan_runs, run_names
from lab.report import write_report
from lab.results import RESULT_COLUMNS
from lab.sensitivity import lr_sensitivity
from lab.sweep import DivergenceRule, MetricsTail, read_result, run_sweep
from tools.sweep import main
from training.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "ds_configs" / "tiny-cpu.json"
MAX_STEPS = 24
PATIENCE = 2
GRID = """\
base: {base}
set: {{training.max_steps: {max_steps}, parallelism.tensor_parallel_size: 1, parallelism.pipeline_parallel_size: 1,
      model.num_layers: 2, model.seq_length: 32, train_batch_size: 4, schedule.batch: {{}},
      schedule.warmup_tokens: 128, training.log_interval: 1, training.eval_interval: 0, training.eval_iters: 0}}
grid:
  schedule.lr: [1e-3, 10]
data: {data}
"""
NAMES = ["lr=0.001", "lr=10"]


def non_embedding_parameters(layers: int = 2, hidden: int = 64) -> int:
    """GPT-2 blocks, 12 h^2 + 13 h each (QKV, output, 4h MLP, their biases, two LayerNorms), and the final
    LayerNorm's 2 h."""
    return layers * (12 * hidden**2 + 13 * hidden) + 2 * hidden


@pytest.fixture(scope="module")
def sweep(corpus, tmp_path_factory):
    """The grid file and the sweep's directory after `tools/sweep.py --parallel 2 --patience 2`."""
    directory = tmp_path_factory.mktemp("sweep")
    grid = directory / "grid.yaml"
    grid.write_text(GRID.format(base=BASE, max_steps=MAX_STEPS, data=corpus))
    output = directory / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DS_ACCELERATOR", "cpu")
        status = main(["--grid", str(grid), "--output", str(output), "--parallel", "2", "--patience", str(PATIENCE),
                       "--no-progress"])
    assert status == 0
    return grid, output


def csv_rows(output: Path) -> list[dict[str, str]]:
    with open(output / "results.csv", newline="") as stream:
        return list(csv.DictReader(stream))


def test_the_csv_says_what_each_runs_metrics_say(sweep):
    _, output = sweep
    rows = csv_rows(output)
    assert list(rows[0]) == ["schedule.lr", *RESULT_COLUMNS]
    assert [row["schedule.lr"] for row in rows] == ["0.001", "10"]  # grid order
    for name, row in zip(NAMES, rows, strict=True):
        records = read_metrics(output / "runs" / name / "metrics.jsonl")
        losses = [r["loss"] for r in records]
        assert float(row["loss_0"]) == losses[0]
        assert float(row["final_loss"]) == losses[-1]
        assert float(row["min_loss"]) == min(losses)
        assert int(row["steps"]) == records[-1]["step"] == len(records)  # logged every step, none twice
        assert int(row["tokens"]) == records[-1]["consumed_tokens"] == 4 * 32 * records[-1]["step"]
        assert int(row["parameters"]) == non_embedding_parameters() == 100_096
        assert float(row["seconds"]) > 0
        spikes = [r["spikes"] for r in records if r.get("spikes") is not None]
        assert row["spikes"] == (str(spikes[-1]) if spikes else "")
        assert not list((output / "runs" / name).glob("global_step*"))  # checkpoints deleted once judged
    assert rows[0]["loss_0"] == rows[1]["loss_0"]  # same seed, model and first batch: the LR acts after step 1
    assert abs(float(rows[0]["loss_0"]) - math.log(50257)) < 0.5


def test_the_high_learning_rate_is_stopped_as_diverged(sweep):
    _, output = sweep
    stable, high = csv_rows(output)
    assert (stable["status"], stable["diverged"], int(stable["steps"])) == ("finished", "false", MAX_STEPS)
    assert float(stable["final_loss"]) < float(stable["loss_0"]) - 0.3
    assert (high["status"], high["diverged"]) == ("diverged", "true")
    assert PATIENCE + 1 <= int(high["steps"]) < MAX_STEPS
    losses = [r["loss"] for r in read_metrics(output / "runs/lr=10/metrics.jsonl")]
    assert all(loss > losses[0] + 0.5 for loss in losses[1:PATIENCE + 1])  # the rule's two steps in a row
    result = read_result(output / "runs/lr=10")
    assert "for 2 logged steps in a row, up to step 3" in result.reason


def test_the_report_gives_the_sensitivity_of_the_csv_numbers(sweep):
    _, output = sweep
    stable, high = csv_rows(output)
    loss_0 = (float(stable["loss_0"]) + float(high["loss_0"])) / 2
    sensitivity = lr_sensitivity([float(stable["final_loss"]), None], loss_0)  # the diverged run counts as loss_0
    assert sensitivity == pytest.approx((loss_0 - float(stable["final_loss"])) / 2)
    report = (output / "report.md").read_text()
    assert f"| all runs | 100,096 | {loss_0:.4f} | {sensitivity:.4f} | 2 | 1 | 0.001 |" in report
    for plot in ("final_loss_vs_lr.png", "loss.png"):
        assert f"]({plot})" in report
        assert (output / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rerun_launches_nothing_and_an_unfinished_run_starts_again(sweep):
    grid, output = sweep
    before = {name: (output / "runs" / name / "result.json").stat().st_mtime_ns for name in NAMES}
    csv_before = (output / "results.csv").read_text()
    rule = DivergenceRule(patience=PATIENCE)
    outcome = run_sweep(grid, output, parallel=2, rule=rule, progress=False)
    write_report(outcome)
    assert outcome.launched == []
    assert {name: (output / "runs" / name / "result.json").stat().st_mtime_ns for name in NAMES} == before
    assert (output / "results.csv").read_text() == csv_before

    # an interrupted run: a directory without result.json is deleted and run again, from step 1
    first = read_result(output / "runs/lr=0.001")
    (output / "runs/lr=0.001/result.json").unlink()
    (output / "runs/lr=0.001/left-over").write_text("from the interrupted run")
    outcome = run_sweep(grid, output, parallel=2, rule=rule, progress=False)
    assert outcome.launched == ["lr=0.001"]
    assert not (output / "runs/lr=0.001/left-over").exists()
    assert [r["step"] for r in read_metrics(output / "runs/lr=0.001/metrics.jsonl")] == list(range(1, MAX_STEPS + 1))
    again = outcome.results[0]
    assert (again.status, again.steps, again.final_loss) == (first.status, first.steps, first.final_loss)  # fp32 CPU
    assert (output / "runs/lr=10/result.json").stat().st_mtime_ns == before["lr=10"]


def test_a_changed_grid_or_rule_is_refused_for_an_existing_sweep(sweep, tmp_path):
    grid, output = sweep
    changed = tmp_path / "changed.yaml"
    changed.write_text(grid.read_text().replace("[1e-3, 10]", "[1e-3, 1e-2, 10]"))
    with pytest.raises(GridError, match=r"holds another sweep .*differs in: grid, runs.*give a new --output"):
        run_sweep(changed, output, rule=DivergenceRule(patience=PATIENCE), progress=False)
    with pytest.raises(GridError, match=r"differs in: rule"):
        run_sweep(grid, output, rule=DivergenceRule(patience=5), progress=False)


# ------------------------------------------------------------------------------------ grid errors (nothing runs)


def grid_error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(GridError) as error:
        plan_runs(load_grid(path), tmp_path / "out")
    assert str(path) in str(error.value)
    return str(error.value)


def test_an_unknown_field_is_refused_with_the_projects_message_and_the_point(tmp_path):
    message = grid_error(tmp_path, f"base: {BASE}\ngrid:\n  schedule.lrr: [1, 2]\n")
    assert "run 1 of 2 (schedule.lrr=1)" in message
    assert "unknown key(s) ['lrr'] in block \"schedule\"" in message


def test_an_impossible_combination_is_refused_before_anything_runs(tmp_path):
    message = grid_error(tmp_path, f"base: {BASE}\ngrid:\n  parallelism.tensor_parallel_size: [3]\n")
    assert "run 1 of 1 (parallelism.tensor_parallel_size=3)" in message
    assert "model.num_attention_heads (4) is not divisible by parallelism.tensor_parallel_size (3)" in message


def test_a_path_outside_the_run_config_is_refused(tmp_path):
    message = grid_error(tmp_path, f"base: {BASE}\ngrid:\n  sheduler.lr: [1, 2]\n")
    assert "sheduler.lr is not a field of the run config" in message


def test_an_axis_that_is_not_a_list_names_its_line(tmp_path):
    message = grid_error(tmp_path, f"base: {BASE}\ngrid:\n  schedule.lr: 0.001\n")
    assert "line 3" in message and "axis schedule.lr must be a non-empty list of values" in message


def test_malformed_yaml_names_its_line(tmp_path):
    message = grid_error(tmp_path, f"base: {BASE}\ngrid:\n  schedule.lr: [1e-3, 1e-2\n  model.num_layers: [2]\n")
    assert "not valid YAML" in message and "line 4" in message


def test_a_key_given_twice_and_the_sweeps_own_path_are_refused(tmp_path):
    message = grid_error(tmp_path, f"base: {BASE}\ngrid:\n  schedule.lr: [1]\n  schedule.lr: [2]\n")
    assert "line 4" in message and "grid.schedule.lr is given twice" in message
    message = grid_error(tmp_path, f"base: {BASE}\nset: {{training.save: x}}\ngrid:\n  schedule.lr: [1]\n")
    assert "set.training.save is set by the sweep" in message


def test_the_tool_prints_the_error_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(f"base: {BASE}\ngrid:\n  schedule.lr: 3\n")
    assert main(["--grid", str(path), "--output", str(tmp_path / "out"), "--no-progress"]) == 2
    assert f"error: {path}, line 3: axis schedule.lr" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- the pieces alone


def records(*losses: float) -> list[dict]:
    return [{"step": step, "loss": loss} for step, loss in enumerate(losses, start=1)]


def test_the_divergence_rule():
    rule = DivergenceRule(patience=3, margin=0.5)
    assert rule.judge(records(10.0, 10.6, 10.6, 10.4, 10.6, 10.6)) is None  # the run above is broken at step 4
    assert "up to step 7" in rule.judge(records(10.0, 10.6, 10.6, 10.4, 10.6, 10.6, 10.6))
    assert rule.judge(records(10.0, 10.5, 10.5, 10.5)) is None  # at loss_0 + margin is not above it
    assert rule.judge(records(10.0, 9.0, float("nan"))) == "loss nan at step 3"
    assert rule.judge(records(10.0, float("inf"))) == "loss inf at step 2"
    with pytest.raises(ValueError, match="patience must be at least 1"):
        DivergenceRule(patience=0)


def test_run_names_are_readable_and_unique():
    points = [{"schedule.lr": 0.001, "model.qk_layernorm": True}, {"schedule.lr": 1e-05, "model.qk_layernorm": False}]
    assert run_names(points) == ["lr=0.001,qk_layernorm=true", "lr=1e-05,qk_layernorm=false"]
    assert run_names([{"model.dropout": 0.1, "training.dropout": 0.2}]) == ["model.dropout=0.1,training.dropout=0.2"]
    same = run_names([{"data.split": "a/b"}, {"data.split": "a b"}])  # both would read split=a-b
    assert same[0] != same[1] and all(name.startswith("split=a-b-") and len(name) == 18 for name in same)


def test_the_tail_of_a_metrics_file_skips_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []
    lines = [{"kind": "train", "step": 1, "loss": 11.0}, {"kind": "valid", "step": 1, "loss": 10.0},
             {"kind": "train", "step": 2, "loss": 9.5}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"kind": "train", "st')
    assert [r["loss"] for r in tail.poll()] == [11.0, 9.5]
    with open(path, "a") as stream:
        stream.write('ep": 3, "loss": 9.0}\n')
    assert [r["loss"] for r in tail.poll()] == [11.0, 9.5, 9.0]
