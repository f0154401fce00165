"""Independent references the data tests compare against, written from the published algorithms, not from data/.

- ``reference_gpt2_encode``: OpenAI's GPT-2 BPE (the algorithm Megatron's GPT2Tokenizer runs), in pure Python.
- ``reference_idx_bytes``: the bytes of an MMIDIDX v1 index, laid out field by field with struct.
- ``reference_sample_index``: Megatron's build_sample_idx loop (helpers.cpp), in pure Python.
- ``reference_blend``: the chairman-assignment rule, one slot at a time with exact fractions.
"""

from __future__ import annotations

import json
import struct
from fractions import Fraction
from functools import cache

import numpy as np
import regex

from data.tokenizers import DEFAULT_MERGE_FILE, DEFAULT_VOCAB_FILE

GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@cache
def _gpt2_tables() -> tuple[dict[int, str], dict[str, int], dict[tuple[str, str], int]]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = printable[:], 0
    byte_values = printable[:]
    for byte in range(256):
        if byte not in printable:
            byte_values.append(byte)
            codes.append(256 + extra)
            extra += 1
    byte_encoder = dict(zip(byte_values, map(chr, codes), strict=True))
    with open(DEFAULT_VOCAB_FILE, encoding="utf-8") as stream:
        encoder = json.load(stream)
    with open(DEFAULT_MERGE_FILE, encoding="utf-8") as stream:
        merges = [tuple(line.split()) for line in stream.read().split("\n")[1:] if line]
    return byte_encoder, encoder, {pair: rank for rank, pair in enumerate(merges)}


@cache
def _bpe(word: str) -> tuple[str, ...]:
    _, _, ranks = _gpt2_tables()
    parts = tuple(word)
    while len(parts) > 1:
        pairs = {(parts[i], parts[i + 1]) for i in range(len(parts) - 1)}
        best = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(parts):
            if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = tuple(merged)
    return parts


def reference_gpt2_encode(text: str) -> list[int]:
    byte_encoder, encoder, _ = _gpt2_tables()
    ids = []
    for piece in GPT2_PATTERN.findall(text):
        word = "".join(byte_encoder[byte] for byte in piece.encode("utf-8"))
        ids.extend(encoder[part] for part in _bpe(word))
    return ids


def reference_idx_bytes(documents: list[list[list[int]]], dtype_code: int, itemsize: int) -> bytes:
    """documents: per document, its sequences of token ids."""
    sizes = [len(sequence) for document in documents for sequence in document]
    pointers, position = [], 0
    for size in sizes:
        pointers.append(position)
        position += size * itemsize
    doc_index = [0]
    for document in documents:
        doc_index.append(doc_index[-1] + len(document))
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_index))
    out += b"".join(struct.pack("<i", size) for size in sizes)
    out += b"".join(struct.pack("<q", pointer) for pointer in pointers)
    out += b"".join(struct.pack("<q", entry) for entry in doc_index)
    return out


def reference_bin_bytes(documents: list[list[list[int]]], pack: str) -> bytes:
    return b"".join(struct.pack(f"<{pack}", token) for document in documents for seq in document for token in seq)


def reference_sample_index(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """Megatron's build_sample_idx: walk the documents, seq_length + 1 tokens per sample, the last one shared."""
    out = [(0, 0)]
    doc_idx_index, doc_offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[doc_idx[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out.append((doc_idx_index, doc_offset))
    return np.array(out, dtype=np.int64)


def reference_blend(weights: list[float], num_samples: int) -> list[int]:
    """Chairman assignment with exact rational arithmetic (no tolerance): the rule data/blended_dataset.py runs."""
    total = sum(Fraction(weight) for weight in weights)
    fractions = [Fraction(weight) / total for weight in weights]
    threshold = Fraction(1, 2 * len(weights) - 2)
    counts, chosen = [0] * len(weights), []
    for slot in range(1, num_samples + 1):
        eligible = [k for k in range(len(weights)) if fractions[k] * slot - counts[k] >= threshold]
        pick = min(eligible, key=lambda k: ((counts[k] + 1 - threshold) / fractions[k], k))
        counts[pick] += 1
        chosen.append(pick)
    return chosen


def test_reference_gpt2_encoder_gives_known_ids() -> None:
    assert reference_gpt2_encode("Hello world") == [15496, 995]


def test_reference_sample_index_walks_documents() -> None:
    # documents of 3 and 4 tokens, seq_length 2: samples [0,1,2] [2,3',4'] [4',5',6'] over positions 0..6
    got = reference_sample_index(np.array([3, 4]), np.array([0, 1]), 2, 3)
    assert got.tolist() == [[0, 0], [0, 2], [1, 1], [1, 3]]
