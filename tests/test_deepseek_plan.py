"""DeepSeek-V3 in the planner: MLA's FLOPs and stored activations, and the plan at the paper's layout, as numbers.

    check                                        reference
    MLA's forward FLOPs per token                the matmuls by hand (DeepSeek-V3), and the matrices of the
                                                 deepseek-tiny blocks built on the meta device
    model.mtp: its parameters and FLOPs          by hand (DeepSeek-V3: block 62 sparse; the official checkpoint's
                                                 685B), and the MTP module built on the meta device (deepseek-tiny,
                                                 llama-tiny), its stages as model/gpt.py's mtp_partition cuts them
    what an MLA block keeps for its backward     the tensors the block saves (saved-tensor hooks, CPU, fp32: exact
                                                 but for a sparse block's loss statistics), a fused kernel's saved set
                                                 standing in for SDPA (fused_sdpa); DeepSeek-V3's rows by hand
    the paper's layout: 2,048 H800, PP 16,       the slot, the iteration, the memory of stage 0 and the GPU-hours from
      EP 64, DP 128, ZeRO-1, 14.8T tokens,       the FLOPs, the bytes and the hardware numbers, by formula
      MTP depth 1
    tools/plan.py --uneven-stages                the table's GPU-hours line, what the flag still refuses, the
                                                 layouts --search adds with it
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.config import preset
from model.flops import (
    attention_core_flops_per_token,
    attention_weights,
    flops_per_iteration,
    layer_forward_flops_per_token,
    model_flops_per_iteration,
    mtp_forward_flops_per_token,
)
from model.gpt import TransformerLayer, gpt_layer_specs, mtp_partition
from model.parallel import ParallelContext
from model.summary import (
    analytic_built_parameters,
    count_stages,
    fp8_checkpoint_extras,
    mtp_parameters,
    official_checkpoint_parameters,
    stage_boundaries,
    total_from_stages,
)
from planner.experts import count_expert_stages
from planner.hardware import GIB, GPU_PRESETS, Assumptions
from planner.memory import count_parameters, latent_attention_stored_tensors, layer_activation_bytes
from planner.plan import check_run_layout, plan_cluster
from planner.search import candidate_layouts, context_parallel_choices
from planner.timing import stage_flops_per_micro_batch
from runconfig.run import load_run_config
from tests.test_planner_moe import kept_bytes
from tools.plan import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "ds_configs" / "1.3b.json"
H800, DEFAULTS = GPU_PRESETS["h800"], Assumptions()
# the paper's pre-training: 14.8T tokens of 4K, the batch ramped from 3,072 to 15,360 sequences over the first 469B
# tokens (its increment unpublished: 768 here), PP 16 x EP 64 x DP 128, no TP, ZeRO-1; full recompute, what fits
PAPER = ['model.preset="deepseek-v3"', "train_micro_batch_size_per_gpu=1", "train_batch_size=15360",
         'schedule.batch={"type": "ramp", "start": 3072, "increment": 768, "ramp_tokens": 469e9}',
         "schedule.train_tokens=14.8e12", "parallelism.pipeline_parallel_size=16",
         "parallelism.expert_parallel_size=64", 'model.recompute="full"']
H, S, V, LAYERS = 7168, 4096, 129_280, 61
# per token, forward: q down and up, kv down (latent and rope key) and up (k_nope and v), the output projection
MLA_WEIGHTS = H * 1536 + 1536 * 128 * (128 + 64) + H * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * H
MLA_CORE = 2 * S * 128 * (192 + 128)  # q k^T over q/k heads of 192, the weighted sum of v heads of 128
EXPERT = 3 * H * 2048
DENSE_MLP, SPARSE_MLP = 3 * H * 18432, 256 * H + 8 * EXPERT + EXPERT  # the router, top 8, the shared expert
LAYER = 2 * (MLA_WEIGHTS + (3 * DENSE_MLP + 58 * SPARSE_MLP) / LAYERS) + MLA_CORE  # the mean block's forward
MTP_BLOCK = 2 * (MLA_WEIGHTS + SPARSE_MLP) + MLA_CORE  # block 62, sparse
MTP = MTP_BLOCK + 2 * 2 * H * H + 2 * H * V  # its block, eh_proj (2h -> h) and its logits


# ------------------------------------------------------------------------------------------------------- FLOPs


def test_mla_flops_by_hand():
    config = preset("deepseek-v3")
    assert attention_weights(config) == MLA_WEIGHTS == 187_105_280
    assert attention_core_flops_per_token(config) == MLA_CORE
    assert layer_forward_flops_per_token(config) == pytest.approx(LAYER, rel=1e-15)
    assert config.mtp.depth == 1 and mtp_forward_flops_per_token(config) == MTP
    # the dense MLP and a sparse block's active weights differ by 0.5%: the mean block is close to either
    assert (DENSE_MLP, SPARSE_MLP) == (396_361_728, 398_196_736)


def test_flops_count_the_matmuls_of_the_blocks_built():
    """deepseek-tiny built on the meta device: twice a block's matrices one token meets (the dense MLP; or the router,
    top_k of the routed experts and the shared expert), averaged over the blocks, plus the core."""
    config = preset("deepseek-tiny")
    with torch.device("meta"):
        blocks = [TransformerLayer(config, ParallelContext(), 0, n) for n in range(1, config.num_layers + 1)]
    moe = config.moe

    def met(block: TransformerLayer) -> float:
        matrices = [p for p in block.parameters() if p.ndim >= 2]
        experts = sum(p.numel() for p in matrices if p.ndim == 3)  # the routed experts' stacked tensors
        return sum(p.numel() for p in matrices if p.ndim == 2) + experts * moe.top_k / moe.num_experts

    assert sum(p.ndim == 3 for p in blocks[1].parameters()) > 0  # the experts are stacked (E, ., .) tensors
    core = 2 * config.seq_length * config.num_attention_heads * (config.head_dim + config.v_head_dim)
    assert layer_forward_flops_per_token(config) == pytest.approx(2 * sum(map(met, blocks)) / 4 + core, rel=1e-15)
    # model.mtp's depths: eh_proj and block L + k (5 and 6: sparse) built, plus the core and the logits' 2 h V each
    config = preset("deepseek-tiny", mtp={"depth": 2})
    with torch.device("meta"):
        module = next(spec for spec in gpt_layer_specs(config, ParallelContext(), 0)
                      if spec.typename.__name__ == "MultiTokenPrediction").build()
    logits = 2 * config.hidden_size * config.padded_vocab_size(1)
    assert [depth.block.layer_number for depth in module.depths] == [5, 6]
    assert mtp_forward_flops_per_token(config) == 2 * met(module) + 2 * (core + logits)


# ------------------------------------------------------------------------------------------------ model.mtp


def built_mtp_parameters(config) -> int:
    """The MultiTokenPrediction layer of gpt_layer_specs built on the meta device (TP 1): its parameters."""
    with torch.device("meta"):
        specs = gpt_layer_specs(config, ParallelContext(), 0)
        module = next(spec for spec in specs if spec.typename.__name__ == "MultiTokenPrediction").build()
    return sum(p.numel() for p in module.parameters())


def test_mtp_parameters_by_hand_and_built():
    """Each depth: eh_proj 2h x h, 3 RMSNorms of h, block L + k: deepseek-tiny's blocks 5 and 6 sparse (MLA, router,
    8 experts and a shared one of 3 h F each), llama-tiny's dense (GQA, SwiGLU)."""
    tiny = preset("deepseek-tiny", mtp={"depth": 2})
    h, f = tiny.hidden_size, tiny.moe.moe_ffn_hidden_size
    mla = (h * 32 + 32 + 32 * 4 * 24 + h * (32 + 8) + 32 + 32 * 4 * (16 + 16) + 4 * 16 * h + 2 * h)
    sparse = mla + 8 * h + 9 * 3 * h * f
    assert mtp_parameters(tiny) == 2 * (2 * h * h + 3 * h + sparse) == built_mtp_parameters(tiny)
    llama = preset("llama-tiny", mtp={"depth": 2})
    h, f, d = llama.hidden_size, llama.ffn_hidden_size, llama.head_dim
    dense = 2 * h + h * (8 + 2 * 2) * d + 8 * d * h + 3 * h * f
    assert mtp_parameters(llama) == 2 * (2 * h * h + 3 * h + dense) == built_mtp_parameters(llama)


