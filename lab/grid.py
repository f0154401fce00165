"""The grid file of a sweep (lab/sweep.py): the axes, the run of each point, every run config checked first.

    key     example                                           what
    base    ds_configs/tiny-cpu.json                          the run config every run starts from
    set     {training.max_steps: 300, model.num_layers: 2}    --set overrides shared by every run
    grid    {schedule.lr: [1.0e-3, 1.0e-2],                   axes: a --set path and its values; a run is one point
             model.qk_layernorm: [false, true]}               of their cartesian product (the first axis slowest)
    data    PREFIX, or [[WEIGHT, PREFIX], ...]                optional: the runs' data.blend, the value train.py's
                                                              --data-path gives it (default: the base config's)

Values follow ``--set``: a YAML string that reads as JSON is that JSON value (``1e-3``, which YAML 1.1 leaves a
string, is the number 0.001). Paths in the file (``base``, ``data``, and those inside the base config) are relative
to the directory the sweep is started from, as they are for train.py, which runs there. A path names a field
(block.field, or a DeepSpeed key of the base config): a block alone, or training.save (the sweep's), is refused.

``plan_runs`` parses every point's run config with runconfig/run.py, checks its world (TP x PP x DP processes)
and its datasets before anything runs: an unknown field or an impossible combination stops the sweep with the
project's message, prefixed with the grid file and the point. A run's name is made of its axis values,
``lr=0.001,qk_layernorm=true`` (an axis's full path when two share a last part), with a short hash added when two
names would collide or one is longer than MAX_NAME_LENGTH.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lab.projection import non_embedding_parameters
from lab.results import LR_COLUMN
from runconfig.run import PROJECT_BLOCKS, load_run_config

LR_AXIS = LR_COLUMN  # the axis names its results.csv column
GRID_KEYS = ("base", "set", "grid", "data")
RESERVED_PATHS = {"training.save": "each run saves to DIR/runs/<name>"}
MAX_NAME_LENGTH = 100


class GridError(ValueError):
    """A grid file that cannot be run; the message names the file (and the line where YAML knows it)."""


# -------------------------------------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Grid:
    """A parsed grid file. ``settings`` and ``axes`` keep the file's order; values are normalised (``as_value``)."""

    path: Path
    base: str
    settings: dict[str, Any]
    axes: dict[str, list[Any]]
    data: list[list[Any]] | None = None

    def points(self) -> list[dict[str, Any]]:
        """The cartesian product of the axes, the first axis slowest: one dict {path: value} per run."""
        return [dict(zip(self.axes, values, strict=True)) for values in itertools.product(*self.axes.values())]

    def definition(self) -> dict[str, Any]:
        """What identifies the sweep (the file's path aside): stored in DIR/sweep.json."""
        return {"base": self.base, "set": self.settings, "grid": self.axes, "data": self.data}


def as_value(value: Any) -> Any:
    """A YAML value as --set reads it: a string that parses as JSON is that value, anything else is itself."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    if isinstance(value, list):
        return [as_value(item) for item in value]
    if isinstance(value, dict):
        return {key: as_value(item) for key, item in value.items()}
    return value


def _parse_yaml(path: Path) -> tuple[Any, yaml.Node | None]:
    """The document and its node tree (for line numbers), or a GridError naming the line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise GridError(f"grid file {path} does not exist") from None
    try:
        return yaml.safe_load(text), yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise GridError(f"{path}{where}: not valid YAML: {problem}") from None


