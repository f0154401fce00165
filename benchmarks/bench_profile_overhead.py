#!/usr/bin/env python
"""What ``training.profile`` costs the steps outside its window: the same run twice through train.py and the
launcher (tiny-cpu, TP 2 x PP 2, 4 CPU processes, tests/launch.py's overrides, --steps steps at the full batch of 16),
once plain and once profiling --window on ranks 0 and 3; each run's median step time outside the window (steps 2 and
after, the window and the step after it left out), and their ratio (goal: 1.0 within the run-to-run noise, which the
two plain halves of --rounds interleaved rounds show).

    python benchmarks/bench_profile_overhead.py [--steps 16] [--window 5 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def step_seconds(save: Path) -> dict[int, float]:
    """Each logged step's seconds, from its record (log_interval 1: the window is the step)."""
    from training.metrics_log import read_metrics

    return {r["step"]: r["global_batch"] * 32 / r["tokens_per_second"] for r in read_metrics(save / "metrics.jsonl")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--window", type=int, nargs=2, default=[5, 6])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from tests.launch import preprocess_corpus, run_training

    profile = {"steps": args.window, "ranks": [0, 3]}
    full_batch = ["schedule.batch.start=16", "training.save_interval=0"]
    outside = [s for s in range(2, args.steps + 1) if not args.window[0] <= s <= args.window[1] + 1]
    medians: dict[str, list[float]] = {"plain": [], "profiled": []}
    with tempfile.TemporaryDirectory() as directory:
        corpus = preprocess_corpus(Path(directory))
        for number in range(args.rounds):
            for kind in ("plain", "profiled"):
                save = Path(directory) / f"{kind}{number}"
                extra = full_batch + ([f"training.profile={json.dumps(profile)}"] if kind == "profiled" else [])
                run_training(corpus, save, max_steps=args.steps, extra=extra)
                seconds = step_seconds(save)
                medians[kind].append(statistics.median(seconds[s] for s in outside))
    print(f"profile overhead: tiny-cpu, TP 2 x PP 2, 4 processes, batch 16, {args.steps} steps, window "
          f"{args.window[0]}-{args.window[1]} on ranks 0 and 3; median step outside the window (steps {outside[0]}.."
          f"{outside[-1]} without {args.window[0]}-{args.window[1] + 1}), {args.rounds} interleaved rounds")
    for kind, values in medians.items():
        print(f"  {kind:<9} " + "  ".join(f"{value * 1e3:7.1f} ms" for value in values))
    ratio = statistics.median(medians["profiled"]) / statistics.median(medians["plain"])
    spread = max(medians["plain"]) / min(medians["plain"])
    print(f"profiled / plain: {ratio:.3f} (plain against plain, run to run: {spread:.3f})")


if __name__ == "__main__":
    main()
