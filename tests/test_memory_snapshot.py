"""training.memory_snapshot (training/memory_snapshot.py): its config refused in one line naming the field, where and
when a snapshot goes, and what happens without CUDA (this machine). The CUDA recording and dumping itself runs in
scripts/gpu_smoke.sh (a snapshot of the 125m run at step 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runconfig.monitors import MemorySnapshotConfig
from runconfig.run import load_run_config
from tests.launch import OVERRIDES
from training.memory_snapshot import CPU_MESSAGE, MemoryMonitor, due, snapshot_path


def _load(value: str, save: bool = True):
    directory = '"runs/x"' if save else "null"
    return load_run_config("ds_configs/tiny-cpu.json", [*OVERRIDES, f"training.memory_snapshot={value}",
                                                        f"training.save={directory}", "training.save_interval=0"])


def test_a_good_block_and_its_defaults():
    config = _load('{"step": 3}').training
    from runconfig.monitors import snapshot_config

    assert snapshot_config(config) == MemorySnapshotConfig(step=3, on_oom=True, stacks="python", max_entries=100000)
    assert snapshot_config(_load("null").training) is None


@pytest.mark.parametrize("value, words", [
    ('{"step": 0}', "training.memory_snapshot.step must be a step >= 1"),
    ('{"step": 3, "stacks": "cpp"}', "training.memory_snapshot.stacks must be \"python\" or \"all\", got 'cpp'"),
    ('{"steps": 3}', "unknown key(s) ['steps'] in block \"training.memory_snapshot\""),
    ('{"step": "3"}', "training.memory_snapshot.step = \"3\" is a string"),
    ('{"step": 3, "max_entries": 0}', "training.memory_snapshot.max_entries must be >= 1"),
    ('{"on_oom": false}', "training.memory_snapshot has neither a step nor on_oom"),
    ('{"step": 3, "on_oom": "yes"}', "training.memory_snapshot.on_oom = \"yes\" is a string"),
    ("[3]", "training.memory_snapshot"),
])
def test_a_bad_block_is_refused_in_one_line_naming_the_field(value, words):
    with pytest.raises(ValueError) as error:
        _load(value)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_snapshots_need_a_save_directory():
    with pytest.raises(ValueError, match="training.memory_snapshot writes its snapshots beside the checkpoints"):
        _load('{"step": 3}', save=False)


def test_where_and_when_a_snapshot_goes():
    assert snapshot_path("runs/a", 3, 0) == Path("runs/a/memory/snapshot_step3_rank0.pickle")
    assert snapshot_path(Path("runs/a"), 17, 5, oom=True) == Path("runs/a/memory/snapshot_oom_step17_rank5.pickle")
    config = MemorySnapshotConfig(step=3)
    assert [step for step in range(1, 10) if due(config, step)] == [3]
    assert not any(due(MemorySnapshotConfig(step=None, on_oom=True), step) for step in range(1, 10))
    assert not due(None, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the behaviour without CUDA")
def test_without_cuda_one_line_and_nothing_recorded_or_dumped(tmp_path):
    said = []
    monitor = MemoryMonitor(MemorySnapshotConfig(step=1), str(tmp_path), 0, said.append)
    assert said == [CPU_MESSAGE] and monitor.config is None
    monitor.after_step(1)
    with pytest.raises(torch.OutOfMemoryError):  # an OOM still propagates, with nothing dumped
        with monitor.guard(2):
            raise torch.OutOfMemoryError("out of memory")
    assert monitor.window_peaks() == {"peak_memory_gib": None, "peak_memory_allocated_gib": None,
                                      "peak_memory_reserved_gib": None}
    monitor.close()
    assert not (tmp_path / "memory").exists()
    said.clear()
    MemoryMonitor(None, str(tmp_path), 0, said.append)
    assert said == []  # not asked: not said
