"""Index building for a synthetic 200B-token corpus: about 100M samples of 2048 tokens.

Builds the GPT dataset's three index arrays (document, sample and shuffle index) from synthetic document lengths
(100M documents of 1..3999 tokens), then the blending index of the same number of samples over 3 and 15 datasets,
and prints the time (wall and CPU) and the peak memory (resident memory above the level before each build, so the
input lengths are excluded) against the size of the arrays built. Goal: seconds, not minutes, and memory within
about 2x the index arrays. Takes a minute or two and ~3 GB.

    python benchmarks/bench_index_build.py [--tokens 200e9] [--seq-length 2048] [--skip-blend]
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import psutil

from data.blended_dataset import build_blending_indices
from data.gpt_dataset import build_gpt_index


def measure(function, *args) -> tuple[object, str, int]:
    """(result, "wall s (CPU s)", peak resident memory above the level before the call, sampled every 5 ms).

    CPU time is printed too because wall time on a shared machine includes waiting for a core.
    """
    process = psutil.Process()
    baseline, peak, done = process.memory_info().rss, [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = function(*args)
    seconds = f"{time.perf_counter() - start:.1f} s wall ({time.process_time() - cpu_start:.1f} s CPU)"
    done.set()
    sampler.join()
    return result, seconds, max(peak[0], process.memory_info().rss) - baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=200e9, help="corpus size in tokens")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--mean-document-tokens", type=int, default=2000)
    parser.add_argument("--skip-blend", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    num_documents = int(args.tokens / args.mean_document_tokens)
    lengths = rng.integers(1, 2 * args.mean_document_tokens, size=num_documents, dtype=np.int32)
    total_tokens = int(lengths.sum(dtype=np.int64))
    num_samples = (total_tokens - 1) // args.seq_length  # one epoch
    print(f"corpus: {num_documents / 1e6:.1f}M documents, {total_tokens / 1e9:.1f}B tokens "
          f"({lengths.nbytes / 2**20:.0f} MiB of lengths, not counted below)")

    arrays, seconds, peak = measure(build_gpt_index, lengths, (0, num_documents), args.seq_length, num_samples, 1234)
    size = sum(array.nbytes for array in arrays.values())
    print(f"GPT index, {num_samples / 1e6:.1f}M samples of {args.seq_length}: {seconds}, peak {peak / 2**30:.2f} "
          f"GiB for {size / 2**30:.2f} GiB of arrays ({peak / size:.2f}x)")
    for name, array in arrays.items():
        print(f"    {name:>15}: {array.shape} {array.dtype} {array.nbytes / 2**20:.0f} MiB")
    del arrays
    if args.skip_blend:
        return
    for num_datasets in (3, 15):
        weights = rng.random(num_datasets) + 0.1
        (index, sample_index), seconds, peak = measure(build_blending_indices, weights, num_samples)
        size = index.nbytes + sample_index.nbytes
        print(f"blend index, {num_samples / 1e6:.1f}M samples over {num_datasets} datasets: {seconds}, "
              f"peak {peak / 2**30:.2f} GiB for {size / 2**30:.2f} GiB of arrays ({peak / size:.2f}x)")
        del index, sample_index


if __name__ == "__main__":
    main()
