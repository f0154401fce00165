"""The checkpoint writer process: serialises and writes the snapshot engine's files outside the training process.

One writer per engine (training/checkpoint_engine.py), never a fork of a training process that may hold CUDA state
or threads. train.py forks one first thing (``WriterProcess.fork_early``), when its process has imported torch and
nothing has run: a forkserver's way, the writer then starts without importing torch again. Any other writer is
started with the "spawn" method (a fresh interpreter), as torchtitan's ``async_with_pinned_mem`` does. The writer
ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group): the training process, which handles them by
writing a checkpoint, still needs it.
It reads the snapshot from the engine's host buffers, which live in shared memory (pinned with
``cudaHostRegister`` on CUDA), so no tensor byte crosses the pipe:

    what crosses the pipe                     when                                  size
    ("buffers", new, released)                a save (or the rehearsal) allocated    one file descriptor per new
                                              or released host buffers: their        buffer (torch's own sharing of
                                              shared-memory handles, once each       storages), numbers of the others
    ("warm", skeletons)                       the rehearsal (start-up)               the rehearsal's files, as below:
                                                                                     their classes imported and the
                                                                                     buffers' pages mapped now, not
                                                                                     at the first save
    ("write", path, zipfile, skeleton)        each file of a checkpoint              the state pickled with each
                                                                                     buffer tensor as a reference
                                                                                     (buffer number, dtype, offset,
                                                                                     size, stride): kilobytes
    ("written", WrittenFile, cpu_s) or        each file, back                        its name, bytes and CRC-32, or
    ("failed", error, cpu_s)                                                         the error; the writer's CPU
                                                                                     seconds so far
    ("warmed", None, cpu_s)                   after "warm", back (read with the      the writer's CPU seconds so far
                                              next answer)
    ("stop",)                                 cleanup                                -

In the writer the skeleton is unpickled into tensors that view the mapped buffers, one storage per buffer, as the
snapshot viewed them: torch.save writes the bytes it would have written in the training process. Each file goes
through ``write_file``: a temporary name, its size and CRC-32 counted as it is written, fsync, rename, directory
fsync (common/files.py), so a writer killed mid-file leaves a temporary, never a complete-looking file.

The writer ends on "stop", when the pipe closes, and when the training process is gone (it watches its parent: a
SIGKILLed rank leaves no writer behind). Under torch's default sharing strategy ("file_descriptor") each shared buffer
keeps a file descriptor open in both processes: both raise their open-file soft limit to the hard one, and a rank
whose files hold N storages needs a hard limit above N.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import multiprocessing.util  # its exit handler (terminate, join) must run after _close_all
import os
import pickle
import resource
import signal
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.device import HOST
from common.files import atomic_open


@dataclass(frozen=True)
class WrittenFile:
    name: str
    """The file's name in the checkpoint directory."""
    bytes: int
    crc32: int


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
    """torch.save into a temporary name beside ``path``, its size and CRC-32 counted as it goes, then published
    (common/files.py: fsync, rename to ``path``, directory fsync); on an error the temporary is removed."""
    with atomic_open(path, "wb") as handle:
        counted = _Counted(handle)
        torch.save(state, counted, _use_new_zipfile_serialization=zipfile)
    return WrittenFile(path.name, counted.bytes, counted.crc32)


