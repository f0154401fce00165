#!/usr/bin/env python
"""Conversion time and peak memory of DeepSpeed's universal-checkpoint converter, against checkpoint size.

For each width, trains 1 step of a GPT at TP 2 x PP 2 (4 CPU processes, the real launcher, ZeRO-1, fp32) from the
shipped corpus, checkpoints it, then times ``training.checkpoint.convert_to_universal`` (DeepSpeed's converter,
strict) in a fresh process, and reads the peak resident memory of that process and of the converter and its
worker processes (getrusage: the largest single process). Prints one row per size and the ratios, so the scaling to a real checkpoint can be read off.

    python benchmarks/bench_reshape.py                      # hidden 256, 512, 1024; 8 layers
    python benchmarks/bench_reshape.py --hidden 512 1024 1536 --layers 8 --workers 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.launch import launcher_env, preprocess_corpus, train_command  # noqa: E402


def checkpoint_of(data: Path, save: Path, hidden: int, layers: int) -> int:
    heads = max(4, hidden // 64)
    sets = [f"model.hidden_size={hidden}", f"model.num_attention_heads={heads}", f"model.num_layers={layers}",
            "training.save_interval=0"]
    subprocess.run(train_command(data, save, 1, sets), cwd=ROOT, env=launcher_env(), check=True,
                   capture_output=True)
    return sum(path.stat().st_size for path in (save / "global_step1").iterdir())


def measure_conversion(save: Path, workers: int) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of the conversion, run in a fresh process so that only it is measured."""
    code = ("import resource, sys, time; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
            "from training.checkpoint import convert_to_universal; start = time.perf_counter();"
            "convert_to_universal(Path(sys.argv[2]), 'global_step1', workers=int(sys.argv[3]));"
            "peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN));"
            "print(time.perf_counter() - start, peak * 1024)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT), str(save), str(workers)], cwd=ROOT,
                         env=launcher_env(), check=True, capture_output=True, text=True).stdout.split()
    return float(out[-2]), int(out[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"{'hidden':>6} {'checkpoint MB':>14} {'convert s':>10} {'peak RSS MB':>12} {'s per GB':>9} "
          f"{'RSS / checkpoint':>17}")
    with tempfile.TemporaryDirectory() as work:
        data = preprocess_corpus(Path(work))
        for hidden in args.hidden:
            save = Path(work) / f"h{hidden}" / "checkpoints"
            size = checkpoint_of(data, save, hidden, args.layers)
            seconds, peak = measure_conversion(save, args.workers)
            print(f"{hidden:>6} {size / 1e6:>14.1f} {seconds:>10.1f} {peak / 1e6:>12.1f} "
                  f"{seconds / (size / 1e9):>9.1f} {peak / size:>17.2f}", flush=True)


if __name__ == "__main__":
    main()
