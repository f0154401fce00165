"""GPT pretraining samples: seq_length + 1 tokens cut across document boundaries, Megatron's three-index design.

For the documents of one split (a contiguous range of document ids, Megatron's "969,30,1" split):

- document_index (E * docs,) int32: the document ids of E epochs, shuffled (the last epoch apart when it is used
  for less than 80% of its samples, so that a partial epoch is still a uniform draw, as Megatron does).
- sample_index (S + 1, 2): for each sample boundary, [position in document_index, token offset in that document].
  Sample i runs from boundary i to boundary i + 1 inclusive: seq_length + 1 tokens, the last token shared with sample
  i + 1 (it is the label of the last input there and the first input here). S = (E * tokens_per_epoch - 1) //
  seq_length, and E is the smallest number of epochs giving at least the requested number of samples.
- shuffle_index (S,): the order in which samples are served.

The arrays are built with vectorised numpy in chunks (no compiled helper) and cached on disk as .npy under a hash of
everything that affects them (data/index_cache.py: one process per node builds, the others memory-map the result).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data.blended_dataset import BlendedDataset, load_or_build_blending_indices, normalize_weights
from data.index_cache import IndexCache, IndexCachePolicy, dataset_fingerprint
from data.indexed_dataset import IndexedDataset, idx_path
from data.loss_mask import find_loss_mask
from data.packing import PackedDataset

GPT_INDEX_VERSION = 1
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's: a final epoch used for less than this is shuffled on its own
_CHUNK = 1 << 22  # documents per chunk while the document index is filled
_SAMPLE_CHUNK = 1 << 16  # documents per chunk of the sample index: its temporaries stay in cache (2x faster than 4M)
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def parse_split(split: str) -> list[float]:
    """ "969,30,1" (or "98/2/0", "1") -> three fractions summing to 1, for train, valid and test."""
    weights = [float(part) for part in re.findall(r"[.0-9]+", split)]
    if not weights or len(weights) > 3 or sum(weights) <= 0:
        raise ValueError(f"split {split!r}: give up to three non-negative numbers, e.g. '969,30,1'")
    weights += [0.0] * (3 - len(weights))
    return [weight / sum(weights) for weight in weights]


def split_document_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """[begin, end) document ids of train, valid and test, rounded as Megatron does (the ends sum exactly)."""
    bounds = [0]
    for fraction in parse_split(split):
        bounds.append(bounds[-1] + int(round(fraction * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [bound - excess for bound in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def parse_data_path(data_path: str | Sequence[str]) -> tuple[list[str], list[float]]:
    """Megatron's --data-path: "prefix" or "w1 prefix1 w2 prefix2 ..." -> (prefixes, weights)."""
    items = data_path.split() if isinstance(data_path, str) else list(data_path)
    if len(items) == 1:
        return items, [1.0]
    if len(items) % 2:
        raise ValueError(f"--data-path {items}: give one prefix, or pairs of weight and prefix")
    try:
        weights = [float(weight) for weight in items[0::2]]
    except ValueError as error:
        raise ValueError(f"--data-path {items}: in pairs, the weight comes first ({error})") from None
    return items[1::2], weights


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest E with (E * tokens_per_epoch - 1) // seq_length >= num_samples."""
    if tokens_per_epoch <= 0:
        raise ValueError("the documents of this split hold no tokens; give it more documents or fewer samples")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_document_index(document_range: tuple[int, int], num_epochs: int, rng: np.random.Generator,
                         separate_final_epoch: bool) -> np.ndarray:
    """(num_epochs * documents,) int32: documents [begin, end) once per epoch, shuffled (the final epoch apart)."""
    begin, end = document_range
    document_index = np.empty((num_epochs, end - begin), dtype=np.int32)
    for start in range(0, end - begin, _CHUNK):  # filled in chunks: no temporary as large as the output
        stop = min(start + _CHUNK, end - begin)
        document_index[:, start:stop] = np.arange(begin + start, begin + stop, dtype=np.int32)
    document_index = document_index.reshape(-1)
    if separate_final_epoch and num_epochs > 1:
        rng.shuffle(document_index[: -(end - begin)])
        rng.shuffle(document_index[-(end - begin) :])
    else:
        rng.shuffle(document_index)
    return document_index


