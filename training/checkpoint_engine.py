"""The checkpoint engine: every file of a checkpoint snapshot to host memory, then written in the background.

DeepSpeed writes every checkpoint file through ``engine.checkpoint_engine`` (its pipeline layer files included), so
this engine, set in place of its own, keeps DeepSpeed's file layout and its loaders, and changes only when and how
the bytes reach the disk:

    when                         what                                                     who
    save() (DeepSpeed calls it)  the state's tensors copied to host memory, storage        the training thread
                                 sharing kept (pinned buffers, non-blocking copies on
                                 CUDA); nothing written yet
    start()                      one device synchronisation, then the files handed to     the training thread
                                 the writer; training continues
    the writer                   each file: serialised into <name>.tmp-<pid> while its     one background thread
                                 size and CRC-32 are counted, fsync, renamed into place,
                                 the directory fsynced
    wait()                       until the writer has finished; its files (name, bytes,   whoever must not overlap
                                 CRC-32) or the error (the file and the OS error)          the next checkpoint

At most one checkpoint is in flight: the next save waits for the previous one (training/checkpoint.py commits it).
In "sync" mode start() waits at once: the same snapshot and the same writer, so the same bytes. Loading is
DeepSpeed's own: ``load`` is torch.load of its own files (weights_only=False: they hold Python objects).

The snapshot costs host memory: each rank holds a copy of what it writes (its layer files on DP rank 0, its ZeRO-1
optimizer shard: fp32 master weights and both Adam moments) until the writer is done.
"""

from __future__ import annotations

import collections
import copy
import errno
import os
import queue
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

MODES = ("async", "sync")


@dataclass(frozen=True)
class WrittenFile:
    name: str
    """The file's name in the checkpoint directory."""
    bytes: int
    crc32: int


class WriterError(RuntimeError):
    """The writer could not write a file; nothing of that checkpoint is committed."""

    def __init__(self, path: Path, error: BaseException) -> None:
        self.path, self.error = path, error
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        super().__init__(f"{path}: {reason}")


def host_snapshot(state: Any, memo: dict | None = None) -> Any:
    """A copy of ``state`` whose tensors live in host memory, views of one storage staying views of one storage
    (torch.save then writes the same bytes as of the original). CUDA tensors go to pinned buffers by non-blocking
    copies: synchronise the device before reading them."""
    memo = {} if memo is None else memo
    if isinstance(state, torch.Tensor):
        return _tensor_snapshot(state, memo)
    if type(state) in (dict, collections.OrderedDict):
        return type(state)((key, host_snapshot(value, memo)) for key, value in state.items())
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(host_snapshot(value, memo) for value in state)
    if isinstance(state, (str, bytes, int, float, bool, type(None))):
        return state
    return copy.deepcopy(state, memo)


def _tensor_snapshot(tensor: torch.Tensor, memo: dict) -> torch.Tensor:
    storage = tensor.untyped_storage()
    key = (tensor.device, storage.data_ptr())
    if key not in memo:
        host = torch.UntypedStorage(storage.nbytes(), device="cpu")
        if tensor.is_cuda:
            host = host.pin_memory()
        host.copy_(storage, non_blocking=tensor.is_cuda)
        memo[key] = host
    copied = torch.empty(0, dtype=tensor.dtype).set_(memo[key], tensor.storage_offset(), tensor.size(),
                                                     tensor.stride())
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
    return copied.requires_grad_(tensor.requires_grad) if tensor.is_leaf else copied


class _Counted:
    """A file object that counts the bytes and the CRC-32 of what goes through it."""

    def __init__(self, handle) -> None:
        self.handle, self.bytes, self.crc32 = handle, 0, 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.crc32 = zlib.crc32(view, self.crc32)
        self.bytes += view.nbytes
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()


