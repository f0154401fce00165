"""Checkpoints that do not stop training (training/checkpoint_engine.py, training/checkpoint.py Checkpointer).

- The snapshot keeps views of one storage as views of one storage (torch.save writes what it would have written of
  the original), and a file's size and CRC-32 are counted as it is written, equal to the file's.
- A writer that fails names the file and leaves no temporary file.
- On 4 processes at TP 2 x PP 2, in fp32 (ZeRO-1) and in bf16 (BF16_Optimizer): after 2 steps, one checkpoint written
  "sync" and one "async" with a slow writer (0.3 s before each file), then 2 more steps while that writer is still
  busy, then its commit. Every file of the async checkpoint is byte-identical to the sync one's: the weights and
  optimizer state that changed after the save did not reach it (no torn snapshot); and a checkpoint saved after
  those steps differs from both (the comparison can fail). Both carry integrity records whose sizes and CRC-32s,
  counted by the writers, match the files.

Resuming from async checkpoints bitwise, a SIGKILL and a SIGTERM while the writer is busy, a full disk in the writer
and a spike rollback while a save is in flight are tests/test_faults.py's (async is the default mode).
"""

from __future__ import annotations

import errno
import zlib
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_model_parallel import deepspeed_config, micro_batches
from training.checkpoint_engine import SnapshotCheckpointEngine, host_snapshot, write_file


def test_the_snapshot_keeps_storage_sharing_and_values():
    base = torch.arange(12, dtype=torch.float32)
    state = {"whole": base, "view": base[2:8].view(2, 3), "nested": [base[::3], {"step": 5, "name": "x"}],
             "parameter": torch.nn.Parameter(torch.ones(3))}
    snapshot = host_snapshot(state)
    base += 100  # the training goes on
    assert torch.equal(snapshot["whole"], torch.arange(12, dtype=torch.float32))
    assert snapshot["view"].untyped_storage().data_ptr() == snapshot["whole"].untyped_storage().data_ptr()
    assert snapshot["nested"][0].stride() == (3,) and snapshot["nested"][1] == {"step": 5, "name": "x"}
    assert isinstance(snapshot["parameter"], torch.nn.Parameter)


def test_a_file_is_counted_as_it_is_written(tmp_path):
    state = {"a": torch.randn(1000), "b": [torch.arange(7)]}
    written = write_file(host_snapshot(state), tmp_path / "x.pt")
    data = (tmp_path / "x.pt").read_bytes()
    assert (written.bytes, written.crc32) == (len(data), zlib.crc32(data))
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["a"], state["a"])
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]  # the temporary name is gone


def test_a_failing_writer_names_the_file_and_leaves_no_temporary(tmp_path):
    engine = SnapshotCheckpointEngine("async", fail_on="global_step3")
    (tmp_path / "global_step3").mkdir()
    engine.save({"x": torch.zeros(2)}, str(tmp_path / "global_step3" / "layer_00-model_00-model_states.pt"))
    engine.start()
    written, error = engine.wait()
    engine.cleanup()
    assert written == [] and error.error.errno == errno.ENOSPC
    assert str(error) == f"{tmp_path / 'global_step3' / 'layer_00-model_00-model_states.pt'}: No space left on device"
    assert list((tmp_path / "global_step3").iterdir()) == []


def _save_sync_and_async(directory: str, precision: str) -> dict:
    """TP 2 x PP 2: 2 steps, a sync and a slow async checkpoint of that state, 2 more steps during the async write,
    its commit, and a third checkpoint of the later state."""
    import torch.distributed as dist

    from training.checkpoint import Checkpointer
    from training.config import parse_run_config
    from training.engine import build_engine

    raw = {**deepspeed_config(precision), "model": {"preset": "tiny", "num_layers": 4, "hidden_size": 64,
                                                     "num_attention_heads": 4, "seq_length": 16,
                                                     "precision": precision},
           "parallelism": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
           "schedule": {"lr": 3e-3, "warmup_tokens": 0, "decay_tokens": 1e6, "train_tokens": 1e6}}
    config = parse_run_config(raw)
    engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, 1234)

    def step(number: int) -> None:
        engine.train_batch(data_iter=micro_batches(number, 16, ctx.data_parallel_rank, ctx.data_parallel_size))

    for number in range(2):
        step(number)
    client = {"run_config": config.to_dict(), "train_state": {"step": 2}}
    Checkpointer(engine, Path(directory) / "sync", "sync").save(2, client)
    slow = Checkpointer(engine, Path(directory) / "async", "async", delay_s=0.3)
    slow.save(2, client)
    busy_after_save = slow.files.in_flight
    for number in range(2, 4):  # weights, master weights and Adam moments all change meanwhile
        step(number)
    busy_after_steps = slow.files.in_flight
    committed = slow.wait()
    Checkpointer(engine, Path(directory) / "later", "sync").save(2, client)
    dist.barrier()
    return {"busy": (busy_after_save, busy_after_steps), "committed": committed,
            "blocked_s": slow.files.blocked_s}


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_async_writes_the_bytes_of_sync_and_no_later_state(precision, tmp_path):
    import json

    ranks = run_distributed(4, _save_sync_and_async, str(tmp_path), precision)
    assert all(rank["busy"] == (True, True) for rank in ranks)  # the writer was still at it two steps later
    assert ranks[0]["committed"] == ("global_step2", [])
    folders = {name: tmp_path / name / "global_step2" for name in ("sync", "async", "later")}
    names = sorted(path.name for path in folders["sync"].iterdir())
    assert names == sorted(path.name for path in folders["async"].iterdir())
    assert any(name.startswith("layer_") for name in names) and any("optim_states" in name for name in names)
    for name in names:
        assert (folders["async"] / name).read_bytes() == (folders["sync"] / name).read_bytes(), name
    assert any((folders["later"] / name).read_bytes() != (folders["sync"] / name).read_bytes()
               for name in names if name != "checkpoint.json")  # the later state is another state
    for name in ("sync", "async"):
        assert (tmp_path / name / "latest").read_text() == "global_step2"
        record = json.loads((folders[name] / "checkpoint.json").read_text())
        assert set(record["files"]) == set(names) - {"checkpoint.json"}
        for file, entry in record["files"].items():
            data = (folders[name] / file).read_bytes()
            assert (entry["bytes"], entry["crc32"]) == (len(data), zlib.crc32(data)), file
