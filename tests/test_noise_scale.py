"""The gradient noise scale: the estimator against a closed form, the DeepSpeed hook against materialised gradients,
and the batch schedule it drives.

Linear regression, y = x . w* + eps, x ~ N(0, S), eps ~ N(0, s^2), per-sample loss (x . w - y)^2 / 2. At a fixed
w = w* + delta the per-sample gradient is g = x (x . delta - eps), so
    G     = E[g] = S delta
    E[g g^T] = (delta^T S delta + s^2) S + 2 S delta delta^T S        (Isserlis: E[x_i x_j x_k x_l] for Gaussian x)
    Sigma = E[g g^T] - G G^T = (delta^T S delta + s^2) S + S delta delta^T S
    B_simple = tr(Sigma) / |G|^2 = (delta^T S delta + s^2) tr(S) / |S delta|^2 + 1.

The pipeline comparisons: fp32 agrees to ~1e-5 (the split changes the summation order only; measured 4e-11 for
|G_small|^2, summed in fp64 like DeepSpeed's ZeRO-1 norm, and 2e-7 for DeepSpeed's |G_big|^2); the hook's tensors
against DeepSpeed's own norm agree to that norm's rounding in both precisions; bf16 against the fp32 reference to
bf16 accuracy (its forward and backward run in bf16).
"""

from __future__ import annotations

import math

import pytest
import torch

from model.config import ParallelConfig
from model.gpt import GPT
from model.parallel import ParallelContext
from runconfig.schedules import NoiseScaleBatchSchedule
from tests.distributed import run_distributed
from tests.test_model_parallel import GLOBAL_BATCH, MICRO_BATCH, SEED, deepspeed_config, micro_batches, model_config
from training.engine import build_engine
from training.noise_scale import GradientNoiseScale, NoiseScaleMonitor, counts_in_norm

BETA = 0.9


# -- the estimator ----------------------------------------------------------------------------------------------------
def linear_regression_noise_scale(covariance_diagonal: torch.Tensor, delta: torch.Tensor, label_std: float) -> float:
    s_delta = covariance_diagonal * delta
    return float(((delta @ s_delta + label_std**2) * covariance_diagonal.sum()) / (s_delta @ s_delta) + 1.0)


def simulated_squared_norms(steps: int, replicas: int, per_replica: int, covariance_diagonal: torch.Tensor,
                            delta: torch.Tensor, label_std: float, generator: torch.Generator):
    """|G_small|^2 (mean over replicas) and |G_big|^2 of each step's mean per-sample gradients, (steps,) each."""
    shape = (steps, replicas, per_replica)
    x = torch.randn(*shape, delta.numel(), generator=generator, dtype=torch.float64) * covariance_diagonal.sqrt()
    eps = torch.randn(*shape, generator=generator, dtype=torch.float64) * label_std
    per_sample = x * (x @ delta - eps).unsqueeze(-1)  # (steps, replicas, per_replica, d)
    replica_means = per_sample.mean(2)  # (steps, replicas, d): what one DP replica accumulates
    small = replica_means.pow(2).sum(-1).mean(-1)
    big = replica_means.mean(1).pow(2).sum(-1)
    return small, big


def test_estimator_recovers_linear_regression_noise_scale():
    generator = torch.Generator().manual_seed(0)
    d, replicas, per_replica, label_std = 16, 4, 8, 0.5
    covariance_diagonal = torch.linspace(0.5, 2.0, d, dtype=torch.float64)
    delta = torch.randn(d, generator=generator, dtype=torch.float64) * 0.12
    truth = linear_regression_noise_scale(covariance_diagonal, delta, label_std)
    assert per_replica < truth < 10 * replicas * per_replica  # a regime where both batches carry information

    small, big = simulated_squared_norms(4000, replicas, per_replica, covariance_diagonal, delta, label_std, generator)
    estimator = GradientNoiseScale(beta=0.999)
    for small_squared, big_squared in zip(small.tolist(), big.tolist(), strict=True):
        assert estimator.update(per_replica, small_squared, replicas * per_replica, big_squared)

    s_delta = covariance_diagonal * delta
    true_gradient_squared = float(s_delta @ s_delta)
    true_trace = float((delta @ s_delta + label_std**2) * covariance_diagonal.sum() + s_delta @ s_delta)
    assert estimator.gradient_squared == pytest.approx(true_gradient_squared, rel=0.1)
    assert estimator.trace == pytest.approx(true_trace, rel=0.1)
    assert estimator.noise_scale == pytest.approx(truth, rel=0.1)


