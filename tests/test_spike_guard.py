"""What a loss spike is (training/spikes.py), and the guard that skips one (training/guards.py).

The rule is tested on its own numbers: the limit at both of its terms, a 1.5x spike injected in a seeded noisy loss
curve found at its step and nowhere else, the table's non-finite and ignored steps, the state a checkpoint keeps.

The guard reads training losses only, and reads them on the host once per step. Unit tests drive ``SpikeGuard`` with
losses that count every host read made on them or on anything computed from them (a Tensor subclass); one
single-process run of the real trainer and DeepSpeed engine, evaluating after every step, checks that the guard's
EWM is exactly that of the training losses the trainer logged, that the log's detector agrees, and that the guard
synchronised with the host once per judged training step and never inside the loss function.
"""

from __future__ import annotations

import inspect
import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from runconfig.monitors import SpikeGuardConfig
from tests.distributed import run_distributed
from training.guards import SpikeGuard
from training.spikes import ALPHA, SpikeDetector, in_ignored_warmup

HOST_READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
              torch.Tensor.__bool__, torch.Tensor.numpy, torch.Tensor.cpu)


class HostReadCountingTensor(torch.Tensor):
    """A loss whose host reads (``.item()``, ``.tolist()``, ``float()``, ...) are counted, and so are those of every
    tensor computed from it (torch keeps the subclass through operations)."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture
def reads():
    HostReadCountingTensor.reads = []
    return HostReadCountingTensor.reads


def counting(value: float) -> torch.Tensor:
    return torch.tensor(value).as_subclass(HostReadCountingTensor)


def run_step(guard: SpikeGuard, losses: list[float], reads: list[str]) -> list[torch.Tensor]:
    before = len(reads)
    guard.begin_step(len(losses))
    returned = [guard.observe(counting(loss)) for loss in losses]
    assert len(reads) == before, "the guard read a loss on the host inside the loss function"
    guard.end_step()
    return returned


# -- the rule ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ewm, loss, spike", [
    (4.0, 4.79, False),  # above 1.5 nats the ratio term sets the limit: 1.2 x 4.0 = 4.8
    (4.0, 4.81, True),
    (1.0, 1.29, False),  # below it the margin does: 1.0 + 0.3 = 1.3, though 1.29 is already 29% up
    (1.0, 1.31, True),
])
def test_the_limit_is_the_larger_of_ratio_times_the_ewm_and_the_ewm_plus_the_margin(ewm, loss, spike) -> None:
    detector = SpikeDetector(ewm=ewm)
    assert detector.limit() == pytest.approx(max(1.2 * ewm, ewm + 0.3))
    assert detector.update(loss) is spike and detector.spikes == int(spike)


def noisy_curve(steps: int = 200, seed: int = 0) -> np.ndarray:
    """A loss decaying from 4 towards 3 (4.0 at step 0, 3.02 at step 199) with N(0, 0.02) noise."""
    noise = np.random.default_rng(seed).normal(0.0, 0.02, steps)
    return 3.0 + np.exp(-np.arange(steps) / 50.0) + noise


def judge(losses: np.ndarray) -> tuple[SpikeDetector, list[int], list[float]]:
    """(the detector after the curve, the steps it flagged, each step's loss / limit)."""
    detector, flagged, closeness = SpikeDetector(), [], []
    for step, loss in enumerate(losses.tolist()):
        limit = detector.limit()
        closeness.append(loss / limit if limit else 0.0)
        if detector.update(loss):
            flagged.append(step)
    return detector, flagged, closeness


def test_a_one_and_a_half_times_spike_in_a_noisy_curve_is_found_at_its_step_and_nowhere_else() -> None:
    clean = noisy_curve()
    detector, flagged, closeness = judge(clean)
    assert flagged == [] and detector.spikes == 0
    assert max(closeness) < 0.9  # no false positive, with room: noise of 0.02 nats against a limit 20% up

    spiked = clean.copy()
    spiked[120] *= 1.5  # 3.1 -> 4.6 nats, against a limit of 3.7
    detector, flagged, closeness = judge(spiked)
    assert flagged == [120] and detector.spikes == 1
    assert closeness[120] == pytest.approx(1.25, abs=0.01)
    # the spike stayed out of the EWM: from there on it is the clean curve's, bit for bit
    assert detector.ewm == judge(np.delete(clean, 120))[0].ewm


def test_a_non_finite_loss_is_a_spike_and_never_moves_the_ewm() -> None:
    detector = SpikeDetector()
    assert detector.update(float("nan")) and detector.ewm is None  # even before there is an EWM
    assert not detector.update(4.0) and detector.ewm == 4.0  # the first finite loss is the EWM
    assert detector.update(float("inf")) and detector.update(float("nan"))
    assert detector.ewm == 4.0 and detector.spikes == 3


def test_a_spike_stays_out_of_the_ewm_so_the_next_is_judged_against_the_level_before_it() -> None:
    detector = SpikeDetector(ewm=4.0)
    assert detector.update(6.0) and detector.ewm == 4.0
    assert detector.update(5.0) and detector.ewm == 4.0  # 5.0 > 4.8: judged against 4.0, not against 6.0
    assert not detector.update(3.5) and detector.ewm == 4.0 + ALPHA * (3.5 - 4.0) == pytest.approx(3.9)
    assert detector.spikes == 2


def test_ignored_steps_are_neither_judged_nor_fed() -> None:
    detector = SpikeDetector()
    for loss in (10.8, float("nan"), 7.0):  # the start of warmup: the loss falls from ln(vocabulary)
        assert not detector.update(loss, ignore=True)
    assert detector.ewm is None and detector.spikes == 0
    assert not detector.update(5.0) and detector.ewm == 5.0
    assert not detector.update(50.0, ignore=True) and detector.ewm == 5.0 and detector.spikes == 0
    # the ignored period: the steps that start before 10% of warmup's tokens
    assert [in_ignored_warmup(tokens, 1000) for tokens in (0, 99, 100, 5000)] == [True, True, False, False]
    assert not in_ignored_warmup(0, 0)  # no warmup, nothing ignored


def test_the_state_round_trips_through_a_checkpoint_file() -> None:
    detector = SpikeDetector(ratio=1.5, min_increase_nats=0.1)
    for loss in (5.0, 4.0, 9.0, 3.0):  # 9.0 > 1.5 x 4.8: one spike
        detector.update(loss)
    buffer = io.BytesIO()
    torch.save(detector.state_dict(), buffer)  # as the trainer's client_state and the guard's rank_state hold it
    buffer.seek(0)
    restored = SpikeDetector(ratio=1.5, min_increase_nats=0.1)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored == detector and restored.spikes == 1
    assert [restored.update(loss) for loss in (4.0, 8.0)] == [detector.update(loss) for loss in (4.0, 8.0)]
    assert restored == detector
    older = SpikeDetector()
    older.load_state_dict({"history": [4.0, 4.1]})  # the guard's state under the window rule: starts afresh
    assert older == SpikeDetector()


# -- the guard ------------------------------------------------------------------------------------------------------
def test_one_host_read_per_step_and_none_inside_the_loss_function(reads) -> None:
    guard = SpikeGuard(SpikeGuardConfig(enabled=True))
    steps = [[4.0, 4.2, 3.8, 4.0], [3.9, 3.9, 3.9, 3.9], [4.1, 3.9, 4.0, 4.0], [3.8, 4.0, 4.0, 4.2]]
    for number, losses in enumerate(steps, 1):
        run_step(guard, losses, reads)
        assert len(reads) == number  # once per step, at end_step; steps 2 on are judged on the device
    expected = SpikeDetector()
    for losses in steps:
        expected.update(float32_mean(losses))
    assert guard.detector == expected and guard.detector.spikes == 0  # the EWM of these step losses, bit for bit


def float32_mean(losses: list[float]) -> float:
    """The step loss as DeepSpeed computes it: a float32 running sum, divided by the number of micro-batches."""
    total = np.float32(0)
    for loss in losses:
        total = np.float32(total + np.float32(loss))
    return float(np.float32(total / np.float32(len(losses))))


def test_a_spike_turns_the_last_micro_batch_loss_into_nan_and_stays_out_of_the_ewm(reads) -> None:
    guard = SpikeGuard(SpikeGuardConfig(enabled=True))
    for losses in ([4.0, 4.1], [4.1, 4.0], [4.05, 4.05]):
        run_step(guard, losses, reads)
    ewm = guard.detector.ewm
    returned = run_step(guard, [4.0, 9.0], reads)  # a step loss of 6.5 against a limit of 1.2 x 4.05
    assert returned[0].item() == 4.0 and math.isnan(returned[1].item())
    assert guard.spike_loss == pytest.approx(6.5) and guard.detector.ewm == ewm and guard.detector.spikes == 1
    returned = run_step(guard, [4.0, 4.0], reads)  # the next ordinary step: no spike, into the EWM
    assert guard.spike_loss is None and [r.item() for r in returned] == [4.0, 4.0]
    assert guard.detector.ewm == ewm + ALPHA * (4.0 - ewm)


def test_the_device_decides_as_the_detector_right_at_the_limit(reads) -> None:
    """With an EWM of 4.0 the limit is 1.2 x 4.0 = 4.8, a double; the float32 loss nearest 4.8, 4.8000002, lies
    above it. Compared in float32 the limit would round to that same number and the step would pass: the guard
    compares in float64, as the detector does on the host, and both call it a spike."""
    guard = SpikeGuard(SpikeGuardConfig(enabled=True))
    run_step(guard, [4.0], reads)
    assert guard.detector.limit() == 4.8
    returned = run_step(guard, [4.8], reads)
    assert math.isnan(returned[0].item())
    assert guard.spike_loss == float(np.float32(4.8)) and guard.detector.spikes == 1


def test_a_non_finite_step_is_counted_but_left_to_deepspeed_and_stays_out_of_the_ewm(reads) -> None:
    """DeepSpeed skips it on its own and the trainer reports it as a non-finite step (no rollback for it)."""
    guard = SpikeGuard(SpikeGuardConfig(enabled=True))
    for losses in ([4.0, 4.0], [4.0, 4.0]):
        run_step(guard, losses, reads)
    run_step(guard, [4.0, float("nan")], reads)
    assert guard.spike_loss is None and guard.detector.ewm == 4.0 and guard.detector.spikes == 1


def test_an_ignored_step_is_neither_read_nor_judged_nor_fed(reads) -> None:
    guard = SpikeGuard(SpikeGuardConfig(enabled=True))
    run_step(guard, [4.0, 4.0], reads)
    reads.clear()
    guard.begin_step(2, ignore=True)  # the start of warmup
    losses = [counting(100.0), counting(100.0)]
    assert all(guard.observe(loss) is loss for loss in losses)
    guard.end_step()
    assert reads == [] and guard.spike_loss is None and guard.detector == SpikeDetector(ewm=4.0)


def test_outside_a_training_step_the_guard_is_inactive(reads) -> None:
    guard = SpikeGuard(SpikeGuardConfig(enabled=True))
    run_step(guard, [4.0, 4.0], reads)
    run_step(guard, [4.0, 4.0], reads)
    reads.clear()
    for loss in (100.0, float("nan"), 3.0):  # what evaluation's eval_batch would pass
        returned = counting(loss)
        assert guard.observe(returned) is returned
    guard.end_step()
    assert reads == [] and guard.detector == SpikeDetector(ewm=4.0) and guard.spike_loss is None


# -- the real trainer, evaluating after every step ----------------------------------------------------------------
STEPS, SEQ_LENGTH, WARMUP_TOKENS = 6, 32, 512  # 256 tokens a step: step 1 is in the ignored 51.2


def write_dataset(prefix: Path) -> None:
    from data.indexed_dataset import IndexedDatasetBuilder

    generator = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for _ in range(200):
            builder.add_item(generator.integers(0, 1000, size=int(generator.integers(20, 80))))
            builder.end_document()


def train_evaluating_every_step(prefix: str, save: str) -> dict:
    """One process (TP 1, PP 1): 6 steps of 4 micro-batches, an evaluation of 2 x 4 micro-batches after each."""
    from runconfig.run import load_run_config
    from training.data import build_loader_factories
    from training.engine import build_engine
    from training.metrics_log import read_metrics
    from training.trainer import Trainer

    config = load_run_config("ds_configs/tiny-cpu.json", [
        "model.num_layers=2", f"model.seq_length={SEQ_LENGTH}", "train_micro_batch_size_per_gpu=2", "train_batch_size=8",
        "parallelism.tensor_parallel_size=1", "parallelism.pipeline_parallel_size=1", "schedule.batch={}",
        f"schedule.warmup_tokens={WARMUP_TOKENS}", "schedule.decay_tokens=4096", "schedule.train_tokens=4096",
        "data.split=\"90,10,0\"", f"data.blend=[[1.0, \"{prefix}\"]]", f"training.save=\"{save}\"",
        "training.save_interval=0", "training.log_interval=1", "training.eval_interval=1", "training.eval_iters=2",
        f"training.max_steps={STEPS}", 'training.spike_guard={"enabled": true}'])
    engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, config.training.seed)
    trainer = Trainer(config, engine, ctx, *build_loader_factories(config, ctx))

    guarded_loss, in_loss_function = engine.module.loss_fn, [False]

    def loss_fn(outputs, labels):
        in_loss_function[0] = True
        try:
            return guarded_loss(outputs, labels)
        finally:
            in_loss_function[0] = False

    engine.module.loss_fn = loss_fn
    guard_reads, reads_in_loss_function = [], []
    originals = {read.__name__: read for read in HOST_READS}

    def counted(name: str):
        def read(tensor, *args, **kwargs):
            caller = inspect.currentframe().f_back.f_code.co_filename
            if caller.endswith(str(Path("training") / "guards.py")):
                guard_reads.append(name)
            if in_loss_function[0]:
                reads_in_loss_function.append(f"{name} from {caller}")
            return originals[name](tensor, *args, **kwargs)
        return read

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        trainer.train()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return {"guard": trainer.spike_guard.detector.state_dict(), "log": trainer.spike_detector.state_dict(),
            "guard_reads": guard_reads, "reads_in_loss_function": reads_in_loss_function,
            "logged": [(r["loss"], r["consumed_tokens"] - r["global_batch"] * SEQ_LENGTH, r["spikes"])
                       for r in read_metrics(Path(save) / "metrics.jsonl")],
            "evaluations": len(read_metrics(Path(save) / "metrics.jsonl", kind="valid")),
            "skipped_steps": int(engine.skipped_steps)}


@pytest.mark.distributed
def test_with_evaluation_every_step_the_ewm_is_that_of_the_logged_training_losses(tmp_path) -> None:
    write_dataset(tmp_path / "data" / "corpus")
    result, = run_distributed(1, train_evaluating_every_step, str(tmp_path / "data" / "corpus"),
                              str(tmp_path / "checkpoints"))
    assert result["evaluations"] == STEPS and result["skipped_steps"] == 0
    assert len(result["logged"]) == STEPS
    # Step 1 is ignored (the start of warmup), steps 3 to 6 were judged; the guard's EWM is that of the training
    # losses the trainer logged (DeepSpeed's mean of the same micro-batch losses), bit for bit, and so is the log's
    # own detector's; no validation loss got in.
    expected = SpikeDetector()
    for loss, tokens_before, _ in result["logged"]:
        expected.update(loss, ignore=in_ignored_warmup(tokens_before, WARMUP_TOKENS))
    assert result["guard"] == result["log"] == expected.state_dict() and expected.spikes == 0
    assert [spikes for _, _, spikes in result["logged"]] == [0] * STEPS
    assert result["guard_reads"] == ["tolist"] * (STEPS - 1)  # one host read per judged step, none for evaluations
    assert result["reads_in_loss_function"] == []
