"""Precision names, as configs and command lines spell them, and what each means: one table for every package.

    name    torch dtype       bytes per element    also spelled
    fp32    torch.float32     4                    float32, float, torch.float32
    bf16    torch.bfloat16    2                    bfloat16, torch.bfloat16
    fp16    torch.float16     2                    float16, half, torch.float16

torch is imported only by ``torch_dtype``: the planner and the config readers use the names and sizes without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "bf16", "fp16")
"""The precision names, in the order the help texts list them."""
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
ALIASES = {"float32": "fp32", "float": "fp32", "torch.float32": "fp32", "bfloat16": "bf16", "torch.bfloat16": "bf16",
           "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def precision_name(name: str) -> str:
    """The canonical name of a precision ("bfloat16" -> "bf16"), or a ValueError listing the names."""
    canonical = ALIASES.get(str(name), str(name))
    if canonical not in BYTES_PER_ELEMENT:
        raise ValueError(f"unknown precision {name!r}: use one of {', '.join(PRECISIONS)} (or {', '.join(ALIASES)})")
    return canonical


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a precision name (any spelling of the table)."""
    import torch

    return getattr(torch, _TORCH_NAMES[precision_name(name)])


def torch_dtypes() -> dict[str, torch.dtype]:
    """{name: torch dtype} for every precision: {"fp32": torch.float32, "bf16": torch.bfloat16, ...}."""
    return {name: torch_dtype(name) for name in PRECISIONS}
