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
    loss_mask = 1 everywhere, or, when the dataset has a loss mask (``dataset.sample_loss_mask(i)``, the bits of
    the sample's seq_length + 1 tokens from a mask dataset beside the tokens, data/loss_mask.py), mask[1:]: the label
    at position i is token i + 1, and its own bit says whether it is a target (TRL's and Megatron-LM's convention); a
    sample of a blended dataset without masks is all ones. With eod_mask_loss, also (AND) 0 where the input token is
    the end-of-document token: the prediction that crosses into the next document (Megatron-LM's
    _get_ltor_masks_and_position_ids, ``loss_mask[data == eod_token] = 0``). The end-of-document token itself is
    still learnt as a label, so a model trained with it learns to end a document.

Context parallelism (CP > 1): the CP peers of a replica read the same samples, and each keeps its own seq_length / CP
positions of tokens, position_ids (the global positions), labels and loss mask; segment_ids stay whole.

Packed documents (Megatron-LM's reset_attention_mask and reset_position_ids). With either flag the first stage's
inputs gain the document of each token::

    ((tokens, position_ids, segment_ids), (labels, loss_mask))
    segment_ids: int64 (mb, seq_length), each token's document in its sample, 0, 1, ... (reset_attention_mask; all 0
                 without: one document)
    position_ids: each token's position in its document (reset_position_ids; 0 .. s-1 without)

and attention is block-diagonal causal (model/attention.py, document_mask). Where the documents of a sample are
(``document_boundaries``):

    "dataset"    where the data says documents start, whatever their tokens: the pieces of a packed sample
                 (data/packing.py; its padding one more document), the document index's cut of a concat sample
                 (data/gpt_dataset.py), from ``dataset.sample_documents(i)``. A chat template whose end-of-turn
                 token is the tokenizer's eos (Qwen's <|im_end|>, Llama 3's <|eot_id|>) keeps each conversation
                 whole. The default.
    "eod_token"  Megatron-LM's rule: a document ends at each end-of-document token, and the next starts after it
                 (:func:`documents`; what Megatron-LM's _get_ltor_masks_and_position_ids gives on the same tokens),
                 for corpora tokenised elsewhere. training/data.py refuses it on a dataset whose end token also
                 occurs inside its documents.

On a pretraining corpus with the end token appended to every document (tools/preprocess_data.py --append-eod) and
nowhere else, both give the same documents. eod_mask_loss is Megatron-LM's token rule under either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
import torch

from data.blended_dataset import BlendedDataset
from data.gpt_dataset import GPTDataset
from data.indexed_dataset import IndexedDataset, check_vocab_size
from data.packing import PackedDataset

MicroBatch = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]  # inputs: 2 or 3 tensors
DOCUMENT_BOUNDARIES = ("dataset", "eod_token")


class SampleDataset(Protocol):
    """Anything with a length whose items are int64 arrays of seq_length + 1 tokens; it may also have
    ``sample_loss_mask(index)``: None or (seq_length + 1,) 0/1 bits, one per token of ``dataset[index]``, and
    ``sample_documents(index)``: (seq_length + 1,) int64, each token's document in the sample (0, 1, ...; non-
    decreasing), which document_boundaries "dataset" needs."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


class MicroBatchLoader:
    """Iterator over the micro-batches of one data-parallel rank (see the module docstring for the rule).

    Stops (StopIteration) when the next micro-batch of all ranks together would run past the end of the dataset.
    """

    def __init__(self, dataset: SampleDataset, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, consumed_samples: int = 0, eod_mask_loss: bool = False,
                 eod_token_id: int | None = None, reset_attention_mask: bool = False,
                 reset_position_ids: bool = False, context_parallel_size: int = 1,
                 context_parallel_rank: int = 0, document_boundaries: str = "dataset") -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size); got rank {data_parallel_rank} "
                             f"of {data_parallel_size}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        if context_parallel_size < 1 or not 0 <= context_parallel_rank < context_parallel_size:
            raise ValueError(f"context_parallel_rank must be in [0, context_parallel_size); got rank "
                             f"{context_parallel_rank} of {context_parallel_size}")
        if document_boundaries not in DOCUMENT_BOUNDARIES:
            raise ValueError(f"data.document_boundaries must be one of {DOCUMENT_BOUNDARIES}, got "
                             f"{document_boundaries!r}")
        by_token = document_boundaries == "eod_token"
        for flag, name in ((eod_mask_loss, "eod_mask_loss"), (reset_attention_mask and by_token,
                                                               "reset_attention_mask"),
                           (reset_position_ids and by_token, "reset_position_ids")):
            if flag and eod_token_id is None:
                raise ValueError(f"{name} needs eod_token_id (the tokenizer's end-of-document id)")
        if (reset_attention_mask or reset_position_ids) and not by_token and not hasattr(dataset,
                                                                                       "sample_documents"):
            raise ValueError(f"data.document_boundaries \"dataset\" reads each sample's documents from the dataset, "
                             f"and {type(dataset).__name__} has none (sample_documents): use a GPTDataset, "
                             f"PackedDataset or BlendedDataset, or \"eod_token\" for Megatron-LM's end-token rule")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.consumed_samples = consumed_samples
        self.eod_mask_loss = eod_mask_loss
        self.eod_token_id = eod_token_id
        self.reset_attention_mask, self.reset_position_ids = reset_attention_mask, reset_position_ids
        self.context_parallel_size, self.context_parallel_rank = context_parallel_size, context_parallel_rank
        self.document_boundaries = document_boundaries

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
        indices = range(first, first + self.micro_batch_size)
        samples = np.stack([np.asarray(self.dataset[i], dtype=np.int64) for i in indices])  # (mb, seq_length + 1)
        self.consumed_samples += self.samples_per_micro_batch
        return self._to_micro_batch(samples, self._sample_masks(indices, samples.shape),
                                    self._sample_documents(indices, samples.shape))

    def _sample_masks(self, indices: range, shape: tuple[int, ...]) -> np.ndarray | None:
        """(mb, seq_length + 1) loss-mask bits of the samples, ones for a sample without; None when none has any."""
        read = getattr(self.dataset, "sample_loss_mask", None)
        bits = [read(i) for i in indices] if read is not None else []
        if all(mask is None for mask in bits):
            return None
        return np.stack([np.ones(shape[1], dtype=np.uint8) if mask is None else np.asarray(mask, dtype=np.uint8)
                         for mask in bits])

    def _sample_documents(self, indices: range, shape: tuple[int, ...]) -> np.ndarray | None:
        """(mb, seq_length + 1) each token's document, from the dataset; None when no flag needs them or the
        end-token rule finds them."""
        if not (self.reset_attention_mask or self.reset_position_ids) or self.document_boundaries == "eod_token":
            return None
        found = [self.dataset.sample_documents(i) for i in indices]
        if any(ids is None or len(ids) != shape[1] for ids in found):
            raise ValueError(f"{type(self.dataset).__name__}: samples {list(indices)} lack the documents of their "
                             f"{shape[1]} tokens (sample_documents); use data.document_boundaries \"eod_token\"")
        return np.stack([np.asarray(ids, dtype=np.int64) for ids in found])

    def _to_micro_batch(self, samples: np.ndarray, sample_masks: np.ndarray | None = None,
                        sample_documents: np.ndarray | None = None) -> MicroBatch:
        if samples.ndim != 2 or samples.shape[1] < 2:
            raise ValueError(f"samples must be (micro_batch, seq_length + 1) token ids, got shape {samples.shape}")
        batch = torch.from_numpy(samples)
        tokens = batch[:, :-1].contiguous()  # (mb, s)
        labels = batch[:, 1:].contiguous()  # (mb, s)
        position_ids = torch.arange(tokens.shape[1], dtype=torch.int64).repeat(tokens.shape[0], 1)  # (mb, s)
        if sample_masks is None:
            loss_mask = torch.ones(labels.shape, dtype=torch.float32)
        else:  # the label at position i is token i + 1: its own bit
            if sample_masks.shape != samples.shape:
                raise ValueError(f"loss-mask bits of shape {sample_masks.shape} for samples of shape {samples.shape}")
            loss_mask = torch.from_numpy(np.ascontiguousarray(sample_masks[:, 1:], dtype=np.float32))
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod_token_id] = 0.0
        if not (self.reset_attention_mask or self.reset_position_ids):
            return self._context_slice((tokens, position_ids), (labels, loss_mask))
        if sample_documents is None:
            segment_ids, in_document = documents(tokens, self.eod_token_id)
        else:  # the documents of the inputs, sample[:-1]
            segment_ids = torch.from_numpy(np.ascontiguousarray(sample_documents[:, :-1]))
            in_document = positions_in_documents(segment_ids)
        return self._context_slice((tokens, in_document if self.reset_position_ids else position_ids),
                                   (labels, loss_mask),
                                   segment_ids if self.reset_attention_mask else torch.zeros_like(segment_ids))

    def _context_slice(self, inputs: tuple[torch.Tensor, torch.Tensor], targets: tuple[torch.Tensor, torch.Tensor],
                       segment_ids: torch.Tensor | None = None) -> MicroBatch:
        """This CP rank's positions [c s/CP, (c+1) s/CP) of tokens, positions, labels and loss mask (all of them at
        CP 1), cut after the labels are shifted; the documents (segment_ids) stay whole: attention sees every
        position (model/attention.py)."""
        if self.context_parallel_size > 1:
            length = inputs[0].shape[1] // self.context_parallel_size
            start = self.context_parallel_rank * length

            def cut(pair):
                return tuple(t[:, start:start + length].contiguous() for t in pair)

            inputs, targets = cut(inputs), cut(targets)
        return (inputs if segment_ids is None else (*inputs, segment_ids)), targets

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed}")
        self.consumed_samples = consumed


def documents(tokens: torch.Tensor, eod_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The documents of packed samples (b, s): each token's document (how many end-of-document tokens come before
    it) and its position in that document (0 after each end-of-document token, which ends the document it closes)."""
    ends = (tokens == eod_token_id).long()
    segment_ids = ends.cumsum(dim=1) - ends  # the end token belongs to the document it closes
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    next_start = torch.where(ends.bool(), index + 1, 0).cummax(dim=1).values  # after the last end token so far
    start = torch.cat([torch.zeros_like(next_start[:, :1]), next_start[:, :-1]], dim=1)  # ... strictly before
    return segment_ids, index - start


