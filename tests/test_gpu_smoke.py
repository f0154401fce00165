"""scripts/gpu_smoke.sh, the first run on a GPU, checked without one: its help, and its dry run against the real code.

The dry run prints every command it would run. Each training command is parsed by train.py's own parser, its
config loaded with its --set overrides by training/config.py and checked against a world of 1 process, as train.py
does before anything is built; each planner command is run for real (tools/plan.py needs no GPU) and must say the
run fits on the GPU and takes a few seconds a step.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import train
from training.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_smoke.sh"
CONFIGS = ["125m", "1.3b"]


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def printed_commands(stdout: str) -> list[list[str]]:
    """The "+ command" lines, split as the shell splits them (a trailing "> file" redirect dropped)."""
    commands = []
    for line in stdout.splitlines():
        if line.startswith("+ "):
            words = shlex.split(line[2:])
            commands.append(words[:words.index(">")] if ">" in words else words)
    return commands


@pytest.fixture(scope="module")
def dry_run() -> list[list[str]]:
    before = sorted((ROOT / "runs" / "gpu_smoke").rglob("*")) if (ROOT / "runs" / "gpu_smoke").exists() else None
    result = run_script("--dry-run")
    assert result.returncode == 0, result.stderr
    after = sorted((ROOT / "runs" / "gpu_smoke").rglob("*")) if (ROOT / "runs" / "gpu_smoke").exists() else None
    assert before == after  # it ran nothing
    return printed_commands(result.stdout)


def test_help():
    result = run_script("--help")
    assert result.returncode == 0
    for word in ("--dry-run", "--skip-install", "--steps", "--allow-cpu", "--build-wheels", "125m.json", "1.3b.json",
                 "30 steps", "TP 1 x PP 1", "bf16", "under 8"):
        assert word in result.stdout, word
    assert run_script("--no-such-option").returncode == 2


def train_commands(commands: list[list[str]]) -> list[list[str]]:
    """The arguments train.py receives (everything after the launched script) of each training command."""
    found = []
    for words in commands:
        if "scripts/gpu_smoke_train.py" in words:
            launcher = words[:words.index("scripts/gpu_smoke_train.py")]
            assert launcher[launcher.index("-m") + 1:launcher.index("--num_gpus") + 2] == [
                "deepspeed.launcher.runner", "--num_gpus", "1"]
            found.append(words[words.index("scripts/gpu_smoke_train.py") + 1:])
    return found


def test_dry_run_trains_both_configs_30_steps_bf16_tp1_pp1_on_one_gpu(dry_run):
    preprocess = [w for w in dry_run if "tools/preprocess_data.py" in w]
    assert len(preprocess) == 1 and "data/corpus/botchan.jsonl" in preprocess[0]
    prefix = preprocess[0][preprocess[0].index("--output-prefix") + 1]
    runs = train_commands(dry_run)
    assert len(runs) == 2
    for name, argv in zip(CONFIGS, runs, strict=True):
        args = train.parse_args(argv)
        assert args.ds_config == f"ds_configs/{name}.json" and args.data_path == [f"{prefix}_text_document"]
        config = load_run_config(ROOT / args.ds_config, args.set)  # the real config code, as train.py runs it
        assert config.check_world(1) == 1  # DP 1: every batch size divides, as train.py checks before starting
        assert (config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size) == (1, 1)
        assert config.model.precision == "bf16" and config.deepspeed["bf16"]["enabled"] is True
        assert config.training.max_steps == 30 and config.training.log_interval == 1
        assert config.training.save == f"runs/gpu_smoke/{name}"
        assert config.batch_schedule()(0) == config.global_batch_size == 64  # a fixed batch from the first step
        assert config.deepspeed["optimizer"]["params"]["torch_adam"] is True  # nothing to compile on the GPU


def test_dry_run_plans_the_same_runs_and_they_fit(dry_run):
    plans = [w for w in dry_run if "tools/plan.py" in w]
    assert len(plans) == 2
    total_seconds = 0.0
    for name, plan, run in zip(CONFIGS, plans, train_commands(dry_run), strict=True):
        assert plan[plan.index("--ds_config") + 1] == f"ds_configs/{name}.json"
        assert plan[plan.index("--nodes") + 1] == "1" and plan[plan.index("--gpus-per-node") + 1] == "1"
        run_sets = train.parse_args(run).set
        plan_sets = [plan[i + 1] for i, word in enumerate(plan) if word == "--set"]
        assert plan_sets == [s for s in run_sets if not s.startswith("training.")]  # the same run, planned
        result = subprocess.run([sys.executable, *plan[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        planned = json.loads(result.stdout)["plans"][0]
        assert (planned["gpus"], planned["tensor_parallel_size"], planned["pipeline_parallel_size"]) == (1, 1, 1)
        assert planned["global_batch_size"] == 64 and not planned["errors"]
        assert all(stage["fits"] for stage in planned["memory"])
        total_seconds += 30 * planned["full_batch"]["seconds"]
    assert total_seconds < 150  # predicted training time of both runs on the H200: well inside the 8 minutes


def test_dry_run_installs_deepspeed_then_the_project_without_dependencies(dry_run):
    pip = [w for w in dry_run if w[1:4] == ["-m", "pip", "install"]]
    assert pip[-1][4:] == ["--no-deps", "--no-build-isolation", "-e", "."]
    assert any("deepspeed==0.19.8" in w or "--find-links" in w for w in pip[:-1])
    assert [w[1:3] for w in dry_run if "scripts/gpu_smoke.py" in w] == [["scripts/gpu_smoke.py", "check"],
                                                                        ["scripts/gpu_smoke.py", "report"]]


def test_steps_option_reaches_both_runs():
    result = run_script("--dry-run", "--steps", "5", "--set", "model.num_layers=2")
    assert result.returncode == 0, result.stderr
    for argv in train_commands(printed_commands(result.stdout)):
        config = load_run_config(ROOT / train.parse_args(argv).ds_config, train.parse_args(argv).set)
        assert config.training.max_steps == 5 and config.model.num_layers == 2
