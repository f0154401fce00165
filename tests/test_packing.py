"""Whole-document packing (data.packing, data/packing.py): TRL's best-fit decreasing bin for bin, the packed samples
of a real chat dataset token for token, epochs, overflow, the cache, and the errors.

The samples are checked against the files independently of the packing code: each sample is read back as its
documents (split at the end tokens) and compared with the documents of the dataset and their mask bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.index_cache import IndexCache
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from data.loss_mask import loss_mask_prefix
from data.packing import PackedDataset, document_pieces, pack
from tests.test_data_loss_mask import CHAT_DEMO, EOD, preprocess


def trl_bins(lengths: list[int], capacity: int, overflow: str = "truncate") -> list[list[tuple[int, int]]]:
    """TRL's own best-fit decreasing (trl.data_utils._pack_bfd) on examples whose tokens are (id, position): each
    bin as its examples' (id, first position)."""
    import pyarrow as pa
    from trl.data_utils import _pack_bfd

    examples = pa.table({"input_ids": [[[i, t] for t in range(n)] for i, n in enumerate(lengths)]})
    bins = _pack_bfd(examples, capacity, overflow).to_pydict()
    found = []
    for tokens, lengths_in_bin in zip(bins["input_ids"], bins["seq_lengths"], strict=True):
        starts = np.cumsum([0, *lengths_in_bin[:-1]])
        found.append([tuple(tokens[start]) for start in starts])
    return found


@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_bfd_packs_what_trl_packs(overflow) -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 160, size=400)
    lengths[::37] = 129  # ties, and documents that overflow 128
    capacity = 128
    pieces, _, cut = document_pieces(lengths, np.arange(len(lengths)), capacity, overflow)
    ours = [[(int(pieces[p, 0]), int(pieces[p, 1])) for p in group] for group in pack(pieces[:, 2], capacity, "bfd")]
    assert ours == trl_bins(lengths.tolist(), capacity, overflow)
    assert cut == int((lengths > capacity).sum()) > 0
    fills = [sum(int(pieces[p, 2]) for p in group) for group in pack(pieces[:, 2], capacity, "bfd")]
    assert max(fills) <= capacity and sum(fills) == int(pieces[:, 2].sum())


def test_greedy_and_none() -> None:
    lengths = np.array([5, 4, 3, 6, 2, 8])
    assert pack(lengths, 10, "greedy") == [[0, 1], [2, 3], [4, 5]]
    assert pack(lengths, 10, "none") == [[0], [1], [2], [3], [4], [5]]
    # longest first: 8 and 6 and 5 open packs; 4 fills the 6's exactly, 3 goes with the 5; 2 finds two packs with 2
    # free and takes the one opened first (TRL's order)
    assert pack(lengths, 10, "bfd") == [[5, 4], [3, 1], [0, 2]]


def read_documents(dataset) -> list[tuple[list[int], list[int]]]:
    """(tokens, mask bits) of every document of the dataset, each ending with its end token."""
    masks = IndexedDataset(loss_mask_prefix(dataset.indexed.prefix))
    return [(dataset.indexed[d].tolist(), masks[d].tolist()) for d in range(dataset.indexed.num_documents)]


def documents_of(sample: np.ndarray, bits: np.ndarray) -> tuple[list, int]:
    """A packed sample cut after each end token: its documents (tokens, bits), and how many padding tokens end it
    (end tokens with bit 0 after the last document)."""
    ends = np.flatnonzero(sample == EOD)
    found, start = [], 0
    for end in ends:
        found.append((sample[start:end + 1].tolist(), bits[start:end + 1].tolist()))
        start = end + 1
    padding = 0
    while found and found[-1][0] == [EOD] and found[-1][1] == [0]:  # padding: single end tokens with bit 0
        found.pop()
        padding += 1
    return found, padding


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> str:
    return preprocess(CHAT_DEMO, tmp_path_factory.mktemp("packing") / "chat")


