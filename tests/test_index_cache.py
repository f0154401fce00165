"""The index cache: on by default beside each dataset, built by one process per node, never trusted when damaged.

Four processes of one node (LOCAL_RANK 0..3) build the run's datasets through training/data.py with the default
configuration: exactly one builds the index arrays, the three others wait for them and memory-map them. A truncated,
corrupted or unrecorded entry is rebuilt; a write that fails leaves nothing that looks complete; a waiting process
that sees no complete entry in time stops with the file and the timeout.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import data.gpt_dataset as gpt_module
import data.index_cache as index_cache_module
from data.gpt_dataset import INDEX_NAMES, GPTDataset
from data.index_cache import IndexCache, IndexCachePolicy, IndexCacheTimeout
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.distributed import run_distributed

SEQ_LENGTH = 16


def write_dataset(prefix: Path, documents: int = 120) -> str:
    generator = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for _ in range(documents):
            builder.add_item(generator.integers(0, 1000, size=int(generator.integers(10, 60))))
            builder.end_document()
    return str(prefix)


@pytest.fixture
def corpus(tmp_path) -> IndexedDataset:
    return IndexedDataset(write_dataset(tmp_path / "data" / "corpus"))


def run_config(prefix: str, *overrides: str):
    from runconfig.run import load_run_config

    return load_run_config("ds_configs/tiny-cpu.json", [
        "model.seq_length=16", "schedule.train_tokens=8192", "schedule.warmup_tokens=1024",
        "schedule.decay_tokens=8192", "data.split=\"90,10,0\"", f"data.blend=[[1.0, \"{prefix}\"]]", *overrides])


def build_on_one_rank(prefix: str) -> dict:
    """What training/data.py builds on this rank; the node's first process starts late, so the others must wait."""
    from training.data import build_datasets

    if os.environ["LOCAL_RANK"] == "0":
        time.sleep(2.0)
    train, valid = build_datasets(run_config(prefix))
    return {"built": [train.index_built, valid.index_built], "memory_mapped": isinstance(train.sample_index, np.memmap),
            "samples": [train[i].tolist() for i in range(5)]}


@pytest.mark.distributed
def test_one_process_per_node_builds_the_index_and_the_others_load_it(tmp_path) -> None:
    prefix = write_dataset(tmp_path / "data" / "corpus")
    results = run_distributed(4, build_on_one_rank, prefix)
    assert [result["built"] for result in results] == [[True, True]] + [[False, False]] * 3
    assert all(result["memory_mapped"] for result in results)
    assert all(result["samples"] == results[0]["samples"] for result in results)
    # on by default, beside the dataset: two entries (train, valid) of three arrays and a record each
    assert len(os.listdir(tmp_path / "data" / "index-cache")) == 2 * (len(INDEX_NAMES) + 1)


def test_the_default_cache_is_beside_the_dataset_and_the_choice_is_printed(tmp_path, capsys) -> None:
    from training.data import build_datasets, index_cache_policy

    prefix = write_dataset(tmp_path / "data" / "corpus")
    config = run_config(prefix)
    assert config.data.cache_dir is None and index_cache_policy(config).builds  # LOCAL_RANK unset: a builder
    build_datasets(config)
    assert f"index cache of {prefix}: {tmp_path / 'data' / 'index-cache'} (beside the dataset)" in capsys.readouterr().out


def test_a_read_only_dataset_folder_falls_back_to_the_save_directory(tmp_path, monkeypatch, capsys) -> None:
    from training.data import build_datasets, index_cache_policy

    prefix = write_dataset(tmp_path / "data" / "corpus")
    read_only = str(tmp_path / "data")
    real_access = os.access
    monkeypatch.setattr(index_cache_module.os, "access",
                        lambda path, mode: False if os.fspath(path) == read_only else real_access(path, mode))
    save = tmp_path / "checkpoints"
    build_datasets(run_config(prefix, f"training.save=\"{save}\""))
    assert f"{save / 'index-cache'} (the dataset's folder {read_only} is not writable)" in capsys.readouterr().out
    assert len(os.listdir(save / "index-cache")) == 8 and not (tmp_path / "data" / "index-cache").exists()
    without_save = index_cache_policy(run_config(prefix, "training.save=null", "training.save_interval=0")).locate(prefix)[0]
    assert without_save == os.path.expanduser(os.path.join("~", ".cache", "mtnlg-ds", "index-cache"))


