"""GPT samples: lengths, tiling of the shuffled token stream, determinism, epochs, splits and the on-disk cache."""

from __future__ import annotations

import os

import numpy as np
import pytest

import data.gpt_dataset as gpt_module
from data.gpt_dataset import (
    GPTDataset,
    build_gpt_datasets,
    build_sample_index,
    num_epochs_needed,
    parse_data_path,
    parse_split,
    split_document_ranges,
)
from data.index_cache import IndexCache
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.test_data_reference import reference_sample_index

SEQ_LENGTH = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> IndexedDataset:
    """60 documents of 1..40 tokens; token values encode (document, position) so a sample shows where it came from."""
    rng = np.random.default_rng(7)
    prefix = str(tmp_path_factory.mktemp("gpt") / "docs")
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for document in range(60):
            length = int(rng.integers(1, 41))
            builder.add_item(document * 1000 + np.arange(length))
            builder.end_document()
    return IndexedDataset(prefix)


def stream_of(dataset: GPTDataset) -> np.ndarray:
    """The token stream in document_index order (what the samples must tile)."""
    return np.concatenate([dataset.indexed.get(int(d)) for d in dataset.document_index]).astype(np.int64)


def unshuffled(dataset: GPTDataset) -> list[np.ndarray]:
    inverse = np.argsort(dataset.shuffle_index)
    return [dataset[int(inverse[j])] for j in range(len(dataset))]


def test_samples_tile_the_shuffled_stream_with_one_shared_token(corpus) -> None:
    dataset = GPTDataset(corpus, (0, 60), SEQ_LENGTH, num_samples=40, seed=1)
    stream = stream_of(dataset)
    samples = unshuffled(dataset)
    assert all(sample.shape == (SEQ_LENGTH + 1,) and sample.dtype == np.int64 for sample in samples)
    for j, sample in enumerate(samples):
        assert np.array_equal(sample, stream[j * SEQ_LENGTH : (j + 1) * SEQ_LENGTH + 1])
    for left, right in zip(samples, samples[1:], strict=False):
        assert left[-1] == right[0]
    # nothing lost: the samples cover the stream up to a final remainder shorter than one sample
    assert len(stream) - (len(samples) * SEQ_LENGTH + 1) < SEQ_LENGTH
    assert sorted(dataset.shuffle_index.tolist()) == list(range(len(dataset)))


def test_sample_index_equals_megatrons_loop(corpus) -> None:
    rng = np.random.default_rng(3)
    lengths = np.asarray(corpus.document_lengths())
    for seq_length in (1, 5, 16, 100):
        document_index = rng.permutation(np.tile(np.arange(60), 2)).astype(np.int32)
        total = (int(lengths[document_index].sum()) - 1) // seq_length
        expected = reference_sample_index(lengths, document_index, seq_length, total)
        assert np.array_equal(build_sample_index(lengths, document_index, seq_length, total), expected)


def test_sample_index_is_the_same_in_small_chunks(corpus, monkeypatch) -> None:
    lengths = np.asarray(corpus.document_lengths())
    document_index = np.arange(60, dtype=np.int32)
    whole = build_sample_index(lengths, document_index, 7, 150)
    monkeypatch.setattr(gpt_module, "_SAMPLE_CHUNK", 4)
    assert np.array_equal(build_sample_index(lengths, document_index, 7, 150), whole)


def test_zero_length_documents_are_stepped_over() -> None:
    lengths = np.array([3, 0, 0, 4, 0, 2])
    got = build_sample_index(lengths, np.arange(6), 2, 4)
    assert np.array_equal(got, reference_sample_index(lengths, np.arange(6), 2, 4))


def test_same_seed_same_order_other_seed_other_order(corpus) -> None:
    first = GPTDataset(corpus, (0, 60), SEQ_LENGTH, 40, seed=5)
    again = GPTDataset(corpus, (0, 60), SEQ_LENGTH, 40, seed=5)
    other = GPTDataset(corpus, (0, 60), SEQ_LENGTH, 40, seed=6)
    assert all(np.array_equal(first[i], again[i]) for i in range(len(first)))
    assert not all(np.array_equal(first[i], other[i]) for i in range(len(first)))