def build_sample_index(document_lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_samples: int) -> np.ndarray:
    """(num_samples + 1, 2): boundary i = [position j in document_index, offset] of token i * seq_length.

    document_lengths: tokens of each document id. Boundary i lies in the document at position j when
    start_j <= i * seq_length < start_{j+1} (start = running token count), i.e. for i in
    [ceil(start_j / seq_length), ceil(start_{j+1} / seq_length)): built chunk by chunk with np.repeat, so memory
    stays at the output plus one chunk.
    """
    wide = len(document_index) >= 2**31 or int(np.max(document_lengths, initial=0)) >= 2**31
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64 if wide else np.int32)
    filled, tokens_before = 0, 0
    for begin in range(0, len(document_index), _SAMPLE_CHUNK):
        lengths = np.asarray(document_lengths[document_index[begin : begin + _SAMPLE_CHUNK]], dtype=np.int64)
        starts = np.concatenate(([tokens_before], tokens_before + np.cumsum(lengths)))  # (n + 1,)
        first_boundary = -(-starts // seq_length)  # first boundary at or after each document start
        take = min(int(first_boundary[-1]), num_samples + 1) - filled
        positions = np.repeat(np.arange(begin, begin + lengths.size), np.diff(first_boundary))[:take]
        sample_index[filled : filled + take, 0] = positions
        boundaries = np.arange(filled, filled + take, dtype=np.int64) * seq_length
        sample_index[filled : filled + take, 1] = boundaries - starts[positions - begin]
        filled, tokens_before = filled + take, int(starts[-1])
        if filled == num_samples + 1:
            return sample_index
    raise ValueError(f"{tokens_before} tokens make only {filled - 1} samples of {seq_length} + 1, "
                     f"{num_samples} were asked for")


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.Generator) -> np.ndarray:
    """(total_size,): samples [0, num_samples) shuffled, then [num_samples, total_size) shuffled on their own."""
    shuffle_index = np.arange(total_size, dtype=np.uint32 if total_size < np.iinfo(np.uint32).max else np.int64)
    rng.shuffle(shuffle_index[:num_samples])
    rng.shuffle(shuffle_index[num_samples:])
    return shuffle_index


