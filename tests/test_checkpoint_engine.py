"""Checkpoints that do not stop training (training/checkpoint_engine.py, training/checkpoint.py Checkpointer).

- The snapshot keeps views of one storage as views of one storage (torch.save writes what it would have written of
  the original), and a file's size and CRC-32 are counted as it is written, equal to the file's.
- The host buffers: the first save allocates one per storage of the state (exactly its bytes), the second allocates
  nothing and copies into the same storages (their data_ptr), a state that changed shape reallocates only what
  changed, and every save's files are byte-identical to files written from a fresh snapshot.
- The rehearsal before the first step allocates the buffers and writes nothing; the first save then allocates
  nothing. The files are written by the writer process (not the training process), an error there (a missing
  directory) comes back naming the file, and the writer ends at cleanup and when the training process is killed.
- A writer that fails names the file and leaves no temporary file (the fault of training/faults.py), and a slowed
  writer is still busy after the save.
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

import collections
import errno
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_model_parallel import deepspeed_config, micro_batches
from training.checkpoint_engine import SnapshotCheckpointEngine, host_snapshot, write_file
from training.faults import FaultPlan, hold_writes


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
    """MTNLG_FAULTS={"checkpoint_oserror": 3}: rank 0's writer fails at global_step3, rank 1's writes it."""
    outcomes, name = {}, "layer_00-model_00-model_states.pt"
    for rank in (0, 1):
        engine = SnapshotCheckpointEngine("async")
        FaultPlan(checkpoint_oserror=3).install_in_writer(engine, rank)
        (tmp_path / str(rank) / "global_step3").mkdir(parents=True)
        engine.save({"x": torch.zeros(2)}, str(tmp_path / str(rank) / "global_step3" / name))
        engine.start()
        outcomes[rank] = engine.wait()
        engine.cleanup()
    written, error = outcomes[0]
    assert written == [] and error.error.errno == errno.ENOSPC
    assert str(error) == f"{tmp_path / '0' / 'global_step3' / name}: No space left on device"
    assert list((tmp_path / "0" / "global_step3").iterdir()) == []
    assert outcomes[1][1] is None and [file.name for file in outcomes[1][0]] == [name]


def _state(weights: torch.Tensor) -> dict:
    """A DeepSpeed-like state: a flat buffer with views of it, a separate moment, a step and a name."""
    return {"module": {"a": weights[:6].view(2, 3), "b": weights[6:]}, "flat": weights,
            "optimizer": {"state": {0: {"exp_avg": weights * 2, "step": torch.tensor(3)}}}, "name": "x"}


def _save(engine: SnapshotCheckpointEngine, directory: Path, tag: str, state: dict) -> bytes:
    (directory / tag).mkdir(parents=True)
    engine.save(state, str(directory / tag / "model_states.pt"))
    engine.start()
    written, error = engine.wait()
    engine.forget()
    assert error is None and [file.name for file in written] == ["model_states.pt"]
    return (directory / tag / "model_states.pt").read_bytes()


def _buffer_pointers(engine: SnapshotCheckpointEngine) -> dict:
    return {place: buffer.data_ptr() for place, (buffer, _) in engine.buffers.storages.items()}


def test_host_buffers_are_allocated_at_the_first_save_and_reused(tmp_path):
    engine = SnapshotCheckpointEngine("async")
    weights = torch.arange(10, dtype=torch.float32)
    first = _save(engine, tmp_path, "global_step1", _state(weights))
    # weights (views "a" and "b" share it), exp_avg, step: 3 storages, 40 + 40 + 8 bytes
    assert (engine.buffers.allocations, engine.buffers.allocated_bytes) == (3, 88)
    pointers = _buffer_pointers(engine)
    assert len(set(pointers.values())) == 3
    weights += 1  # a step
    second = _save(engine, tmp_path, "global_step2", _state(weights))
    assert (engine.buffers.allocations, engine.buffers.allocated_bytes) == (3, 88)  # nothing more
    assert _buffer_pointers(engine) == pointers  # the same storages, copied into
    write_file(host_snapshot(_state(weights)), tmp_path / "fresh.pt")  # today's path: a new snapshot each time
    assert second == (tmp_path / "fresh.pt").read_bytes() != first

    grown = _state(torch.arange(12, dtype=torch.float32))  # the state changes shape: the flat buffer and exp_avg grow
    grown["optimizer"]["state"][1] = {"exp_avg": torch.ones(2)}  # and a new tensor appears
    third = _save(engine, tmp_path, "global_step3", grown)
    assert (engine.buffers.allocations, engine.buffers.allocated_bytes) == (3 + 3, 88 + 48 + 48 + 8)
    assert _buffer_pointers(engine)[("model_states.pt", "optimizer", "state", 0, "step")] == \
        pointers[("model_states.pt", "optimizer", "state", 0, "step")]  # unchanged: kept
    write_file(host_snapshot(grown), tmp_path / "fresh.pt")
    assert third == (tmp_path / "fresh.pt").read_bytes()
    assert len(engine.buffers.storages) == 4
    _save(engine, tmp_path, "global_step4", _state(weights))  # back: the new tensor's buffer is released
    assert (engine.buffers.allocations, len(engine.buffers.storages)) == (3 + 3 + 2, 3)
    engine.cleanup()


def test_the_buffers_are_not_overwritten_while_the_writer_reads_them(tmp_path):
    engine = SnapshotCheckpointEngine("async")
    gate = threading.Event()
    hold_writes(engine, gate)
    (tmp_path / "global_step1").mkdir()
    engine.save({"x": torch.zeros(4)}, str(tmp_path / "global_step1" / "a.pt"))
    engine.start()
    with pytest.raises(RuntimeError, match="global_step1 is still being written"):
        engine.save({"x": torch.ones(4)}, str(tmp_path / "global_step1" / "a.pt"))
    gate.set()
    written, error = engine.wait()
    engine.cleanup()
    assert error is None and torch.equal(torch.load(tmp_path / "global_step1" / "a.pt")["x"], torch.zeros(4))


def _save_sync_and_async(directory: str, precision: str) -> dict:
    """TP 2 x PP 2: 2 steps, a sync and a slow async checkpoint of that state, 2 more steps during the async write,
    its commit, and a third checkpoint of the later state, by a checkpointer rehearsed before and after the first
    step as the trainer does (its buffers allocated then: after the first step, and at its save, how many)."""
    import torch.distributed as dist

    from common.deepspeed_internals import replace_checkpoint_engine
    from runconfig.run import parse_run_config
    from training.checkpoint import Checkpointer
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

    client = {"run_config": config.to_dict(), "train_state": {"step": 2}}
    later = Checkpointer(engine, Path(directory) / "later", "sync")
    later.rehearse(client)  # as the trainer does: before the first step,
    allocated = [later.files.buffers.allocations]
    for number in range(2):
        step(number)
        if number == 0:  # and after it (fp32: ZeRO-1's torch Adam makes its moments at its first step)
            later.rehearse(client)
            allocated.append(later.files.buffers.allocations - allocated[0])
    Checkpointer(engine, Path(directory) / "sync", "sync").save(2, client)
    slow = Checkpointer(engine, Path(directory) / "async", "async")
    gate = threading.Event()
    hold_writes(slow.files, gate)  # the writer writes nothing until the two steps below have run
    slow.save(2, client)
    busy_after_save = slow.files.in_flight
    for number in range(2, 4):  # weights, master weights and Adam moments all change meanwhile
        step(number)
    busy_after_steps = slow.files.in_flight
    gate.set()
    committed = slow.wait()
    replace_checkpoint_engine(engine, later.files)  # DeepSpeed writes through the engine of the last one made
    before = later.files.buffers.allocations
    later.save(2, client)
    allocated.append(later.files.buffers.allocations - before)
    dist.barrier()
    return {"busy": (busy_after_save, busy_after_steps), "committed": committed,
            "blocked_s": slow.files.blocked_s, "allocated": allocated}


def test_the_rehearsal_allocates_the_buffers_and_writes_nothing(tmp_path):
    engine = SnapshotCheckpointEngine("async")
    weights = torch.arange(10, dtype=torch.float32)
    with engine.rehearsal():
        engine.makedirs(str(tmp_path / "rehearsal"), exist_ok=True)  # as DeepSpeed's save_checkpoint does
        engine.save(_state(weights), str(tmp_path / "rehearsal" / "model_states.pt"))
    assert list(tmp_path.iterdir()) == [] and engine.pending is None
    assert (engine.buffers.allocations, engine.buffers.allocated_bytes) == (3, 88)
    pointers = _buffer_pointers(engine)
    weights += 1
    first = _save(engine, tmp_path, "global_step1", _state(weights))
    assert (engine.buffers.allocations, _buffer_pointers(engine)) == (3, pointers)  # the first save: nothing new
    write_file(host_snapshot(_state(weights)), tmp_path / "fresh.pt")
    assert first == (tmp_path / "fresh.pt").read_bytes()
    engine.cleanup()


Held = collections.namedtuple("Held", "tensor")  # an object the snapshot deep-copies; the writer imports it by name


def test_the_writer_process_writes_the_bytes_of_the_training_process(tmp_path):
    """Parameters, empty tensors, views of one storage, a tensor inside another object (copied, not in
    the buffers) and a bf16 tensor: the writer's file equals torch.save of the snapshot in this process."""
    base = torch.arange(8, dtype=torch.float32)
    state = {"parameter": torch.nn.Parameter(torch.ones(2, 3)), "empty": torch.empty(0), "also_empty": torch.zeros(0, 4),
             "base": base, "view": base[2:6].view(2, 2), "bf16": torch.randn(5).to(torch.bfloat16),
             "object": Held(torch.ones(2)), "step": torch.tensor(7)}
    engine = SnapshotCheckpointEngine("async")
    written = _save(engine, tmp_path, "global_step1", state)
    engine.cleanup()
    write_file(host_snapshot(state), tmp_path / "fresh.pt")
    assert written == (tmp_path / "fresh.pt").read_bytes()


