"""On-disk cache of index arrays: ``{directory}/{key}-{name}.npy``, loaded memory-mapped and without pickle.

An entry is complete when its record ``{key}-record.json`` exists and matches the arrays: the record, written last,
holds each file's size and CRC-32 (and, for people, a description of what the key hashes). An entry whose record
is missing, unreadable or does not match (a truncated or half-copied file, a file from another build) is rebuilt,
never trusted. Every file is written under a temporary name unique to its host and process and renamed, so a
crash never leaves something that looks complete, and several processes building the same key at once (one per
node on a shared file system) only repeat work: the arrays of a key are the same bytes whoever builds them.

One process per node builds (``builds=True``: LOCAL_RANK 0); the others (``builds=False``) wait for the entry,
polling for up to ``timeout_s``, and memory-map it, so a node holds one copy of the arrays in its page cache.

``dataset_fingerprint`` (what the keys of data/gpt_dataset.py and data/packing.py hash of their dataset) is here,
below both.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from common.files import atomic_open

if TYPE_CHECKING:
    from data.indexed_dataset import IndexedDataset

RECORD_VERSION = 1
_CRC_CHUNK_BYTES = 1 << 24
DEFAULT_FALLBACK_DIRECTORY = os.path.join("~", ".cache", "mtnlg-ds", "index-cache")


class IndexCacheTimeout(TimeoutError):
    """A waiting process did not see a complete entry in time."""


def file_crc32(path: str) -> int:
    """CRC-32 of a file, read in 16 MiB chunks (about 4 GB/s: a corruption check, not a security hash)."""
    crc = 0
    with open(path, "rb") as stream:
        while chunk := stream.read(_CRC_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


class IndexCache:
    """A directory of cached index arrays (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, builds: bool = True, timeout_s: float = 1800.0,
                 poll_s: float = 1.0) -> None:
        self.directory = os.fspath(directory)
        self.builds, self.timeout_s, self.poll_s = builds, timeout_s, poll_s

    def path(self, key: str, name: str) -> str:
        return os.path.join(self.directory, f"{key}-{name}.npy")

    def record_path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}-record.json")

    def load(self, key: str, names: Sequence[str]) -> dict[str, np.ndarray] | None:
        """The arrays of a complete entry, memory-mapped read-only, or None (missing, incomplete or corrupt)."""
        try:
            with open(self.record_path(key)) as stream:
                files = json.load(stream)["files"]
            for name in names:
                path, expected = self.path(key, name), files[name]
                if os.path.getsize(path) != expected["bytes"] or file_crc32(path) != expected["crc32"]:
                    return None
            return {name: np.load(self.path(key, name), mmap_mode="r", allow_pickle=False) for name in names}
        except (OSError, ValueError, KeyError, TypeError):  # missing file, bad JSON or record, bad .npy header
            return None

    def save(self, key: str, arrays: Mapping[str, np.ndarray], description: Mapping) -> None:
        """Write the arrays, then the record that makes the entry complete (each file atomically)."""
        os.makedirs(self.directory, exist_ok=True)
        try:
            os.remove(self.record_path(key))  # a stale record must not vouch for the files while they are replaced
        except FileNotFoundError:
            pass
        files = {}
        for name, array in arrays.items():
            with atomic_open(self.path(key, name), "wb") as stream:
                np.save(stream, np.ascontiguousarray(array), allow_pickle=False)
            files[name] = {"bytes": os.path.getsize(self.path(key, name)), "crc32": file_crc32(self.path(key, name))}
        record = {"version": RECORD_VERSION, "files": files, "description": dict(description)}
        with atomic_open(self.record_path(key), "w") as stream:
            json.dump(record, stream, indent=2, sort_keys=True)

    def load_or_build(self, key: str, names: Sequence[str], build: Callable[[], Mapping[str, np.ndarray]],
                      description: Mapping) -> tuple[dict[str, np.ndarray], bool]:
        """(arrays memory-mapped from the cache, whether this process built them).

        A builder loads a complete entry or builds, saves and maps it; any other process waits for a complete entry.
        """
        arrays = self.load(key, names)
        if arrays is not None:
            return arrays, False
        if not self.builds:
            return self._wait(key, names), False
        arrays = build()
        try:
            self.save(key, arrays, description)
        except OSError as error:
            raise OSError(error.errno, f"cannot write the index cache in {self.directory} ({error.strerror or error}): "
                                       f"free space there, or set data.cache_dir to a writable directory") from error
        del arrays  # the built arrays leave memory: this process maps the files like the others
        return {name: np.load(self.path(key, name), mmap_mode="r", allow_pickle=False) for name in names}, True

    def _wait(self, key: str, names: Sequence[str]) -> dict[str, np.ndarray]:
        deadline = time.monotonic() + self.timeout_s
        checked = None  # the record last found wrong: checked again only once it has been replaced
        while True:
            signature = _signature(self.record_path(key))
            if signature is not None and signature != checked:
                arrays = self.load(key, names)
                if arrays is not None:
                    return arrays
                checked = signature
            if time.monotonic() >= deadline:
                raise IndexCacheTimeout(
                    f"index cache: {self.record_path(key)} was not complete after {self.timeout_s:g} s "
                    f"(data.cache_timeout_s). The first process of this node (LOCAL_RANK 0) builds it: see whether it "
                    f"failed, or raise the timeout if building takes longer on this file system")
            time.sleep(self.poll_s)


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


