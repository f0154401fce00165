#!/usr/bin/env python
"""Peak memory of the output head and the vocab-parallel cross-entropy, forward and backward, before and after
issue 12 ("The first run on a GPU cluster"), on CPU.

The step measured is the last pipeline stage's: logits = head(hidden) (the tied embedding, TP 1), per-token losses
by the vocab-parallel cross-entropy, their mean, and the backward to the hidden states and the weight. The logits stay
alive until the backward is done, as DeepSpeed's pipeline engine keeps them (``pipe_buffers['outputs']`` of the last
stage). bf16 as on GPUs: hidden states and weight in bf16, so the head matmul and the logits are bf16; the loss
computes in fp32. Default shape: h 2048, vocabulary 50,257 padded to 50,304 (47 padded rows), sequence 2048,
micro-batch 2, i.e. the 1.3b preset's head at a quarter of its micro-batch.

    python benchmarks/bench_head_memory.py                 # about 1.5 minutes on one core
    python benchmarks/bench_head_memory.py --micro-batch 1 --seq 1024

Method. Each variant runs in a fresh process, which reports how far its resident memory rose above what it held
before the step:
- glibc's malloc returns a freed block to the system only if it was mmap'ed, i.e. above the mmap threshold, which it
  raises on its own up to 32 MiB; the child fixes it at 1 MiB (MALLOC_MMAP_THRESHOLD_), so every tensor of more than
  1 MiB is its own mapping, resident once written and unmapped when freed: the resident set follows the live tensors;
- the child builds the weight, the hidden states and the labels, runs the step once at a tiny size (libraries' lazy
  set-up), resets the kernel's high-water mark (writing 5 to /proc/self/clear_refs) and takes its RSS as the baseline;
  after the backward it reads the high-water mark (VmHWM). Peak = high-water mark - baseline: every tensor the head
  and the loss allocate, the weight and hidden-state gradients included (0.21 GB and 0.02 GB here), and the matmul
  kernels' scratch (some 40 MB). Where the reset is unavailable, ru_maxrss is used.
- unavoidable = the bf16 logits (2 b s V bytes) + their fp32 softmax (4 b s V bytes): 1.24 GB at the default shape.

"old" is the code before issue 12, kept below verbatim: the head copies the logits (torch.cat) to fill the padded rows
with -inf, the loss keeps an fp32 copy beside its shifted copy, saves the fp32 softmax, and its backward clones it.
"new" is model/layers.py: the padded rows are filled in place, the loss runs in fp32 on chunks of rows and saves
only the logits (the input itself) and per-token tensors, and its backward recomputes the softmax chunk by chunk.

Measured at the default shape (AMD EPYC, one thread; N = b s V = 206M logits):

    unavoidable (2N + 4N bytes)   1.236 GB
    old                           2.473 GB = 2.00 x   in the loss's backward: the held bf16 logits 2N, the saved fp32
                                                      softmax 4N, its clone 4N, the clone cast to bf16 by autograd 2N
    new                           1.049 GB = 0.85 x   in the head's backward matmul: the held bf16 logits 2N, their bf16
                                                      gradient 2N, the weight gradient (0.21 GB)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from model.layers import VocabParallelEmbedding, vocab_parallel_cross_entropy
from model.parallel import ParallelContext

GPT2_VOCAB_SIZE, GPT2_PADDED_VOCAB_SIZE = 50257, 50304


# -- the code before issue 12, verbatim at TP 1 (no process group) ---------------------------------------------------
def old_logits(embedding: VocabParallelEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, embedding.weight)  # (b, s, V/R)
    padded = embedding.vocab_end - max(embedding.vocab_size, embedding.vocab_start)
    if padded > 0:
        logits = torch.cat([logits[..., :-padded], torch.full_like(logits[..., -padded:], float("-inf"))], -1)
    return logits


class _OldVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, ignore_index):
        logits = logits.float()  # (b, s, V/R)
        local_max = logits.max(dim=-1).values
        shifted = logits - local_max.unsqueeze(-1)

        ignored = labels == ignore_index
        local_labels = labels - vocab_start
        mine = (local_labels >= 0) & (local_labels < logits.shape[-1]) & ~ignored
        local_labels = local_labels.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_labels, mine, ignored = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None


def old_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _OldVocabParallelCrossEntropy.apply(logits, labels, 0, -100)


def new_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, labels, None, 0)


VARIANTS = {"old": (old_logits, old_loss), "new": (VocabParallelEmbedding.logits, new_loss)}


# -- the measurement, in the child process ------------------------------------------------------------------------
def _rss_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _embedding(hidden_size: int, padded_vocab: int, vocab: int) -> VocabParallelEmbedding:
    embedding = VocabParallelEmbedding(padded_vocab, hidden_size, ParallelContext(), vocab_size=vocab,
                                       init_std=0.02, seed=0)
    return embedding.to(torch.bfloat16)


def _step(variant: str, embedding: VocabParallelEmbedding, hidden: torch.Tensor, labels: torch.Tensor) -> float:
    head, loss_fn = VARIANTS[variant]
    logits = head(embedding, hidden)  # (b, s, V) bf16, held until the backward is done, as the pipeline engine does
    loss = loss_fn(logits, labels).mean()
    loss.backward()
    del logits
    return loss.item()


def measure(variant: str, hidden_size: int, padded_vocab: int, vocab: int, seq: int, micro_batch: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    warm_up = _embedding(64, 256, 250)
    _step(variant, warm_up, torch.randn(1, 8, 64, generator=generator).to(torch.bfloat16).requires_grad_(),
          torch.randint(0, 250, (1, 8), generator=generator))
    embedding = _embedding(hidden_size, padded_vocab, vocab)
    hidden = torch.randn(micro_batch, seq, hidden_size, generator=generator).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (micro_batch, seq), generator=generator)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        high_water = "VmHWM"
    except OSError:
        high_water = None
    baseline = _rss_bytes("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    loss = _step(variant, embedding, hidden, labels)
    seconds = time.perf_counter() - start
    peak = _rss_bytes(high_water) if high_water else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": peak - baseline, "seconds": seconds, "loss": loss, "method": high_water or "ru_maxrss",
            "grad_weight_bytes": embedding.weight.grad.numel() * embedding.weight.grad.element_size()}


# -- the parent: one child per variant, then the table --------------------------------------------------------------
def run_child(variant: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", variant, "--hidden", str(args.hidden), "--vocab", str(args.vocab),
               "--padded-vocab", str(args.padded_vocab), "--seq", str(args.seq), "--micro-batch",
               str(args.micro_batch), "--threads", str(args.threads)]
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    completed = subprocess.run(command, check=True, capture_output=True, text=True, env=environment)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=GPT2_VOCAB_SIZE, help="real vocabulary")
    parser.add_argument("--padded-vocab", type=int, default=GPT2_PADDED_VOCAB_SIZE, help="rows of the head")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.child, args.hidden, args.padded_vocab, args.vocab, args.seq, args.micro_batch)))
        return 0
    results = {variant: run_child(variant, args) for variant in ("old", "new")}
    logits_elements = args.micro_batch * args.seq * args.padded_vocab
    unavoidable = 2 * logits_elements + 4 * logits_elements  # bf16 logits + fp32 softmax
    gb = 1e9
    print(f"head + loss, forward and backward: h {args.hidden}, vocabulary {args.vocab} padded to "
          f"{args.padded_vocab}, sequence {args.seq}, micro-batch {args.micro_batch}; bf16 logits, fp32 loss")
    print(f"unavoidable (bf16 logits {2 * logits_elements / gb:.3f} GB + fp32 softmax {4 * logits_elements / gb:.3f} "
          f"GB)  {unavoidable / gb:6.3f} GB")
    for variant, result in results.items():
        print(f"{variant:3s} peak above inputs and weights   {result['peak_bytes'] / gb:6.3f} GB  = "
              f"{result['peak_bytes'] / unavoidable:.2f} x the unavoidable   ({result['seconds']:.1f} s, "
              f"loss {result['loss']:.6f}, {result['method']})")
    print(f"new / old: {results['new']['peak_bytes'] / results['old']['peak_bytes']:.2f}   (both peaks include the "
          f"weight gradient, {results['new']['grad_weight_bytes'] / gb:.3f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