def test_deepseek_v3_mtp_and_the_official_checkpoint_size():
    """DeepSeek-V3's MTP module: eh_proj, 3 norms and a sparse block (block 62); the official checkpoint's layer 61
    stores it with its own embedding and head: 671B + 13.46B, and with the fp8 release's block scales (one fp32 per
    128 x 128 tile of every block matrix) and the routers' score biases 684.53B, the published 685B."""
    config = preset("deepseek-v3")
    sparse = 187_121_664 + 256 * H + 257 * EXPERT
    assert mtp_parameters(config) == 2 * H * H + 3 * H + sparse == 11_610_067_968
    official = official_checkpoint_parameters(config)
    assert official == 671_026_404_352 + 11_610_067_968 + 2 * V * H == 684_489_830_400
    attention = 12 * 56 + 192 * 12 + 5 * 56 + 256 * 4 + 56 * 128  # q_a, q_b, kv_a, kv_b, o in 128 x 128 tiles
    dense, sparse = attention + 3 * 144 * 56, attention + 257 * 3 * 16 * 56 + 256
    assert fp8_checkpoint_extras(config) == 3 * dense + 59 * sparse == 41_555_600
    assert round((official + fp8_checkpoint_extras(config)) / 1e9) == 685


@pytest.mark.parametrize("name, pp", [("llama-tiny", 2), ("llama-tiny", 4), ("deepseek-v3", 16)])
def test_stage_boundaries_are_what_the_pipeline_cuts(name, pp):
    """model/summary.py's boundaries are model/gpt.py mtp_partition's; the last stage's blocks include L + 1 .. L + D
    and, built (llama-tiny, untied), its count and the model's total match the formulas (the embedding once)."""
    config = preset(name, mtp={"depth": 2})
    assert stage_boundaries(config, pp) == mtp_partition(config, [0] * (pp + 1), "type:TransformerLayer")
    if config.moe is not None:
        return
    counts = count_stages(config, 1, pp)
    assert counts[-1].blocks[-2:] == (5, 6) and "MultiTokenPrediction" in counts[-1].layers
    assert sorted(n for c in counts for n in c.blocks) == [1, 2, 3, 4, 5, 6]
    assert all(c.parameters_per_tp_rank == c.analytic_per_tp_rank for c in counts)
    assert total_from_stages(counts, config, 1) == analytic_built_parameters(config, 1)