def forbid_builds(monkeypatch) -> None:
    def must_not_build(*args, **kwargs):
        raise AssertionError("the index was rebuilt instead of loaded from the cache")

    monkeypatch.setattr(gpt_module, "build_gpt_index", must_not_build)


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "delete the record", "garble the record"])
def test_a_damaged_entry_is_rebuilt_never_trusted(corpus, tmp_path, damage) -> None:
    cache = IndexCache(tmp_path / "cache")
    first = GPTDataset(corpus, (0, 100), SEQ_LENGTH, 200, seed=3, cache=cache)
    key, path = first.spec.key(), cache.path(first.spec.key(), "sample_index")
    expected = [first[i].tolist() for i in range(len(first))]
    del first  # its memory map is closed before the file is damaged
    if damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 64)
    elif damage == "flip a byte":
        with open(path, "r+b") as stream:
            stream.seek(-5, os.SEEK_END)
            byte = stream.read(1)
            stream.seek(-5, os.SEEK_END)
            stream.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "delete the record":  # as a crash between the arrays and the record leaves it
        os.remove(cache.record_path(key))
    else:
        Path(cache.record_path(key)).write_text('{"version": 1, "files": {"sample_index"')
    assert cache.load(key, INDEX_NAMES) is None
    again = GPTDataset(corpus, (0, 100), SEQ_LENGTH, 200, seed=3, cache=cache)
    assert again.index_built and [again[i].tolist() for i in range(len(again))] == expected
    assert cache.load(key, INDEX_NAMES) is not None


def test_an_intact_entry_is_loaded_memory_mapped(corpus, tmp_path, monkeypatch) -> None:
    cache = IndexCache(tmp_path / "cache")
    assert GPTDataset(corpus, (0, 100), SEQ_LENGTH, 200, seed=3, cache=cache).index_built
    forbid_builds(monkeypatch)
    loaded = GPTDataset(corpus, (0, 100), SEQ_LENGTH, 200, seed=3, cache=cache)
    assert not loaded.index_built and isinstance(loaded.shuffle_index, np.memmap)


def test_a_failed_write_leaves_nothing_that_looks_complete(tmp_path, monkeypatch) -> None:
    cache = IndexCache(tmp_path)
    arrays = {"a": np.arange(1000), "b": np.arange(10)}
    real_save = np.save

    def disk_full_on_b(stream, array, **kwargs):
        if array.size == 10:
            stream.write(b"\x93NUMPY")
            raise OSError(28, "No space left on device")
        real_save(stream, array, **kwargs)

    monkeypatch.setattr(index_cache_module.np, "save", disk_full_on_b)
    with pytest.raises(OSError, match="No space left"):
        cache.save("key", arrays, {"what": "test"})
    assert sorted(os.listdir(tmp_path)) == ["key-a.npy"]  # no temporary, no b, no record
    assert cache.load("key", ["a", "b"]) is None and cache.load("key", ["a"]) is None


def test_a_waiting_process_stops_with_the_file_and_the_timeout(tmp_path) -> None:
    waiting = IndexCache(tmp_path, builds=False, timeout_s=0.3, poll_s=0.05)
    start = time.monotonic()
    with pytest.raises(IndexCacheTimeout, match=rf"{tmp_path / 'key-record.json'} was not complete after 0.3 s "
                                                r"\(data.cache_timeout_s\)"):
        waiting.load_or_build("key", ["a"], lambda: pytest.fail("a waiting process built"), {})
    assert 0.3 <= time.monotonic() - start < 5


def test_a_waiting_process_loads_what_the_builder_completes(tmp_path) -> None:
    waiting = IndexCache(tmp_path, builds=False, timeout_s=10, poll_s=0.05)
    IndexCache(tmp_path).save("key", {"a": np.arange(5)}, {})
    arrays, built = waiting.load_or_build("key", ["a"], lambda: pytest.fail("a waiting process built"), {})
    assert not built and arrays["a"].tolist() == [0, 1, 2, 3, 4]


def test_the_policy_locates_each_dataset(tmp_path) -> None:
    assert IndexCachePolicy(directory="/x").locate(str(tmp_path / "a" / "corpus")) == ("/x", "data.cache_dir")
    assert IndexCachePolicy().locate(str(tmp_path / "a" / "corpus")) == (str(tmp_path / "a" / "index-cache"),
                                                                         "beside the dataset")


def test_a_builder_that_cannot_write_names_the_directory_and_the_setting(tmp_path) -> None:
    (tmp_path / "not-a-folder").write_text("")
    cache = IndexCache(tmp_path / "not-a-folder" / "cache")
    with pytest.raises(OSError, match=r"cannot write the index cache in .*not-a-folder/cache .*data\.cache_dir"):
        cache.load_or_build("key", ["a"], lambda: {"a": np.arange(3)}, {})
