"""Packed documents (data.reset_attention_mask, data.reset_position_ids): the loader's documents and positions are
Megatron-LM's, and a packed sample computes what its documents compute one by one.

The reference of every check here is the model run on each document alone, at positions 0 .. len - 1: what a
packed sample must equal (per-token losses within 1e-6, fp32), and a document's logits must not move, by one bit,
when another document of the same sample changes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.loader import MicroBatchLoader, documents
from model.attention import document_mask
from model.config import preset
from model.gpt import GPT

EOD = 50256
ARCHITECTURES = {
    "gpt2 (learned positions)": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=24),
    "llama (RoPE, GQA)": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              seq_length=24, position_embedding="rope", norm="rmsnorm", mlp="swiglu",
                              tie_word_embeddings=False, ffn_hidden_size=128),
}


def with_ends(lengths: list[int], seed: int) -> torch.Tensor:
    """One sample: documents of random tokens (below 500) of these lengths, each closed by the end token."""
    generator = torch.Generator().manual_seed(seed)
    parts = [torch.cat([torch.randint(0, 500, (length - 1,), generator=generator), torch.tensor([EOD])])
             for length in lengths]
    return torch.cat(parts)


@pytest.mark.parametrize("tokens", [
    [5, EOD, 7, 8, EOD, 9, 10, 11, 12, EOD],  # ends inside and at the very end
    [EOD, 1, 2, 3, 4, 5, EOD, EOD, 6, 7],  # an end first, two ends in a row
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],  # no end: one document
])
def test_documents_and_positions_are_megatron_lms(tokens) -> None:
    """megatron-core's own _get_ltor_masks_and_position_ids on the same tokens: the same attention mask (its True is
    'masked') and the same reset positions."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = torch.tensor(tokens)
    segment_ids, positions = documents(tokens[None], EOD)
    mask, _, megatron_positions = _get_ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False,
        create_attention_mask=True)
    assert torch.equal(document_mask(segment_ids)[0], ~mask)
    assert torch.equal(positions[0], megatron_positions)


class Packed:
    """Samples of seq_length + 1 tokens: documents closed by the end token, some cut at the sample's end."""

    def __init__(self, seq_length: int) -> None:
        self.samples = [with_ends(lengths, seed)[:seq_length + 1].numpy()
                        for seed, lengths in enumerate([[4, 9, 13], [25], [1, 6, 6, 3, 9], [12, 14]])]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.samples[index]


def test_the_loader_yields_each_flag_alone() -> None:
    """Each flag acts alone, Megatron's way; with neither, the batch is the two input tensors of before."""
    dataset = Packed(24)

    def first(**flags):
        return next(MicroBatchLoader(dataset, 4, 0, 1, eod_token_id=EOD, document_boundaries="eod_token", **flags))[0]

    tokens, plain_positions = first()
    segment_ids, positions = documents(tokens, EOD)
    assert torch.equal(plain_positions, torch.arange(24).expand(4, 24))
    both = first(reset_attention_mask=True, reset_position_ids=True)
    assert torch.equal(both[0], tokens) and torch.equal(both[1], positions) and torch.equal(both[2], segment_ids)
    masks_only = first(reset_attention_mask=True)
    assert torch.equal(masks_only[1], plain_positions) and torch.equal(masks_only[2], segment_ids)
    positions_only = first(reset_position_ids=True)
    assert torch.equal(positions_only[1], positions) and not positions_only[2].any()
    assert segment_ids[0].tolist() == [0] * 4 + [1] * 9 + [2] * 11 and positions[0, 4:14].tolist() == [*range(9), 0]
    with pytest.raises(ValueError, match="reset_attention_mask needs eod_token_id"):
        MicroBatchLoader(dataset, 1, 0, 1, reset_attention_mask=True, document_boundaries="eod_token")
    with pytest.raises(ValueError, match=r"reads each sample's documents from the dataset, and Packed has none "
                                         r"\(sample_documents\).*\"eod_token\" for Megatron-LM's end-token rule"):
        MicroBatchLoader(dataset, 1, 0, 1, eod_token_id=EOD, reset_attention_mask=True)