_SCAN_TOKENS = 1 << 24  # tokens per chunk of the end-token scan


def check_end_token_rule(indexed: IndexedDataset, eod_token_id: int) -> None:
    """data.document_boundaries "eod_token" on this dataset: every document ends with the end-of-document token and
    it occurs nowhere else, else the rule would cut documents apart or run them together (ValueError naming the file,
    the first document and the fix). One pass over the tokens, in chunks."""
    lengths = np.asarray(indexed.document_lengths(), dtype=np.int64)
    last = (np.cumsum(lengths) - 1)[lengths > 0]  # the last token of every non-empty document, in order
    tokens = indexed.tokens
    missing = np.flatnonzero(np.asarray(tokens[last]) != eod_token_id) if len(last) else np.zeros(0, np.int64)
    fix = "or use data.document_boundaries \"dataset\" (the default: the documents of the dataset's index)"
    if len(missing):
        document = int(np.flatnonzero(lengths > 0)[missing[0]])
        raise ValueError(f"{indexed.bin_file}: {len(missing)} documents do not end with the end-of-document token "
                         f"{eod_token_id} (the first: document {document}), and data.document_boundaries "
                         f"\"eod_token\" tells documents apart by it: preprocess with tools/preprocess_data.py "
                         f"--append-eod, set data.eod_token_id, {fix}")
    inside = 0
    first_inside = None
    for start in range(0, indexed.num_tokens, _SCAN_TOKENS):
        found = np.flatnonzero(np.asarray(tokens[start:start + _SCAN_TOKENS]) == eod_token_id) + start
        ends = last[np.searchsorted(last, start):np.searchsorted(last, start + _SCAN_TOKENS)]
        stray = found[~np.isin(found, ends, assume_unique=True)]
        if len(stray) and first_inside is None:
            first_inside = int(stray[0])
        inside += len(stray)
    if inside:
        document = int(np.searchsorted(np.cumsum(lengths), first_inside, side="right"))
        raise ValueError(f"{indexed.bin_file}: the end-of-document token {eod_token_id} occurs {inside} times inside "
                         f"documents (the first in document {document}), and data.document_boundaries \"eod_token\" "
                         f"would cut them there (a chat template whose end-of-turn token is the tokenizer's eos, as "
                         f"Qwen's <|im_end|> or Llama 3's <|eot_id|>, cuts a conversation at every turn): {fix}")


