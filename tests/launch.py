"""Launch train.py as users do (4 CPU processes, TP 2 x PP 2, with the launcher's environment) and read what it logged.

``run_training`` forks the ranks from the suite's warm process with what DeepSpeed's per-node launcher gives them
(tests/warm_launch.py): 5-10 s less per launch on 2 cores than starting fresh interpreters. Runs with injected faults
go through the per-node launcher itself, ``python -m deepspeed.launcher.launch`` (``train_command``), the program
the ``deepspeed`` command starts on every node (locally for --num_gpus, over pdsh for a hostfile) and the one that
starts the ranks; so do the fault suite's signals. The ``deepspeed`` command itself and torchrun are run by
tests/test_launchers.py, which also checks that the warm start gives bitwise the run the real launcher gives.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.distributed import free_port
from tests.warm_launch import launch
from training.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
# A ramp 4 -> 8 -> 12 -> 16 (micro-batch 2, DP 1) over the first steps; warmup and cosine inside the run;
# a checkpoint every 4 steps.
OVERRIDES = [
    "model.num_layers=2", "model.seq_length=32", "train_micro_batch_size_per_gpu=2", "train_batch_size=16",
    "schedule.batch.start=4", "schedule.batch.increment=4", "schedule.batch.ramp_tokens=1536",
    "schedule.warmup_tokens=1024", "schedule.decay_tokens=4096", "schedule.train_tokens=1000000",
    "training.log_interval=1", "training.eval_interval=0", "training.eval_iters=0", "training.save_interval=4",
]


def launcher_env(faults: dict | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("MTNLG_FAULTS", None)
    if faults:
        env["MTNLG_FAULTS"] = json.dumps(faults)
    return env


# Two processes (PP 2) for the tests whose point does not need tensor parallelism: half the start-up cost.
TWO_PROCESSES = ["parallelism.tensor_parallel_size=1", "parallelism.pipeline_parallel_size=2"]


def run_overrides(data_prefix: Path, save: Path, max_steps: int = STEPS, extra: list[str] = (),
                  processes: int = 4, base: list[str] = OVERRIDES) -> list[str]:
    """The --set items of a test run: the overrides above (or ``base``), its data, checkpoint directory and length."""
    return [*base, f"training.save={save}", f"training.max_steps={max_steps}",
            f"data.blend=[[1.0, \"{data_prefix}\"]]", f"data.cache_dir=\"{save.parent / 'index-cache'}\"",
            *(TWO_PROCESSES if processes == 2 else []), *extra]


def train_arguments(data_prefix: Path, save: Path, max_steps: int = STEPS, extra: list[str] = (),
                    processes: int = 4, ds_config: str = "ds_configs/tiny-cpu.json",
                    base: list[str] = OVERRIDES) -> list[str]:
    """train.py and its arguments."""
    arguments = ["train.py", "--ds_config", ds_config]
    for item in run_overrides(data_prefix, save, max_steps, extra, processes, base):
        arguments += ["--set", item]
    return arguments


def node_launcher(world_info: dict[str, list[int]], node_rank: int, port: int, arguments: list[str]) -> list[str]:
    """What DeepSpeed's runner starts on node ``node_rank`` (deepspeed/launcher/runner.py, multinode_runner.py):
    its per-node launcher, with the base64 world info, the master address and port."""
    encoded = base64.urlsafe_b64encode(json.dumps(world_info).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={encoded}",
            f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}", *arguments]


def train_command(data_prefix: Path, save: Path, max_steps: int = STEPS, extra: list[str] = (),
                  processes: int = 4, ds_config: str = "ds_configs/tiny-cpu.json",
                  base: list[str] = OVERRIDES) -> list[str]:
    """One node of ``processes`` ranks, as ``deepspeed --num_gpus N train.py ...`` starts it."""
    return node_launcher({"localhost": list(range(processes))}, 0, free_port(),
                         train_arguments(data_prefix, save, max_steps, extra, processes, ds_config, base))


def run_training(data_prefix: Path, save: Path, max_steps: int = STEPS, extra: list[str] = (),
                 faults: dict | None = None, expect_success: bool = True, processes: int = 4,
                 ds_config: str = "ds_configs/tiny-cpu.json", base: list[str] = OVERRIDES,
                 real_launcher: bool = False) -> subprocess.CompletedProcess:
    """One run of train.py on ``processes`` ranks: forked from the warm server with the launcher's environment
    (tests/warm_launch.py), or through DeepSpeed's per-node launcher itself with ``real_launcher``, for every run
    with injected faults (the fault suite proves the launcher's handling of a failing rank), and for every run when
    MTNLG_TESTS_REAL_LAUNCHER=1 (to measure what the warm start saves, docs/testing.md)."""
    started = time.monotonic()
    real = real_launcher or bool(faults) or os.environ.get("MTNLG_TESTS_REAL_LAUNCHER") == "1"  # the latter: to compare
    if real:
        result = subprocess.run(train_command(data_prefix, save, max_steps, extra, processes, ds_config, base),
                                cwd=ROOT, env=launcher_env(faults), capture_output=True, text=True, timeout=600)
    else:
        result = launch(train_arguments(data_prefix, save, max_steps, extra, processes, ds_config, base), processes,
                        free_port(), launcher_env(), timeout=600)
    if os.environ.get("MTNLG_TESTS_LAUNCH_LOG"):  # one line per launch: what docs/testing.md's figures are made of
        with open(os.environ["MTNLG_TESTS_LAUNCH_LOG"], "a") as log:
            log.write(json.dumps({"seconds": round(time.monotonic() - started, 2), "processes": processes,
                                  "real_launcher": real, "steps": max_steps}) + "\n")
    if expect_success:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def preprocess_corpus(out: Path) -> Path:
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(ROOT / "data/corpus/botchan.jsonl"),
                    "--output-prefix", str(out / "demo"), "--append-eod", "--workers", "1", "--no-progress"],
                   cwd=ROOT, check=True, capture_output=True)
    return out / "demo_text_document"


def trajectory(save: Path) -> list[tuple]:
    """(step, loss, lr, global batch, micro-batches, tokens) of every step, the last record of each."""
    return [(r["step"], r["loss"], r["lr"], r["global_batch"], r["micro_batches"], r["consumed_tokens"])
            for r in read_metrics(save / "metrics.jsonl")]


def final_weights(save: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every layer file of the latest checkpoint (each TP rank's shard), and at EP > 1 every EP rank's expert file,
    read without pickle."""
    tag = (save / "latest").read_text()
    paths = sorted((save / tag).glob("layer_*.pt")) + sorted((save / tag).glob("experts_*.pt"))
    return {path.name: torch.load(path, weights_only=True) for path in paths}


def resumable_copy(save: Path, destination: Path, step: int = 4) -> Path:
    """A run's checkpoints up to ``step`` in ``destination``/checkpoints, ``latest`` naming it: what the run left had
    it stopped there (its metrics and TensorBoard events not copied: the resumed run writes its own from there)."""
    later = [p.name for p in save.glob("global_step*") if int(p.name.removeprefix("global_step")) > step]
    copy = destination / "checkpoints"
    shutil.copytree(save, copy, ignore=shutil.ignore_patterns("tensorboard", "metrics.jsonl", *later))
    (copy / "latest").write_text(f"global_step{step}")
    return copy


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[name].keys() == b[name].keys() and all(torch.equal(a[name][k], b[name][k]) for k in a[name]) for name in a)
