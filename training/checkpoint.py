"""Where checkpoints are written and read.

A checkpoint is DeepSpeed's directory ``<save>/global_step<N>/`` (layer files per TP rank, model states, ZeRO-1
optimizer shards) plus ``rank_state_<R>.pt`` per global rank (both dropout RNG streams, spike-guard window), and the
training state (step, consumed samples and tokens, batch size) in DeepSpeed's client_state. ``<save>/latest`` names
the newest COMPLETE checkpoint: it is written by rank 0 only after every rank has finished writing (a barrier), to a
temporary file, fsynced, and renamed over the old one. A crash while writing leaves the previous ``latest`` in place.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from model.random import RNGStream

LATEST = "latest"


def tag_for_step(step: int) -> str:
    return f"global_step{step}"


def read_latest(directory: str | Path) -> str | None:
    path = Path(directory) / LATEST
    if not path.exists():
        return None
    tag = path.read_text().strip()
    if not tag or not (Path(directory) / tag).is_dir():
        raise ValueError(f"{path} names checkpoint {tag!r}, which does not exist in {directory}: restore that "
                         f"directory or point {LATEST} at a complete checkpoint")
    return tag


def write_latest(directory: str | Path, tag: str) -> None:
    """Atomically point ``latest`` at ``tag``."""
    directory = Path(directory)
    temporary = directory / f".{LATEST}.tmp"
    with open(temporary, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, directory / LATEST)
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _rank_state_file(directory: Path, tag: str, rank: int) -> Path:
    return directory / tag / f"rank_state_{rank}.pt"


def save_checkpoint(engine: Any, directory: str | Path, step: int, client_state: dict[str, Any],
                    rank_state: dict[str, Any] | None = None, before_commit: Callable[[], None] | None = None) -> str:
    """Collective: every rank writes its shards and its own state (RNG, guards); ``latest`` moves only once all have
    finished. A failure to write (full disk, lost mount) raises CheckpointWriteError naming the previous checkpoint;
    the failing rank exits and the launcher ends the job, so no rank waits forever at the barrier."""
    directory = Path(directory)
    tag = tag_for_step(step)
    previous = read_latest(directory)
    try:
        engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
        torch.save({"rng": rng_state(engine.module.tensor_parallel_rng), **(rank_state or {})},
                   _rank_state_file(directory, tag, dist.get_rank()))
        if before_commit:
            before_commit()
    except OSError as error:
        raise CheckpointWriteError(
            f"rank {dist.get_rank()} could not write checkpoint {directory / tag}: {error.strerror or error}. "
            f"{LATEST} still names {previous or 'no checkpoint'}; free space or fix the mount, then relaunch to resume "
            f"from it (the partial {tag} directory is overwritten by the next save of that step)") from error
    dist.barrier()
    if dist.get_rank() == 0:
        write_latest(directory, tag)
    dist.barrier()
    return tag


def load_weights(engine: Any, directory: str | Path) -> int:
    """Only the model weights of the latest checkpoint in ``directory``; returns the tokens that checkpoint had seen
    (0 when it does not say)."""
    tag = read_latest(directory)
    if tag is None:
        raise ValueError(f"{directory} holds no checkpoint (no {LATEST} file): give a checkpoint directory, e.g. the "
                         f"--output of tools/convert_from_hf.py")
    load_path, client_state = engine.load_checkpoint(str(directory), tag=tag, load_module_only=True,
                                                     load_optimizer_states=False, load_lr_scheduler_states=False)
    if load_path is None:
        raise ValueError(f"DeepSpeed could not load the weights of {Path(directory) / tag}")
    return int((client_state or {}).get("train_state", {}).get("consumed_tokens", 0))


def load_checkpoint(engine: Any, directory: str | Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Load the latest complete checkpoint into the engine; return (client_state, this rank's state), or None.

    DeepSpeed reads its own files with torch.load(weights_only=False) (its optimizer states hold Python objects);
    the files this project adds are read with weights_only=True.
    """
    tag = read_latest(directory)
    if tag is None:
        return None
    load_path, client_state = engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                                     load_lr_scheduler_states=False)
    if load_path is None:
        raise ValueError(f"DeepSpeed could not load checkpoint {Path(directory) / tag}")
    rank_file = _rank_state_file(Path(directory), tag, dist.get_rank())
    if not rank_file.exists():
        raise ValueError(f"{rank_file} is missing: the checkpoint was written by a different number of processes "
                         f"or is incomplete; relaunch with the same world size, or restore the file")
    rank_state = torch.load(rank_file, weights_only=True)
    set_rng_state(rank_state.pop("rng"), engine.module.tensor_parallel_rng)
    return client_state, rank_state
