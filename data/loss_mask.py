"""Loss masks beside a token dataset: a second indexed dataset of uint8 0/1, one per token, read as (tokens, mask).

``tools/preprocess_data.py`` with chat or prompt/completion input writes the tokens as usual,
``{output_prefix}_text_document.bin/.idx`` (Megatron's bytes, readable by ``IndexedDataset`` and Megatron-LM), and
the mask in the same MMIDIDX format, dtype code 1 (uint8), ``{output_prefix}_loss_mask_document.bin/.idx``: the same
sequences and document index, mask[i] = 1 where token i is a target of the loss. :class:`MaskedDocuments` opens the
pair, checks that they agree (document count, sequence lengths and document index) and yields (tokens, mask) per
document.

Training reads the mask of every dataset of ``data.blend`` that has one beside it (found by name,
:func:`find_loss_mask`): data/gpt_dataset.py cuts the same token span from it as from the tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from data.indexed_dataset import IndexedDataset, IndexFormatError, bin_path, idx_path

TOKENS_KEY = "text"
LOSS_MASK_KEY = "loss_mask"


def tokens_prefix(output_prefix: str) -> str:
    """Where the preprocessor writes the tokens of chat data: ``{output_prefix}_text_document``."""
    return f"{output_prefix}_{TOKENS_KEY}_document"


def loss_mask_prefix(tokens: str | os.PathLike) -> str:
    """The mask dataset beside a token dataset: ``x_text_document`` -> ``x_loss_mask_document``."""
    tokens = os.fspath(tokens)
    suffix = f"_{TOKENS_KEY}_document"
    stem = tokens[: -len(suffix)] if tokens.endswith(suffix) else tokens
    return f"{stem}_{LOSS_MASK_KEY}_document"


class LossMaskMismatchError(IndexFormatError):
    """A mask dataset that does not describe the token dataset it is opened with."""


class MaskedDocuments:
    """A token dataset and its loss mask, checked against each other; ``docs[i]`` is (tokens, mask) of document i.

    mask_prefix defaults to :func:`loss_mask_prefix` of the tokens' prefix. Both are memory-mapped numpy views.
    """

    def __init__(self, tokens: str | os.PathLike, mask_prefix: str | os.PathLike | None = None) -> None:
        self.tokens = IndexedDataset(tokens)
        self.mask = IndexedDataset(loss_mask_prefix(tokens) if mask_prefix is None else mask_prefix)
        self._check()

    def _mismatch(self, what: str) -> LossMaskMismatchError:
        return LossMaskMismatchError(
            f"the loss mask {self.mask.idx_file} does not match the tokens {self.tokens.idx_file}: {what}; they were "
            f"not written by the same run of tools/preprocess_data.py: re-run it on the chat data to write both "
            f"(the tokens as {{prefix}}_text_document and the mask as {{prefix}}_loss_mask_document)")

    def _check(self) -> None:
        tokens, mask = self.tokens, self.mask
        if mask.dtype != np.uint8:
            raise self._mismatch(f"the mask holds {mask.dtype}, not uint8 0/1")
        if mask.num_documents != tokens.num_documents:
            raise self._mismatch(f"{mask.num_documents} documents in the mask, {tokens.num_documents} in the tokens")
        if len(mask) != len(tokens) or not np.array_equal(mask.sequence_lengths, tokens.sequence_lengths):
            lengths = zip(mask.sequence_lengths, tokens.sequence_lengths, strict=False)
            first = next((i for i, (a, b) in enumerate(lengths) if a != b), min(len(mask), len(tokens)))
            raise self._mismatch(f"sequence lengths differ first at sequence {first} ({len(mask)} sequences in the "
                                 f"mask, {len(tokens)} in the tokens)")
        if not np.array_equal(mask.document_indices, tokens.document_indices):
            raise self._mismatch("the document indices differ")
        if mask.num_tokens and int(mask.max_token_id()) > 1:
            raise self._mismatch(f"the mask holds the value {mask.max_token_id()}, not only 0 and 1")

    def __len__(self) -> int:
        return self.tokens.num_documents

    def document(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, mask) of one document, its sequences back to back."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        index %= len(self)
        start = self.tokens.document_start(index)
        end = self.tokens.document_start(index + 1)
        return self.tokens.tokens[start:end], self.mask.tokens[start:end]

    __getitem__ = document

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for index in range(len(self)):
            yield self.document(index)

    def target_fraction(self) -> float:
        """Share of the tokens that are targets."""
        total = self.mask.num_tokens
        return float(np.count_nonzero(self.mask.tokens)) / total if total else 0.0


def find_loss_mask(tokens: str | os.PathLike) -> IndexedDataset | None:
    """The loss-mask dataset beside a token dataset (:func:`loss_mask_prefix`), checked against the tokens; None when
    neither of its files exists. A mask that does not match is a LossMaskMismatchError naming both files."""
    prefix = loss_mask_prefix(tokens)
    if not (os.path.exists(idx_path(prefix)) or os.path.exists(bin_path(prefix))):
        return None
    try:
        return MaskedDocuments(tokens, prefix).mask
    except LossMaskMismatchError as error:
        raise LossMaskMismatchError(f"{error}; training reads a loss mask found beside the tokens: to train on every "
                                    f"token instead, move {prefix}.bin/.idx away") from None
