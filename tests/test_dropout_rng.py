"""Dropout random streams (model/random.py): which stream draws which mask, recompute, and resume.

- single process: the tensor-parallel stream is kept apart from torch's default one; recomputation (a checkpointed
  block, and each model.recompute mode) draws the forward's masks from both streams (gradients bitwise equal to no
  recomputation), which plain torch.utils.checkpoint does not do for the tensor-parallel stream;
- TP 2 x PP 2 (4 processes, gloo, the real DeepSpeed pipeline with full recomputation, dropout 0.1): the
  attention dropout draws from a different generator state on every TP rank and stage, the replicated dropouts draw
  the same masks on the TP ranks of a stage, and a resume from the project's checkpoint replays the losses bitwise,
  which it no longer does when either stream is re-seeded instead of restored;
- then, in the same processes, with sequence parallelism: the embedding and hidden dropouts act on each TP rank's
  own positions and draw from the tensor-parallel stream, so their masks differ between the TP ranks of a stage.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from model.config import ParallelConfig
from model.gpt import HiddenDropout, TransformerLayer
from model.parallel import ParallelContext
from model.random import RNGStream, checkpoint, default_stream_seed, tensor_parallel_stream_seed
from tests.distributed import run_distributed
from tests.test_model_parallel import SEED, deepspeed_config, micro_batches, model_config

DROPOUT = 0.1


def test_seeds_follow_megatron():
    ctx = ParallelContext(tensor_parallel_size=2, tensor_parallel_rank=1, pipeline_parallel_size=4,
                          pipeline_parallel_rank=3)
    assert default_stream_seed(SEED, ctx) == SEED + 300
    assert tensor_parallel_stream_seed(SEED, ctx) == SEED + 300 + 2718 + 1


def test_fork_keeps_the_default_stream_apart():
    torch.manual_seed(0)
    stream = RNGStream(7)
    with stream.fork():
        first = torch.rand(5)
    after_fork = torch.rand(5)
    torch.manual_seed(0)
    assert torch.equal(after_fork, torch.rand(5))  # the default stream went on as if there were no fork
    torch.manual_seed(7)
    assert torch.equal(first, torch.rand(5))  # the stream is seeded with its own seed
    with stream.fork():
        second = torch.rand(5)
    assert torch.equal(second, torch.rand(5))  # and continues where it stopped
    saved = stream.state_dict()
    with stream.fork():
        third = torch.rand(5)
    stream.load_state_dict(saved)
    with stream.fork():
        assert torch.equal(third, torch.rand(5))


def _layer_step(layer: TransformerLayer, forward) -> list[torch.Tensor]:
    """One forward and backward from fixed stream states; returns output, gradients and both streams' end states."""
    torch.manual_seed(5)
    layer.attention.rng.load_state_dict(RNGStream(7).state_dict())
    layer.zero_grad()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 64, generator=generator).requires_grad_()
    out = forward(x)
    (out * torch.randn(out.shape, generator=generator)).sum().backward()
    return [out.detach(), x.grad, *[p.grad for p in layer.parameters()], torch.get_rng_state(),
            layer.attention.rng.state_dict()["cpu"]]


def test_recompute_draws_the_forward_masks():
    config = model_config(hidden_dropout=DROPOUT, attention_dropout=DROPOUT)
    layer = TransformerLayer(config, ParallelContext(), SEED, 1, RNGStream(0))
    plain = _layer_step(layer, layer)
    recomputed = _layer_step(layer, partial(checkpoint, layer.attention.rng, layer))
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed, strict=True))
    # torch's checkpoint alone restores the default stream only: the recomputed attention draws other masks.
    torch_only = _layer_step(layer, partial(torch.utils.checkpoint.checkpoint, layer, use_reentrant=False))
    assert torch.equal(plain[0], torch_only[0]) and not torch.equal(plain[1], torch_only[1])


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_each_recompute_mode_draws_the_forward_masks(recompute):
    """model.recompute inside the block: outputs, gradients and both streams' end states bitwise those of "none"."""
    config = model_config(hidden_dropout=DROPOUT, attention_dropout=DROPOUT)
    plain = TransformerLayer(config, ParallelContext(), SEED, 1, RNGStream(0))
    layer = TransformerLayer(model_config(hidden_dropout=DROPOUT, attention_dropout=DROPOUT, recompute=recompute),
                             ParallelContext(), SEED, 1, RNGStream(0))
    assert layer.recompute == recompute
    assert all(torch.equal(a, b) for a, b in zip(_layer_step(plain, plain), _layer_step(layer, layer), strict=True))


def _train_step(engine, ctx, step: int) -> float:
    data = micro_batches(step, model_config().seq_length, ctx.data_parallel_rank, ctx.data_parallel_size)
    return engine.train_batch(data_iter=data).item()


