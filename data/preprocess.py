"""Tokenising a corpus into indexed datasets: the library under ``tools/preprocess_data.py``.

For each ``--json-keys`` key, ``{output_prefix}_{key}_document.bin/.idx``, the same bytes as Megatron-LM's
preprocess_data.py writes with the same tokenizer (one sequence per document, the eod id appended to it with
``append_eod``, uint16 below 65,500 ids). A value may also be a list of sentences, as Megatron accepts: each non-empty
sentence is one sequence of the document. Differences, all on bad input where Megatron crashes or writes a silently
wrong dataset: a malformed line, a missing key, invalid UTF-8, an empty document (no tokens) or an empty file is an
error naming the file and line, or with ``skip_bad_lines`` a counted skip of the whole line (for every key, so the
outputs of several keys keep the same documents); and every key's output is finalized, not only the last.

Several inputs (files or glob patterns) are read in the order given as one stream of documents; ``shard=(K, N)``
tokenises only the K-th of N disjoint slices of that stream and writes a shard that ``data.sharding.merge_shards``
joins with the others into the bytes of one run (see ``data.sharding``).

Streaming: records are read in batches and at most ``4 * workers`` batches are in flight, the index arrays are
spilled to disk, so memory does not grow with the corpus. Outputs are written under temporary names and renamed.
"""

from __future__ import annotations

import gzip
import itertools
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass, field

import numpy as np

from data import sharding
from data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from data.sharding import InputSlice
from data.tokenizers import TOKENIZER_BACKENDS, TOKENIZER_TYPES, Tokenizer, build_tokenizer

INPUT_FORMATS = ("auto", "jsonl", "json", "parquet", "arrow", "dataset")
_BOM = b"\xef\xbb\xbf"
Record = bytes | dict  # a raw JSONL line, or a row that `datasets` already parsed
Task = tuple[int, int, list[Record]]  # (number of the input slice, number of its first record, 1-based, records)


class BadInputError(ValueError):
    """Input that would make a wrong dataset: the message names the file and the line (or row)."""


