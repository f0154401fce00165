"""Build everything for one run, train, and always shut the process group down."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from model.parallel import init_distributed
from training.checkpoint import Layout, ResumePoint, check_writable, prepare_resume
from training.config import RunConfig
from training.data import build_loader_factories, check_datasets
from training.engine import build_engine
from training.trainer import Trainer, TrainState

MOE_NOT_YET = {  # what a Mixture-of-Experts model (model.moe) can describe but the pipeline does not train yet
    "expert_parallel": "parallelism.expert_parallel_size > 1 is not built yet (the experts split over data-parallel "
                       "ranks, their gradients reduced over the expert-data-parallel group by DeepSpeed's optimizer); "
                       "set it to 1: the experts are then replicated over the data-parallel ranks",
    "dualpipev": "parallelism.pipeline_schedule \"dualpipev\" with model.moe is not built yet; use \"1f1b\"",
}


def check_buildable(config: RunConfig) -> None:
    """Refuse what the config can describe but the pipeline does not build yet, before data or a process group."""
    moe = config.model.moe
    if moe is None:
        return
    if config.parallelism.expert_parallel_size > 1:
        raise ValueError(MOE_NOT_YET["expert_parallel"])
    if config.parallelism.pipeline_schedule == "dualpipev":
        raise ValueError(MOE_NOT_YET["dualpipev"])


def resume_point(config: RunConfig) -> ResumePoint | None:
    """Collective: the checked checkpoint to resume from; converted first when another layout wrote it."""
    if not config.training.save:
        return None
    parallel = config.parallelism
    now = Layout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                 parallel.data_parallel_size(dist.get_world_size()), parallel.pipeline_schedule)
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
                                   config.training.z_loss)
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
