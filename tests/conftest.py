"""Fixtures shared by the launcher tests: the tokenised shipped corpus and one uninterrupted reference run."""

from __future__ import annotations

import pytest

from tests.launch import preprocess_corpus, run_training


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return preprocess_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def straight_run(corpus, tmp_path_factory):
    """12 steps without interruption (checkpoints at 4, 8, 12): the reference every fault test must reproduce."""
    save = tmp_path_factory.mktemp("straight") / "checkpoints"
    run_training(corpus, save)
    return save