def build_gpt_index(document_lengths: np.ndarray, document_range: tuple[int, int], seq_length: int,
                    num_samples: int, seed: int) -> dict[str, np.ndarray]:
    """The three index arrays for ``num_samples`` samples from documents [begin, end) of document_lengths."""
    begin, end = document_range
    if end >= 2**31:
        raise ValueError(f"{end} documents: the document index is int32, as Megatron's; split the dataset")
    tokens_per_epoch = int(np.sum(document_lengths[begin:end], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_final_epoch = False
    if num_epochs > 1:
        samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = (num_samples - samples_before_final
                                < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch))
    rng = np.random.Generator(np.random.PCG64(seed))
    document_index = build_document_index(document_range, num_epochs, rng, separate_final_epoch)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(document_lengths, document_index, seq_length, total)
    shuffled_together = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate_final_epoch else total
    shuffle_index = build_shuffle_index(shuffled_together, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


@dataclass(frozen=True)
class GPTIndexSpec:
    """Everything that decides the index arrays of one GPTDataset; its hash is the cache key."""

    fingerprint: str  # dataset_fingerprint of the indexed dataset
    document_range: tuple[int, int]  # [begin, end) document ids of the split
    seq_length: int
    num_samples: int
    seed: int

    def description(self, prefix: str) -> dict:
        return {"class": "GPTDataset", "version": GPT_INDEX_VERSION, "dataset": idx_path(prefix),
                "fingerprint": self.fingerprint, "document_range": list(self.document_range),
                "seq_length": self.seq_length, "num_samples": self.num_samples, "seed": self.seed,
                "separate_final_epoch_threshold": SEPARATE_FINAL_EPOCH_THRESHOLD}

    def key(self) -> str:
        fields = self.description("")
        del fields["dataset"]  # the path does not change the arrays: a moved dataset keeps its cache
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


class GPTDataset:
    """Samples of seq_length + 1 tokens (int64) from documents [begin, end) of an indexed dataset.

    ``len()`` is every sample of the epochs built (at least ``num_samples``); ``dataset[i]`` is (seq_length + 1,).
    With a cache, the index arrays are memory-mapped from it, built and saved first when this process is the cache's
    builder, or waited for when it is not (data/index_cache.py). ``index_built`` says whether this process built them.
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], seq_length: int, num_samples: int,
                 seed: int, cache: IndexCache | None = None, loss_mask: IndexedDataset | None = None) -> None:
        begin, end = document_range
        if not 0 <= begin < end <= indexed.num_documents:
            raise ValueError(f"{indexed.idx_file}: documents [{begin}, {end}) are out of its "
                             f"{indexed.num_documents} documents (is the split too fine for this dataset?)")
        if seq_length < 1 or num_samples < 0:
            raise ValueError(f"seq_length must be >= 1 and num_samples >= 0, got {seq_length} and {num_samples}")
        self.indexed, self.seq_length, self.loss_mask = indexed, seq_length, loss_mask
        self.spec = GPTIndexSpec(dataset_fingerprint(indexed) if cache else "", (begin, end), seq_length,
                                 num_samples, seed)

        def build() -> dict[str, np.ndarray]:
            return build_gpt_index(indexed.document_lengths(), (begin, end), seq_length, num_samples, seed)

        if cache is None:
            arrays, self.index_built = build(), True
        else:
            arrays, self.index_built = cache.load_or_build(self.spec.key(), INDEX_NAMES, build,
                                                           self.spec.description(indexed.prefix))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def _spans(self, index: int) -> list[tuple[int, int]]:
        """[start, end) token positions in the .bin of the parts of sample ``index``, in order (seq_length + 1 in all).

        Sample s = shuffle_index[index] runs from boundary s of the sample index to boundary s + 1 inclusive."""
        sample = int(self.shuffle_index[index])
        first, first_offset = (int(value) for value in self.sample_index[sample])
        last, last_offset = (int(value) for value in self.sample_index[sample + 1])
        starts = [self.indexed.document_start(int(self.document_index[position])) for position in range(first, last + 1)]
        spans = [(start, self.indexed.document_start(int(self.document_index[position]) + 1))
                 for position, start in zip(range(first, last), starts, strict=False)]
        spans.append((starts[-1], starts[-1] + last_offset + 1))
        spans[0] = (spans[0][0] + first_offset, spans[0][1])
        return spans

    def _read(self, flat: np.ndarray, index: int) -> np.ndarray:
        part = np.concatenate([flat[start:end] for start, end in self._spans(index)])
        if part.size != self.seq_length + 1:
            raise RuntimeError(f"{self.indexed.prefix}: sample {index} has {part.size} tokens, expected "
                               f"{self.seq_length + 1}; the cached index does not match the data: delete the cache")
        return part

    def __getitem__(self, index: int) -> np.ndarray:
        return self._read(self.indexed.tokens, index).astype(np.int64)

    def sample_loss_mask(self, index: int) -> np.ndarray | None:
        """(seq_length + 1,) uint8: the loss-mask bits of the tokens of ``dataset[index]`` (the same span of the mask
        dataset), or None without a mask dataset. A pure function of the index, as the tokens: resume stays exact."""
        return None if self.loss_mask is None else self._read(self.loss_mask.tokens, index)

    def sample_documents(self, index: int) -> np.ndarray:
        """(seq_length + 1,) int64: each token's document in ``dataset[index]``, 0 for the one the sample starts in,
        +1 at every start of the next in the document index (data.document_boundaries "dataset")."""
        lengths = np.array([end - start for start, end in self._spans(index)], dtype=np.int64)
        lengths = lengths[lengths > 0]  # an empty document holds no token of the sample
        return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)


def build_gpt_datasets(data_path: str | Sequence[str], split: str, seq_length: int, num_samples: Sequence[int],
                       seed: int, cache_dir: str | None = None, cache_policy: IndexCachePolicy | None = None,
                       packing: str = "concat", packing_overflow: str = "truncate", eod_token_id: int | None = None
                       ) -> list[GPTDataset | PackedDataset | BlendedDataset | None]:
    """Train, valid and test datasets from Megatron's --data-path and --split.

    packing: "concat" (Megatron's samples cut across documents: GPTDataset) or whole documents per sample, "bfd",
    "greedy" or "none" (data/packing.py's PackedDataset, with ``packing_overflow`` and the ``eod_token_id`` that ends
    every document and pads every sample).

    num_samples: samples wanted for (train, valid, test); a split with 0 samples gives None. Several weighted
    prefixes give BlendedDatasets whose components are split alike. Index arrays are cached as ``cache_policy``
    says (training/data.py gives one: beside each dataset by default), else in ``cache_dir`` when given, else
    built in memory each time; the blending indices go to the first dataset's cache.
    """
    prefixes, weights = parse_data_path(data_path)
    indexed = [IndexedDataset(prefix) for prefix in prefixes]
    masks = [find_loss_mask(prefix) for prefix in prefixes]  # beside the tokens, by name (data/loss_mask.py)
    if cache_policy is None and cache_dir:
        cache_policy = IndexCachePolicy(directory=cache_dir)
    caches = [cache_policy.cache_for(prefix) if cache_policy else None for prefix in prefixes]
    ranges = [split_document_ranges(dataset.num_documents, split) for dataset in indexed]
    result: list[GPTDataset | BlendedDataset | None] = []
    if packing != "concat" and eod_token_id is None:
        raise ValueError(f"data.packing {packing!r} needs the end-of-document token id (data.eod_token_id)")

    def dataset(k: int, split_number: int, samples: int) -> GPTDataset | PackedDataset:
        if packing == "concat":
            return GPTDataset(indexed[k], ranges[k][split_number], seq_length, samples, seed, caches[k], masks[k])
        return PackedDataset(indexed[k], ranges[k][split_number], seq_length, samples, seed=seed, packing=packing,
                             overflow=packing_overflow, eod_token_id=eod_token_id, cache=caches[k], loss_mask=masks[k])

    for split_number, wanted in enumerate(num_samples):
        if wanted <= 0:
            result.append(None)
            continue
        if len(indexed) == 1:
            result.append(dataset(0, split_number, wanted))
            continue
        indices = load_or_build_blending_indices(normalize_weights(weights), wanted, caches[0], prefixes)
        counts = np.bincount(indices[0], minlength=len(indexed))
        parts = [dataset(k, split_number, int(counts[k])) if counts[k] else [] for k in range(len(indexed))]
        result.append(BlendedDataset(parts, *indices))
    return result
