"""A forward-only pipeline over this rank's stage: activations go stage to stage by plain point-to-point sends.

DeepSpeed's pipeline engine is built for training: its ``eval_batch`` returns outputs on the last stage only, caches
activation shapes between calls (``reset_activation_shape``), and has no KV cache. Inference here needs lengths that
change with every batch, a cache that grows one token at a time, and results on every rank; so it runs the stage's
own layers (the engine's ``forward_funcs``, or a stage built for evaluation, ``evaluation/loading.py``) and moves the
hidden state itself:

    who                         sends / receives                                   when
    stage p, TP rank t, DP d    its output (b, s, h) (with SP (b, s/R, h)) to       every forward (batch or token)
                                stage p + 1, TP rank t, same DP replica
    last stage, TP rank 0       each new token to every rank of its replica         every generated token
    (last stage, TP rank 0)s    their replica's results, to every rank              once per request list

Every rank of a replica walks the same batches in the same order (the requests and their split are known to all),
so a receiver knows the shape it receives: no shape handshake, and a new length costs nothing. The process groups
are the run's: the TP group for the sharded layers, the world group for the sends (global ranks from the
topology). The vocabulary-parallel log-likelihood and argmax never gather the vocabulary (model/layers.py).
Every tensor made here (token batches, positions, receive buffers, the broadcast token) is made on the stage's
device (``Stage.device``, common/device.py): a CPU tensor would meet a GPU stage, or an NCCL send, and fail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common import deepspeed_internals as ds_internals
from common.device import device_of
from model.attention import kv_caches
from model.config import ModelConfig
from model.layers import vocab_parallel_argmax, vocab_parallel_cross_entropy
from model.parallel import ParallelContext

IGNORE = -100


@dataclass
class Stage:
    """This rank's part of the model, forward only: its layers in order (the first takes (tokens, positions), the
    last returns this TP rank's logits (b, s, V/R)), the parallel context and the model's shape."""

    layers: list[Callable[[Any], Any]]
    module: nn.Module
    """The module holding the layers (train/eval mode, dtype, KV caches)."""
    ctx: ParallelContext
    config: ModelConfig

    @classmethod
    def of_engine(cls, engine, ctx: ParallelContext, config: ModelConfig) -> Stage:
        """The live training engine's stage (evaluation during training), its layers as the engine runs them."""
        return cls(ds_internals.stage_forward_functions(engine.module), engine.module, ctx, config)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """Where this stage runs: every tensor it meets (inputs, receive buffers, positions) is made there."""
        return device_of(self.module)

    def __call__(self, inputs: Any) -> Any:
        for layer in self.layers:
            inputs = layer(inputs)
        return inputs


def _rank_at(ctx: ParallelContext, pipe: int, model: int | None = None) -> int:
    """The global rank of pipeline stage ``pipe`` (and TP rank ``model``, default this one) in this DP replica."""
    if ctx.topology is None:
        return 0
    model = ctx.tensor_parallel_rank if model is None else model
    return ctx.topology.get_rank(pipe=pipe, data=ctx.data_parallel_rank, model=model)


class Pipeline:
    """Forward passes of one DP replica, results shared with every rank (module docstring)."""

    def __init__(self, stage: Stage) -> None:
        self.stage, self.ctx, self.config = stage, stage.ctx, stage.config
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    @property
    def sequence_multiple(self) -> int:
        """Sequences are padded to a multiple of this: TP with sequence parallelism (each rank holds s/R)."""
        return self.ctx.tensor_parallel_size if self.ctx.sequence_parallel else 1

    @property
    def is_result_rank(self) -> bool:
        """The rank whose results count: the last stage's TP rank 0 of its replica."""
        return self.ctx.is_last_stage and self.ctx.tensor_parallel_rank == 0

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """One forward of the replica on (b, s) tokens at (b, s) positions: this TP rank's logits (b, s, V/R) on the
        last stage, None on the others. Collective over the replica."""
        ctx, stage = self.ctx, self.stage
        if ctx.is_first_stage:
            inputs = (tokens, positions.clamp(max=self.config.max_position_embeddings - 1))  # padding may pass it
        else:
            b, s = tokens.shape
            inputs = torch.empty(b, s // self.sequence_multiple, self.config.hidden_size, dtype=stage.dtype,
                                 device=stage.device)
            dist.recv(inputs, src=_rank_at(ctx, ctx.pipeline_parallel_rank - 1))
        output = stage(inputs)
        if ctx.is_last_stage:
            return output
        dist.send(output.contiguous(), dst=_rank_at(ctx, ctx.pipeline_parallel_rank + 1))
        return None

    def token_log_likelihoods(self, tokens: torch.Tensor, labels: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """log p(label) and whether it is the argmax, (b, s) each, where ``labels`` is not IGNORE (0 and False
        elsewhere), on the last stage; None on the others. The vocabulary is never gathered."""
        b, s = tokens.shape
        positions = torch.arange(s, device=self.stage.device).expand(b, s)
        logits = self.logits(tokens, positions)
        if logits is None:
            return None
        vocab_start = self.ctx.tensor_parallel_rank * logits.shape[-1]
        group = self.ctx.tensor_parallel_group
        log_likelihood = -vocab_parallel_cross_entropy(logits, labels, group, vocab_start, IGNORE)
        greedy = vocab_parallel_argmax(logits, group, vocab_start) == labels
        return log_likelihood.masked_fill(labels == IGNORE, 0.0), greedy & (labels != IGNORE)

    def share(self, mine: dict[int, Any]) -> dict[int, Any]:
        """Every replica's results ({request index: result}, from its result rank) on every rank."""
        if not self.distributed:
            return dict(mine)
        gathered: list[dict[int, Any]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, mine if self.is_result_rank else {})
        return {index: result for part in gathered for index, result in part.items()}

    def broadcast_token(self, token: int | None) -> int:
        """The token the last stage chose, sent by its TP rank 0 to every rank of the replica (point to point)."""
        ctx = self.ctx
        if ctx.topology is None or not self.distributed:
            return int(token)
        source = _rank_at(ctx, ctx.pipeline_parallel_size - 1, 0)
        me = dist.get_rank()
        value = torch.tensor([token if token is not None else -1], dtype=torch.int64, device=self.stage.device)
        if me == source:
            for pipe in range(ctx.pipeline_parallel_size):
                for model in range(ctx.tensor_parallel_size):
                    if (rank := _rank_at(ctx, pipe, model)) != source:
                        dist.send(value, dst=rank)
        else:
            dist.recv(value, src=source)
        return int(value.item())

    def caches(self):
        """Empty KV caches on every attention of this stage, for one generation."""
        return kv_caches(self.stage.module)


def pad_batch(sequences: list[list[int]], device: torch.device, multiple: int = 1, pad_id: int = 0) -> torch.Tensor:
    """Right-padded (b, s) int64 on ``device`` (the stage's), s rounded up to ``multiple``: causal attention never
    lets a position see the padding after it, so the real positions compute what they would alone."""
    length = max(len(sequence) for sequence in sequences)
    length = -(-length // multiple) * multiple
    padded = [list(sequence) + [pad_id] * (length - len(sequence)) for sequence in sequences]
    return torch.tensor(padded, dtype=torch.int64, device=device)  # one copy to the device