@dataclass(frozen=True)
class IndexCachePolicy:
    """Where the index arrays of each dataset are cached, and whether this process builds them or waits for them."""

    directory: str | None = None
    """One directory for every dataset; None: an ``index-cache`` folder beside each dataset..."""
    fallback_directory: str = DEFAULT_FALLBACK_DIRECTORY
    """...or this one when that folder cannot be written (a read-only dataset directory)."""
    builds: bool = True
    """False: another process of the node (LOCAL_RANK 0) builds the arrays; this one waits and loads them."""
    timeout_s: float = 1800.0
    """How long a waiting process waits for a complete entry."""

    def locate(self, prefix: str) -> tuple[str, str]:
        """(directory, why) of the cache of the dataset ``prefix`` (``prefix.bin`` / ``prefix.idx``)."""
        if self.directory:
            return self.directory, "data.cache_dir"
        beside = os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")
        if _writable(beside):
            return beside, "beside the dataset"
        return (os.path.abspath(os.path.expanduser(self.fallback_directory)),
                f"the dataset's folder {os.path.dirname(beside)} is not writable")

    def cache_for(self, prefix: str) -> IndexCache:
        return IndexCache(self.locate(prefix)[0], builds=self.builds, timeout_s=self.timeout_s)


def _writable(directory: str) -> bool:
    """Whether this process can create files in ``directory``, or create it (access(2): no file is written)."""
    while not os.path.isdir(directory):
        parent = os.path.dirname(directory)
        if parent == directory:
            return False
        directory = parent
    return os.access(directory, os.W_OK | os.X_OK)


_FINGERPRINT_BLOCKS, _FINGERPRINT_BLOCK_BYTES = 64, 1 << 16


def dataset_fingerprint(dataset: IndexedDataset) -> str:
    """Hash of the .idx: its size and 64 evenly spaced 64 KiB blocks (all of it below 4 MiB) plus the .bin size.

    What the index arrays depend on is the document lengths, which live in the .idx; sampling keeps start-up fast
    on many ranks for a multi-GB index while any re-tokenisation still changes the hash.
    """
    digest = hashlib.sha256()
    size = os.path.getsize(dataset.idx_file)
    digest.update(f"{size} {os.path.getsize(dataset.bin_file)}".encode())
    with open(dataset.idx_file, "rb") as stream:
        if size <= _FINGERPRINT_BLOCKS * _FINGERPRINT_BLOCK_BYTES:
            digest.update(stream.read())
        else:
            for offset in np.linspace(0, size - _FINGERPRINT_BLOCK_BYTES, _FINGERPRINT_BLOCKS).astype(np.int64):
                stream.seek(int(offset))
                digest.update(stream.read(_FINGERPRINT_BLOCK_BYTES))
    return digest.hexdigest()
