"""Each tensor-parallel layer at TP 2 and TP 4 against the same layer unsharded (TP 1 is plain PyTorch).

Every case returns, per rank, named tensors with their sharding ("replicated", or sharded along a dimension). The
test reassembles the shards and compares with the unsharded layer built from the same seed.

Exact comparisons (torch.equal), and why they are exact:
- initial weights: each index along the sharded dimension draws from its own generator (model/init.py);
- embedding forward and weight gradient: one rank contributes the row, the others add exact zeros;
- replicated results agree bitwise across ranks: gloo's all-reduce hands every rank the same sum.
Tolerant comparisons (rtol 1e-5, atol 1e-6 in fp32), and why:
- any result of an all-reduce (row-parallel output, column-parallel input gradient, the cross-entropy): R partial
  sums are added in another order than one long sum, which changes the last bits of an fp32 result;
- column-parallel outputs and weight gradients: BLAS may block a matmul differently for N/R rows than for N.

Sequence parallelism (the sp_* cases, in the same processes): the same layers with their activations outside the
TP matmuls split along the sequence (dim 1) equal the same unsharded layers. A replicated parameter's gradient is
then a partial sum over the ranks; after all_reduce_sequence_parallel_gradients every rank holds the whole sum.

Memory of the output head and the loss (single process, exact byte counts): the head allocates its matmul output and
nothing else, and the loss saves for backward the logits themselves (no copy) plus five per-token tensors.
benchmarks/bench_head_memory.py measures the peak at 1.3B scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import model.layers
from model.config import ParallelConfig
from model.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_sequence_parallel_gradients,
    vocab_parallel_cross_entropy,
)
from model.parallel import ParallelContext, build_parallel_context
from model.primitives import gather_from_tensor_parallel_region, scatter_to_tensor_parallel_region
from tests.distributed import run_distributed

B, S, K, N, VOCAB, PADDED = 2, 8, 16, 24, 50, 64  # S divides by TP 2 and 4
IGNORE = -100
REPLICATED = "replicated"


def _inputs(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _shard(full: torch.Tensor, ctx: ParallelContext, dim: int) -> torch.Tensor:
    return full.chunk(ctx.tensor_parallel_size, dim=dim)[ctx.tensor_parallel_rank].contiguous()


def _column(ctx: ParallelContext) -> dict:
    layer = ColumnParallelLinear(K, N, ctx, init_std=0.02, seed=11)
    x = _inputs(B, S, K, seed=1).requires_grad_()
    out = layer(x)
    (out * _shard(_inputs(B, S, N, seed=2), ctx, -1)).sum().backward()
    return {"weight": (layer.weight.detach(), 0, "exact"), "out": (out.detach(), -1, "close"),
            "grad_x": (x.grad, REPLICATED, "close"), "grad_weight": (layer.weight.grad, 0, "close"),
            "grad_bias": (layer.bias.grad, 0, "close")}


def _row(ctx: ParallelContext) -> dict:
    layer = RowParallelLinear(N, K, ctx, init_std=0.02, seed=12)
    with torch.no_grad():
        layer.bias.copy_(_inputs(K, seed=3))  # a non-zero bias: it must be added once, not R times
    x = _shard(_inputs(B, S, N, seed=4), ctx, -1).requires_grad_()
    out = layer(x)
    (out * _inputs(B, S, K, seed=5)).sum().backward()
    return {"weight": (layer.weight.detach(), 1, "exact"), "out": (out.detach(), REPLICATED, "close"),
            "grad_x": (x.grad, -1, "close"), "grad_weight": (layer.weight.grad, 1, "close"),
            "grad_bias": (layer.bias.grad, REPLICATED, "close")}


def _embedding(ctx: ParallelContext) -> dict:
    layer = VocabParallelEmbedding(PADDED, K, ctx, vocab_size=VOCAB, init_std=0.02, seed=13)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(6))
    out = layer(ids)
    (out * _inputs(B, S, K, seed=7)).sum().backward()
    return {"weight": (layer.weight.detach(), 0, "exact"), "out": (out.detach(), REPLICATED, "exact"),
            "grad_weight": (layer.weight.grad, 0, "exact")}


def _cross_entropy(ctx: ParallelContext) -> dict:
    logits = _shard(_inputs(B, S, PADDED, seed=8) * 3, ctx, -1).requires_grad_()
    labels = torch.randint(0, PADDED, (B, S), generator=torch.Generator().manual_seed(9))
    labels[0, 1] = labels[1, 3] = IGNORE
    vocab_start = ctx.tensor_parallel_rank * logits.shape[-1]
    loss = vocab_parallel_cross_entropy(logits, labels, ctx.tensor_parallel_group, vocab_start, IGNORE)
    (loss * _inputs(B, S, seed=10)).sum().backward()
    return {"loss": (loss.detach(), REPLICATED, "close"), "grad_logits": (logits.grad, -1, "close")}


Z_LOSS = 1e-2  # large enough that the z-loss term is a sizeable part of the objective and its gradient


def _z_loss(ctx: ParallelContext) -> dict:
    """The objective with the z-loss (model/loss.py) on vocabulary shards: the term as the trainer logs it, and the
    gradient of cross-entropy + z-loss."""
    from model.loss import GPTLoss

    logits = _shard(_inputs(B, S, PADDED, seed=8) * 3, ctx, -1).requires_grad_()
    labels = torch.randint(0, PADDED, (B, S), generator=torch.Generator().manual_seed(9))
    loss_mask = (_inputs(B, S, seed=11) > 0).float()
    objective = GPTLoss(ctx, Z_LOSS)
    objective.recording = True
    objective(logits, (labels, loss_mask)).backward()
    sums, min_log_z = objective.take()
    return {"z_term": (sums[1], REPLICATED, "close"), "min_log_z": (min_log_z, REPLICATED, "close"),
            "grad_logits": (logits.grad, -1, "close")}


def _z_loss_reference() -> dict:
    """coef x mean(logsumexp^2) over the masked tokens, computed unsharded with torch.logsumexp, and the gradient of
    cross-entropy + that term by autograd."""
    logits = (_inputs(B, S, PADDED, seed=8) * 3).requires_grad_()
    labels = torch.randint(0, PADDED, (B, S), generator=torch.Generator().manual_seed(9))
    loss_mask = (_inputs(B, S, seed=11) > 0).float()
    log_z = torch.logsumexp(logits, dim=-1)
    cross_entropy = F.cross_entropy(logits.reshape(-1, PADDED), labels.reshape(-1), reduction="none").view(B, S)
    z_term = Z_LOSS * (log_z.square() * loss_mask).sum() / loss_mask.sum()
    ((cross_entropy * loss_mask).sum() / loss_mask.sum() + z_term).backward()
    return {"z_term": z_term.detach(), "min_log_z": log_z.detach()[loss_mask > 0].min(), "grad_logits": logits.grad}


def _scatter_gather(ctx: ParallelContext) -> dict:
    x = _inputs(B, S, N, seed=14).requires_grad_()
    local = scatter_to_tensor_parallel_region(x, ctx.tensor_parallel_group)
    gathered = gather_from_tensor_parallel_region(local * 2.0, ctx.tensor_parallel_group)
    (gathered * _inputs(B, S, N, seed=15)).sum().backward()
    return {"local": (local.detach(), -1, "exact"), "gathered": (gathered.detach(), REPLICATED, "exact"),
            "grad_x": (x.grad, REPLICATED, "exact")}


SEQUENCE = 1  # the sequence dimension of (b, s, h)


def _sp_column(ctx: ParallelContext) -> dict:
    layer = ColumnParallelLinear(K, N, ctx, init_std=0.02, seed=11)
    x = _shard(_inputs(B, S, K, seed=1), ctx, SEQUENCE).requires_grad_()  # this rank's positions
    out = layer(x)  # the whole sequence, this rank's N/R features
    (out * _shard(_inputs(B, S, N, seed=2), ctx, -1)).sum().backward()
    return {"out": (out.detach(), -1, "close"), "grad_x": (x.grad, SEQUENCE, "close"),
            "grad_weight": (layer.weight.grad, 0, "close"), "grad_bias": (layer.bias.grad, 0, "close")}


def _sp_row(ctx: ParallelContext) -> dict:
    layer = RowParallelLinear(N, K, ctx, init_std=0.02, seed=12)
    with torch.no_grad():
        layer.bias.copy_(_inputs(K, seed=3))
    x = _shard(_inputs(B, S, N, seed=4), ctx, -1).requires_grad_()
    out = layer(x)  # this rank's positions
    (out * _shard(_inputs(B, S, K, seed=5), ctx, SEQUENCE)).sum().backward()
    all_reduce_sequence_parallel_gradients(layer, ctx.tensor_parallel_group)  # the bias saw only our positions
    return {"out": (out.detach(), SEQUENCE, "close"), "grad_x": (x.grad, -1, "close"),
            "grad_weight": (layer.weight.grad, 1, "close"), "grad_bias": (layer.bias.grad, REPLICATED, "close")}


def _sp_embedding(ctx: ParallelContext) -> dict:
    layer = VocabParallelEmbedding(PADDED, K, ctx, vocab_size=VOCAB, init_std=0.02, seed=13)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(6))
    out = layer(ids)  # reduce-scattered: this rank's positions, one rank's row plus exact zeros
    (out * _shard(_inputs(B, S, K, seed=7), ctx, SEQUENCE)).sum().backward()
    return {"out": (out.detach(), SEQUENCE, "exact"), "grad_weight": (layer.weight.grad, 0, "exact")}


def _head(ctx: ParallelContext) -> dict:
    """The output head: hidden (b, s, h), or this rank's positions with sequence parallelism, -> (b, s, V/R)."""
    layer = VocabParallelEmbedding(PADDED, K, ctx, vocab_size=VOCAB, init_std=0.02, seed=13)
    hidden_sharding = SEQUENCE if ctx.sequence_parallel else REPLICATED
    hidden = _inputs(B, S, K, seed=16)
    hidden = (_shard(hidden, ctx, SEQUENCE) if ctx.sequence_parallel else hidden).requires_grad_()
    logits = layer.logits(hidden)
    real = logits[..., :VOCAB - layer.vocab_start] if layer.vocab_start < VOCAB else logits[..., :0]
    (real * _shard(_inputs(B, S, PADDED, seed=17), ctx, -1)[..., :real.shape[-1]]).sum().backward()
    return {"logits": (logits.detach(), -1, "close"), "grad_hidden": (hidden.grad, hidden_sharding, "close"),
            "grad_weight": (layer.weight.grad, 0, "close")}


