"""Megatron's memory-mapped indexed dataset, format ``MMIDIDX`` version 1, read and written byte for byte.

A dataset is a pair of files sharing a prefix. ``{prefix}.bin`` holds the tokens of every sequence back to back and
nothing else. ``{prefix}.idx`` is, little-endian::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    <Q        version = 1
    <B        dtype code of the tokens (see DTYPE_CODES)
    <Q        N, the number of sequences
    <Q        D, the length of the document index (documents + 1)
    int32[N]  sequence lengths, in tokens
    int64[N]  byte offset of each sequence in the .bin
    int64[D]  document index: 0, then the running sequence count at the end of each document

A document is one or more consecutive sequences (one per document when sentences are not split). The writer keeps
flat memory (the index arrays are spilled to temporary files) and renames its outputs into place only when complete.
A side file ``{prefix}.stats.json`` (ignored by Megatron) records the largest token id, so that the vocabulary check
at start-up does not have to scan the tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from common.files import atomic_open, publish, temporary_name

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # 9 magic + 8 version + 1 dtype code + 8 N + 8 D
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_SPILL_ENTRIES = 1 << 20  # index entries buffered in memory before they are appended to a spill file
_COPY_ENTRIES = 1 << 22  # index entries per chunk when the .idx is assembled or scanned
_SCAN_TOKENS = 1 << 26  # tokens per chunk when the .bin is scanned for its largest id


class IndexFormatError(ValueError):
    """A ``.bin``/``.idx`` pair that is missing, truncated, corrupted or inconsistent."""


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """Megatron's rule: uint16 when the vocabulary has fewer than 65,500 tokens, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dtype_code(dtype: np.dtype | type) -> int:
    """The ``.idx`` code of a token dtype (8 for uint16, 4 for int32, ...)."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if candidate == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no MMIDIDX code; use one of {sorted(str(d) for d in DTYPE_CODES.values())}")


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def stats_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.stats.json"


class _SpilledArray:
    """An append-only integer array kept in a temporary raw file, so that memory stays flat for any length."""

    def __init__(self, path: str, dtype: np.dtype) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.length = 0
        self._pending: list[np.ndarray] = []
        self._pending_entries = 0
        self._file = open(path, "wb")

    def append(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=self.dtype).reshape(-1)
        self._pending.append(values)
        self._pending_entries += values.size
        self.length += values.size
        if self._pending_entries >= _SPILL_ENTRIES:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._file.write(np.concatenate(self._pending).tobytes())
            self._pending, self._pending_entries = [], 0

    def chunks(self) -> Iterator[np.ndarray]:
        """Yield the whole array back in chunks (closes the spill file for writing)."""
        self.flush()
        self._file.close()
        with open(self.path, "rb") as stream:
            while block := stream.read(_COPY_ENTRIES * self.dtype.itemsize):
                yield np.frombuffer(block, dtype=self.dtype)

    def remove(self) -> None:
        self._file.close()
        if os.path.exists(self.path):
            os.remove(self.path)


class IndexedDatasetBuilder:
    """Writes ``{prefix}.bin`` and ``{prefix}.idx``; use as a context manager.

    Tokens go to temporary names; :meth:`finalize` writes the index and renames both files into place (the ``.idx``
    last, so an ``.idx`` on disk always describes a complete ``.bin``). Leaving the ``with`` block finalizes, or on an
    exception deletes the temporaries and leaves any earlier dataset at ``prefix`` untouched.

    >>> with IndexedDatasetBuilder("corpus_text_document", np.uint16) as builder:
    ...     builder.add_item([15496, 995, 50256])
    ...     builder.end_document()
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.int32) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # raises for a dtype the format cannot name
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = os.fspath(temporary_name(bin_path(self.prefix)))
        self._idx_tmp = os.fspath(temporary_name(idx_path(self.prefix)))
        self._bin = open(self._bin_tmp, "wb")
        self._sizes = _SpilledArray(self._idx_tmp + ".sizes", np.dtype(np.int32))
        self._docs = _SpilledArray(self._idx_tmp + ".docs", np.dtype(np.int64))
        self._docs.append(np.zeros(1, dtype=np.int64))
        self.num_sequences = 0
        self.num_tokens = 0
        self.max_token_id = -1
        self._done = False

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            if not self._done:
                self.finalize()
        else:
            self.discard()

    def _as_tokens(self, tokens: np.ndarray | Sequence[int]) -> np.ndarray:
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"{self.prefix}: a sequence must be 1-D, got shape {array.shape}")
        if array.size == 0:
            return array.astype(self.dtype)
        low, high = array.min(), array.max()
        if self._limits is not None and (low < self._limits.min or high > self._limits.max):
            raise ValueError(
                f"{self.prefix}: token ids {low}..{high} do not fit {self.dtype}; "
                f"build the dataset with dtype=optimal_dtype(vocab_size) of the tokenizer that produced them"
            )
        self.max_token_id = max(self.max_token_id, int(high))
        return array.astype(self.dtype, copy=False)

    def add_item(self, tokens: np.ndarray | Sequence[int]) -> None:
        """Append one sequence (1-D token ids) to the current document."""
        array = self._as_tokens(tokens)
        self._bin.write(array.tobytes())
        self._sizes.append(np.array([array.size], dtype=np.int32))
        self.num_sequences += 1
        self.num_tokens += array.size

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one document."""
        self._docs.append(np.array([self.num_sequences], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray, sequences_per_document: np.ndarray) -> None:
        """Append many documents at once (the fast path of the preprocessor).

        tokens: (sum(sequence_lengths),) ids of all sequences back to back.
        sequence_lengths: (S,) tokens per sequence. sequences_per_document: (M,) sequences per document, summing to S.
        """
        array = self._as_tokens(tokens)
        sequence_lengths = np.asarray(sequence_lengths, dtype=np.int64)
        sequences_per_document = np.asarray(sequences_per_document, dtype=np.int64)
        if sequence_lengths.sum() != array.size or sequences_per_document.sum() != sequence_lengths.size:
            raise ValueError(
                f"{self.prefix}: {array.size} tokens, {sequence_lengths.size} sequence lengths summing to "
                f"{sequence_lengths.sum()} and document sizes summing to {sequences_per_document.sum()} disagree"
            )
        self._bin.write(array.tobytes())
        self._sizes.append(sequence_lengths)
        self._docs.append(self.num_sequences + np.cumsum(sequences_per_document))
        self.num_sequences += sequence_lengths.size
        self.num_tokens += array.size

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append a whole existing dataset (documents, sequences and tokens), as Megatron's merge tool does."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{other.idx_file} holds {other.dtype} tokens but this builder writes {self.dtype}")
        for start in range(0, len(other), _COPY_ENTRIES):
            self._sizes.append(other.sequence_lengths[start : start + _COPY_ENTRIES])
        for start in range(1, len(other.document_indices), _COPY_ENTRIES):
            self._docs.append(self.num_sequences + other.document_indices[start : start + _COPY_ENTRIES])
        with open(other.bin_file, "rb") as stream:
            shutil.copyfileobj(stream, self._bin, 1 << 24)
        self.num_sequences += len(other)
        self.num_tokens += other.num_tokens
        self.max_token_id = max(self.max_token_id, other.max_token_id())

    def finalize(self) -> None:
        """Write the index, rename ``.bin`` then ``.idx`` into place, and record the side statistics."""
        if self._done:
            raise RuntimeError(f"{self.prefix}: finalize() was already called")
        self._bin.close()
        try:
            with open(self._idx_tmp, "wb") as stream:
                self._write_index(stream)
        except BaseException:
            self.discard()
            raise
        publish(self._bin_tmp, bin_path(self.prefix))
        publish(self._idx_tmp, idx_path(self.prefix))
        self._sizes.remove()
        self._docs.remove()
        self._done = True
        write_stats(self.prefix, self.max_token_id, self.num_tokens)

    def _write_index(self, stream: BinaryIO) -> None:
        stream.write(MAGIC)
        stream.write(struct.pack("<Q", VERSION))
        stream.write(struct.pack("<B", dtype_code(self.dtype)))
        stream.write(struct.pack("<Q", self._sizes.length))
        stream.write(struct.pack("<Q", self._docs.length))
        for chunk in self._sizes.chunks():
            stream.write(chunk.tobytes())
        offset = 0  # byte offset of the next sequence, carried across chunks
        for chunk in self._sizes.chunks():
            ends = offset + np.cumsum(chunk, dtype=np.int64) * self.dtype.itemsize
            stream.write(np.concatenate(([offset], ends[:-1])).astype(np.int64).tobytes())
            offset = int(ends[-1])
        for chunk in self._docs.chunks():
            stream.write(chunk.tobytes())

    def discard(self) -> None:
        """Delete the temporary files; nothing at ``prefix`` is changed."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        self._sizes.remove()
        self._docs.remove()
        self._done = True