def test_estimator_bias_correction_and_state_round_trip():
    estimator = GradientNoiseScale(beta=0.9)
    assert estimator.noise_scale is None and estimator.gradient_squared is None
    estimator.update(4, 3.0, 16, 1.5)
    # After one step the bias-corrected averages are that step's unbiased estimates.
    gradient_squared, trace = GradientNoiseScale.single_step(4, 3.0, 16, 1.5)
    assert gradient_squared == pytest.approx((16 * 1.5 - 4 * 3.0) / 12)
    assert trace == pytest.approx(1.5 / (1 / 4 - 1 / 16))
    assert estimator.gradient_squared == pytest.approx(gradient_squared)
    assert estimator.trace == pytest.approx(trace)
    assert estimator.noise_scale == pytest.approx(trace / gradient_squared)

    assert not estimator.update(4, float("inf"), 16, 1.0)  # a skipped (overflowed) step changes nothing
    assert estimator.updates == 1

    restored = GradientNoiseScale(beta=0.9)
    restored.load_state_dict(estimator.state_dict())
    assert all(type(v) in (int, float) for v in estimator.state_dict().values())
    for step in range(5):
        estimator.update(4, 2.0 + step, 16, 1.0)
        restored.update(4, 2.0 + step, 16, 1.0)
    assert restored.state_dict() == estimator.state_dict()
    assert restored.noise_scale == estimator.noise_scale

    with pytest.raises(ValueError, match="B_small == B_big"):
        estimator.update(8, 1.0, 8, 1.0)


def test_monitor_says_once_why_it_cannot_measure_at_dp1():
    messages = []
    monitor = NoiseScaleMonitor(engine=None, ctx=ParallelContext(), info=messages.append)
    assert len(messages) == 1 and "B_small == B_big" in messages[0]
    assert monitor.after_step() == {"noise_scale": None} and monitor.noise_scale is None
    assert len(messages) == 1


def test_counting_rules_mirror_deepspeed_norm():
    sharded, replicated, tied_copy = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    sharded.tensor_model_parallel = True
    tied_copy.tensor_model_parallel, tied_copy.ds_pipe_replicated = True, True
    assert [counts_in_norm(p, 0) for p in (sharded, replicated, tied_copy)] == [True, True, False]
    assert [counts_in_norm(p, 1) for p in (sharded, replicated, tied_copy)] == [True, False, False]


# -- the hook in DeepSpeed's pipeline engine (PP 2 x DP 2, ZeRO-1) ----------------------------------------------------
def _one_step(precision: str, schedule: str = "1f1b") -> dict:
    config = model_config(precision=precision)
    parallel = ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=2, pipeline_schedule=schedule)
    ds_config = deepspeed_config(precision)
    if schedule == "dualpipev":  # the full batch needs 2p micro-batches; this step is a ramp step below it
        ds_config["train_batch_size"] = 2 * GLOBAL_BATCH
    engine, ctx = build_engine(config, parallel, ds_config, SEED)
    engine.set_train_batch_size(GLOBAL_BATCH)
    monitor = NoiseScaleMonitor(engine, ctx, beta=BETA)
    captured = {}
    measure = monitor.local_squared_norm

    def capture_then_measure() -> torch.Tensor:  # the tensors the hook reads, as they are just before ReduceGrads
        captured["flat"] = torch.cat([grad.detach().float().flatten() for grad in monitor.counted_gradients()])
        return measure()

    monitor.local_squared_norm = capture_then_measure
    engine.train_batch(data_iter=micro_batches(0, config.seq_length, ctx.data_parallel_rank, ctx.data_parallel_size))
    record = monitor.after_step()
    return {**record, "global_norm": float(engine.get_global_grad_norm()), "flat": captured["flat"],
            "stage": ctx.pipeline_parallel_rank, "optimizer": type(engine.optimizer).__name__}


