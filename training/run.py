"""Build everything for one run, train, and always shut the process group down."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from model.parallel import init_distributed
from runconfig.run import RunConfig
from training.checkpoint import Layout, ResumePoint, check_writable, prepare_resume
from training.data import build_loader_factories, check_datasets
from training.engine import build_engine
from training.plan_check import hardware_of
from training.trainer import Trainer, TrainState


def _expert_parallel_refusals(config: RunConfig) -> list[str]:
    """What expert parallelism (EP > 1) does not support yet, one line each."""
    ep = config.parallelism.expert_parallel_size
    zero = config.deepspeed.get("zero_optimization", {})
    refusals = []
    if zero.get("stage", 0) != 1:
        refusals.append(f"parallelism.expert_parallel_size {ep} needs zero_optimization.stage 1 (ZeRO-1 in fp32, "
                        f"BF16_Optimizer in bf16): without ZeRO, DeepSpeed's fp32 clipping averages the norms of "
                        f"ranks holding different experts (DeepSpeed #8475); stage 2 is not checked")
    if zero.get("reduce_scatter", True) is not True:
        refusals.append(f"parallelism.expert_parallel_size {ep} needs zero_optimization.reduce_scatter true "
                        f"(DeepSpeed's ZeRO-1 asserts it with experts)")
    if config.schedule.batch.get("type") == "noise_scale":
        refusals.append(f"parallelism.expert_parallel_size {ep} cannot drive schedule.batch by the noise scale: an "
                        f"expert's gradient before the reduction already sums its EP group's tokens, so it is not "
                        f"one replica's gradient; use a \"ramp\" batch schedule")
    return refusals


def check_buildable(config: RunConfig) -> None:
    """What the run config cannot check without training code, before data or a process group (train.py runs it with
    the config's own checks): training.plan_hardware against the planner's GPU presets, and what the config can
    describe but the pipeline does not build yet."""
    hardware_of(config.training.plan_hardware)
    if config.model.moe is not None and config.parallelism.expert_parallel_size > 1:
        refusals = _expert_parallel_refusals(config)
        if refusals:
            raise ValueError("; ".join(refusals))


def resume_point(config: RunConfig) -> ResumePoint | None:
    """Collective: the checked checkpoint to resume from; converted first when another layout wrote it."""
    if not config.training.save:
        return None
    parallel = config.parallelism
    now = Layout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                 parallel.data_axis_size(dist.get_world_size()), parallel.pipeline_schedule,
                 parallel.expert_parallel_size)
    log = print if dist.get_rank() == 0 else (lambda message: None)
    return prepare_resume(config.training.save, now, config.training.fallback_on_corrupt_checkpoint,
                          config.training.reshape_timeout_s, log)


def run(config: RunConfig) -> TrainState:
    finished = False
    try:
        check_buildable(config)
        check_datasets(config)  # a missing, truncated or too-large-vocabulary dataset fails here, not mid-run
        if config.training.save:
            check_writable(config.training.save)
        init_distributed(rendezvous_timeout_s=config.training.rendezvous_timeout_s)
        point = resume_point(config)
        deepspeed_config = config.deepspeed
        if point is not None and point.reshaped:
            deepspeed_config = {**deepspeed_config,
                                "checkpoint": {**deepspeed_config.get("checkpoint", {}), "load_universal": True}}
        engine, ctx = build_engine(config.model, config.parallelism, deepspeed_config, config.training.seed,
                                   config.training.z_loss, config.training.compile, config.training.dpo_config())
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {socket.gethostname()} (local rank "
              f"{os.environ.get('LOCAL_RANK', '0')}): {ctx.describe()}", flush=True)
        train_loader, valid_loader = build_loader_factories(config, ctx)
        state = Trainer(config, engine, ctx, train_loader, valid_loader, point).train()
        finished = True
        return state
    finally:
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()
