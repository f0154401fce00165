"""Counts and a document-length histogram of an indexed dataset (the library under tools/inspect_dataset.py)."""

from __future__ import annotations

import numpy as np

from data.indexed_dataset import IndexedDataset


def describe(dataset: IndexedDataset) -> dict[str, int | float | str]:
    """Sequence, document and token counts, dtype, largest token id and document-length statistics."""
    lengths = np.asarray(dataset.document_lengths(), dtype=np.int64)
    stats: dict[str, int | float | str] = {
        "prefix": dataset.prefix, "dtype": str(dataset.dtype), "sequences": len(dataset),
        "documents": dataset.num_documents, "tokens": dataset.num_tokens, "max_token_id": dataset.max_token_id(),
    }
    if lengths.size:
        stats.update({"document_tokens_min": int(lengths.min()), "document_tokens_mean": float(lengths.mean()),
                      "document_tokens_median": float(np.median(lengths)),
                      "document_tokens_p99": float(np.percentile(lengths, 99)),
                      "document_tokens_max": int(lengths.max())})
    return stats


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(low, high, count) of document lengths in power-of-two buckets [low, high); the first bucket is [0, 1)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return []
    buckets = np.where(lengths > 0, np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64) + 1, 0)
    counts = np.bincount(buckets)
    return [(0 if b == 0 else 1 << (b - 1), 1 if b == 0 else 1 << b, int(c)) for b, c in enumerate(counts) if c]


def format_histogram(histogram: list[tuple[int, int, int]], width: int = 50) -> str:
    """Text bars, one line per bucket."""
    if not histogram:
        return "(no documents)"
    largest = max(count for _, _, count in histogram)
    return "\n".join(f"[{low:>9}, {high:>9}) {count:>10} {'#' * max(1, round(width * count / largest))}"
                     for low, high, count in histogram)