def test_the_writer_is_a_process_that_reports_its_errors_and_ends(tmp_path):
    engine = SnapshotCheckpointEngine("sync")
    assert engine.writer.process.pid != os.getpid()
    engine.save({"x": torch.ones(3)}, str(tmp_path / "missing" / "a.pt"))  # no directory: the writer's open fails
    engine.start()
    written, error = engine.wait()
    assert written == [] and error.error.errno == errno.ENOENT
    assert str(error) == f"{tmp_path / 'missing' / 'a.pt'}: No such file or directory"
    engine.forget()
    _save(engine, tmp_path, "global_step1", {"x": torch.ones(3)})
    assert engine.writer.cpu_seconds() > 0  # the writer's own CPU time, reported with each file
    engine.cleanup()
    assert engine.writer.process.exitcode == 0


def test_the_writer_ends_when_the_training_process_is_killed(tmp_path):
    script = ("import os, signal, sys, time; sys.path.insert(0, sys.argv[1])\n"
              "from training.checkpoint_engine import SnapshotCheckpointEngine\n"
              "engine = SnapshotCheckpointEngine('async'); engine.writer.share({})\n"
              "print(engine.writer.process.pid, flush=True); os.kill(os.getpid(), signal.SIGKILL)\n")
    result = subprocess.run([sys.executable, "-c", script, str(Path(__file__).resolve().parents[1])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    writer = int(result.stdout.split()[0])
    deadline = time.monotonic() + 60
    while _alive(writer) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(writer)


def test_the_writer_forked_at_start_up_skips_the_imports_outlives_signals_and_ends_at_exit(tmp_path):
    """train.py's start (WriterProcess.fork_early): the first engine takes the forked writer, which spends no CPU
    importing torch again (a spawned one spends 1-2 s: measured 1.8 s here); SIGINT and SIGTERM, which a Ctrl-C or a
    scheduler sends to every process of the job, leave it writing for the training process that answers them; an
    interpreter that exits with the engine still open ends it and does not hang."""
    script = ("import os, signal, sys; sys.path.insert(0, sys.argv[1])\n"
              "from training.checkpoint_writer import WriterProcess\n"
              "WriterProcess.fork_early(); early = WriterProcess._early[0].process.pid\n"
              "import torch\n"
              "from training.checkpoint_engine import SnapshotCheckpointEngine\n"
              "engine = SnapshotCheckpointEngine('sync')\n"
              "assert engine.writer.process.pid == early and WriterProcess._early == []\n"
              "for number in (signal.SIGINT, signal.SIGTERM): os.kill(early, number)\n"
              "engine.save({'x': torch.arange(4)}, sys.argv[2]); engine.start(); written, error = engine.wait()\n"
              "assert error is None and torch.load(sys.argv[2])['x'].tolist() == [0, 1, 2, 3], error\n"
              "print(early, engine.writer.cpu_seconds(), flush=True)\n")
    result = subprocess.run([sys.executable, "-c", script, str(Path(__file__).resolve().parents[1]),
                             str(tmp_path / "a.pt")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    writer, cpu_seconds = result.stdout.split()
    assert float(cpu_seconds) < 0.3
    assert not _alive(int(writer))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended: only its exit status waits for its (new) parent


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_async_writes_the_bytes_of_sync_and_no_later_state(precision, tmp_path):
    import json

    ranks = run_distributed(4, _save_sync_and_async, str(tmp_path), precision)
    assert all(rank["busy"] == (True, True) for rank in ranks)  # the writer was still at it two steps later
    # the rehearsals before and after the first step allocated every buffer (each rank writes files; after the first
    # step, fp32's Adam moments), the first save none
    assert all(rank["allocated"][0] > 0 and rank["allocated"][2] == 0 for rank in ranks), ranks
    assert all(rank["allocated"][1] > 0 for rank in ranks) if precision == "fp32" else True
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
