"""The MoE block (model/moe.py): its config's refusals, its router against transformers', and split against unsplit.

    what                                  how                                                          tolerance
    config refusals                       each bad value raises a ValueError naming the field          -
    router and block semantics            transformers' Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE  1e-6 (fp32)
                                          blocks with random weights copied into an MoEBlock (TP 1,
                                          EP 1): outputs, router logits, selected experts, weights
    ties, sigmoid_bias, capacity          hand-built routers with known answers                        exact
    split vs unsplit                      EP 2 (2 processes), EP 2 x TP 2 with sequence parallelism    1e-6 (fp32)
                                          off and on (4 processes), against one TP 1 x EP 1 block over
                                          the EP ranks' tokens concatenated

Split vs unsplit, what is compared on every rank (p: EP rank, r: TP rank):
- initial weights, exactly: each expert draws from seeds of its global index (model/init.py);
- outputs and input gradients: rank p's slice of the reference's (with sequence parallelism, also TP rank r's
  positions);
- expert gradients, as they are: the owner of expert e receives every EP rank's rows for e, so its gradient is
  already the sum over the whole batch, the reference's gradient of e (TP rank r: rows r of gate and up, columns r of
  down); no reduction over EP (the expert-data-parallel reduce of training sums replicas of the same expert, of
  which there are none here, DP = EP);
- router and shared-gate gradients after a sum over the world: TP ranks hold partial sums (they combine partial
  expert outputs) and EP ranks their own tokens' contributions; the shared expert's sharded weights after a sum over
  EP only;
- the objective includes the aux and z losses, each EP rank's own (computed on its own tokens, as a data-parallel
  replica computes its loss) times MoEStats.loss_scale = 1 / TP: the reference adds the router's losses of each EP
  rank's slice. That the sums agree is what shows 1 / TP is the right scale.
Tolerant, not exact: the all-reduces add partial sums in another order, and BLAS may block a matmul of fewer rows or
columns differently. The bound is 1e-6 on max |split - reference| / max(1, max |reference|): absolute for tensors
below 1, relative to the largest entry above (an expert that takes all 32 tokens has gradients near 5, where one fp32
ulp is 5e-7; measured: 2.2e-6 absolute, 4.1e-7 scaled, at EP 2 x TP 2).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from model.config import MoEConfig, ParallelConfig, check_expert_parallel
from model.layers import partial_gradient_parameters
from model.moe import MoEBlock
from model.parallel import ParallelContext, build_parallel_context
from model.primitives import group_rank, group_size
from model.router import top_k_experts
from tests.distributed import run_distributed
from tests.test_device_discipline import default_device

TOLERANCE = 1e-6


def _block(moe: MoEConfig, hidden: int, ctx: ParallelContext | None = None, expert_group=None,
           std: float = 0.2) -> MoEBlock:
    return MoEBlock(moe, hidden, ctx or ParallelContext(), seed=1234, layer_number=3, init_std=std, output_init_std=std,
                    expert_parallel_group=expert_group)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------- the config


@pytest.mark.parametrize(("fields", "field"), [
    ({"top_k": 9}, "model.moe.top_k"),
    ({"capacity_factor": -1.0}, "model.moe.capacity_factor"),
    ({"capacity_factor": 0.0}, "model.moe.capacity_factor"),
    ({"router": "noisy"}, "model.moe.router"),
    ({"moe_ffn_hidden_size": 0}, "model.moe.moe_ffn_hidden_size"),
    ({"shared_expert_ffn_hidden_size": -8}, "model.moe.shared_expert_ffn_hidden_size"),
    ({"aux_loss_coeff": -0.1}, "model.moe.aux_loss_coeff"),
])
def test_config_refuses_bad_values_naming_the_field(fields, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        MoEConfig(**{"num_experts": 8, "top_k": 2, "moe_ffn_hidden_size": 16, **fields})


def test_expert_parallel_size_must_divide_the_experts_and_the_data_parallel_size():
    moe = MoEConfig(num_experts=6, top_k=2, moe_ffn_hidden_size=16)
    with pytest.raises(ValueError, match=r"parallelism\.expert_parallel_size \(4\) does not divide model\.moe\."
                                         r"num_experts \(6\): choose one of \[1, 2, 3, 6\]"):
        check_expert_parallel(moe, expert_parallel_size=4, data_parallel_size=8)
    with pytest.raises(ValueError, match=r"parallelism\.expert_parallel_size \(3\) does not divide the "
                                         r"data-parallel size \(4,.*choose one of \[1, 2, 4\]"):
        check_expert_parallel(moe, expert_parallel_size=3, data_parallel_size=4)
    check_expert_parallel(moe, expert_parallel_size=2, data_parallel_size=4)  # accepted


def test_sparse_layers_follow_sparse_every_and_first_dense_layers():
    every_other = MoEConfig(num_experts=4, top_k=1, moe_ffn_hidden_size=8, sparse_every=2, first_dense_layers=3)
    assert [n for n in range(1, 9) if every_other.is_sparse(n)] == [4, 6, 8]
    every = MoEConfig(num_experts=4, top_k=1, moe_ffn_hidden_size=8)
    assert all(every.is_sparse(n) for n in range(1, 9))


# ----------------------------------------------------------------------------------------- against transformers


HF_HIDDEN, HF_EXPERTS, HF_FFN, HF_SHARED = 32, 8, 16, 24


def _hf_block(family: str, norm_topk_prob: bool):
    """transformers' sparse block of ``family`` on a tiny config, its every weight drawn N(0, 0.2^2)."""
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen2_moe import modeling_qwen2_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    shape = {"hidden_size": HF_HIDDEN, "num_experts_per_tok": 2}
    if family == "mixtral":  # always renormalises its top-k
        config = modeling_mixtral.MixtralConfig(**shape, intermediate_size=HF_FFN, num_local_experts=HF_EXPERTS)
        block = modeling_mixtral.MixtralSparseMoeBlock(config)
    elif family == "qwen2_moe":
        config = modeling_qwen2_moe.Qwen2MoeConfig(**shape, moe_intermediate_size=HF_FFN, num_experts=HF_EXPERTS,
                                                   shared_expert_intermediate_size=HF_SHARED,
                                                   norm_topk_prob=norm_topk_prob)
        block = modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    else:
        config = modeling_qwen3_moe.Qwen3MoeConfig(**shape, moe_intermediate_size=HF_FFN, num_experts=HF_EXPERTS,
                                                   norm_topk_prob=norm_topk_prob)
        block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    config._experts_implementation = "eager"  # the reference loop over experts, the semantics compared against
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return block.eval()