def reference_squared_norms(data_parallel_size: int) -> tuple[float, float]:
    """Per-replica mean gradients of step 0, materialised by the single-process model: (|G_small|^2, |G_big|^2)."""
    torch.manual_seed(SEED)
    config = model_config()
    model = GPT(config, seed=SEED)
    replica_gradients = []
    for replica in range(data_parallel_size):
        model.zero_grad()
        batches = list(micro_batches(0, config.seq_length, replica, data_parallel_size))
        (sum(model.loss(*inputs, *labels) for inputs, labels in batches) / len(batches)).backward()
        replica_gradients.append(torch.cat([p.grad.double().flatten() for p in model.parameters()]))
    small = sum(g.pow(2).sum().item() for g in replica_gradients) / data_parallel_size
    big = torch.stack(replica_gradients).mean(0).pow(2).sum().item()
    return small, big


def norms_of_hooked_tensors(ranks: list[dict]) -> tuple[float, float]:
    """(|G_small|^2, |G_big|^2) from the tensors the hook read: stages summed, replicas averaged."""
    stages = sorted({r["stage"] for r in ranks})
    by_stage = [torch.stack([r["flat"].double() for r in ranks if r["stage"] == s]) for s in stages]  # (DP, n_s)
    small = sum(flats.pow(2).sum(1).mean().item() for flats in by_stage)
    big = sum(flats.mean(0).pow(2).sum().item() for flats in by_stage)
    return small, big


@pytest.fixture(scope="module")
def reference() -> tuple[float, float]:
    return reference_squared_norms(data_parallel_size=2)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_fp32_zero1_pipeline_hook_equals_materialised_replica_gradients(reference, schedule):
    """Under DualPipeV (here its V-shaped schedule: 2 micro-batches per pipeline) the hook sits on the same
    ReduceGrads, and rank 0 holds the only copy of the tied embedding."""
    ranks = run_distributed(4, _one_step, "fp32", schedule)
    small, big = reference
    small_batch = GLOBAL_BATCH // 2
    expected = GradientNoiseScale(BETA)
    expected.update(small_batch, small, GLOBAL_BATCH, big)
    assert small > big * 1.05  # the noise is visible at these batch sizes, so the estimate is meaningful
    for result in ranks:  # every rank reports the same numbers
        assert result["optimizer"] == "DeepSpeedZeroOptimizer"
        assert result["noise_scale_small_batch"] == small_batch == MICRO_BATCH * GLOBAL_BATCH // (MICRO_BATCH * 2)
        assert result["grad_norm_squared_small"] == pytest.approx(small, rel=1e-5)
        assert result["grad_norm_squared_big"] == pytest.approx(big, rel=1e-5)
        # The estimates are differences of the two norms: their tolerance is the norms' one, amplified by
        # the cancellation (|G|^2 here is 1.1 out of B_big |G_big|^2 = 164).
        tolerance = 1e-5 * ((GLOBAL_BATCH * big + small_batch * small) / abs(GLOBAL_BATCH * big - small_batch * small)
                            + (small + big) / (small - big))
        assert result["noise_scale"] == pytest.approx(expected.noise_scale, rel=tolerance)
        assert result["noise_scale_gradient_squared"] == pytest.approx(expected.gradient_squared, rel=tolerance)
        assert result["noise_scale_trace"] == pytest.approx(expected.trace, rel=tolerance)
    hooked_small, hooked_big = norms_of_hooked_tensors(ranks)
    assert hooked_small == pytest.approx(small, rel=1e-5)
    assert hooked_big == pytest.approx(ranks[0]["global_norm"] ** 2, rel=1e-5)  # what DeepSpeed reduced and normed


