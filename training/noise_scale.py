"""The gradient noise scale, measured online (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
appendix A.1), and a global-batch schedule driven by it.

What is measured
    Every data-parallel step has two batch sizes for free:
        B_small = micro-batch x gradient-accumulation steps   (the samples one DP replica accumulated)
        B_big   = B_small x DP                                  (the global batch)
    |G_small|^2 = squared norm of one replica's accumulated gradient, before the DP reduction, summed over the
                  tensor- and pipeline-parallel shards, then averaged over the DP replicas;
    |G_big|^2   = squared norm of the DP-reduced gradient, before clipping (DeepSpeed's global gradient norm).
    For gradients that are means over B i.i.d. samples, E|G_B|^2 = |G|^2 + tr(Sigma) / B, hence the unbiased
        |G|^2     ~= (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
        tr(Sigma) ~= (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)
    Each is a noisy single-step estimate; both are smoothed by an exponential moving average (with Adam's bias
    correction) BEFORE the ratio B_simple = tr(Sigma) / |G|^2 is taken (a ratio of averages, not an average of
    ratios, which the noisy and sometimes negative |G|^2 estimate would wreck). With DP = 1, B_small == B_big and
    nothing can be measured.

    The "sample" here is one sequence: a micro-batch loss is the masked mean over its tokens, so B_simple counts
    sequences, the unit of DeepSpeed's train_batch_size.

Where the gradients are, in DeepSpeed 0.19.8's PipelineEngine
    The last command of a training batch is [ReduceTiedGrads, ReduceGrads, OptimizerStep] on every stage
    (``runtime/pipe/schedule.py``). ``PipelineEngine._exec_schedule`` dispatches through ``self._INSTRUCTION_MAP``;
    ``NoiseScaleMonitor`` gives the engine instance its own copy of that map whose ReduceGrads handler first takes
    this rank's squared norm, then runs DeepSpeed's ``_exec_reduce_grads`` (the DP all-reduce). At that moment:
      * DeepSpeed has scaled each micro-batch loss by 1 / gradient_accumulation_steps (``_scale_loss_by_gas``), so
        the accumulated gradient is the mean over the replica's B_small samples;
      * ReduceTiedGrads has already summed the tied word embedding's gradient over the first and last stage, so
        the first stage's copy holds the whole gradient of that weight (the last stage's copy carries
        ``ds_pipe_replicated = True`` and is skipped, as DeepSpeed's own norm skips it);
      * (a) fp32 + ZeRO-1 (``DeepSpeedZeroOptimizer``, no partitioned gradients): the accumulated gradients are
        ``param.grad`` (``param.grad_accum`` when the optimizer keeps a separate accumulation dtype;
        ``optimizer.get_gradient_for_reduction`` picks the right one). Its backward hooks reduce nothing before
        the boundary: the pipeline engine reports a gradient-accumulation boundary only inside ReduceGrads /
        OptimizerStep (``_force_grad_boundary``). ``reduce_gradients`` then copies them into the flat partition
        and sets ``param.grad = None``: after ReduceGrads they are gone, hence the hook;
      * (b) bf16 + ``data_types.grad_accum_dtype = fp32`` + ZeRO-1 runs ``BF16_Optimizer`` instead: after every
        backward (``update_hp_grads``, or per-parameter hooks with ``immediate_grad_update``) the bf16 gradient is
        added into fp32 buffers, ``optimizer.fp32_groups_gradients[group][index]`` (views of
        ``fp32_groups_gradients_flat``, also reachable as ``param._hp_grad``); ``_bf16_reduce_grads`` all-reduces
        those flat buffers. The bf16 ``param.grad`` is not the accumulated gradient and is not read.
    Both are verified by tests/test_noise_scale.py on 4 CPU processes (PP 2 x DP 2, gloo): for (a) the hooked
    |G_small|^2 and |G_big|^2 equal those of per-replica gradients materialised by a single-process PyTorch model
    to 1e-5; for (a) and (b) the squared norm of the DP mean of exactly the tensors the hook read equals
    DeepSpeed's own global norm squared (so the hook reads the buffers DeepSpeed then reduces and norms), and (b)
    agrees with the fp32 reference to bf16 accuracy.

    Which parameters count (DeepSpeed's norm rules, ``get_grad_norm_direct`` / ``BF16_Optimizer.get_grads_for_norm``):
    a ``tensor_model_parallel`` parameter on every TP rank, a replicated one on TP rank 0 only, one with
    ``ds_pipe_replicated`` not at all. The per-rank squares are summed over the whole world in the one extra
    collective of a step (a 2-element all-reduce after ``train_batch``, never inside DeepSpeed's schedule), and
    divided by DP.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from common.deepspeed_internals import accumulated_gradients, norm_dtype, run_before_instruction
from common.device import accelerator_device, device_of
from model.parallel import ParallelContext


class GradientNoiseScale:
    """The estimator of appendix A.1, with exponential moving averages of |G|^2 and tr(Sigma). No communication.

    ``update`` takes one step's batch sizes and squared norms; ``noise_scale`` is B_simple = tr(Sigma) / |G|^2 from
    the bias-corrected averages (None before the first update, or while the averaged |G|^2 is not positive: the
    gradient is then indistinguishable from noise at these batch sizes).
    """

    def __init__(self, beta: float = 0.99) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"the noise-scale moving-average beta must be in [0, 1), got {beta}")
        self.beta = beta
        self.updates = 0
        self.ema_gradient_squared = 0.0  # biased EMA of the |G|^2 estimates
        self.ema_trace = 0.0  # biased EMA of the tr(Sigma) estimates

    @staticmethod
    def single_step(small_batch: float, small_squared: float, big_batch: float,
                    big_squared: float) -> tuple[float, float]:
        """Unbiased one-step estimates (|G|^2, tr(Sigma)) from the two batch sizes."""
        if not 0 < small_batch < big_batch:
            raise ValueError(f"the noise scale needs 0 < B_small < B_big, got B_small = {small_batch}, "
                             f"B_big = {big_batch} (B_small == B_big when data parallelism is 1)")
        gradient_squared = (big_batch * big_squared - small_batch * small_squared) / (big_batch - small_batch)
        trace = (small_squared - big_squared) / (1.0 / small_batch - 1.0 / big_batch)
        return gradient_squared, trace

    def update(self, small_batch: float, small_squared: float, big_batch: float, big_squared: float) -> bool:
        """Fold in one step; returns False (and changes nothing) if a squared norm is not finite (a skipped step)."""
        if not (math.isfinite(small_squared) and math.isfinite(big_squared)):
            return False
        gradient_squared, trace = self.single_step(small_batch, small_squared, big_batch, big_squared)
        self.ema_gradient_squared = self.beta * self.ema_gradient_squared + (1.0 - self.beta) * gradient_squared
        self.ema_trace = self.beta * self.ema_trace + (1.0 - self.beta) * trace
        self.updates += 1
        return True

    def _bias_correction(self) -> float:
        return 1.0 - self.beta ** self.updates

    @property
    def gradient_squared(self) -> float | None:
        """Smoothed |G|^2 (the true gradient's squared norm)."""
        return self.ema_gradient_squared / self._bias_correction() if self.updates else None

    @property
    def trace(self) -> float | None:
        """Smoothed tr(Sigma) (the per-sample gradient covariance's trace)."""
        return self.ema_trace / self._bias_correction() if self.updates else None

    @property
    def noise_scale(self) -> float | None:
        """B_simple = tr(Sigma) / |G|^2, in samples."""
        if not self.updates or self.ema_gradient_squared <= 0.0:
            return None
        return self.ema_trace / self.ema_gradient_squared  # the bias corrections cancel

    def state_dict(self) -> dict[str, float | int]:
        """Plain floats and ints (checkpoints stay loadable with weights_only=True)."""
        return {"updates": self.updates, "ema_gradient_squared": self.ema_gradient_squared, "ema_trace": self.ema_trace}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """The averages continue with this estimator's beta (the configured one, if a resumed run changed it)."""
        self.updates = int(state["updates"])
        self.ema_gradient_squared = float(state["ema_gradient_squared"])
        self.ema_trace = float(state["ema_trace"])


def counts_in_norm(param: torch.nn.Parameter, tensor_parallel_rank: int) -> bool:
    """DeepSpeed's rule for the global norm: TP shards on every TP rank, replicated parameters on TP rank 0 only,
    pipeline-replicated copies (the tied embedding on the last stage) never."""
    if getattr(param, "ds_pipe_replicated", False):
        return False
    sharded = getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False)
    return bool(sharded) or tensor_parallel_rank == 0


