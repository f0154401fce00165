"""DeepSeek-V3's routing in the MoE block (model/router.py, model/moe.py) against transformers' DeepseekV3TopkRouter
and DeepseekV3MoE, and its sequence-wise balance loss against the paper's equations.

    what                                   how                                                        tolerance
    router, random weights and bias        selected experts (as sets: transformers' torch.topk is     exact; 1e-6
                                           unsorted), gate weights in the same order, for several
                                           (n_group, topk_group, top_k), topk_group = n_group too
    topk_group = n_group                   the same choices as one group (plain top-k)                exact
    ties                                   scores fed through an identity router weight (logits =     exact
                                           the input, bit for bit), ties that torch.topk's choice
                                           does not decide; and one that it does, where ours takes
                                           the lower index
    an empty group                         a group masked (-inf bias) and one that no token chooses   exact; 1e-6
    the block                              DeepseekV3MoE's forward, weights copied, ungated shared    1e-5
                                           experts, routed_scaling_factor 2.5
    first_dense_layers                     DeepseekV3DecoderLayer's dense / MoE choice                exact
    sequence-wise balance loss             the paper's eqs. 17-20 written out in float64, value and   1e-6
                                           router gradient; attached by MoEMLP
    refusals                               config fields and layouts, each naming the field           -
"""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig, MoEConfig
from model.moe import MoEBlock, MoEMLP
from model.parallel import ParallelContext

HIDDEN, EXPERTS, FFN = 32, 16, 16


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _hf_config(**fields):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config

    values = dict(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=4, n_group=4, topk_group=2,
                  moe_intermediate_size=FFN, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                  qk_nope_head_dim=4, v_head_dim=8, intermediate_size=24, num_hidden_layers=4, vocab_size=50)
    return DeepseekV3Config(**{**values, **fields})


def _moe(config, **fields) -> MoEConfig:
    """model.moe of a DeepseekV3Config (the keys MoEConfig's docstrings name)."""
    values = dict(num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                  moe_ffn_hidden_size=config.moe_intermediate_size, router="sigmoid_bias",
                  norm_topk_prob=config.norm_topk_prob, routed_scaling_factor=config.routed_scaling_factor,
                  n_group=config.n_group, topk_group=config.topk_group,
                  shared_expert_ffn_hidden_size=config.moe_intermediate_size * config.n_shared_experts,
                  shared_expert_gate=False, first_dense_layers=config.first_k_dense_replace)
    return MoEConfig(**{**values, **fields})


def _block(moe: MoEConfig, hidden: int = HIDDEN) -> MoEBlock:
    return MoEBlock(moe, hidden, ParallelContext(), seed=1234, layer_number=3, init_std=0.2, output_init_std=0.2)


def _routers(config, weight: torch.Tensor, bias: torch.Tensor, **fields):
    """transformers' DeepseekV3TopkRouter and ours, with the same weight and bias."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    theirs = DeepseekV3TopkRouter(config).eval()
    ours = _block(_moe(config, **fields), weight.shape[1]).router
    with torch.no_grad():
        for router in (theirs, ours):
            router.weight.copy_(weight)
        theirs.e_score_correction_bias.copy_(bias)
        ours.expert_bias.copy_(bias)
    return theirs, ours


def _compare(theirs, ours, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Ours' experts (T, k), sorted per token, once they equal transformers' as sets; the largest weight difference,
    each token's weights taken in that order."""
    with torch.no_grad():
        _, their_weights, their_experts = theirs(tokens)
        routing = ours(tokens)
    mine_sorted, mine_order = routing.experts.sort(dim=-1)
    theirs_sorted, their_order = their_experts.sort(dim=-1)
    assert torch.equal(mine_sorted, theirs_sorted)
    difference = (routing.weights.gather(-1, mine_order) - their_weights.gather(-1, their_order)).abs().max()
    return mine_sorted, float(difference)


@pytest.mark.parametrize(("n_group", "topk_group", "top_k", "norm_topk_prob"), [
    (4, 2, 4, True), (4, 1, 3, True), (8, 3, 5, False), (2, 1, 8, True), (4, 4, 4, True), (1, 1, 6, False)])
