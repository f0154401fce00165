"""The MMIDIDX v1 format: exact bytes, round trips, and clear errors on every kind of damage."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexFormatError,
    check_vocab_size,
    merge_datasets,
    optimal_dtype,
)
from tests.test_data_reference import reference_bin_bytes, reference_idx_bytes

# three documents: 2 sequences, 1 sequence, 3 sequences (one of them empty)
DOCUMENTS = [[[5, 6, 7], [8]], [[9, 10]], [[11], [], [12, 13, 14, 15]]]


def write(prefix: str, documents: list[list[list[int]]], dtype: type) -> None:
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for document in documents:
            for sequence in document:
                builder.add_item(np.array(sequence, dtype=np.int64))
            builder.end_document()


@pytest.mark.parametrize(("dtype", "code", "pack"), [(np.uint16, 8, "H"), (np.int32, 4, "i")])
def test_writer_bytes_match_the_layout_built_by_hand(tmp_path, dtype, code, pack) -> None:
    prefix = str(tmp_path / "hand")
    documents = [[[70000 if pack == "i" else 65535, 1, 2], [3]], [[4, 5]], [[6], [], [7, 8, 9, 10]]]
    write(prefix, documents, dtype)
    with open(prefix + ".idx", "rb") as stream:
        assert stream.read() == reference_idx_bytes(documents, code, np.dtype(dtype).itemsize)
    with open(prefix + ".bin", "rb") as stream:
        assert stream.read() == reference_bin_bytes(documents, pack)


def test_header_fields_at_their_offsets(tmp_path) -> None:
    prefix = str(tmp_path / "header")
    write(prefix, DOCUMENTS, np.uint16)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 6, 4)  # version, uint16, 6 sequences, 3 documents + 1
    assert len(raw) == 34 + 6 * 4 + 6 * 8 + 4 * 8


def test_round_trip_gives_back_every_sequence(tmp_path) -> None:
    prefix = str(tmp_path / "trip")
    write(prefix, DOCUMENTS, np.uint16)
    dataset = IndexedDataset(prefix)
    sequences = [sequence for document in DOCUMENTS for sequence in document]
    assert (len(dataset), dataset.num_documents, dataset.num_tokens) == (6, 3, 11)
    assert [dataset[i].tolist() for i in range(len(dataset))] == sequences
    assert [s.tolist() for s in dataset[1:6]] == sequences[1:6]
    assert dataset.get(5, offset=1, length=2).tolist() == [13, 14]
    assert dataset.get(0, offset=1).tolist() == [6, 7]
    assert dataset.document_indices.tolist() == [0, 2, 3, 6]
    assert dataset.document_lengths().tolist() == [4, 2, 5]
    assert [dataset.document_start(d) for d in range(4)] == [0, 4, 6, 11]
    assert dataset.dtype == np.uint16 and dataset[0].dtype == np.uint16
    dataset.verify()
    with pytest.raises(IndexError, match="out of range"):
        dataset.get(1, offset=0, length=2)


def test_add_documents_fast_path_writes_the_same_bytes(tmp_path) -> None:
    write(str(tmp_path / "slow"), DOCUMENTS, np.int32)
    with IndexedDatasetBuilder(str(tmp_path / "fast"), np.int32) as builder:
        builder.add_documents(np.array([5, 6, 7, 8, 9, 10]), np.array([3, 1, 2]), np.array([2, 1]))
        builder.add_documents(np.array([11, 12, 13, 14, 15]), np.array([1, 0, 4]), np.array([3]))
    for suffix in (".idx", ".bin"):
        assert open(tmp_path / f"slow{suffix}", "rb").read() == open(tmp_path / f"fast{suffix}", "rb").read()


def test_index_arrays_spill_to_disk_across_chunks(tmp_path, monkeypatch) -> None:
    import data.indexed_dataset as module

    monkeypatch.setattr(module, "_SPILL_ENTRIES", 3)
    monkeypatch.setattr(module, "_COPY_ENTRIES", 2)
    write(str(tmp_path / "small_chunks"), DOCUMENTS, np.uint16)
    monkeypatch.undo()
    write(str(tmp_path / "one_chunk"), DOCUMENTS, np.uint16)
    assert open(tmp_path / "small_chunks.idx", "rb").read() == open(tmp_path / "one_chunk.idx", "rb").read()


def test_optimal_dtype_is_megatrons_rule() -> None:
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32


def test_token_ids_that_do_not_fit_the_dtype_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"do not fit uint16"), IndexedDatasetBuilder(tmp_path / "x", np.uint16) as b:
        b.add_item([1, 65536])
    assert not any(name.startswith("x.") for name in os.listdir(tmp_path))  # temporaries removed


def test_failed_write_leaves_the_previous_dataset_untouched(tmp_path) -> None:
    prefix = str(tmp_path / "keep")
    write(prefix, DOCUMENTS, np.uint16)
    before = open(prefix + ".idx", "rb").read()
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_item([1, 2, 3])
        raise RuntimeError("interrupted")
    assert open(prefix + ".idx", "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["keep.bin", "keep.idx", "keep.stats.json"]


def test_missing_files_are_named(tmp_path) -> None:
    write(str(tmp_path / "pair"), DOCUMENTS, np.uint16)
    os.remove(tmp_path / "pair.bin")
    with pytest.raises(IndexFormatError, match=r"pair\.bin does not exist"):
        IndexedDataset(tmp_path / "pair")
    with pytest.raises(IndexFormatError, match=r"nothing\.idx does not exist.*without \.bin/\.idx"):
        IndexedDataset(tmp_path / "nothing")


def corrupt(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as stream:
        stream.seek(offset)
        stream.write(data)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: corrupt(p + ".idx", 0, b"XXIDIDX"), r"hand\.idx: bad magic"),
        (lambda p: corrupt(p + ".idx", 9, struct.pack("<Q", 2)), r"hand\.idx: index version 2"),
        (lambda p: corrupt(p + ".idx", 17, b"\x09"), r"hand\.idx: unknown dtype code 9"),
        (lambda p: corrupt(p + ".idx", 18, struct.pack("<Q", 8)), r"hand\.idx: \d+ bytes, but its header announces 8"),
        (lambda p: os.truncate(p + ".idx", 60), r"hand\.idx: 60 bytes, but its header announces 6 sequences"),
        (lambda p: os.truncate(p + ".idx", 20), r"hand\.idx: 20 bytes, shorter than the 34-byte"),
        (lambda p: os.truncate(p + ".bin", 20), r"hand\.bin: 20 bytes, but .*hand\.idx describes 22 bytes"),
        (lambda p: corrupt(p + ".idx", 34 + 6 * 12 + 3 * 8, struct.pack("<q", 5)), r"from 0 to the 6 sequences"),
        (lambda p: corrupt(p + ".idx", 34 + 6 * 4 + 5 * 8, struct.pack("<q", 100)), r"hand\.bin: 22 bytes"),
    ],
)
def test_corrupted_or_truncated_files_raise_naming_the_file(tmp_path, damage, message) -> None:
    prefix = str(tmp_path / "hand")
    write(prefix, DOCUMENTS, np.uint16)
    damage(prefix)
    with pytest.raises(IndexFormatError, match=message):
        IndexedDataset(prefix)


def test_verify_finds_a_pointer_that_the_open_check_cannot(tmp_path) -> None:
    prefix = str(tmp_path / "deep")
    write(prefix, DOCUMENTS, np.uint16)
    corrupt(prefix + ".idx", 34 + 6 * 4 + 2 * 8, struct.pack("<q", 2))  # pointer of sequence 2: 8 -> 2
    dataset = IndexedDataset(prefix)
    with pytest.raises(IndexFormatError, match=r"deep\.idx: sequence 2 starts at byte 2, expected 8"):
        dataset.verify()


def test_max_token_id_is_recorded_at_write_time_and_rescanned_when_stale(tmp_path) -> None:
    prefix = str(tmp_path / "stats")
    write(prefix, DOCUMENTS, np.uint16)
    assert IndexedDataset(prefix).max_token_id() == 15
    os.remove(prefix + ".stats.json")  # e.g. a dataset written by Megatron
    assert IndexedDataset(prefix).max_token_id() == 15  # scanned, and recorded again
    assert os.path.exists(prefix + ".stats.json")


def test_vocabulary_check_names_the_file(tmp_path) -> None:
    prefix = str(tmp_path / "big_ids")
    write(prefix, [[[3, 50300, 7]]], np.uint16)
    dataset = IndexedDataset(prefix)
    check_vocab_size(dataset, 50304)
    with pytest.raises(ValueError, match=r"big_ids\.bin: token id 50300 does not fit the model's vocabulary of 50257"):
        check_vocab_size(dataset, 50257)


def test_merge_concatenates_documents_in_order(tmp_path) -> None:
    write(str(tmp_path / "a"), DOCUMENTS, np.uint16)
    write(str(tmp_path / "b"), [[[1, 2]], [[3]]], np.uint16)
    merged = merge_datasets([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "ab"))
    assert merged.document_indices.tolist() == [0, 2, 3, 6, 7, 8]
    assert [merged[i].tolist() for i in range(len(merged))][-3:] == [[12, 13, 14, 15], [1, 2], [3]]
    expected = reference_idx_bytes(DOCUMENTS + [[[1, 2]], [[3]]], 8, 2)
    assert open(tmp_path / "ab.idx", "rb").read() == expected
    write(str(tmp_path / "wide"), [[[1]]], np.int32)
    with pytest.raises(ValueError, match=r"wide\.idx holds int32 tokens but this builder writes uint16"):
        merge_datasets([str(tmp_path / "a"), str(tmp_path / "wide")], str(tmp_path / "bad"))


def test_empty_dataset_opens(tmp_path) -> None:
    with IndexedDatasetBuilder(tmp_path / "empty", np.uint16):
        pass
    dataset = IndexedDataset(tmp_path / "empty")
    assert (len(dataset), dataset.num_documents, dataset.num_tokens, dataset.max_token_id()) == (0, 0, 0, -1)


def test_pickles_by_prefix(tmp_path) -> None:
    import pickle

    write(str(tmp_path / "p"), DOCUMENTS, np.uint16)
    copy = pickle.loads(pickle.dumps(IndexedDataset(tmp_path / "p")))
    assert copy[5].tolist() == [12, 13, 14, 15]
