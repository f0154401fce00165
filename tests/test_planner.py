"""The planner: its formulas against values worked out by hand, the 530B count, a real DeepSpeed engine's
allocations, the layout search, and the errors of impossible plans.

Hand values use the 530B shape: s = 2048, b = 1, h = 20480, a = 128, f = 4h, t = 8, p = 35, V = 51200, bf16, so one
hidden tensor 2 s b h = 83,886,080 bytes, and N_0 = 2,060,874,240 parameters on a TP rank of stage 0 (N_34 =
2,018,972,160 on the last stage). What a block keeps (planner/memory.py, layer_stored_tensors), per token, in
bytes: 2 x (4h + 3h/t + h/t + 2f/t) = 2 x 5.5 h = 11 h at t = 8, plus the LayerNorm statistics (2 norms x 2 x 4 =
16) and the SDPA logsumexp (4 a / t = 64): s b h x 11 + 80 s b. Selective recompute drops the logsumexp, full
keeps the block output alone (2 h). With sequence parallelism every h above that is not split by t is: 2 x 16 h / 8
= 4 h, + 16 / 8 + 64.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from planner.hardware import GPU_PRESETS, Assumptions, deepspeed_layout
from planner.memory import (
    count_parameters,
    layer_activation_bytes,
    layer_stored_tensors,
    micro_batches_held,
    stage_activations,
    stage_memory,
)
from planner.plan import plan_cluster
from planner.ramp import suggest_ramp, training_time
from planner.scaling import CHINCHILLA, chinchilla_optimal, compute_optimal, twenty_tokens_per_parameter
from planner.timing import (
    iteration_time,
    micro_batch_time,
    ring_all_gather_seconds,
    ring_all_reduce_seconds,
    stage_flops_per_micro_batch,
    sustained_rates,
)
from runconfig.run import load_run_config, parse_run_config
from runconfig.schedules import BatchRamp
from tests.distributed import run_distributed
from training.engine import build_engine

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "ds_configs" / "530b.json"
A100, DEFAULTS = GPU_PRESETS["a100-80gb"], Assumptions()
HIDDEN_TENSOR = 2 * 2048 * 20480  # bytes of one bf16 (s, b, h) activation
N_FIRST, N_LAST = 2_060_874_240, 2_018_972_160
SBH = 2048 * 1 * 20480
S = 2048
LAYER_NONE = SBH * 11 + S * 80  # 461,537,280 bytes at t = 8: the fused kernel's set
LAYER_STORED = SBH * 11 + S * (16 + 5 * 16 * 2048)  # the logsumexp replaced by Korthikanti's 5 a s / t = 8 s b h
STORED = Assumptions(attention_scores="stored")


# ------------------------------------------------------------------------------------------- formulas by hand


def layer(model, t=8, **kwargs) -> float:
    return layer_activation_bytes(model, 1, t, **{"sequence_parallel": False, **kwargs})


def test_layer_activations_of_this_implementation(recipe):
    model = recipe.model
    assert layer(model, recompute="none") == LAYER_NONE == 461_537_280
    assert layer(model, recompute="selective") == SBH * 11 + S * 16  # the logsumexp recomputed
    assert layer(model, recompute="full") == HIDDEN_TENSOR  # the block output alone
    # sequence parallelism: the replicated 8 h of the 11 h become h, the LayerNorm statistics 16 / 8 bytes
    assert layer(model, recompute="none", sequence_parallel=True) == SBH * 4 + S * (2 + 64)
    assert layer(model, recompute="selective", sequence_parallel=True) == SBH * 4 + S * 2
    assert layer(model, recompute="full", sequence_parallel=True) == HIDDEN_TENSOR / 8
    # at t = 1 the GPT block keeps 2 x 16 h + 16 + 4 a: sequence parallelism at t = 8 is exactly that / 8
    assert layer(model, 1, recompute="none") == SBH * 32 + S * (16 + 512)
    assert layer(model, recompute="none", sequence_parallel=True) == pytest.approx(
        (SBH * 32 + S * 16) / 8 + S * 512 / 8)


def test_sequence_parallelism_divides_the_replicated_rows_by_t(recipe):
    def rows(sequence_parallel: bool) -> dict[str, float]:
        return {r.name: r.bytes_per_token for r in layer_stored_tensors(recipe.model, 8,
                                                                        sequence_parallel=sequence_parallel)}

    plain, sharded = rows(False), rows(True)
    replicated = ("block output (the next block's input)", "ln1 output, residual sum (ln2 input), ln2 output",
                  "ln1: mean and rstd (fp32)", "ln2: mean and rstd (fp32)")
    assert all(sharded[name] == plain[name] / 8 for name in replicated)
    assert all(sharded[name] == plain[name] for name in plain if name not in replicated)  # already split by t


def test_layer_activations_with_scores_stored(recipe):
    """Korthikanti et al.'s 5 a s / (h t) = 8 s b h of scores: kept without recompute, dropped by selective."""
    model = recipe.model
    assert layer(model, recompute="none", attention_scores_stored=True) == LAYER_STORED
    assert LAYER_STORED - LAYER_NONE == SBH * 8 - S * 64
    assert layer(model, recompute="selective", attention_scores_stored=True) == SBH * 11 + S * 16
    assert layer(model, recompute="full", attention_scores_stored=True) == HIDDEN_TENSOR