def test_mtp_flops_by_hand():
    """llama-tiny with 2 depths (dense blocks 5 and 6), full recompute: each depth adds 3 forwards of its block, eh_proj
    and its logits, and one more forward of its block."""
    config = preset("llama-tiny", mtp={"depth": 2}, recompute="full")
    trunk = preset("llama-tiny", recompute="full")
    h, s, v = config.hidden_size, config.seq_length, config.padded_vocab_size(1)
    block = layer_forward_flops_per_token(trunk)  # a dense model's blocks are all the mean block
    assert block == 2 * (h * (8 + 2 * 2) * 16 + 8 * 16 * h + 3 * h * config.ffn_hidden_size) + 4 * s * 8 * 16
    depth = block + 4 * h * h + 2 * h * v
    assert model_flops_per_iteration(config, 2, 1) == model_flops_per_iteration(trunk, 2, 1) + 2 * s * 3 * 2 * depth
    assert flops_per_iteration(config, 2, 1) == flops_per_iteration(trunk, 2, 1) + 2 * s * (3 * 2 * depth + 2 * block)


@pytest.mark.parametrize("name, recompute", [("llama-tiny", "full"), ("llama-tiny", "selective"),
                                             ("deepseek-tiny", "full")])
def test_the_stages_flops_add_up_with_mtp(name, recompute):
    """The planner's per-stage FLOPs (the depths on the last stage, their blocks recomputing as block L + k would:
    recompute_num_layers 1 of each of PP 2's stages, so block 5, first of its group, does) sum to
    flops_per_iteration."""
    config = preset(name, mtp={"depth": 2}, recompute=recompute, recompute_num_layers=1)
    stages = count_expert_stages(config, 1, 2) if config.moe else count_stages(config, 1, 2)
    assert config.recomputes_block(5, 2) and not config.recomputes_block(6, 2)
    summed = sum(stage_flops_per_micro_batch(config, c, 1, 1, pipeline_parallel_size=2) for c in stages)
    assert summed * 3 == pytest.approx(flops_per_iteration(config, 3, 1, pipeline_parallel_size=2), rel=1e-12)


