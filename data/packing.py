"""Packed samples for fine-tuning (data.packing "bfd", "greedy", "none"): whole documents, never cut unless asked.

A sample is seq_length + 1 tokens (the loader's unit, data/loader.py). Megatron's pretraining samples ("concat",
data/gpt_dataset.py) lay the documents end to end and cut them at every sample boundary, so a conversation may start
in one sample and end in the next. Packing instead puts whole documents in each sample and fills the rest with the
end-of-document token, whose loss-mask bit is 0:

    packing   which documents share a sample                                       from
    "bfd"     best-fit decreasing: longest first, each into the fullest sample     TRL's SFTTrainer (packing_strategy
              it still fits in (the fewest samples, little padding)                "bfd"), the default for SFT
    "greedy"  in the shuffled order, into the current sample until the next        GPT-NeoX's pack_until_overflow
              does not fit
    "none"    one document per sample                                               GPT-NeoX's unpacked, TRL unpacked

A document longer than a sample (data.packing_overflow) is "truncate"d to its first seq_length + 1 tokens (TRL's
default), "drop"ped, or "split" into pieces of seq_length + 1 tokens, each packed as a document of its own. Dropped
and truncated documents are counted and reported.

A sample's documents, for data.reset_attention_mask and data.reset_position_ids (which packing is meant to be used
with, and turns on by default: without them the documents of a sample attend to each other), are its pieces
(``sample_documents``), whatever tokens they hold; the padding is one more. The end-of-document token only pads (and
ends each document where tools/preprocess_data.py --append-eod put it); under data.document_boundaries "eod_token"
(Megatron-LM's rule) it is what tells the documents apart instead, and training/data.py checks that it ends every
document and occurs nowhere else (data/loader.py check_end_token_rule).

Epochs. The documents of the split are shuffled anew for every epoch (seed and epoch number), packed, and the packs
of the epoch shuffled; epoch after epoch until there are as many samples as the run needs. Sample i is a pure
function of i, so a run resumes in the middle of an epoch exactly from consumed_samples, as the loader's rule wants.

The pack index is cached like the GPT sample index (data/index_cache.py: one process per node builds it):

    pieces        (n, 3) int64  [document id, first token, length] of every piece, pack after pack
    pack_offsets  (P + 1,)      pieces [pack_offsets[p], pack_offsets[p + 1]) make pack p
    pack_targets  (P,) int32    the target tokens of pack p: its labels whose mask bit is 1 (what training counts)
    epoch_starts  (E + 1,)      the first pack of each epoch
    overflowed    (E, 2)        the documents dropped and cut in each epoch (data.packing_overflow)

A sample's loss-mask bits are its documents' (ones for a dataset without a mask), 0 on the padding, and 0 on each
document's first token: it is the label of the previous document's end token, which cannot predict it.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from data.index_cache import IndexCache, dataset_fingerprint, file_crc32
from data.indexed_dataset import IndexedDataset, idx_path

PACKINGS = ("concat", "bfd", "greedy", "none")
OVERFLOWS = ("truncate", "drop", "split")
PACK_INDEX_VERSION = 1
PACK_INDEX_NAMES = ("pieces", "pack_offsets", "pack_targets", "epoch_starts", "overflowed")


def document_pieces(lengths: np.ndarray, documents: np.ndarray, capacity: int,
                    overflow: str) -> tuple[np.ndarray, int, int]:
    """(pieces (n, 3) [document, first token, length], documents dropped, documents cut) for ``documents`` (ids, in
    order) of ``lengths`` (tokens of each id) into samples of ``capacity`` tokens, as ``overflow`` says. Empty
    documents are left out."""
    if overflow not in OVERFLOWS:
        raise ValueError(f"data.packing_overflow must be one of {OVERFLOWS}, got {overflow!r}")
    documents = documents[np.asarray(lengths[documents]) > 0]  # an empty document has nothing to pack
    sizes = np.asarray(lengths[documents], dtype=np.int64)
    long = sizes > capacity
    if overflow == "drop":
        keep = ~long
        return np.stack([documents[keep], np.zeros(keep.sum(), np.int64), sizes[keep]], axis=1), int(long.sum()), 0
    if overflow == "truncate":
        return np.stack([documents, np.zeros_like(sizes), np.minimum(sizes, capacity)], axis=1), 0, int(long.sum())
    counts = -(-sizes // capacity)  # "split": ceil(size / capacity) pieces each
    owners = np.repeat(np.arange(len(documents)), counts)
    first_piece = np.repeat(np.cumsum(counts) - counts, counts)
    starts = (np.arange(counts.sum()) - first_piece) * capacity
    pieces = np.stack([documents[owners], starts, np.minimum(sizes[owners] - starts, capacity)], axis=1)
    return pieces.astype(np.int64), 0, int(long.sum())


class _FullestFit:
    """The open packs by free space, for best fit: the fullest open pack with room for a length, in O(log C).

    A max-tree over the free amounts 1 .. capacity holds, per node, the largest amount that some open pack has below
    it (0: none); the search goes left whenever the left half has room enough, so it ends at the smallest amount
    that fits. Packs with the same free space are taken first-opened first (TRL's order)."""

    def __init__(self, capacity: int) -> None:
        self.leaves = 1 << capacity.bit_length()  # a leaf per free amount 0 .. capacity
        self.largest = [0] * (2 * self.leaves)
        self.packs: dict[int, deque[int]] = defaultdict(deque)

    def _mark(self, free: int, present: bool) -> None:
        node = self.leaves + free
        self.largest[node] = free if present else 0
        while node > 1:
            node //= 2
            left, right = self.largest[2 * node], self.largest[2 * node + 1]
            self.largest[node] = left if left >= right else right

    def push(self, free: int, pack: int) -> None:
        if not self.packs[free]:
            self._mark(free, True)
        self.packs[free].append(pack)

    def pop_fitting(self, length: int) -> tuple[int, int] | None:
        """(pack, its free space) of the fullest open pack with room for ``length`` tokens, removed; or None."""
        if self.largest[1] < length:
            return None
        node = 1
        while node < self.leaves:
            node = 2 * node if self.largest[2 * node] >= length else 2 * node + 1
        free = node - self.leaves
        pack = self.packs[free].popleft()
        if not self.packs[free]:
            self._mark(free, False)
        return pack, free


def pack(piece_lengths: np.ndarray, capacity: int, packing: str) -> list[list[int]]:
    """The packs, each a list of piece positions (into ``piece_lengths``, all <= capacity), in packing order."""
    if packing == "none":
        return [[position] for position in range(len(piece_lengths))]
    if packing == "greedy":
        packs, used = [], capacity + 1
        for position, length in enumerate(piece_lengths.tolist()):
            if used + length > capacity:
                packs.append([])
                used = 0
            packs[-1].append(position)
            used += length
        return packs
    if packing != "bfd":
        raise ValueError(f"packing must be one of {PACKINGS[1:]} here, got {packing!r}")
    packs: list[list[int]] = []
    open_packs = _FullestFit(capacity)
    for position in np.argsort(-piece_lengths, kind="stable").tolist():  # longest first; ties in shuffled order
        length = int(piece_lengths[position])
        found = open_packs.pop_fitting(length)
        if found is None:
            packs.append([position])
            free = capacity - length
            target = len(packs) - 1
        else:
            target, free = found
            packs[target].append(position)
            free -= length
        if free > 0:
            open_packs.push(free, target)
    return packs


def build_pack_index(lengths: np.ndarray, document_range: tuple[int, int], capacity: int, num_samples: int,
                     seed: int, packing: str, overflow: str,
                     sample_bits: Callable[[np.ndarray], np.ndarray]) -> dict[str, np.ndarray]:
    """The pack index of at least ``num_samples`` samples, whole epochs (module docstring). ``sample_bits(pieces)``:
    the loss-mask bits of the sample made of these pieces (padding included), from which each pack's target count."""
    begin, end = document_range
    all_pieces, offsets, targets, epoch_starts, overflowed = [], [0], [], [0], []
    epoch = 0
    while epoch == 0 or len(targets) < num_samples:
        rng = np.random.Generator(np.random.PCG64([seed, epoch]))
        documents = rng.permutation(np.arange(begin, end, dtype=np.int64))
        pieces, dropped, cut = document_pieces(lengths, documents, capacity, overflow)
        if len(pieces) == 0:
            raise ValueError(f"no document of documents [{begin}, {end}) fits a sample of {capacity} tokens and "
                             f"data.packing_overflow is \"drop\": raise model.seq_length or choose \"truncate\"")
        groups = pack(pieces[:, 2], capacity, packing)
        for group in rng.permutation(len(groups)).tolist():
            members = pieces[groups[group]]
            all_pieces.append(members)
            offsets.append(offsets[-1] + len(members))
            targets.append(int(sample_bits(members)[1:].sum()))  # label-aligned: the first token is no one's label
        epoch_starts.append(len(targets))
        overflowed.append((dropped, cut))
        epoch += 1
    return {"pieces": np.concatenate(all_pieces), "pack_offsets": np.asarray(offsets, dtype=np.int64),
            "pack_targets": np.asarray(targets, dtype=np.int32), "epoch_starts": np.asarray(epoch_starts, np.int64),
            "overflowed": np.asarray(overflowed, dtype=np.int64)}


@dataclass(frozen=True)
class PackIndexSpec:
    """Everything that decides a pack index; its hash is the cache key."""

    fingerprint: str
    document_range: tuple[int, int]
    seq_length: int
    num_samples: int
    seed: int
    packing: str
    overflow: str
    eod_token_id: int
    loss_mask_crc32: int  # of the mask dataset's .bin (-1 without one): the target counts come from its bits

    def description(self, prefix: str) -> dict:
        return {"class": "PackedDataset", "version": PACK_INDEX_VERSION, "dataset": idx_path(prefix),
                "fingerprint": self.fingerprint, "document_range": list(self.document_range),
                "seq_length": self.seq_length, "num_samples": self.num_samples, "seed": self.seed,
                "packing": self.packing, "overflow": self.overflow, "eod_token_id": self.eod_token_id,
                "loss_mask_crc32": self.loss_mask_crc32}

    def key(self) -> str:
        fields = self.description("")
        del fields["dataset"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


class PackedDataset:
    """Samples of seq_length + 1 tokens (int64), each whole documents of [begin, end) and end-token padding.

    The same interface as GPTDataset: ``len()``, ``dataset[i]``, ``sample_loss_mask(i)`` (the documents' bits, or
    ones without a mask dataset, and 0 on the padding), ``sample_documents(i)`` (its pieces), plus ``pack_targets``
    (each sample's target tokens) and ``epoch_starts``."""

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], seq_length: int, num_samples: int,
                 *, seed: int, packing: str, overflow: str, eod_token_id: int, cache: IndexCache | None = None,
                 loss_mask: IndexedDataset | None = None) -> None:
        begin, end = document_range
        if not 0 <= begin < end <= indexed.num_documents:
            raise ValueError(f"{indexed.idx_file}: documents [{begin}, {end}) are out of its "
                             f"{indexed.num_documents} documents (is the split too fine for this dataset?)")
        if packing not in PACKINGS[1:]:
            raise ValueError(f"data.packing must be one of {PACKINGS}, got {packing!r}")
        self.indexed, self.loss_mask, self.eod_token_id = indexed, loss_mask, eod_token_id
        self.capacity = seq_length + 1
        self.spec = PackIndexSpec(dataset_fingerprint(indexed) if cache else "", (begin, end), seq_length,
                                  num_samples, seed, packing, overflow, eod_token_id,
                                  file_crc32(loss_mask.bin_file) if cache and loss_mask is not None else -1)

        def build() -> dict[str, np.ndarray]:
            return build_pack_index(indexed.document_lengths(), (begin, end), self.capacity, num_samples, seed,
                                    packing, overflow, self._bits)

        if cache is None:
            arrays, self.index_built = build(), True
        else:
            arrays, self.index_built = cache.load_or_build(self.spec.key(), PACK_INDEX_NAMES, build,
                                                           self.spec.description(indexed.prefix))
        self.pieces, self.pack_offsets = arrays["pieces"], arrays["pack_offsets"]
        self.pack_targets, self.epoch_starts = arrays["pack_targets"], arrays["epoch_starts"]
        self.dropped, self.cut = (int(value) for value in arrays["overflowed"][0])

    def __len__(self) -> int:
        return len(self.pack_targets)

    def _pieces(self, index: int) -> np.ndarray:
        return self.pieces[self.pack_offsets[index]:self.pack_offsets[index + 1]]

    def _read(self, flat: np.ndarray, pieces: np.ndarray, padding: int) -> np.ndarray:
        parts = [flat[self.indexed.document_start(int(document)) + int(first):][:int(length)]
                 for document, first, length in pieces]
        used = sum(len(part) for part in parts)
        return np.concatenate([*parts, np.full(self.capacity - used, padding, dtype=flat.dtype)])

    def _bits(self, pieces: np.ndarray) -> np.ndarray:
        """The loss-mask bits of the sample of these pieces: the mask dataset's (ones without one), 0 on the padding
        and 0 on each piece's first token, which nothing before it in the sample can predict (the end token of the
        previous document does not announce it; TRL's padding-free collator masks it likewise)."""
        used = int(pieces[:, 2].sum())
        if self.loss_mask is not None:
            bits = self._read(self.loss_mask.tokens, pieces, 0).astype(np.uint8)
        else:
            bits = np.concatenate([np.ones(used, np.uint8), np.zeros(self.capacity - used, np.uint8)])
        bits[np.cumsum(pieces[:, 2]) - pieces[:, 2]] = 0
        return bits

    def __getitem__(self, index: int) -> np.ndarray:
        return self._read(self.indexed.tokens, self._pieces(index), self.eod_token_id).astype(np.int64)

    def sample_loss_mask(self, index: int) -> np.ndarray:
        """(seq_length + 1,) uint8: the bits of ``dataset[index]``'s tokens; 0 on the padding."""
        return self._bits(self._pieces(index))

    def sample_documents(self, index: int) -> np.ndarray:
        """(seq_length + 1,) int64: each token's piece in ``dataset[index]``, 0, 1, ..., and the padding one more
        (data.document_boundaries "dataset": whatever tokens the documents hold)."""
        lengths = self._pieces(index)[:, 2]
        padding = self.capacity - int(lengths.sum())
        return np.repeat(np.arange(len(lengths) + 1, dtype=np.int64), np.append(lengths, padding))

    def summary(self) -> str:
        """One line for the run's log: samples, epochs, fill and targets, what overflowed."""
        used = int(self.pieces[:, 2].sum())
        epochs = len(self.epoch_starts) - 1
        return (f"{len(self)} packed samples of {self.capacity} tokens in {epochs} epoch(s) "
                f"({len(self) / max(epochs, 1):.0f} per epoch), {100 * used / (len(self) * self.capacity):.1f}% "
                f"tokens (the rest padding), {int(self.pack_targets.sum())} target tokens; per epoch "
                f"{self.dropped} documents dropped, {self.cut} cut (data.packing_overflow)")
