"""The recipe's schedules and configs: exact values at chosen token counts, and the start-up divisibility check."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from model.flops import flops_per_iteration, tflops_per_gpu
from runconfig.run import load_run_config, parse_run_config
from runconfig.schedules import BatchRamp, LearningRateSchedule
from training.metrics import mfu

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "ds_configs"


@pytest.fixture(scope="module")
def recipe():
    return load_run_config(CONFIGS / "530b.json")


def test_530b_json_is_the_recipe(recipe):
    ds = recipe.deepspeed
    assert (recipe.parallelism.tensor_parallel_size, recipe.parallelism.pipeline_parallel_size) == (8, 35)
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (1, 1920)
    assert ds["zero_optimization"]["stage"] == 1 and ds["bf16"]["enabled"] and ds["data_types"]["grad_accum_dtype"] == "fp32"
    params = ds["optimizer"]["params"]
    assert ds["optimizer"]["type"] == "Adam" and params["betas"] == [0.9, 0.95] and params["eps"] == 1e-8
    assert params["weight_decay"] == 0.1 and ds["gradient_clipping"] == 1.0 and params["lr"] == 5e-5
    s = recipe.schedule
    assert (s.lr, s.min_lr_ratio, s.warmup_tokens, s.decay_tokens, s.train_tokens) == (5e-5, 0.1, 1e9, 340e9, 270e9)
    assert recipe.model.init_method_std == pytest.approx(math.sqrt(1 / (3 * 20480)), rel=1e-8)
    assert set(recipe.deepspeed).isdisjoint({"model", "parallelism", "schedule", "data", "training"})


@pytest.mark.parametrize("tokens, lr", [
    (0, 0.0),
    (0.5e9, 2.5e-5),
    (1e9, 5e-5),  # peak at the end of warmup
    (1e9 + 170e9, 5e-6 + 4.5e-5 * 0.5),  # half-way through the cosine: the mean of peak and minimum
    (1e9 + 85e9, 5e-6 + 4.5e-5 * 0.5 * (1 + math.cos(math.pi / 4))),
    (341e9, 5e-6),  # the minimum from 341B tokens on
    (400e9, 5e-6),
])
def test_530b_learning_rate(recipe, tokens, lr):
    assert recipe.learning_rate_schedule()(tokens) == pytest.approx(lr, rel=1e-12, abs=1e-20)


@pytest.mark.parametrize("tokens, batch", [
    (0, 32), (203_389_830, 32), (203_389_831, 64), (6e9, 32 + 32 * 29), (11.99e9, 1888), (12e9, 1920), (270e9, 1920),
])
def test_530b_batch_ramp(recipe, tokens, batch):
    ramp = recipe.batch_schedule()
    assert ramp.num_increments == 59
    assert ramp.tokens_per_increment == pytest.approx(12e9 / 59)  # 99,311.4 samples of 2048
    assert ramp(tokens) == batch


@pytest.mark.parametrize("nodes, dp", [(280, 8), (560, 16)])
def test_530b_ramp_divides_at_dp_8_and_16(recipe, nodes, dp):
    assert recipe.check_world(nodes * 8) == dp


@pytest.mark.parametrize("nodes, dp", [(350, 10), (420, 12)])
def test_530b_ramp_refused_at_dp_10_and_12(recipe, nodes, dp):
    with pytest.raises(ValueError) as error:
        recipe.check_world(nodes * 8)
    message = str(error.value)
    assert f"micro-batch x data-parallel size = 1 x {dp} = {dp}" in message
    offending = [size for size in range(32, 1921, 32) if size % dp]
    assert message.split(": ")[1].startswith(", ".join(map(str, offending[:12])))
    assert 1920 % dp == 0 and "1920" not in message  # the full batch itself is accepted
    assert 32 % dp != 0 and re.search(r"\b32\b", message)


def test_lr_of_a_step_counts_its_own_batch():
    """The LR of a step is lr(tokens after the step): the first step is not at 0, the step reaching warmup is at peak."""
    schedule = LearningRateSchedule(peak=1.0, warmup_tokens=1000, decay_tokens=1000, min_lr_ratio=0.1)
    tokens_per_step = 250
    lrs = [schedule((step + 1) * tokens_per_step) for step in range(4)]
    assert lrs == [0.25, 0.5, 0.75, 1.0]


def test_ramp_validation():
    with pytest.raises(ValueError, match="not a whole number of schedule.batch.increment"):
        BatchRamp(start=32, increment=48, end=1920, ramp_tokens=1e9)
    with pytest.raises(ValueError, match="larger than the full batch"):
        BatchRamp(start=64, increment=32, end=32, ramp_tokens=1e9)
    assert BatchRamp(start=32, increment=32, end=1920, ramp_tokens=0)(0) == 1920


def test_flops_formula_against_hand_values(recipe):
    # 530B, full batch, recomputation: 96 * 1920 * 2048 * 105 * 20480^2 * (1 + 2048/(6*20480) + 51200/(16*105*20480))
    expected = 96 * 1920 * 2048 * 105 * 20480**2 * (1 + 1 / 60 + 51200 / 34406400)
    assert flops_per_iteration(recipe.model, 1920, 8) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(1.69264e19, rel=1e-5)
    no_recompute = 72 * 1920 * 2048 * 105 * 20480**2 * (1 + 1 / 60 + 51200 / (12 * 105 * 20480))
    assert flops_per_iteration(recipe.model, 1920, 8, recompute=False) == pytest.approx(no_recompute, rel=1e-12)
    # 4480 GPUs at 60 s per iteration: 1.69264e19 / (60 * 4480) = 62.97 TFLOP/s per GPU
    assert tflops_per_gpu(expected, 60.0, 4480) == pytest.approx(62.970, rel=1e-4)
    assert mfu(tflops_per_gpu(expected, 60.0, 4480), 312.0) == pytest.approx(62.970 / 312, rel=1e-4)  # 20.2% of A100
    assert mfu(62.97, None) is None  # CPU: no peak, no MFU


def test_config_errors_name_the_field():
    raw = json.loads((CONFIGS / "tiny-cpu.json").read_text())
    cases = [
        ({"schedule": {**raw["schedule"], "warmup_tokens": -1}}, "schedule.warmup_tokens must be >= 0"),
        ({"model": {**raw["model"], "num_layers": 3}}, "model.num_layers (3) cannot be split evenly"),
        ({"training": {**raw["training"], "bogus": 1}}, "unknown key(s) ['bogus'] in block \"training\""),
        ({"scheduler": {"type": "WarmupLR"}}, "DeepSpeed key \"scheduler\" is not used here"),
        ({"bf16": {"enabled": True}}, "model.precision is 'fp32' but the DeepSpeed sections enable bf16"),
        ({"train_batch_size": 0}, "\"train_batch_size\" must be a positive integer"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_run_config({**raw, **change})


def test_plot_schedule_prints_values_at_tokens(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_schedule.py"), "--ds_config",
                          str(CONFIGS / "530b.json"), "--at", "0,1e9,12e9,341e9", "--output", str(tmp_path / "s.png")],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [line.split() for line in out if line.split() and line.split()[0].isdigit()]
    # at 1e9 tokens: 4 increments of 12e9/59 tokens done -> 32 + 4 x 32 = 160;
    # at 12e9: 5e-6 + 4.5e-5 (1 + cos(pi 11/340)) / 2 = 4.988388e-05
    assert rows == [["0", "0.000000e+00", "32"], ["1000000000", "5.000000e-05", "160"],
                    ["12000000000", "4.988388e-05", "1920"], ["341000000000", "5.000000e-06", "1920"]]
    assert (tmp_path / "s.png").stat().st_size > 10_000


def test_the_eta_counts_the_ramps_future_batches():
    """Worked by hand: batches 4 -> 12 in steps of 4 over 1,536 tokens (one increment per 768), 32-token samples, a
    10,000-token target. From 0: 6 steps of 4 (768 tokens), 3 of 8 (to 1,536), then 12s until 10,000 is passed:
    1,536 + 22 x 384 = 9,984 < 10,000, so 23. At micro-batch 2 on 2 stages a step is (m + 1) slots: 6 x 3 + 3 x 5 +
    23 x 7 = 194; the current batch's pace (4 a step) would have counted (10,000 / 128 = 78.1 steps) x 3 = 234."""
    from runconfig.schedules import BatchRamp, future_batches, pipeline_slots

    ramp = BatchRamp(start=4, increment=4, end=12, ramp_tokens=1536)
    assert future_batches(ramp, 0, 10_000, 32) == [(4, 6), (8, 3), (12, 23)]
    assert sum(steps * pipeline_slots(batch // 2, 2) for batch, steps in future_batches(ramp, 0, 10_000, 32)) == 194
    assert future_batches(ramp, 700, 10_000, 32) == [(4, 1), (8, 3), (12, 22)]  # 828, then 3 x 256 to 1,596
    assert future_batches(ramp, 9_990, 10_000, 32) == [(12, 1)] and future_batches(ramp, 10_000, 10_000, 32) == []
    no_ramp = BatchRamp(start=12, increment=12, end=12, ramp_tokens=0.0)
    assert future_batches(no_ramp, 0, 10_000, 32) == [(12, 27)]  # ceil(10,000 / 384)