def test_llama_layer_activations_from_the_code():
    """llama-tiny, fp32, t = 1, micro-batch 2: h 128, 8 query and 2 key/value heads of 16, f 256, RoPE. Per token, in
    elements: the block output, ln1 and ln2 outputs, the residual sum (4 h), each RMSNorm's normalised x (2 h) and
    rsqrt (2), QKV 1.5 h, the rotated query h and keys h / 4, the dense input h, a transposed copy of the SDPA output
    (the 2 groups' flattened query, and so the output, are (b, a, s, d)) h and the logsumexp 8, SwiGLU 8 h:
    18.75 h + 10, and cos and sin, (s, d) each per block: 2 x 16 / 2 per token. At TP 2 a rank holds one group: the
    query is a view, the dense input a view of the SDPA output. Both are measured in tests/test_activation_memory.py."""
    from model.config import preset

    model = preset("llama-tiny")
    h, tokens = 128, 2 * 64
    none = layer_activation_bytes(model, 2, 1, sequence_parallel=False, recompute="none")
    assert none == tokens * 4 * (18.75 * h + 10 + 16)
    selective = layer_activation_bytes(model, 2, 1, sequence_parallel=False, recompute="selective")
    assert none - selective == tokens * 4 * (h + 8)  # the SDPA output (the dense input is a copy) and logsumexp
    at_tp2 = layer_activation_bytes(model, 2, 2, sequence_parallel=False, recompute="none")
    assert at_tp2 - layer_activation_bytes(model, 2, 2, sequence_parallel=False, recompute="selective") == \
        tokens * 4 * 4  # one group per rank: the logsumexp of its 4 heads only


def test_stage_activations_530b(recipe, parameters):
    first = stage_activations(recipe.model, parameters.stages[0], 1, 8)
    last = stage_activations(recipe.model, parameters.stages[-1], 1, 8)
    assert first.per_micro_batch == 4 * HIDDEN_TENSOR  # the stage input + 3 block outputs
    assert first.working_set == LAYER_NONE  # one block recomputed
    head = HIDDEN_TENSOR + S * 8 + 2 * 2 * 2048 * 51200 // 8  # final norm output and stats, bf16 logits + gradient
    assert last.working_set == LAYER_NONE + head
    none = stage_activations(recipe.model, parameters.stages[0], 1, 8, recompute="none")
    assert (none.per_micro_batch, none.working_set) == (3 * LAYER_NONE + HIDDEN_TENSOR, 0)
    selective = stage_activations(recipe.model, parameters.stages[0], 1, 8, recompute="selective",
                                  sequence_parallel=True)
    assert selective.per_micro_batch == 3 * (SBH * 4 + S * 2) + HIDDEN_TENSOR / 8
    assert selective.working_set == 3 * 0 + S * 64  # one block's recomputed core: its logsumexp
    stored = stage_activations(recipe.model, parameters.stages[0], 1, 8, attention_scores_stored=True)
    assert stored.per_micro_batch == first.per_micro_batch and stored.working_set == LAYER_STORED


def test_recompute_num_layers_splits_a_stage(recipe, parameters):
    """The first n blocks of each stage recompute, the others store everything."""
    model = load_run_config(RECIPE, ["model.recompute_num_layers=1"]).model
    full = stage_activations(model, parameters.stages[0], 1, 8)
    assert full.per_micro_batch == HIDDEN_TENSOR + 2 * LAYER_NONE + HIDDEN_TENSOR and full.working_set == LAYER_NONE
    # FLOPs: one block in three reruns its forward
    one = stage_flops_per_micro_batch(model, parameters.stages[1], 1, 8)
    every = stage_flops_per_micro_batch(recipe.model, parameters.stages[1], 1, 8)
    none = stage_flops_per_micro_batch(recipe.model, parameters.stages[1], 1, 8, recompute="none")
    assert one - none == pytest.approx((every - none) / 3, rel=1e-12)


def test_micro_batches_held_by_a_1f1b_stage():
    assert [micro_batches_held(stage, 35, 240) for stage in (0, 1, 17, 34)] == [35, 34, 18, 1]
    assert [micro_batches_held(stage, 35, 2) for stage in (0, 33, 34)] == [2, 2, 1]


