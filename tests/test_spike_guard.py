"""The loss-spike guard reads training losses only, and reads them on the host once per step.

Unit tests drive ``SpikeGuard`` with losses that count every host read made on them or on anything computed from
them (a Tensor subclass); one single-process run of the real trainer and DeepSpeed engine, evaluating after every
step, checks that the guard's window holds exactly the training losses the trainer logged and that the guard
synchronised with the host once per training step and never inside the loss function.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from training.guards import SpikeGuard, SpikeGuardConfig

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


def test_one_host_read_per_step_and_none_inside_the_loss_function(reads) -> None:
    guard = SpikeGuard(SpikeGuardConfig(enabled=True, window=3))
    steps = [[4.0, 4.2, 3.8, 4.0], [3.9, 3.9, 3.9, 3.9], [4.1, 3.9, 4.0, 4.0], [3.8, 4.0, 4.0, 4.2]]
    for number, losses in enumerate(steps, 1):
        run_step(guard, losses, reads)
        assert len(reads) == number  # once per step, at end_step; steps 4 on are judged on the device
    assert list(guard.history) == [float32_mean(losses) for losses in steps[1:]]  # the window keeps the last 3


def float32_mean(losses: list[float]) -> float:
    """The step loss as DeepSpeed computes it: a float32 running sum, divided by the number of micro-batches."""
    total = np.float32(0)
    for loss in losses:
        total = np.float32(total + np.float32(loss))
    return float(np.float32(total / np.float32(len(losses))))


def test_a_spike_turns_the_last_micro_batch_loss_into_nan_and_stays_out_of_the_window(reads) -> None:
    guard = SpikeGuard(SpikeGuardConfig(enabled=True, window=3, threshold_std=3.0, min_increase=0.05))
    for losses in ([4.0, 4.1], [4.1, 4.0], [4.05, 4.05]):
        run_step(guard, losses, reads)
    window = list(guard.history)
    returned = run_step(guard, [4.0, 9.0], reads)
    assert returned[0].item() == 4.0 and math.isnan(returned[1].item())
    assert guard.spike_loss == pytest.approx(6.5) and list(guard.history) == window
    returned = run_step(guard, [4.0, 4.0], reads)  # the next ordinary step: no spike, into the window
    assert guard.spike_loss is None and [r.item() for r in returned] == [4.0, 4.0]
    assert list(guard.history) == window[1:] + [4.0]


def test_a_non_finite_step_is_neither_a_spike_nor_part_of_the_window(reads) -> None:
    guard = SpikeGuard(SpikeGuardConfig(enabled=True, window=2))
    for losses in ([4.0, 4.0], [4.0, 4.0]):
        run_step(guard, losses, reads)
    run_step(guard, [4.0, float("nan")], reads)
    assert guard.spike_loss is None and list(guard.history) == [4.0, 4.0]


def test_outside_a_training_step_the_guard_is_inactive(reads) -> None:
    guard = SpikeGuard(SpikeGuardConfig(enabled=True, window=2))
    run_step(guard, [4.0, 4.0], reads)
    run_step(guard, [4.0, 4.0], reads)
    reads.clear()
    for loss in (100.0, float("nan"), 3.0):  # what evaluation's eval_batch would pass
        returned = counting(loss)
        assert guard.observe(returned) is returned
    guard.end_step()
    assert reads == [] and list(guard.history) == [4.0, 4.0] and guard.spike_loss is None


# -- the real trainer, evaluating after every step ----------------------------------------------------------------
STEPS, WINDOW = 6, 4


def write_dataset(prefix: Path) -> None:
    from data.indexed_dataset import IndexedDatasetBuilder

    generator = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for _ in range(200):
            builder.add_item(generator.integers(0, 1000, size=int(generator.integers(20, 80))))
            builder.end_document()


def train_evaluating_every_step(prefix: str, save: str) -> dict:
    """One process (TP 1, PP 1): 6 steps of 4 micro-batches, an evaluation of 2 x 4 micro-batches after each."""
    from training.config import load_run_config
    from training.data import build_loader_factories
    from training.engine import build_engine
    from training.metrics_log import read_metrics
    from training.trainer import Trainer

    guard = f'{{"enabled": true, "window": {WINDOW}}}'
    config = load_run_config("ds_configs/tiny-cpu.json", [
        "model.num_layers=2", "model.seq_length=32", "train_micro_batch_size_per_gpu=2", "train_batch_size=8",
        "parallelism.tensor_parallel_size=1", "parallelism.pipeline_parallel_size=1", "schedule.batch={}",
        "schedule.warmup_tokens=512", "schedule.decay_tokens=4096", "schedule.train_tokens=4096",
        "data.split=\"90,10,0\"", f"data.blend=[[1.0, \"{prefix}\"]]", f"training.save=\"{save}\"",
        "training.save_interval=0", "training.log_interval=1", "training.eval_interval=1", "training.eval_iters=2",
        f"training.max_steps={STEPS}", f"training.spike_guard={guard}"])
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
    return {"window": list(trainer.spike_guard.history), "guard_reads": guard_reads,
            "reads_in_loss_function": reads_in_loss_function,
            "logged": [r["loss"] for r in read_metrics(Path(save) / "metrics.jsonl")],
            "evaluations": len(read_metrics(Path(save) / "metrics.jsonl", kind="valid")),
            "skipped_steps": int(engine.skipped_steps)}


@pytest.mark.distributed
def test_with_evaluation_every_step_the_window_holds_the_logged_training_losses(tmp_path) -> None:
    write_dataset(tmp_path / "data" / "corpus")
    result, = run_distributed(1, train_evaluating_every_step, str(tmp_path / "data" / "corpus"),
                              str(tmp_path / "checkpoints"))
    assert result["evaluations"] == STEPS and result["skipped_steps"] == 0
    assert len(result["logged"]) == STEPS
    # Steps 5 and 6 were judged against a full window; the window holds the last 4 training losses, bit for bit
    # what the trainer logged (DeepSpeed's mean of the same micro-batch losses); no validation loss got in.
    assert result["window"] == result["logged"][-WINDOW:]
    assert result["guard_reads"] == ["tolist"] * STEPS  # one host read per step, none for the evaluations
    assert result["reads_in_loss_function"] == []
