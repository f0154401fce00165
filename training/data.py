"""The run's data: datasets checked at start-up, sample indices built once, one loader per DP rank."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from data.gpt_dataset import build_gpt_datasets
from data.indexed_dataset import IndexedDataset, check_vocab_size
from data.loader import MicroBatchLoader
from model.parallel import ParallelContext
from training.config import RunConfig

LoaderFactory = Callable[[int], Iterator]


def blend_as_data_path(config: RunConfig) -> list[str]:
    if not config.data.blend:
        raise ValueError(f"{config.source}: data.blend is empty: give datasets with --data-path PREFIX (or "
                         f"W1 PREFIX1 W2 PREFIX2 ...) or --set 'data.blend=[[1.0, \"path/prefix\"]]'")
    return [str(item) for weight, prefix in config.data.blend for item in (weight, prefix)]


def check_datasets(config: RunConfig) -> None:
    """Open every dataset (header, dtype and file sizes are checked on open) and check its token ids against the
    model's vocabulary, before any process group or model exists."""
    for prefix in blend_as_data_path(config)[1::2]:
        for suffix in (".idx", ".bin"):
            if not Path(prefix + suffix).exists():
                raise ValueError(f"{config.source}: dataset file {prefix + suffix} does not exist: preprocess the "
                                 f"corpus with tools/preprocess_data.py or fix data.blend")
        check_vocab_size(IndexedDataset(prefix), config.model.vocab_size)


def samples_needed(config: RunConfig) -> tuple[int, int, int]:
    """(train, valid, test) samples: enough for train_tokens plus one full batch, plus what spike rollbacks may jump
    over (each skips at most save_interval full batches), and every evaluation."""
    train = math.ceil(config.schedule.train_tokens / config.model.seq_length) + config.global_batch_size
    guard = config.training.spike_guard_config()
    if guard.enabled and guard.rollback:
        train += guard.max_rollbacks * max(config.training.save_interval, 1) * config.global_batch_size
    valid = config.training.eval_iters * config.global_batch_size
    return train, valid, 0


def build_loader_factories(config: RunConfig, ctx: ParallelContext) -> tuple[LoaderFactory, LoaderFactory | None]:
    """Datasets are built by the first rank of each node first (they cache their index arrays), then the others."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    train = valid = None
    for turn in (True, False):
        if (local_rank == 0) == turn:
            train, valid, _ = build_gpt_datasets(blend_as_data_path(config), config.data.split, config.model.seq_length,
                                                 samples_needed(config), config.training.seed, config.data.cache_dir)
        dist.barrier()

    def factory(dataset) -> LoaderFactory:
        return lambda consumed_samples: MicroBatchLoader(
            dataset, micro_batch_size=config.micro_batch_size, data_parallel_rank=ctx.data_parallel_rank,
            data_parallel_size=ctx.data_parallel_size, consumed_samples=consumed_samples,
            eod_mask_loss=config.data.eod_mask_loss, eod_token_id=config.data.eod_token_id)

    return factory(train), (factory(valid) if valid is not None else None)