def test_links_follow_deepspeeds_rank_layout():
    """TP ranks are neighbours, DP ranks TP apart, stages TP x DP apart: a group on one node uses NVLink."""
    nvlink, infiniband = 600e9 / 2 * 0.8, 200e9 / 8 * 0.8
    recipe_rates = sustained_rates(A100, DEFAULTS, 8, 35, 8)
    assert (recipe_rates.tensor_parallel_bytes_per_s, recipe_rates.data_parallel_bytes_per_s,
            recipe_rates.pipeline_bytes_per_s) == (nvlink, infiniband, infiniband)
    one_node = sustained_rates(A100, DEFAULTS, 2, 2, 2)
    assert one_node.data_parallel_bytes_per_s == one_node.pipeline_bytes_per_s == nvlink
    assert sustained_rates(A100, DEFAULTS, 16, 1, 1).tensor_parallel_bytes_per_s == infiniband


def test_ring_volumes():
    assert ring_all_reduce_seconds(1e9, 8, 100e9) == pytest.approx(2 * 7 / 8 * 1e9 / 100e9)
    assert ring_all_gather_seconds(1e9, 8, 100e9) == pytest.approx(7 / 8 * 1e9 / 100e9)
    assert ring_all_reduce_seconds(1e9, 1, 100e9) == ring_all_gather_seconds(1e9, 1, 100e9) == 0.0


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_stage_flops_add_up_to_flops_per_iteration(recipe, parameters, recompute):
    from model.flops import flops_per_iteration

    per_micro_batch = sum(stage_flops_per_micro_batch(recipe.model, c, 1, 8, recompute) for c in parameters.stages)
    # every TP rank of every stage, 240 micro-batches on each of 8 pipelines
    assert per_micro_batch * 8 * 240 * 8 == pytest.approx(flops_per_iteration(recipe.model, 1920, 8, recompute),
                                                          rel=1e-12)


def test_recompute_flops_by_hand(recipe, parameters):
    """Per middle stage (3 blocks) and micro-batch, over t = 8: full reruns each block's forward, 24 h^2 + 4 s h per
    token; selective the attention core's, 4 s h per token; none nothing."""
    s, h = 2048, 20480
    none = stage_flops_per_micro_batch(recipe.model, parameters.stages[1], 1, 8, "none")
    assert none == pytest.approx(3 * s * 3 * (24 * h * h + 4 * s * h) / 8, rel=1e-12)
    full = stage_flops_per_micro_batch(recipe.model, parameters.stages[1], 1, 8, "full")
    assert full - none == pytest.approx(3 * s * (24 * h * h + 4 * s * h) / 8, rel=1e-12)  # 1.105e13
    selective = stage_flops_per_micro_batch(recipe.model, parameters.stages[1], 1, 8, "selective")
    assert selective - none == pytest.approx(3 * s * 4 * s * h / 8, rel=1e-12)  # 1.29e11: 1.6% of none