def bf16_norm_tolerance(ranks: list[dict]) -> float:
    """Relative tolerance between DeepSpeed's bf16 global norm^2 and the exact fp64 |G_big|^2 of the hooked buffers,
    from bf16's and fp32's precision and the size of the reduction (4 standard deviations of both errors):

    - With bf16 on and no "communication_data_type", DeepSpeed all-reduces the fp32 accumulation buffers in bf16
      (engine.allreduce_bucket): each element of the mean gradient g is rounded about three times (each replica's
      cast, the sum), by a random relative error of standard deviation 2^-9 / sqrt(3) each, so about 2^-9 in all.
      The error of sum(g^2) then has a standard deviation of 2 * 2^-9 * sqrt(sum(g^4)): small relative to sum(g^2)
      when many elements contribute, large when a few dominate. How this CPU's bf16 kernels rounded the gradients
      decides where in that spread one run lands (6.0e-5 on one AMD EPYC, under 5e-5 on Intel CPUs).
    - DeepSpeed then takes the norm in fp32: a running fp32 sum of n terms, whose rounding errors (2^-24 relative
      each) add up like a random walk, sqrt(n) * 2^-24; torch keeps one running sum per vector lane, and the lane
      count differs between CPUs (AVX2, AVX-512).
    """
    squares, fourth_powers, elements = 0.0, 0.0, 0
    for stage in sorted({r["stage"] for r in ranks}):
        flats = torch.stack([r["flat"].double() for r in ranks if r["stage"] == stage])  # (DP, n_stage)
        mean = flats.mean(0)
        squares += mean.pow(2).sum().item()
        fourth_powers += mean.pow(4).sum().item()
        elements += mean.numel()
    communication = 2 * 2.0**-9 * math.sqrt(fourth_powers) / squares
    accumulation = math.sqrt(elements) * 2.0**-24
    return 4 * math.hypot(communication, accumulation)


@pytest.mark.distributed
def test_bf16_optimizer_hook_reads_the_fp32_accumulation_buffers(reference):
    ranks = run_distributed(4, _one_step, "bf16")
    assert {r["optimizer"] for r in ranks} == {"BF16_Optimizer"}
    hooked_small, hooked_big = norms_of_hooked_tensors(ranks)
    # The tensors the hook read are the ones DeepSpeed all-reduces and norms, up to DeepSpeed's own rounding
    # (measured here: 6.0e-5 relative, against a tolerance of 4.8e-4). One micro-batch's gradients instead of the
    # accumulated ones would be off by far more (several %: micro-batches differ by their noise, small > 1.05 big).
    tolerance = bf16_norm_tolerance(ranks)
    assert tolerance < 1e-3  # many elements contribute, so the comparison still means something
    assert hooked_big == pytest.approx(ranks[0]["global_norm"] ** 2, rel=tolerance)
    for result in ranks:
        assert result["grad_norm_squared_small"] == pytest.approx(hooked_small, rel=1e-9)  # both fp64 sums
        assert result["grad_norm_squared_big"] == pytest.approx(hooked_big, rel=tolerance)
    # Against the fp32 model: forward and backward ran in bf16 (8 significant bits, 2^-8 = 0.4% per rounding) through
    # 4 layers and a 50k-way softmax; measured 0.6% here. 2% leaves room for other CPUs' bf16 kernels.
    small, big = reference
    for result in ranks:
        assert result["grad_norm_squared_small"] == pytest.approx(small, rel=0.02)
        assert result["grad_norm_squared_big"] == pytest.approx(big, rel=0.02)


# -- the schedule -----------------------------------------------------------------------------------------------------
def schedule(**overrides) -> NoiseScaleBatchSchedule:
    return NoiseScaleBatchSchedule(**{"start": 8, "end": 64, "micro_batch_size": 2, "data_parallel_size": 2,
                                      **overrides})


