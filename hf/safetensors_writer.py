"""Writing safetensors a tensor at a time: the headers are planned up front, so no tensor is held after it is
written and an export's peak memory follows its largest layer, not the model."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def parse_size(size: str | int) -> int:
    """"5GB" -> 5e9 bytes (KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary), or plain bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            text, multiplier = text[: -len(unit)], factor
            break
    else:
        multiplier = 1
    try:
        value = float(text) * multiplier
    except ValueError:
        raise ValueError(f"size {size!r} is not a number of bytes like 5GB, 500MB or 2000000") from None
    if value <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return int(value)


class SafetensorsShardWriter:
    """Writes tensors whose names and shapes are known up front, one at a time and in that order, into safetensors
    files of at most ``max_shard_bytes`` each (a bigger tensor gets a file of its own), plus the index that
    ``from_pretrained`` reads when there is more than one file. Each file's header is written first, so no tensor is
    held after ``write`` returns. Every tensor is written in ``dtype``, those named in ``dtypes`` in theirs."""

    def __init__(self, directory: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 max_shard_bytes: int, dtypes: dict[str, torch.dtype] | None = None) -> None:
        self.dtypes = {name: (dtypes or {}).get(name, dtype) for name in shapes}
        for each in {dtype, *self.dtypes.values()}:
            if each not in SAFETENSORS_DTYPES:
                raise ValueError(f"cannot write dtype {each} to safetensors: use one of {list(SAFETENSORS_DTYPES)}")
        self.directory, self.shapes = Path(directory), shapes
        self.files = self._plan(max_shard_bytes)
        self.order = [name for names in self.files for name in names]
        self.position, self.file_number, self.handle = 0, -1, None

    def _bytes(self, name: str) -> int:
        return self.dtypes[name].itemsize * int(torch.Size(self.shapes[name]).numel())

    def _plan(self, max_shard_bytes: int) -> list[list[str]]:
        files, size = [[]], 0
        for name in self.shapes:
            if files[-1] and size + self._bytes(name) > max_shard_bytes:
                files.append([])
                size = 0
            files[-1].append(name)
            size += self._bytes(name)
        return files

    def file_name(self, number: int) -> str:
        if len(self.files) == 1:
            return "model.safetensors"
        return f"model-{number + 1:05d}-of-{len(self.files):05d}.safetensors"

    def _header(self, names: list[str]) -> bytes:
        entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            entries[name] = {"dtype": SAFETENSORS_DTYPES[self.dtypes[name]], "shape": list(self.shapes[name]),
                             "data_offsets": [offset, offset + self._bytes(name)]}
            offset += self._bytes(name)
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        return struct.pack("<Q", len(header)) + header

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.position >= len(self.order) or name != self.order[self.position]:
            expected = self.order[self.position] if self.position < len(self.order) else "nothing more"
            raise RuntimeError(f"safetensors writer: got {name}, expected {expected}")
        if tuple(tensor.shape) != self.shapes[name]:
            raise RuntimeError(f"safetensors writer: {name} has shape {tuple(tensor.shape)}, planned {self.shapes[name]}")
        if self.file_number + 1 < len(self.files) and name == self.files[self.file_number + 1][0]:
            self._next_file()
        data = tensor.detach().to(self.dtypes[name]).contiguous().reshape(-1)
        self.handle.write(data.view(torch.uint8).numpy().data)
        self.position += 1

    def _next_file(self) -> None:
        if self.handle is not None:
            self.handle.close()
        self.file_number += 1
        self.handle = open(self.directory / self.file_name(self.file_number), "wb")
        self.handle.write(self._header(self.files[self.file_number]))

    def close(self) -> list[str]:
        """Finish (every planned tensor must have been written); returns the file names."""
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        if self.position != len(self.order):
            raise RuntimeError(f"safetensors writer closed after {self.position} of {len(self.order)} tensors")
        names = [self.file_name(number) for number in range(len(self.files))]
        if len(self.files) > 1:
            index = {"metadata": {"total_size": sum(self._bytes(n) for n in self.order)},
                     "weight_map": {n: self.file_name(i) for i, names_ in enumerate(self.files) for n in names_}}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names

