"""The sequence-split dispatch (model/moe.py): under sequence parallelism at TP 2 x EP 2 each TP rank routes and sends
its own s/2 positions through the expert-parallel all-to-all. Measured on 4 gloo processes, one launch, for the
same block with sequence parallelism off (every TP rank routes and sends all T tokens: what the dispatch did under
sequence parallelism too before) and on:

- the bytes each rank sends to other ranks in the all-to-alls of the rows, forward and backward (a counting wrapper
  around torch.distributed.all_to_all_single, the real collective underneath): equal to the planner's figure
  (planner/experts.py all_to_all_bytes, 4 all-to-alls a block) on a router made to spread the tokens evenly (each
  token's two experts are t mod E and t + 1 mod E), and 1/TP of it with sequence parallelism;
- what the block keeps for its backward (saved-tensor hooks, fp32): the planner's sparse rows
  (planner/memory.py sparse_mlp_stored_tensors) exactly, but for the aux loss's E floats, in both dispatches;
  the per-position rows are per s/2 positions in the split one. Measured: 21,280 and 15,264 bytes a rank, and
  8,192 against 4,096 bytes sent (before the split dispatch, 8,192 with sequence parallelism too).

That the split block computes what the unsplit one does (outputs, input, expert and router gradients within 1e-6)
is tests/test_moe.py's, at EP 2 x TP 2 and EP 4 x TP 2 with sequence parallelism.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from model.config import MoEConfig, ParallelConfig, preset
from model.moe import MoEBlock
from model.parallel import build_parallel_context
from planner.experts import all_to_all_bytes
from planner.memory import sparse_mlp_stored_tensors
from tests.distributed import run_distributed

EXPERTS, HIDDEN, FFN, BATCH, SEQUENCE = 8, 16, 8, 2, 16  # per EP rank 32 tokens; a TP rank's 16 cycle the experts
MOE = MoEConfig(num_experts=EXPERTS, top_k=2, moe_ffn_hidden_size=FFN, aux_loss_coeff=0.1)


def balanced_inputs(rank_tokens: int, first: int) -> torch.Tensor:
    """Tokens whose router logits put experts t mod E and t + 1 mod E first (t from ``first``): x_t = 10 e_(t mod E)
    + 5 e_(t + 1 mod E) against a router whose row e is the unit vector e."""
    x = torch.zeros(rank_tokens, HIDDEN)
    t = torch.arange(first, first + rank_tokens)
    x[torch.arange(rank_tokens), t % EXPERTS] = 10.0
    x[torch.arange(rank_tokens), (t + 1) % EXPERTS] = 5.0
    return x


def _sent_bytes(calls: list) -> int:
    """Bytes this rank sent to the other ranks of the expert-parallel group in the recorded all-to-alls."""
    return sum(row_bytes * sum(size for q, size in enumerate(splits) if q != me) for splits, row_bytes, me in calls)


def _measure() -> dict:
    from model.primitives import group_rank

    ctx = build_parallel_context(ParallelConfig(tensor_parallel_size=2))
    expert_group = None
    for ranks in ctx.topology.get_axis_comm_lists("data"):  # EP = DP = 2: the data ranks of this TP rank
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            expert_group = group
    calls, real = [], dist.all_to_all_single

    def counting(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        if group is expert_group and input_split_sizes is not None and tensor.dim() == 2:  # the rows, not counts
            calls.append((input_split_sizes, tensor.shape[1] * tensor.element_size(), group_rank(group)))
        return real(output, tensor, output_split_sizes, input_split_sizes, group, **kwargs)

    dist.all_to_all_single = counting
    results = {}
    try:
        for sequence_parallel in (False, True):
            case = dataclasses.replace(ctx, sequence_parallel=sequence_parallel)
            block = MoEBlock(MOE, HIDDEN, case, seed=1234, layer_number=3, init_std=0.2, output_init_std=0.2,
                             expert_parallel_group=expert_group)
            with torch.no_grad():
                block.router.weight.copy_(torch.eye(EXPERTS, HIDDEN))
            positions = SEQUENCE // 2 if sequence_parallel else SEQUENCE
            first = ctx.tensor_parallel_rank * positions * BATCH if sequence_parallel else 0
            x = balanced_inputs(BATCH * positions, first).view(BATCH, positions, HIDDEN).requires_grad_()
            storages = {}
            parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}

            def pack(t, storages=storages, parameters=parameters):
                storage = t.untyped_storage()
                if storage.data_ptr() not in parameters:  # the input too: the ln2 output the router keeps
                    storages[storage.data_ptr()] = storage.nbytes()
                return t

            calls.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out, stats = block(x)
            (out.square().sum() + stats.loss_scale * stats.aux_loss).backward()
            results[sequence_parallel] = {"sent": _sent_bytes(calls), "all_to_alls": len(calls),
                                          "kept": sum(storages.values()),
                                          "split": block.splits_the_sequence,
                                          "counts": stats.tokens_per_expert.tolist()}
    finally:
        dist.all_to_all_single = real
    return results


@pytest.mark.distributed
def test_the_split_dispatch_sends_a_tp_ranks_share_and_keeps_per_position_rows_per_rank_positions():
    model = preset("llama-tiny", num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=2,
                   seq_length=SEQUENCE, moe=dataclasses.asdict(MOE))
    ranks = run_distributed(4, _measure)
    aux = 4 * EXPERTS  # the aux loss's mean probabilities, E floats: not in the planner's rows
    for rank in ranks:
        for sequence_parallel, found in rank.items():
            assert found["split"] == sequence_parallel
            assert found["counts"] == [BATCH * SEQUENCE * 2 // EXPERTS] * EXPERTS  # balanced over the EP rank's tokens
            planned = all_to_all_bytes(model, BATCH, 2, 2, sequence_parallel)
            assert found["all_to_alls"] == 4 and found["sent"] == 4 * planned, (sequence_parallel, found)
            rows = sparse_mlp_stored_tensors(model, 2, micro_batch=BATCH, expert_parallel_size=2,
                                             sequence_parallel=sequence_parallel)
            tokens = BATCH * SEQUENCE
            assert found["kept"] == tokens * sum(row.bytes_per_token for row in rows) + aux, (sequence_parallel, found)
        assert rank[True]["sent"] * 2 == rank[False]["sent"]  # 1/TP of the bytes
    print({sp: ranks[0][sp]["kept"] for sp in (False, True)})
