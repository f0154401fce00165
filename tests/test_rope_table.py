"""RoPE's cos and sin table (model/layers.py RotaryEmbedding): made once per micro-batch for a stage's blocks, from
frequencies that live on the module's device in fp32, with the bits of one table per block.

    what                                                    checked by
    one table per micro-batch, whatever the blocks          counting torch's cos kernels in a forward (and a
      (positions 0 .. s-1, packed ids, a full recompute,     backward): 1 per micro-batch; a KV cache's decode
      a KV cache growing)                                    steps, 1 each
    the same bits as one RotaryEmbedding per block          logits and every gradient, fp32 and bf16, plain, YaRN,
                                                             packed documents, full recompute
    the frequencies: a buffer, fp32 after a bf16 cast, in   the cast model's buffers; its state_dict
      no checkpoint
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.attention import kv_caches
from model.config import preset
from model.gpt import GPT
from model.layers import RotaryEmbedding, rope_inverse_frequencies

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
SEQUENCE, BATCH = 12, 2


def _config(**overrides):
    return preset("llama-tiny", num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  ffn_hidden_size=96, seq_length=SEQUENCE, vocab_size=300, **overrides)


def _batch(seed: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    tokens = torch.randint(0, 300, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(SEQUENCE).expand(BATCH, SEQUENCE)
    if not packed:
        return tokens, positions, None
    segments = (positions >= 5 + seed % 3).long()  # two documents a sample; the second starts at 5, 6 or 7
    return tokens, positions - segments * (5 + seed % 3), segments


class _CosKernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.cos.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("packed", [False, True], ids=["positions", "packed"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_stage_makes_cos_and_sin_once_per_micro_batch(recompute, packed):
    model = GPT(_config(recompute=recompute)).train()
    rotaries = {id(layer.attention.rotary) for layer in model.layers}
    assert len(rotaries) == 1  # the blocks share one RotaryEmbedding
    with _CosKernels() as kernels:
        for seed in (1, 2):  # two micro-batches, forward then backward each
            tokens, positions, segments = _batch(seed, packed)
            model(tokens, positions, segments)[..., :300].float().square().mean().backward()
    # without packed ids both micro-batches have positions 0 .. s-1: the table of the first serves the second
    assert kernels.count == (2 if packed else 1)


def test_generation_makes_one_table_per_decode_step():
    model = GPT(_config()).eval()
    tokens, positions, _ = _batch(3, False)
    with torch.no_grad(), kv_caches(model), _CosKernels() as kernels:
        model(tokens, positions)  # the prompt
        for step in range(3):  # each new token at position s + step: a new offset, one table for the 4 blocks
            model(tokens[:, :1], positions[:, :1] + SEQUENCE + step)
    assert kernels.count == 4


def _own_tables(model: GPT) -> GPT:
    config = model.layers[0].attention.rotary
    for layer in model.layers:  # what each attention did before: a RotaryEmbedding of its own
        layer.attention.rotary = RotaryEmbedding(config.head_dim, config.theta, config.scaling)
    return model


def _logits_and_gradients(model: GPT, packed: bool) -> list[torch.Tensor]:
    results = []
    for seed in (4, 5):
        tokens, positions, segments = _batch(seed, packed)
        logits = model(tokens, positions, segments)[..., :300]  # the padded vocabulary's logits are -inf
        logits.float().square().mean().backward()
        results.append(logits.detach())
    return results + [p.grad for p in model.parameters()]


@pytest.mark.parametrize(("dtype", "scaling", "recompute", "packed"), [
    (torch.float32, None, "none", False), (torch.float32, YARN, "full", True), (torch.bfloat16, YARN, "none", True),
    (torch.bfloat16, None, "selective", False)])
def test_the_shared_table_gives_the_bits_of_one_table_per_block(dtype, scaling, recompute, packed):
    config = _config(rope_scaling=scaling, recompute=recompute)
    shared = _logits_and_gradients(GPT(config).to(dtype).train(), packed)
    separate = _logits_and_gradients(_own_tables(GPT(config)).to(dtype).train(), packed)
    assert len(shared) == len(separate) > 10
    for ours, theirs in zip(shared, separate, strict=True):
        assert ours.dtype == dtype and torch.equal(ours, theirs)


def test_the_frequencies_are_an_fp32_buffer_out_of_checkpoints():
    config = _config(rope_scaling=YARN)
    model = GPT(config).to(torch.bfloat16)
    rotary = model.layers[0].attention.rotary
    expected = rope_inverse_frequencies(config.head_dim, config.rope_theta, YARN)
    assert any(buffer is rotary.inv_freq for buffer in model.buffers())  # moved with the module by module.to(device)
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, expected)  # bf16 cast: kept fp32
    assert model.layers[0].ln1.weight.dtype == torch.bfloat16
    assert not [key for key in model.state_dict() if "inv_freq" in key]
    assert model.to("meta").layers[0].attention.rotary.inv_freq.is_meta
