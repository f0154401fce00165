"""Where checkpoints are written and read.

A checkpoint is DeepSpeed's directory ``<save>/global_step<N>/`` (layer files per TP rank, model states, ZeRO-1
optimizer shards) plus ``rank_state_<R>.pt`` per global rank (both dropout RNG streams, spike-guard EWM), and the
training state (step, consumed samples and tokens, batch size) in DeepSpeed's client_state. Every one of these files
goes through the snapshot engine (training/checkpoint_engine.py): copied at the save into host buffers allocated
around the first step (``Checkpointer.rehearse``), written by a writer process (temporary name, fsync, size and
CRC-32 counted, rename). Then the commit, from the training loop:

    when                                   what                                                   who
    after every step (Checkpointer.poll)   one small all-reduce on a gloo group of its own: has   every rank
                                           every rank's writer finished, has any failed
    all finished, none failed              the files' sizes and CRC-32s gathered (no re-read),    rank 0
                                           <tag>/checkpoint.json (the layout and every file)
                                           written, then ``latest`` (each to a temporary name,
                                           fsynced, renamed), then old checkpoints pruned
    a writer failed                        nothing written; the failed checkpoint's directory     every rank
                                           removed; the run stops after this step, naming the
                                           file and the error
    the next save, a SIGTERM, the end,     wait for the writer, then the same commit (at most
    a spike rollback (Checkpointer.wait)   one checkpoint in flight)

``training.checkpoint_mode`` "sync" runs the same engine and waits at once. A crash before the commit leaves the
previous ``latest`` in place. On resume the record is checked, by all ranks, before DeepSpeed unpickles anything. A
checkpoint written at another layout is converted once by DeepSpeed's universal-checkpoint converter into
``<save>/universal/<tag>/`` and loaded from there (``load_universal``). Old checkpoints are deleted, by rank 0 and
after ``latest`` has moved, as ``training.keep_last`` / ``keep_every`` say.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common import deepspeed_internals as ds_internals
from common.device import HOST
from common.files import TEMPORARY_MARK, atomic_open, publish, write_text_atomically
from model.checkpoint_files import (
    LATEST,
    RECORD,
    UNIVERSAL,
    layer_file,
    rank_state_file,
    read_latest,
    tag_for_step,
    write_latest,
)
from model.random import RNGStream
from training.expert_checkpoint import restore_experts, save_expert_files

_TAG = re.compile(r"global_step(\d+)$")


def check_writable(directory: str | Path) -> None:
    """Fail at start-up, not at the first checkpoint, when the checkpoint directory cannot be written."""
    directory = Path(directory)
    probe = directory / f".write_probe_{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"training.save: cannot write checkpoints to {directory} ({error.strerror or error}): "
                         f"choose a writable directory with free space") from None


# -- layout and integrity record ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """The split that wrote a checkpoint (or that runs now)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    pipeline_schedule: str = "1f1b"
    """Which layers a pipeline rank holds, and so its optimizer-state files: DualPipeV's rank r holds stages r and
    2PP-1-r. The layer files are the same under both, but the ZeRO files are not: another schedule is another
    layout, reached through the universal checkpoint. Records written before the field read as "1f1b"."""
    expert_parallel_size: int = 1
    """Which experts a data-parallel rank holds, and so its experts' optimizer-state shards: another EP is another
    layout. Records written before the field read as 1."""

    def __str__(self) -> str:
        split = f"TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size} x DP {self.data_parallel_size}"
        split += f" (EP {self.expert_parallel_size})" if self.expert_parallel_size > 1 else ""
        return split if self.pipeline_schedule == "1f1b" else f"{split} (DualPipeV)"

    @classmethod
    def of_engine(cls, engine: Any) -> Layout:
        grid = engine.grid  # DeepSpeed's PipelineParallelGrid over this run's topology
        schedule = "dualpipev" if ds_internals.is_dualpipev_engine(engine) else "1f1b"
        return cls(grid.get_tensor_model_parallel_world_size(), grid.get_pipe_parallel_world_size(),
                   grid.get_data_parallel_world_size(), schedule, engine.module.expert_parallel_size)