def test_530b_memory_parts_by_hand(recipe, parameters):
    memory = stage_memory(recipe, deepspeed_layout(recipe), parameters.stages[0], 8, 240, A100, DEFAULTS)
    n = N_FIRST
    assert (memory.weights, memory.gradients, memory.gradient_accumulation) == (2 * n, 2 * n, 4 * n)
    assert (memory.master_weights, memory.adam_states, memory.gradient_partition) == (4 * n // 8, 8 * n // 8, 0)
    assert memory.micro_batches_held == 35
    assert memory.activations == memory.activations_full == 35 * 4 * HIDDEN_TENSOR + LAYER_NONE
    assert memory.activations_none == 35 * (3 * LAYER_NONE + HIDDEN_TENSOR)
    assert memory.activations_selective == 35 * (3 * (SBH * 11 + S * 16) + HIDDEN_TENSOR) + 3 * 0 + S * 64
    assert memory.pipeline_buffers == 2 * HIDDEN_TENSOR and memory.reduce_buffer == 2 * n  # the bf16 cast
    assert memory.total == 8 * n + 12 * n // 8 + memory.activations + 2 * HIDDEN_TENSOR + 2 * 2**30
    assert memory.fits and memory.margin == 80 * 2**30 - memory.total
    stored = stage_memory(recipe, deepspeed_layout(recipe), parameters.stages[0], 8, 240, A100, STORED)
    assert stored.activations == 35 * 4 * HIDDEN_TENSOR + LAYER_STORED
    assert stored.activations_none == 35 * (3 * LAYER_STORED + HIDDEN_TENSOR)


def test_530b_without_checkpointing_fits_only_if_attention_is_fused(recipe, parameters):
    """Stage 0 holds 35 micro-batches of 3 full blocks + its input: 8 N + 12 N / 8 + activations + p2p + 2 GiB."""
    no_recompute = load_run_config(RECIPE, ["model.recompute=\"none\""])
    static = 8 * N_FIRST + 12 * N_FIRST // 8 + 2 * HIDDEN_TENSOR + 2 * 2**30
    fused = stage_memory(no_recompute, deepspeed_layout(recipe), parameters.stages[0], 8, 240, A100, DEFAULTS)
    assert fused.total == static + 35 * (3 * LAYER_NONE + HIDDEN_TENSOR) == 73_290_988_288  # 68.26 GiB
    assert fused.fits
    stored = stage_memory(no_recompute, deepspeed_layout(recipe), parameters.stages[0], 8, 240, A100, STORED)
    assert stored.total == static + 35 * (3 * LAYER_STORED + HIDDEN_TENSOR)  # 101.1 GiB
    assert not stored.fits


def test_530b_iteration_time_by_hand(recipe, parameters):
    timed = iteration_time(recipe, deepspeed_layout(recipe), parameters.stages, 8, 1920, A100, DEFAULTS)
    flops_per_s, nvlink, infiniband, hbm = 312e12 * 0.6, 300e9 * 0.8, 25e9 * 0.8, 2039e9 * 0.8
    last_stage_flops = (3 * 96 * 2048 * 20480**2 * (1 + 2048 / (6 * 20480)) + 6 * 2048 * 20480 * 51200) / 8
    all_reduce = 2 * 7 / 8 * HIDDEN_TENSOR / nvlink
    slot = timed.micro_batch
    assert slot.stage == 34  # the logits make the last stage the slowest
    assert slot.compute == pytest.approx(last_stage_flops / flops_per_s)
    assert slot.tensor_parallel == pytest.approx((3 * 6 + 1) * all_reduce)  # 6 per layer with recompute, + the head
    assert slot.pipeline_p2p == pytest.approx(2 * HIDDEN_TENSOR / 8 / infiniband + 7 / 8 * HIDDEN_TENSOR / nvlink)
    assert slot.gradient_accumulation == pytest.approx(12 * N_LAST / hbm)
    after = (2 * 1 / 2 * 4 * 6400 * 20480 / infiniband  # tied embedding, fp32, between 2 stages
             + 2 * 7 / 8 * 2 * N_FIRST / infiniband  # bf16 all-reduce over DP 8
             + (30 * N_FIRST / 8 + 16 * N_FIRST) / hbm  # Adam on the partition; cast, uncast and zero the buffer
             + 7 / 8 * 2 * N_FIRST / infiniband)  # ZeRO-1 all-gather of the bf16 weights
    assert timed.seconds == pytest.approx((240 + 34) * slot.total + after)
    assert timed.bubble == pytest.approx(34 * slot.total) and timed.bubble_fraction == 34 / 240
    assert timed.tflops_per_gpu == pytest.approx(timed.flops / (timed.seconds * 2240) / 1e12)
    assert timed.hfu == pytest.approx(timed.tflops_per_gpu / 312)
    assert timed.mfu == pytest.approx(timed.model_flops / (timed.seconds * 2240) / 1e12 / 312)
    assert timed.model_flops / timed.flops == pytest.approx(0.75, abs=0.002)  # 72 / 96, the logits aside


SELECTIVE_SP = ["parallelism.sequence_parallel=true", "model.recompute=\"selective\""]


def test_530b_sequence_parallel_selective_slot_by_hand(parameters):
    config = load_run_config(RECIPE, SELECTIVE_SP)
    assert not deepspeed_layout(config).pipe_partitioned  # the engine turns it off with SP
    timed = iteration_time(config, deepspeed_layout(config), parameters.stages, 8, 1920, A100, DEFAULTS)
    flops_per_s, nvlink, infiniband = 312e12 * 0.6, 300e9 * 0.8, 25e9 * 0.8
    s, h = 2048, 20480
    last_stage_flops = (3 * 72 * s * h**2 * (1 + s / (6 * h)) + 3 * s * 4 * s * h + 6 * s * h * 51200) / 8
    all_reduce = 2 * 7 / 8 * HIDDEN_TENSOR / nvlink
    slot = timed.micro_batch
    assert slot.stage == 34 and slot.compute == pytest.approx(last_stage_flops / flops_per_s)
    # 4 per block as all-gathers + reduce-scatters, 1 more per block regathering the column-parallel inputs, the
    # head's 1 and its regather's 1/2; selective reruns no collective
    assert slot.tensor_parallel == pytest.approx((3 * 4 + 3 + 1 + 0.5) * all_reduce)
    assert slot.pipeline_p2p == pytest.approx(2 * HIDDEN_TENSOR / 8 / infiniband)  # the shard, nothing to rebuild
    replicated = 3 * (2 * 2 * h + 2 * h) + 2048 * h  # stage 0: LayerNorms, row-parallel biases, position table
    assert timed.sequence_parallel_reduce == pytest.approx(2 * 7 / 8 * 4 * replicated / nvlink)


def test_530b_selective_with_sequence_parallelism_beats_full_recompute(recipe, parameters):
    """Korthikanti et al. 2022 measured 1.29x at 530B (TP 8 x PP 35, 2240 A100s): the plan must give >= 1.2x and fit.
    Predicted: full 56.59 s, 31.76 GiB at stage 0; selective + SP 44.77 s, 37.00 GiB: 1.264x."""
    full = plan_cluster(recipe, 280, A100, DEFAULTS, parameters)
    selective = plan_cluster(load_run_config(RECIPE, SELECTIVE_SP), 280, A100, DEFAULTS, parameters)
    assert full.ok and selective.ok and selective.peak_memory().fits
    assert selective.peak_memory().total / 2**30 == pytest.approx(37.00, abs=0.01)
    assert full.full_batch.seconds == pytest.approx(56.59, abs=0.01)
    assert selective.full_batch.seconds == pytest.approx(44.77, abs=0.01)
    assert full.full_batch.seconds / selective.full_batch.seconds >= 1.2
    # the same model FLOPs in less time; full recompute's hardware FLOPs are a third more
    assert selective.full_batch.mfu / full.full_batch.mfu == pytest.approx(
        full.full_batch.seconds / selective.full_batch.seconds)
    assert full.full_batch.hfu > full.full_batch.mfu and selective.full_batch.hfu == pytest.approx(
        selective.full_batch.mfu * (1 + 4 * 2048 * 20480 / (24 * 20480**2 * 1.0167 + 4 * 2048 * 20480) / 3),
        rel=2e-3)


@pytest.mark.parametrize("nodes, seconds, paper_tflops", [(280, 60.1, 126), (420, 44.4, 113)])
def test_measured_iteration_gives_the_papers_throughput(recipe, parameters, nodes, seconds, paper_tflops):
    """Smith et al. 2022, table: iteration time and TFLOP/s per GPU at 280 and 420 nodes."""
    plan = plan_cluster(recipe, nodes, A100, DEFAULTS, parameters, iteration_seconds=seconds)
    assert plan.measured["tflops_per_gpu"] == pytest.approx(paper_tflops, abs=0.6)
    assert plan.measured["hfu"] == pytest.approx(plan.measured["tflops_per_gpu"] / 312)
    # MFU counts model FLOPs: 72 of full recompute's 96 (the logits aside)
    assert plan.measured["mfu"] == pytest.approx(plan.measured["model_tflops_per_gpu"] / 312)
    assert plan.measured["mfu"] / plan.measured["hfu"] == pytest.approx(0.75, abs=0.002)


def test_training_time_integrates_the_ramp_in_tokens():
    ramp = BatchRamp(start=2, increment=2, end=6, ramp_tokens=400)  # 200 tokens at 2, 200 at 4, then 6
    timed = training_time(ramp, 1000, seq_length=10, seconds_per_step=lambda batch: 1.0 + batch)
    # steps 200 / 20 + 200 / 40 + 600 / 60 = 10 + 5 + 10; seconds 10 x 3 + 5 x 5 + 10 x 7
    assert (timed.steps, timed.seconds) == (25, 125)
    assert (timed.ramp_tokens, timed.ramp_steps, timed.ramp_seconds) == (400, 15, 55)
    assert timed.ramp_seconds_at_full_batch_rate == pytest.approx(400 * 7 / 60)


def test_ramp_warning_names_sizes_and_a_ramp_that_works(recipe, parameters):
    ramp = recipe.batch_schedule()
    assert (suggest_ramp(ramp, 10).start, suggest_ramp(ramp, 10).increment) == (30, 30)
    assert (suggest_ramp(ramp, 12).start, suggest_ramp(ramp, 12).increment) == (48, 36)
    at_dp10 = plan_cluster(recipe, 350, A100, DEFAULTS, parameters)
    assert at_dp10.ok and at_dp10.data_parallel_size == 10 and len(at_dp10.warnings) == 1
    assert "32, 64, 96, 128, 192" in at_dp10.warnings[0] and "schedule.batch.increment=30" in at_dp10.warnings[0]
    assert at_dp10.ramp["suggested"] and at_dp10.first_batch.global_batch == 30
    assert at_dp10.full_batch.micro_batches == 192  # the full-batch figures are still given
    for nodes in (280, 560):  # DP 8 and 16 divide every size of the ramp
        assert plan_cluster(recipe, nodes, A100, DEFAULTS, parameters).warnings == []


def test_throughput_falls_with_nodes_at_a_fixed_batch(recipe, parameters):
    plans = [plan_cluster(recipe, n, A100, DEFAULTS, parameters) for n in (280, 350, 420, 560)]
    assert all(p.ok and p.peak_memory().fits for p in plans)
    tflops = [p.full_batch.tflops_per_gpu for p in plans]
    bubbles = [p.full_batch.bubble_fraction for p in plans]
    assert tflops == sorted(tflops, reverse=True) and bubbles == sorted(bubbles)
    assert [p.full_batch.micro_batches for p in plans] == [240, 192, 160, 120]


# ---------------------------------------------------------------------------- tokens per parameter, compute-optimal


def chinchilla_loss(parameters: float, tokens: float) -> float:
    """Hoffmann et al. 2022, approach 3: L(N, D) = 1.69 + 406.4 / N^0.34 + 410.7 / D^0.28."""
    return 1.69 + 406.4 / parameters**0.34 + 410.7 / tokens**0.28


def minimise_along_budget(flops: float) -> float:
    """The N minimising L(N, C / (6 N)), by golden-section search over log N: no closed form involved."""
    low, high = math.log(1e6), math.log(1e15)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        left, right = high - ratio * (high - low), low + ratio * (high - low)
        loss_left = chinchilla_loss(math.exp(left), flops / (6 * math.exp(left)))
        loss_right = chinchilla_loss(math.exp(right), flops / (6 * math.exp(right)))
        low, high = (low, right) if loss_left < loss_right else (left, high)
    return math.exp((low + high) / 2)


@pytest.mark.parametrize("flops", [1e21, 5.76e23, 6 * 529_600_819_200 * 270e9])
def test_chinchilla_optimum_minimises_the_fitted_loss(flops):
    fit = chinchilla_optimal(flops)
    assert 6 * fit.parameters * fit.tokens == pytest.approx(flops, rel=1e-12)  # on the budget
    assert fit.parameters == pytest.approx(minimise_along_budget(flops), rel=1e-6)
    # the closed form, written out: a = 0.28 / 0.62, b = 0.34 / 0.62, G = (0.34 x 406.4 / (0.28 x 410.7))^(1 / 0.62)
    g = (0.34 * 406.4 / (0.28 * 410.7)) ** (1 / 0.62)
    assert fit.parameters == pytest.approx(g * (flops / 6) ** (0.28 / 0.62), rel=1e-12)
    assert fit.tokens == pytest.approx((flops / 6) ** (0.34 / 0.62) / g, rel=1e-12)
    # first-order condition along N D = C / 6: alpha A / N^alpha = beta B / D^beta
    assert 0.34 * 406.4 / fit.parameters**0.34 == pytest.approx(0.28 * 410.7 / fit.tokens**0.28, rel=1e-9)
    assert CHINCHILLA.E == 1.69 and (CHINCHILLA.A, CHINCHILLA.B) == (406.4, 410.7)


def test_twenty_tokens_per_parameter_rule():
    rule = twenty_tokens_per_parameter(1.2e23)  # 120 N^2 = 1.2e23: N = 1e10.5
    assert rule.parameters == pytest.approx(10**10.5) and rule.tokens == pytest.approx(20 * 10**10.5)
    assert rule.tokens_per_parameter == pytest.approx(20)
    # Chinchilla itself: 70B parameters on 1.4T tokens
    chinchilla = twenty_tokens_per_parameter(6 * 70e9 * 1.4e12)
    assert (chinchilla.parameters, chinchilla.tokens) == (pytest.approx(70e9), pytest.approx(1.4e12))


def test_530b_tokens_per_parameter(recipe, parameters):
    optimal = compute_optimal(recipe, parameters)
    assert optimal.run.tokens_per_parameter == pytest.approx(0.51, abs=0.005)  # 270e9 / 529.6e9 = 0.5098
    assert optimal.flops == pytest.approx(6 * 529_600_819_200 * 270e9)  # 8.58e23
    # at that C the fit wants a model of about 38.5B on 3.71T tokens, the rule 84.6B on 1.69T
    assert optimal.chinchilla.parameters == pytest.approx(minimise_along_budget(optimal.flops), rel=1e-6)
    assert optimal.chinchilla.parameters == pytest.approx(38.5e9, rel=0.01)
    assert optimal.twenty_tokens_per_parameter.parameters == pytest.approx(math.sqrt(optimal.flops / 120))


# ----------------------------------------------------------------------------------------------- parameter count


def test_530b_meta_count_equals_analytic(parameters):
    assert len(parameters.stages) == 35
    assert all(c.parameters_per_tp_rank == c.analytic_per_tp_rank for c in parameters.stages)
    assert (parameters.stages[0].parameters_per_tp_rank, parameters.stages[-1].parameters_per_tp_rank) == \
        (N_FIRST, N_LAST)
    assert parameters.total == parameters.analytic_total == 529_600_819_200


# ------------------------------------------------------------------------------------- a real engine's allocations


MEASURED = dict(tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=2)


def measured_config(precision: str):
    raw = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                                    "torch_adam": True}},
           "model": {"preset": "tiny", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                     "seq_length": 16, "precision": precision, "recompute": "full"},
           "parallelism": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2},
           "schedule": {"lr": 1e-3, "warmup_tokens": 0, "decay_tokens": 1e6, "train_tokens": 1e6}}
    if precision == "bf16":
        raw.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    return parse_run_config(raw)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _allocated_by_deepspeed(precision: str) -> dict:
    """Build the engine, train one batch (Adam's states exist after the first step), read what it holds."""
    config = measured_config(precision)
    engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, seed=1234)

    def batches():
        generator = torch.Generator().manual_seed(0)
        for _ in range(2):  # 8 = 2 micro-batches x 2 x DP 2
            tokens = torch.randint(0, 200, (2, 17), generator=generator)
            yield (tokens[:, :-1], torch.arange(16).expand(2, 16)), (tokens[:, 1:], torch.ones(2, 16))

    engine.train_batch(data_iter=batches())
    optimizer = engine.optimizer
    if type(optimizer).__name__ == "BF16_Optimizer":
        weights, master = optimizer.bf16_groups_flat, optimizer.fp32_groups_flat_partition
        accumulation = optimizer.fp32_groups_gradients_flat
    else:
        weights, master, accumulation = optimizer.bit16_groups_flat, optimizer.single_partition_of_fp32_groups, []
    adam = [optimizer.optimizer.state[p][key] for p in master for key in ("exp_avg", "exp_avg_sq")]
    return {"optimizer": type(optimizer).__name__, "stage": engine.stage_id, "dp": ctx.data_parallel_size,
            "groups": len(weights), "weights": _bytes(weights), "master_weights": _bytes(master),
            "adam_states": _bytes(adam), "gradient_accumulation": _bytes(accumulation),
            "module_weights": _bytes(engine.module.parameters())}


