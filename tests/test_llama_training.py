"""A Llama-shaped model trains through train.py and the deepspeed launcher like the GPT: ds_configs/llama-tiny-cpu.json
(RoPE, RMSNorm, SwiGLU, 8 query heads in 2 KV groups, untied head) at TP 2 x PP 2 on 4 CPU processes, the loss
falls, and a stop at step 4 resumed to step 8 is bitwise the uninterrupted run."""

from __future__ import annotations

import shutil

import pytest

from tests.launch import final_weights, run_training, same_weights, trajectory

CONFIG = "ds_configs/llama-tiny-cpu.json"
EXTRA = ["training.save_interval=4"]


@pytest.mark.distributed
def test_llama_tiny_trains_and_resumes_exactly(corpus, tmp_path):
    straight = tmp_path / "straight" / "checkpoints"
    output = run_training(corpus, straight, max_steps=8, extra=EXTRA, ds_config=CONFIG)
    assert "TP 1/2 PP 1/2 DP 0/1" in output.stdout + output.stderr
    steps = trajectory(straight)
    assert [step for step, *_ in steps] == list(range(1, 9))
    assert steps[-1][1] < steps[0][1] - 0.5  # the loss falls (about 10.9 at the start: ln 50257)

    resumed = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("tensorboard", "metrics.jsonl", "global_step8"))
    (resumed / "latest").write_text("global_step4")
    run_training(corpus, resumed, max_steps=8, extra=EXTRA, ds_config=CONFIG)
    assert trajectory(resumed) == steps[4:]  # losses, learning rates, batches, tokens: bitwise
    assert same_weights(final_weights(resumed), final_weights(straight))
