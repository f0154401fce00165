"""The checkpoint engine: every file of a checkpoint snapshot to host memory, then written by a writer process.

DeepSpeed writes every checkpoint file through ``engine.checkpoint_engine`` (its pipeline layer files included), so
this engine, set in place of its own, keeps DeepSpeed's file layout and its loaders, and changes only when and how
the bytes reach the disk:

    when                         what                                                     who, where
    start-up (rehearsal())       a save of the run's state that only sizes the host        the training thread,
                                 buffers (below): allocated, their pages touched, their   before the first step and
                                 shared-memory handles sent to the writer; nothing        after it (the optimizer's
                                 copied or written                                        lazy state: Adam's moments)
    save() (DeepSpeed calls it)  the state's tensors copied into the host buffers,        the training thread
                                 storage sharing kept (non-blocking copies into pinned
                                 buffers on CUDA); nothing written yet
    start()                      one device synchronisation, then the files handed to     the training thread
                                 the hand-over thread; training continues
    the hand-over thread         each file in turn: the snapshot pickled with its         a thread of the training
                                 tensors as references into the buffers (kilobytes),      process, blocked on a pipe
                                 sent; the writer's answer awaited                        (the GIL free) meanwhile
    the writer                   each file: torch.save of the snapshot, viewing the       a process of its own
                                 shared buffers, into .<name>.tmp-<host>-<pid>-... while  (spawned once per engine:
                                 its size and CRC-32 are counted, fsync, renamed into     training/checkpoint_writer
                                 place, the directory fsynced (common/files.py)           .py), its own GIL
    wait()                       until the writer has finished; its files (name, bytes,   whoever must not overlap
                                 CRC-32) or the error (the file and the OS error)          the next checkpoint
    cleanup()                    the writer process ends (it also ends by itself when     the training thread
                                 the training process dies)

At most one checkpoint is in flight: the next save waits for the previous one (training/checkpoint.py commits it),
and save() refuses to begin while the writer still reads the buffers. In "sync" mode start() waits at once: the same
snapshot and the same writer, so the same bytes. Loading is DeepSpeed's own: ``load`` is torch.load of its own files
(weights_only=False: they hold Python objects).

The host buffers (``HostBuffers``) are allocated by the rehearsals (training/checkpoint.py ``Checkpointer.rehearse``,
before and after the first step; without them, at the first save), sized from the state, and reused by every save: one
storage per storage of the state, found again by where it sits (the file's name and the keys that lead to it), in
shared memory. They cost host memory for the whole run: each rank holds one copy of what it writes (its layer files
on DP rank 0, its ZeRO-1 optimizer shard: fp32 master weights and both Adam moments). Fault injection (a slow
writer, a full disk) wraps ``SnapshotCheckpointEngine.write_file``, which the hand-over thread calls for each file:
training/faults.py; a wrapped file reaches the writer process late, or never.
"""

from __future__ import annotations

import collections
import copy
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.deepspeed_internals import CheckpointCommitInfo, CheckpointEngine
from common.device import HOST
from training.checkpoint_writer import WriterProcess, WrittenFile, write_file

__all__ = ["MODES", "HostBuffers", "SnapshotCheckpointEngine", "WriterError", "WrittenFile", "host_snapshot",
           "write_file"]

MODES = ("async", "sync")


class WriterError(RuntimeError):
    """The writer could not write a file; nothing of that checkpoint is committed."""

    def __init__(self, path: Path, error: BaseException) -> None:
        self.path, self.error = path, error
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        super().__init__(f"{path}: {reason}")