def _mapping_items(node: yaml.Node | None) -> list[tuple[str, yaml.Node, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        return []
    return [(key.value, key, value) for key, value in node.value if isinstance(key, yaml.ScalarNode)]


def _where(path: Path, node: yaml.Node | None) -> str:
    return f"{path}, line {node.start_mark.line + 1}" if node is not None else str(path)


def _child(node: yaml.Node | None, key: str) -> yaml.Node | None:
    return next((value for name, _, value in _mapping_items(node) if name == key), None)


def _check_paths(path: Path, section: str, values: Any, node: yaml.Node | None) -> None:
    """``set`` and ``grid``: a mapping of distinct block.field paths, none of them the sweep's own."""
    if not isinstance(values, dict):
        raise GridError(f"{_where(path, node)}: \"{section}\" must be a mapping of block.field paths, got "
                        f"{type(values).__name__}: write e.g. {section}: {{schedule.lr: ...}}")
    seen = set()
    for name, key_node, _ in _mapping_items(node):
        if name in seen:
            raise GridError(f"{_where(path, key_node)}: {section}.{name} is given twice")
        seen.add(name)
    for name in values:
        key_node = next((k for n, k, _ in _mapping_items(node) if n == name), node)
        if not isinstance(name, str) or not all(name.split(".")):
            raise GridError(f"{_where(path, key_node)}: {section} key {name!r} is not a block.field path")
        if name in PROJECT_BLOCKS:
            raise GridError(f"{_where(path, key_node)}: {section}.{name} would replace the whole {name} block: name "
                            f"its fields, e.g. {name}.FIELD: VALUE")
        if name in RESERVED_PATHS:
            raise GridError(f"{_where(path, key_node)}: {section}.{name} is set by the sweep: "
                            f"{RESERVED_PATHS[name]}")


def load_grid(path: str | Path) -> Grid:
    """Read and check a grid file's shape (the run configs are checked by ``plan_runs``)."""
    path = Path(path)
    document, root = _parse_yaml(path)
    if not isinstance(document, dict):
        raise GridError(f"{path}: a grid file is a mapping with the keys {list(GRID_KEYS)}, got "
                        f"{type(document).__name__}")
    unknown = [key for key in document if key not in GRID_KEYS]
    if unknown:
        key_node = next((k for name, k, _ in _mapping_items(root) if name == unknown[0]), None)
        raise GridError(f"{_where(path, key_node)}: unknown key(s) {unknown}: a grid file has {list(GRID_KEYS)}")
    for key in ("base", "grid"):
        if key not in document:
            raise GridError(f"{path}: \"{key}\" is missing (base: the run config, grid: the axes)")
    if not isinstance(document["base"], str):
        raise GridError(f"{_where(path, _child(root, 'base'))}: \"base\" must be the path of a run config (JSON)")
    settings = document.get("set") or {}
    _check_paths(path, "set", settings, _child(root, "set"))
    _check_paths(path, "grid", document["grid"], _child(root, "grid"))
    axes = {}
    for name, values in document["grid"].items():
        where = _where(path, _child(_child(root, "grid"), name))
        if not isinstance(values, list) or not values:
            raise GridError(f"{where}: axis {name} must be a non-empty list of values, got {values!r}: write "
                            f"{name}: [{values!r}, ...]")
        values = as_value(values)
        repeated = [v for i, v in enumerate(values) if v in values[:i]]
        if repeated:
            raise GridError(f"{where}: axis {name} repeats {repeated}: each value is one run")
        if name in settings:
            raise GridError(f"{where}: {name} is both an axis and in \"set\": keep one")
        axes[name] = values
    return Grid(path, document["base"], as_value(settings), axes, _data_blend(path, document, root, settings))


def _data_blend(path: Path, document: dict[str, Any], root: yaml.Node | None,
                settings: dict[str, Any]) -> list[list[Any]] | None:
    """``data``: one prefix, or [[weight, prefix], ...] (checked by DataConfig with the rest of each run config)."""
    if "data" not in document:
        return None
    data, where = document["data"], _where(path, _child(root, "data"))
    if "data.blend" in settings or "data.blend" in document["grid"]:
        raise GridError(f"{where}: \"data\" and data.blend (in set or grid) both give the data: keep one")
    if isinstance(data, str):
        return [[1.0, data]]
    if isinstance(data, list) and data:
        return as_value(data)
    raise GridError(f"{where}: \"data\" must be a dataset prefix or a list of [weight, prefix] pairs, got {data!r}")


# --------------------------------------------------------------------------------------------------- the run plan


@dataclass(frozen=True)
class RunSpec:
    """One run of the sweep, checked."""

    name: str
    point: dict[str, Any]
    """{axis path: value}."""
    overrides: list[str]
    """train.py's --set items: the grid's set, the point, the data, training.save."""
    world_size: int
    """Processes: TP x PP x DP."""
    parameters: int
    """N, the model's non-embedding parameters (lab.projection.non_embedding_parameters: the blocks and the final
    norm, as Kaplan et al. count; tools/project_lr.py reads them from results.csv)."""
    max_steps: int | None


def format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:g}"
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def run_names(points: Sequence[dict[str, Any]]) -> list[str]:
    """Readable directory names from the axis values, a hash added where two collide or one is too long."""
    if not points or not points[0]:
        return ["base"] * len(points)
    paths = list(points[0])
    last = [p.split(".")[-1] for p in paths]
    labels = [leaf if last.count(leaf) == 1 else path for leaf, path in zip(last, paths, strict=True)]
    names = [",".join(f"{label}={format_value(point[path])}" for label, path in zip(labels, paths, strict=True))
             for point in points]
    names = [re.sub(r"[^A-Za-z0-9._=,+-]", "-", name) for name in names]
    return [name if names.count(name) == 1 and len(name) <= MAX_NAME_LENGTH
            else f"{name[:MAX_NAME_LENGTH - 9]}-{_short_hash(point)}" for name, point in zip(names, points, strict=True)]


def _short_hash(point: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(point, sort_keys=True).encode()).hexdigest()[:8]


def run_overrides(grid: Grid, point: dict[str, Any], run_dir: Path) -> list[str]:
    items = {**grid.settings, **point}
    if grid.data is not None:
        items["data.blend"] = grid.data
    items["training.save"] = str(run_dir)
    return [f"{path}={json.dumps(value)}" for path, value in items.items()]


def plan_runs(grid: Grid, output: str | Path, processes_per_run: int | None = None) -> list[RunSpec]:
    """Every point's run config parsed by runconfig/run.py, its world and its datasets checked; nothing runs."""
    if processes_per_run is not None and processes_per_run < 1:
        raise GridError(f"processes per run must be at least 1, got {processes_per_run}")
    base = read_base(grid)
    paths = [*grid.settings, *grid.axes]
    unknown = [p for p in paths if p.split(".")[0] not in PROJECT_BLOCKS and p.split(".")[0] not in base]
    if unknown:
        raise GridError(f"{grid.path}: {unknown[0]} is not a field of the run config: its first part must be a "
                        f"block ({', '.join(PROJECT_BLOCKS)}) or a DeepSpeed key of {grid.base} (a DeepSpeed key "
                        f"must be in the base config to be set)")
    points, specs, checked = grid.points(), [], set()
    for index, (name, point) in enumerate(zip(run_names(points), points, strict=True)):
        run_dir = Path(output).resolve() / "runs" / name
        overrides = run_overrides(grid, point, run_dir)
        label = ", ".join(f"{path}={format_value(value)}" for path, value in point.items())
        try:
            config = load_run_config(grid.base, overrides)
            tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
            world = processes_per_run or tp * pp
            config.check_world(world)
            blend = json.dumps(config.data.blend)
            if blend not in checked:
                from training.data import check_datasets  # imports torch: once the configs parse

                check_datasets(config)
                checked.add(blend)
        except ValueError as error:
            raise GridError(f"{grid.path}: run {index + 1} of {len(points)} ({label or 'the base'}): {error}") from None
        specs.append(RunSpec(name, point, overrides, world, non_embedding_parameters(config.model),
                             config.training.max_steps))
    return specs


def read_base(grid: Grid) -> dict[str, Any]:
    try:
        return json.loads(Path(grid.base).read_text())
    except FileNotFoundError:
        raise GridError(f"{grid.path}: base config {grid.base} does not exist (paths are relative to the directory "
                        f"the sweep runs in, {Path.cwd()})") from None
    except json.JSONDecodeError as error:
        raise GridError(f"{grid.path}: base config {grid.base} is not valid JSON (line {error.lineno}: "
                        f"{error.msg})") from None