def _observed_step(engine, ctx, step: int) -> tuple[float, list[torch.Tensor], list[torch.Tensor]]:
    """A training step that records the generator state each SDPA draws its attention dropout from (inside the
    tensor-parallel region) and the mask of every hidden dropout (replicated activations, or sequence shards); with
    full recomputation the recompute records again."""
    attention_states, replicated_masks = [], []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        attention_states.append(torch.get_rng_state())
        return sdpa(*args, **kwargs)

    hooks = [module.register_forward_hook(lambda module, inputs, output: replicated_masks.append(output == 0))
             for module in engine.module.modules() if isinstance(module, HiddenDropout)]
    F.scaled_dot_product_attention = recording_sdpa
    try:
        loss = _train_step(engine, ctx, step)
    finally:
        F.scaled_dot_product_attention = sdpa
        for hook in hooks:
            hook.remove()
    return loss, attention_states, replicated_masks


def _train_save_resume(directory: str) -> dict:
    from training.checkpoint import load_checkpoint, save_checkpoint
    from training.engine import build_engine

    config = model_config(hidden_dropout=DROPOUT, attention_dropout=DROPOUT, recompute="full")
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    engine, ctx = build_engine(config, parallel, deepspeed_config("fp32"), SEED)
    stream = engine.module.tensor_parallel_rng
    result = {"tp": ctx.tensor_parallel_rank, "pp": ctx.pipeline_parallel_rank, "default_seed": torch.initial_seed(),
              "tensor_parallel_seed": stream.seed}
    _, result["attention_states"], result["replicated_masks"] = _observed_step(engine, ctx, 0)
    save_checkpoint(engine, directory, 1, client_state={})
    result["continued"] = [_train_step(engine, ctx, step) for step in (1, 2)]
    load_checkpoint(engine, directory)
    result["replayed"] = [_train_step(engine, ctx, step) for step in (1, 2)]
    load_checkpoint(engine, directory)
    torch.manual_seed(999)
    result["default_reseeded"] = _train_step(engine, ctx, 1)
    load_checkpoint(engine, directory)
    stream.load_state_dict(RNGStream(999).state_dict())
    result["tensor_parallel_reseeded"] = _train_step(engine, ctx, 1)
    del engine
    sequence_parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=True)
    engine, ctx = build_engine(config, sequence_parallel, deepspeed_config("fp32"), SEED)
    _, _, result["shard_masks"] = _observed_step(engine, ctx, 0)
    return result


@pytest.mark.distributed
def test_streams_at_tp2_pp2_and_bitwise_resume(tmp_path):
    ranks = run_distributed(4, _train_save_resume, str(tmp_path))
    for rank in ranks:
        assert rank["default_seed"] == SEED + 100 * rank["pp"]
        assert rank["tensor_parallel_seed"] == SEED + 100 * rank["pp"] + 2718 + rank["tp"]
        assert len(rank["attention_states"]) >= 2 * 4  # 2 blocks x 4 micro-batches, and their recomputes
    # Attention dropout: no generator state is shared by two ranks, whether TP ranks of a stage or two stages.
    for i, first in enumerate(ranks):
        for second in ranks[i + 1:]:
            assert not any(torch.equal(a, b) for a in first["attention_states"] for b in second["attention_states"])
    # Replicated activations: the same masks on the TP ranks of a stage, and dropout really drops about 10 %.
    for stage in (0, 1):
        tp0, tp1 = (next(r for r in ranks if (r["pp"], r["tp"]) == (stage, tp)) for tp in (0, 1))
        assert len(tp0["replicated_masks"]) == len(tp1["replicated_masks"]) > 0
        assert all(torch.equal(a, b) for a, b in zip(tp0["replicated_masks"], tp1["replicated_masks"], strict=True))
        dropped = torch.cat([mask.flatten() for mask in tp0["replicated_masks"]]).float().mean().item()
        assert 0.07 < dropped < 0.13
    # Sequence parallelism: each TP rank drops its own positions (half the sequence) with its own stream's masks.
    for stage in (0, 1):
        tp0, tp1 = (next(r for r in ranks if (r["pp"], r["tp"]) == (stage, tp)) for tp in (0, 1))
        assert len(tp0["shard_masks"]) == len(tp1["shard_masks"]) == len(tp0["replicated_masks"])
        assert all(mask.shape[1] == model_config().seq_length // 2 for mask in tp0["shard_masks"])
        assert not any(torch.equal(a, b) for a, b in zip(tp0["shard_masks"], tp1["shard_masks"], strict=True))
        dropped = torch.cat([mask.flatten() for mask in tp0["shard_masks"] + tp1["shard_masks"]]).float().mean()
        assert 0.07 < dropped.item() < 0.13
    # Resume: the losses after loading the checkpoint are the losses after saving it, bit for bit; re-seeding either
    # stream instead of restoring it changes them.
    for rank in ranks:
        assert rank["replayed"] == rank["continued"] == ranks[0]["continued"]
        assert rank["default_reseeded"] != rank["continued"][0]
        assert rank["tensor_parallel_reseeded"] != rank["continued"][0]
