"""The run's data: datasets checked at start-up, sample indices built once per node, one loader per DP rank (its CP
slice of each sample under context parallelism)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from common.device import accelerator_device
from data.gpt_dataset import build_gpt_datasets
from data.index_cache import DEFAULT_FALLBACK_DIRECTORY, IndexCachePolicy
from data.indexed_dataset import IndexedDataset, check_vocab_size
from data.loader import DevicePrefetcher, MicroBatchLoader, SampleDataset, check_end_token_rule
from data.loss_mask import find_loss_mask, loss_mask_prefix
from model.config import set_option
from model.parallel import ParallelContext
from runconfig.run import RunConfig
from training.preference_data import PairLoader, describe_preference_layout, open_preference_data, train_rows

LoaderFactory = Callable[[int], Iterator]


def blend_as_data_path(config: RunConfig) -> list[str]:
    if not config.data.blend:
        raise ValueError(f"{config.source}: data.blend is empty: give datasets with --data-path PREFIX (or "
                         f"W1 PREFIX1 W2 PREFIX2 ...) or {set_option('data.blend', [[1.0, 'path/prefix']])}")
    return [str(item) for weight, prefix in config.data.blend for item in (weight, prefix)]


def check_datasets(config: RunConfig) -> None:
    """Open every dataset (header, dtype and file sizes are checked on open) and check its token ids against the
    model's vocabulary, before any process group or model exists; under training.dpo the preference set and its
    reference log-probs (training/preference_data.py)."""
    if config.training.dpo is not None:
        open_preference_data(config, check_files=True)
        return
    for prefix in blend_as_data_path(config)[1::2]:
        for suffix in (".idx", ".bin"):
            if not Path(prefix + suffix).exists():
                raise ValueError(f"{config.source}: dataset file {prefix + suffix} does not exist: preprocess the "
                                 f"corpus with tools/preprocess_data.py or fix data.blend")
        indexed = IndexedDataset(prefix)
        check_vocab_size(indexed, config.model.vocab_size)
        find_loss_mask(prefix)  # a loss mask beside the tokens is checked against them (data/loss_mask.py)
        if data_layout(config).end_token_rule:
            check_end_token_rule(indexed, config.data.eod_token_id)


def samples_needed(config: RunConfig) -> tuple[int, int, int]:
    """(train, valid, test) samples: enough for train_tokens plus one full batch, plus what spike rollbacks may jump
    over (each skips at most save_interval full batches), and every evaluation."""
    train = math.ceil(config.schedule.train_tokens / config.model.seq_length) + config.global_batch_size
    guard = config.training.spike_guard_config()
    if guard.enabled and guard.rollback:
        train += guard.max_rollbacks * max(config.training.save_interval, 1) * config.global_batch_size
    valid = config.training.eval_iters * config.global_batch_size
    return train, valid, 0


def index_cache_policy(config: RunConfig) -> IndexCachePolicy:
    """data.cache_dir, or beside each dataset with <save>/index-cache (else ~/.cache/...) for read-only folders;
    the node's first process (LOCAL_RANK 0) builds, the others wait up to data.cache_timeout_s."""
    save = config.training.save
    fallback = os.path.join(save, "index-cache") if save else DEFAULT_FALLBACK_DIRECTORY
    return IndexCachePolicy(directory=config.data.cache_dir, fallback_directory=fallback,
                            builds=int(os.environ.get("LOCAL_RANK", "0")) == 0, timeout_s=config.data.cache_timeout_s)


def build_datasets(config: RunConfig) -> tuple[SampleDataset, SampleDataset | None]:
    """(train, valid) datasets; their index arrays built once per node and memory-mapped by every process. A dataset
    with a loss mask beside it (``{prefix}_loss_mask_document`` for ``{prefix}_text_document``) trains on its bits."""
    policy = index_cache_policy(config)
    data_path = blend_as_data_path(config)
    if policy.builds:
        for prefix in data_path[1::2]:
            directory, why = policy.locate(prefix)
            print(f"index cache of {prefix}: {directory} ({why})", flush=True)
            if find_loss_mask(prefix) is not None:
                print(f"loss mask of {prefix}: {loss_mask_prefix(prefix)}", flush=True)
    packing = data_layout(config).packing
    train, valid, _ = build_gpt_datasets(data_path, config.data.split, config.model.seq_length,
                                         samples_needed(config), config.training.seed, cache_policy=policy,
                                         packing=packing, packing_overflow=config.data.packing_overflow,
                                         eod_token_id=config.data.eod_token_id)
    if policy.builds and packing != "concat":
        for name, dataset in (("train", train), ("valid", valid)):
            for part in getattr(dataset, "datasets", [dataset]):
                if hasattr(part, "summary"):
                    print(f"packing {packing} ({name}, {part.indexed.prefix}): {part.summary()}", flush=True)
    return train, valid