# ------------------------------------------------------------------------------------------------ activations


class FusedAttention(torch.autograd.Function):
    """Causal attention keeping what CUDA's fused kernels keep for the backward: q, k, v, the output and the fp32
    logsumexp. On CPU MLA's unequal q and v widths select the math kernel, which keeps the scores instead."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        with torch.no_grad():
            scores = (q @ k.transpose(-1, -2)) * scale
            scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
            logsumexp = scores.logsumexp(-1)
            out = (scores - logsumexp[..., None]).exp() @ v
        ctx.save_for_backward(q, k, v, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("a stand-in for the forward's saved set: only what the forward saves is measured")


def fused_sdpa(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None, enable_gqa=False):
    assert attn_mask is None and is_causal and dropout_p == 0.0 and not enable_gqa
    return FusedAttention.apply(q, k, v, scale if scale is not None else q.shape[-1] ** -0.5)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_mla_blocks_keep_what_the_planner_counts(monkeypatch, recompute):
    """deepseek-tiny's blocks, fp32, micro-batch 2: a dense MLA block with a query latent or a q_proj, and a sparse
    one (8 experts in 4 groups, a shared expert without gate): the planner's rows are exact but for the routing's
    loss statistics of a sparse block, the aux loss's E + 1 floats and the sequence-wise loss's E per sequence."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", fused_sdpa)
    gaps = []
    for q_lora_rank, sparse in ((32, False), (None, False), (32, True)):
        config = preset("deepseek-tiny", q_lora_rank=q_lora_rank, recompute=recompute)
        layer = TransformerLayer(config, ParallelContext(), 1234, 2 if sparse else 1).train()
        assert config.moe.is_sparse(2 if sparse else 1) == sparse
        x = torch.randn(2, config.seq_length, config.hidden_size, requires_grad=True)
        planned = layer_activation_bytes(config, 2, 1, sequence_parallel=False, recompute=recompute, sparse=sparse)
        gaps.append(kept_bytes(layer, x) - planned)
    experts = 8
    assert gaps == [0, 0, (4 * experts + 4) + 2 * 4 * experts]


def test_mla_rows_by_hand():
    """DeepSeek-V3's attention per token, bf16, TP 1: the two latents (fp32 norm input, rsqrt, normalised x, output),
    kv_b_proj's output, q and k of 192, cos and sin, the dense input, and without recompute the kernel's output and
    logsumexp; half of the heads' rows at TP 2, and the latents' at TP 2 with SP."""
    config = preset("deepseek-v3")

    def per_token(tp: int = 1, sp: bool = False, mode: str = "none") -> float:
        rows = latent_attention_stored_tensors(config, tp, sequence_parallel=sp, micro_batch=1)
        return sum(row.bytes_per_token for row in rows if mode in row.modes)

    latents = (4 * 1536 + 4 + 2 * 2 * 1536) + (4 * 512 + 4 + 2 * 2 * 512)
    heads = 2 * 128 * (128 + 128) + 2 * 2 * 128 * 192 + 2 * 128 * 128  # kv_b output, q and k, the dense input
    rope = 2 * 2 * 64
    assert per_token() == latents + heads + rope + 2 * 128 * 128 + 4 * 128 == 246_536
    assert per_token(mode="selective") == latents + heads + rope
    assert per_token(2) == latents + heads / 2 + rope + (2 * 128 * 128 + 4 * 128) / 2
    assert per_token(2, sp=True) == latents / 2 + heads / 2 + rope + (2 * 128 * 128 + 4 * 128) / 2


# ------------------------------------------------------------------------------------- the paper's layout, planned


@pytest.fixture(scope="module")
def paper():
    config = load_run_config(BASE, PAPER, check_layout=False)
    check_run_layout(config, uneven_stages=True)
    parameters = count_parameters(config, uneven_stages=True)
    return config, parameters, plan_cluster(config, 256, H800, DEFAULTS, parameters)