def positions_in_documents(segment_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document, for (b, s) non-decreasing document ids: 0 where a document starts."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


Transfer = Callable[[MicroBatch], MicroBatch]


def map_tensors(function: Callable[[torch.Tensor], torch.Tensor], batch):
    """``batch`` (nested tuples or lists of tensors) with ``function`` applied to every tensor."""
    if isinstance(batch, torch.Tensor):
        return function(batch)
    return type(batch)(map_tensors(function, item) for item in batch)


def pinned_non_blocking_copy(device: torch.device) -> Transfer:
    """Pin each tensor and issue its copy to ``device`` without waiting for it (on the current stream, before any
    kernel that reads it is queued, so every reader sees the copied data)."""
    return lambda batch: map_tensors(lambda tensor: tensor.pin_memory().to(device, non_blocking=True), batch)


class DevicePrefetcher:
    """Micro-batches of a loader, with the next one already on its way to the device.

    DeepSpeed's pipeline engine copies each micro-batch to the device with a blocking ``.to(device)`` on the first
    and last stages: from pageable memory that copy waits for every kernel queued before it, so the host stops
    feeding the GPU at each micro-batch. With a ``transfer`` (on CUDA: :func:`pinned_non_blocking_copy`), the copy
    of micro-batch k + 1 is issued before micro-batch k is returned, and DeepSpeed's ``.to(device)`` finds the
    tensors already there. Without one (on CPU) the loader's micro-batches pass through untouched. Either way the
    order is the loader's.

    ``consumed_samples`` is the data position of the next micro-batch this returns (training/faults.py reads it),
    not the loader's, which runs one micro-batch ahead.
    """

    def __init__(self, loader: MicroBatchLoader, transfer: Transfer | None = None) -> None:
        self.loader, self.transfer = loader, transfer
        self._next: tuple[int, MicroBatch] | None = None  # (data position, transferred micro-batch), fetched ahead
        self._exhausted = False

    @classmethod
    def for_device(cls, loader: MicroBatchLoader, device: torch.device) -> DevicePrefetcher:
        """Prefetching on CUDA; a pass-through anywhere else."""
        if device.type == "cuda" and torch.cuda.is_available():
            return cls(loader, pinned_non_blocking_copy(device))
        return cls(loader)

    @property
    def consumed_samples(self) -> int:
        return self._next[0] if self._next is not None else self.loader.consumed_samples

    def __iter__(self) -> Iterator[MicroBatch]:
        return self

    def __next__(self) -> MicroBatch:
        if self.transfer is None:
            return next(self.loader)
        if self._next is None:
            self._fetch()
        if self._next is None:
            raise StopIteration
        _, current = self._next
        self._fetch()  # micro-batch k + 1's copy is issued before micro-batch k is returned
        return current

    def _fetch(self) -> None:
        self._next = None
        if self._exhausted:
            return
        position = self.loader.consumed_samples
        try:
            batch = next(self.loader)
        except StopIteration:
            self._exhausted = True
            return
        self._next = (position, self.transfer(batch))


def indexed_datasets(dataset: object) -> list[IndexedDataset]:
    """The indexed datasets underneath a GPTDataset, a PackedDataset, a BlendedDataset, or an IndexedDataset."""
    if isinstance(dataset, IndexedDataset):
        return [dataset]
    if isinstance(dataset, (GPTDataset, PackedDataset)):
        return [dataset.indexed]
    if isinstance(dataset, BlendedDataset):
        return [found for part in dataset.datasets for found in indexed_datasets(part)]
    return []


def check_token_ids_fit(dataset: object, vocab_size: int) -> None:
    """Start-up check: every token id of the data is below the model's vocabulary size (ValueError naming the file)."""
    for indexed in indexed_datasets(dataset):
        check_vocab_size(indexed, vocab_size)