def _crc32(path: Path, chunk_bytes: int = 16 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            crc = zlib.crc32(block, crc)
    return crc


def _my_share(names: list[str]) -> list[str]:
    """Files are checksummed by all ranks, a strided share each, so a 7 TB checkpoint is read once, in parallel."""
    return names[dist.get_rank()::dist.get_world_size()]


def write_record(directory: Path, tag: str, layout: Layout, files: dict[str, dict[str, int]]) -> None:
    """Rank 0, once every rank's files are written: <tag>/checkpoint.json with the layout and every file's size and
    CRC-32 (as the writers counted them; a file in the directory that no writer reported is read here)."""
    folder = directory / tag
    files = dict(files)
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != RECORD and path.name not in files and TEMPORARY_MARK not in path.name:
            files[path.name] = {"bytes": path.stat().st_size, "crc32": _crc32(path)}
    record = {"tag": tag, "layout": asdict(layout), "files": dict(sorted(files.items()))}
    with atomic_open(folder / RECORD, "w") as f:
        json.dump(record, f, indent=1)


def read_record(directory: str | Path, tag: str) -> dict[str, Any] | None:
    """The record of a checkpoint, or None for one written before records existed (or one never completed)."""
    path = Path(directory) / tag / RECORD
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return {"damaged": f"{path} is not valid JSON ({error})"}


def saved_layout(directory: str | Path, tag: str) -> Layout | None:
    record = read_record(directory, tag)
    return Layout(**record["layout"]) if record and "layout" in record else None


def _damage(directory: str | Path, tag: str, names: list[str] | None) -> list[str]:
    """What is wrong with the files ``names`` of a checkpoint (all of them when None) against its record."""
    folder = Path(directory) / tag
    record = read_record(directory, tag)
    if record is None:
        return []
    if "damaged" in record:
        return [record["damaged"]]
    problems = []
    for name in sorted(record["files"]) if names is None else names:
        expected, path = record["files"][name], folder / name
        if not path.exists():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != expected["bytes"]:
            problems.append(f"{path} has {path.stat().st_size:,} bytes, the record says {expected['bytes']:,} "
                            f"(truncated or overwritten)")
        elif _crc32(path) != expected["crc32"]:
            problems.append(f"{path} does not match its CRC-32 in {RECORD} (corrupted)")
    return problems


def verify_alone(directory: str | Path, tag: str) -> list[str]:
    """One process checks every file (tools)."""
    return _damage(directory, tag, None)


def find_damage(directory: str | Path, tag: str) -> list[str]:
    """Collective: what is wrong with a checkpoint's files against its record (empty: intact, or no record); each
    rank reads a share of the files."""
    record = read_record(directory, tag)
    if record is None or "damaged" in record:
        return _damage(directory, tag, None)
    problems = _damage(directory, tag, _my_share(sorted(record["files"])))
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, problems)
    return sorted(problem for share in gathered for problem in share)


