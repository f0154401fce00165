"""Atomic writes: a file (or directory) appears at its path complete, or not at all; a crash leaves the old one.

    step                      what                                                         why
    1. temporary name         ``.<name>.tmp-<host>-<pid>-<random><suffix>`` beside the     same file system, so the
                              target                                                       rename is atomic; unique,
                                                                                           so processes on several
                                                                                           nodes never share one
    2. write                  the caller writes the temporary (bytes, text, JSON, or any   nothing at the target yet
                              writer given a path or a file: np.save, torch.save, ...)
    3. fsync the file         its data on disk before its name is                          a power loss after the
                                                                                           rename cannot leave an
                                                                                           empty file at the name
    4. rename into place      ``os.replace``: readers see the old file or the new one
    5. fsync the directory    the rename itself on disk                                    the name survives a crash
    on an exception           the temporary is removed; the target is untouched

``durable=False`` skips steps 3 and 5 (the rename stays atomic) where a crash is detected anyway and a sync would
cost more than a rebuild. The helpers:

    write_bytes_atomically(path, data)     write_text_atomically(path, text)     write_json_atomically(path, value)
    with atomic_path(path) as temporary:   a Path to write (a file, or a directory made there), published on exit
    with atomic_open(path, "w") as f:      an open file on the temporary, closed and published on exit
    publish(temporary, path)               steps 3 to 5 for a temporary the caller named (builders that stream)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TEMPORARY_MARK = ".tmp-"
"""In every temporary name: whoever lists a directory that is being written skips names holding it."""


def temporary_name(path: str | os.PathLike) -> Path:
    """A hidden sibling of ``path``, unique to this host, process and call, ending in ``path``'s suffix: writers that
    choose the format by the suffix (matplotlib's savefig) or add one that is missing (np.save) write it as named."""
    path = Path(path)
    unique = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{unique}{path.suffix}")


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make a rename (or a new name) in ``directory`` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(path: Path) -> None:
    """fsync a file, or every file and folder of a directory."""
    if path.is_dir():
        for child in path.rglob("*"):
            if child.is_file():
                _fsync_file(child)
        fsync_directory(path)
    else:
        _fsync_file(path)


def _fsync_file(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(temporary: str | os.PathLike, path: str | os.PathLike, *, durable: bool = True) -> None:
    """Rename a finished ``temporary`` (a file, or a directory) to ``path``: its data synced first, the directory
    after (both skipped when not ``durable``). A directory replaces only a missing or empty one (POSIX rename)."""
    temporary, path = Path(temporary), Path(path)
    if durable:
        _fsync_tree(temporary)
    os.replace(temporary, path)
    if durable:
        fsync_directory(path.parent)


def remove(path: str | os.PathLike) -> None:
    """Remove a temporary, file or directory, if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | os.PathLike, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for the caller to write (a file, or a directory it makes there);
    published to ``path`` when the block ends, removed when it raises."""
    path = Path(path)
    temporary = temporary_name(path)
    try:
        yield temporary
        if not temporary.exists():
            raise FileNotFoundError(f"nothing was written to {temporary} for {path}")
        publish(temporary, path, durable=durable)
    except BaseException:
        remove(temporary)
        raise


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, durable: bool = True, **options: Any) -> Iterator[IO]:
    """``open(temporary, mode, **options)``; closed and published to ``path`` when the block ends, removed when it
    raises. ``mode`` writes: "w", "wb", "x"... ("a" would append to an empty temporary, not to ``path``)."""
    if mode[:1] not in ("w", "x"):
        raise ValueError(f"atomic_open writes a new file: mode {mode!r} must be 'w', 'wb', 'w+' or 'x'")
    with atomic_path(path, durable=durable) as temporary:
        with open(temporary, mode, **options) as stream:
            yield stream


def write_bytes_atomically(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    with atomic_open(path, "wb", durable=durable) as stream:
        stream.write(data)


def write_text_atomically(path: str | os.PathLike, text: str, *, encoding: str = "utf-8",
                          durable: bool = True) -> None:
    with atomic_open(path, "w", encoding=encoding, durable=durable) as stream:
        stream.write(text)


def write_json_atomically(path: str | os.PathLike, value: Any, *, indent: int | None = 1, durable: bool = True,
                          **dump_options: Any) -> None:
    """``json.dumps(value, indent=indent, **dump_options)`` and a final newline, written atomically."""
    write_text_atomically(path, json.dumps(value, indent=indent, **dump_options) + "\n", durable=durable)
