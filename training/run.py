"""Build everything for one run, train, and always shut the process group down."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from model.parallel import init_distributed
from training.checkpoint import check_writable
from training.config import RunConfig
from training.data import build_loader_factories, check_datasets
from training.engine import build_engine
from training.trainer import Trainer, TrainState


def run(config: RunConfig) -> TrainState:
    finished = False
    try:
        check_datasets(config)  # a missing, truncated or too-large-vocabulary dataset fails here, not mid-run
        if config.training.save:
            check_writable(config.training.save)
        init_distributed(rendezvous_timeout_s=config.training.rendezvous_timeout_s)
        engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, config.training.seed)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {socket.gethostname()} (local rank "
              f"{os.environ.get('LOCAL_RANK', '0')}): {ctx.describe()}", flush=True)
        train_loader, valid_loader = build_loader_factories(config, ctx)
        state = Trainer(config, engine, ctx, train_loader, valid_loader).train()
        finished = True
        return state
    finally:
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()
