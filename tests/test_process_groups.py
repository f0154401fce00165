"""Start-up creates only the process groups that are used: the project's TP groups, and DeepSpeed's own.

``new_group`` is collective over the whole world: every rank calls it for every group, members or not. On CUDA it is
more than bookkeeping: DeepSpeed binds each rank's device at ``init_process_group``, so torch builds every new group
with an ncclCommSplit of the world communicator, joined by all ranks. Start-up cost grows with the number of calls.

Who calls ``new_group`` while ``training/engine.py build_engine`` runs, for TP t x PP p x DP d on n = t p d ranks:

the project (model/parallel.py build_parallel_context), before the PipelineModule exists:
    TP groups                      p d    (t > 1)     the sharded layers and the vocab-parallel loss use them
DeepSpeed, while the PipelineModule is built (deepspeed/runtime/pipe/module.py, topology.py):
    world group                    1                  PipelineModule.world_group (module.py)
    model-parallel groups          d                  one per replica, all its p t ranks: grid.ds_model_proc_group
                                                      (overflow checks and the gradient norm across the model)
    data-parallel groups           p t                grid.dp_proc_group: gradient reduction, ZeRO partitions
    pipe groups                    t d                grid.pp_proc_group
    slice (tensor) groups          p d  (t > 1)       grid.slice_proc_group; n single-rank groups when t = 1
                                   n    (t = 1)
    tied-weight groups             d t                the word embedding shared by the first and last stage
    pipeline p2p groups            0                  torch >= 1.8 sends directly (deepspeed/runtime/pipe/p2p.py)
the engine (deepspeed.initialize): none.

At t 2 x p 2 x d 2 that is 4 for the project and 1 + 2 + 4 + 4 + 4 + 4 = 19 for DeepSpeed: 23 in all. Before, the
project also built the data-parallel groups, p t = 4 more (27), which nothing read. At the 530B run's t 8 x p 35 x
d 16 (4,480 ranks): 560 for the project (was 840) and 1,113 for DeepSpeed. The project's TP groups still duplicate
DeepSpeed's slice groups (same ranks): the layers take theirs from the ParallelContext, built before the layer specs,
while PipelineModule builds its grid inside its own constructor and accepts a topology, not a grid. Taking the TP
group from the grid needs model/gpt.py to hand the PipelineModule a grid built beforehand.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest

from model.config import ParallelConfig
from tests.distributed import run_distributed
from tests.test_model_parallel import deepspeed_config, model_config

REPO = Path(__file__).resolve().parents[1]


def expected_groups(tp: int, pp: int, dp: int) -> dict[str, list[tuple[int, ...]]]:
    """The rank lists of every new_group call, in call order, by caller (the table of the module docstring)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    world = tp * pp * dp

    def lists(axis: str) -> list[tuple[int, ...]]:
        return [tuple(ranks) for ranks in topology.get_axis_comm_lists(axis)]

    tied_stages = sorted({0, pp - 1})
    deepspeed = [
        tuple(range(world)),
        *[tuple(sorted(topology.get_axis_list(axis="data", idx=d))) for d in range(dp)],
        *lists("data"),
        *lists("pipe"),
        *(lists("model") if tp > 1 else [(r,) for r in range(world)]),
        *[tuple(topology.get_rank(pipe=s, data=d, model=m) for s in tied_stages) for d in range(dp) for m in range(tp)],
    ]
    return {"project": lists("model") if tp > 1 else [], "deepspeed": deepspeed}


def _count_groups_while_building(tp: int, pp: int) -> dict:
    """On every rank: wrap torch.distributed.new_group, build the engine, and report each call with its caller."""
    import torch.distributed as dist

    from training.engine import build_engine

    original = dist.new_group
    calls = []

    def counting_new_group(*args, **kwargs):
        ranks = kwargs.get("ranks", args[0] if args else None)
        calls.append((_caller(), tuple(sorted(ranks))))
        return original(*args, **kwargs)

    dist.new_group = counting_new_group
    try:
        engine, ctx = build_engine(model_config(), ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                                   deepspeed_config("fp32"), 1234)
    finally:
        dist.new_group = original
    used = tuple(dist.get_process_group_ranks(ctx.tensor_parallel_group)) if ctx.tensor_parallel_group else None
    return {"calls": calls, "tensor_parallel_ranks": used,
            "grid_slice_ranks": tuple(engine.grid.slice_group), "rank": dist.get_rank()}


def _caller() -> str:
    """'deepspeed' or 'project': whose code called new_group (the innermost frame outside torch and this file)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename
        if "/torch/" in path or path == __file__:
            continue
        return "deepspeed" if "/deepspeed/" in path else "project" if path.startswith(str(REPO)) else path
    return "unknown"


@pytest.mark.distributed
def test_only_used_groups_are_created_at_tp2_pp2_dp2():
    tp, pp, dp = 2, 2, 2
    ranks = run_distributed(tp * pp * dp, _count_groups_while_building, tp, pp)
    expected = expected_groups(tp, pp, dp)
    assert (len(expected["project"]), len(expected["deepspeed"])) == (4, 19)
    for result in ranks:  # a collective: every rank makes the same calls in the same order
        assert result["calls"] == ranks[0]["calls"]
        by_caller = {owner: [r for who, r in result["calls"] if who == owner] for owner in ("project", "deepspeed")}
        assert by_caller == expected, result["rank"]
        assert len(result["calls"]) == 23
        # Every group the project creates is the TP group of its members, the same ranks as DeepSpeed's slice group.
        assert result["tensor_parallel_ranks"] == result["grid_slice_ranks"]
    assert sorted({r["tensor_parallel_ranks"] for r in ranks}) == sorted(expected["project"])


def test_group_counts_at_the_530b_scale():
    groups = expected_groups(tp=8, pp=35, dp=16)
    assert len(groups["project"]) == 35 * 16 == 560
    assert len(groups["deepspeed"]) == 1 + 16 + 35 * 8 + 8 * 16 + 35 * 16 + 16 * 8 == 1113
    assert len(set(groups["project"]) - set(groups["deepspeed"])) == 0  # the TP groups are DeepSpeed's slice groups