def write_stats(prefix: str, max_token_id: int, num_tokens: int) -> None:
    """Record the largest token id next to a finished dataset, keyed to the sizes of its two files."""
    record = {
        "max_token_id": int(max_token_id),
        "num_tokens": int(num_tokens),
        "idx_bytes": os.path.getsize(idx_path(prefix)),
        "bin_bytes": os.path.getsize(bin_path(prefix)),
    }
    with atomic_open(stats_path(prefix), "w") as stream:
        json.dump(record, stream)


def _read_header(path: str) -> tuple[np.dtype, int, int]:
    """Check the fixed header of an ``.idx``; returns (token dtype, N sequences, D document-index length)."""
    with open(path, "rb") as stream:
        header = stream.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        raise IndexFormatError(f"{path}: {len(header)} bytes, shorter than the {HEADER_BYTES}-byte MMIDIDX header; "
                               f"the file is truncated: re-run tools/preprocess_data.py")
    if header[:9] != MAGIC:
        raise IndexFormatError(f"{path}: bad magic {header[:9]!r} (expected {MAGIC!r}); not a Megatron mmap index "
                               f"(an old 'cached'/'lazy' dataset-impl file?): re-run tools/preprocess_data.py")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != VERSION:
        raise IndexFormatError(f"{path}: index version {version}, only version {VERSION} is supported")
    code = header[17]
    if code not in DTYPE_CODES:
        raise IndexFormatError(f"{path}: unknown dtype code {code} (valid: {sorted(DTYPE_CODES)}); the file is corrupted")
    num_sequences, doc_index_length = struct.unpack("<QQ", header[18:34])
    return DTYPE_CODES[code], num_sequences, doc_index_length