def _norms(ctx: ParallelContext) -> dict:
    """LayerNorm and RMSNorm on (b, s, h), or on this rank's positions: weight (and bias) gradients summed over TP."""
    torch.manual_seed(18)
    norms = torch.nn.ModuleDict({"layernorm": torch.nn.LayerNorm(K), "rmsnorm": RMSNorm(K, eps=1e-5)})
    with torch.no_grad():
        for parameter in norms.parameters():
            parameter.add_(_inputs(*parameter.shape, seed=19))
    sharding = SEQUENCE if ctx.sequence_parallel else REPLICATED
    x = _inputs(B, S, K, seed=20)
    x = (_shard(x, ctx, SEQUENCE) if ctx.sequence_parallel else x).requires_grad_()
    target = _inputs(B, S, K, seed=21)
    target = _shard(target, ctx, SEQUENCE) if ctx.sequence_parallel else target
    (norms["layernorm"](x) * target).sum().backward()
    (norms["rmsnorm"](x) * target * 2).sum().backward()
    if ctx.sequence_parallel:
        all_reduce_sequence_parallel_gradients(norms, ctx.tensor_parallel_group)
    return {"grad_x": (x.grad, sharding, "close"),
            "ln_grad_weight": (norms["layernorm"].weight.grad, REPLICATED, "close"),
            "ln_grad_bias": (norms["layernorm"].bias.grad, REPLICATED, "close"),
            "rms_grad_weight": (norms["rmsnorm"].weight.grad, REPLICATED, "close")}