def _allocated_both() -> list[dict]:
    return [_allocated_by_deepspeed("bf16"), _allocated_by_deepspeed("fp32")]


@pytest.mark.distributed
def test_memory_parts_match_deepspeed_allocations():
    """bf16 (BF16_Optimizer) and fp32 (DeepSpeedZeroOptimizer) at TP 1 x PP 2 x DP 2 on 4 CPU processes.

    The planner counts N_i parameters exactly; DeepSpeed pads each parameter group's flat buffer to a multiple of
    2 x DP elements, so it may hold up to (2 x DP - 1) more elements per group in a full buffer and 1 more per group
    in a DP partition. Measured - planned must lie in [0, that padding]; at this model's sizes it is 0.
    """
    results = [r for rank in run_distributed(4, _allocated_both) for r in rank]
    assert {r["optimizer"] for r in results} == {"BF16_Optimizer", "DeepSpeedZeroOptimizer"}
    assert sorted({(r["stage"], r["dp"]) for r in results}) == [(0, 2), (1, 2)]
    for r in results:
        config = measured_config("bf16" if r["optimizer"] == "BF16_Optimizer" else "fp32")
        count = count_parameters(config).stages[r["stage"]]
        planned = stage_memory(config, deepspeed_layout(config), count, 2, 2, A100, DEFAULTS)
        assert r["module_weights"] == planned.weights  # every parameter, in the model dtype
        full, partition = 2 * r["dp"] - 1, 1  # padding elements per parameter group
        padding_bytes = {"weights": full * planned.weights // planned.parameters, "gradient_accumulation": full * 4,
                         "master_weights": partition * 4, "adam_states": 2 * partition * 4}
        for part, per_group in padding_bytes.items():
            assert 0 <= r[part] - getattr(planned, part) <= r["groups"] * per_group, (r["optimizer"], r["stage"], part)
        assert r["weights"] == planned.weights and r["adam_states"] == planned.adam_states  # no padding here