@torch.no_grad()
def _copy_from_hf(block: MoEBlock, hf) -> None:
    """transformers 5.24 keeps the routed experts fused: experts.gate_up_proj [E, 2 I, h] ([gate; up] per expert,
    split by chunk(2)) and experts.down_proj [E, h, I], our layout at TP 1; the shared expert is a Qwen2MoeMLP of
    three nn.Linear and shared_expert_gate an nn.Linear(h, 1)."""
    block.router.weight.copy_(hf.gate.weight)
    block.experts.gate_up.copy_(hf.experts.gate_up_proj)
    block.experts.down.copy_(hf.experts.down_proj)
    if block.shared_expert is not None:
        shared = hf.shared_expert
        block.shared_expert.gate_up.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        block.shared_expert.down.copy_(shared.down_proj.weight)
        block.shared_expert.gate.copy_(hf.shared_expert_gate.weight)


@pytest.mark.parametrize(("family", "norm_topk_prob"), [
    ("mixtral", True), ("qwen2_moe", True), ("qwen2_moe", False), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_block_equals_transformers(family, norm_topk_prob):
    hf = _hf_block(family, norm_topk_prob)
    moe = MoEConfig(num_experts=HF_EXPERTS, top_k=2, moe_ffn_hidden_size=HF_FFN, norm_topk_prob=norm_topk_prob,
                    shared_expert_ffn_hidden_size=HF_SHARED if family == "qwen2_moe" else 0)
    block = _block(moe, HF_HIDDEN)
    _copy_from_hf(block, hf)
    x = _randn(3, 5, HF_HIDDEN, seed=6)
    with torch.no_grad():
        expected = hf(x)
        hf_logits, hf_weights, hf_experts = hf.gate(x.view(-1, HF_HIDDEN))
        out, stats = block(x)
        routing = block.router(x.view(-1, HF_HIDDEN))
    assert torch.equal(routing.experts, hf_experts)
    assert (routing.logits - hf_logits).abs().max() <= TOLERANCE
    assert (routing.weights - hf_weights).abs().max() <= TOLERANCE
    assert (out - expected).abs().max() <= TOLERANCE
    assert expected.abs().max() > 0.1  # the comparison sees real numbers
    assert int(stats.tokens_per_expert.sum()) == 3 * 5 * 2 and int(stats.dropped) == 0


def test_aux_loss_is_transformers_load_balancing_loss_over_top_k_and_z_loss_is_mean_squared_logsumexp():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    block = _block(MoEConfig(num_experts=HF_EXPERTS, top_k=2, moe_ffn_hidden_size=HF_FFN), HF_HIDDEN, std=1.0)
    with torch.no_grad():
        routing = block.router(_randn(40, HF_HIDDEN, seed=7))
    theirs = load_balancing_loss_func((routing.logits,), HF_EXPERTS, top_k=2)
    assert abs(float(theirs) - 2 * float(routing.aux_loss)) <= TOLERANCE
    assert float(routing.aux_loss) > 1.0  # 1 only for perfectly balanced routing
    z = (torch.logsumexp(routing.logits.double(), dim=-1) ** 2).mean()
    assert abs(float(routing.z_loss) - float(z)) <= TOLERANCE * float(z)


# ---------------------------------------------------------------------------------------------- hand-built routers


def test_ties_go_to_the_lower_expert_index():
    scores = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.2, 0.2, 0.2, 0.2], [0.5, 0.1, 0.5, 0.0]])
    assert top_k_experts(scores, 2).tolist() == [[1, 2], [0, 1], [0, 2]]
    block = _block(MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=8), 8)
    with torch.no_grad():
        block.router.weight.zero_()  # every score equal
        routing = block.router(_randn(5, 8, seed=8))
    assert routing.experts.tolist() == [[0, 1]] * 5 and routing.weights.tolist() == [[0.5, 0.5]] * 5


