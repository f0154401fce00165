"""The helpers every configuration module checks its fields with, and the --set option that fixes one."""

from __future__ import annotations

import json
import shlex
from typing import Any


def set_option(path: str, value: Any) -> str:
    """The --set option that gives a config field this value, as one shell word that pastes: compact JSON, quoted
    where the shell needs it (--set reads the value as JSON: runconfig/fields.py apply_overrides).

    >>> set_option("model.num_attention_heads", 6)
    '--set model.num_attention_heads=6'
    >>> set_option("model.rope_scaling", {"rope_type": "llama3", "factor": 8.0})
    '--set \'model.rope_scaling={"rope_type":"llama3","factor":8.0}\''
    """
    return "--set " + shlex.quote(f"{path}={json.dumps(value, separators=(',', ':'))}")


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless ``condition``: every check names the field and the fix in its message."""
    if not condition:
        raise ValueError(message)


def require_block(values: Any, block: str, known: list[str], what: str) -> None:
    """A config block given as a JSON object (``what``: its fields, for the message) with known keys only."""
    require(isinstance(values, dict), f"{block} must be an object of {what} or null, got {values!r}")
    unknown = sorted(set(values) - set(known))
    require(not unknown, f"unknown key(s) {unknown} in block \"{block}\": known keys are {sorted(known)}")


def is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
