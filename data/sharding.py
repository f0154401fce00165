"""Inputs bigger than one machine: several input files, disjoint shards of them, and the merge of the shards.

The inputs, in the order given, are read as one stream of documents. ``--shard K/N`` keeps the K-th (0-based) of N
slices of that stream, cut by bytes: with W the total size of the inputs, shard K holds every line whose first byte
lies in [K W / N, (K + 1) W / N) of the inputs laid end to end. A plain JSONL file can be cut anywhere (a cut moves
to the next line start); a gzip, parquet, arrow or saved-dataset input is never cut: it belongs to the shard holding
its first byte. So the shards are disjoint, cover every document once and keep their order: merging the N shard
datasets in shard order gives the bytes of one run over all the inputs.

Each shard writes ``{output_prefix}-shard{K:05d}of{N:05d}_{key}_document.bin/.idx`` and, once every key is complete,
the manifest ``{output_prefix}-shard{K:05d}of{N:05d}.manifest.json`` (inputs, settings, and the size of each
dataset). :func:`merge_shards` merges only when all N manifests are there, agree, and describe the files on disk, so a
crashed, missing or stale shard stops the merge instead of leaving a dataset that looks complete.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from common.files import atomic_open
from data.indexed_dataset import IndexedDataset, bin_path, idx_path, merge_datasets

_SCAN_BYTES = 1 << 20  # bytes read at a time when looking for a line start or counting lines


class ShardError(ValueError):
    """Shards that cannot be merged into the output of one run: missing, incomplete or from different runs."""


@dataclass(frozen=True)
class InputSlice:
    """The part of one input file that a run reads: the whole file, or the lines starting in [start, end)."""

    path: str
    start: int = 0  # byte offset of the first line
    end: int | None = None  # byte offset where reading stops (a line start); None: the end of the file


def expand_inputs(inputs: str | Sequence[str]) -> tuple[str, ...]:
    """Files from --input: paths and glob patterns (each pattern's matches sorted by name), in the order given."""
    files: list[str] = []
    for item in [inputs] if isinstance(inputs, str) else inputs:
        if glob.has_magic(item):
            matches = sorted(glob.glob(item))
            if not matches:
                raise FileNotFoundError(f"input {item}: no file matches this pattern")
            files += matches
        elif os.path.exists(item):
            files.append(item)
        else:
            raise FileNotFoundError(f"input {item} does not exist")
    repeated = sorted({path for path in files if files.count(path) > 1})
    if repeated:
        raise ValueError(f"input {repeated[0]} is listed more than once: its documents would be written twice")
    if not files:
        raise ValueError("no input files")
    return tuple(files)


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N), K 0-based."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"--shard {text!r}: expected K/N, e.g. 0/16 (K from 0 to N-1)")
    return check_shard(int(match.group(1)), int(match.group(2)))


def check_shard(index: int, count: int) -> tuple[int, int]:
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: K must be in 0..N-1 (0-based, as $SLURM_ARRAY_TASK_ID with "
                         f"--array=0-{max(count, 1) - 1}) and N >= 1")
    return index, count


def input_size(path: str) -> int:
    """Bytes of an input: its file size, or the total of a saved-dataset directory."""
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)
    return os.path.getsize(path)


def shard_slices(files: Sequence[str], splittable: Sequence[bool], index: int, count: int) -> list[InputSlice]:
    """The slices of shard ``index`` of ``count`` (see the module docstring)."""
    sizes = [input_size(path) for path in files]
    total = sum(sizes)
    low, high = total * index // count, total * (index + 1) // count
    slices, offset = [], 0
    for path, size, cuttable in zip(files, sizes, splittable, strict=True):
        if cuttable:
            start = line_start(path, min(max(low - offset, 0), size))
            end = line_start(path, min(max(high - offset, 0), size))
            if start < end:
                slices.append(InputSlice(path, start, end))
        elif low <= offset < high:
            slices.append(InputSlice(path))
        offset += size
    return slices


def line_start(path: str, offset: int) -> int:
    """The first line start at or after ``offset`` (a line starts at 0 or after a newline); the file size if none."""
    if offset == 0:
        return 0
    with open(path, "rb") as stream:
        stream.seek(offset - 1)
        position = offset - 1
        while block := stream.read(_SCAN_BYTES):
            newline = block.find(b"\n")
            if newline >= 0:
                return position + newline + 1
            position += len(block)
    return position


def count_lines_before(path: str, offset: int) -> int:
    """Newlines in the first ``offset`` bytes: the line number of the line starting at ``offset``, minus one."""
    lines, remaining = 0, offset
    with open(path, "rb") as stream:
        while remaining > 0 and (block := stream.read(min(_SCAN_BYTES, remaining))):
            lines += block.count(b"\n")
            remaining -= len(block)
    return lines


# ------------------------------------------------------------------------------------------------- names and manifest