# -- the state as references into the shared buffers -----------------------------------------------------------------
class _SkeletonPickler(pickle.Pickler):
    """Pickles a snapshot with every tensor that views a shared buffer as a reference to it (``numbers``: the
    buffers' data pointers -> their numbers); other objects, and tensors outside the buffers, by value."""

    def __init__(self, file: io.BytesIO, numbers: dict[int, int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.numbers = numbers

    def persistent_id(self, obj: Any) -> tuple | None:
        if not isinstance(obj, torch.Tensor):
            return None
        number = self.numbers.get(obj.untyped_storage().data_ptr()) if obj.untyped_storage().nbytes() else -1
        if number is None:
            return None
        return (number, obj.dtype, obj.storage_offset(), tuple(obj.size()), obj.stride(), obj.requires_grad,
                isinstance(obj, torch.nn.Parameter))


class _SkeletonUnpickler(pickle.Unpickler):
    """The writer's side: each reference becomes a view of the mapped buffer, as the snapshot's tensor viewed it;
    the empty storages of one file are one storage (the snapshot made them one: host_snapshot's memo)."""

    def __init__(self, file: io.BytesIO, storages: dict[int, torch.UntypedStorage]) -> None:
        super().__init__(file)
        self.storages, self.empty = storages, torch.UntypedStorage(0)

    def persistent_load(self, reference: tuple) -> torch.Tensor:
        number, dtype, offset, size, stride, requires_grad, parameter = reference
        storage = self.empty if number == -1 else self.storages[number]
        # host: a view of a shared snapshot buffer, in the writer process
        tensor = torch.empty(0, dtype=dtype, device=HOST).set_(storage, offset, size, stride)
        if parameter:
            return torch.nn.Parameter(tensor, requires_grad=requires_grad)
        return tensor.requires_grad_(requires_grad)


def skeleton(state: Any, numbers: dict[int, int]) -> bytes:
    buffer = io.BytesIO()
    _SkeletonPickler(buffer, numbers).dump(state)
    return buffer.getvalue()


def from_skeleton(data: bytes, storages: dict[int, torch.UntypedStorage]) -> Any:
    return _SkeletonUnpickler(io.BytesIO(data), storages).load()


# -- the writer process ----------------------------------------------------------------------------------------------
def _exit_with(parent: int) -> None:
    """The training process died (SIGKILL, OOM): it will never read what this writer writes; end now."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _portable(error: BaseException) -> BaseException:
    """The error as the training process can unpickle it (OSError keeps its errno and strerror)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # an error holding something that does not pickle: its type and message
        return RuntimeError(f"{type(error).__name__}: {error}")


def raise_open_file_limit() -> None:
    """Every shared buffer keeps a file descriptor open in the training process and in the writer (torch's
    "file_descriptor" sharing): the soft limit is raised to the hard one, as a rank whose files hold more tensors than
    a usual soft limit of 1,024 would otherwise fail at its first save."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(connection: Any, parent: int, other_end: Any = None) -> None:
    """The writer process's loop (the module docstring's messages); ``other_end``: the training process's end of the
    pipe, which a forked writer inherits and closes (its recv then sees EOF when the training process is gone)."""
    if other_end is not None:
        other_end.close()
    for number in (signal.SIGINT, signal.SIGTERM):  # the training process answers them, and still needs its writer
        signal.signal(number, signal.SIG_IGN)
    torch.set_num_threads(1)
    raise_open_file_limit()
    threading.Thread(target=_exit_with, args=(parent,), name="watch-parent", daemon=True).start()
    storages: dict[int, torch.UntypedStorage] = {}
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):  # the training process closed its end, or died
            return
        if message[0] == "buffers":
            storages.update(message[1])
            for number in message[2]:
                storages.pop(number, None)
        elif message[0] == "warm":
            for data in message[1]:
                from_skeleton(data, storages)  # imports what the files' objects need (DeepSpeed's config)
            for storage in storages.values():
                # host: a byte view of a mapped buffer, read once per page so that its pages are mapped here
                torch.empty(0, dtype=torch.uint8, device=HOST).set_(storage)[::4096].sum()
            connection.send(("warmed", None, _cpu_seconds()))
        elif message[0] == "write":
            _, path, zipfile, data = message
            try:
                reply = ("written", write_file(from_skeleton(data, storages), Path(path), zipfile))
            except BaseException as error:  # the training process names the file and stops the commit
                reply = ("failed", _portable(error))
            connection.send((*reply, _cpu_seconds()))
        else:
            return


class WriterProcess:
    """The training process's end: starts the writer, hands it the buffers' handles and each file, and takes back
    each file's WrittenFile (or raises its error). ``write`` is called by one thread at a time."""

    _early: list[WriterProcess] = []
    """The writers forked at the start (fork_early: train.py's one), until engines take them (start)."""

    def __init__(self, method: str = "spawn") -> None:
        import torch.multiprocessing  # noqa: F401  torch's reductions: a shared storage pickles as its handle

        raise_open_file_limit()
        self.method = method
        """How the writer started: "fork" (at start-up, fork_early) or "spawn"."""
        context = multiprocessing.get_context(method)
        self.connection, child = context.Pipe()
        # daemon: an interpreter that exits without cleanup() terminates it; a killed one is watched (_exit_with)
        other_end = self.connection if method == "fork" else None
        self.process = context.Process(target=serve, args=(child, os.getpid(), other_end), name="checkpoint-writer",
                                       daemon=True)
        self.process.start()
        _LIVE.add(self)
        child.close()  # the writer's end lives in the writer only: its recv sees EOF when this process dies
        self.numbers: dict[int, int] = {}
        """Data pointer -> number of each buffer the writer has mapped."""
        self.cpu_s = 0.0
        """The writer process's CPU seconds so far (user and system), as of its last reply."""
        self._lock = threading.Lock()

    @classmethod
    def fork_early(cls, writers: int = 1) -> None:
        """Fork the writers of this process's first ``writers`` engines now (train.py: one, first thing): a fork
        costs nothing, but only while the process has one thread and no CUDA context, before anything has run;
        otherwise each engine spawns its writer as usual. A writer forked after another holds the training end of
        the earlier one's pipe, so at exit they end in turn, the last forked first."""
        if not cls._early and threading.active_count() == 1 and not torch.cuda.is_initialized():
            cls._early = [cls("fork") for _ in range(writers)]

    @classmethod
    def start(cls) -> WriterProcess:
        """The engine's writer: one forked at start-up if one is alive and not taken yet, else a spawned one."""
        while cls._early:
            early = cls._early.pop(0)
            if early.process.is_alive():
                return early
        return cls()

    def share(self, buffers: dict[int, tuple[int, torch.UntypedStorage]]) -> None:
        """Send the handles of the buffers the writer has not mapped yet, and the numbers of those released;
        ``buffers``: data pointer -> (number, storage) of every live shared buffer."""
        mapped = set(self.numbers.values())
        new = {number: storage for number, storage in buffers.values() if number not in mapped}
        released = mapped - {number for number, _ in buffers.values()}
        if new or released:
            with self._lock:
                self.connection.send(("buffers", new, sorted(released)))
        self.numbers = {pointer: number for pointer, (number, _) in buffers.items()}

    def warm(self, states: list[Any]) -> None:
        """Have the writer unpickle these snapshots (a rehearsal's) and touch its buffers now, so that its first
        write spends nothing on imports and page mappings; no answer is awaited."""
        data = [skeleton(state, self.numbers) for state in states]
        with self._lock:
            self.connection.send(("warm", data))

    def write(self, state: Any, path: Path, zipfile: bool = True) -> WrittenFile:
        """The engine's default ``write_file``: the writer process writes ``state`` (a snapshot viewing the shared
        buffers) to ``path``; its error is raised here."""
        data = skeleton(state, self.numbers)
        with self._lock:
            try:
                self.connection.send(("write", str(path), zipfile, data))
                kind = "warmed"
                while kind == "warmed":
                    kind, result, self.cpu_s = self.connection.recv()
            except (EOFError, OSError) as error:
                raise RuntimeError(f"the checkpoint writer process ended (exit code {self.process.exitcode})") \
                    from error
        if kind == "failed":
            raise result
        return result

    def cpu_seconds(self) -> float:
        """The writer process's CPU seconds so far, as of its last answer (a warm-up's included once it is done)."""
        with self._lock:
            while self.connection.poll():
                _, _, self.cpu_s = self.connection.recv()
        return self.cpu_s

    def close(self, kill: bool = False) -> None:
        """End the writer: let it finish (after its current file), or with ``kill`` at once (a checkpoint abandoned
        mid-file leaves only its temporary)."""
        if kill:
            self.process.kill()
        elif self.process.is_alive():
            try:
                with self._lock:
                    self.connection.send(("stop",))
            except OSError:  # it has ended already
                pass
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.connection.close()
        _LIVE.discard(self)


_LIVE: weakref.WeakSet[WriterProcess] = weakref.WeakSet()
"""The writers of this process not closed yet."""


@atexit.register
def _close_all() -> None:
    """At exit, before multiprocessing's own handler (which would SIGTERM a writer, and the writer ignores it): close
    the writers an engine left open."""
    for writer in list(_LIVE):
        writer.close()