def document_by_document(model: GPT, tokens: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """The logits of each document run alone at positions 0 .. len - 1, put back in place: (b, s, V)."""
    rows = []
    for row, segments in zip(tokens, segment_ids, strict=True):
        pieces = []
        for segment in segments.unique_consecutive():
            document = row[segments == segment][None]
            pieces.append(model(document, torch.arange(document.shape[1])[None]))
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_packed_equals_each_document_alone(architecture) -> None:
    """Per-token losses and the gradients of a packed micro-batch equal those of its documents run one by one."""
    config = preset("tiny", **ARCHITECTURES[architecture])
    torch.manual_seed(0)
    model = GPT(config, seed=7)
    (tokens, positions, segment_ids), (labels, _) = next(MicroBatchLoader(
        Packed(config.seq_length), 4, 0, 1, eod_token_id=EOD, reset_attention_mask=True, reset_position_ids=True,
        document_boundaries="eod_token"))

    def per_token_losses(logits):
        return F.cross_entropy(logits[..., :config.vocab_size].flatten(0, 1), labels.flatten(), reduction="none")

    packed = per_token_losses(model(tokens, positions, segment_ids))
    packed.sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = per_token_losses(document_by_document(model, tokens, segment_ids))
    alone.sum().backward()
    # within 1e-6 of each loss (about 11 nats here, where one fp32 step is 9.5e-7): 2 steps at most were seen
    assert ((packed - alone).abs() / alone).max().item() < 1e-6
    for parameter, packed_grad in zip(model.parameters(), packed_grads, strict=True):
        # sums of 96 tokens' fp32 contributions in two orders: at most 2.5e-6 of the largest entry was seen
        scale = parameter.grad.abs().max().item()
        assert (packed_grad - parameter.grad).abs().max().item() <= 1e-5 * scale
    whole = per_token_losses(model(tokens, torch.arange(config.seq_length).expand_as(tokens)))
    assert (whole - alone).abs().max().item() > 1e-3  # without masks the documents see each other


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_document_never_sees_another(architecture) -> None:
    """Changing the first document of a sample leaves the second's logits bit-identical (and changes its own)."""
    config = preset("tiny", **ARCHITECTURES[architecture])
    model = GPT(config, seed=7)
    first, second = with_ends([10], 1), with_ends([14], 2)
    changed = with_ends([10], 3)
    tokens = torch.stack([torch.cat([first, second]), torch.cat([changed, second])])
    segment_ids, positions = documents(tokens, EOD)
    with torch.no_grad():
        logits = model(tokens, positions, segment_ids)
    assert torch.equal(logits[0, 10:], logits[1, 10:])
    assert not torch.equal(logits[0, :10], logits[1, :10])


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_flex_attention_computes_the_sdpa_reference(architecture) -> None:
    """model.attention_backend "flex" (FlexAttention's block mask, the GPU kernel of document masks) gives the
    logits of the SDPA reference. Forward only: torch has no FlexAttention backward on CPU (the backward is checked
    on a GPU by scripts/gpu_smoke.sh), and training with it on CPU is refused at start-up, naming the field."""
    fields = ARCHITECTURES[architecture]
    reference, flex = (GPT(preset("tiny", **fields, attention_backend=backend), seed=7).eval()
                       for backend in ("sdpa", "flex"))
    (tokens, positions, segment_ids), _ = next(MicroBatchLoader(
        Packed(24), 4, 0, 1, eod_token_id=EOD, reset_attention_mask=True, reset_position_ids=True,
        document_boundaries="eod_token"))
    with torch.no_grad():
        expected, found = reference(tokens, positions, segment_ids), flex(tokens, positions, segment_ids)
    vocab = reference.word_embeddings.vocab_size  # the padded rows are -inf in both
    assert (found - expected)[..., :vocab].abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="model.attention_backend \"flex\" has no attention dropout"):
        preset("tiny", attention_backend="flex", attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"model.attention_backend must be one of \('auto', 'blockwise', 'sdpa', 'flex'\), got 'flash'"):
        preset("tiny", attention_backend="flash")


def test_a_models_blocks_make_one_block_mask_per_micro_batch_and_models_share_none(monkeypatch) -> None:
    """The FlexAttention block mask is the model's (model/attention.py BlockMasks, shared by its blocks as RoPE's
    table is), not a module-level cache that every model of the process would share: made once per micro-batch for
    all the blocks, again for a new micro-batch, and never handed to another model's blocks."""
    import torch.nn.attention.flex_attention as flex_module

    made = []
    real = flex_module.create_block_mask
    monkeypatch.setattr(flex_module, "create_block_mask", lambda *a, **k: made.append(1) or real(*a, **k))
    first, second = (GPT(preset("tiny", attention_backend="flex"), seed=7).eval() for _ in range(2))
    assert len(first.layers) > 1 and len({id(layer.attention.block_masks) for layer in first.layers}) == 1
    assert first.layers[0].attention.block_masks is not second.layers[0].attention.block_masks
    (tokens, positions, segment_ids), _ = next(MicroBatchLoader(
        Packed(24), 4, 0, 1, eod_token_id=EOD, reset_attention_mask=True, reset_position_ids=True,
        document_boundaries="eod_token"))
    with torch.no_grad():
        first(tokens, positions, segment_ids)
        assert len(made) == 1  # one for the model's blocks
        second(tokens, positions, segment_ids)
        assert len(made) == 2  # the other model makes its own
        first(tokens, positions, segment_ids.clone())
        assert len(made) == 3  # a new micro-batch, a new mask