@dataclass
class PreprocessConfig:
    """What to tokenise and how (the flags of tools/preprocess_data.py)."""

    input: str | Sequence[str]  # JSONL files (.gz too) or json/parquet/arrow files or saved datasets; globs allowed
    output_prefix: str  # outputs are {output_prefix}_{key}_document.bin/.idx (a shard: see data.sharding)
    json_keys: tuple[str, ...] = ("text",)  # one output dataset per key
    workers: int = 1  # tokenising processes; 1 tokenises in this process
    append_eod: bool = False  # append the tokenizer's end-of-document id to every document
    tokenizer_type: str = "GPT2BPETokenizer"  # Megatron's --tokenizer-type names
    vocab_file: str | None = None  # GPT-2 vocab.json (default: the shipped one)
    merge_file: str | None = None  # GPT-2 merges.txt (default: the shipped one)
    tokenizer_model: str | None = None  # SentencePiece .model, or Hugging Face tokenizer.json / directory
    tokenizer_backend: str = "auto"  # one of TOKENIZER_BACKENDS: tiktoken where exact, else `tokenizers`
    parse_special_tokens: bool = False  # GPT2BPETokenizer: <|endoftext|> in a text is 50256 (Megatron-LM), not text
    skip_bad_lines: bool = False  # skip (and count) bad lines instead of stopping at the first
    input_format: str = "auto"  # one of INPUT_FORMATS; auto: directory -> dataset, .parquet, .arrow, else jsonl
    batch_size: int = 64  # documents per task sent to a worker (Pool.imap chunk)
    progress: bool = True  # progress bar on stderr
    shard: tuple[int, int] | None = None  # (K, N): only the K-th (0-based) of N slices of the inputs
    files: tuple[str, ...] = field(init=False)  # the input files, globs expanded, in order

    def __post_init__(self) -> None:
        self.json_keys = tuple(self.json_keys)
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            raise ValueError(f"json_keys must be distinct and not empty, got {list(self.json_keys)}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.input_format not in INPUT_FORMATS:
            raise ValueError(f"input_format {self.input_format!r}: choose one of {', '.join(INPUT_FORMATS)}")
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(f"tokenizer_type {self.tokenizer_type!r}: choose one of {', '.join(TOKENIZER_TYPES)}")
        if self.tokenizer_backend not in TOKENIZER_BACKENDS:
            raise ValueError(f"tokenizer_backend {self.tokenizer_backend!r}: choose one of "
                             f"{', '.join(TOKENIZER_BACKENDS)}")
        if self.shard is not None:
            self.shard = sharding.check_shard(*self.shard)
        self.files = sharding.expand_inputs(self.input)
        for path in self.files:
            if self.format_of(path) == "jsonl" and os.path.getsize(path) == 0:
                raise BadInputError(f"{path}: the file is empty (expected one JSON object per line)")

    def tokenizer_arguments(self) -> dict:
        return {"tokenizer_type": self.tokenizer_type, "vocab_file": self.vocab_file,
                "merge_file": self.merge_file, "tokenizer_model": self.tokenizer_model,
                "backend": self.tokenizer_backend, "parse_special_tokens": self.parse_special_tokens}

    def format_of(self, path: str) -> str:
        """The format of one input: --input-format, or by its name (directory -> dataset, .parquet, .arrow, jsonl)."""
        if self.input_format != "auto":
            return self.input_format
        if os.path.isdir(path):
            return "dataset"
        for suffix in ("parquet", "arrow"):
            if path.endswith(f".{suffix}"):
                return suffix
        return "jsonl"

    def slices(self) -> list[InputSlice]:
        """What this run reads: every input whole, or this shard's slices."""
        if self.shard is None:
            return [InputSlice(path) for path in self.files]
        cuttable = [self.format_of(path) == "jsonl" and not path.endswith(".gz") for path in self.files]
        return sharding.shard_slices(self.files, cuttable, *self.shard)

    def dataset_prefix(self) -> str:
        """The prefix the datasets are written under: output_prefix, or this shard's."""
        return self.output_prefix if self.shard is None else sharding.shard_prefix(self.output_prefix, *self.shard)


@dataclass
class PreprocessReport:
    """What a run wrote and skipped."""

    outputs: list[str]  # dataset prefixes written, one per key
    backend: str = ""  # what tokenised: tiktoken, tokenizers or sentencepiece
    shard: tuple[int, int] | None = None  # (K, N) of a sharded run
    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)  # per key, including eod tokens
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)  # the first few "file:line: reason"
    input_bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        seconds = max(self.seconds, 1e-9)
        tokens = sum(self.tokens.values())
        lines = [f"{self.documents} documents, {tokens} tokens, {self.input_bytes / 1e6:.1f} MB in {seconds:.1f} s "
                 f"({self.documents / seconds:.0f} docs/s, {self.input_bytes / 1e6 / seconds:.2f} MB/s, "
                 f"{tokens / seconds:.0f} tokens/s) with {self.backend}"]
        lines += [f"  {prefix}.bin/.idx" for prefix in self.outputs]
        if self.shard is not None:
            lines.append(f"shard {self.shard[0]} of 0..{self.shard[1] - 1}; once all are written: "
                         f"python tools/merge_datasets.py --shards <output prefix>")
        if self.skipped:
            lines.append(f"skipped {self.skipped} bad lines; the first ones:")
            lines += [f"  {example}" for example in self.skipped_examples]
        return "\n".join(lines)


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output name for one JSON key (document level)."""
    return f"{output_prefix}_{key}_document"


# ---------------------------------------------------------------------------------------------------------- reading


def read_batches(config: PreprocessConfig, slices: Sequence[InputSlice]) -> Iterator[Task]:
    """Tasks of config.batch_size records, slice after slice, streaming; a batch never spans two slices."""
    for source, piece in enumerate(slices):
        jsonl = config.format_of(piece.path) == "jsonl"
        records = _jsonl_records(piece) if jsonl else _dataset_rows(piece.path, config)
        number = 1
        while batch := list(itertools.islice(records, config.batch_size)):
            yield source, number, batch
            number += len(batch)


def _jsonl_records(piece: InputSlice) -> Iterator[bytes]:
    """The lines of a slice; a UTF-8 byte-order mark at the start of the file is dropped."""
    opener = gzip.open if piece.path.endswith(".gz") else open
    with opener(piece.path, "rb") as stream:
        stream.seek(piece.start)
        position = piece.start
        for line in stream:
            if piece.end is not None and position >= piece.end:
                return
            if position == 0 and line.startswith(_BOM):
                line = line[len(_BOM):]
                position += len(_BOM)
            position += len(line)
            yield line


def _dataset_rows(path: str, config: PreprocessConfig) -> Iterator[dict]:
    import datasets

    form = config.format_of(path)
    if form == "dataset":
        rows = datasets.load_from_disk(path)
        if isinstance(rows, datasets.DatasetDict):
            if "train" not in rows:
                raise BadInputError(f"{path}: a DatasetDict without a 'train' split ({list(rows)})")
            rows = rows["train"]
    else:
        rows = datasets.load_dataset(form, data_files=path, split="train", streaming=True)
    for row in rows:
        if all(key in row for key in config.json_keys):
            yield {key: row[key] for key in config.json_keys}  # only what the workers need crosses processes
        else:
            yield dict(row)


class _LineNumbers:
    """File and line (or row) of a record, for messages; a slice starting inside a file counts the lines before
    it only when a message needs them."""

    def __init__(self, config: PreprocessConfig, slices: Sequence[InputSlice]) -> None:
        self.slices = slices
        self.jsonl = [config.format_of(piece.path) == "jsonl" for piece in slices]
        self._lines_before: dict[int, int] = {}

    def __call__(self, source: int, number: int) -> str:
        piece = self.slices[source]
        if not self.jsonl[source]:
            return f"{piece.path}: row {number}"
        if source not in self._lines_before:
            self._lines_before[source] = sharding.count_lines_before(piece.path, piece.start)
        return f"{piece.path}:{self._lines_before[source] + number}"


# --------------------------------------------------------------------------------------------------------- encoding


@dataclass
class EncodedBatch:
    """One batch, tokenised: per key, all tokens back to back with their sequence and document sizes."""

    source: int  # number of the input slice
    num_documents: int
    input_bytes: int
    tokens: dict[str, np.ndarray]  # (tokens,) in the output dtype
    sequence_lengths: dict[str, np.ndarray]  # (sequences,)
    sequences_per_document: dict[str, np.ndarray]  # (num_documents,)
    bad: list[tuple[int, str]]  # (record number in the slice, reason)


class DocumentEncoder:
    """Parses and tokenises batches of records (runs in the worker processes)."""

    def __init__(self, tokenizer: Tokenizer, json_keys: tuple[str, ...], append_eod: bool) -> None:
        self.tokenizer, self.json_keys, self.append_eod = tokenizer, json_keys, append_eod
        self.dtype = optimal_dtype(tokenizer.vocab_size)

    def parse(self, record: Record) -> list[list[str]] | str:
        """The sentences of each key, or the reason the record is bad."""
        if isinstance(record, bytes):
            try:
                text = record.decode("utf-8")
            except UnicodeDecodeError as error:
                return f"invalid UTF-8 at byte offset {error.start} of the line"
            if not text.strip():
                return "blank line (expected one JSON object)"
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                return f"malformed JSON ({error.msg} at column {error.colno})"
        if not isinstance(record, dict):
            hint = " (a JSON array file? pass --input-format json)" if isinstance(record, list) else ""
            return f"expected a JSON object, got {type(record).__name__}{hint}"
        values = []
        for key in self.json_keys:
            if key not in record:
                return f"missing key {key!r} (the record has {sorted(record)[:8]})"
            value = record[key]
            if isinstance(value, str):
                values.append([value])
            elif isinstance(value, list) and all(isinstance(sentence, str) for sentence in value):
                values.append(value)
            else:
                return f"key {key!r} holds {type(value).__name__}, expected a string or a list of strings"
        return values

    def _encode_sentences(self, sentences: list[str], numbers: list[int], bad: dict[int, str]) -> list[list[int]]:
        """Token ids of each sentence; a text the tokenizer rejects (e.g. a lone surrogate) marks its record bad."""
        try:
            return self.tokenizer.encode_batch(sentences)
        except Exception:  # find the culprit one by one: rare
            encoded = []
            for sentence, number in zip(sentences, numbers, strict=True):
                try:
                    encoded.append(self.tokenizer.encode(sentence))
                except Exception as error:
                    bad.setdefault(number, f"text the tokenizer cannot encode ({type(error).__name__}: {error})")
                    encoded.append([])
            return encoded

    def __call__(self, task: Task) -> EncodedBatch:
        source, first, records = task
        bad: dict[int, str] = {}
        documents: list[tuple[int, list[list[str]]]] = []
        for number, record in enumerate(records, start=first):
            parsed = self.parse(record)
            if isinstance(parsed, str):
                bad[number] = parsed
            else:
                documents.append((number, parsed))
        per_key = [self._encode_key(documents, key_number, bad) for key_number in range(len(self.json_keys))]
        good = [i for i, (number, _) in enumerate(documents) if number not in bad]
        result = EncodedBatch(source, len(good), sum(len(r) if isinstance(r, bytes) else 0 for r in records),
                              {}, {}, {}, sorted(bad.items()))
        for key, encoded in zip(self.json_keys, per_key, strict=True):
            self._flatten(key, [encoded[i] for i in good], result)
        if not isinstance(records[0], bytes):
            result.input_bytes = sum(len(s.encode()) for i in good for v in documents[i][1] for s in v)
        return result

    def _encode_key(self, documents: list[tuple[int, list[list[str]]]], key_number: int,
                    bad: dict[int, str]) -> list[list[list[int]]]:
        """Per document, the non-empty token sequences of one key (eod appended to the last with append_eod)."""
        sentences = [sentence for _, values in documents for sentence in values[key_number]]
        numbers = [number for number, values in documents for _ in values[key_number]]
        encoded = iter(self._encode_sentences(sentences, numbers, bad))
        result = []
        for number, values in documents:
            sequences = [ids for ids in itertools.islice(encoded, len(values[key_number])) if ids]
            if not sequences:
                bad.setdefault(number, f"empty document: key {self.json_keys[key_number]!r} has no tokens")
            elif self.append_eod:
                sequences[-1].append(self.tokenizer.eod_id)
            result.append(sequences)
        return result

    def _flatten(self, key: str, documents: list[list[list[int]]], result: EncodedBatch) -> None:
        sequences = [ids for document in documents for ids in document]
        lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        result.tokens[key] = np.fromiter(itertools.chain.from_iterable(sequences), dtype=self.dtype,
                                         count=int(lengths.sum()))
        result.sequence_lengths[key] = lengths
        result.sequences_per_document[key] = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))


_WORKER_ENCODER: DocumentEncoder | None = None  # the main process's, handed to each worker by _start_worker


def _start_worker(encoder: DocumentEncoder) -> None:
    global _WORKER_ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    _WORKER_ENCODER = encoder  # built (and its vocabulary checked) once, in the main process


def _encode_in_worker(task: Task) -> EncodedBatch:
    return _WORKER_ENCODER(task)


def encode_stream(config: PreprocessConfig, tasks: Iterable[Task], encoder: DocumentEncoder) -> Iterator[EncodedBatch]:
    """Encoded batches in input order; with several workers at most 4 * workers batches are in flight."""
    if config.workers == 1:
        yield from map(encoder, tasks)
        return
    limit = 4 * config.workers
    in_flight, stopping = threading.Semaphore(limit), threading.Event()

    def throttled() -> Iterator[Task]:  # runs in the pool's task-feeding thread
        for task in tasks:
            in_flight.acquire()
            if stopping.is_set():
                return
            yield task

    with multiprocessing.Pool(config.workers, initializer=_start_worker, initargs=(encoder,)) as pool:
        try:
            for result in pool.imap(_encode_in_worker, throttled(), chunksize=1):
                in_flight.release()
                yield result
        finally:
            stopping.set()
            for _ in range(limit):  # unblock the feeding thread so that the pool can shut down
                in_flight.release()


# ---------------------------------------------------------------------------------------------------------- writing


class _Progress:
    """A tqdm bar in bytes (MB/s) with documents/s and tokens/s after it."""

    def __init__(self, config: PreprocessConfig, slices: Sequence[InputSlice]) -> None:
        from tqdm import tqdm

        plain = all(config.format_of(piece.path) == "jsonl" and not piece.path.endswith(".gz") for piece in slices)
        total = sum((piece.end if piece.end is not None else os.path.getsize(piece.path)) - piece.start
                    for piece in slices) if plain else None  # bytes of decoded records are counted otherwise
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenising", disable=not config.progress,
                        mininterval=0.5, smoothing=0.1)
        self.start, self.last_postfix = time.perf_counter(), 0.0

    def update(self, report: PreprocessReport, input_bytes: int) -> None:
        self.bar.update(input_bytes)
        now = time.perf_counter()
        if now - self.last_postfix > 0.5:
            elapsed = max(now - self.start, 1e-9)
            self.bar.set_postfix_str(f"{report.documents / elapsed:.0f} docs/s, "
                                     f"{sum(report.tokens.values()) / elapsed:.0f} tokens/s", refresh=False)
            self.last_postfix = now

    def close(self) -> None:
        self.bar.close()


def preprocess(config: PreprocessConfig) -> PreprocessReport:
    """Tokenise the inputs (or this shard of them) into one indexed dataset per key; returns what was written."""
    start = time.perf_counter()
    tokenizer = build_tokenizer(**config.tokenizer_arguments())
    if tokenizer.backend_note and config.tokenizer_backend == "auto":
        print(f"tokenizer backend: tokenizers ({tokenizer.backend_note})", file=sys.stderr)
    encoder = DocumentEncoder(tokenizer, config.json_keys, config.append_eod)
    prefix = config.dataset_prefix()
    report = PreprocessReport([output_prefix_for(prefix, key) for key in config.json_keys],
                              tokens={key: 0 for key in config.json_keys}, backend=tokenizer.backend,
                              shard=config.shard)
    slices = config.slices()
    if config.shard is not None:
        sharding.remove_manifest(prefix)  # until the new one is written, this shard counts as incomplete
    _write_datasets(config, slices, encoder, report)
    if config.shard is not None:
        sharding.write_manifest(prefix, _manifest(config, slices, report))
    report.seconds = time.perf_counter() - start
    return report


def _write_datasets(config: PreprocessConfig, slices: Sequence[InputSlice], encoder: DocumentEncoder,
                    report: PreprocessReport) -> None:
    """Stream the slices through the encoder into one builder per key; a builder left by an error is discarded."""
    where = _LineNumbers(config, slices)
    progress = _Progress(config, slices)
    try:
        with ExitStack() as stack:
            builders = {key: stack.enter_context(IndexedDatasetBuilder(prefix, encoder.dtype))
                        for key, prefix in zip(config.json_keys, report.outputs, strict=True)}
            batches = stack.enter_context(closing(encode_stream(config, read_batches(config, slices), encoder)))
            for batch in batches:  # closing(): an error stops the worker pool now, not when garbage-collected
                _record_bad_lines(config, batch, report, where)
                for key, builder in builders.items():
                    builder.add_documents(batch.tokens[key], batch.sequence_lengths[key],
                                          batch.sequences_per_document[key])
                    report.tokens[key] += batch.tokens[key].size
                report.documents += batch.num_documents
                report.input_bytes += batch.input_bytes
                progress.update(report, batch.input_bytes)
            if report.documents == 0 and config.shard is None:  # a shard may be empty; the merge checks the total
                raise BadInputError(f"{', '.join(config.files[:3])}: no documents (empty input, or every line or "
                                    f"row was bad); nothing was written")
    finally:
        progress.close()


def _record_bad_lines(config: PreprocessConfig, batch: EncodedBatch, report: PreprocessReport,
                      where: _LineNumbers) -> None:
    for number, reason in batch.bad:
        message = f"{where(batch.source, number)}: {reason}"
        if not config.skip_bad_lines:
            unit = "line" if where.jsonl[batch.source] else "row"
            raise BadInputError(f"{message}; fix it, or pass --skip-bad-lines to skip such {unit}s")
        report.skipped += 1
        if len(report.skipped_examples) < 10:
            report.skipped_examples.append(message)


def _manifest(config: PreprocessConfig, slices: Sequence[InputSlice], report: PreprocessReport) -> dict:
    """What the merge checks: the same inputs and settings in every shard, and the datasets this shard wrote."""
    index, count = config.shard
    absolute = [os.path.abspath(path) if path else None
                for path in (config.vocab_file, config.merge_file, config.tokenizer_model)]
    return {
        "shard": index, "num_shards": count,
        "inputs": [[os.path.abspath(path), sharding.input_size(path)] for path in config.files],
        "json_keys": list(config.json_keys), "append_eod": config.append_eod, "input_format": config.input_format,
        "tokenizer": {"type": config.tokenizer_type, "vocab_file": absolute[0], "merge_file": absolute[1],
                      "tokenizer_model": absolute[2], "parse_special_tokens": config.parse_special_tokens},
        "slices": [[os.path.abspath(piece.path), piece.start, piece.end] for piece in slices],
        "documents": report.documents, "skipped": report.skipped, "backend": report.backend,
        "datasets": [sharding.dataset_record(prefix) for prefix in report.outputs],
    }
