"""Reading JSON into the run config's dataclasses: --set overrides, and the type check of every field, which names
the field, the value and the type it takes (runconfig/run.py builds the blocks with these)."""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from typing import Any


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """--set a.b.c=value, value read as JSON when it parses."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected block.field=value, e.g. schedule.warmup_tokens=1e6")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part} is not a block")
        node[leaf] = value
    return raw


# What a field of each type takes, with an example of how to write it in JSON (and so with --set).
_TYPE_NAMES = {bool: "true or false", int: "an integer (e.g. 100)", float: "a number (e.g. 1e-4)",
               str: "a string", list: "a list [...]",
               dict: "an object {...}"}

_JSON_NAMES = {bool: "a boolean", int: "an integer", float: "a decimal number", str: "a string", list: "a list",
               dict: "an object", type(None): "null"}


def _matches(value: Any, annotation: Any) -> bool:
    """JSON values against a field's annotation: int, float (an int is a float too), str, bool, list[...],
    dict[...], Any, and unions of them (X | None). bool is not an int here, although Python says it is."""
    if annotation is Any:
        return True
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_matches(value, option) for option in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation) or annotation
    if isinstance(value, bool):
        return origin is bool
    if dataclasses.is_dataclass(origin):  # a block of its own (model.moe): check_field_types checks its fields
        return isinstance(value, dict)
    if origin is float:
        return isinstance(value, (int, float))
    return isinstance(value, origin)


def _describe(annotation: Any) -> str:
    names = [_TYPE_NAMES[dict] if dataclasses.is_dataclass(option) else
             _TYPE_NAMES.get(typing.get_origin(option) or option, "null" if option is type(None) else str(option))
             for option in _options(annotation)]
    return " or ".join(names)


def _options(annotation: Any) -> tuple[Any, ...]:
    return typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)


def check_field_types(cls: type, block: str, values: dict[str, Any], extra_keys: tuple[str, ...] = ()) -> None:
    """Refuse unknown keys and values of the wrong type, naming the field, the value and the type it takes."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)} | set(extra_keys)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in block \"{block}\": known keys are {sorted(known)}")
    for name, value in values.items():
        if not _matches(value, hints[name]):
            quote = _matches(str(value), hints[name]) and not isinstance(value, (list, dict))
            hint = f" (quote it to mean the string: '\"{value}\"')" if quote else ""
            raise ValueError(f"{block}.{name} = {json.dumps(value)} is {_JSON_NAMES[type(value)]}: expected "
                             f"{_describe(hints[name])}{hint}")
        nested = [option for option in _options(hints[name]) if dataclasses.is_dataclass(option)]
        if nested and isinstance(value, dict):  # a block inside the block: model.moe
            check_field_types(nested[0], f"{block}.{name}", value)


def build_block(cls, block: str, values: dict[str, Any]):
    check_field_types(cls, block, values)
    return cls(**values)
