"""The training loop: where the batch size changes, where the learning rate is set, where checkpoints happen.

Each step:
  1. global batch  = batch_schedule(tokens consumed before the step), or with schedule.batch.type "noise_scale"
                     factor x the noise scale measured up to the previous step  -> engine.set_train_batch_size
  2. learning rate = lr_schedule(tokens consumed after the step)        -> every optimizer param group
  3. engine.train_batch pulls batch / (micro x DP) micro-batches per DP rank from the loader
  4. counters advance (the data is consumed even when the update is skipped, see training/guards.py); the step's
     loss is judged by the spike rule (training/spikes.py) for the log's spike count;
     one all-reduce agrees on the step's status (a stop signal on any rank, a loss spike on any last stage);
     log / evaluate / checkpoint on their intervals; SIGTERM or SIGINT -> checkpoint on every rank and return;
     too many consecutive skipped steps -> stop with the batch positions; a spike with rollback -> reload the
     latest checkpoint and skip the data up to the spike.
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

from common.device import accelerator_device
from model.checkpoint_files import tag_for_step, universal_checkpoint_info
from model.flops import flops_per_iteration, model_flops_per_iteration, tflops_per_gpu
from model.parallel import ParallelContext
from model.pipe_schedules import PIPELINE_SCHEDULE_NAMES
from runconfig.monitors import snapshot_config
from runconfig.run import RunConfig
from runconfig.schedules import future_batches, pipeline_slots
from training import checkpoint
from training.compile import CompileClock
from training.data import describe_layout
from training.dpo import CHOSEN_ROWS
from training.engine import pipeline_schedule_of, set_global_batch
from training.faults import FaultPlan, FaultyLoader
from training.guards import SpikeGuard, attach_spike_guard
from training.loss_normalization import clear_step_tokens, set_step_tokens, take_micro_batches
from training.memory_snapshot import MemoryMonitor
from training.metrics import detect_peak_tflops, mfu
from training.metrics_log import MetricsLogger
from training.moe_monitor import MoEMonitor
from training.muon import clip_after_step
from training.noise_scale import NoiseScaleMonitor
from training.plan_check import open_plan_check
from training.preference_data import ReferenceModel
from training.profiling import StepProfiler
from training.spikes import SpikeDetector, in_ignored_warmup
from training.stability import StabilityMonitor
from training.task_evaluation import TaskEvaluation


@dataclass
class TrainState:
    """Everything the loop needs to continue exactly: saved in every checkpoint's client_state."""

    step: int = 0
    consumed_samples: int = 0
    """Samples trained on (or skipped by a non-applied update); the schedules count these."""
    consumed_tokens: int = 0
    global_batch: int = 0
    skipped_samples: int = 0
    """Samples of data jumped over by spike rollbacks: the loader reads from consumed + skipped."""
    consecutive_skips: int = 0
    rollbacks: int = 0

    @property
    def data_position(self) -> int:
        return self.consumed_samples + self.skipped_samples


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many skipped steps); the message says where and what to do."""


class StopRequest:
    """SIGTERM / SIGINT set a flag; the loop reads it after each step, agreed over all ranks."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class StepStatus:
    stop_requested: bool
    spike_loss: float | None


