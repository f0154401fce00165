"""Packed attention's memory: one Llama block's forward and backward over samples of 8 documents, per kernel.

For each sequence length and each document-mask kernel (model.attention_backend; model/document_attention.py):
what the forward keeps for the backward (glibc's allocated bytes after the forward less before, the output held, as
tests/test_activation_memory.py measures), the peak over the forward and backward above the start (the same count,
sampled every 0.2 ms by a thread), the planner's figure for what the block keeps (planner/memory.py
layer_activation_bytes), and the seconds of the forward and backward. fp32, micro-batch 1, one process, one thread.

    python benchmarks/bench_document_attention.py [--lengths 4096 8192] [--backends sdpa blockwise]
"""

from __future__ import annotations

import argparse
import gc
import threading
import time

import torch

from model.config import preset
from model.gpt import TransformerLayer
from model.parallel import ParallelContext
from model.random import RNGStream
from planner.memory import layer_activation_bytes
from tests.test_activation_memory import allocated_bytes

HIDDEN, HEADS, KV_HEADS, DOCUMENTS = 256, 8, 2, 8


class PeakSampler:
    """The largest allocated-byte count seen by a thread sampling every ``interval_s`` while inside."""

    def __init__(self, interval_s: float = 2e-4) -> None:
        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, allocated_bytes(collect=False))
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, allocated_bytes(collect=False))


def block_config(backend: str, seq_length: int):
    return preset("llama-tiny", num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, ffn_hidden_size=2 * HIDDEN, seq_length=seq_length,
                  attention_backend=backend)


def packed_ids(seq_length: int, documents: int = DOCUMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, s) positions in the document and document ids of a sample of ``documents`` equal documents."""
    segment_ids = (torch.arange(seq_length) * documents // seq_length)[None]
    starts = torch.searchsorted(segment_ids[0], segment_ids[0])  # each token's document's first position
    return (torch.arange(seq_length) - starts)[None], segment_ids


def measure(backend: str, seq_length: int) -> dict[str, float]:
    """Kept and peak bytes of one forward and backward, and its seconds (after a warm-up)."""
    config = block_config(backend, seq_length)
    layer = TransformerLayer(config, ParallelContext(), 1234, 1, RNGStream(0))
    x = torch.randn(1, seq_length, HIDDEN, requires_grad=True)
    positions, segment_ids = packed_ids(seq_length)
    layer((x, positions, segment_ids))[0].sum().backward()  # warm-up: lazy states, first-call allocations
    layer.zero_grad(set_to_none=False)
    x.grad = torch.zeros_like(x)
    gc.collect()
    start = allocated_bytes()
    began = time.perf_counter()
    with PeakSampler() as sampler:
        out = layer((x, positions, segment_ids))[0]
        kept = allocated_bytes(collect=False) - start
        out.sum().backward()
        del out
    seconds = time.perf_counter() - began
    planned = layer_activation_bytes(config, 1, 1, sequence_parallel=False, recompute="none")
    return {"kept": kept, "peak": sampler.peak - start, "planned": planned, "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--backends", nargs="+", default=["sdpa", "blockwise"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"Llama block h {HIDDEN}, {HEADS} heads ({KV_HEADS} kv), {DOCUMENTS} documents per sample, fp32, mb 1")
    print(f"{'kernel':>10} {'s':>6} {'kept MiB':>9} {'planned MiB':>11} {'kept/plan':>9} {'peak MiB':>9} "
          f"{'fwd+bwd s':>9}")
    results = {}
    for backend in args.backends:
        for length in args.lengths:
            found = results[backend, length] = measure(backend, length)
            print(f"{backend:>10} {length:>6} {found['kept'] / 2**20:9.1f} {found['planned'] / 2**20:11.1f} "
                  f"{found['kept'] / found['planned']:9.3f} {found['peak'] / 2**20:9.1f} {found['seconds']:9.2f}")
    if len(args.lengths) > 1:
        first, last = args.lengths[0], args.lengths[-1]
        for backend in args.backends:
            print(f"{backend}: from s {first} to {last}, kept x{results[backend, last]['kept'] / results[backend, first]['kept']:.2f}, "
                  f"peak x{results[backend, last]['peak'] / results[backend, first]['peak']:.2f}")


if __name__ == "__main__":
    main()
