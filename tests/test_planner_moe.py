"""The planner on Mixture-of-Experts models (planner/experts.py): numbers, not just runs.

Mixtral-8x7B (h 4096, F 14336, 8 experts, top 2, 32 sparse blocks, bf16) at TP 2 x PP 4 x EP 2 on 8 H100 nodes (DP
8): a TP rank of stage 0 holds 3,052,208,128 parameters, of which 8 blocks x 4 local experts x 3 h F / 2 =
2,818,572,288 are experts; what the model built on the meta device at that layout holds too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import model.moe as moe_module
from model.config import preset
from model.gpt import TransformerLayer, gpt_layer_specs
from model.parallel import ParallelContext
from model.summary import analytic_active_parameters, analytic_total_parameters, stage_boundaries
from planner.experts import (
    all_to_all_bytes,
    count_expert_stages,
    expert_group_spans_nodes,
    expert_parallel_choices,
)
from planner.hardware import GPU_PRESETS, Assumptions, deepspeed_layout
from planner.memory import count_parameters, layer_activation_bytes, stage_memory
from planner.plan import plan_cluster
from planner.report import plan_to_dict
from planner.search import candidate_layouts, search_layouts
from planner.timing import (
    after_pipeline_time,
    micro_batch_time,
    ring_all_reduce_seconds,
    sustained_rates,
)
from runconfig.run import load_run_config
from tools.plan import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "ds_configs" / "1.3b.json"
H100, DEFAULTS = GPU_PRESETS["h100-80gb"], Assumptions()
MIXTRAL = ['model.preset="mixtral-8x7b"', "data.eod_token_id=2", "train_micro_batch_size_per_gpu=1",
           "train_batch_size=512", "schedule.batch={}"]
QWEN3 = ['model.preset="qwen3-30b-a3b"', "train_micro_batch_size_per_gpu=1", "train_batch_size=512",
         "schedule.batch={}"]
N_FIRST, EXPERTS_PER_STAGE = 3_052_208_128, 2_818_572_288  # Mixtral, TP 2 x PP 4 x EP 2, stage 0
NVLINK = 900e9 / 2 * 0.8  # H100 per direction x comm_efficiency
INFINIBAND = 400e9 / 8 * 0.8


def mixtral(tp: int = 2, pp: int = 4, ep: int = 2, *more: str):
    return load_run_config(BASE, [*MIXTRAL, f"parallelism.tensor_parallel_size={tp}",
                                  f"parallelism.pipeline_parallel_size={pp}", f"parallelism.expert_parallel_size={ep}",
                                  *more])


# ------------------------------------------------------------------------------------------------ parameters


EP_GROUP = object()  # stands for a process group of 2 ranks, of which this is rank 1


def built_on_meta(config, tp: int, pp: int, monkeypatch) -> list[tuple[int, int]]:
    """(parameters, expert parameters) of each stage of TP rank 0 and EP rank 1 of 2, built on the meta device."""
    size, rank = moe_module.group_size, moe_module.group_rank
    monkeypatch.setattr(moe_module, "group_size", lambda g: 2 if g is EP_GROUP else size(g))
    monkeypatch.setattr(moe_module, "group_rank", lambda g: 1 if g is EP_GROUP else rank(g))
    ctx = ParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, expert_parallel_size=2,
                          expert_parallel_group=EP_GROUP)
    specs, bounds = gpt_layer_specs(config, ctx, seed=0), stage_boundaries(config, pp)
    counts = []
    with torch.device("meta"):
        for stage in range(pp):
            parameters = [p for spec in specs[bounds[stage]:bounds[stage + 1]] for p in spec.build().parameters()]
            counts.append((sum(p.numel() for p in parameters),
                           sum(p.numel() for p in parameters if getattr(p, "expert_parallel", False))))
    return counts


@pytest.mark.parametrize("name, tp, pp, moe", [
    ("mixtral-8x7b", 2, 4, None),
    ("qwen3-30b-a3b", 2, 4, None),
    # dense and sparse blocks, a shared expert with its gate
    ("llama-tiny", 2, 2, dict(num_experts=4, top_k=2, moe_ffn_hidden_size=64, shared_expert_ffn_hidden_size=32,
                              first_dense_layers=1)),
])
def test_stage_counts_at_ep2_equal_the_model_built_on_the_meta_device(name, tp, pp, moe, monkeypatch):
    config = preset(name, **({"moe": moe} if moe else {}))
    counts = count_expert_stages(config, tp, pp, 2)
    assert [(c.parameters_per_tp_rank, c.expert_parameters_per_tp_rank) for c in counts] == \
        built_on_meta(config, tp, pp, monkeypatch)
    assert all(c.local_experts == config.moe.num_experts // 2 for c in counts)


def test_mixtral_counts_by_hand():
    counts = count_parameters(mixtral()).stages
    expert = 3 * 4096 * 14336 // 2  # gate_up 2 F h / t + down h F / t
    assert counts[0].expert_parameters_per_tp_rank == 8 * 4 * expert == EXPERTS_PER_STAGE
    assert counts[0].parameters_per_tp_rank == N_FIRST
    # EP 1 holds every expert: 8 blocks x 4 experts more
    assert count_parameters(mixtral(2, 4, 1)).stages[0].parameters_per_tp_rank == N_FIRST + 8 * 4 * expert
    parameters = count_parameters(mixtral())
    assert parameters.total == analytic_total_parameters(preset("mixtral-8x7b"), 2) == 46_702_792_704


# ------------------------------------------------------------------------------------------------ memory


def test_optimizer_states_shard_the_experts_over_the_expert_data_parallel_group():
    """DP 8, EP 2: the dense parameters' master, Adam and ZeRO partition over 8 ranks, the experts' over 4."""
    config = mixtral()
    count = count_parameters(config).stages[0]
    memory = stage_memory(config, deepspeed_layout(config), count, 8, 64, H100, DEFAULTS)
    dense = N_FIRST - EXPERTS_PER_STAGE  # 233,635,840
    assert memory.master_weights == 4 * dense // 8 + 4 * EXPERTS_PER_STAGE // 4 == 2_935_390_208
    assert memory.adam_states == 8 * dense // 8 + 8 * EXPERTS_PER_STAGE // 4 == 5_870_780_416
    # weights, .grad and BF16_Optimizer's fp32 accumulation buffer: full size, the local experts only
    assert (memory.weights, memory.gradients, memory.gradient_accumulation) == (2 * N_FIRST, 2 * N_FIRST, 4 * N_FIRST)
    zero = mixtral(2, 4, 2, "data_types.grad_accum_dtype=null", 'model.precision="fp32"', "bf16.enabled=false")
    partition = stage_memory(zero, deepspeed_layout(zero), count_parameters(zero).stages[0], 8, 64, H100, DEFAULTS)
    assert partition.gradient_partition == 4 * dense // 8 + 4 * EXPERTS_PER_STAGE // 4


def test_ep1_is_the_dense_formula_applied_to_the_moes_count():
    """At EP 1 the expert-data-parallel group is DP: the same bytes as a stage counted as dense, N_i over DP."""
    config = mixtral(2, 4, 1)
    count = count_parameters(config).stages[1]
    plain = dataclasses.replace(count, expert_parameters_per_tp_rank=0)  # no experts of its own: dense formula
    moe, dense = (stage_memory(config, deepspeed_layout(config), c, 8, 64, H100, DEFAULTS) for c in (count, plain))
    assert moe == dense
    n = count.parameters_per_tp_rank
    assert (moe.master_weights, moe.adam_states) == (4 * n // 8, 8 * n // 8)
    rates = sustained_rates(H100, DEFAULTS, 2, 4, 8)
    after = after_pipeline_time(config, deepspeed_layout(config), count, 8, rates)
    assert after.data_parallel_reduce == ring_all_reduce_seconds(2 * n, 8, rates.data_parallel_bytes_per_s)
    assert micro_batch_time(config, deepspeed_layout(config), count, rates).expert_all_to_all == 0.0


def test_dp_reduction_splits_dense_and_experts():
    config = mixtral()
    count = count_parameters(config).stages[0]
    rates = sustained_rates(H100, DEFAULTS, 2, 4, 8, 2)
    after = after_pipeline_time(config, deepspeed_layout(config), count, 8, rates)
    dp = rates.data_parallel_bytes_per_s
    assert after.data_parallel_reduce == pytest.approx(
        ring_all_reduce_seconds(2 * (N_FIRST - EXPERTS_PER_STAGE), 8, dp) + ring_all_reduce_seconds(
            2 * EXPERTS_PER_STAGE, 4, dp))


def kept_bytes(layer: torch.nn.Module, x: torch.Tensor) -> int:
    """The bytes of the storages a block's autograd nodes save for its backward (saved-tensor hooks; its parameters
    and its input left out), its output counted."""
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters and storage.data_ptr() != x.untyped_storage().data_ptr():
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    return sum(storages.values()) + out.untyped_storage().nbytes()


def test_sparse_block_activations_are_what_the_block_saves():
    """The tensors a real block saves for its backward (saved-tensor hooks, CPU, TP 1, EP 1, micro-batch 2): in fp32
    the planner's sparse block is exact but for the aux loss's E + 1 floats (36 bytes); in bf16 the planner's dense
    block differs from CPU's (its kernels keep other tensors than CUDA's), by as much as the sparse block does."""
    shape = dict(num_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, ffn_hidden_size=512,
                 seq_length=64)
    experts = [dict(num_experts=8, top_k=2, moe_ffn_hidden_size=128),
               dict(num_experts=8, top_k=2, moe_ffn_hidden_size=128, shared_expert_ffn_hidden_size=64,
                    router="sigmoid_bias", norm_topk_prob=False)]
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        gaps = []
        for moe in (None, *experts):
            config = preset("llama-tiny", **shape, precision=precision, moe=moe)
            layer = TransformerLayer(config, ParallelContext(), 1234, 1).to(dtype).train()
            x = torch.randn(2, 64, 256, dtype=dtype, requires_grad=True)
            planned = layer_activation_bytes(config, 2, 1, sequence_parallel=False, recompute="none",
                                             sparse=moe is not None)
            gaps.append(kept_bytes(layer, x) - planned)
        aux = 4 * 8 + 4  # the aux loss's mean probabilities (E fp32) and the loss
        if precision == "fp32":
            assert gaps == [0, aux, aux]
        else:
            assert gaps[1] - gaps[0] == gaps[2] - gaps[0] == aux


# ------------------------------------------------------------------------------------------------ time


def test_all_to_all_bytes_and_seconds_by_hand():
    model = preset("mixtral-8x7b")
    assert all_to_all_bytes(model, 1, 8) == 2 * 2 * 4096 * 4096 * 7 / 8  # e k s b h (P - 1) / P
    assert all_to_all_bytes(model, 2, 2) == 2 * 2 * 4096 * 2 * 4096 / 2
    assert all_to_all_bytes(model, 1, 1) == 0
    assert all_to_all_bytes(preset("mixtral-8x7b", moe={"capacity_factor": 0.5}), 1, 2) == 2 * 1 * 4096 * 4096 / 2
    for recompute, per_block in (("none", 4), ("selective", 4), ("full", 6)):  # full reruns dispatch and combine
        config = mixtral(2, 4, 2, f'model.recompute="{recompute}"')
        count = count_parameters(config).stages[1]  # 8 sparse blocks
        rates = sustained_rates(H100, DEFAULTS, 2, 4, 8, 2)
        assert rates.expert_parallel_bytes_per_s == NVLINK  # TP 2 x EP 2 = 4 ranks in a node
        slot = micro_batch_time(config, deepspeed_layout(config), count, rates)
        assert slot.expert_all_to_all == pytest.approx(8 * per_block * 2 * 2 * 4096 * 4096 / 2 / NVLINK)


def test_expert_groups_span_nodes_by_the_rank_layout():
    # (TP, PP, DP, EP, GPUs per node): EP groups are EP consecutive data ranks, TP apart
    assert not expert_group_spans_nodes(1, 1, 8, 8, 8)
    assert not expert_group_spans_nodes(2, 4, 8, 4, 8)  # ranks r, r + 2, r + 4, r + 6
    assert expert_group_spans_nodes(2, 4, 8, 8, 8)  # 16 ranks
    assert expert_group_spans_nodes(1, 1, 12, 3, 8)  # data ranks 6, 7, 8: the third group straddles two nodes
    assert not expert_group_spans_nodes(1, 1, 12, 4, 8)
    assert sustained_rates(H100, DEFAULTS, 2, 4, 8, 8).expert_parallel_bytes_per_s == INFINIBAND


def test_mfu_counts_the_active_parameters():
    plan = plan_cluster(mixtral(), 8, H100, DEFAULTS, count_parameters(mixtral()))
    assert plan.ok and plan.experts is not None
    model, t = mixtral().model, plan.full_batch
    tokens = 512 * 4096
    active_flops = tokens * (3 * 32 * (2 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 4096 * 8 + 2 * 3 * 4096 * 14336)
                                       + 4 * 4096 * 4096) + 6 * 4096 * model.padded_vocab_size(2))
    assert t.model_flops == pytest.approx(active_flops)
    assert t.mfu == pytest.approx(active_flops / (t.seconds * 64 * 989e12)) == plan.experts.mfu_active
    x = plan.experts
    assert (x.expert_parallel_size, x.experts_per_gpu, x.expert_data_parallel_size) == (2, 4, 4)
    assert (x.total_parameters, x.active_parameters) == (46_702_792_704, 12_879_925_248)
    assert x.active_parameters == analytic_active_parameters(model, 2)
    assert x.all_to_all_share == pytest.approx(t.expert_all_to_all / t.seconds) and x.all_to_all_share > 0
    assert t.seconds == pytest.approx(sum(getattr(t, name) for name in (
        "compute", "tensor_parallel", "pipeline_p2p", "gradient_accumulation", "bubble", "tied_embedding_reduce",
        "data_parallel_reduce", "optimizer_step", "zero_allgather", "sequence_parallel_reduce", "expert_all_to_all")))
    assert "experts" in plan_to_dict(plan) and "expert_all_to_all" in plan_to_dict(plan)["full_batch"]


# ------------------------------------------------------------------------------------------------ search


def test_search_tries_only_ep_dividing_the_experts_and_dp():
    config = mixtral(1, 1, 1)
    layouts = candidate_layouts(config, 16, 8)
    by_dp = {}
    for layout in layouts:
        by_dp.setdefault(layout.data_parallel_size, set()).add(layout.expert_parallel_size)
    assert by_dp == {dp: {ep for ep in (1, 2, 4, 8) if dp % ep == 0} for dp in by_dp} and 16 in by_dp
    assert by_dp[16] == {1, 2, 4, 8} and by_dp[2] == {1, 2}
    assert expert_parallel_choices(preset("qwen3-30b-a3b"), 48) == [1, 2, 4, 8, 16]
    assert expert_parallel_choices(preset("llama3-8b"), 16) == [1]  # dense: nothing changes


def test_search_of_a_small_moe_ranks_valid_ep():
    config = load_run_config(ROOT / "ds_configs" / "llama-tiny-cpu.json", [
        "model.moe={\"num_experts\": 4, \"top_k\": 2, \"moe_ffn_hidden_size\": 128}", "train_batch_size=64",
        "schedule.batch={}"])
    tried, results = search_layouts(config, 1, H100, DEFAULTS)
    eps = {r.layout.expert_parallel_size for r in results}
    assert tried == len(results) > 0 and eps == {1, 2, 4}  # the tiny model fits every layout
    assert all(4 % r.layout.expert_parallel_size == 0 and r.layout.data_parallel_size % r.layout.expert_parallel_size
               == 0 for r in results)
    assert all((r.full_batch.expert_all_to_all > 0) == (r.layout.expert_parallel_size > 1) for r in results)


# ------------------------------------------------------------------------------------------------ the CLI


def run(capsys, *settings: str, nodes: str = "8") -> tuple[int, str, str]:
    """tools/plan.py's status, stdout with its wrapped lines joined (one space between words), and stderr."""
    status = plan_main(["--ds_config", str(BASE), "--gpu", "h100-80gb", "--nodes", nodes,
                        *[word for s in settings for word in ("--set", s)]])
    out, err = capsys.readouterr()
    return status, " ".join(out.split()), err


