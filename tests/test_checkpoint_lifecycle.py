"""A months-long run keeps the checkpoints it needs: old ones pruned as keep_last / keep_every say, never the one
``latest`` names; a damaged latest checkpoint is caught by its record before anything is unpickled, and the run
stops naming the file, or falls back to the previous complete checkpoint and resumes from it exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.launch import final_weights, run_training, same_weights, trajectory
from training.checkpoint import RECORD, UNIVERSAL, prune, verify_alone


def fake_run(directory: Path, steps: list[int], latest: int, incomplete: tuple[int, ...] = ()) -> None:
    """global_stepN folders (with a record unless incomplete), a universal conversion of each, and ``latest``."""
    for step in steps:
        folder = directory / f"global_step{step}"
        folder.mkdir(parents=True)
        if step not in incomplete:
            (folder / RECORD).write_text(json.dumps({"tag": folder.name, "files": {}}))
        (directory / UNIVERSAL / folder.name).mkdir(parents=True)
    (directory / "latest").write_text(f"global_step{latest}")


def remaining(directory: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("global_step")) for p in directory.glob("global_step*"))


@pytest.mark.parametrize("keep_last, keep_every, latest, expected", [
    (None, None, 20, [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]),  # the default deletes nothing
    (3, None, 20, [16, 18, 20]),
    (3, 10, 20, [10, 16, 18, 20]),  # every 10th step kept for good
    (1, None, 20, [20]),
    # latest moved back (a fallback): the newer folders are not older than latest and stay; latest is kept
    (2, None, 14, [12, 14, 16, 18, 20]),
])
def test_prune_deletes_exactly_what_keep_last_and_keep_every_do_not_keep(tmp_path, keep_last, keep_every, latest,
                                                                         expected):
    fake_run(tmp_path, list(range(2, 22, 2)), latest)
    deleted = prune(tmp_path, keep_last, keep_every)
    assert remaining(tmp_path) == expected
    assert sorted(int(tag.removeprefix("global_step")) for tag in deleted) == \
        sorted(set(range(2, 22, 2)) - set(expected))
    kept_universal = sorted(int(p.name.removeprefix("global_step")) for p in (tmp_path / UNIVERSAL).iterdir())
    assert kept_universal == expected  # a conversion goes with its checkpoint


def test_incomplete_checkpoints_do_not_count_as_kept(tmp_path):
    fake_run(tmp_path, [2, 4, 6, 8], latest=8, incomplete=(6,))  # step 6 crashed while being written
    prune(tmp_path, keep_last=2, keep_every=None)
    assert remaining(tmp_path) == [4, 8]


def _copy(straight_run: Path, tmp_path: Path) -> Path:
    save = tmp_path / "checkpoints"
    shutil.copytree(straight_run, save, ignore=shutil.ignore_patterns("tensorboard", "metrics.jsonl"))
    return save


@pytest.mark.distributed
def test_a_corrupted_layer_file_stops_the_resume_naming_it(corpus, straight_run, tmp_path):
    save = _copy(straight_run, tmp_path)
    layer = save / "global_step12" / "layer_02-model_01-model_states.pt"
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, different content
    layer.write_bytes(bytes(data))
    assert verify_alone(save, "global_step12") == [f"{layer} does not match its CRC-32 in {RECORD} (corrupted)"]
    result = run_training(corpus, save, max_steps=14, expect_success=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"checkpoint {save / 'global_step12'} is damaged: {layer} does not match its CRC-32" in output
    assert f"the previous complete checkpoint is {save / 'global_step8'}" in output
    assert "training.fallback_on_corrupt_checkpoint=true" in output
    assert "Traceback" not in output  # stopped before DeepSpeed unpickled anything


@pytest.mark.distributed
def test_a_truncated_optimizer_file_falls_back_and_resumes_exactly(corpus, straight_run, tmp_path):
    """With the fallback the run resumes from global_step8 and trains 9-12 again: bitwise the straight run. It
    checkpoints step 12 once (the interval and the end of the run are the same step), and keep_last = 2 prunes 4."""
    save = _copy(straight_run, tmp_path)
    optimizer = save / "global_step12" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    result = run_training(corpus, save, max_steps=12,
                          extra=["training.fallback_on_corrupt_checkpoint=true", "training.keep_last=2"])
    output = result.stdout + result.stderr
    assert f"WARNING: checkpoint {save / 'global_step12'} is damaged: {optimizer} has 1,000 bytes" in output
    assert "Resuming from the previous complete checkpoint global_step8" in output
    assert trajectory(save)[-4:] == trajectory(straight_run)[-4:]  # steps 9-12: losses, lrs, batches, tokens
    assert same_weights(final_weights(save), final_weights(straight_run))
    assert output.count(f"saved checkpoint {save / 'global_step12'}") == 1
    assert remaining(save) == [8, 12] and "deleted checkpoint(s) global_step4" in output
