"""Packed attention's memory: one Llama block's forward and backward over samples of 8 documents, per kernel.

For each sequence length and each document-mask kernel (model.attention_backend; model/document_attention.py):
what the forward keeps for the backward (glibc's allocated bytes after the forward less before, the output held, as
tests/test_activation_memory.py measures), the peak over the forward and backward above the start (the same count,
read after every operator), the planner's figures for what the block keeps (planner/memory.py layer_activation_bytes)
and for its peak (that plus layer_backward_transient_bytes), and the seconds of the forward and backward (the
count after each operator included). fp32, micro-batch 1, one process, one thread.

    python benchmarks/bench_document_attention.py [--lengths 4096 8192] [--backends sdpa blockwise]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.config import preset
from model.gpt import TransformerLayer
from model.parallel import ParallelContext
from model.random import RNGStream
from planner.memory import layer_activation_bytes, layer_backward_transient_bytes
from tests.test_activation_memory import allocated_bytes

HIDDEN, HEADS, KV_HEADS, DOCUMENTS = 256, 8, 2, 8


class PeakPerOperator(TorchDispatchMode):
    """The largest allocated-byte count seen after any operator while inside: exact where a sampling thread misses
    short-lived buffers (what an operator allocates and frees within itself is not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, allocated_bytes(collect=False))
        return out

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
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
    with PeakPerOperator():  # warm-up: lazy states, first-call allocations (the mode's own too: 24 MiB at s 4096)
        layer((x, positions, segment_ids))[0].sum().backward()
    layer.zero_grad(set_to_none=False)
    x.grad = torch.zeros_like(x)
    gc.collect()
    start = allocated_bytes()
    began = time.perf_counter()
    with PeakPerOperator() as sampler:
        out = layer((x, positions, segment_ids))[0]
        kept = allocated_bytes(collect=False) - start
        out.sum().backward()
        del out
    seconds = time.perf_counter() - began
    planned = layer_activation_bytes(config, 1, 1, sequence_parallel=False, recompute="none")
    return {"kept": kept, "peak": sampler.peak - start, "planned": planned,
            "planned_peak": planned + layer_backward_transient_bytes(config, 1, 1), "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--backends", nargs="+", default=["sdpa", "blockwise"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"Llama block h {HIDDEN}, {HEADS} heads ({KV_HEADS} kv), {DOCUMENTS} documents per sample, fp32, mb 1")
    print(f"{'kernel':>10} {'s':>6} {'kept MiB':>9} {'planned MiB':>11} {'kept/plan':>9} {'peak MiB':>9} "
          f"{'planned peak':>12} {'peak/plan':>9} {'fwd+bwd s':>9}")
    results = {}
    for backend in args.backends:
        for length in args.lengths:
            found = results[backend, length] = measure(backend, length)
            print(f"{backend:>10} {length:>6} {found['kept'] / 2**20:9.1f} {found['planned'] / 2**20:11.1f} "
                  f"{found['kept'] / found['planned']:9.3f} {found['peak'] / 2**20:9.1f} "
                  f"{found['planned_peak'] / 2**20:12.1f} {found['peak'] / found['planned_peak']:9.3f} "
                  f"{found['seconds']:9.2f}")
    if len(args.lengths) > 1:
        first, last = args.lengths[0], args.lengths[-1]
        for backend in args.backends:
            print(f"{backend}: from s {first} to {last}, kept x{results[backend, last]['kept'] / results[backend, first]['kept']:.2f}, "
                  f"peak x{results[backend, last]['peak'] / results[backend, first]['peak']:.2f}")


if __name__ == "__main__":
    main()