def test_router_equals_transformers(n_group, topk_group, top_k, norm_topk_prob):
    config = _hf_config(n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k,
                        norm_topk_prob=norm_topk_prob)
    theirs, ours = _routers(config, _randn(EXPERTS, HIDDEN, seed=1) * 0.3, _randn(EXPERTS, seed=2) * 0.1)
    tokens = _randn(256, HIDDEN, seed=3)
    experts, difference = _compare(theirs, ours, tokens)
    assert difference <= 1e-6
    if topk_group < n_group:  # the groups limit the choice: every token's experts lie in topk_group groups
        groups_used = torch.zeros(256, n_group, dtype=torch.bool).scatter_(1, experts // (EXPERTS // n_group), True)
        assert int(groups_used.sum(dim=1).max()) <= topk_group
        plain = _block(_moe(config, n_group=1, topk_group=1)).router
        with torch.no_grad():
            plain.load_state_dict(ours.state_dict())
            assert not torch.equal(plain(tokens).experts, ours(tokens).experts)  # and the limit changes some


def test_topk_group_equal_to_n_group_is_plain_top_k():
    config = _hf_config(n_group=4, topk_group=4)
    _, grouped = _routers(config, _randn(EXPERTS, HIDDEN, seed=4), _randn(EXPERTS, seed=5) * 0.1)
    plain = _block(_moe(config, n_group=1, topk_group=1)).router
    with torch.no_grad():
        plain.load_state_dict(grouped.state_dict())
        tokens = _randn(128, HIDDEN, seed=6)
        assert torch.equal(grouped(tokens).experts, plain(tokens).experts)
        assert torch.equal(grouped(tokens).weights, plain(tokens).weights)


def _identity_routers(**fields):
    """Routers whose logits are their input, bit for bit (an identity weight, h = E): scores fed by hand."""
    config = _hf_config(hidden_size=EXPERTS, **fields)
    return _routers(config, torch.eye(EXPERTS), torch.zeros(EXPERTS))


# groups of 4 experts; logits (sigmoid keeps their order and their ties), each row a token
TIES_DECIDED = [
    # groups 1 and 2 tie for best (top 2: 3 + 2), both kept; group 0 and 3 lower
    [0, 0, 1, 1, 3, 2, 0, 0, 0, 2, 3, 0, -1, -1, -1, -1],
    # groups 0 and 3 tie for worst and both go, top_k 4 takes the kept groups' best two each
    [0, 0, 0, 0, 4, 3, 0, 0, 0, 0, 3, 4, 0, 0, 0, 0],
    # a three-way tie for a group's two best (2, 2, 2): its score is the same whichever two are taken
    [2, 2, 2, 0, 3, 0, 0, 0, 1.5, 1, 0, 0, 0, 0, 0, 0],
    # groups 0 and 1 tie; experts tie inside the chosen four (3, 3 and 2, 2) and outside them (1 x 4)
    [3, 2, 1, 1, 3, 2, 1, 1, -1, -1, -1, -2, -3, -3, -3, -3],
]


def test_ties_that_torch_topk_does_not_decide_equal_transformers():
    theirs, ours = _identity_routers(n_group=4, topk_group=2, num_experts_per_tok=4)
    experts, difference = _compare(theirs, ours, torch.tensor(TIES_DECIDED, dtype=torch.float32))
    assert difference <= 1e-6
    assert experts.tolist() == [[4, 5, 9, 10], [4, 5, 10, 11], [0, 1, 2, 8], [0, 1, 4, 5]]


def test_ties_at_the_cut_go_to_the_lower_index():
    """Where the tie decides, ours takes the lower index, groups and experts (model/router.py's docstring);
    transformers' torch.topk takes what its kernel gives (four equal scores, k 2: [2, 3] on CPU)."""
    _, ours = _identity_routers(n_group=4, topk_group=2, num_experts_per_tok=2)
    tokens = torch.tensor([[0.0] * 16,  # every group and expert equal: groups 0 and 1, experts 0 and 1
                           [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    with torch.no_grad():
        assert ours(tokens).experts.tolist() == [[0, 1], [4, 5]]


def test_an_empty_group_equals_transformers():
    """Group 0 masked (bias -inf: every expert of it out, and the group with them) and group 3 pushed down (bias
    -5: no token chooses it); with topk_group < n_group and = n_group."""
    bias = _randn(EXPERTS, seed=7) * 0.1
    bias[:4], bias[12:] = float("-inf"), -5.0
    tokens = _randn(64, HIDDEN, seed=8)
    for topk_group in (2, 4):
        config = _hf_config(n_group=4, topk_group=topk_group, num_experts_per_tok=4)
        theirs, ours = _routers(config, _randn(EXPERTS, HIDDEN, seed=9) * 0.3, bias)
        experts, difference = _compare(theirs, ours, tokens)
        assert difference <= 1e-6
        assert not ((experts < 4) | (experts >= 12)).any()  # groups 0 and 3 empty
        with torch.no_grad():
            routing = ours(tokens)
        assert routing.tokens_per_expert[:4].tolist() == [0] * 4 and routing.tokens_per_expert[12:].tolist() == [0] * 4
        assert torch.isfinite(routing.weights).all()


# ------------------------------------------------------------------------------------------------------- the block


def _hf_block(config):
    """transformers' DeepseekV3MoE, every weight and the correction bias drawn at random."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config._experts_implementation = "eager"  # the reference loop over experts
    block = DeepseekV3MoE(config)
    generator = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for tensor in [*block.parameters(), block.gate.e_score_correction_bias]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    return block.eval()


@torch.no_grad()
def _copy_from_hf(block: MoEBlock, hf) -> None:
    """Fused experts as tests/test_moe.py copies Qwen's; the shared experts, one DeepseekV3MLP of width
    moe_intermediate_size x n_shared_experts, as our ungated SharedExpert."""
    block.router.weight.copy_(hf.gate.weight)
    block.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
    block.experts.gate_up.copy_(hf.experts.gate_up_proj)
    block.experts.down.copy_(hf.experts.down_proj)
    shared = hf.shared_experts
    block.shared_expert.gate_up.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
    block.shared_expert.down.copy_(shared.down_proj.weight)


@pytest.mark.parametrize(("n_group", "topk_group", "norm_topk_prob"), [(4, 2, True), (4, 4, True), (8, 3, False)])
def test_block_equals_transformers_deepseek_v3_moe(n_group, topk_group, norm_topk_prob):
    config = _hf_config(n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob)
    hf = _hf_block(config)
    block = _block(_moe(config))
    assert block.shared_expert.gate is None and "shared_expert.gate" not in block.state_dict()
    _copy_from_hf(block, hf)
    x = _randn(3, 7, HIDDEN, seed=11)
    with torch.no_grad():
        expected = hf(x)
        out, stats = block(x)
    assert (out - expected).abs().max() <= 1e-5
    assert expected.abs().max() > 0.5  # real numbers, the scaling factor 2.5 among them
    assert int(stats.tokens_per_expert.sum()) == 3 * 7 * 4


def test_first_dense_layers_is_first_k_dense_replace():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3MoE

    config = _hf_config(num_hidden_layers=5, first_k_dense_replace=2)
    theirs = [isinstance(DeepseekV3DecoderLayer(config, index).mlp, DeepseekV3MoE) for index in range(5)]
    ours = [_moe(config).is_sparse(layer_number) for layer_number in range(1, 6)]  # 1-based
    assert ours == theirs == [False, False, True, True, True]


# ------------------------------------------------------------------------------------ the sequence-wise balance loss


def _paper_loss(logits: torch.Tensor, experts: torch.Tensor, sequences: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's eqs. 17-20, one sequence and one expert at a time, in float64: L = sum_i f_i P_i,
    f_i = N_r / (K_r T) sum_t 1(token t routed to i), s'_{i,t} = s_{i,t} / sum_j s_{j,t}, P_i = 1/T sum_t s'_{i,t};
    the mean over the sequences."""
    scores = logits.double().sigmoid()
    tokens, num_experts = scores.shape
    length = tokens // sequences
    losses = []
    for sequence in range(sequences):
        rows = range(sequence * length, (sequence + 1) * length)
        loss = scores.new_zeros(())
        for expert in range(num_experts):
            routed = sum(int(expert in experts[t].tolist()) for t in rows)
            f = num_experts / (top_k * length) * routed
            p = sum(scores[t, expert] / scores[t].sum() for t in rows) / length
            loss = loss + f * p
        losses.append(loss)
    return torch.stack(losses).mean()


def test_sequence_balance_loss_is_the_papers():
    config = _hf_config()
    block = _block(_moe(config, sequence_aux_loss_coeff=1e-4))
    with torch.no_grad():
        block.router.weight.copy_(_randn(EXPERTS, HIDDEN, seed=12))
        block.router.expert_bias.copy_(_randn(EXPERTS, seed=13) * 0.1)
    x = _randn(3, 6, HIDDEN, seed=14)
    routing = block.router(x.view(-1, HIDDEN), sequence_length=6)
    weight = block.router.weight.detach().double().requires_grad_()
    expected = _paper_loss(x.view(-1, HIDDEN).double() @ weight.t(), routing.experts, 3, 4)
    assert abs(float(routing.sequence_aux_loss.detach()) - float(expected.detach())) <= 1e-6
    assert float(expected.detach()) > 1.0  # 1 only for a perfectly balanced sequence
    one_sequence = block.router(x.view(-1, HIDDEN)).sequence_aux_loss  # the same tokens as one sequence differ
    assert abs(float(one_sequence.detach()) - float(routing.sequence_aux_loss.detach())) > 1e-3
    routing.sequence_aux_loss.backward()
    expected.backward()
    assert (block.router.weight.grad.double() - weight.grad).abs().max() <= 1e-6
    assert float(block.router.weight.grad.abs().max()) > 1e-3


def test_block_reports_the_sequence_loss_and_mlp_attaches_it():
    """MoEBlock routes (b, s, h) as b sequences of s; MoEMLP's gradient is the objective's,
    out + sequence_aux_loss_coeff x the loss (TP 1: loss_scale 1, one micro-batch)."""
    config = _hf_config()
    moe = _moe(config, sequence_aux_loss_coeff=0.5, aux_loss_coeff=0.0)
    block = _block(moe)
    x = _randn(2, 5, HIDDEN, seed=15)
    out, stats = block(x)
    weight = block.router.weight.detach().double().requires_grad_()
    experts = block.router(x.view(-1, HIDDEN)).experts
    expected = _paper_loss(x.view(-1, HIDDEN).double() @ weight.t(), experts, 2, 4)
    assert abs(float(stats.sequence_aux_loss.detach()) - float(expected.detach())) <= 1e-6
    (out.sum() + 0.5 * stats.sequence_aux_loss).backward()
    reference = block.router.weight.grad.clone()
    block.zero_grad()
    layer = MoEMLP(block).train()
    layer(x).sum().backward()
    assert torch.equal(block.router.weight.grad, reference)
    off = _block(_moe(config))
    assert float(off(x)[1].sequence_aux_loss) == 0.0


# ---------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("fields", "field"), [
    ({"n_group": 3}, r"model\.moe\.num_experts \(16\) is not divisible by model\.moe\.n_group \(3\)"),
    ({"n_group": 16, "topk_group": 4}, r"model\.moe\.n_group \(16\) leaves 1 expert per group"),
    ({"topk_group": 5}, r"model\.moe\.topk_group \(5\) is more than model\.moe\.n_group \(4\)"),
    ({"topk_group": 1, "top_k": 5}, r"model\.moe\.top_k \(5\) is more than the 4 experts.*topk_group to at least 2"),
    ({"router": "softmax"}, r"model\.moe\.n_group \(4\).*needs model\.moe\.router \"sigmoid_bias\""),
    ({"routed_scaling_factor": 0.0}, r"model\.moe\.routed_scaling_factor must be a positive number"),
    ({"shared_expert_gate": "no"}, r"model\.moe\.shared_expert_gate must be true or false"),
    ({"sequence_aux_loss_coeff": -1.0}, r"model\.moe\.sequence_aux_loss_coeff must be a non-negative number"),
])
def test_config_refuses_bad_groups_naming_the_field(fields, field):
    values = dict(num_experts=16, top_k=4, moe_ffn_hidden_size=16, router="sigmoid_bias", n_group=4, topk_group=2)
    with pytest.raises(ValueError, match=field):
        MoEConfig(**{**values, **fields})


def test_sequence_loss_is_refused_where_a_rank_holds_part_of_a_sequence():
    moe = dict(num_experts=8, top_k=2, moe_ffn_hidden_size=16, router="sigmoid_bias", sequence_aux_loss_coeff=1e-4)
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=300,
                         position_embedding="rope", norm="rmsnorm", mlp="swiglu", moe=moe)
    with pytest.raises(ValueError, match=r"model\.moe\.sequence_aux_loss_coeff .*context_parallel_size 2"):
        config.check_parallel(1, 1, context_parallel_size=2)
    with pytest.raises(ValueError, match=r"model\.moe\.sequence_aux_loss_coeff .*sequence-split dispatch"):
        config.check_parallel(2, 1, sequence_parallel=True, expert_parallel_size=2)
    config.check_parallel(2, 1, sequence_parallel=True)  # EP 1: every TP rank routes the gathered sequence
    config.check_parallel(2, 1, expert_parallel_size=2)  # no sequence parallelism: the same


def test_group_limited_routing_and_the_sequence_loss_read_nothing_on_the_host():
    """A training forward and backward of the sparse layer at EP 1 (tests/host_syncs.py: the CUDA kernels, counted
    on the CPU): the groups, the scaling and the sequence-wise loss add no read and no copy."""
    from tests.host_syncs import HostSyncAudit

    layer = MoEMLP(_block(_moe(_hf_config(), sequence_aux_loss_coeff=1e-4))).train()
    x = _randn(2, 6, HIDDEN, seed=16).requires_grad_()
    with HostSyncAudit(layer) as audit:
        layer(x).sum().backward()
    assert audit.table() == {}, audit.where()
    assert x.grad is not None and layer.block.router.weight.grad is not None
