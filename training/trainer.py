"""The training loop: where the batch size changes, where the learning rate is set, where checkpoints happen.

Each step:
  1. global batch  = batch_schedule(tokens consumed before the step)   -> engine.set_train_batch_size
  2. learning rate = lr_schedule(tokens consumed after the step)        -> every optimizer param group
  3. engine.train_batch pulls batch / (micro x DP) micro-batches per DP rank from the loader
  4. counters advance; log / evaluate / checkpoint on their intervals; SIGTERM or SIGINT on any rank ->
     checkpoint on every rank and return.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from model.parallel import ParallelContext, device
from training import checkpoint
from training.config import RunConfig
from training.metrics import detect_peak_tflops, flops_per_iteration, mfu, tflops_per_gpu
from training.metrics_log import MetricsLogger


@dataclass
class TrainState:
    """Everything the loop needs to continue exactly: saved in every checkpoint's client_state."""

    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    global_batch: int = 0


class StopRequest:
    """SIGTERM / SIGINT set a flag; the loop checks it after each step, agreed over all ranks."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def any_rank(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    def __init__(self, config: RunConfig, engine: Any, ctx: ParallelContext, train_loader_factory,
                 valid_loader_factory=None) -> None:
        """``*_loader_factory(consumed_samples)`` returns an iterator over this DP rank's micro-batches."""
        self.config, self.engine, self.ctx = config, engine, ctx
        self.lr_schedule = config.learning_rate_schedule()
        self.batch_schedule = config.batch_schedule()
        self.seq_length = config.model.seq_length
        self.make_train_loader, self.make_valid_loader = train_loader_factory, valid_loader_factory
        self.state = TrainState()
        self.peak_tflops = config.training.peak_tflops_per_gpu or detect_peak_tflops()
        self.logger = MetricsLogger(config, is_writer=dist.get_rank() == 0)

    # -- the loop -------------------------------------------------------------------------------------------------
    def train(self) -> TrainState:
        self.resume()
        loader = self.make_train_loader(self.state.consumed_samples)
        stop = StopRequest()
        window = _Window()
        try:
            while not self.finished():
                loss = self.train_step(loader)
                window.add(self.state, flops_per_iteration(self.config.model, self.state.global_batch,
                                                           self.ctx.tensor_parallel_size))
                if self.state.step % self.config.training.log_interval == 0:
                    self.log_step(loss, window.take())
                stopping = stop.any_rank()
                if self._due(self.config.training.eval_interval):
                    self.evaluate()
                if stopping or self._due(self.config.training.save_interval):
                    self.save()
                if stopping:
                    self.logger.info(f"stop requested by a signal: checkpoint written at step {self.state.step}")
                    return self.state
            if not self._due(self.config.training.eval_interval):  # the last step was not evaluated yet
                self.evaluate()
            self.save()
            return self.state
        finally:
            stop.restore()
            self.logger.close()

    def train_step(self, loader) -> float:
        batch = self.batch_schedule(self.state.consumed_tokens)
        if batch != self.engine.train_batch_size():
            self.engine.set_train_batch_size(batch)
        lr = self.lr_schedule(self.state.consumed_tokens + batch * self.seq_length)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        loss = self.engine.train_batch(data_iter=loader).item()
        self.state.step += 1
        self.state.global_batch = batch
        self.state.consumed_samples += batch
        self.state.consumed_tokens += batch * self.seq_length
        return loss

    def finished(self) -> bool:
        max_steps = self.config.training.max_steps
        return (self.state.consumed_tokens >= self.config.schedule.train_tokens
                or (max_steps is not None and self.state.step >= max_steps))

    def _due(self, interval: int) -> bool:
        return bool(interval) and self.state.step % interval == 0

    # -- metrics --------------------------------------------------------------------------------------------------
    def log_step(self, loss: float, throughput: dict[str, float]) -> None:
        achieved = tflops_per_gpu(throughput["flops"], throughput["seconds"], dist.get_world_size())
        grad_norm = self.engine.get_global_grad_norm()
        record = {
            **asdict(self.state),
            "micro_batches": self.engine.gradient_accumulation_steps(),
            "lr": self.engine.optimizer.param_groups[0]["lr"],
            "loss": loss,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped_steps": int(self.engine.skipped_steps),
            "samples_per_second": throughput["samples"] / throughput["seconds"],
            "tokens_per_second": throughput["samples"] * self.seq_length / throughput["seconds"],
            "tflops_per_gpu": achieved,
            "mfu": mfu(achieved, self.peak_tflops),
        }
        self.logger.log("train", record)

    def evaluate(self) -> float | None:
        if not self.make_valid_loader or not self.config.training.eval_iters:
            return None
        loader = self.make_valid_loader(0)
        # Always the full batch, whatever the ramp is at: evaluations stay comparable along the run.
        micro_batches = self.config.global_batch_size // (self.config.micro_batch_size * self.ctx.data_parallel_size)
        losses = [self.engine.eval_batch(data_iter=loader, num_micro_batches=micro_batches).item()
                  for _ in range(self.config.training.eval_iters)]
        loss = sum(losses) / len(losses)
        self.logger.log("valid", {"step": self.state.step, "consumed_tokens": self.state.consumed_tokens,
                                  "loss": loss, "perplexity": math.exp(min(loss, 50.0))})
        return loss

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def save(self) -> None:
        directory = self.config.training.save
        if not directory:
            return
        Path(directory).mkdir(parents=True, exist_ok=True)
        tag = checkpoint.save_checkpoint(self.engine, directory, self.state.step,
                                         {"train_state": asdict(self.state), "run_config": self.config.to_dict()})
        self.logger.info(f"saved checkpoint {Path(directory) / tag}")

    def resume(self) -> None:
        directory = self.config.training.save
        client_state = checkpoint.load_checkpoint(self.engine, directory) if directory else None
        if client_state is None:
            if self.config.training.init_from:
                self.initialise_from(self.config.training.init_from)
            return
        self.state = TrainState(**client_state["train_state"])
        # DeepSpeed does not restore a changed batch size: re-apply the one in force when the checkpoint was taken.
        if self.state.global_batch and self.state.global_batch != self.engine.train_batch_size():
            self.engine.set_train_batch_size(self.state.global_batch)
        self.logger.info(f"resumed from {directory} at step {self.state.step}, {self.state.consumed_tokens:,} tokens, "
                         f"{self.state.consumed_samples:,} samples")


    def initialise_from(self, directory: str) -> None:
        """Weights only (fresh optimizer); the schedules start at the import's start_tokens, the data at sample 0."""
        from model.hf_conversion import read_import_record

        start_tokens = checkpoint.load_weights(self.engine, directory)
        record = read_import_record(directory)
        self.state = TrainState(consumed_tokens=record["start_tokens"] if record else start_tokens)
        self.logger.info(f"initialised the weights from {directory}; schedules start at "
                         f"{self.state.consumed_tokens:,} tokens")


class _Window:
    """Samples, FLOPs and wall time since the last log line."""

    def __init__(self) -> None:
        self.start, self.samples, self.flops = time.perf_counter(), 0, 0.0

    def add(self, state: TrainState, flops: float) -> None:
        self.samples += state.global_batch
        self.flops += flops

    def take(self) -> dict[str, float]:
        now = time.perf_counter()
        out = {"seconds": max(now - self.start, 1e-9), "samples": self.samples, "flops": self.flops}
        self.start, self.samples, self.flops = now, 0, 0.0
        return out
