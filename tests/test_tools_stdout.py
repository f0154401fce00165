"""Tools print results, and only results, on stdout: `tool --json | python -c 'json.load(sys.stdin)'` works even when
DeepSpeed warns as it is imported (without DS_ACCELERATOR it logs that it falls back to the CPU, through a logger that
writes to stdout). The warning is not silenced: it goes to stderr (tools/streams.py).

Each tool runs as a subprocess, as a user runs it, with DS_ACCELERATOR removed from its environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

JSON_TOOLS = {  # tool -> (arguments that need no data and run in seconds, top-level keys its JSON must carry)
    "plan.py": (["--ds_config", "ds_configs/530b.json", "--nodes", "280", "--json"],
                {"schema_version", "config", "gpu", "assumptions", "deepspeed", "parameters", "compute_optimal", "plans"}),
}


def run_tool(tool: str, *args: str) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "DS_ACCELERATOR"}
    return subprocess.run([sys.executable, str(ROOT / "tools" / tool), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def deepspeed_warns_about_the_accelerator() -> bool:
    """Without DS_ACCELERATOR and without a GPU DeepSpeed picks the CPU and logs a warning as it is imported."""
    return not torch.cuda.is_available()


def test_every_tool_with_a_json_option_is_checked():
    """A tool that gains --json joins JSON_TOOLS, or this fails."""
    with_json = {path.name for path in (ROOT / "tools").glob("*.py") if '"--json"' in path.read_text()}
    assert with_json == set(JSON_TOOLS)


@pytest.mark.parametrize("tool", sorted(JSON_TOOLS))
def test_json_alone_on_stdout(tool):
    args, keys = JSON_TOOLS[tool]
    result = run_tool(tool, *args)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # the whole of stdout is one JSON document
    assert keys <= set(report)
    assert isinstance(report["schema_version"], int)  # every tool's JSON is a versioned interface
    if deepspeed_warns_about_the_accelerator():
        assert "Setting accelerator to CPU" in result.stderr  # moved, not silenced


def test_plan_table_alone_on_stdout():
    result = run_tool("plan.py", "--ds_config", "ds_configs/530b.json", "--nodes", "280")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ds_configs/530b.json: 105 layers")  # the first line is the plan's
    assert "[WARNING]" not in result.stdout and "real_accelerator" not in result.stdout
    assert result.stdout.rstrip().splitlines()[-1].split()[:3] == ["280", "2240", "8"]  # the comparison table
    if deepspeed_warns_about_the_accelerator():
        assert "Setting accelerator to CPU" in result.stderr