def test_sigmoid_bias_router_selects_with_the_bias_and_weighs_without_it():
    block = _block(MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=8, router="sigmoid_bias"), 8)
    assert "router.expert_bias" in block.state_dict() and block.router.expert_bias.dtype == torch.float32
    assert all(parameter is not block.router.expert_bias for parameter in block.parameters())
    with torch.no_grad():
        block.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 always chosen
    tokens = _randn(6, 8, seed=9).requires_grad_()
    routing = block.router(tokens)
    scores = torch.sigmoid(tokens.detach() @ block.router.weight.detach().t())
    best_other = scores[:, :3].argmax(dim=-1)
    assert routing.experts.tolist() == [[3, int(e)] for e in best_other]
    chosen = torch.stack([scores[:, 3], scores.gather(-1, best_other[:, None])[:, 0]], dim=-1)
    assert torch.equal(routing.weights, chosen / chosen.sum(dim=-1, keepdim=True))
    routing.weights.sum().backward()
    assert block.router.expert_bias.grad is None and tokens.grad is not None

    block.router.update_bias(torch.tensor([10, 0, 5, 5]), rate=0.25)  # mean 5: the over- and underloaded move
    assert block.router.expert_bias.tolist() == [-0.25, 0.25, 0.0, 10.0]


def test_capacity_drops_the_lowest_weights_and_counts_them():
    """4 tokens, 2 experts, top 1, capacity factor 1: C = ceil(1 x 4 x 1 / 2) = 2. Expert 0 is chosen by tokens 0,
    1, 2 with probabilities sigmoid(1), sigmoid(3), sigmoid(2): token 0, the lowest, is dropped. With
    norm_topk_prob every weight is 1: the tie drops the latest assignment, token 2."""
    tokens = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [0.0, 1.0]]])  # (1, 4, 2)
    expected_dropped = {False: 0, True: 2}
    for norm_topk_prob in (False, True):
        fields = {"num_experts": 2, "top_k": 1, "moe_ffn_hidden_size": 4, "norm_topk_prob": norm_topk_prob}
        capped, dropless = (_block(MoEConfig(**fields, capacity_factor=c), 2) for c in (1.0, None))
        for block in (capped, dropless):
            with torch.no_grad():
                block.router.weight.copy_(torch.eye(2))
        with torch.no_grad():
            out, stats = capped(tokens)
            full, full_stats = dropless(tokens)
        dropped = expected_dropped[norm_topk_prob]
        assert int(stats.dropped) == 1 and int(full_stats.dropped) == 0
        assert stats.tokens_per_expert.tolist() == [3, 1]  # routed, before the drop
        assert torch.equal(out[0, dropped], torch.zeros(2))
        kept = [t for t in range(4) if t != dropped]
        assert torch.equal(out[0, kept], full[0, kept]) and full[0, dropped].abs().max() > 0


