"""The shape of the codebase: every import points down, no import cycle, no module outgrows a page of concerns, the
docs' links work.

The packages in layers, each importing only from layers below it (and from itself):

    0  common/                   the floor: DeepSpeed's private API behind one door, devices, atomic files
    1  data/                     indexed datasets, tokenizers, samples, blending, the loader
    2  model/                    the model, its parallel layers, its parameter and FLOP counts, the checkpoint files
    3  hf/                       Hugging Face conversion (and the config.json and tokenizer readers the run config uses)
    4  runconfig/                the run configuration: its blocks, --set overrides, the schedules' arithmetic
    5  planner/, evaluation/     planning a run; inference, generation, lm-evaluation-harness (they do not import each
                                 other)
    6  training/                 the loop, the engine, checkpoints, metrics
    7  lab/                      the stability lab: sweeps of short runs, LR sensitivity, the learning-rate projection
    8  tools/, train.py          command-line programs
    9  benchmarks/, scripts/, tests/      (these three may import each other: benchmarks use the tests' launcher)

No exception. Within a layer, modules import each other freely but never in a cycle (imports inside functions
count): a cycle means neither module is the lower floor.

`python -m pytest tests/test_structure.py -s` prints each package's line count and what it imports.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"common": 0, "data": 1, "model": 2, "hf": 3, "runconfig": 4, "planner": 5, "evaluation": 5, "training": 6,
          "lab": 7, "tools": 8, "train": 8, "benchmarks": 9, "scripts": 9, "tests": 9}
TOP = 9  # benchmarks and scripts may use the tests' launch helpers
MAX_MODULE_LINES = 600
MAX_MODEL_CONFIG_LINES = 400  # model/config/: room for the next architecture's fields in each concern


def package_files(package: str) -> list[Path]:
    if package == "train":
        return [ROOT / "train.py"]
    return sorted((ROOT / package).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """Absolute imports of project packages, at any depth (imports inside functions count too)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return {m for m in modules if m.split(".")[0] in LAYERS}


def project_modules() -> list[Path]:
    return [p for package in LAYERS for p in package_files(package)]


def test_every_import_points_down():
    upward, rows = [], []
    for package, layer in LAYERS.items():
        files = package_files(package)
        imports: dict[str, set[str]] = {}
        for path in files:
            for module in imported_modules(path):
                top = module.split(".")[0]
                if top == package:
                    continue
                imports.setdefault(top, set()).add(module)
                sideways = LAYERS[top] == layer < TOP
                if LAYERS[top] > layer or sideways:
                    upward.append(f"{path.relative_to(ROOT)} imports {module} (layer {LAYERS[top]}, not below {layer})")
        lines = sum(len(p.read_text().splitlines()) for p in files)
        name = "train.py" if package == "train" else package + "/"
        rows.append(f"{name:<12} layer {layer} {lines:>7,} lines  imports {', '.join(sorted(imports)) or '-'}")
    print("\n" + "\n".join(rows))
    assert upward == []


def test_the_rule_sees_an_upward_import(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from training.trainer import train\n    import hf.export\n")
    assert imported_modules(path) == {"training.trainer", "hf.export"}


def module_name(path: Path, root: Path = ROOT) -> str:
    """model/config/__init__.py -> model.config; train.py -> train."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(paths: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Each module's project modules: ``from a.b import c`` depends on a.b.c when that is a module, else on a.b."""
    names = {module_name(path, root): path for path in paths}
    graph = {}
    for name, path in names.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = {f"{node.module}.{alias.name}" for alias in node.names} & names.keys()
                edges |= found or ({node.module} & names.keys())
            elif isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names} & names.keys()
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    paths = [path for package in LAYERS for path in package_files(package) if package not in ("benchmarks", "scripts",
                                                                                               "tests")]
    assert cycles(import_graph(paths)) == []


def test_the_cycle_rule_sees_a_cycle(tmp_path):
    """A planted cycle through a function-level import, as data/packing.py and data/gpt_dataset.py had one."""
    package = tmp_path / "data"
    package.mkdir()
    (package / "gpt_dataset.py").write_text("from data.packing import PackedDataset\n")
    (package / "packing.py").write_text("def f():\n    from data.gpt_dataset import dataset_fingerprint\n")
    (package / "loader.py").write_text("import data.packing\n")
    graph = import_graph(sorted(package.glob("*.py")), tmp_path)
    assert cycles(graph) == [["data.gpt_dataset", "data.packing"]]


def test_the_model_configuration_has_room_per_concern():
    sizes = {path.name: len(path.read_text().splitlines()) for path in (ROOT / "model" / "config").glob("*.py")}
    print(f"\nmodel/config/: {sizes}")
    assert max(sizes.values()) <= MAX_MODEL_CONFIG_LINES, sizes


def test_no_module_outgrows_600_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in project_modules()}
    largest = max(sizes, key=sizes.get)
    print(f"\nlargest module: {largest}, {sizes[largest]} lines")
    assert sizes[largest] < MAX_MODULE_LINES, f"{largest} has {sizes[largest]} lines: split it by concern"


def rebound_globals(paths: list[Path]) -> list[str]:
    """Every ``global`` statement of ``paths``: a function rebinding module state, which every model of the process
    would then share."""
    return [f"{path.name}:{node.lineno} global {', '.join(node.names)}" for path in paths
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)]


def test_the_model_keeps_no_module_level_state():
    """model/ rebinds no module global: a micro-batch's state (the block mask, RoPE's table) is the model's, and a
    dynamic scope (a recompute running) a context variable."""
    assert rebound_globals(package_files("model")) == []


def test_the_module_state_rule_sees_a_global(tmp_path):
    planted = tmp_path / "attention.py"
    planted.write_text("_last = None\n\ndef remember(x):\n    global _last\n    _last = x\n")
    assert rebound_globals([planted]) == ["attention.py:4 global _last"]


# -------------------------------------------------------------------------------------------------- the docs' links


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(markdown: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", markdown.read_text(), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def relative_links(markdown: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown.read_text(), flags=re.S)
    links = [a or b for a, b in LINK.findall(text)]
    return [link for link in links if not re.match(r"[a-z]+:", link)]


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("markdown", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(markdown):
    broken = []
    for link in relative_links(markdown):
        target, _, anchor = link.partition("#")
        path = (markdown.parent / target).resolve() if target else markdown
        if not path.exists():
            broken.append(f"{link}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.name}")
    assert broken == []


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[ok](#title) [file](page.md#title) [gone](missing.md) [bad](#nowhere) "
                    "[web](https://example.com)\n```\n[not a link](inside/code.md)\n```\n")
    assert relative_links(page) == ["#title", "page.md#title", "missing.md", "#nowhere"]
    assert anchors(page) == {"title"}
    assert slug("The 530B plan at 280, 350, 420 and 560 nodes") == "the-530b-plan-at-280-350-420-and-560-nodes"