class IndexedDataset:
    """Read-only view of ``{prefix}.bin``/``.idx``, memory-mapped: O(1) random access, nothing loaded up front.

    ``dataset[i]`` is sequence i (a numpy view of the .bin, dtype as stored); ``dataset[a:b]`` a list of them;
    ``get(i, offset, length)`` a slice of one sequence. Opening checks the header, the file sizes and the ends of
    the document index; :meth:`verify` checks every entry.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        self.idx_file, self.bin_file = idx_path(self.prefix), bin_path(self.prefix)
        for path in (self.idx_file, self.bin_file):
            if not os.path.isfile(path):
                raise IndexFormatError(
                    f"{path} does not exist; a dataset is named by its prefix without .bin/.idx (got {self.prefix!r})"
                )
        self.dtype, num_sequences, doc_index_length = _read_header(self.idx_file)
        self._check_idx_size(num_sequences, doc_index_length)
        self._idx = np.memmap(self.idx_file, dtype=np.uint8, mode="r")
        offset = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, num_sequences, offset)
        offset += 4 * num_sequences
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, num_sequences, offset)
        offset += 8 * num_sequences
        self.document_indices = np.frombuffer(self._idx, np.int64, doc_index_length, offset)
        self._check_consistency()
        bin_bytes = os.path.getsize(self.bin_file)
        self.tokens = (np.memmap(self.bin_file, dtype=self.dtype, mode="r") if bin_bytes
                       else np.empty(0, dtype=self.dtype))
        self._max_token_id: int | None = None

    def _check_idx_size(self, num_sequences: int, doc_index_length: int) -> None:
        expected = HEADER_BYTES + 12 * num_sequences + 8 * doc_index_length
        actual = os.path.getsize(self.idx_file)
        if actual != expected:
            raise IndexFormatError(
                f"{self.idx_file}: {actual} bytes, but its header announces {num_sequences} sequences and a document "
                f"index of {doc_index_length} entries ({expected} bytes); the file is truncated or corrupted "
                f"(multimodal indexes are not supported): re-run tools/preprocess_data.py"
            )

    def _check_consistency(self) -> None:
        docs, n = self.document_indices, len(self.sequence_lengths)
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != n:
            ends = (int(docs[0]), int(docs[-1])) if len(docs) else None
            raise IndexFormatError(f"{self.idx_file}: the document index must run from 0 to the {n} sequences, "
                                   f"got ends {ends}; the file is corrupted: re-run tools/preprocess_data.py")
        expected_bin = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
        actual_bin = os.path.getsize(self.bin_file)
        if n and self.sequence_pointers[0] != 0:
            raise IndexFormatError(f"{self.idx_file}: the first sequence must start at byte 0 of the .bin")
        if actual_bin != expected_bin:
            raise IndexFormatError(
                f"{self.bin_file}: {actual_bin} bytes, but {self.idx_file} describes {expected_bin} bytes "
                f"({self.dtype} tokens); the .bin is truncated or belongs to another index: re-run "
                f"tools/preprocess_data.py"
            )

    def verify(self) -> None:
        """Check every index entry (O(N + D)): lengths >= 0, pointers contiguous, document index non-decreasing."""
        lengths = self.sequence_lengths
        if len(lengths) and lengths.min() < 0:
            raise IndexFormatError(f"{self.idx_file}: negative sequence length at {int(np.argmin(lengths))}")
        pointers = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)[:-1])) * self.dtype.itemsize
        bad = np.flatnonzero(pointers != self.sequence_pointers)
        if bad.size:
            raise IndexFormatError(f"{self.idx_file}: sequence {int(bad[0])} starts at byte "
                                   f"{int(self.sequence_pointers[bad[0]])}, expected {int(pointers[bad[0]])}")
        steps = np.diff(self.document_indices)
        if steps.size and steps.min() < 0:
            raise IndexFormatError(f"{self.idx_file}: the document index decreases at document "
                                   f"{int(np.argmin(steps))}")

    def __getstate__(self) -> str:
        return self.prefix

    def __setstate__(self, prefix: str) -> None:
        self.__init__(prefix)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("slices of an IndexedDataset must be contiguous (step 1)")
            if start >= stop:
                return []
            first = int(self.sequence_pointers[start]) // self.dtype.itemsize
            lengths = self.sequence_lengths[start:stop]
            block = self.tokens[first : first + int(lengths.sum(dtype=np.int64))]
            return np.split(block, np.cumsum(lengths[:-1], dtype=np.int64))
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index`` (to its end when length is None)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) of sequence {index} "
                             f"(length {size}) are out of range")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    def document_start(self, document: int) -> int:
        """Token position in the .bin of the first token of a document (its sequences are contiguous)."""
        first_sequence = int(self.document_indices[document])
        if first_sequence == len(self):
            return self.num_tokens
        return int(self.sequence_pointers[first_sequence]) // self.dtype.itemsize

    def document_lengths(self) -> np.ndarray:
        """(documents,) tokens per document. A view of the sequence lengths when each document is one sequence."""
        docs = self.document_indices
        if len(docs) == len(self) + 1 and np.array_equal(docs, np.arange(len(docs))):
            return self.sequence_lengths
        ends = np.concatenate(([0], np.cumsum(self.sequence_lengths, dtype=np.int64)))
        return ends[docs[1:]] - ends[docs[:-1]]

    def max_token_id(self) -> int:
        """Largest token id (-1 when empty): from the side statistics when they match the files, else by a scan."""
        if self._max_token_id is None:
            self._max_token_id = self._recorded_max_token_id()
        if self._max_token_id is None:
            self._max_token_id = self._scan_max_token_id()
            try:
                write_stats(self.prefix, self._max_token_id, self.num_tokens)
            except OSError:
                pass  # a read-only data directory: the scan is repeated next time
        return self._max_token_id

    def _recorded_max_token_id(self) -> int | None:
        try:
            with open(stats_path(self.prefix)) as stream:
                record = json.load(stream)
        except (OSError, ValueError):
            return None
        sizes = (os.path.getsize(self.idx_file), os.path.getsize(self.bin_file))
        if (record.get("idx_bytes"), record.get("bin_bytes")) != sizes or not isinstance(record.get("max_token_id"), int):
            return None
        return record["max_token_id"]

    def _scan_max_token_id(self) -> int:
        largest = -1
        for start in range(0, self.num_tokens, _SCAN_TOKENS):
            largest = max(largest, int(self.tokens[start : start + _SCAN_TOKENS].max()))
        return largest


def check_vocab_size(dataset: IndexedDataset, vocab_size: int) -> None:
    """Raise ValueError, naming the file, when a token id of the dataset is >= the model's vocabulary size."""
    if dataset.dtype == np.uint16 and vocab_size > np.iinfo(np.uint16).max:
        return  # every uint16 id fits: no need to look
    largest = dataset.max_token_id()
    if largest >= vocab_size:
        raise ValueError(
            f"{dataset.bin_file}: token id {largest} does not fit the model's vocabulary of {vocab_size} "
            f"(ids 0..{vocab_size - 1}); the data was tokenised with a larger vocabulary than the model's: "
            f"re-tokenise it with the model's tokenizer or give the model a vocabulary of at least {largest + 1}"
        )


def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> IndexedDataset:
    """Concatenate datasets of one dtype, in the given order, into ``output_prefix``."""
    if not prefixes:
        raise ValueError("merge_datasets: no input datasets")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetBuilder(output_prefix, dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
    return IndexedDataset(output_prefix)