def test_router_and_shared_gate_gradients_are_listed_as_partial_over_tensor_parallel():
    moe = MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=8, shared_expert_ffn_hidden_size=8)
    block = _block(moe, 8)
    partial = {block.router.weight, block.shared_expert.gate}
    for sequence_parallel in (False, True):
        assert partial <= set(partial_gradient_parameters(block, sequence_parallel))
    assert set(partial_gradient_parameters(block, False)) == partial
    assert (block.experts.gate_up.partition_dim, block.experts.gate_up.partition_stride) == (1, 2)
    assert block.experts.down.partition_dim == 2
    assert block.experts.gate_up.expert_parallel and block.experts.down.expert_parallel
    assert block.experts.gate_up.tensor_model_parallel and not hasattr(block.router.weight, "expert_parallel")
    with torch.device("meta"):  # a meta build (model/summary.py) allocates and draws nothing
        assert _block(moe, 8).experts.gate_up.is_meta


def test_every_run_time_tensor_is_made_on_the_device_of_what_it_meets():
    """Forward and backward with torch's default device set to meta (as tests/test_device_discipline.py runs a
    training step): a tensor made without a device would be a meta tensor and fail beside the real ones."""
    moe = MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=8, shared_expert_ffn_hidden_size=8,
                    capacity_factor=0.75)
    block = _block(moe, 8)
    x = _randn(2, 6, 8, seed=10).requires_grad_()
    with default_device("meta"):
        out, stats = block(x)
        out.sum().backward()
    assert not out.is_meta and int(stats.dropped) > 0 and x.grad.abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_path_equals_the_per_expert_loop_bit_for_bit(dtype):
    """The CUDA bf16 path (torch's grouped GEMM, model/moe.py grouped_swiglu) computes on CPU too: the same bits as
    the per-expert loop the CPU runs, outputs and gradients, with an expert without rows; its offsets are made on the
    rows' device (the default device set to meta would show otherwise)."""
    from model.moe import Experts, grouped_swiglu

    experts = Experts(MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16), 32, ParallelContext(), first=0,
                      count=4, init_std=0.1, output_init_std=0.05, seed=1, layer_number=1).to(dtype)
    counts = [5, 0, 9, 3]
    rows = _randn(sum(counts), 32, seed=11).to(dtype)
    results = []
    for run in ("loop", "grouped"):
        x = rows.clone().requires_grad_()
        experts.zero_grad()
        with default_device("meta"):
            out = experts(x, counts) if run == "loop" else grouped_swiglu(x, counts, experts.gate_up, experts.down)
            out.float().square().sum().backward()
        results.append((out, x.grad, experts.gate_up.grad, experts.down.grad))
    for loop, grouped in zip(*results, strict=True):
        assert torch.equal(loop, grouped)
    assert results[0][3][1].abs().max() == 0 and results[0][3][0].abs().max() > 0  # no rows, no gradient


# ---------------------------------------------------------------------------------------------- split vs unsplit


HIDDEN, EXPERTS, FFN, BATCH, SEQUENCE = 16, 8, 8, 2, 8  # per EP rank: (2, 8) tokens; SEQUENCE divides by TP 2


def _uneven(block: MoEBlock) -> None:
    """Inputs are positive on average (_split_inputs): expert 3 never wins, expert 1 wins often."""
    block.router.weight[3] = -1.0
    block.router.weight[1] += 0.2