def test_as_many_epochs_as_the_samples_need(corpus) -> None:
    tokens = int(np.sum(corpus.document_lengths()))
    assert num_epochs_needed(tokens, SEQ_LENGTH, (tokens - 1) // SEQ_LENGTH) == 1
    assert num_epochs_needed(tokens, SEQ_LENGTH, (tokens - 1) // SEQ_LENGTH + 1) == 2
    wanted = (3 * tokens - 1) // SEQ_LENGTH + 1  # one sample more than 3 epochs give
    dataset = GPTDataset(corpus, (0, 60), SEQ_LENGTH, num_samples=wanted, seed=1)
    assert len(dataset.document_index) == 4 * 60
    assert len(dataset) == (4 * tokens - 1) // SEQ_LENGTH >= wanted
    assert np.bincount(dataset.document_index).tolist() == [4] * 60  # epochs shuffled together, as Megatron does
    stream = stream_of(dataset)
    for j, sample in enumerate(unshuffled(dataset)):
        assert np.array_equal(sample, stream[j * SEQ_LENGTH : (j + 1) * SEQ_LENGTH + 1])


def test_a_small_final_epoch_is_shuffled_on_its_own(corpus) -> None:
    tokens = int(np.sum(corpus.document_lengths()))
    per_epoch = (tokens - 1) // SEQ_LENGTH
    dataset = GPTDataset(corpus, (0, 60), SEQ_LENGTH, num_samples=per_epoch + 2, seed=1)  # 2 epochs, the 2nd barely
    before_final = (tokens - 1) // SEQ_LENGTH
    assert sorted(dataset.shuffle_index[:before_final].tolist()) == list(range(before_final))
    assert sorted(dataset.shuffle_index[before_final:].tolist()) == list(range(before_final, len(dataset)))


def test_splits_by_documents_megatron_style() -> None:
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_document_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(60, "8,1,1") == [(0, 48), (48, 54), (54, 60)]
    assert split_document_ranges(7, "1,1,1") == [(0, 3), (3, 5), (5, 7)]  # rounding excess taken from the first
    with pytest.raises(ValueError, match="split 'a,b'"):
        parse_split("a,b")


def test_split_datasets_use_only_their_documents(corpus) -> None:
    train, valid, test = build_gpt_datasets(corpus.prefix, "8,1,1", SEQ_LENGTH, [30, 5, 0], seed=1)
    assert test is None
    documents_of = lambda dataset: {int(token) // 1000 for i in range(len(dataset)) for token in dataset[i]}  # noqa: E731
    assert documents_of(train) <= set(range(48)) and documents_of(valid) <= set(range(48, 54))
    with pytest.raises(ValueError, match=r"docs\.idx: documents \[54, 54\) are out of its 60 documents"):
        GPTDataset(corpus, (54, 54), SEQ_LENGTH, 1, seed=1)


def test_the_cached_index_is_reused(corpus, tmp_path, monkeypatch) -> None:
    cache = IndexCache(tmp_path / "cache")
    built = GPTDataset(corpus, (0, 60), SEQ_LENGTH, 40, seed=3, cache=cache)
    files = sorted(os.listdir(tmp_path / "cache"))  # three arrays and the record that says they are complete
    assert len(files) == 4 and all(name.startswith(built.spec.key()) for name in files)
    assert built.index_built and f"{built.spec.key()}-record.json" in files

    def must_not_build(*args, **kwargs):
        raise AssertionError("the index was rebuilt instead of loaded from the cache")

    monkeypatch.setattr(gpt_module, "build_gpt_index", must_not_build)
    loaded = GPTDataset(corpus, (0, 60), SEQ_LENGTH, 40, seed=3, cache=cache)
    assert isinstance(loaded.sample_index, np.memmap) and not loaded.index_built
    assert all(np.array_equal(built[i], loaded[i]) for i in range(len(built)))
    with pytest.raises(AssertionError, match="rebuilt"):  # anything that changes the arrays changes the key
        GPTDataset(corpus, (0, 60), SEQ_LENGTH, 40, seed=4, cache=cache)
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset(corpus, (0, 60), SEQ_LENGTH + 1, 40, seed=3, cache=cache)


def test_cache_files_load_without_pickle(corpus, tmp_path) -> None:
    cache = IndexCache(tmp_path)
    dataset = GPTDataset(corpus, (0, 60), SEQ_LENGTH, 10, seed=3, cache=cache)
    for name in ("document_index", "sample_index", "shuffle_index"):
        array = np.load(cache.path(dataset.spec.key(), name), allow_pickle=False)
        assert array.dtype != object


def test_data_path_forms() -> None:
    assert parse_data_path("corpus_text_document") == (["corpus_text_document"], [1.0])
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="pairs of weight and prefix"):
        parse_data_path(["0.3", "a", "b"])
