#!/usr/bin/env python
"""training.compile on CPU: the step time of a small GPT with its blocks compiled (training/compile.py, inductor)
against the same model eager, and their parity; one process, fp32.

    python benchmarks/bench_compile.py [--preset llama-tiny] [--layers 4] [--hidden 256] [--heads 8] [--seq 256]
                                       [--batch 4] [--dropout 0.0] [--recompute none] [--steps 5] [--warmup 2]

A step is the loss's forward and backward (model.GPT.loss, every token a target), gradients set to None first; no
optimizer (the same for both). Each time is the median of --steps timed steps after --warmup untimed ones; the first
compiled step, which compiles, is printed apart.

    printed              what
    compile              the first compiled step's time (dynamo, AOT autograd and inductor, forward and backward;
                         less on a second run: inductor's kernels are cached on disk)
    step                 median time of the whole step, eager and compiled, and compiled / eager (below 1: it pays)
    blocks               the same for the blocks alone (what is compiled: forward and backward of a (b, s, h) input
                         through the blocks), without the embedding, the head and the loss, which stay eager
    parity               |loss - eager loss| and the largest |gradient - eager gradient| over the parameters, of
                         one step from the same weights, with each parameter's largest eager gradient for scale

On a CPU, inductor's C++ kernels fuse the elementwise chains (norms, SwiGLU, RoPE, residuals) as its GPU kernels do;
the matmuls stay oneDNN/BLAS calls either way, so the ratio on a GPU, where the elementwise kernels' memory traffic
counts for more, is what scripts/gpu_smoke.sh measures.

Measured at the defaults (AMD EPYC, 2 cores shared with a running test suite, OMP_NUM_THREADS=1): see the report of
the commit that added this file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.config import preset  # noqa: E402
from model.gpt import GPT  # noqa: E402
from training.compile import compile_blocks  # noqa: E402


def step(model: GPT, tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One forward and backward from the same dropout streams; returns (seconds, loss)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    positions = torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)
    started = time.perf_counter()
    loss = model.loss(tokens[:, :-1], positions, tokens[:, 1:], torch.ones_like(positions, dtype=torch.float))
    loss.backward()
    return time.perf_counter() - started, loss.detach()


def blocks_step(model: GPT, hidden: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The blocks alone, what training.compile compiles: forward and backward of mean(blocks(hidden)^2)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    started = time.perf_counter()
    x = hidden.detach().requires_grad_()
    for layer in model.layers:
        x = layer(x)
    loss = x.square().mean()
    loss.backward()
    return time.perf_counter() - started, loss.detach()


def median_times(models: dict[str, GPT], run, data: torch.Tensor, steps: int, warmup: int) -> dict[str, float]:
    """Median seconds of ``run(model, data)`` per model, the models taking turns step by step."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for repeat in range(warmup + steps):
        for name, model in models.items():
            seconds, _ = run(model, data)
            if repeat >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    config = preset(args.preset, num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    ffn_hidden_size=4 * args.hidden, seq_length=args.seq, hidden_dropout=args.dropout,
                    attention_dropout=args.dropout, recompute=args.recompute, precision="fp32")
    eager, compiled = GPT(config), GPT(config)
    blocks = compile_blocks(compiled)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    print(f"{args.preset}: {args.layers} layers, h {args.hidden}, {args.heads} heads, batch {args.batch} x {args.seq} "
          f"tokens, dropout {args.dropout}, recompute {args.recompute}; {torch.get_num_threads()} torch thread(s)")

    compile_seconds, loss = step(compiled, tokens)
    _, expected = step(eager, tokens)  # the same weights and streams: the first step of each is comparable
    gradients = {name: p.grad for name, p in compiled.named_parameters()}
    worst = max(((gradients[name] - p.grad).abs().max().item(), p.grad.abs().max().item(), name)
                for name, p in eager.named_parameters())
    print(f"compile      {compile_seconds:.1f} s for the first compiled step ({blocks} blocks)")
    print(f"parity       loss {expected.item():.6f}, |compiled - eager| {abs(loss - expected).item():.2e}; largest "
          f"gradient difference {worst[0]:.2e} ({worst[2]}, whose largest gradient is {worst[1]:.2e})")

    models = {"eager": eager, "compiled": compiled}
    hidden = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    blocks_step(compiled, hidden)  # the blocks' graphs for a leaf input: compiled before the timing
    for what, run, data in (("step", step, tokens), ("blocks", blocks_step, hidden)):
        median = median_times(models, run, data, args.steps, args.warmup)
        print(f"{what:<7}eager {median['eager'] * 1e3:.1f} ms, compiled {median['compiled'] * 1e3:.1f} ms (medians "
              f"of {args.steps}): compiled / eager {median['compiled'] / median['eager']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