CASES = {"column": _column, "row": _row, "embedding": _embedding, "cross_entropy": _cross_entropy, "z_loss": _z_loss,
         "scatter_gather": _scatter_gather, "head": _head, "norms": _norms}
# The same layers with sequence parallelism, checked against the same unsharded references.
SEQUENCE_PARALLEL_CASES = {"sp_column": (_sp_column, "column"), "sp_row": (_sp_row, "row"),
                           "sp_embedding": (_sp_embedding, "embedding"), "sp_head": (_head, "head"),
                           "sp_norms": (_norms, "norms")}


def _all_cases(tensor_parallel_size: int) -> dict:
    import dataclasses

    ctx = build_parallel_context(ParallelConfig(tensor_parallel_size=tensor_parallel_size))
    results = {name: case(ctx) for name, case in CASES.items()}
    sequence_parallel = dataclasses.replace(ctx, sequence_parallel=True)
    results.update({name: case(sequence_parallel) for name, (case, _) in SEQUENCE_PARALLEL_CASES.items()})
    return results


def _cross_entropy_reference() -> dict:
    """F.cross_entropy on the full logits: the ground truth for the vocab-parallel loss."""
    logits = (_inputs(B, S, PADDED, seed=8) * 3).requires_grad_()
    labels = torch.randint(0, PADDED, (B, S), generator=torch.Generator().manual_seed(9))
    labels[0, 1] = labels[1, 3] = IGNORE
    loss = F.cross_entropy(logits.reshape(-1, PADDED), labels.reshape(-1), reduction="none",
                           ignore_index=IGNORE).view(B, S)
    (loss * _inputs(B, S, seed=10)).sum().backward()
    return {"loss": loss.detach(), "grad_logits": logits.grad}


