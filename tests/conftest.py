"""Shared fixtures: the tokenised shipped corpus and the uninterrupted reference runs (the launcher tests); the
recipe's run config and its parameter counts (the planner tests)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from planner.memory import ParameterCounts, count_parameters
from runconfig.run import RunConfig, load_run_config
from tests.launch import preprocess_corpus, run_training

RECIPE = Path(__file__).resolve().parents[1] / "ds_configs" / "530b.json"


def pytest_collection_finish(session) -> None:
    """The modules every test imported live as long as the session: frozen out of the collector's sight, so that a
    test's gc.collect() (the memory measurements) walks what the tests made, not torch's and DeepSpeed's objects."""
    gc.freeze()


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