@dataclass(frozen=True)
class DataLayout:
    """How the run's documents become samples, the data block's defaults resolved (runconfig/blocks.py DataConfig)."""

    packing: str  # "concat", "bfd", "greedy" or "none"
    reset_attention_mask: bool
    reset_position_ids: bool
    document_boundaries: str  # "dataset" or "eod_token" (data/loader.py)

    @property
    def end_token_rule(self) -> bool:
        """Megatron-LM's rule tells this run's documents apart: the end token must end them and nothing else."""
        return self.document_boundaries == "eod_token" and (self.reset_attention_mask or self.reset_position_ids)


def data_layout(config: RunConfig) -> DataLayout:
    """data.packing ("bfd" when the run fine-tunes, else "concat"), and the document masks and position reset
    (on under whole-document packing) where the config leaves them unset."""
    packing = config.data.packing or ("bfd" if config.training.fine_tune else "concat")
    whole_documents = packing != "concat"
    masks, positions = config.data.reset_attention_mask, config.data.reset_position_ids
    return DataLayout(packing, whole_documents if masks is None else masks,
                      whole_documents if positions is None else positions, config.data.document_boundaries)


def describe_layout(config: RunConfig) -> str:
    """The start-up line: how documents become samples and what the loss divides by, defaults named."""
    if config.training.dpo is not None:
        return describe_preference_layout(config)
    layout = data_layout(config)
    documents = ("each sample one stream (no document masks, positions 0 .. s-1)"
                 if not (layout.reset_attention_mask or layout.reset_position_ids) else
                 f"document masks {'on' if layout.reset_attention_mask else 'off'}, positions "
                 f"{'reset' if layout.reset_position_ids else 'not reset'} per document, documents from "
                 + ("the dataset's index" if layout.document_boundaries == "dataset"
                    else f"end token {config.data.eod_token_id} (Megatron-LM's rule)"))
    normalization = config.training.loss_normalization
    over = "the step's target tokens" if normalization == "tokens" else "each micro-batch's target tokens"
    return (f"data: packing {layout.packing}, {documents}; loss over {over} (training.loss_normalization "
            f"\"{normalization}\", {config.loss_normalization_origin})")


def build_loader_factories(config: RunConfig, ctx: ParallelContext) -> tuple[LoaderFactory, LoaderFactory | None]:
    """One loader per DP rank from a data position; on CUDA it pins and prefetches the next micro-batch. Under
    training.dpo: pairs (training/preference_data.py), no validation set."""
    if config.training.dpo is not None:
        rows = train_rows(config, samples_needed(config)[0], *open_preference_data(config))
        return (lambda consumed_samples: DevicePrefetcher.for_device(PairLoader(
            rows, micro_batch_size=config.micro_batch_size, data_parallel_rank=ctx.data_parallel_rank,
            data_parallel_size=ctx.data_parallel_size, consumed_samples=consumed_samples), accelerator_device())), None
    train, valid = build_datasets(config)
    layout = data_layout(config)

    def factory(dataset: SampleDataset) -> LoaderFactory:
        return lambda consumed_samples: DevicePrefetcher.for_device(MicroBatchLoader(
            dataset, micro_batch_size=config.micro_batch_size, data_parallel_rank=ctx.data_parallel_rank,
            data_parallel_size=ctx.data_parallel_size, consumed_samples=consumed_samples,
            eod_mask_loss=config.data.eod_mask_loss, eod_token_id=config.data.eod_token_id,
            reset_attention_mask=layout.reset_attention_mask, reset_position_ids=layout.reset_position_ids,
            context_parallel_size=ctx.context_parallel_size, context_parallel_rank=ctx.context_parallel_rank,
            document_boundaries=layout.document_boundaries), accelerator_device())

    return factory(train), (factory(valid) if valid is not None else None)