def test_530b_checkpoint_size_write_and_stall_by_hand(recipe, parameters):
    """bf16 weights from DP rank 0 of each (stage, TP rank), the tied head's copy not saved; 12 bytes of fp32 master
    weights and Adam moments per parameter, split over DP 8; 2 GB/s per node, 100 GB/s in all, 20 GB/s to host."""
    from planner.checkpointing import Storage, checkpoint_cost

    held = 8 * sum(count.parameters_per_tp_rank for count in parameters.stages)
    cost = checkpoint_cost(recipe, parameters, 8, 56.0, A100, Storage())
    assert cost.bytes_per_run == 2 * (held - 51200 * 20480) + 12 * held
    assert 7.40e12 < cost.bytes_per_run < 7.45e12  # "about 7.4 TB"
    assert cost.bytes_per_rank == 2 * N_FIRST + 12 * N_FIRST // 8
    assert cost.write_seconds == max(8 * cost.bytes_per_rank / 2e9, cost.bytes_per_run / 100e9)
    assert cost.async_stall_seconds == cost.bytes_per_rank / 20e9
    between = 100 * 56.0  # save_interval 100 in 530b.json
    assert cost.lost_share_sync == pytest.approx(cost.write_seconds / (between + cost.write_seconds), rel=1e-12)
    assert cost.lost_share_async < cost.lost_share_sync / 100