def _all_to_the_last(block: MoEBlock) -> None:
    """Every token to expert E - 1, which the last EP rank owns: EP rank 0 receives nothing."""
    block.router.weight.zero_()
    block.router.weight[EXPERTS - 1] = 1.0


def _skewed_bias(block: MoEBlock) -> None:
    block.router.expert_bias.copy_(torch.linspace(-0.3, 0.6, EXPERTS))


SPLIT_CASES = {  # name: (config, router edit applied to the reference and to the split block alike)
    "random": (MoEConfig(num_experts=EXPERTS, top_k=2, moe_ffn_hidden_size=FFN, norm_topk_prob=False,
                         shared_expert_ffn_hidden_size=8, aux_loss_coeff=0.1, router_z_loss_coeff=0.01), None),
    "uneven, an empty expert": (MoEConfig(num_experts=EXPERTS, top_k=2, moe_ffn_hidden_size=FFN,
                                          aux_loss_coeff=0.1), _uneven),
    "every token to one expert": (MoEConfig(num_experts=EXPERTS, top_k=1, moe_ffn_hidden_size=FFN,
                                            norm_topk_prob=False, router_z_loss_coeff=0.01), _all_to_the_last),
    "sigmoid_bias": (MoEConfig(num_experts=EXPERTS, top_k=2, moe_ffn_hidden_size=FFN, router="sigmoid_bias",
                               shared_expert_ffn_hidden_size=8), _skewed_bias),
}