def test_schedule_rounds_down_to_whole_micro_batches_and_never_decreases():
    s = schedule()
    assert s(0, None) == 8  # nothing measured yet
    assert s(1, 23.9) == 20  # rounded down to a multiple of 2 x 2
    assert s(2, 10.0) == 20  # never decreases
    assert s(3, 2.0) == 20
    assert s(4, 31.0) == 28
    assert s(5, 1e6) == 64  # bounded by train_batch_size
    assert s(6, math.inf) == 64
    assert s(7, 3.0) == 64


def test_schedule_bounds_and_factor():
    assert schedule()(1, 3.0) == 8  # never below start
    assert schedule()(1, -5.0) == 8  # a negative early estimate is just "small"
    assert schedule(factor=2.0)(1, 10.5) == 20
    assert schedule(factor=0.5)(1, 100.0) == 48


def test_schedule_changes_at_most_every_interval():
    s = schedule(interval_steps=3)
    assert s(1, 30.0) == 8  # the start of the run counts as a change
    assert s(2, 30.0) == 8
    assert s(3, 30.0) == 28
    assert s(4, 50.0) == 28
    assert s(5, 50.0) == 28
    assert s(6, 50.0) == 48
    assert s(7, 1e6) == 48
    assert s(9, 1e6) == 64


def test_schedule_state_round_trip():
    s = schedule(interval_steps=2)
    for step, noise in enumerate([None, 12.0, 17.0, 25.0]):
        s(step, noise)
    state = s.state_dict()
    assert state == {"batch": 16, "last_change_step": 2} and all(type(v) is int for v in state.values())
    restored = schedule(interval_steps=2)
    restored.load_state_dict(state)
    for step, noise in enumerate([40.0, 44.0, 60.0, 70.0, 5.0], start=4):
        assert restored(step, noise) == s(step, noise)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        restored.load_state_dict({"batch": 30, "last_change_step": 0})


@pytest.mark.parametrize("overrides, message", [
    ({"start": 6}, r"schedule.batch.start \(6\) must be a multiple of micro-batch x data-parallel size = 2 x 2 = 4"),
    ({"end": 66}, r"train_batch_size \(66\)"),
    ({"start": 128}, "larger than the full batch"),
    ({"factor": 0.0}, "factor must be positive"),
    ({"interval_steps": 0}, "interval_steps must be a positive integer"),
])
def test_schedule_refuses_bad_configuration(overrides, message):
    with pytest.raises(ValueError, match=message):
        schedule(**overrides)


# -- end to end: train.py with the noise-scale batch schedule ---------------------------------------------------------

NOISE_SCALE_RUN = ["parallelism.tensor_parallel_size=1", "parallelism.pipeline_parallel_size=2",  # DP 2 on 4 ranks
                   'schedule.batch={"type": "noise_scale", "start": 4, "factor": 2.0, "interval_steps": 2}']


@pytest.mark.distributed
def test_noise_scale_schedule_grows_the_batch_and_resumes_exactly(corpus, tmp_path):
    from tests.launch import run_training
    from training.metrics_log import read_metrics

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_training(corpus, straight, max_steps=8, extra=NOISE_SCALE_RUN)
    records = read_metrics(straight / "metrics.jsonl")
    batches = [r["global_batch"] for r in records]
    assert batches[0] == 4 and batches == sorted(batches) and batches[-1] > 4  # grows, never shrinks
    assert all(b % 4 == 0 and b <= 16 for b in batches)  # multiples of micro 2 x DP 2, at most the full batch
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert all(r["noise_scale"] is not None for r in records[1:])  # measured from the first step's reduction on

    run_training(corpus, resumed, max_steps=4, extra=NOISE_SCALE_RUN)
    run_training(corpus, resumed, max_steps=8, extra=NOISE_SCALE_RUN)
    fields = ("step", "loss", "lr", "global_batch", "noise_scale", "grad_norm_squared_small", "grad_norm_squared_big")
    assert [tuple(r[f] for f in fields) for r in read_metrics(resumed / "metrics.jsonl")] == [
        tuple(r[f] for f in fields) for r in records]