@pytest.mark.parametrize("packing", ["bfd", "greedy", "none"])
def test_packed_samples_are_whole_documents(chat, packing, tmp_path) -> None:
    indexed, masks = IndexedDataset(chat), IndexedDataset(loss_mask_prefix(chat))
    documents = indexed.num_documents
    capacity = 1 + int(indexed.document_lengths().max())  # nothing overflows
    dataset = PackedDataset(indexed, (0, documents), capacity - 1, 3 * documents // 2, seed=5, packing=packing,
                            overflow="truncate", eod_token_id=EOD, cache=IndexCache(tmp_path), loss_mask=masks)
    expected = sorted(read_documents(dataset))
    epochs = [range(int(a), int(b)) for a, b in zip(dataset.epoch_starts[:-1], dataset.epoch_starts[1:], strict=True)]
    assert len(epochs) == 2 and len(dataset) >= 3 * documents // 2 and dataset.index_built
    orders = []
    for epoch in epochs:
        seen = []
        for index in epoch:
            sample, bits = dataset[index], dataset.sample_loss_mask(index)
            assert sample.shape == bits.shape == (capacity,) and sample.dtype == np.int64
            found, padding = documents_of(sample, bits)
            assert padding == capacity - sum(len(tokens) for tokens, _ in found)
            assert dataset.pack_targets[index] == int(bits[1:].sum())  # what training counts
            seen += found
            if packing == "none":
                assert len(found) == 1
        assert sorted(seen) == expected  # every document once per epoch, whole, with its bits
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled each epoch
    if packing == "bfd":
        fill = sum(len(tokens) for order in orders for tokens, _ in order) / (len(dataset) * capacity)
        greedy_like = len(epochs[0]) < documents  # bfd puts several conversations in a sample
        assert greedy_like and fill > 0.5, fill
    again = PackedDataset(indexed, (0, documents), capacity - 1, 3 * documents // 2, seed=5, packing=packing,
                          overflow="truncate", eod_token_id=EOD, cache=IndexCache(tmp_path), loss_mask=masks)
    assert not again.index_built and np.array_equal(again.pieces, dataset.pieces)  # from the cache


def test_overflow_is_truncated_dropped_or_split(tmp_path) -> None:
    prefix = str(tmp_path / "docs")
    lengths = [5, 30, 12, 70, 9]
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for number, length in enumerate(lengths):
            builder.add_item(np.concatenate([np.full(length - 1, number + 1), [EOD]]))
            builder.end_document()
    indexed = IndexedDataset(prefix)

    def packed(overflow):
        return PackedDataset(indexed, (0, 5), 15, 1, seed=0, packing="bfd", overflow=overflow, eod_token_id=EOD)

    truncated, dropped, split = packed("truncate"), packed("drop"), packed("split")
    assert (truncated.dropped, truncated.cut) == (0, 2) and sorted(truncated.pieces[:, 2].tolist()) == [5, 9, 12, 16, 16]
    assert (dropped.dropped, dropped.cut) == (2, 0) and sorted(dropped.pieces[:, 2].tolist()) == [5, 9, 12]
    assert split.cut == 2 and sorted(split.pieces[:, 2].tolist()) == [5, 6, 9, 12, 14, 16, 16, 16, 16, 16]
    whole = {number: [] for number in range(5)}
    for index in range(len(split)):
        for document, first, length in split._pieces(index):
            whole[int(document)].append((int(first), int(length)))
    for number, parts in whole.items():  # the pieces of a split document cover it exactly once
        covered = sorted(parts)
        assert covered[0][0] == 0 and sum(length for _, length in covered) == lengths[number]
        assert all(a[0] + a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
    assert "per epoch 2 documents dropped, 0 cut" in dropped.summary()
    assert "per epoch 0 documents dropped, 2 cut" in truncated.summary()


def write_documents(prefix: str, documents: list[list[int]]) -> IndexedDataset:
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for tokens in documents:
            builder.add_item(np.asarray(tokens))
            builder.end_document()
    return IndexedDataset(prefix)


def test_documents_are_the_pieces_whatever_their_tokens(tmp_path) -> None:
    """A packed sample's documents are its pieces (data.document_boundaries "dataset"): documents without an end token,
    or with the end token inside (a template whose end-of-turn token is the tokenizer's eos), stay whole; the padding
    is one more document. Megatron-LM's end-token rule refuses both datasets at start-up, naming the file and the
    fix, and accepts a dataset preprocessed with --append-eod."""
    from data.loader import check_end_token_rule

    plain = write_documents(str(tmp_path / "plain"), [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]])
    dataset = PackedDataset(plain, (0, 3), 8, 1, seed=0, packing="bfd", overflow="truncate", eod_token_id=EOD)
    for index in range(len(dataset)):
        lengths = dataset.pieces[dataset.pack_offsets[index]:dataset.pack_offsets[index + 1], 2].tolist()
        padding = 9 - sum(lengths)
        expected = [number for number, length in enumerate([*lengths, padding]) for _ in range(length)]
        assert dataset.sample_documents(index).tolist() == expected
    assert sorted(dataset.pieces[:, 2].tolist()) == [3, 4, 4]
    with pytest.raises(ValueError, match=r"plain.bin: 3 documents do not end with the end-of-document token 50256 "
                                         r"\(the first: document 0\).*--append-eod.*\"dataset\" \(the default"):
        check_end_token_rule(plain, EOD)
    turns = write_documents(str(tmp_path / "turns"), [[1, EOD, 2, EOD], [3, EOD], [4, 5, EOD, 6, EOD, EOD]])
    with pytest.raises(ValueError, match=r"turns.bin: the end-of-document token 50256 occurs 3 times inside documents "
                                         r"\(the first in document 0\).*cuts a conversation at every turn.*"
                                         r"\"dataset\" \(the default"):
        check_end_token_rule(turns, EOD)
    check_end_token_rule(write_documents(str(tmp_path / "ends"), [[1, 2, EOD], [], [3, EOD]]), EOD)