# ------------------------------------------------------------------------------------------------------ DualPipeV
SP_SELECTIVE = ["parallelism.sequence_parallel=true", 'model.recompute="selective"']
DUALPIPEV = ['parallelism.pipeline_schedule="dualpipev"']


def test_dualpipev_ranks_hold_two_stages_and_the_tied_embedding_once():
    """530B's 105 blocks in 70 stages of 2 (the way out) and 1 (the way back): 3 a rank, as under 1F1B; rank 0
    holds both ends of the tied embedding, built once, and the head's copy is not counted again."""
    plain = count_parameters(load_run_config(RECIPE))
    dual = count_parameters(load_run_config(RECIPE, DUALPIPEV))
    assert dual.total == plain.total == dual.analytic_total
    assert [len(c.blocks) for c in dual.stages] == [3] * 35
    assert [c.phases[0].blocks for c in dual.stages[:2]] == [(1, 2), (3, 4)]
    assert [c.phases[1].blocks for c in dual.stages[:2]] == [(105,), (104,)]
    assert dual.stages[0].layers.count("WordEmbedding") == 1 and dual.stages[0].layers[-1] == "FinalLayerNorm"
    assert dual.stages[0].parameters_per_tp_rank == N_FIRST + 20480 * 2  # + the final LayerNorm
    assert dual.stages[34].phases[0].blocks == (69, 70) and dual.stages[34].phases[1].blocks == (71,)


