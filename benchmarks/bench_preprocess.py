"""Throughput of tools/preprocess_data.py against the bare tokenizer on the same corpus, with peak memory.

Corpora: the shipped Botchan corpus (data/corpus/botchan.jsonl) repeated to two sizes (default 8 and 32 MB). For
each size:

- preprocess: ``tools/preprocess_data.py --workers 2 --append-eod`` (GPT-2 BPE) in a subprocess; its throughput from
  the seconds the tool reports (start-up of the interpreter excluded) and end to end; peak memory is the largest sum
  of resident memory over the tool and its worker processes, sampled every 20 ms;
- bare tokenizer: ``GPT2BPETokenizer.encode_batch`` over the same documents already in memory, in batches of 1,000,
  with the tokenizer's own 2 threads (the same 2 cores), in a subprocess.

Goal: preprocessing at >= 80% of the bare tokenizer's tokens/s, and peak memory that does not grow with the corpus.
The best of ``--repeat`` runs is kept (other processes on a shared machine only ever slow a run down); the CPU-time
ratio (CPU seconds of the whole bare process over those of the tool and its workers) is the robust figure there.

    python benchmarks/bench_preprocess.py [--sizes-mb 8 32] [--workers 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "corpus", "botchan.jsonl")


def make_corpus(path: str, megabytes: float) -> int:
    """Repeat the shipped corpus up to ``megabytes``; returns the number of documents."""
    with open(CORPUS, encoding="utf-8") as stream:
        lines = stream.readlines()
    written, documents = 0, 0
    with open(path, "w", encoding="utf-8") as stream:
        while written < megabytes * 1e6:
            for line in lines:
                stream.write(line)
                written += len(line.encode())
                documents += 1
    return documents


def run_measured(command: list[str], environment: dict | None = None) -> tuple[str, float, int, float]:
    """(stdout, wall seconds, peak resident bytes of the process tree, CPU seconds of the tree) of a command."""
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, **(environment or {})}, cwd=ROOT)
    peak, done = [0], threading.Event()

    def sample() -> None:
        root = psutil.Process(process.pid)
        while not done.wait(0.02):
            try:
                tree = [root, *root.children(recursive=True)]
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = process.communicate()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed with code {process.returncode}")
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)  # includes the pool's workers, waited for by the tool
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return output, seconds, peak[0], cpu


def bare_tokenizer(path: str) -> None:
    """Child mode: time encode_batch over the documents of ``path``; print JSON."""
    from data.tokenizers import GPT2BPETokenizer

    tokenizer = GPT2BPETokenizer()
    with open(path, encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    start = time.perf_counter()
    tokens = sum(len(ids) for i in range(0, len(texts), 1000) for ids in tokenizer.encode_batch(texts[i : i + 1000]))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "tokens": tokens + len(texts)}))  # + the eod the tool appends


def measure(path: str, workers: int, repeat: int, directory: str) -> dict:
    megabytes = os.path.getsize(path) / 1e6
    tool = [sys.executable, "tools/preprocess_data.py", "--input", path, "--output-prefix",
            os.path.join(directory, "out"), "--append-eod", "--workers", str(workers), "--no-progress"]
    runs = [run_measured(tool) for _ in range(repeat)]
    output, wall, peak, cpu = min(runs, key=lambda run: float(re.search(r" in ([0-9.]+) s", run[0]).group(1)))
    inside = float(re.search(r" in ([0-9.]+) s", output).group(1))
    tokens = int(re.search(r"documents, (\d+) tokens", output).group(1))
    bare_runs = [run_measured([sys.executable, __file__, "--bare", path], {"RAYON_NUM_THREADS": str(workers)})
                 for _ in range(repeat)]
    bare_output, _, bare_peak, bare_cpu = min(bare_runs, key=lambda run: json.loads(run[0])["seconds"])
    bare = json.loads(bare_output)
    return {"MB": megabytes, "tokens": tokens, "tool_s": inside, "tool_wall_s": wall, "tool_peak": peak,
            "tool_cpu": cpu, "bare_s": bare["seconds"], "bare_peak": bare_peak, "bare_cpu": bare_cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[8, 32])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--bare", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare_tokenizer(args.bare)
        return
    print(f"{os.cpu_count()} cores, {args.workers} workers; throughput in MB/s of JSONL and M tokens/s; "
          f"ratio = preprocess / bare tokens/s, by wall time and by CPU time of the whole processes")
    print(f"{'corpus':>9} {'tokens':>8} | {'preprocess':>18} {'end to end':>10} {'peak':>7} | "
          f"{'bare tokenizer':>18} {'peak':>7} | ratio wall, CPU")
    with tempfile.TemporaryDirectory() as directory:
        for megabytes in args.sizes_mb:
            path = os.path.join(directory, f"corpus_{megabytes:g}mb.jsonl")
            make_corpus(path, megabytes)
            r = measure(path, args.workers, args.repeat, directory)
            print(f"{r['MB']:>6.1f} MB {r['tokens'] / 1e6:>7.2f}M | "
                  f"{r['MB'] / r['tool_s']:>5.2f} MB/s {r['tokens'] / r['tool_s'] / 1e6:>5.3f} M/s "
                  f"{r['tokens'] / r['tool_wall_s'] / 1e6:>6.3f} M/s {r['tool_peak'] / 2**20:>4.0f} MB | "
                  f"{r['MB'] / r['bare_s']:>5.2f} MB/s {r['tokens'] / r['bare_s'] / 1e6:>5.3f} M/s "
                  f"{r['bare_peak'] / 2**20:>4.0f} MB | {r['bare_s'] / r['tool_s']:.0%}, "
                  f"{r['bare_cpu'] / r['tool_cpu']:.0%}")


if __name__ == "__main__":
    main()