def _split_inputs(ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every EP rank's tokens (ranks B, S, h), rank p's rows [p B, (p + 1) B), and the objective's weights."""
    tokens = _randn(ranks * BATCH, SEQUENCE, HIDDEN, seed=21) * 0.5 + 0.5
    return tokens, _randn(ranks * BATCH, SEQUENCE, HIDDEN, seed=22)


def _tensor_parallel_slice(full: torch.Tensor, dim: int, ctx: ParallelContext, sub_matrices: int = 1) -> torch.Tensor:
    """Rank r's slice along ``dim`` of each of ``sub_matrices`` stacked blocks, stacked again (SwiGLU's gate_up)."""
    blocks = full.chunk(sub_matrices, dim=dim)
    return torch.cat([b.chunk(ctx.tensor_parallel_size, dim=dim)[ctx.tensor_parallel_rank] for b in blocks], dim=dim)


def _edited_block(name: str, ctx: ParallelContext, expert_group) -> MoEBlock:
    moe, edit = SPLIT_CASES[name]
    block = _block(moe, HIDDEN, ctx, expert_group)
    if edit is not None:
        with torch.no_grad():
            edit(block)
    return block


def _auxiliary(aux_loss: torch.Tensor, z_loss: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    return moe.aux_loss_coeff * aux_loss + moe.router_z_loss_coeff * z_loss


def _reference(name: str, ranks: int):
    """The unsplit block (TP 1, EP 1) over every rank's tokens, with each rank's own aux and z losses."""
    moe = SPLIT_CASES[name][0]
    block = _edited_block(name, ParallelContext(), None)
    tokens, target = _split_inputs(ranks)
    x = tokens.clone().requires_grad_()
    out, _ = block(x)
    slices = [block.router(x[p * BATCH:(p + 1) * BATCH].reshape(-1, HIDDEN)) for p in range(ranks)]
    objective = (out * target).sum() + sum(_auxiliary(r.aux_loss, r.z_loss, moe) for r in slices)
    objective.backward()
    return block, x, out.detach(), slices


def _split_case(name: str, ctx: ParallelContext, expert_group) -> dict:
    ranks, p = group_size(expert_group), group_rank(expert_group)
    moe = SPLIT_CASES[name][0]
    reference, x_reference, out_reference, slices = _reference(name, ranks)
    block = _edited_block(name, ctx, expert_group)
    local = EXPERTS // ranks
    mine = slice(p * local, (p + 1) * local)
    init_exact = (torch.equal(block.experts.gate_up, _tensor_parallel_slice(reference.experts.gate_up[mine], 1, ctx, 2))
                  and torch.equal(block.experts.down, _tensor_parallel_slice(reference.experts.down[mine], 2, ctx)))

    tokens, target = (t[p * BATCH:(p + 1) * BATCH] for t in _split_inputs(ranks))
    positions = slice(None)
    if ctx.sequence_parallel:
        step = SEQUENCE // ctx.tensor_parallel_size
        positions = slice(ctx.tensor_parallel_rank * step, (ctx.tensor_parallel_rank + 1) * step)
    x = tokens[:, positions].clone().requires_grad_()
    out, stats = block(x)
    objective = (out * target[:, positions]).sum() + stats.loss_scale * _auxiliary(stats.aux_loss, stats.z_loss, moe)
    objective.backward()

    router_grad = block.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # partial over TP and over EP: the world
    rows = slice(p * BATCH, (p + 1) * BATCH)
    pairs = {
        "out": (out, out_reference[rows, positions]),
        "grad x": (x.grad, x_reference.grad[rows, positions]),
        "grad experts.gate_up": (block.experts.gate_up.grad,
                                 _tensor_parallel_slice(reference.experts.gate_up.grad[mine], 1, ctx, 2)),
        "grad experts.down": (block.experts.down.grad, _tensor_parallel_slice(reference.experts.down.grad[mine], 2, ctx)),
        "grad router": (router_grad, reference.router.weight.grad),
        "aux loss": (stats.aux_loss, slices[p].aux_loss),
        "z loss": (stats.z_loss, slices[p].z_loss),
    }
    if block.shared_expert is not None:
        shared, shared_reference = block.shared_expert, reference.shared_expert
        gate_grad, gate_up_grad, down_grad = (shared.gate.grad.clone(), shared.gate_up.grad.clone(),
                                              shared.down.grad.clone())
        dist.all_reduce(gate_grad)  # partial over TP and EP
        dist.all_reduce(gate_up_grad, group=expert_group)  # sharded over TP, partial over EP
        dist.all_reduce(down_grad, group=expert_group)
        pairs["grad shared gate"] = (gate_grad, shared_reference.gate.grad)
        pairs["grad shared gate_up"] = (gate_up_grad, _tensor_parallel_slice(shared_reference.gate_up.grad, 0, ctx, 2))
        pairs["grad shared down"] = (down_grad, _tensor_parallel_slice(shared_reference.down.grad, 1, ctx))
    return {
        "differences": {key: float((a.detach() - b.detach()).abs().max()) if b.numel() else 0.0
                        for key, (a, b) in pairs.items()},
        "reference sizes": {key: float(b.detach().abs().max()) if b.numel() else 0.0 for key, (a, b) in pairs.items()},
        "init exact": init_exact,
        "counts equal": torch.equal(stats.tokens_per_expert, slices[p].tokens_per_expert),
        "routed": sum(s.tokens_per_expert for s in slices).tolist(),
    }


def _expert_parallel_group(ctx: ParallelContext):
    """EP = DP here: the data-parallel ranks of this TP rank (new_group is collective: every rank makes every one)."""
    mine = None
    for ranks in ctx.topology.get_axis_comm_lists("data"):
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _split_worker(tensor_parallel_size: int, sequence_parallel_modes: tuple[bool, ...]) -> dict:
    ctx = build_parallel_context(ParallelConfig(tensor_parallel_size=tensor_parallel_size))
    expert_group = _expert_parallel_group(ctx)
    results = {}
    for sequence_parallel in sequence_parallel_modes:
        case_ctx = dataclasses.replace(ctx, sequence_parallel=sequence_parallel)
        for name in SPLIT_CASES:
            results[f"{name}, SP {sequence_parallel}"] = _split_case(name, case_ctx, expert_group)
    return results


def _check_split_results(per_rank: list[dict], expert_parallel_size: int) -> None:
    worst, worst_scaled = 0.0, 0.0
    for rank, results in enumerate(per_rank):
        for case, result in results.items():
            where = f"rank {rank}, {case}"
            assert result["init exact"] and result["counts equal"], where
            for key, difference in result["differences"].items():
                size = result["reference sizes"][key]
                scaled = difference / max(1.0, size)  # absolute below 1, relative to the largest entry above
                assert scaled <= TOLERANCE, f"{where}: {key} differs by {difference:.3g} (largest entry {size:.3g})"
                worst, worst_scaled = max(worst, difference), max(worst_scaled, scaled)
            assert result["reference sizes"]["out"] > 0.05 and result["reference sizes"]["grad router"] > 0.05, where
            routed = result["routed"]
            if case.startswith("uneven"):
                assert routed[3] == 0 and max(routed) == routed[1] > 2 * sum(routed) / EXPERTS, where
            if case.startswith("every token"):
                assert routed[-1] == sum(routed) == expert_parallel_size * BATCH * SEQUENCE, where  # top 1
    print(f"\nlargest difference over {len(per_rank)} ranks: {worst:.3g} absolute, {worst_scaled:.3g} scaled")


def test_expert_parallel_2_equals_the_unsplit_block():
    _check_split_results(run_distributed(2, _split_worker, 1, (False,)), 2)


def test_expert_parallel_2_by_tensor_parallel_2_equals_the_unsplit_block_with_and_without_sequence_parallelism():
    _check_split_results(run_distributed(4, _split_worker, 2, (False, True)), 2)


def test_expert_parallel_4_by_tensor_parallel_2_equals_the_unsplit_block_with_and_without_sequence_parallelism():
    """EP 4 (2 of the 8 experts a rank; the empty expert's rank receives rows for its other one only)."""
    _check_split_results(run_distributed(8, _split_worker, 2, (False, True)), 4)


# ------------------------------------------------------------------------------------- the block in the pipeline


def test_attached_losses_give_the_gradients_of_the_whole_objective():
    """MoEMLP attaches aux_loss_coeff x aux + router_z_loss_coeff x z, scaled by 1 / micro_batches, in autograd: its
    gradients equal those of the objective written out, out . g + (coefficients x losses) / micro_batches, computed
    from the bare block; and without the attachment they differ (the test can fail)."""
    from model.moe import MoEMLP

    moe = MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16, aux_loss_coeff=0.5, router_z_loss_coeff=0.1,
                    shared_expert_ffn_hidden_size=8)
    x, g = _randn(2, 5, 12, seed=1), _randn(2, 5, 12, seed=2)
    grads = {}
    for name in ("attached", "written out", "bare"):
        block = _block(moe, 12)
        layer = MoEMLP(block).train()
        layer.micro_batches = 4
        inputs = x.clone().requires_grad_()
        if name == "attached":
            (layer(inputs) * g).sum().backward()
        else:
            out, stats = block(inputs)
            objective = (out * g).sum()
            if name == "written out":
                objective = objective + (0.5 * stats.aux_loss + 0.1 * stats.z_loss) / 4
            objective.backward()
        grads[name] = [inputs.grad, *(p.grad for p in block.parameters())]
    for attached, written in zip(grads["attached"], grads["written out"], strict=True):
        torch.testing.assert_close(attached, written, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(grads["attached"][1], grads["bare"][1])  # the router's gradient: the losses reach it


def test_a_full_recompute_counts_each_forward_once():
    """Under model/random.py's checkpoint (model.recompute "full") the block's forward runs again in the backward:
    the step's statistics count it once, and equal those of the same forward without recompute."""
    from model.moe import MoEMLP
    from model.random import RNGStream, checkpoint

    moe = MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16)
    counted = {}
    for recompute in (False, True):
        layer = MoEMLP(_block(moe, 12)).train()
        for micro_batch in range(3):
            inputs = _randn(2, 5, 12, seed=micro_batch).requires_grad_()
            out = checkpoint(RNGStream(7), layer, inputs) if recompute else layer(inputs)
            out.sum().backward()
        counted[recompute] = layer.take_stats()
        assert layer.take_stats() is None  # taken: the next step counts afresh
    assert counted[True].forwards == counted[False].forwards == 3
    assert torch.equal(counted[True].tokens_per_expert, counted[False].tokens_per_expert)
    assert int(counted[True].tokens_per_expert.sum()) == 3 * 10 * 2
    torch.testing.assert_close(counted[True].aux_loss, counted[False].aux_loss, rtol=0, atol=0)