def checkpoint_tags(directory: str | Path) -> list[str]:
    """global_stepN folders, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    tags = [path.name for path in directory.iterdir() if path.is_dir() and _TAG.match(path.name)]
    return sorted(tags, key=lambda tag: int(_TAG.match(tag).group(1)))


def choose_checkpoint(directory: str | Path, fallback: bool, log: Callable[[str], None] = print) -> str | None:
    """Collective: the checkpoint to resume from, checked against its record before anything is unpickled.

    A damaged ``latest`` stops the run naming the damage and the previous complete checkpoint, or, with ``fallback``
    (training.fallback_on_corrupt_checkpoint), resumes from that one and says so."""
    latest = read_latest(directory)
    if latest is None:
        return None
    damage = find_damage(directory, latest)
    if not damage:
        return latest
    earlier = [tag for tag in checkpoint_tags(directory) if _step(tag) < _step(latest)]
    previous = next((tag for tag in reversed(earlier) if read_record(directory, tag) is not None
                     and not find_damage(directory, tag)), None)
    what = f"checkpoint {Path(directory) / latest} is damaged: " + "; ".join(damage)
    if fallback and previous:
        log(f"WARNING: {what}. Resuming from the previous complete checkpoint {previous} instead "
            f"(training.fallback_on_corrupt_checkpoint); the steps after it are trained again")
        return previous
    advice = (f"the previous complete checkpoint is {Path(directory) / previous}: set "
              f"training.fallback_on_corrupt_checkpoint=true to resume from it, or restore the files"
              if previous else "no earlier complete checkpoint exists: restore the files")
    raise ValueError(f"{what}. {advice}")


def _step(tag: str) -> int:
    return int(_TAG.match(tag).group(1))


def prune(directory: str | Path, keep_last: int | None, keep_every: int | None) -> list[str]:
    """Rank 0, after ``latest`` has moved: delete checkpoints older than ``latest`` except the newest ``keep_last``
    complete ones and every ``keep_every``-th step. None keeps everything. Returns the deleted tags."""
    if keep_last is None:
        return []
    directory = Path(directory)
    latest = read_latest(directory)
    tags = [tag for tag in checkpoint_tags(directory) if _step(tag) <= _step(latest)]
    complete = [tag for tag in tags if read_record(directory, tag) is not None]
    kept = set(complete[-keep_last:]) | {latest}
    kept |= {tag for tag in tags if keep_every and _step(tag) % keep_every == 0}
    deleted = [tag for tag in tags if tag not in kept]
    for tag in deleted:
        shutil.rmtree(directory / tag, ignore_errors=True)
        shutil.rmtree(directory / UNIVERSAL / tag, ignore_errors=True)
    return deleted


# -- another layout: DeepSpeed's universal checkpoint ---------------------------------------------------------------
def convert_to_universal(directory: str | Path, tag: str, workers: int = 2, show_progress: bool = False) -> Path:
    """DeepSpeed's converter, strict, into ``<save>/universal/<tag>`` (written under a temporary name and renamed,
    so an interrupted conversion is never taken for a finished one). Reuses a finished conversion. With
    ``show_progress`` the converter's own log and progress bars go to stderr as it runs."""
    directory = Path(directory)
    output = directory / UNIVERSAL / tag
    if output.is_dir():
        return output
    temporary = directory / UNIVERSAL / f".{tag}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "training.universal_conversion", "--input", str(directory / tag),
               "--output", str(temporary), "--workers", str(workers)]
    if show_progress:
        result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, text=True)
        log = "(see its output above)"
    else:
        result = subprocess.run(command, capture_output=True, text=True)
        log = (result.stdout + result.stderr)[-3000:]
    if result.returncode != 0:
        shutil.rmtree(temporary, ignore_errors=True)
        raise ValueError(f"DeepSpeed's universal-checkpoint converter failed on {directory / tag}:\n{log}")
    publish(temporary, output)
    # the converter wrote the temporary name there
    write_text_atomically(directory / UNIVERSAL / "latest_universal", tag)
    return output


