"""common/: atomic writes (a crash leaves the old file and no temporary; the file and its directory are fsynced),
free_port, and the one precision table (its byte sizes checked against torch's own element sizes)."""

from __future__ import annotations

import json
import os
import socket
import stat

import numpy as np
import pytest
import torch

from common import files
from common.dtypes import ALIASES, BYTES_PER_ELEMENT, PRECISIONS, precision_name, torch_dtype, torch_dtypes
from common.files import (
    TEMPORARY_MARK,
    atomic_open,
    atomic_path,
    write_bytes_atomically,
    write_json_atomically,
    write_text_atomically,
)
from common.net import free_port


class Crash(Exception):
    pass


@pytest.fixture
def synced(monkeypatch) -> list[tuple[bool, int]]:
    """Every os.fsync call, as (is a directory, inode): the real fsync still runs on the real file."""
    calls, real_fsync = [], os.fsync

    def recording_fsync(descriptor: int) -> None:
        status = os.fstat(descriptor)
        calls.append((stat.S_ISDIR(status.st_mode), status.st_ino))
        real_fsync(descriptor)

    monkeypatch.setattr(files.os, "fsync", recording_fsync)
    return calls


def test_each_writer_replaces_the_file_and_syncs_it_then_its_directory(tmp_path, synced):
    target = tmp_path / "value.json"
    target.write_text("old")
    write_json_atomically(target, {"a": 1})
    assert target.read_text() == '{\n "a": 1\n}\n'
    # the file's data before the rename, then the directory holding the new name: two syncs, in that order
    assert synced == [(False, target.stat().st_ino), (True, tmp_path.stat().st_ino)]
    write_text_atomically(target, "é")
    write_bytes_atomically(tmp_path / "raw", b"\x00\x01")
    assert target.read_text(encoding="utf-8") == "é" and (tmp_path / "raw").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "value.json"]  # no temporary left
    assert len(synced) == 6


def test_not_durable_renames_without_a_sync(tmp_path, synced):
    write_text_atomically(tmp_path / "cache", "x", durable=False)
    assert (tmp_path / "cache").read_text() == "x" and synced == []


@pytest.mark.parametrize("how", ["open", "path", "directory"])
def test_a_crash_mid_write_leaves_the_old_file_and_no_temporary(tmp_path, synced, how):
    target = tmp_path / "state"
    target.write_bytes(b"the old state")
    with pytest.raises(Crash):
        if how == "open":
            with atomic_open(target, "wb") as stream:
                stream.write(b"half of the new")
                raise Crash
        else:
            with atomic_path(target) as temporary:
                assert temporary.parent == tmp_path and TEMPORARY_MARK in temporary.name
                if how == "directory":
                    temporary.mkdir()
                    (temporary / "part").write_bytes(b"half")
                else:
                    torch.save(torch.arange(3), temporary)
                raise Crash
    assert target.read_bytes() == b"the old state"
    assert [p.name for p in tmp_path.iterdir()] == ["state"]
    assert synced == []  # nothing was published


def test_atomic_path_takes_a_writer_that_needs_a_path_and_publishes_directories(tmp_path, synced):
    with atomic_path(tmp_path / "array.npy") as temporary:
        assert temporary.suffix == ".npy"  # so that np.save writes it as named, adding no second suffix
        np.save(temporary, np.arange(5, dtype=np.int16))
    assert np.load(tmp_path / "array.npy").tolist() == [0, 1, 2, 3, 4]
    with atomic_path(tmp_path / "export") as temporary:
        temporary.mkdir()
        (temporary / "a.json").write_text(json.dumps([1]))
    assert json.loads((tmp_path / "export" / "a.json").read_text()) == [1]
    # the directory's file, the directory itself, then the parent that holds its new name
    assert [is_dir for is_dir, _ in synced[2:]] == [False, True, True]
    assert synced[-1] == (True, tmp_path.stat().st_ino)


def test_a_writer_that_writes_nothing_is_an_error_and_publishes_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing was written"):
        with atomic_path(tmp_path / "never"):
            pass
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="must be 'w'"):
        with atomic_open(tmp_path / "log", "a"):
            pass


def test_temporary_names_are_unique_and_hidden(tmp_path):
    names = {files.temporary_name(tmp_path / "x").name for _ in range(100)}
    assert len(names) == 100 and all(n.startswith(".x" + TEMPORARY_MARK) for n in names)
    assert files.temporary_name(tmp_path / "plot.png").name.endswith(".png")


def test_free_port_can_be_bound():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))


def test_the_precision_table_matches_torch():
    assert PRECISIONS == ("fp32", "bf16", "fp16")
    assert torch_dtypes() == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for name in PRECISIONS:
        assert torch.empty(0, dtype=torch_dtype(name)).element_size() == BYTES_PER_ELEMENT[name]
    for alias, name in ALIASES.items():
        assert torch_dtype(alias) == torch_dtype(name)
        if alias.startswith("torch."):
            assert str(torch_dtype(alias)) == alias  # the alias is how torch prints the dtype
    with pytest.raises(ValueError, match="unknown precision 'int8': use one of fp32, bf16, fp16"):
        precision_name("int8")


def test_the_packages_share_the_table():
    from hf.tables import PRECISION_DTYPES
    from model.config import PRECISIONS as MODEL_PRECISIONS
    from planner.hardware import DTYPE_BYTES

    assert PRECISION_DTYPES == torch_dtypes() and MODEL_PRECISIONS is PRECISIONS and DTYPE_BYTES is BYTES_PER_ELEMENT
