"""The one spawn helper of the test suite: run a function on N CPU processes joined by gloo.

``run_distributed(world_size, fn, *args)`` starts ``world_size`` processes (forked from a server that has imported
torch and DeepSpeed once, ``PRELOADED``; spawned where fork is not available), sets the variables a
launcher sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) plus OMP_NUM_THREADS=1, initialises torch.distributed
through DeepSpeed (gloo on CPU), calls ``fn(*args)`` on every rank, ends with a barrier and
``destroy_process_group()``, and returns the list of each rank's return value (anything torch.save can write).
A failure on any rank fails the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from common.net import free_port

DEFAULT_TIMEOUT_S = 600


def _fp16_unsupported_reason() -> str | None:
    """DeepSpeed's CPU accelerator offers fp16 only where the CPU computes it (AVX-512 FP16 or AMX); elsewhere
    deepspeed.initialize refuses an "fp16" config with "Type fp16 is not supported on your device"."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        return None
    return (f"fp16 is not supported by DeepSpeed's {get_accelerator().device_name()} accelerator on this CPU "
            f"(no AVX-512 FP16 / AMX); the overflow path it covers is tested in every precision by "
            f"test_non_finite_gradients_are_skipped_and_counted")


# The one place that decides whether the fp16 tests run here: skipped, with the reason, on CPUs without fp16.
FP16_UNSUPPORTED = _fp16_unsupported_reason()
requires_fp16 = pytest.mark.skipif(FP16_UNSUPPORTED is not None, reason=str(FP16_UNSUPPORTED))


def launcher_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


WRITERS = 4
"""Checkpoint writers each rank forks first thing: the engines a test builds and saves in one world (test_muon's
four) take them; a fifth spawns its own."""


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(launcher_environment(rank, world_size, port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from model.parallel import init_distributed
    from training.checkpoint_writer import WriterProcess

    WriterProcess.fork_early(WRITERS)  # as train.py does: the rank's engines save through them, no fresh interpreter

    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        init_distributed(timeout_minutes=5)
        result = fn(*args)
        dist.barrier()
        torch.save({"ok": True, "result": result}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is written: skip the interpreter's teardown (about a second per process)


# The ranks are forked from one server process that has imported torch, DeepSpeed (and torch._dynamo, which any
# optimizer imports) once for the whole session: each rank then starts in a fraction of a second instead of the 3-4 s
# of a fresh interpreter importing them (a 4-rank run on 2 cores: about 7 s less). Nothing runs in the server but
# the imports: no thread pool, no process group, no tensor; every rank sets its own environment (_worker).
PRELOADED = ["tests.preload"]


def _start_method() -> str:
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOADED)
    return "forkserver"


def start_context():
    """The multiprocessing context whose processes start from the warm server (tests/warm_launch.py's ranks too)."""
    return mp.get_context(_start_method())


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout_s: int = DEFAULT_TIMEOUT_S) -> list[Any]:
    """fn must be importable (a module-level function) so that the ranks can find it."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size,
                                     join=False, start_method=_start_method())
        errors = []
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=2):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"distributed run did not finish in {timeout_s} s")
        except Exception as exc:  # a rank died: report every rank's traceback that was saved
            errors.append(str(exc))
        results = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pt"
            if not path.exists():
                errors.append(f"rank {rank} wrote no result")
                continue
            saved = torch.load(path, weights_only=True)
            if not saved["ok"]:
                errors.append(f"rank {rank}:\n{saved['error']}")
            results.append(saved.get("result"))
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