def write_file(state: Any, path: Path, zipfile: bool = True) -> WrittenFile:
    """torch.save into ``<path>.tmp-<pid>``, counted, fsynced, renamed to ``path``, the directory fsynced."""
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            counted = _Counted(handle)
            torch.save(state, counted, _use_new_zipfile_serialization=zipfile)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return WrittenFile(path.name, counted.bytes, counted.crc32)


@dataclass
class _Batch:
    """One checkpoint's files, in the order DeepSpeed saved them."""

    files: list[tuple[Path, Any]] = field(default_factory=list)
    written: list[WrittenFile] = field(default_factory=list)
    error: WriterError | None = None
    done: threading.Event = field(default_factory=threading.Event)


class SnapshotCheckpointEngine(CheckpointEngine):
    """The engine of the module docstring. ``delay_s`` slows the writer down before each file (fault injection:
    tests/test_checkpoint_engine.py, training/faults.py); ``fail_on`` makes it fail writing the first file of that
    tag with ENOSPC, as a full disk does."""

    def __init__(self, mode: str = "async", zipfile: bool = True, delay_s: float = 0.0,
                 fail_on: str | None = None) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"training.checkpoint_mode must be one of {MODES}, got {mode!r}")
        self.name, self.mode, self.zipfile = "SnapshotCheckpointEngine", mode, zipfile
        self.delay_s, self.fail_on = delay_s, fail_on
        self.pending: _Batch | None = None
        self.current: _Batch | None = None
        self.tag: str | None = None
        self.blocked_s = 0.0
        """Seconds the last save held the training thread (snapshot and hand-over; with "sync", the writing too)."""
        self._jobs: queue.Queue[_Batch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_batches, name="checkpoint-writer", daemon=True)
        self._thread.start()

    # -- DeepSpeed's interface -------------------------------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        if self.current is not None and not self.current.done.is_set():
            raise RuntimeError(f"checkpoint {self.tag} is still being written: wait() before the next save")
        self.tag, self.pending = info.tag, _Batch()
        self._started = time.perf_counter()

    def save(self, state_dict: Any, path: str) -> None:
        if self.pending is None:
            self.create(CheckpointCommitInfo(tag=Path(path).parent.name, save_dir=str(Path(path).parent.parent),
                                             save_latest=False))
        self.pending.files.append((Path(path), host_snapshot(state_dict)))

    def load(self, path: str, map_location=None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """DeepSpeed's own commit, at the end of its save: nothing here (start() and training/checkpoint.py's commit
        run after the project's own files are added)."""
        return True

    # -- the writer ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Hand the snapshot to the writer (after one device synchronisation); with "sync", wait for it."""
        if self.pending is None:
            raise RuntimeError("start() without a save")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.current, self.pending = self.pending, None
        self._jobs.put(self.current)
        if self.mode == "sync":
            self.current.done.wait()
        self.blocked_s = time.perf_counter() - self._started

    @property
    def in_flight(self) -> bool:
        return self.current is not None and not self.current.done.is_set()

    @property
    def finished(self) -> bool:
        """True once the writer has finished the current checkpoint (or none was started)."""
        return self.current is None or self.current.done.is_set()

    def wait(self) -> tuple[list[WrittenFile], WriterError | None]:
        """The current checkpoint's written files and the writer's error (None: all written), once it is done."""
        if self.current is None:
            return [], None
        self.current.done.wait()
        return list(self.current.written), self.current.error

    def forget(self) -> None:
        """The current checkpoint is committed (or abandoned)."""
        self.current = None

    def _write_batches(self) -> None:
        while (batch := self._jobs.get()) is not None:
            for path, state in batch.files:
                try:
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    if self.fail_on is not None and path.parent.name == self.fail_on:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    batch.written.append(write_file(state, path, self.zipfile))
                except BaseException as error:  # the file and the error; the files already renamed stay
                    batch.error = WriterError(path, error)
                    break
            batch.files.clear()  # the snapshot's host memory is released here
            batch.done.set()

    def cleanup(self) -> None:
        self._jobs.put(None)
