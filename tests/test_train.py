"""train.py end to end, launched as users launch it: the deepspeed launcher, 4 CPU processes, TP 2 x PP 2.

One straight run of 2k steps (the ramp changes the number of micro-batches mid-run; the loss falls), one run stopped
after k steps and resumed to 2k, and one run stopped by SIGTERM mid-run and resumed: the per-step losses, learning
rates and batch sizes of the three are identical (bitwise, fp32 on CPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
# A ramp 4 -> 8 -> 12 -> 16 (micro-batch 2, DP 1) over the first steps; warmup and cosine inside the run.
OVERRIDES = [
    "model.num_layers=2", "model.seq_length=32", "train_micro_batch_size_per_gpu=2", "train_batch_size=16",
    "schedule.batch.start=4", "schedule.batch.increment=4", "schedule.batch.ramp_tokens=1536",
    "schedule.warmup_tokens=1024", "schedule.decay_tokens=4096", "schedule.train_tokens=1000000",
    "training.log_interval=1", "training.eval_interval=0", "training.eval_iters=0", "training.save_interval=0",
]


def launcher_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}


def train_command(data_prefix: Path, save: Path, max_steps: int, extra: list[str] = ()) -> list[str]:
    sets = [*OVERRIDES, f"training.save={save}", f"training.max_steps={max_steps}",
            f"data.blend=[[1.0, \"{data_prefix}\"]]", f"data.cache_dir=\"{save.parent / 'index-cache'}\"", *extra]
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port",
               str(_free_port()), "train.py", "--ds_config", "ds_configs/tiny-cpu.json"]
    for item in sets:
        command += ["--set", item]
    return command


def _free_port() -> int:
    from tests.distributed import free_port

    return free_port()


def run_training(data_prefix: Path, save: Path, max_steps: int) -> subprocess.CompletedProcess:
    result = subprocess.run(train_command(data_prefix, save, max_steps), cwd=ROOT, env=launcher_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus_file()), "--output-prefix",
                    str(out / "demo"), "--append-eod", "--workers", "1"], cwd=ROOT, check=True, capture_output=True)
    return out / "demo_text_document"


def corpus_file() -> Path:
    return next((ROOT / "data" / "corpus").glob("*.jsonl"))


def trajectory(save: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["global_batch"], r["micro_batches"], r["consumed_tokens"])
            for r in read_metrics(save / "metrics.jsonl")]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory) -> list[tuple]:
    save = tmp_path_factory.mktemp("straight") / "checkpoints"
    run_training(corpus, save, STEPS)
    return trajectory(save)


@pytest.mark.distributed
def test_ramp_changes_micro_batches_and_loss_falls(straight):
    assert [step for step, *_ in straight] == list(range(1, STEPS + 1))
    # 3 increments over 1536 tokens: one per 512 tokens of 32-token samples
    assert [s[3] for s in straight] == [4, 4, 4, 4, 8, 8, 12, 12, 16, 16, 16, 16]
    assert [s[4] for s in straight] == [b // 2 for b in [4, 4, 4, 4, 8, 8, 12, 12, 16, 16, 16, 16]]  # micro 2, DP 1
    losses = [s[1] for s in straight]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5
    lrs = [s[2] for s in straight]
    # step 6 ends at 1024 tokens, the end of warmup: it trains at the peak; the first step at 128/1024 of it
    assert lrs[0] == pytest.approx(3e-3 * 128 / 1024) and lrs[5] == pytest.approx(3e-3) and lrs[-1] < lrs[5]


@pytest.mark.distributed
def test_stop_and_resume_is_exact(corpus, straight, tmp_path):
    save = tmp_path / "checkpoints"
    run_training(corpus, save, STEPS // 2)
    assert (save / "latest").read_text() == f"global_step{STEPS // 2}"
    run_training(corpus, save, STEPS)
    assert trajectory(save) == straight


@pytest.mark.distributed
def test_sigterm_checkpoints_and_resumes_exactly(corpus, straight, tmp_path):
    save = tmp_path / "checkpoints"
    process = subprocess.Popen(train_command(corpus, save, STEPS), cwd=ROOT, env=launcher_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = save / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, "training ended before it could be stopped"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)  # as a scheduler does: every process of the job
    output, _ = process.communicate(timeout=120)
    stopped_at = int((save / "latest").read_text().removeprefix("global_step"))
    assert 3 <= stopped_at < STEPS, output[-3000:]
    assert "stop requested by a signal" in output
    run_training(corpus, save, STEPS)
    assert trajectory(save) == straight
    assert json.loads((save / "metrics.jsonl").read_text().splitlines()[-1])["step"] == STEPS
