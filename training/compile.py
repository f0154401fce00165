"""training.compile: each transformer block compiled with torch.compile, regionally, as torchtitan does: the blocks, not
the model. DeepSpeed's pipeline engine, the tied embedding and the recompute of model/random.py keep the modules they
had and call them as before; only the block's own computation runs as inductor's kernels (fused norms, GeLU or
SwiGLU, RoPE, residual adds and dropouts, which eager PyTorch runs one kernel each).

    piece of a stage                      under training.compile
    TransformerLayer.block                compiled (inductor), once for all the blocks of the stage: they share its
      (norms, attention, MLP, dropouts)     code and differ only in their parameters, which dynamo takes as inputs
    full recompute (model/random.py)      around the compiled block: ``checkpoint`` calls it in the forward, and again
                                            in the backward with the forward's random streams
    selective recompute's core            a graph break: its ``checkpoint`` runs eager between two compiled graphs
    RoPE's cos and sin                    made inside each block's graph (model/layers.py RotaryEmbedding.cos_sin)
    a sparse layer's MoE MLP              eager (torch.compiler.disable): its dispatch reads the split sizes on the
                                            host and its row counts change with every batch; compiled, the step's
                                            statistics it keeps (one more forward counted each time) recompiled it
                                            at every micro-batch (3 steps of a tiny block: 108 s, 4.5 s with it eager)
    dropout                               inductor calls eager's random ops (``fallback_random``): the same masks
                                            from the same streams (model/random.py), bitwise, so a compiled run is
                                            the eager run within fp32 rounding, dropout or not
    embedding, position layer, final      eager
      norm, output head, loss

Evaluation (eval mode) and the attention-logit probe (training/stability.py) each compile one more graph of the
block, once. Checked on CPU against the same run eager, fp32, 3 steps, the largest difference:

    layout and block                          losses, relative   gradient norms, relative
    PP 2, dropout 0.1, full recompute         9e-8 (1 ulp)       equal (tests/test_compile.py)
    TP 2 + sequence parallelism, dropout,     9e-8               2e-6
      selective recompute
    CP 2 (Ulysses), full recompute            9e-8               7e-8
    PP 2, a sparse MoE block, dropout         9e-8               2e-7

Not checked yet: FlexAttention (CUDA only), DualPipeV, bf16 and fp16; scripts/gpu_smoke.sh runs 125m compiled in
bf16. torch.compile compiles lazily, in the first step: ``CompileClock`` logs once, after the second step, how long
that took (the first step's time less the second's, per micro-batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from model.gpt import TransformerLayer
from model.moe import MoEMLP

INDUCTOR_OPTIONS = {"fallback_random": True}
"""Inductor's options for the blocks: random ops as eager's (torch.compile's documented option), so that dropout
masks are those of an eager run."""


def compile_blocks(module: nn.Module) -> int:
    """Compile, in place, the block of every TransformerLayer in ``module`` (a pipeline stage, or the whole GPT);
    returns how many. A sparse layer's MoE MLP is left eager (the module docstring says why)."""
    layers = [layer for layer in module.modules() if isinstance(layer, TransformerLayer)]
    for layer in layers:
        if isinstance(layer.mlp, MoEMLP):
            layer.mlp.forward = torch.compiler.disable(layer.mlp.forward)
        layer.block = torch.compile(layer.block, options=INDUCTOR_OPTIONS)
    return len(layers)


class CompileClock:
    """The one log line of training.compile: its blocks compile during the first step, so the compilation took about
    the first step's time less the second's (each per micro-batch, times the first step's micro-batches). A stage
    without compiled blocks (``blocks`` 0) logs nothing."""

    def __init__(self, blocks: int, info: Callable[[str], None]) -> None:
        self.blocks, self.info = blocks, info
        self.first: tuple[float, int] | None = None  # the first step's (seconds, micro-batches)
        self.done = blocks == 0
        self.started = 0.0

    def start(self) -> None:
        if not self.done:
            self.started = time.perf_counter()

    def stop(self, micro_batches: int) -> None:
        """After a step of ``micro_batches`` micro-batches, timed from ``start``: the first this process runs (a
        resumed run's too), then the second, which logs."""
        if self.done:
            return
        seconds = time.perf_counter() - self.started
        if self.first is None:
            self.first = (seconds, micro_batches)
            return
        first_seconds, first_micro_batches = self.first
        compiling = max(first_seconds - seconds / micro_batches * first_micro_batches, 0.0)
        self.info(f"[compile] {self.blocks} block(s) of this stage compiled with torch.compile (training.compile) in "
                  f"about {compiling:.1f} s: the first step took {first_seconds:.1f} s, the second {seconds:.2f} s")
        self.done = True