class NoiseScaleMonitor:
    """Measures |G_small|^2 and |G_big|^2 at every ``engine.train_batch`` of a DeepSpeed PipelineEngine.

    Construct it after the engine (it hooks the engine instance's ReduceGrads handler); call ``after_step()`` on
    every rank after each ``train_batch``: it does the step's one extra all-reduce, updates the estimator and returns
    the fields to log (also kept in ``last``). With DP = 1 it installs nothing, says once why, and reports None.
    A skipped step (non-finite gradients: fp16 overflow, a NaN loss, the spike guard) leaves the averages as they
    are: every rank sees the same non-finite sums and skips alike.
    """

    def __init__(self, engine: Any, ctx: ParallelContext, beta: float = 0.99,
                 info: Callable[[str], None] | None = None) -> None:
        self.engine, self.ctx = engine, ctx
        self.estimator = GradientNoiseScale(beta)
        self.info = info or _print_on_rank_zero
        # under context parallelism a rank's gradient is that of its sequence slices, not of a replica's batch
        self.enabled = ctx.data_parallel_size > 1 and ctx.expert_parallel_size == 1 and ctx.context_parallel_size == 1
        self.last: dict[str, float | None] = {"noise_scale": None}
        self._local_squared: torch.Tensor | None = None
        if ctx.data_parallel_size == 1:
            self.info("gradient noise scale: not measured. It compares one replica's gradient (B_small = "
                      "micro-batch x accumulation steps) with the data-parallel mean (B_big = B_small x DP); "
                      "with data parallelism 1 the two batches are the same, B_small == B_big")
        elif ctx.context_parallel_size > 1:
            self.info(f"gradient noise scale: not measured. It needs one replica's gradient (B_small = micro-batch x "
                      f"accumulation steps); with context parallelism {ctx.context_parallel_size} a rank's gradient "
                      f"before the reduction is that of its slices of the sequence, and no rank holds a replica's")
        elif not self.enabled:
            self.info(f"gradient noise scale: not measured. It needs one replica's gradient; with expert "
                      f"parallelism {ctx.expert_parallel_size} an expert's gradient before the reduction already sums "
                      f"the tokens of its EP group (the all-to-all's backward), so no rank holds one replica's")
        if not self.enabled:
            return
        accumulated_gradients(engine.optimizer)  # refuse an unsupported optimizer now, not at the first step
        self._install_hook()

    def _install_hook(self) -> None:
        run_before_instruction(self.engine, "ReduceGrads", self._measure)

    def _measure(self) -> None:
        self._local_squared = self.local_squared_norm()

    def counted_gradients(self) -> list[torch.Tensor]:
        """This rank's accumulated gradients that enter the norm, as they are now (before ReduceGrads)."""
        rank = self.ctx.tensor_parallel_rank
        return [grad for param, grad in accumulated_gradients(self.engine.optimizer)
                if grad is not None and counts_in_norm(param, rank)]

    def local_squared_norm(self) -> torch.Tensor:
        """This rank's share of the replica's |G_small|^2, loss scaling removed.

        Accumulated in fp64 where the device has it, as DeepSpeed's norms are (``get_norm_dtype``): on CPU an fp32
        norm of the 3.2M-element embedding gradient is 1.6e-5 (relative) off.
        """
        dtype = norm_dtype()
        grads = self.counted_gradients()
        if not grads:
            return torch.zeros((), dtype=dtype, device=device_of(self.engine.module))
        norms = torch.stack([torch.linalg.vector_norm(grad, dtype=dtype) for grad in grads])
        loss_scale = float(getattr(self.engine.optimizer, "loss_scale", 1.0) or 1.0)  # fp16 only; else 1
        return norms.pow(2).sum() / loss_scale**2

    def after_step(self) -> dict[str, float | None]:
        """Collective. Reduce the step's squared norms, update the moving averages, return the log fields."""
        if not self.enabled:
            return dict(self.last)
        if self._local_squared is None:
            raise RuntimeError("NoiseScaleMonitor.after_step() without a train_batch since the last call: the "
                               "ReduceGrads hook did not run")
        small_batch = self.engine.train_micro_batch_size_per_gpu() * self.engine.gradient_accumulation_steps()
        big_batch = self.engine.train_batch_size()
        global_norm = self.engine.get_global_grad_norm()
        if global_norm is None:
            self.enabled = False
            self.info("gradient noise scale: not measured: DeepSpeed computes no global gradient norm in this "
                      "configuration (engine.get_global_grad_norm() is None)")
            return dict(self.last)
        world = dist.get_world_size()
        # The world sum of the shards' squares is the sum over replicas of |G_small|^2. |G_big|^2 travels in the
        # same all-reduce (as a world mean) so that every rank holds the one reduced value and takes the same
        # batch decisions, whatever rounding each model-parallel group's norm reduction had.
        squared = self._local_squared
        sums = torch.stack([squared, torch.tensor(float(global_norm) ** 2 / world, dtype=squared.dtype,
                                                  device=squared.device)]).to(accelerator_device())
        dist.all_reduce(sums)
        self._local_squared = None
        small_squared = sums[0].item() / self.ctx.data_parallel_size
        big_squared = sums[1].item()
        self.estimator.update(small_batch, small_squared, big_batch, big_squared)
        self.last = {"noise_scale": self.estimator.noise_scale, "noise_scale_trace": self.estimator.trace,
                     "noise_scale_gradient_squared": self.estimator.gradient_squared,
                     "grad_norm_squared_small": small_squared, "grad_norm_squared_big": big_squared,
                     "noise_scale_small_batch": small_batch}
        return dict(self.last)

    @property
    def noise_scale(self) -> float | None:
        return self.estimator.noise_scale if self.enabled else None

    def state_dict(self) -> dict[str, float | int]:
        return self.estimator.state_dict()

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.estimator.load_state_dict(state)


def _print_on_rank_zero(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
