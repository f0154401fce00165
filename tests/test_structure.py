"""The shape of the codebase: every import points down, no module outgrows a page of concerns, the docs' links work.

The packages in layers, each importing only from layers below it (and from itself):

    0  common/                   the floor: DeepSpeed's private API behind one door, devices, atomic files
    1  data/                     indexed datasets, tokenizers, samples, blending, the loader
    2  model/                    the model, its parallel layers, its parameter and FLOP counts, the checkpoint files
    3  hf/, planner/             Hugging Face conversion; planning a run (they do not import each other)
    4  evaluation/               inference pipeline, generation, the lm-evaluation-harness model, its tasks
    5  training/                 the loop, the engine, checkpoints, schedules, metrics, the run config
    6  lab/                      the stability lab: sweeps of short runs, LR sensitivity, the learning-rate projection
    7  tools/, train.py          command-line programs
    8  benchmarks/, scripts/, tests/      (these three may import each other: benchmarks use the tests' launcher)

One exception, and why: planner/ reads the run configuration, training/config.py and the batch ramp that it builds
(training/schedules.py, pure arithmetic). Moving RunConfig below the planner would move the whole config; nothing in
the training loop imports the planner, so the arrow does not close a cycle.

`python -m pytest tests/test_structure.py -s` prints each package's line count and what it imports.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"common": 0, "data": 1, "model": 2, "hf": 3, "planner": 3, "evaluation": 4, "training": 5, "lab": 6,
          "tools": 7, "train": 7, "benchmarks": 8, "scripts": 8, "tests": 8}
TOP = 8  # benchmarks and scripts may use the tests' launch helpers
ALLOWED_UPWARD = {"planner": {"training.config", "training.schedules"}}
MAX_MODULE_LINES = 600


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
                if (LAYERS[top] > layer or sideways) and module not in ALLOWED_UPWARD.get(package, set()):
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


def test_no_module_outgrows_600_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in project_modules()}
    largest = max(sizes, key=sizes.get)
    print(f"\nlargest module: {largest}, {sizes[largest]} lines")
    assert sizes[largest] < MAX_MODULE_LINES, f"{largest} has {sizes[largest]} lines: split it by concern"


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