def test_h800_preset():
    assert (H800.peak_tflops, H800.memory_gib, H800.hbm_gbytes_per_s, H800.nvlink_gbytes_per_s, H800.ib_gbits_per_s,
            H800.gpus_per_node) == (989.0, 80.0, 3350.0, 400.0, 400.0, 8)
    h100 = GPU_PRESETS["h100-80gb"]
    assert (H800.peak_tflops, H800.memory_gib) == (h100.peak_tflops, h100.memory_gib)  # NVLink is what differs


def test_stages_of_the_papers_layout(paper):
    """61 blocks and the MTP depth (one block's weight) over PP 16 as DeepSpeed's partition_balanced cuts them: 14
    stages of 4, then 2 of 3, the last blocks 60, 61 and the depth's 62; stage 1 holds 4 sparse blocks with EP 64's 4
    experts each; the last its 2 blocks, the final norm, the head, the embedding's copy and the MTP module."""
    _, parameters, plan = paper
    assert [len(c.blocks) for c in parameters.stages] == [4] * 14 + [3] * 2
    last = parameters.stages[-1]
    assert last.blocks == (60, 61, 62) and last.layers[-1] == "MultiTokenPrediction"
    block = 187_121_664 + 256 * H + 4 * EXPERT + EXPERT  # MLA and its norms, the router, 4 experts, the shared one
    assert parameters.stages[1].parameters_per_tp_rank == 4 * block == 1_636_630_528
    first = parameters.stages[0]
    dense = 187_121_664 + DENSE_MLP
    assert first.parameters_per_tp_rank == V * H + 3 * dense + block and first.expert_parameters_per_tp_rank == \
        4 * EXPERT
    mtp = 2 * H * H + 3 * H + block
    assert last.parameters_per_tp_rank == 2 * block + H + 2 * V * H + mtp == 3_183_620_096
    assert last.expert_parameters_per_tp_rank == 3 * 4 * EXPERT
    assert "partition_balanced" in plan.warnings[0] and "(14 of 4, 2 of 3;" in plan.warnings[0]


def slot_seconds(parameters) -> dict[str, float]:
    """One micro-batch slot of stage 1 (4 sparse blocks, both neighbours), by formula: the forward, backward and
    full recompute of 4 blocks at 60% of 989 TFLOP/s; each sparse block's 6 all-to-alls (dispatch and combine,
    forward, backward, recomputed forward) of e k s h (P - 1) / P bytes over InfiniBand (an EP group of 64 spans 8
    nodes) at 80% of 50 GB/s; 4 p2p transfers of e s h; 12 bytes per parameter of HBM for the fp32 accumulation."""
    infiniband = 400e9 / 8 * 0.8
    all_to_all = 2 * 8 * S * H * 63 / 64
    return dict(compute=S * (3 + 1) * 4 * LAYER / (989e12 * 0.6), expert_all_to_all=4 * 6 * all_to_all / infiniband,
                pipeline_p2p=4 * 2 * S * H / infiniband,
                gradient_accumulation=12 * parameters.stages[1].parameters_per_tp_rank / (3350e9 * 0.8))


def after_pipeline_seconds(parameters) -> float:
    """Stage 0 after the last backward: the all-reduce of the embedding's fp32 gradient with the last stage's copy
    (the MTP depth's lookup), the DP all-reduce of its bf16 gradients (dense over 128 ranks, experts over the 2 that
    hold the same ones), Adam on the partitions and BF16_Optimizer's 16 bytes per parameter of HBM, the all-gather of
    the updated bf16 weights; every DP group and the pipeline span nodes: InfiniBand."""
    infiniband, hbm = 400e9 / 8 * 0.8, 3350e9 * 0.8
    tied = 2 * 1 / 2 * 4 * V * H / infiniband
    n = parameters.stages[0].parameters_per_tp_rank
    experts = parameters.stages[0].expert_parameters_per_tp_rank
    dense = n - experts
    reduce = 2 * 127 / 128 * 2 * dense / infiniband + 2 * 1 / 2 * 2 * experts / infiniband
    step = ((28 + 2) * dense / 128 + (28 + 2) * experts / 2 + 16 * n) / hbm
    gather = 127 / 128 * 2 * dense / infiniband + 1 / 2 * 2 * experts / infiniband
    return tied + reduce + step + gather


