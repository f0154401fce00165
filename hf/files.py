"""Directories that others read (exports, imported checkpoints) are written beside their final path and renamed
into place when complete, so a crash never leaves one that looks complete; long work shows a progress bar."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from common.files import publish as publish_directory


def staging_directory(output: Path) -> Path:
    """A sibling of ``output`` (same filesystem, so the final rename is atomic)."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"output {output} already exists and is not empty: remove it or choose another path")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def publish(staging: Path, output: Path) -> None:
    if output.exists():
        output.rmdir()  # empty (checked before starting)
    publish_directory(staging, output)  # its files synced, renamed, the parent directory synced


def progress_bar(items: Iterable, description: str, enabled: bool):
    from tqdm.auto import tqdm

    items = list(items)
    return tqdm(items, desc=description, unit="layer", total=len(items), disable=not enabled, file=sys.stderr)