def wait_for_universal(directory: str | Path, tag: str, timeout_s: float) -> Path:
    """Ranks other than 0 wait, bounded, for rank 0's conversion."""
    output = Path(directory) / UNIVERSAL / tag
    deadline = time.monotonic() + timeout_s
    while not output.is_dir():
        if time.monotonic() > deadline:
            raise ValueError(f"{output} did not appear within {timeout_s:g} s: rank 0 converts the checkpoint to the "
                             f"new layout; see its log, or convert ahead of time with tools/reshape_checkpoint.py "
                             f"(training.reshape_timeout_s sets this limit)")
        time.sleep(1.0)
    return output


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from, and how: directly, or through its universal conversion."""

    directory: str
    tag: str
    written_at: Layout | None
    now: Layout

    @property
    def reshaped(self) -> bool:
        return self.written_at is not None and self.written_at != self.now

    def describe(self) -> str:
        written = f"written at {self.written_at}" if self.written_at else "(no layout record)"
        return f"resumed {self.tag} {written}; now {self.now}"


def prepare_resume(directory: str | Path, now: Layout, fallback: bool, timeout_s: float,
                   log: Callable[[str], None] = print) -> ResumePoint | None:
    """Collective, before the engine is built: pick and check the checkpoint; if another layout wrote it, make sure
    its universal conversion exists (rank 0 converts, the others wait). The engine then needs load_universal."""
    tag = choose_checkpoint(directory, fallback, log)
    if tag is None:
        return None
    point = ResumePoint(str(directory), tag, saved_layout(directory, tag), now)
    if point.reshaped:
        if dist.get_rank() == 0:
            log(f"{point.tag} was written at {point.written_at}; this run is {now}: converting it with DeepSpeed's "
                f"universal-checkpoint converter into {Path(directory) / UNIVERSAL / tag}")
            convert_to_universal(directory, tag)
        else:
            wait_for_universal(directory, tag, timeout_s)
    return point


def rng_state(tensor_parallel_rng: RNGStream) -> dict[str, Any]:
    """Both dropout streams of this rank (model/random.py): torch's default generators and the model's
    tensor-parallel stream."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    state["tensor_parallel"] = tensor_parallel_rng.state_dict()
    return state


