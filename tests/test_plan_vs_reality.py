"""Plan against reality (training/plan_check.py): a CPU run given a made-up hardware entry prints the plan of its
layout at start-up, and each logged window's measured / planned ratios, which equal the log's own numbers divided.

The hardware is small enough that the tiny model's plan is of the order of the CPU's real step time; the ratios'
values are not judged, only that they are what the log's measured and planned figures say."""

from __future__ import annotations

import json
import re

import pytest

from runconfig.run import load_run_config
from tests.launch import OVERRIDES, TWO_PROCESSES, run_overrides, run_training
from training.metrics_log import read_metrics

HARDWARE = {"name": "test-cpu", "peak_tflops": 0.02, "memory_gib": 4.0, "hbm_gbytes_per_s": 10.0,
            "nvlink_gbytes_per_s": 2.0, "ib_gbits_per_s": 8.0}
SNAPSHOT = {"step": 3, "on_oom": True, "stacks": "python"}
EXTRA = [f"training.plan_hardware={json.dumps(HARDWARE)}", f"training.memory_snapshot={json.dumps(SNAPSHOT)}",
         "training.log_interval=3", "training.save_interval=0"]
STEPS = 6  # two windows of 3 steps: batches 4, 4, 4 then 4, 8, 8 (the ramp of tests/launch.py)


@pytest.fixture(scope="module")
def planned_run(corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("plan") / "checkpoints"
    result = run_training(corpus, save, max_steps=STEPS, extra=EXTRA, processes=2)
    return save, result.stdout


@pytest.mark.distributed
def test_the_logged_ratios_are_measured_over_planned_from_the_logs_own_numbers(corpus, planned_run):
    save, stdout = planned_run
    records = read_metrics(save / "metrics.jsonl")
    assert [r["step"] for r in records] == [3, 6]
    consumed = [0] + [r["consumed_samples"] for r in records]
    for record, before in zip(records, consumed, strict=False):
        samples = record["consumed_samples"] - before
        seconds = samples / record["samples_per_second"]  # the window's wall time, from the log
        assert record["iteration_seconds"] == pytest.approx(seconds / 3, rel=1e-9)
        assert record["plan_iteration_ratio"] == pytest.approx(
            record["iteration_seconds"] / record["planned_iteration_seconds"], rel=1e-12)
        assert record["plan_tokens_per_second_ratio"] == pytest.approx(
            record["tokens_per_second"] / record["planned_tokens_per_second"], rel=1e-12)
        # planned at the window's own batches: tokens / planned seconds, planned seconds = steps x mean
        assert record["planned_tokens_per_second"] == pytest.approx(
            samples * 32 / (3 * record["planned_iteration_seconds"]), rel=1e-12)
        assert record["peak_memory_reserved_gib"] is None and record["plan_memory_ratio"] is None  # no CUDA
        shown = f"time/plan {record['plan_iteration_ratio']:.3f} | tokens/s / plan " \
                f"{record['plan_tokens_per_second_ratio']:.3f}"
        line = next(line for line in stdout.splitlines() if line.startswith(f"[train] step {record['step']} |"))
        assert shown in line and f"{record['iteration_seconds']:.4g} s/step" in line

    # the planner itself, at each step's batch: what the run's config plans on the same hardware, DP 1, PP 2
    from training.plan_check import PlanCheck, hardware_of

    config = load_run_config("ds_configs/tiny-cpu.json", run_overrides(corpus, save, STEPS, EXTRA, 2))
    said = []
    check = PlanCheck(config, hardware_of(HARDWARE), "training.plan_hardware", 2, 2, said.append)
    for record, batches in zip(records, ([4, 4, 4], [4, 8, 8]), strict=True):
        assert record["planned_iteration_seconds"] == pytest.approx(
            sum(check.seconds(b) for b in batches) / 3, rel=1e-9)
        assert record["planned_peak_memory_gib"] == pytest.approx(check.planned_memory_gib, rel=1e-12)
    startup = [line for line in stdout.splitlines() if line.startswith("[plan] test-cpu (training.plan_hardware)")]
    assert startup == [said[0]]  # once, on rank 0, with the plan of this layout
    match = re.search(r"TP 1 x PP 2 x DP 1, full batch 16: iteration ([\d.e+-]+) s", startup[0])
    assert float(match[1]) == pytest.approx(check.seconds(16), rel=1e-3)


@pytest.mark.distributed
def test_a_memory_snapshot_on_cpu_says_it_needs_cuda_once_and_the_run_finishes(planned_run):
    save, stdout = planned_run
    from training.memory_snapshot import CPU_MESSAGE

    assert stdout.count(CPU_MESSAGE) == 1
    assert (save / "latest").read_text() == f"global_step{STEPS}" and not (save / "memory").exists()


def test_without_plan_hardware_a_cpu_run_plans_nothing():
    from training.plan_check import open_plan_check

    config = load_run_config("ds_configs/tiny-cpu.json", OVERRIDES + TWO_PROCESSES)
    said = []
    assert config.training.plan_hardware is None and open_plan_check(config, 2, said.append) is None and not said


@pytest.mark.parametrize("value, words", [
    ('"a100"', "is not a planner/hardware.py GPU_PRESETS name"),
    ('{"peak_tflops": 1.0}', "a hardware dict needs ['peak_tflops', 'memory_gib'"),
    ('{"peak_tflops": 1.0, "memory_gib": 1, "hbm_gbytes_per_s": 1, "nvlink_gbytes_per_s": 1, "ib_gbits_per_s": 1, '
     '"tflops": 2}', "unknown key(s) ['tflops'] in block \"training.plan_hardware\""),
    ('{"peak_tflops": -1.0, "memory_gib": 1, "hbm_gbytes_per_s": 1, "nvlink_gbytes_per_s": 1, "ib_gbits_per_s": 1}',
     "hardware peak_tflops must be positive"),
    ("7", "training.plan_hardware = 7 is an integer"),
])
def test_a_bad_plan_hardware_is_refused_in_one_line_naming_it(value, words):
    """Where training starts (training/run.py check_buildable, which train.py runs before any process): the run
    config itself does not read the planner's presets."""
    from training.run import check_buildable

    with pytest.raises(ValueError) as error:
        check_buildable(load_run_config("ds_configs/tiny-cpu.json", [*OVERRIDES, f"training.plan_hardware={value}"]))
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_preset_name_is_the_planners_preset():
    from planner.hardware import GPU_PRESETS
    from training.plan_check import detected_hardware, hardware_of

    assert hardware_of("h200") is GPU_PRESETS["h200"]
    assert detected_hardware("NVIDIA H200", 139.8) is GPU_PRESETS["h200"]
    assert detected_hardware("NVIDIA H100 80GB HBM3", 79.6) is GPU_PRESETS["h100-80gb"]
    assert detected_hardware("NVIDIA A100-SXM4-40GB", 39.4) is GPU_PRESETS["a100-40gb"]
    assert detected_hardware("NVIDIA A100-SXM4-80GB", 79.2) is GPU_PRESETS["a100-80gb"]
    assert detected_hardware("NVIDIA H100 PCIe", 79.6) is None and detected_hardware(None, None) is None