@pytest.mark.parametrize(("heads", "groups", "length", "documents", "max_scores"), [
    (4, 4, 64, 1, None),  # one document: plain causal attention, in one block
    (4, 2, 100, 7, 3000),  # GQA, documents of random lengths, blocks of 16 queries
    (6, 2, 257, 40, 5000),  # many short documents, a last block shorter than the others
    (2, 1, 300, 3, 1 << 22),  # multi-query, one block
])
def test_the_blockwise_kernel_is_the_sdpa_mask_within_fp32(monkeypatch, heads, groups, length, documents,
                                                           max_scores) -> None:
    """model/document_attention.py against SDPA with document_mask: outputs and the gradients of q, k and v within
    1e-6 of each tensor's largest entry (fp32: measured 2e-7 to 6e-7, the sums in another order)."""
    import model.document_attention as blockwise

    if max_scores is not None:
        monkeypatch.setattr(blockwise, "MAX_SCORES", max_scores)
    generator = torch.Generator().manual_seed(length)
    batch, width = 3, 8
    segment_ids = torch.sort(torch.randint(0, documents, (batch, length), generator=generator), dim=1).values
    q, k, v = (torch.randn(batch, n, length, width, generator=generator, requires_grad=True)
               for n in (heads, groups, groups))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(segment_ids), enable_gqa=heads > groups)
    found = blockwise.blockwise_document_attention(q, k, v, segment_ids)
    upstream = torch.randn(expected.shape, generator=generator)
    for reference, ours in zip((expected, *torch.autograd.grad(expected, (q, k, v), upstream)),
                               (found, *torch.autograd.grad(found, (q, k, v), upstream)), strict=True):
        assert (ours - reference).abs().max() <= 1e-6 * reference.abs().max()
    blocks = blockwise.query_blocks(blockwise.document_starts(segment_ids), heads)
    assert len(blocks) > 1 or max_scores in (None, 1 << 22)
    assert all(first <= start for start, _, first in blocks)


def test_the_default_kernel_of_document_masks() -> None:
    """model.attention_backend "auto": the blockwise kernel on CPU (FlexAttention on CUDA), SDPA's mask under
    attention dropout; the blockwise kernel refuses dropout as flex does; logits and gradients of a packed
    micro-batch through the model equal the SDPA mask's within 1e-6 (learned positions and RoPE with GQA)."""
    from model.attention import document_kernel

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [document_kernel("auto", device, dropout) for device, dropout in ((cpu, 0.0), (cuda, 0.0), (cpu, 0.1))] \
        == ["blockwise", "flex", "sdpa"]
    assert preset("tiny").attention_backend == "auto"
    with pytest.raises(ValueError, match="model.attention_backend \"blockwise\" has no attention dropout"):
        preset("tiny", attention_backend="blockwise", attention_dropout=0.1)
    (tokens, positions, segment_ids), (labels, _) = next(MicroBatchLoader(
        Packed(24), 4, 0, 1, eod_token_id=EOD, reset_attention_mask=True, reset_position_ids=True,
        document_boundaries="eod_token"))
    for fields in ARCHITECTURES.values():
        results = []
        for backend in ("sdpa", "blockwise"):
            model = GPT(preset("tiny", **fields, attention_backend=backend), seed=7)
            logits = model(tokens, positions, segment_ids)[..., :model.word_embeddings.vocab_size]
            F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
            results.append([logits.detach(), *(p.grad for p in model.parameters())])
        for reference, ours in zip(*results, strict=True):
            assert (ours - reference).abs().max() <= 1e-6 * reference.abs().max()


def _build_flex_engine() -> str:
    from model.config import ParallelConfig
    from tests.test_model_parallel import SEED, deepspeed_config
    from training.engine import build_engine

    try:
        build_engine(preset("tiny", attention_backend="flex"), ParallelConfig(), deepspeed_config("fp32"), SEED)
    except ValueError as error:
        return str(error)
    return "built"


def test_flex_training_on_cpu_is_refused_at_start_up() -> None:
    from tests.distributed import run_distributed

    [message] = run_distributed(1, _build_flex_engine)
    assert message.startswith("model.attention_backend \"flex\" trains on CUDA only: torch has no FlexAttention "
                              "backward on cpu; use \"sdpa\" here"), message