def set_rng_state(state: dict[str, Any], tensor_parallel_rng: RNGStream) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tensor_parallel" in state:  # absent from checkpoints written before the stream existed: it keeps its seed
        tensor_parallel_rng.load_state_dict(state["tensor_parallel"])


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed; ``latest`` still names the previous complete one."""


@dataclass
class _InFlight:
    tag: str
    layout: Layout
    previous: str | None
    """``latest`` when the save began: what it still names if this checkpoint fails."""
    before_commit: Callable[[], None] | None


class Checkpointer:
    """Writes checkpoints through the snapshot engine and commits them (the module docstring's table). Collective:
    every rank makes the same calls in the same order."""

    def __init__(self, engine: Any, directory: str | Path, mode: str = "async",
                 keep: tuple[int | None, int | None] = (None, None)) -> None:
        from training.checkpoint_engine import SnapshotCheckpointEngine

        self.engine, self.directory, self.keep = engine, Path(directory), keep
        zipfile = ds_internals.checkpoint_zipfile_serialization(engine)
        self.files = SnapshotCheckpointEngine(mode, zipfile)
        ds_internals.replace_checkpoint_engine(engine, self.files)  # every file DeepSpeed writes, layer files too
        self.group = dist.new_group(backend="gloo")  # the commit's agreement: on CPU, apart from NCCL's streams
        self.in_flight: _InFlight | None = None

    @property
    def mode(self) -> str:
        return self.files.mode

    def save(self, step: int, client_state: dict[str, Any], rank_state: dict[str, Any] | None = None,
             before_commit: Callable[[], None] | None = None) -> list[tuple[str, list[str]]]:
        """Snapshot this step's checkpoint and hand it to the writer, the previous one committed first; with "sync",
        wait for this one and commit it too. Returns what was committed: (tag, deleted tags) each."""
        committed = [self.wait()]
        tag = tag_for_step(step)
        self.in_flight = _InFlight(tag, Layout.of_engine(self.engine), read_latest(self.directory), before_commit)
        self._snapshot(tag, client_state, rank_state)
        self.files.start()
        if self.mode == "sync":
            committed.append(self.wait())
        return [entry for entry in committed if entry is not None]

    def rehearse(self, client_state: dict[str, Any], rank_state: dict[str, Any] | None = None) -> None:
        """Collective, before the first step and after it (an optimizer makes its state, Adam's moments, at its
        first step): a save of this state that only allocates the host buffers and hands them to the writer
        process, so that the first real save allocates nothing. Nothing is copied, no checkpoint directory made;
        DeepSpeed's rank 0 copies its recovery scripts (zero_to_fp32.py) into the save directory, as every save
        does."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.files.rehearsal():
            self._snapshot("rehearsal", client_state, rank_state)  # no directory is made, nothing written

    def _snapshot(self, tag: str, client_state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
        """Every file of this rank's checkpoint, DeepSpeed's and the project's, into the engine's host buffers."""
        with ds_internals.own_expert_checkpoints(self.engine):
            self.engine.save_checkpoint(str(self.directory), tag=tag, client_state=client_state, save_latest=False)
        save_expert_files(self.engine.module, self.directory / tag, _tensor_parallel_rank(self.engine),
                          self.engine.module.expert_parallel_size, self.files.save)
        self.files.save({"rng": rng_state(self.engine.module.tensor_parallel_rng), **(rank_state or {})},
                        str(rank_state_file(self.directory / tag, dist.get_rank())))

    def poll(self) -> tuple[str, list[str]] | None:
        """After a step: commit the checkpoint in flight if every rank's writer has finished (one small all-reduce);
        returns (tag, deleted tags) when it committed. A failed writer raises CheckpointWriteError on every rank."""
        if self.in_flight is None:
            return None
        status = torch.tensor([0.0 if self.files.finished else 1.0], device=HOST)  # host: reduced on the gloo group
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.group)
        return None if status.item() else self._commit()

    def wait(self) -> tuple[str, list[str]] | None:
        """Wait for the checkpoint in flight and commit it (or raise CheckpointWriteError)."""
        if self.in_flight is None:
            return None
        self.files.wait()
        return self._commit()

    def _commit(self) -> tuple[str, list[str]]:
        point, (written, error) = self.in_flight, self.files.wait()
        self.in_flight = None
        self.files.forget()
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, str(error) if error else None, group=self.group)
        failures = [message for message in errors if message]
        if failures:
            if dist.get_rank() == 0:
                shutil.rmtree(self.directory / point.tag, ignore_errors=True)
            dist.barrier(group=self.group)
            raise CheckpointWriteError(
                f"could not write checkpoint {self.directory / point.tag}: {failures[0]}. {LATEST} still names "
                f"{point.previous or 'no checkpoint'}; free space or fix the mount, then relaunch to resume from it")
        if point.before_commit:
            point.before_commit()
        shares: list[list] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(shares, [(f.name, f.bytes, f.crc32) for f in written], group=self.group)
        deleted = []
        if dist.get_rank() == 0:
            files = {name: {"bytes": size, "crc32": crc} for share in shares for name, size, crc in share}
            write_record(self.directory, point.tag, point.layout, files)
            write_latest(self.directory, point.tag)
            deleted = prune(self.directory, *self.keep)
        dist.barrier(group=self.group)
        return point.tag, deleted

    def close(self) -> None:
        self.files.cleanup()


def save_checkpoint(engine: Any, directory: str | Path, step: int, client_state: dict[str, Any],
                    rank_state: dict[str, Any] | None = None, before_commit: Callable[[], None] | None = None,
                    keep: tuple[int | None, int | None] = (None, None)) -> tuple[str, list[str]]:
    """Collective: one checkpoint written and committed before returning (the snapshot engine in "sync" mode).
    Returns the tag and the tags deleted by ``keep`` = (keep_last, keep_every)."""
    checkpointer = Checkpointer(engine, directory, "sync", keep)
    try:
        return checkpointer.save(step, client_state, rank_state, before_commit)[-1]
    finally:
        checkpointer.close()