@pytest.fixture(scope="module")
def references() -> dict:
    refs = {name: {k: v[0] for k, v in case(ParallelContext()).items()} for name, case in CASES.items()}
    refs["cross_entropy_torch"] = _cross_entropy_reference()
    refs["z_loss_torch"] = _z_loss_reference()
    return refs


def test_tp1_z_loss_equals_torch(references):
    ours, torch_ref = references["z_loss"], references["z_loss_torch"]
    assert ours["z_term"] > 0.1  # log Z about 5 here: the term is not negligible
    for name in ("z_term", "min_log_z", "grad_logits"):
        torch.testing.assert_close(ours[name], torch_ref[name], rtol=1e-6, atol=1e-7, msg=name)


def test_tp1_cross_entropy_equals_torch(references):
    ours, torch_ref = references["cross_entropy"], references["cross_entropy_torch"]
    torch.testing.assert_close(ours["loss"], torch_ref["loss"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours["grad_logits"], torch_ref["grad_logits"], rtol=1e-6, atol=1e-7)
    assert torch.all(ours["loss"][0, 1] == 0) and torch.all(ours["grad_logits"][0, 1] == 0)  # ignored position


class _NewStorageBytes(TorchDispatchMode):
    """Bytes of the new storage that the ops run under it return (views and in-place results share their input's)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


def test_head_fills_the_padded_rows_in_place():
    """The padded rows' logits are -inf, written into the matmul's output (no copy in the forward, no extra tensor in
    the backward), and through the cross-entropy they change no gradient: padded rows of the weight get exactly 0."""
    layer = VocabParallelEmbedding(PADDED, K, ParallelContext(), vocab_size=VOCAB, init_std=0.02, seed=13)
    hidden = _inputs(B, S, K, seed=16).requires_grad_()
    labels = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(9))
    with _NewStorageBytes() as allocated:
        logits = layer.logits(hidden)
    assert allocated.bytes == B * S * PADDED * 4  # the matmul's output, and no copy of it
    assert torch.all(logits[..., VOCAB:] == float("-inf"))
    assert torch.equal(logits[..., :VOCAB], F.linear(hidden, layer.weight[:VOCAB]))
    assert logits.grad_fn.name() != "CopySlices"  # autograd would copy the whole gradient to zero the padded columns
    vocab_parallel_cross_entropy(logits, labels, None, 0).sum().backward()
    assert torch.all(layer.weight.grad[VOCAB:] == 0)

    real_weight = layer.weight.detach()[:VOCAB].clone().requires_grad_()
    real_hidden = hidden.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(real_hidden, real_weight).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum").backward()
    torch.testing.assert_close(layer.weight.grad[:VOCAB], real_weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(hidden.grad, real_hidden.grad, rtol=1e-5, atol=1e-7)


PER_TOKEN_SAVED_BYTES = 4 + 4 + 8 + 1 + 1  # global max, sum of exps (fp32), local label (int64), two bool masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_saves_only_the_logits_and_per_token_tensors(dtype):
    """Before issue 12 the loss saved an fp32 softmax beside its inputs (and its backward cloned it); now the only
    full-size tensor it saves is its input, which the pipeline engine holds until the backward anyway."""
    logits = (_inputs(B, S, PADDED, seed=8) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, PADDED, (B, S), generator=torch.Generator().manual_seed(9))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = vocab_parallel_cross_entropy(logits, labels, None, 0, IGNORE)
    full_size = [t for t in saved if t.numel() == logits.numel()]
    assert len(full_size) == 1 and full_size[0].data_ptr() == logits.data_ptr() and full_size[0].dtype == dtype
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert saved_bytes == logits.numel() * logits.element_size() + B * S * PER_TOKEN_SAVED_BYTES
    loss.sum().backward()
    assert logits.grad.dtype == dtype


def test_cross_entropy_in_chunks_changes_no_bit(monkeypatch):
    """The loss works on row chunks of the logits; chunks of 3 rows give the bits of one chunk of all B x S rows."""
    def loss_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
        logits = (_inputs(B, S, PADDED, seed=8) * 3).to(torch.bfloat16).requires_grad_()
        labels = torch.randint(0, PADDED, (B, S), generator=torch.Generator().manual_seed(9))
        labels[0, 1] = IGNORE
        loss = vocab_parallel_cross_entropy(logits, labels, None, 0, IGNORE)
        (loss * _inputs(B, S, seed=10)).sum().backward()
        return loss.detach(), logits.grad

    whole = loss_and_grad()
    monkeypatch.setattr(model.layers, "LOSS_CHUNK_ELEMENTS", 3 * PADDED)
    chunked = loss_and_grad()
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


@pytest.mark.distributed
@pytest.mark.parametrize("tensor_parallel_size", [2, 4])
def test_layers_match_unsharded(tensor_parallel_size, references):
    per_rank = run_distributed(tensor_parallel_size, _all_cases, tensor_parallel_size)
    references = {**references, "cross_entropy": references["cross_entropy_torch"], "z_loss": references["z_loss_torch"],
                  **{name: references[unsharded] for name, (_, unsharded) in SEQUENCE_PARALLEL_CASES.items()}}
    for case in [*CASES, *SEQUENCE_PARALLEL_CASES]:
        for name, (_, sharding, comparison) in per_rank[0][case].items():
            shards = [rank_result[case][name][0] for rank_result in per_rank]
            if sharding == REPLICATED:
                for other in shards[1:]:
                    assert torch.equal(shards[0], other), f"{case}.{name} differs across TP ranks"
                assembled = shards[0]
            else:
                assembled = torch.cat(shards, dim=sharding)
            expected = references[case][name]
            where = f"{case}.{name} at TP {tensor_parallel_size}"
            if comparison == "exact":
                assert torch.equal(assembled, expected), where
            else:
                torch.testing.assert_close(assembled, expected, rtol=1e-5, atol=1e-6, msg=where)


def _send_forward_then_backward() -> dict:
    """Two stages as DeepSpeed's pipeline joins them on gloo: stage 0 sends its output with dist.broadcast (the
    in-place op whose missing autograd kernel torch warns about), stage 1 returns the output's gradient the same way,
    and stage 0 runs torch.autograd.backward from it."""
    import warnings

    import torch.distributed as dist

    rank = dist.get_rank()
    weight = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
    buffer = torch.empty(6)
    with warnings.catch_warnings(record=True) as caught:  # keeps the filters init_distributed installed
        if rank == 0:
            output = weight * 3.0
            dist.broadcast(output, src=0)
            dist.broadcast(buffer, src=1)  # the gradient of stage 1's loss with respect to output
            torch.autograd.backward(output, buffer)
        else:
            dist.broadcast(buffer, src=0)
            received = buffer.clone().requires_grad_()
            (received ** 2).sum().backward()  # d/d output = 2 output
            dist.broadcast(received.grad, src=1)
        warnings.warn("an unrelated warning still shows", UserWarning, stacklevel=1)
    return {"grad": weight.grad, "warnings": [str(w.message) for w in caught]}


@pytest.mark.distributed
def test_gradient_through_a_pipeline_send_is_exact():
    stage0, stage1 = run_distributed(2, _send_forward_then_backward)
    weight = torch.linspace(-1.0, 1.0, 6)
    assert torch.equal(stage0["grad"], 2 * (weight * 3.0) * 3.0)  # chain rule through the send, exact in fp32
    # The c10d::broadcast_ autograd warning is filtered (model/parallel.py), nothing else is.
    assert stage0["warnings"] == stage1["warnings"] == ["an unrelated warning still shows"]