class HostBuffers:
    """The host memory snapshots are copied into: allocated once (by the rehearsals around the first step, else at
    the first save), reused by every later save.

        a storage of the state, found at      its buffer
        the place of a buffer of the last     that buffer, the same storage (``copy_`` into it): nothing allocated
          save, the same bytes and pinning
        the place of a buffer of another      a new one in its place (the state changed shape: counted)
          size or pinning
        a new place                           a new one (counted)
        a second time in one save             a new one for this save only (counted; never two snapshots in one)
        no longer in the state                its buffer is released by ``end_save()``

    A place is the file's name and the keys and indices that lead to the tensor that first shows the storage. Every
    buffer is in shared memory (``share_memory_``), which the writer process maps (training/checkpoint_writer.py);
    buffers of CUDA tensors are also pinned (the shared pages registered with ``cudaHostRegister``, as torchtitan
    pins its shared buffers), the copy into them non-blocking.
    """

    def __init__(self) -> None:
        self.storages: dict[tuple, tuple[torch.UntypedStorage, bool]] = {}
        """Place -> (buffer, pinned)."""
        self.allocations = 0
        """Buffers allocated since the engine was made: at the first save, then only where the state changed."""
        self.allocated_bytes = 0
        self.shared: dict[int, tuple[int, torch.UntypedStorage]] = {}
        """Data pointer -> (number, buffer) of every live buffer that holds bytes: what the writer maps."""
        self.sizing = False
        """True during a rehearsal: snapshots take (allocate) their buffers but copy nothing into them."""
        self._taken: set[tuple] = set()
        self._once: list[torch.UntypedStorage] = []
        self._numbers = iter(range(1 << 62))

    def take(self, place: tuple, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        if place in self._taken:
            buffer = self._allocate(nbytes, pinned)
            self._once.append(buffer)
            return buffer
        self._taken.add(place)
        buffer, was_pinned = self.storages.get(place, (None, pinned))
        if buffer is None or buffer.nbytes() != nbytes or was_pinned != pinned:
            buffer = self._allocate(nbytes, pinned)
            self.storages[place] = (buffer, pinned)
        return buffer

    def end_save(self) -> None:
        """The save's snapshot is complete: buffers it did not take are released (the previous save's writer has
        finished with them), those it took stay shared until the next save ends."""
        self.storages = {place: buffer for place, buffer in self.storages.items() if place in self._taken}
        live = {buffer.data_ptr() for buffer, _ in self.storages.values()} | {b.data_ptr() for b in self._once}
        for pointer in set(self.shared) - live:
            _unpin(self.shared.pop(pointer)[1])
        self._taken, self._once = set(), []

    def _allocate(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        self.allocations += 1
        self.allocated_bytes += nbytes
        # host: a snapshot buffer, in shared memory for the writer process (pinned too for a CUDA tensor's copy)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=HOST).untyped_storage()
        if nbytes:
            buffer.share_memory_()
            if pinned:
                _pin(buffer)
            self.shared[buffer.data_ptr()] = (next(self._numbers), buffer)
        return buffer


def _pin(buffer: torch.UntypedStorage) -> None:
    """Page-lock a shared buffer for CUDA's non-blocking copies (torch's pin_memory would allocate new memory)."""
    error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes(), 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of a {buffer.nbytes():,}-byte checkpoint buffer failed ({error}): "
                           f"too little lockable host memory? Use training.checkpoint_mode \"sync\"")


def _unpin(buffer: torch.UntypedStorage) -> None:
    if buffer.device.type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized() and \
            buffer.is_pinned():
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def host_snapshot(state: Any, buffers: HostBuffers | None = None, place: tuple = (), memo: dict | None = None) -> Any:
    """A copy of ``state`` whose tensors live in host memory, views of one storage staying views of one storage
    (torch.save then writes the same bytes as of the original). Its storages are taken from ``buffers`` at ``place``
    (the file's name, then the keys that lead to each tensor); without buffers, allocated for this snapshot only.
    CUDA tensors go to pinned buffers by non-blocking copies: synchronise the device before reading them."""
    memo = {} if memo is None else memo
    buffers = HostBuffers() if buffers is None else buffers
    if isinstance(state, torch.Tensor):
        return _tensor_snapshot(state, buffers, place, memo)
    if type(state) in (dict, collections.OrderedDict):
        return type(state)((key, host_snapshot(value, buffers, (*place, key), memo)) for key, value in state.items())
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(host_snapshot(value, buffers, (*place, index), memo) for index, value in enumerate(state))
    if isinstance(state, (str, bytes, int, float, bool, type(None))):
        return state
    return copy.deepcopy(state, memo)  # tensors inside other objects are copied afresh, not into the buffers


def _tensor_snapshot(tensor: torch.Tensor, buffers: HostBuffers, place: tuple, memo: dict) -> torch.Tensor:
    storage = tensor.untyped_storage()
    key = (tensor.device, storage.data_ptr())
    if key not in memo:
        memo[key] = buffers.take(place, storage.nbytes(), pinned=tensor.is_cuda)
        if not buffers.sizing:
            memo[key].copy_(storage, non_blocking=tensor.is_cuda)
    # host: a view of the snapshot's buffer, as the tensor views its storage
    copied = torch.empty(0, dtype=tensor.dtype, device=HOST).set_(memo[key], tensor.storage_offset(), tensor.size(),
                                                                  tensor.stride())
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
    return copied.requires_grad_(tensor.requires_grad) if tensor.is_leaf else copied


@dataclass
class _Batch:
    """One checkpoint's files, in the order DeepSpeed saved them."""

    files: list[tuple[Path, Any]] = field(default_factory=list)
    written: list[WrittenFile] = field(default_factory=list)
    error: WriterError | None = None
    done: threading.Event = field(default_factory=threading.Event)


class SnapshotCheckpointEngine(CheckpointEngine):
    """The engine of the module docstring."""

    def __init__(self, mode: str = "async", zipfile: bool = True) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"training.checkpoint_mode must be one of {MODES}, got {mode!r}")
        self.name, self.mode, self.zipfile = "SnapshotCheckpointEngine", mode, zipfile
        self.buffers = HostBuffers()
        self.writer = WriterProcess.start()  # forked at start-up, or spawned now: it starts while the run builds
        self.write_file: Callable[[Any, Path, bool], WrittenFile] = self.writer.write
        """What the hand-over thread calls for each file: (snapshot, path, zipfile); by default the writer process
        writes it. training/faults.py wraps it (a slow writer, a full disk)."""
        self.pending: _Batch | None = None
        self.current: _Batch | None = None
        self.tag: str | None = None
        self.blocked_s = 0.0
        """Seconds the last save held the training thread (snapshot and hand-over; with "sync", the writing too)."""
        self._rehearsing = False
        self._jobs: queue.Queue[_Batch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_batches, name="checkpoint-hand-over", daemon=True)
        self._thread.start()

    # -- DeepSpeed's interface -------------------------------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        if self.current is not None and not self.current.done.is_set():
            raise RuntimeError(f"checkpoint {self.tag} is still being written: wait() before the next save")
        self.tag, self.pending = info.tag, _Batch()
        self._started = time.perf_counter()

    def makedirs(self, path, exist_ok=False) -> None:
        if not self._rehearsing:
            super().makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        if self.pending is None:
            self.create(CheckpointCommitInfo(tag=Path(path).parent.name, save_dir=str(Path(path).parent.parent),
                                             save_latest=False))
        if self.in_flight:  # never reached through create(); the writer reads the buffers this would overwrite
            raise RuntimeError(f"checkpoint {self.tag} is still being written: wait() before the next save")
        # The buffers are reused: safe because the previous checkpoint's writer has finished (checked above and in
        # create()), and it is the only reader of the host buffers.
        snapshot = host_snapshot(state_dict, self.buffers, (Path(path).name,))
        self.pending.files.append((Path(path), snapshot))

    def load(self, path: str, map_location=None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """DeepSpeed's own commit, at the end of its save: nothing here (start() and training/checkpoint.py's commit
        run after the project's own files are added)."""
        return True

    @contextmanager
    def rehearsal(self) -> Iterator[None]:
        """Saves inside only size the host buffers (allocated, their pages touched, handed to the writer): nothing
        is copied or written, no directory made. After one, a save of the same shapes allocates nothing."""
        if self.in_flight:
            raise RuntimeError(f"checkpoint {self.tag} is still being written: wait() before a rehearsal")
        self._rehearsing = self.buffers.sizing = True
        try:
            yield
        finally:
            self._rehearsing = self.buffers.sizing = False
            rehearsed, self.pending = self.pending, None
            self.buffers.end_save()
            self.writer.share(self.buffers.shared)
            if rehearsed is not None:  # the writer imports and maps now what its first write will need
                self.writer.warm([state for _, state in rehearsed.files])

    # -- the writer ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Hand the snapshot to the writer (after one device synchronisation); with "sync", wait for it."""
        if self.pending is None:
            raise RuntimeError("start() without a save")
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the one synchronisation of the save: every non-blocking copy has landed
        self.buffers.end_save()
        self.writer.share(self.buffers.shared)  # handles of new buffers only: none once the shapes are settled
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
        """The hand-over thread: each file to ``write_file`` (the writer process), one at a time, waiting for it
        (a blocking read of a pipe: the GIL is free meanwhile)."""
        while (batch := self._jobs.get()) is not None:
            for path, state in batch.files:
                try:
                    batch.written.append(self.write_file(state, path, self.zipfile))
                except BaseException as error:  # the file and the error; the files already renamed stay
                    batch.error = WriterError(path, error)
                    break
            batch.files.clear()  # the snapshot's views; its buffers stay with the engine for the next save
            batch.done.set()

    def cleanup(self) -> None:
        """End the hand-over thread and the writer process: after the checkpoint in flight if there is none, at
        once if there is (a run ending on an error: that checkpoint would never be committed)."""
        if self._thread.is_alive():
            abandoned = self.in_flight
            self._jobs.put(None)
            if abandoned:
                self.writer.close(kill=True)
            self._thread.join()
        if self.writer.process.exitcode is None:
            self.writer.close()