def test_papers_layout_iteration_by_formula(paper):
    config, parameters, plan = paper
    t = plan.full_batch
    assert (plan.gpus, plan.data_parallel_size, t.micro_batches) == (2048, 128, 120)
    tokens = 15360 * S
    assert t.model_flops == pytest.approx(tokens * (3 * LAYERS * LAYER + 3 * MTP + 6 * H * V), rel=1e-12)
    assert t.flops == pytest.approx(t.model_flops + tokens * (LAYERS * LAYER + MTP_BLOCK), rel=1e-12)  # full recompute
    slot = slot_seconds(parameters)
    assert t.micro_batch.stage == 1
    for name, seconds in slot.items():
        assert getattr(t.micro_batch, name) == pytest.approx(seconds, rel=1e-12), name
    per_slot = sum(slot.values())
    assert t.bubble == pytest.approx(15 * per_slot) and t.bubble_fraction == 15 / 120
    assert t.seconds == pytest.approx((120 + 15) * per_slot + after_pipeline_seconds(parameters), rel=1e-12)
    assert t.mfu == pytest.approx(t.model_flops / (t.seconds * 2048 * 989e12), rel=1e-12)
    # the all-to-all, not hidden behind compute here, is the largest part: more than half of the iteration
    assert t.expert_all_to_all / t.seconds > 0.5 > t.compute / t.seconds


def test_papers_layout_gpu_hours_by_formula(paper):
    """The training: the ramp's 16 sizes (3,072 .. 14,592 by 768) each for 469B / 16 tokens, then 15,360 to 14.8T;
    a step of B sequences takes (B / 128 + 15) slots and the work after the pipeline. GPU-hours: 2,048 GPUs x the
    seconds; the paper's 180K per trillion tokens and 2.664M in all beside them."""
    _, parameters, plan = paper
    per_slot, after = sum(slot_seconds(parameters).values()), after_pipeline_seconds(parameters)
    segments = [(3072 + 768 * i, 469e9 / 16) for i in range(16)] + [(15360, 14.8e12 - 469e9)]
    seconds = sum(tokens / (batch * S) * ((batch / 128 + 15) * per_slot + after) for batch, tokens in segments)
    assert plan.training.seconds == pytest.approx(seconds, rel=1e-9)
    assert plan.gpu_hours == pytest.approx(2048 * seconds / 3600, rel=1e-9)
    assert plan.gpu_hours_per_trillion_tokens == pytest.approx(plan.gpu_hours / 14.8, rel=1e-12)
    run = plan.published
    assert (run.gpu_hours_per_trillion_tokens, run.gpu_hours, run.tokens) == (180e3, 2.664e6, 14.8e12)
    assert run.gpu_hours_per_trillion_tokens * run.tokens / 1e12 == pytest.approx(run.gpu_hours)
    # the report's figure as an MFU: the model FLOPs of 1e12 tokens over 180K hours of 989 TFLOP/s
    per_token = 3 * LAYERS * LAYER + 3 * MTP + 6 * H * V
    assert plan.published_mfu == pytest.approx(per_token * 1e12 / (180e3 * 3600 * 989e12), rel=1e-12)
    assert 0.45 < plan.published_mfu < 0.46


def test_papers_layout_fits_in_80_gb_with_full_recompute(paper):
    """Stage 0 (16 micro-batches held, the embedding): BF16_Optimizer's 8 bytes per parameter whole, Adam and the
    master weights sharded (the dense part over 128, the experts over 2), the activations of full recompute;
    selective recompute would not fit: each held micro-batch keeps every MoE row. The peak is the last stage: the
    head, the embedding's copy and the MTP module (8 bytes each per parameter), and in its working set the rerun
    block and the head: the final norm and the logits, the MTP depth's rows and logits, both logits' gradients."""
    config, parameters, plan = paper
    first = plan.memory[0]
    assert first.fits and first.total < 80 * GIB
    n, experts = parameters.stages[0].parameters_per_tp_rank, parameters.stages[0].expert_parameters_per_tp_rank
    assert (first.weights, first.gradients, first.gradient_accumulation) == (2 * n, 2 * n, 4 * n)
    assert first.master_weights == 4 * (n - experts) // 128 + 4 * experts // 2
    assert first.adam_states == 8 * (n - experts) // 128 + 8 * experts // 2
    assert first.micro_batches_held == 16
    assert first.activations_per_micro_batch == 5 * 2 * S * H  # 4 block outputs and the stage's input
    assert first.total == (8 * n + first.master_weights + first.adam_states + first.activations
                           + first.pipeline_buffers + 2 * GIB)  # the DP reduce buffer (2 n) comes after the backward
    static = first.total - first.activations
    assert static + first.activations_selective > 80 * GIB
    peak = plan.peak_memory()
    assert peak.stage == 15 and peak.fits and peak.weights == 2 * 3_183_620_096 and peak.micro_batches_held == 1
    rerun = layer_activation_bytes(config.model, 1, 1, sequence_parallel=False, recompute="none", sparse=True,
                                   expert_parallel_size=64)
    head = S * (34 * H + 16 + 8 * V)  # bf16, RMSNorm's fp32 copy, rsqrt and normalised x per norm
    assert peak.activations_working_set == int(rerun + head)