def test_the_dataset_rule_gives_the_end_token_rules_documents_on_appended_end_tokens(chat) -> None:
    """On data preprocessed with --append-eod (the end token ends every document and occurs nowhere else), the
    dataset's documents are the end-token rule's: concat samples (Megatron's, cut across documents) alike, with the
    first token of a sample inside a document and an end token shared by two samples; packed samples alike on every
    position the loss reads (the rule makes each padding token a document of its own, the dataset one of all)."""
    from data.gpt_dataset import GPTDataset
    from data.loader import MicroBatchLoader

    indexed, masks = IndexedDataset(chat), IndexedDataset(loss_mask_prefix(chat))
    concat = GPTDataset(indexed, (0, indexed.num_documents), 31, 64, seed=3, loss_mask=masks)
    packed = PackedDataset(indexed, (0, indexed.num_documents), 255, 32, seed=3, packing="bfd", overflow="truncate",
                           eod_token_id=EOD, loss_mask=masks)
    for dataset in (concat, packed):
        flags = dict(eod_token_id=EOD, reset_attention_mask=True, reset_position_ids=True)
        by_index = MicroBatchLoader(dataset, 4, 0, 1, **flags)
        by_token = MicroBatchLoader(dataset, 4, 0, 1, document_boundaries="eod_token", **flags)
        for batch, ((inputs, targets), (token_inputs, token_targets)) in enumerate(zip(by_index, by_token,
                                                                                        strict=True)):
            assert torch.equal(inputs[0], token_inputs[0]) and all(map(torch.equal, targets, token_targets))
            documents = torch.zeros_like(inputs[0], dtype=torch.bool)  # the inputs that are documents' tokens (not padding)
            for row in range(4):
                used = (int(packed.pieces[packed.pack_offsets[4 * batch + row]:
                                          packed.pack_offsets[4 * batch + row + 1], 2].sum())
                        if dataset is packed else documents.shape[1])
                documents[row, :used] = True
            assert documents.any(dim=1).all() and not (targets[1].bool() & ~documents).any()
            for found, expected in zip(inputs[1:], token_inputs[1:], strict=True):  # positions, documents
                assert torch.equal(found[documents], expected[documents])


def test_config_names_the_packing_fields() -> None:
    from runconfig.blocks import DataConfig

    with pytest.raises(ValueError, match=r"data.packing must be one of .*'bfd'.*got 'best'"):
        DataConfig(packing="best")
    with pytest.raises(ValueError, match=r"data.packing_overflow must be one of .*'split'.*got 'wrap'"):
        DataConfig(packing_overflow="wrap")


@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_pack_targets_are_what_the_loader_trains_on(tmp_path, eod_mask_loss) -> None:
    """Documents without a mask dataset (pretraining text), one of them empty: each sample's target count is the
    loader's loss-mask sum, with eod_mask_loss too, and no document's first token is a target (the previous
    document's end token cannot predict it); the empty document is left out."""
    from data.loader import MicroBatchLoader

    prefix = str(tmp_path / "text")
    lengths = [7, 3, 0, 12, 5, 9, 1]
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for number, length in enumerate(lengths):
            builder.add_item(np.concatenate([np.full(length - 1, number + 1), [EOD]]) if length else np.zeros(0))
            builder.end_document()
    dataset = PackedDataset(IndexedDataset(prefix), (0, len(lengths)), 15, 6, seed=1, packing="bfd",
                            overflow="truncate", eod_token_id=EOD)
    first_epoch = dataset.pieces[:dataset.pack_offsets[dataset.epoch_starts[1]]]
    assert sorted(first_epoch[:, 2].tolist()) == [1, 3, 5, 7, 9, 12]  # every document but the empty one
    loader = MicroBatchLoader(dataset, 1, 0, 1, eod_mask_loss=eod_mask_loss, eod_token_id=EOD)
    for index, ((tokens, _), (_, loss_mask)) in enumerate(loader):
        assert int(loss_mask.sum()) == dataset.pack_targets[index]
        assert not loss_mask[0][tokens[0] == EOD].any()  # the label after an end token: a first token, or padding
    assert index == len(dataset) - 1