def test_dualpipev_plan_of_530b():
    """TP 8 x PP 35 with SP + selective at 280 and 560 nodes, against 1F1B: the replayed bubble is smaller, the
    tied-embedding reduce is gone, every middle rank sends and receives for both of its stages, and the ramp's
    first steps (4 and 2 micro-batches per pipeline) run the V-shaped schedule."""
    for nodes in (280, 560):
        plain = plan_cluster(load_run_config(RECIPE, SP_SELECTIVE), nodes, A100, DEFAULTS,
                             count_parameters(load_run_config(RECIPE, SP_SELECTIVE)))
        config = load_run_config(RECIPE, SP_SELECTIVE + DUALPIPEV)
        dual = plan_cluster(config, nodes, A100, DEFAULTS, count_parameters(config))
        assert dual.ok, dual.errors
        assert (dual.first_batch.schedule, dual.full_batch.schedule) == ("vshape", "dualpipev")
        assert (plain.first_batch.schedule, plain.full_batch.schedule) == ("1f1b", "1f1b")
        t, p = dual.full_batch, plain.full_batch
        assert t.tied_embedding_reduce == 0 < p.tied_embedding_reduce
        assert t.bubble_fraction < p.bubble_fraction == 34 / t.micro_batches
        assert t.seconds < p.seconds
        # a middle rank receives and sends an activation and a gradient at both ends of both of its stages
        rates = sustained_rates(A100, DEFAULTS, 8, 35, dual.data_parallel_size)
        middle = [micro_batch_time(c, deepspeed_layout(c), count_parameters(c).stages[1], rates).pipeline_p2p
                  for c in (load_run_config(RECIPE, SP_SELECTIVE), config)]
        assert middle[1] == pytest.approx(2 * middle[0], rel=1e-12)
        memory = {m.stage: m for m in dual.memory}
        assert memory[0].micro_batches_held > 35  # DualPipeV keeps more in flight than 1F1B's p on rank 0
        assert all(m.fits for m in dual.memory)


def test_dualpipev_needs_2p_micro_batches_at_the_full_batch():
    config = load_run_config(RECIPE, DUALPIPEV + ["train_micro_batch_size_per_gpu=4"])
    plan = plan_cluster(config, 280, A100, DEFAULTS, count_parameters(config))
    assert plan.errors == ['parallelism.pipeline_schedule "dualpipev" needs at least 2 x PP = 70 micro-batches per '
                           'pipeline at the full batch, and train_batch_size 1920 / (micro-batch 4 x DP 8) gives 60: '
                           'raise train_batch_size to 2240 or more, use fewer nodes, or "1f1b"']
