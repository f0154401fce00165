"""Shared fixtures: the tokenised shipped corpus and the uninterrupted reference runs (the launcher tests); the
recipe's run config and its parameter counts (the planner tests)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.memory import ParameterCounts, count_parameters
from runconfig.run import RunConfig, load_run_config
from tests.launch import preprocess_corpus, run_training

RECIPE = Path(__file__).resolve().parents[1] / "ds_configs" / "530b.json"


SUITE_DISK_GIB = 12
"""Free space the whole suite needs where pytest keeps its temporary folders: measured 8.8 GB at the peak of a full
run (checkpoints of the session's reference runs and of each test alive at once), with room to spare."""


def pytest_sessionstart(session) -> None:
    """A full disk fails hundreds of tests at once with errors that do not say so: say it first."""
    import shutil
    import tempfile

    if len(session.config.args) > 1 or not any(Path(arg).name == "tests" for arg in session.config.args):
        return  # a few tests chosen by hand need far less
    folder = Path(session.config.option.basetemp or tempfile.gettempdir())
    free = shutil.disk_usage(folder if folder.exists() else folder.parent).free / 2**30
    if free < SUITE_DISK_GIB:
        pytest.exit(f"{folder} has {free:.1f} GiB free; the whole suite writes up to about 9 GiB of checkpoints there "
                    f"(tests/conftest.py SUITE_DISK_GIB {SUITE_DISK_GIB}): free some space (old pytest-of-* folders), "
                    f"or point pytest elsewhere with --basetemp=DIR", returncode=4)


def pytest_collection_finish(session) -> None:
    """The modules every test imported live as long as the session: frozen out of the collector's sight, so that a
    test's gc.collect() (the memory measurements) walks what the tests made, not torch's and DeepSpeed's objects.
    And DeepSpeed's FusedAdam op, which tests/test_optimizer_rule.py compares, starts compiling now (about 57 s of
    CPU on a fresh checkout) at the lowest priority, on whatever core the tests before it leave idle."""
    gc.freeze()
    if any(item.path.name == "test_optimizer_rule.py" for item in session.items):
        _BACKGROUND.append(subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-c", COMPILE_FUSED_ADAM], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1]))


COMPILE_FUSED_ADAM = "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()"
"""What FusedAdam's constructor loads (deepspeed/ops/adam/fused_adam.py): torch's JIT build, under its file lock in
the extensions folder, so a test that asks for the op while this runs waits for it and loads what it built."""
_BACKGROUND: list[subprocess.Popen] = []


def pytest_sessionfinish(session, exitstatus) -> None:
    for process in _BACKGROUND:  # never killed: a build stopped midway leaves torch's lock file, and the next
        process.wait()             # session would wait on it for ever


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return preprocess_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def straight_run(corpus, tmp_path_factory):
    """12 steps without interruption (checkpoints at 4, 8, 12): the reference every fault test must reproduce. Ranks 0
    and 3 profile steps 5 and 6 (training.profile), which must change no number of it."""
    save = tmp_path_factory.mktemp("straight") / "checkpoints"
    result = run_training(corpus, save, extra=[f"training.profile={json.dumps(PROFILE, separators=(',', ':'))}"])
    (save.parent / "output.txt").write_text(result.stdout + result.stderr)
    return save


PROFILE = {"steps": [5, 6], "ranks": [0, 3]}


@pytest.fixture(scope="session")
def reshape_reference(corpus, tmp_path_factory):
    """TP 2 x PP 2 x DP 1, 4 layers, 10 steps, checkpoints at steps 6 and 10: the run tests/test_reshape.py resumes
    at other layouts and tests/test_dualpipev.py repeats and resumes under DualPipeV."""
    from tests.test_reshape import BASE, STEPS

    save = tmp_path_factory.mktemp("reference") / "checkpoints"
    run_training(corpus, save, STEPS, BASE)
    return save


@pytest.fixture(scope="session")
def recipe() -> RunConfig:
    """ds_configs/530b.json, the recipe."""
    return load_run_config(RECIPE)


@pytest.fixture(scope="session")
def parameters(recipe) -> ParameterCounts:
    """The recipe's parameters per stage, counted on the meta device (a few seconds: shared by the planner tests)."""
    return count_parameters(recipe)
