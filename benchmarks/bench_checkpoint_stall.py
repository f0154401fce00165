#!/usr/bin/env python
"""How long a checkpoint stops training: "sync" against "async" (training/checkpoint_engine.py), side by side.

    python benchmarks/bench_checkpoint_stall.py [--hidden 512] [--layers 8] [--saves 3] [--directory DIR]

Two ranks (PP 2, fp32, ZeRO-1) train a GPT whose checkpoint is about 600 MB (--hidden, --layers; GPT-2's
vocabulary), writing to --directory (default: a temporary folder on the same disk as /tmp). For each mode, --saves
checkpoints, 8 steps apart; for each: the seconds save() blocks the training thread, the stall (the time of the save
call and the 5 steps after it, less 5 median steps), and the seconds from the save until ``latest`` names it. Each
rank's snapshot takes host memory equal to what it writes. Printed by rank 0, the median over the saves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def measure(directory: str, hidden: int, layers: int, saves: int) -> dict:
    import torch.distributed as dist

    from tests.test_model_parallel import deepspeed_config, micro_batches
    from training.checkpoint import Checkpointer
    from training.config import parse_run_config
    from training.engine import build_engine

    raw = {**deepspeed_config("fp32"), "model": {"preset": "tiny", "num_layers": layers, "hidden_size": hidden,
                                                  "num_attention_heads": hidden // 64, "seq_length": 64},
           "parallelism": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2},
           "schedule": {"lr": 3e-3, "warmup_tokens": 0, "decay_tokens": 1e6, "train_tokens": 1e9}}
    config = parse_run_config(raw)
    engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, 1234)
    counter = iter(range(10**9))

    def step() -> float:
        start = time.perf_counter()
        engine.train_batch(data_iter=micro_batches(next(counter), 64, 0, 1))
        return time.perf_counter() - start

    results = {}
    for mode in ("sync", "async"):
        save_dir = Path(directory) / mode
        checkpointer = Checkpointer(engine, save_dir, mode)
        plain = [step() for _ in range(5)]
        blocked, stalls, until_latest = [], [], []
        for number in range(saves):
            tag = f"global_step{1000 * (mode == 'async') + number + 1}"
            dist.barrier()
            start = time.perf_counter()
            checkpointer.save(int(tag.removeprefix("global_step")), {"train_state": {}})
            blocked.append(time.perf_counter() - start)
            timed = [blocked[-1]]
            moved = blocked[-1] if mode == "sync" else None  # sync commits inside save()
            for index in range(8):
                timed.append(step())
                if checkpointer.poll() is not None and moved is None:
                    moved = time.perf_counter() - start
                if index >= 5:
                    plain.append(timed[-1])
            if checkpointer.wait() is not None or moved is None:
                moved = time.perf_counter() - start
            median = statistics.median(plain)
            stalls.append(timed[0] + sum(timed[1:6]) - 5 * median)  # the save, and 5 steps over their median
            until_latest.append(moved)
        checkpointer.close()
        files = [p for p in (save_dir / tag).iterdir() if p.is_file()]
        results[mode] = {"blocked": statistics.median(blocked), "stall": statistics.median(stalls),
                         "latest": statistics.median(until_latest), "median_step": statistics.median(plain),
                         "bytes": sum(p.stat().st_size for p in files)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--directory", help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    from tests.distributed import run_distributed

    with tempfile.TemporaryDirectory(dir=args.directory) as directory:
        results = run_distributed(2, measure, directory, args.hidden, args.layers, args.saves, timeout_s=3600)[0]
    size = results["sync"]["bytes"]
    print(f"checkpoint of {size / 1e6:,.0f} MB on 2 ranks (PP 2, fp32, ZeRO-1); median step "
          f"{results['sync']['median_step']:.2f} s; the median of {args.saves} saves")
    print(f"{'mode':<6} {'save blocks, s':>15} {'stall (save step + 5), s':>25} {'until latest moves, s':>22}")
    for mode in ("sync", "async"):
        r = results[mode]
        print(f"{mode:<6} {r['blocked']:>15.2f} {r['stall']:>25.2f} {r['latest']:>22.2f}")
    ratio = results["async"]["stall"] / results["sync"]["stall"] if results["sync"]["stall"] > 0 else float("nan")
    print(f"async stall / sync stall: {ratio:.3f} (goal <= 0.1)")


if __name__ == "__main__":
    main()
