"""The two tokenizer backends side by side: tools/preprocess_data.py on each, the bare tokenizer, peak memory.

Corpora: the shipped Botchan corpus (data/corpus/botchan.jsonl) repeated to each size (default 5 and 20 MB). For each
size and each backend (``--tokenizer-backend tokenizers`` and ``tiktoken``, same ids):

- preprocess: ``tools/preprocess_data.py --workers 2 --append-eod`` (GPT-2 BPE) in a subprocess; the seconds the tool
  reports (from the start of its work: tokenizer construction and exactness check included, interpreter start-up not)
  and the wall time end to end; peak memory is the largest sum of resident memory over the tool and its worker
  processes, sampled every 20 ms; the CPU seconds of the tool and its workers;
- bare tokenizer: the same backend's ``encode_batch`` over the same documents already in memory, 1,000 documents per
  call from 2 threads (both backends release the GIL: the same 2 cores), in a subprocess.

Goals: tiktoken's preprocessing at most 0.5x the wall time of tokenizers'; preprocessing at >= 80% of the bare
tokenizer's tokens/s; peak memory that does not grow with the corpus. The best of ``--repeat`` runs is kept (other
processes on a shared machine only ever slow a run down); CPU-time ratios are the robust figures there.

    python benchmarks/bench_preprocess.py [--sizes-mb 5 20] [--workers 2] [--repeat 2]
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
from concurrent.futures import ThreadPoolExecutor

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


def bare_tokenizer(path: str, backend: str, threads: int) -> None:
    """Child mode: time encode_batch over the documents of ``path`` from ``threads`` threads; print JSON."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per call: the threads are the parallelism
    from data.tokenizers import GPT2BPETokenizer

    tokenizer = GPT2BPETokenizer(backend=backend)
    with open(path, encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    chunks = [texts[i : i + 1000] for i in range(0, len(texts), 1000)]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        tokens = sum(len(ids) for encoded in pool.map(tokenizer.encode_batch, chunks) for ids in encoded)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "tokens": tokens + len(texts)}))  # + the eod the tool appends


def _reported_seconds(output: str) -> float:
    return float(re.search(r" in ([0-9.]+) s", output).group(1))


def measure(path: str, backend: str, workers: int, repeat: int, directory: str) -> dict:
    """Best of ``repeat`` runs of the tool and of the bare tokenizer, with one backend."""
    tool = [sys.executable, "tools/preprocess_data.py", "--input", path, "--output-prefix",
            os.path.join(directory, f"out_{backend}"), "--append-eod", "--workers", str(workers), "--no-progress",
            "--tokenizer-backend", backend]
    runs = [run_measured(tool) for _ in range(repeat)]
    output, wall, peak, cpu = min(runs, key=lambda run: run[1])
    bare_command = [sys.executable, __file__, "--bare", path, "--backend", backend, "--workers", str(workers)]
    bare_runs = [run_measured(bare_command) for _ in range(repeat)]
    bare = min((json.loads(run[0]) for run in bare_runs), key=lambda result: result["seconds"])
    tokens = int(re.search(r"documents, (\d+) tokens", output).group(1))
    return {"backend": backend, "MB": os.path.getsize(path) / 1e6, "tokens": tokens,
            "tool_s": min(_reported_seconds(run[0]) for run in runs), "wall_s": wall, "peak": peak, "cpu": cpu,
            "bare_s": bare["seconds"], "bare_peak": max(run[2] for run in bare_runs)}


def print_row(r: dict) -> None:
    print(f"{r['MB']:>6.1f} MB  {r['backend']:<10} | {r['tool_s']:>6.2f} s {r['MB'] / r['tool_s']:>5.2f} MB/s "
          f"{r['tokens'] / r['tool_s'] / 1e6:>5.3f} M/s  {r['wall_s']:>6.2f} s {r['cpu']:>6.1f} s "
          f"{r['peak'] / 2**20:>5.0f} MB | {r['tokens'] / r['bare_s'] / 1e6:>5.3f} M/s | "
          f"{r['bare_s'] / r['tool_s']:.0%}")


def print_comparison(rows: list[dict]) -> None:
    by = {(round(r["MB"]), r["backend"]): r for r in rows}
    sizes = sorted({size for size, _ in by})
    for size in sizes:
        fast, slow = by[(size, "tiktoken")], by[(size, "tokenizers")]
        print(f"{size} MB: tiktoken / tokenizers = {fast['wall_s'] / slow['wall_s']:.2f}x wall time end to end "
              f"(goal <= 0.5x), {fast['tool_s'] / slow['tool_s']:.2f}x inside the tool, "
              f"{fast['cpu'] / slow['cpu']:.2f}x CPU time")
    if len(sizes) > 1:
        for backend in ("tokenizers", "tiktoken"):
            peaks = ", ".join(f"{by[(size, backend)]['peak'] / 2**20:.0f} MB" for size in sizes)
            print(f"peak memory of {backend} at {', '.join(f'{size} MB' for size in sizes)} of corpus: {peaks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[5, 20])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--bare", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="tokenizers", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare_tokenizer(args.bare, args.backend, args.workers)
        return
    print(f"{os.cpu_count()} cores, {args.workers} workers, GPT-2 BPE, best of {args.repeat}; tool seconds as it "
          f"reports them, wall and CPU seconds of the whole process tree; ratio = tool / bare tokens/s")
    print(f"{'corpus':>9}  {'backend':<10} | {'preprocess':>30} {'end to end':>9} {'CPU':>8} {'peak':>8} | "
          f"{'bare':>9} | ratio")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for megabytes in args.sizes_mb:
            path = os.path.join(directory, f"corpus_{megabytes:g}mb.jsonl")
            make_corpus(path, megabytes)
            for backend in ("tokenizers", "tiktoken"):
                rows.append(measure(path, backend, args.workers, args.repeat, directory))
                print_row(rows[-1])
    print_comparison(rows)


if __name__ == "__main__":
    main()
