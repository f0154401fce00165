#!/usr/bin/env python
"""train.py, then this rank's peak CUDA memory over the whole run, for scripts/gpu_smoke.sh (the trainer's log has the
peak of each log window: training/memory_snapshot.py).

    deepspeed --num_gpus 1 scripts/gpu_smoke_train.py --ds_config ds_configs/125m.json --set training.max_steps=30

Takes exactly train.py's arguments and exit status. After the run, each rank prints one line
    [memory] rank 0 | peak allocated 12.34 GiB | peak reserved 13.00 GiB | device NVIDIA H200
(torch.cuda.max_memory_allocated / max_memory_reserved over the whole run); on CPU it prints nothing.
With GPU_SMOKE_HOST_SYNCS=1 each rank also prints a line per step, its host synchronisations by owner
(scripts/gpu_smoke_syncs.py; torch.cuda.set_sync_debug_mode on CUDA, tests/host_syncs.py's audit on CPU):
    [host-syncs] rank 0 | step 5 | 9 syncs | model 0 | training 4 | deepspeed 5 | other 0 | model at: -
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: train.py and its packages

import train  # noqa: E402


def memory_line() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    gib = 2**30
    return (f"[memory] rank {os.environ.get('RANK', '0')} | peak allocated {torch.cuda.max_memory_allocated() / gib:.2f}"
            f" GiB | peak reserved {torch.cuda.max_memory_reserved() / gib:.2f} GiB | "
            f"device {torch.cuda.get_device_name()}")


def main(argv: list[str] | None = None) -> int:
    finish = None
    if os.environ.get("GPU_SMOKE_HOST_SYNCS") == "1":
        from gpu_smoke_syncs import count_steps  # beside this file

        finish = count_steps(int(os.environ.get("RANK", "0")))
    try:
        status = train.main(argv)
    finally:
        if finish is not None:
            finish()
    line = memory_line()
    if line:
        print(line, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