def test_cli_plans_mixtral_with_its_expert_lines(capsys):
    status, out, err = run(capsys, *MIXTRAL, "parallelism.tensor_parallel_size=2", "parallelism.pipeline_parallel_size=4",
                           "parallelism.expert_parallel_size=2", 'model.recompute="full"')
    assert status == 0 and err == ""
    assert f"stage 0 WordEmbedding, EmbeddingDropout, TransformerLayer x8 {N_FIRST:,} {EXPERTS_PER_STAGE:,}" in out
    assert "EP 2: 4 experts per GPU in each sparse block" in out
    assert "46,702,792,704 total" in out and "12,879,925,248 active per token" in out
    assert "experts: EP 2, 4 of 8 experts per GPU in each of the 32 sparse blocks" in out
    assert "expert all to all" in out and "MFU (active FLOPs)" in out and "MFU on active FLOPs" in out


def test_cli_plans_qwen3_30b_a3b(capsys):
    status, out, _ = run(capsys, *QWEN3, "parallelism.pipeline_parallel_size=4", "parallelism.expert_parallel_size=8",
                         'model.recompute="full"', nodes="4")
    assert status == 0
    assert "EP 8: 16 experts per GPU in each sparse block" in out and "48 of 48 blocks sparse" in out
    assert "experts: EP 8, 16 of 128 experts per GPU" in out


def test_cli_refuses_an_ep_that_does_not_divide_in_one_line(capsys):
    status, out, err = run(capsys, *MIXTRAL, "parallelism.expert_parallel_size=3")
    assert status == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert "parallelism.expert_parallel_size (3) does not divide model.moe.num_experts (8): choose one of " \
           "[1, 2, 4, 8]" in err
    # EP 8 divides the experts, not DP 2 (1 node at TP 4): one line on stderr for that node count
    status, out, err = run(capsys, *MIXTRAL, "parallelism.tensor_parallel_size=4", "parallelism.expert_parallel_size=8",
                           nodes="1")
    assert status == 1 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: 1 nodes: parallelism.expert_parallel_size (8) does not divide the data-parallel "
                          "size (2,")