# --------------------------------------------------------------------------------------------------------- the CLI


def test_cli_prints_the_papers_table(capsys, paper):
    _, _, plan = paper
    status = plan_main(["--ds_config", str(BASE), "--gpu", "h800", "--nodes", "256", "--uneven-stages",
                        *[word for item in PAPER for word in ("--set", item)]])
    out, err = capsys.readouterr()
    out = " ".join(out.split())
    assert status == 0 and err == ""
    assert (f"GPU-hours: {plan.gpu_hours_per_trillion_tokens / 1e3:,.1f}K per trillion tokens, "
            f"{plan.gpu_hours / 1e6:,.3f}M for the 14.8T tokens (2,048 GPUs); DeepSeek-V3 technical report, table 1 "
            f"(pre-training): 180K per trillion tokens, 2.664M for 14.8T on 2,048 H800, an MFU of "
            f"{plan.published_mfu:.1%} at this plan's model FLOPs per token and peak "
            f"({plan.gpu_hours_per_trillion_tokens / 180e3:.2f} x:") in out
    assert "== 256 nodes: 2048 GPUs = TP 1 x PP 16 x DP 128 ==" in out and "verdict: fits" in out


@pytest.mark.parametrize("settings, uneven, message", [
    ([], False, "model.num_layers (61) cannot be split evenly over parallelism.pipeline_parallel_size (16)"),
    (["model.recompute_num_layers=2"], True, "model.recompute_num_layers (2) counts the blocks of equal stages"),
    (['parallelism.pipeline_schedule="dualpipev"'], True, "DualPipeV pairs equal stages"),
])
def test_uneven_stages_only_where_asked_and_possible(capsys, settings, uneven, message):
    status = plan_main(["--ds_config", str(BASE), "--gpu", "h800", "--nodes", "256",
                        *(["--uneven-stages"] if uneven else []),
                        *[word for item in PAPER + settings for word in ("--set", item)]])
    _, err = capsys.readouterr()
    assert status == 1 and message in err


def test_search_tries_uneven_stages_and_never_what_the_model_refuses():
    """deepseek-tiny (4 blocks) on 3 nodes of 4 GPUs: PP 3 only with --uneven-stages, and then under 1F1B
    recomputing all blocks or none; no context parallelism (MLA refuses it), no sequence-split dispatch (SP x TP > 1 x EP > 1: its
    sequence-wise balance loss refuses it)."""
    config = load_run_config(ROOT / "ds_configs" / "llama-tiny-cpu.json",
                             ['model.preset="deepseek-tiny"', "train_batch_size=48", "schedule.batch={}"])
    even, uneven = candidate_layouts(config, 12, 4), candidate_layouts(config, 12, 4, uneven_stages=True)
    assert {layout.pipeline_parallel_size for layout in even} == {1, 2, 4}
    extra = [layout for layout in uneven if layout.pipeline_parallel_size == 3]
    assert extra and len(uneven) == len(even) + len(extra)
    assert all(layout.pipeline_schedule == "1f1b" and layout.recompute_num_layers is None for layout in extra)
    assert context_parallel_choices(config.model, 1, 4) == [1, 2, 4]  # offered by the heads, refused by MLA
    assert all(layout.context_parallel_size == 1 for layout in uneven)
    assert not any(layout.sequence_parallel and layout.tensor_parallel_size > 1 and layout.expert_parallel_size > 1
                   for layout in uneven)