class Trainer:
    def __init__(self, config: RunConfig, engine: Any, ctx: ParallelContext, train_loader_factory,
                 valid_loader_factory=None, resume_point: checkpoint.ResumePoint | None = None) -> None:
        """``*_loader_factory(data_position)`` returns an iterator over this DP rank's micro-batches;
        ``resume_point`` is the checked checkpoint to resume from (training/checkpoint.py prepare_resume)."""
        self.config, self.engine, self.ctx = config, engine, ctx
        self.resume_point = resume_point
        self.saved_step: int | None = None
        self.lr_schedule = config.learning_rate_schedule()
        self.batch_schedule = config.batch_schedule()
        self.seq_length = config.model.seq_length
        self.make_train_loader, self.make_valid_loader = train_loader_factory, valid_loader_factory
        self.state = TrainState()
        self.peak_tflops = config.training.peak_tflops_per_gpu or detect_peak_tflops()
        self.logger = MetricsLogger(config, is_writer=dist.get_rank() == 0)
        # Measures the gradient noise scale at every step (DP >= 2): one ReduceGrads hook, one small all-reduce.
        self.noise_scale = NoiseScaleMonitor(engine, ctx, beta=config.training.noise_scale_beta, info=self.logger.info)
        self.noise_scale_schedule = config.noise_scale_schedule(ctx.data_parallel_size)
        self.faults = FaultPlan.from_environment()
        self.tasks = TaskEvaluation(config, engine, ctx, self.logger) if config.training.eval_tasks else None
        self.checkpointer = self._checkpointer() if config.training.save else None
        self.spike_guard = SpikeGuard(config.training.spike_guard_config())
        if self.spike_guard.config.enabled:  # it reads the step's loss (one host sync per step): only when asked
            attach_spike_guard(engine, self.spike_guard)
        # z-loss and log Z of every step, attention logits and update ratios every stability_interval steps: read
        # once per logged step (training/stability.py)
        self.stability = StabilityMonitor(engine, ctx, config.model.num_layers, config.training.stability_interval,
                                          config.training.z_loss, lambda: next(iter(self.make_train_loader(0))))
        self.moe = MoEMonitor(engine.module, config.model, ctx)
        self.profiler = StepProfiler(config.training.profile_config(), engine, dist.get_rank(), config.training.save)
        # the CUDA allocator's history and snapshots, the log's peak memory (training/memory_snapshot.py)
        self.memory = MemoryMonitor(snapshot_config(config.training), config.training.save, dist.get_rank(),
                                    self.logger.info)
        # measured against the planner's figures for this layout, on rank 0, which logs (training/plan_check.py)
        self.plan_check = open_plan_check(config, dist.get_world_size(), self.logger.info) \
            if dist.get_rank() == 0 else None
        # The log's spike count, on every run, guard or not: the same rule on train_batch's loss (_count_spike).
        self.spike_detector = SpikeDetector.of(self.spike_guard.config)
        self._pipeline_schedule: str | None = None  # the stream the last step ran (model/pipe_schedules.py)
        # training.compile: the blocks compile in the first step; one line after the second (training/compile.py)
        self.compile_clock = CompileClock(getattr(engine.module, "compiled_blocks", 0), self.logger.info)
        # training.dpo.reference "model": the frozen reference, run over each step's micro-batches (collective)
        dpo = config.training.dpo_config()
        self.reference = ReferenceModel(config) if dpo is not None and dpo.reference == "model" else None

    # -- the loop -------------------------------------------------------------------------------------------------
    def train(self) -> TrainState:
        self.resume()
        if self.checkpointer is not None:  # the host buffers, allocated before the first step, not at the first save
            self.checkpointer.rehearse(*self._checkpoint_states())
        rehearsed_after_a_step = self.checkpointer is None
        self.logger.info(describe_layout(self.config))
        self.logger.start_wandb(resumed=self.saved_step is not None, layout={
            "world_size": dist.get_world_size(), "data_parallel_size": self.ctx.data_parallel_size})
        if self.plan_check is not None:  # the plan's start-up figures beside the run's scalars (plan/...)
            self.logger.log_scalars("plan", self.state.step, self.plan_check.summary())
        loader = self._loader()
        stop = StopRequest()
        window = _Window()
        try:
            while not self.finished():
                with self.memory.guard(self.state.step + 1):  # on OOM: a snapshot, then the error
                    loss, skipped = self.train_step(loader)
                self.memory.after_step(self.state.step)
                if not rehearsed_after_a_step:  # the optimizer's state made by its first step (Adam's moments)
                    self.checkpointer.rehearse(*self._checkpoint_states())
                    rehearsed_after_a_step = True
                if not skipped:
                    self.state.consecutive_skips = 0
                status = self._agree_on_status(stop)
                if status.spike_loss is not None and not math.isfinite(loss):
                    loss = status.spike_loss  # the guard made the loss NaN to skip the update: log the loss it judged
                if self.checkpointer is not None:
                    self._committed(self.checkpointer.poll())  # the checkpoint in flight, once every writer is done
                window.add(self.state, flops_per_iteration(self.config.model, self.state.global_batch,
                                                           self.ctx.tensor_parallel_size,
                                                           pipeline_parallel_size=self.ctx.pipeline_parallel_size),
                           pipeline_slots(self.engine.gradient_accumulation_steps(), self.ctx.pipeline_parallel_size))
                if self.state.step % self.config.training.log_interval == 0:
                    self.log_step(loss, window.take())
                if skipped:
                    self._record_skip(loss, status)
                    if status.spike_loss is not None and self.spike_guard.config.rollback:
                        self.rollback()
                        loader = self._loader()
                        continue
                if self._due(self.config.training.eval_interval):
                    self.evaluate()
                if self.tasks is not None and self._due(self.config.training.eval_tasks_interval):
                    self.tasks.run(self.state.step, self.state.consumed_tokens)
                if status.stop_requested or self._due(self.config.training.save_interval):
                    self.save()
                if status.stop_requested:
                    self.finish_checkpoints()
                    self.logger.info(f"stop requested by a signal: checkpoint written at step {self.state.step}")
                    return self.state
            if not self._due(self.config.training.eval_interval):  # the last step was not evaluated yet
                self.evaluate()
            if self.tasks is not None and not self._due(self.config.training.eval_tasks_interval):
                self.tasks.run(self.state.step, self.state.consumed_tokens)
            self.save()
            self.finish_checkpoints()
            return self.state
        finally:
            stop.restore()
            if self.checkpointer is not None:
                self.checkpointer.close()
            self.memory.close()
            self.logger.close()

    def _loader(self):
        return FaultyLoader(self.make_train_loader(self.state.data_position), self.faults, self.config.model.vocab_size)

    def train_step(self, loader: FaultyLoader) -> tuple[float, bool]:
        """One optimizer step; returns the loss and whether DeepSpeed skipped the update."""
        batch = self.next_batch()
        set_global_batch(self.engine, self.ctx, batch)
        self._announce_pipeline_schedule()
        lr = self.lr_schedule(self.state.consumed_tokens + batch * self.seq_length)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        skipped_before = self.engine.skipped_steps
        loader.step = self.state.step + 1
        ignore_spikes = in_ignored_warmup(self.state.consumed_tokens, self.config.schedule.warmup_tokens)
        self.spike_guard.begin_step(self.engine.gradient_accumulation_steps(), ignore=ignore_spikes)
        self.stability.before_step(self.state.step + 1)
        self.profiler.before_step(self.state.step + 1)
        data, objective = loader, self.engine.module.objective
        if self.config.model.mtp is not None:  # lambda from its schedule; the record holds this step only
            objective.mtp_weight = self.config.model.mtp.weight_at(self.state.consumed_tokens)
            objective.take_mtp()
        dpo = self.config.training.dpo is not None  # its SFT term divides by the step's chosen targets
        clip = getattr(self.engine.module, "qk_clip", None)  # MuonClip's passes after the step take its batches again
        passes = clip is not None and clip.passes > 0
        counted = self.config.training.loss_normalization == "tokens" or dpo
        if passes or counted:
            data = take_micro_batches(loader, self.engine.gradient_accumulation_steps())
        if counted:  # the step's target count first (collective)
            if self.reference is not None:
                data = self.reference.fill(data)
            set_step_tokens(objective, data, self.engine.grid.get_data_parallel_group(), self.ctx.data_axis_size,
                            CHOSEN_ROWS if dpo else slice(None))
        step_batches = data if passes else None
        if passes or counted:
            data = iter(data)
        self.compile_clock.start()
        try:
            loss = self.engine.train_batch(data_iter=data).item()
        finally:
            self.spike_guard.end_step()  # evaluation, which runs the same loss function, finds the guard inactive
            clear_step_tokens(objective)  # and each micro-batch's own mean
        self.compile_clock.stop(self.engine.gradient_accumulation_steps())
        if step_batches is not None:  # collective: every rank
            skipped = self.engine.skipped_steps > skipped_before  # the weights are as they were: nothing to clip
            clip.passes_run = 0 if skipped else clip_after_step(self.engine, step_batches, clip)
        traced = self.profiler.after_step(self.state.step + 1)
        if traced is not None:
            print(f"[profile] rank {dist.get_rank()}: steps {self.profiler.config.steps[0]}-{self.state.step + 1} "
                  f"traced in {traced}", flush=True)
        self.noise_scale.after_step()  # collective: every rank, every step
        self.state.step += 1
        self.state.global_batch = batch
        self.state.consumed_samples += batch
        self.state.consumed_tokens += batch * self.seq_length
        self.stability.after_step(self.state.step)  # collective on its steps: the attention-logit probe
        skipped = self.engine.skipped_steps > skipped_before
        self.moe.after_step(applied=not skipped)  # a skipped update leaves the routers' bias too
        self._count_spike(loss, ignore_spikes)
        return loss, skipped

    def _announce_pipeline_schedule(self) -> None:
        """One line when the pipeline's instruction stream changes with the batch, and why (model/pipe_schedules.py)."""
        schedule, micro_batches = pipeline_schedule_of(self.engine), self.engine.gradient_accumulation_steps()
        if schedule == self._pipeline_schedule:
            return
        self._pipeline_schedule, twice_pp = schedule, 2 * self.ctx.pipeline_parallel_size
        why = {"1f1b": "parallelism.pipeline_schedule \"1f1b\"",
               "dualpipev": f"{micro_batches} micro-batches per pipeline >= 2 x PP = {twice_pp}",
               "vshape": f"{micro_batches} micro-batches per pipeline < 2 x PP = {twice_pp}, which DualPipeV needs"}
        self.logger.info(f"[pipeline] from step {self.state.step + 1}: {PIPELINE_SCHEDULE_NAMES[schedule]} "
                         f"({why[schedule]})")

    def _count_spike(self, loss: float, ignore: bool) -> None:
        """The log's ``spikes``: this trainer's own detector, fed the step loss DeepSpeed returns (the DP mean, the
        same on every rank). With the guard on, a step it skipped returns a NaN loss, which the rule counts as a
        spike too: one count either way, from one place."""
        ewm, limit = self.spike_detector.ewm, self.spike_detector.limit()
        if self.spike_detector.update(loss, ignore=ignore):
            level = "no EWM yet" if ewm is None else f"EWM {ewm:.4f} | limit {limit:.4f}"
            self.logger.info(f"[spike] step {self.state.step} | loss {loss:.4f} | {level} | "
                             f"spikes {self.spike_detector.spikes}")

    def _agree_on_status(self, stop: StopRequest) -> StepStatus:
        """One small all-reduce (MAX) per step: a signal on any rank, a spike on any last stage (and its loss)."""
        spike = self.spike_guard.spike_loss
        flags = torch.tensor([float(stop.requested), float(spike is not None), spike or 0.0],
                             device=accelerator_device())  # meets no module: the communication device
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return StepStatus(stop_requested=bool(flags[0]), spike_loss=flags[2].item() if flags[1] else None)

    def _record_skip(self, loss: float, status: StepStatus) -> None:
        state = self.state
        first = state.data_position - state.global_batch
        reason = (f"loss spike {status.spike_loss:.4f} above the guard's threshold" if status.spike_loss is not None
                  else f"non-finite loss or gradient (loss {loss}), or an fp16 loss-scale overflow")
        self.logger.log("skip", {"step": state.step, "consumed_tokens": state.consumed_tokens, "reason": reason,
                                 "first_sample": first, "last_sample": state.data_position - 1,
                                 "skipped_steps": int(self.engine.skipped_steps)})
        if status.spike_loss is not None and self.spike_guard.config.rollback:
            return
        state.consecutive_skips += 1
        limit = self.config.training.max_consecutive_skips
        if state.consecutive_skips >= limit:
            raise TrainingStopped(
                f"stopping: {state.consecutive_skips} consecutive steps were skipped (training.max_consecutive_skips "
                f"= {limit}), the last at step {state.step} on samples [{first}, {state.data_position}) ({reason}). "
                f"The weights are those of the last applied step; the latest checkpoint is "
                f"{checkpoint.read_latest(self.config.training.save) if self.config.training.save else None}. Inspect "
                f"the data there (tools/inspect_dataset.py), lower the learning rate, or relaunch with "
                f"training.spike_guard.rollback to jump over it")

    def next_batch(self) -> int:
        if self.noise_scale_schedule is not None:
            return self.noise_scale_schedule(self.state.step, self.noise_scale.noise_scale)
        return self.batch_schedule(self.state.consumed_tokens)

    def finished(self) -> bool:
        max_steps = self.config.training.max_steps
        return (self.state.consumed_tokens >= self.config.schedule.train_tokens
                or (max_steps is not None and self.state.step >= max_steps))

    def _due(self, interval: int) -> bool:
        return bool(interval) and self.state.step % interval == 0

    # -- metrics --------------------------------------------------------------------------------------------------
    def _progress(self, throughput: dict[str, float]) -> dict[str, float]:
        """Tokens per second (in total and per GPU), the share of schedule.train_tokens done, and the seconds left to
        it (training.max_steps, when it stops the run earlier, is not counted).

        The ETA counts the batches still to come, the ramp's real sizes step by step (runconfig/schedules.py
        future_batches), each at the time of its 1F1B step: the log window's seconds per pipeline slot (one
        micro-batch's forward and backward on a stage) times its micro-batches plus the pipeline's fill and drain. A
        ramp's small first batches are thus not taken for the pace of the whole run. With the noise-scale schedule,
        whose batches are not known ahead, the window's tokens per second."""
        target, done = self.config.schedule.train_tokens, self.state.consumed_tokens
        tokens_per_second = throughput["samples"] * self.seq_length / throughput["seconds"]
        if self.noise_scale_schedule is None:
            per_micro_batch = self.config.micro_batch_size * self.ctx.data_parallel_size
            slots = sum(steps * pipeline_slots(batch // per_micro_batch, self.ctx.pipeline_parallel_size)
                        for batch, steps in future_batches(self.batch_schedule, done, target, self.seq_length))
            eta = throughput["seconds"] / throughput["slots"] * slots
        else:
            eta = max(target - done, 0) / tokens_per_second
        return {"tokens_per_second": tokens_per_second,
                "tokens_per_second_per_gpu": tokens_per_second / dist.get_world_size(),
                "fraction_done": min(done / target, 1.0), "eta_seconds": eta}

    def log_step(self, loss: float, throughput: dict[str, float]) -> None:
        # hardware FLOPs (recompute included) -> TFLOP/s and HFU; model FLOPs (no recompute, PaLM's) -> MFU. Their
        # ratio does not depend on the batch (training/metrics.py)
        achieved = tflops_per_gpu(throughput["flops"], throughput["seconds"], dist.get_world_size())
        model, tp = self.config.model, self.ctx.tensor_parallel_size
        model_achieved = achieved * model_flops_per_iteration(model, 1, tp) / flops_per_iteration(
            model, 1, tp, pipeline_parallel_size=self.ctx.pipeline_parallel_size)
        grad_norm = self.engine.get_global_grad_norm()
        record = {
            **asdict(self.state),
            "micro_batches": self.engine.gradient_accumulation_steps(),
            "pipeline_schedule": pipeline_schedule_of(self.engine),
            "lr": self.engine.optimizer.param_groups[0]["lr"],
            "loss": loss,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped_steps": int(self.engine.skipped_steps),
            "spikes": self.spike_detector.spikes,
            "samples_per_second": throughput["samples"] / throughput["seconds"],
            **self._progress(throughput),
            "tflops_per_gpu": achieved,
            "model_tflops_per_gpu": model_achieved,
            "hfu": mfu(achieved, self.peak_tflops),
            "mfu": mfu(model_achieved, self.peak_tflops),
            "iteration_seconds": throughput["seconds"] / throughput["steps"],
            # CUDA: rank 0's largest allocation so far (the first stage, which holds the most micro-batches), and
            # its peak allocated and reserved in this window (training/memory_snapshot.py); None on CPU
            **self.memory.window_peaks(),
            **self.noise_scale.last,
        }
        stability = self.stability.take()  # collective: every rank, every logged step
        if "z_loss" in stability and self.config.training.z_loss:
            record["objective"], record["loss"] = loss, loss - stability["z_loss"]  # the loss stays the cross-entropy
        record.update(stability)
        record.update(self.moe.take())  # collective when the model has experts: every rank, every logged step
        record.update(self._multi_token_prediction(loss))  # collective with model.mtp
        if self.config.training.dpo is not None:  # TRL's rewards/* and logps/* (collective over the world)
            record.update(self.engine.module.objective.take_metrics(accelerator_device()))
        if self.plan_check is not None:  # the plan at the window's own batches, and measured / planned
            record.update(self.plan_check.compare(throughput["batches"], throughput["seconds"], record))
        self.logger.log("train", record)

    def _multi_token_prediction(self, loss: float) -> dict[str, Any]:
        """model.mtp's fields of a logged step (collective): ``loss`` the next-token cross-entropy, ``mtp_loss``
        each depth's, ``mtp_weight`` lambda, ``objective`` what the step minimised (model/loss.py)."""
        if self.config.model.mtp is None:
            return {}
        objective = self.engine.module.objective
        losses = objective.mtp_losses(accelerator_device())
        return {"objective": loss, **losses, "mtp_weight": objective.mtp_weight} if losses else {}

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
    def _checkpointer(self) -> checkpoint.Checkpointer:
        training = self.config.training
        checkpointer = checkpoint.Checkpointer(self.engine, training.save, training.checkpoint_mode,
                                               (training.keep_last, training.keep_every))
        self.faults.install_in_writer(checkpointer.files, dist.get_rank())
        writer = checkpointer.files.writer
        self.logger.info(f"[checkpoint] {training.checkpoint_mode} saves to {training.save}, written by process "
                         f"{writer.process.pid} ({'forked at start-up' if writer.method == 'fork' else 'spawned'})")
        return checkpointer

    def save(self) -> None:
        """Checkpoint the current step, once: the end of the run does not write again the step an interval wrote.
        In "async" mode this returns once the state is in host memory; the commit follows (``_committed``)."""
        if self.checkpointer is None or self.state.step == self.saved_step:
            return
        started = time.perf_counter()
        client_state, rank_state = self._checkpoint_states()
        committed = self.checkpointer.save(
            self.state.step, client_state, rank_state,
            before_commit=lambda step=self.state.step: self.faults.before_checkpoint_commit(step, dist.get_rank()))
        self.saved_step = self.state.step
        for entry in committed:
            self._committed(entry)
        # "training stopped for X s (mode" is what scripts/gpu_smoke_checks.py's stall check reads.
        stopped = f"checkpoint {tag_for_step(self.state.step)}: training stopped for {time.perf_counter() - started:.3f} s"
        if self.checkpointer.mode == "async":
            self.logger.info(f"{stopped} (async: in host memory after {self.checkpointer.files.blocked_s:.3f} s, "
                             f"being written in the background)")
        else:
            self.logger.info(f"{stopped} (sync: written and committed)")

    def _checkpoint_states(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a checkpoint holds beside DeepSpeed's state: the client state (every rank) and this rank's own."""
        client_state = {"train_state": asdict(self.state), "run_config": self.config.to_dict(),
                        "noise_scale": self.noise_scale.state_dict(), "spike_detector": self.spike_detector.state_dict(),
                        "noise_scale_schedule": self.noise_scale_schedule.state_dict()
                        if self.noise_scale_schedule is not None else None,
                        "universal_checkpoint_info": universal_checkpoint_info(self.config.model)}
        return client_state, {"spike_guard": self.spike_guard.state_dict()}

    def finish_checkpoints(self) -> None:
        """Wait for the checkpoint in flight and commit it (the end, a signal, a rollback)."""
        if self.checkpointer is not None:
            self._committed(self.checkpointer.wait())

    def _committed(self, committed: tuple[str, list[str]] | None) -> None:
        if committed is None:
            return
        tag, deleted = committed
        training = self.config.training
        self.logger.info(f"saved checkpoint {Path(training.save) / tag}")
        # TensorBoard and W&B: at the step it is committed (async: a step or more later), the step it holds
        self.logger.log_scalars("checkpoint", self.state.step, {"committed_step": int(tag.removeprefix("global_step"))})
        if deleted:
            self.logger.info(f"deleted checkpoint(s) {', '.join(deleted)} (training.keep_last = {training.keep_last}, "
                             f"keep_every = {training.keep_every})")

    def resume(self) -> None:
        directory = self.config.training.save
        point = self.resume_point
        loaded = checkpoint.load_checkpoint(self.engine, directory, point) if directory else None
        if loaded is None:
            if self.config.training.init_from:
                self.initialise_from(self.config.training.init_from)
            return
        client_state, rank_state = loaded
        self._restore(client_state, rank_state)
        self.saved_step = self.state.step
        if point is not None and point.reshaped:
            self.logger.info(f"{point.describe()}: fp32 master weights and Adam moments resliced by DeepSpeed's "
                             f"universal checkpoint; dropout streams re-seeded for the new ranks")
        self.logger.info(f"resumed from {directory} at step {self.state.step}, {self.state.consumed_tokens:,} tokens, "
                         f"{self.state.consumed_samples:,} samples")

    def _restore(self, client_state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        self.state = TrainState(**client_state["train_state"])
        self.spike_guard.load_state_dict(rank_state.get("spike_guard", {}))
        self.spike_detector.load_state_dict(client_state.get("spike_detector", {}))
        if client_state.get("noise_scale"):
            self.noise_scale.load_state_dict(client_state["noise_scale"])
        if self.noise_scale_schedule is not None and client_state.get("noise_scale_schedule"):
            self.noise_scale_schedule.load_state_dict(client_state["noise_scale_schedule"])
        # DeepSpeed does not restore a changed batch size: re-apply the one in force when the checkpoint was taken.
        if self.state.global_batch:
            set_global_batch(self.engine, self.ctx, self.state.global_batch)

    def rollback(self) -> None:
        """Reload the latest checkpoint and jump the data over everything from there to the spike."""
        directory = self.config.training.save
        spiked_at, spikes_seen = self.state, self.spike_detector.spikes
        self.finish_checkpoints()  # a checkpoint in flight is committed first: it may be the one to go back to
        loaded = checkpoint.load_checkpoint(self.engine, directory) if directory else None
        if loaded is None:
            raise TrainingStopped(f"a loss spike at step {spiked_at.step} asked for a rollback, but there is no "
                                  f"checkpoint in training.save ({directory}) to roll back to")
        if spiked_at.rollbacks >= self.spike_guard.config.max_rollbacks:
            raise TrainingStopped(f"stopping: a loss spike at step {spiked_at.step} after "
                                  f"{spiked_at.rollbacks} rollbacks (training.spike_guard.max_rollbacks): the spikes "
                                  f"come back whatever data is skipped; lower the learning rate or inspect the run")
        self._restore(*loaded)
        self.spike_detector.spikes = spikes_seen  # the EWM goes back with the checkpoint; the count does not
        self.state.skipped_samples = spiked_at.data_position - self.state.consumed_samples
        self.state.rollbacks = spiked_at.rollbacks + 1
        self.logger.log("rollback", {"step": self.state.step, "consumed_tokens": self.state.consumed_tokens,
                                     "spike_step": spiked_at.step, "skipped_samples": self.state.skipped_samples,
                                     "data_position": self.state.data_position})

    def initialise_from(self, directory: str) -> None:
        """Weights only (fresh optimizer), the data at sample 0; the schedules at 0 tokens with training.fine_tune,
        else at the checkpoint's consumed tokens (an import's start_tokens)."""
        from hf.importer import read_import_record

        start_tokens = checkpoint.load_weights(self.engine, directory)
        record = read_import_record(directory)
        start_tokens = record["start_tokens"] if record else start_tokens
        if self.config.training.fine_tune:
            self.state = TrainState()
            self.logger.info(f"fine-tuning from the weights of {directory} (training.fine_tune): schedules, data and "
                             f"optimizer start afresh (the checkpoint had seen {start_tokens:,} tokens)")
            return
        self.state = TrainState(consumed_tokens=start_tokens)
        self.logger.info(f"initialised the weights from {directory}; schedules start at "
                         f"{self.state.consumed_tokens:,} tokens")


class _Window:
    """Samples, FLOPs, pipeline slots (runconfig/schedules.py pipeline_slots), each step's global batch and wall time
    since the last log line: everything between two log lines, evaluations and checkpoint stalls included."""

    def __init__(self) -> None:
        self.start, self.samples, self.flops, self.slots = time.perf_counter(), 0, 0.0, 0
        self.batches: list[int] = []

    def add(self, state: TrainState, flops: float, slots: int) -> None:
        self.samples += state.global_batch
        self.flops += flops
        self.slots += slots
        self.batches.append(state.global_batch)

    def take(self) -> dict[str, Any]:
        now = time.perf_counter()
        out = {"seconds": max(now - self.start, 1e-9), "samples": self.samples, "flops": self.flops,
               "slots": self.slots, "steps": max(len(self.batches), 1), "batches": self.batches}
        self.start, self.samples, self.flops, self.slots, self.batches = now, 0, 0.0, 0, []
        return out