def load_weights(engine: Any, directory: str | Path) -> int:
    """Only the model weights of the latest checkpoint in ``directory``; returns the tokens that checkpoint had seen
    (0 when it does not say)."""
    tag = read_latest(directory)
    if tag is None:
        raise ValueError(f"{directory} holds no checkpoint (no {LATEST} file): give a checkpoint directory, e.g. the "
                         f"--output of tools/convert_from_hf.py")
    with ds_internals.own_expert_checkpoints(engine):
        load_path, client_state = engine.load_checkpoint(str(directory), tag=tag, load_module_only=True,
                                                         load_optimizer_states=False, load_lr_scheduler_states=False)
    if load_path is None:
        raise ValueError(f"DeepSpeed could not load the weights of {Path(directory) / tag}")
    if restore_experts(engine.module, Path(directory) / tag, _tensor_parallel_rank(engine)):
        ds_internals.refresh_master_weights(engine)
    return int((client_state or {}).get("train_state", {}).get("consumed_tokens", 0))


def _tensor_parallel_rank(engine: Any) -> int:
    return engine.grid.get_tensor_model_parallel_rank()


def restore_buffers(module: Any, tag_directory: Path) -> None:
    """The persistent buffers of this stage's layers (the aux-loss-free routers' bias, model/moe.py), from the layer
    files of the checkpoint itself: the universal conversion carries parameters and their optimizer states only.
    They are replicated over TP, so TP rank 0's file holds each whole, whatever the TP of either layout."""
    for index in ds_internals.stage_layer_indices(module):
        try:
            layer = ds_internals.stage_layer(module, index)
        except KeyError:  # a function or a tied layer: no buffers of its own
            continue
        names = [name for name, _ in layer.named_buffers() if name in layer.state_dict()]  # persistent ones
        if names:
            saved = torch.load(layer_file(tag_directory, index, 0), weights_only=True)
            for name in names:
                layer.get_buffer(name).copy_(saved[name])


def load_checkpoint(engine: Any, directory: str | Path, point: ResumePoint | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Load a complete checkpoint into the engine (``point``, else ``latest``); return (client_state, this rank's
    state), or None when there is none.

    A reshaped point loads the universal conversion: DeepSpeed slices every fp32 master weight and Adam moment for
    this rank and copies the weights into the model. The rank states (RNG streams, spike-guard EWM) belong to ranks of
    the old layout and are not used then: the streams keep the seeds of this rank, the EWM restarts.
    DeepSpeed reads its own files with torch.load(weights_only=False) (its optimizer states hold Python objects);
    the files this project adds are read with weights_only=True.
    """
    tag = point.tag if point else read_latest(directory)
    if tag is None:
        return None
    if point and point.reshaped:
        load_path, client_state = engine.load_checkpoint(str(Path(directory) / UNIVERSAL), tag=tag,
                                                         load_optimizer_states=True, load_lr_scheduler_states=False)
        ds_internals.stop_loading_universal(engine)  # later loads (a spike rollback) read this run's own format
        if load_path is None:
            raise ValueError(f"DeepSpeed could not load the universal checkpoint {Path(directory) / UNIVERSAL / tag}")
        restore_buffers(engine.module, Path(directory) / tag)
        return client_state, {}
    with ds_internals.own_expert_checkpoints(engine):
        load_path, client_state = engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                                         load_lr_scheduler_states=False)
    if load_path is None:
        raise ValueError(f"DeepSpeed could not load checkpoint {Path(directory) / tag}")
    restore_experts(engine.module, Path(directory) / tag, _tensor_parallel_rank(engine))
    rank_file = rank_state_file(Path(directory) / tag, dist.get_rank())
    if not rank_file.exists():
        raise ValueError(f"{rank_file} is missing: the checkpoint is incomplete (written by a different number of "
                         f"processes without a layout record); restore the file")
    rank_state = torch.load(rank_file, weights_only=True)
    set_rng_state(rank_state.pop("rng"), engine.module.tensor_parallel_rng)
    return client_state, rank_state