def shard_prefix(output_prefix: str, index: int, count: int) -> str:
    """The prefix a shard writes under: zero-padded so that name order is shard order."""
    return f"{output_prefix}-shard{index:05d}of{count:05d}"


def manifest_path(prefix: str) -> str:
    return f"{prefix}.manifest.json"


def dataset_record(prefix: str) -> dict:
    """What the manifest says of one finished dataset, to recognise it at merge time."""
    dataset = IndexedDataset(prefix)
    return {"prefix": os.path.basename(prefix), "documents": dataset.num_documents, "tokens": dataset.num_tokens,
            "idx_bytes": os.path.getsize(idx_path(prefix)), "bin_bytes": os.path.getsize(bin_path(prefix))}


def write_manifest(prefix: str, record: dict) -> None:
    """Write the manifest through a temporary name: it exists only once every dataset of the shard is complete."""
    with atomic_open(manifest_path(prefix), "w") as stream:
        json.dump(record, stream, indent=1)


def remove_manifest(prefix: str) -> None:
    """Before a shard is (re)written: until its new manifest exists, the shard counts as incomplete."""
    if os.path.exists(manifest_path(prefix)):
        os.remove(manifest_path(prefix))


# ------------------------------------------------------------------------------------------------------------ merging

_SAME_IN_EVERY_SHARD = ("num_shards", "inputs", "json_keys", "append_eod", "input_format", "tokenizer")


def merge_shards(output_prefix: str, output_to: str | None = None) -> dict[str, IndexedDataset]:
    """Merge the shards written with ``output_prefix`` into ``{output_to}_{key}_document`` for every key.

    output_to defaults to output_prefix: the names one run over all inputs writes. Raises ShardError unless all N
    shards are complete and come from the same run.
    """
    manifests = _read_manifests(output_prefix)
    total_documents = sum(manifest["documents"] for manifest in manifests)
    if total_documents == 0:
        raise ShardError(f"{output_prefix}: no documents in any of the {len(manifests)} shards (empty input, or "
                         f"every line was bad); nothing was written")
    merged = {}
    for key_number, key in enumerate(manifests[0]["json_keys"]):
        prefixes = [_checked_dataset(output_prefix, manifest, key_number) for manifest in manifests]
        merged[key] = merge_datasets(prefixes, f"{output_to or output_prefix}_{key}_document")
    return merged


def _read_manifests(output_prefix: str) -> list[dict]:
    """The N manifests of one run, in shard order; ShardError if any is missing or from another run."""
    pattern = f"{glob.escape(output_prefix)}-shard[0-9][0-9][0-9][0-9][0-9]of[0-9][0-9][0-9][0-9][0-9].manifest.json"
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise ShardError(f"{output_prefix}: no shard manifests ({os.path.basename(pattern)}); run "
                         f"tools/preprocess_data.py --shard K/N --output-prefix {output_prefix} for every K first")
    manifests = [_load_manifest(path) for path in paths]
    for path, manifest in zip(paths, manifests, strict=True):
        for name in _SAME_IN_EVERY_SHARD:
            if manifest.get(name) != manifests[0].get(name):
                raise ShardError(f"{path}: its {name} differ from those of {paths[0]}: the shards come from "
                                 f"different runs; re-run the stale shards (or delete them)")
    count = manifests[0]["num_shards"]
    missing = sorted(set(range(count)) - {manifest["shard"] for manifest in manifests})
    if missing:
        names = ", ".join(os.path.basename(manifest_path(shard_prefix(output_prefix, k, count))) for k in missing[:5])
        raise ShardError(f"{output_prefix}: {len(missing)} of {count} shards are missing or incomplete (no manifest: "
                         f"{names}); run tools/preprocess_data.py --shard K/{count} for them")
    return sorted(manifests, key=lambda manifest: manifest["shard"])


def _load_manifest(path: str) -> dict:
    try:
        with open(path) as stream:
            manifest = json.load(stream)
    except (OSError, ValueError) as error:
        raise ShardError(f"{path}: unreadable shard manifest ({error}); re-run that shard") from error
    if not isinstance(manifest, dict) or not {"shard", "num_shards", "documents", "datasets"} <= manifest.keys():
        raise ShardError(f"{path}: not a shard manifest of tools/preprocess_data.py; re-run that shard")
    return manifest


def _checked_dataset(output_prefix: str, manifest: dict, key_number: int) -> str:
    """The dataset of one key of one shard, checked to be the one its manifest describes."""
    record = manifest["datasets"][key_number]
    prefix = os.path.join(os.path.dirname(output_prefix), record["prefix"])
    for path, size in ((idx_path(prefix), record["idx_bytes"]), (bin_path(prefix), record["bin_bytes"])):
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            raise ShardError(f"{path}: missing, or not the file shard {manifest['shard']} wrote ({size} bytes); "
                             f"re-run tools/preprocess_data.py --shard {manifest['shard']}/{manifest['num_shards']}")
    return prefix
