"""The interface between the data and the model: micro-batches for one data-parallel rank, resumable.

Megatron's pretraining sampler rule: micro-batch k of the run covers the global samples
[consumed + k * mb * dp, consumed + (k + 1) * mb * dp), and data-parallel rank r takes the slice [r * mb, (r + 1) * mb)
of that range. The iterator does not know the global batch size (which a batch-size ramp changes during training):
the trainer draws global_batch / (mb * dp) micro-batches per optimizer step. Resuming is exact from the single number
``consumed_samples``, whatever the micro-batch and data-parallel sizes were before.

Each item is the tuple DeepSpeed's pipeline engine expects, read by the first stage (inputs) and the last (labels)::

    ((tokens, position_ids), (labels, loss_mask))
    tokens, position_ids, labels: int64 (mb, seq_length); loss_mask: float32 (mb, seq_length)
    tokens = sample[:-1], labels = sample[1:], position_ids = arange(seq_length) on every row,
    loss_mask = 1 everywhere, 0 where the label is the end-of-document token when eod_mask_loss is set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch

from data.blended_dataset import BlendedDataset
from data.gpt_dataset import GPTDataset
from data.indexed_dataset import IndexedDataset, check_vocab_size

MicroBatch = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SampleDataset(Protocol):
    """Anything with a length whose items are int64 arrays of seq_length + 1 tokens."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


class MicroBatchLoader:
    """Iterator over the micro-batches of one data-parallel rank (see the module docstring for the rule).

    Stops (StopIteration) when the next micro-batch of all ranks together would run past the end of the dataset.
    """

    def __init__(self, dataset: SampleDataset, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, consumed_samples: int = 0, eod_mask_loss: bool = False,
                 eod_token_id: int | None = None) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size); got rank {data_parallel_rank} "
                             f"of {data_parallel_size}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        if eod_mask_loss and eod_token_id is None:
            raise ValueError("eod_mask_loss needs eod_token_id (the tokenizer's end-of-document id)")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.consumed_samples = consumed_samples
        self.eod_mask_loss = eod_mask_loss
        self.eod_token_id = eod_token_id

    @property
    def samples_per_micro_batch(self) -> int:
        """Samples consumed by one micro-batch of all data-parallel ranks together (mb * dp)."""
        return self.micro_batch_size * self.data_parallel_size

    def __iter__(self) -> Iterator[MicroBatch]:
        return self

    def __next__(self) -> MicroBatch:
        if self.consumed_samples + self.samples_per_micro_batch > len(self.dataset):
            raise StopIteration
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        samples = np.stack([np.asarray(self.dataset[i], dtype=np.int64)
                            for i in range(first, first + self.micro_batch_size)])  # (mb, seq_length + 1)
        self.consumed_samples += self.samples_per_micro_batch
        return self._to_micro_batch(samples)

    def _to_micro_batch(self, samples: np.ndarray) -> MicroBatch:
        if samples.ndim != 2 or samples.shape[1] < 2:
            raise ValueError(f"samples must be (micro_batch, seq_length + 1) token ids, got shape {samples.shape}")
        batch = torch.from_numpy(samples)
        tokens = batch[:, :-1].contiguous()  # (mb, s)
        labels = batch[:, 1:].contiguous()  # (mb, s)
        position_ids = torch.arange(tokens.shape[1], dtype=torch.int64).repeat(tokens.shape[0], 1)  # (mb, s)
        loss_mask = torch.ones(labels.shape, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[labels == self.eod_token_id] = 0.0
        return (tokens, position_ids), (labels, loss_mask)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed}")
        self.consumed_samples = consumed


def indexed_datasets(dataset: object) -> list[IndexedDataset]:
    """The indexed datasets underneath a GPTDataset, a BlendedDataset, or an IndexedDataset itself."""
    if isinstance(dataset, IndexedDataset):
        return [dataset]
    if isinstance(dataset, GPTDataset):
        return [dataset.indexed]
    if isinstance(dataset, BlendedDataset):
        return [found for part in dataset.datasets for found in indexed_datasets(part)]
    return []


def check_token_ids_fit(dataset: object, vocab_size: int) -> None:
    """Start-up check: every token id of the data is below the model's vocabulary size (ValueError naming the file)."""
    for indexed in indexed_datasets(dataset):
        check_vocab_size(indexed, vocab_size)
