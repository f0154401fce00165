"""Dropout random streams (Megatron's): which stream draws which mask, on every rank.

    stream           seed                       draws the masks of                               across ranks
    default (torch)  seed + 100 p               embedding dropout (PositionEmbedding); hidden    the same on the TP ranks
                                                dropout after each row-parallel output           of a stage, different
                                                (TransformerLayer), both on replicated (b, s, h) between stages
    tensor-parallel  seed + 100 p + 2718 + t    attention dropout inside SDPA, on this rank's    different on every TP
                                                heads (SelfAttention); with sequence parallelism rank and every stage
                                                also the embedding and hidden dropouts, on this
                                                rank's positions (b, s/R, h) (HiddenDropout)

with p the pipeline rank and t the tensor-parallel rank. A replicated activation (b, s, h) must be dropped identically
on every TP rank, or the ranks' copies drift apart; the attention probabilities of different heads live on different TP
ranks, as do the sequence shards under sequence parallelism, and must not share a mask pattern. Data-parallel replicas
share both streams (as in Megatron); their data differ.

torch's dropout and SDPA draw from the default generator (CPU, or the current CUDA device), so the tensor-parallel
stream is a saved generator state swapped into the default generators around the region (``RNGStream.fork``), as
Megatron's CudaRNGStatesTracker does. Recomputation (model.recompute: a whole block, or its attention core) reruns
in the backward pass: torch.utils.checkpoint restores the default stream for the recompute, and ``checkpoint`` below also replays the
tensor-parallel stream from where the forward drew, so the recomputed masks are the forward's. Both streams are saved
in, and restored from, every checkpoint (training/checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.utils.checkpoint

from model.parallel import ParallelContext

PIPELINE_SEED_STRIDE = 100
TENSOR_PARALLEL_SEED_OFFSET = 2718  # Megatron's 'model-parallel-rng' offset


def default_stream_seed(seed: int, ctx: ParallelContext) -> int:
    """Seed of torch's default generators on this rank: one per pipeline stage."""
    return seed + PIPELINE_SEED_STRIDE * ctx.pipeline_parallel_rank


def tensor_parallel_stream_seed(seed: int, ctx: ParallelContext) -> int:
    """Seed of the stream used inside tensor-parallel regions: one per (stage, TP rank)."""
    return default_stream_seed(seed, ctx) + TENSOR_PARALLEL_SEED_OFFSET + ctx.tensor_parallel_rank


States = dict[str, torch.Tensor]  # {"cpu": generator state, "cuda": the current CUDA device's, when there is one}


def _default_states() -> States:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_default_states(states: States) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class RNGStream:
    """A random stream kept apart from torch's default one and swapped into it for the regions that draw from it.

    Its generator states are created at the first use, not at construction, so that building a model (on the meta
    device, for a summary) never initialises CUDA.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._states: States | None = None

    def _current(self) -> States:
        if self._states is None:
            with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
                torch.random.default_generator.manual_seed(self.seed)
                if torch.cuda.is_available():
                    torch.cuda.manual_seed(self.seed)
                self._states = _default_states()
        return self._states

    @contextmanager
    def fork(self, enabled: bool = True) -> Iterator[None]:
        """Within the block, torch's default generators draw from this stream; outside, the default stream resumes
        exactly where it was."""
        if not enabled:
            yield
            return
        outside = _default_states()
        _set_default_states(self._current())
        try:
            yield
        finally:
            self._states = _default_states()
            _set_default_states(outside)

    @contextmanager
    def replaying(self, states: States) -> Iterator[None]:
        """Within the block the stream restarts from ``states`` (a recompute); afterwards it is where it was."""
        current = self._current()
        self._states = states
        try:
            yield
        finally:
            self._states = current

    def state_dict(self) -> States:
        return dict(self._current())

    def load_state_dict(self, states: States) -> None:
        self._states = dict(states)


def checkpoint(stream: RNGStream, function: Callable[..., Any], *args: Any) -> Any:
    """torch.utils.checkpoint (non-reentrant) that also replays ``stream`` in the recompute.

    torch restores the default generators for the recompute; without this, a block's tensor-parallel dropout would
    draw new masks in the backward pass and its gradients would belong to another forward. Signature of DeepSpeed's
    ``activation_checkpoint_func`` once ``stream`` is bound.
    """
    at_forward = stream.state_dict()
    calls = 0

    def run(*inputs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:  # the forward itself
            return function(*inputs)
        token = _RECOMPUTES.set(_RECOMPUTES.get() + 1)
        try:
            with stream.replaying(at_forward):  # a recompute, in the backward pass
                return function(*inputs)
        finally:
            _RECOMPUTES.reset(token)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)


_RECOMPUTES: ContextVar[int] = ContextVar("recomputes", default=0)
"""How many recomputes of ``checkpoint`` the running code is inside (nested: a selective one inside a full one): a
dynamic scope, like torch's grad mode, whose value belongs to the thread running the recompute (the autograd
engine's, for CUDA tensors), not a count shared by the process."""


def recomputing() -> bool:
    """True inside a recompute of ``checkpoint``: the forward runs again in the backward pass. What a forward counts
    (the MoE layers' statistics of the step) is counted once, outside it."""
    return _RECOMPUTES.get() > 0
