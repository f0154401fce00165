"""Plan a TP x PP x DP run before booking the cluster: does it fit in memory, how fast will it run, where the time goes.

    python tools/plan.py --ds_config ds_configs/530b.json --nodes 280,350,420,560 --gpu a100-80gb

Everything below is per GPU and per optimizer step unless named otherwise. t, p, d: tensor-, pipeline-, data-parallel
sizes; s sequence length, b micro-batch, h hidden, a heads, V padded vocabulary; N_i the parameters of one TP rank of
pipeline stage i (counted on the meta device by model/summary.py); m = global batch / (b d) micro-batches per pipeline.

What DeepSpeed 0.19.8 does (read from its source, runtime/engine.py ``_do_optimizer_sanity_check``)
    bf16 weights + ``data_types.grad_accum_dtype`` fp32 + ZeRO stage 1 selects ``BF16_Optimizer``: bf16 weights and
    bf16 ``.grad`` (2 + 2 bytes x N_i), a full (not partitioned) fp32 gradient-accumulation buffer (4 N_i) that every
    micro-batch's bf16 grads are added into, and only the fp32 master weights (4 N_i / d) and Adam's exp_avg and
    exp_avg_sq (8 N_i / d) partitioned over DP. After the last backward the pipeline engine all-reduces (not
    reduce-scatters) that buffer over DP, cast to ``communication_data_type`` (default: bf16, so a transient bf16
    copy of 2 N_i), not overlapped with compute; after the step each DP rank's updated bf16 partition is all-gathered
    in place (``all_gather_into_tensor``; the ``allgather_bucket_size`` only matters without it).
    Every other precision goes through ``DeepSpeedZeroOptimizer`` (stage 1): weights and ``.grad`` in the model dtype,
    an fp32 gradient partition (4 N_i / d), the same master and Adam partitions, a ``reduce_bucket_size`` staging
    buffer (default 5e8 elements) and a reduce (volume of a reduce-scatter) instead of the all-reduce.
    The tied word embedding lives on the first and last stage; its fp32 gradient is all-reduced between the two.
    With TP > 1 a stage sends 1/t of its output per TP rank (``pipeline.pipe_partitioned``, default on) and the
    receiver all-gathers it over the TP group. With sequence parallelism (SP) the engine turns pipe_partitioned off
    (training/engine.py): each TP rank sends its own sequence shard, 1/t of the tensor, and nothing is rebuilt.

Memory of stage i
    weights + grads + accumulation buffer + master + Adam       as above
    activations = held x per_micro_batch + working_set, held = min(p - i, m) (a 1F1B stage keeps the micro-batches
        whose backward has not run: DeepSpeed's ``TrainSchedule.num_pipe_buffers``).
        Per block and micro-batch: what THIS implementation keeps for the backward (``layer_stored_tensors``, one row
        per tensor, each with the recompute modes that keep it), in the model dtype (e bytes: 2 bf16, 4 fp32), per
        token, with u = 1/t with SP (outside the TP matmuls a rank holds s/t positions) and 1 without, f the FFN,
        q the QKV rows (3h multi-head):
          "none": 4 h u (the block output, ln1 output, attention residual sum = ln2 input, ln2 output) + q/t (the
            QKV output; q, k, v are views of it) + h/t (the attention output, the dense layer's input) + 2 f/t (fc1
            output and GeLU output); fp32 extras: LayerNorm mean and rstd, 2 norms x 2 x 4 u bytes, and the fused
            SDPA's logsumexp, 4 a/t bytes. GPT: 16 h at t = 1, 16 h / t with SP. The fused kernels (flash, memory-
            efficient; CPU's flash too) write their output in (b, s, a, d) layout, so with q a view of the QKV output
            the dense layer's input, transpose(1, 2).reshape, is a view of the SDPA output, not a copy (measured with
            saved-tensor hooks on the tiny GPT, CPU fp32: 15.125 h per token besides the block's input).
          "selective" (the attention core checkpointed, model/gpt.py SelfAttention.core): the same minus the SDPA
            logsumexp, and the SDPA output where the dense input is a copy of it (below); with the GPT shape that is
            all it saves: the dense layer still keeps the core's output, of which its input is a view. With the scores stored
            (below) it drops the s x s terms too: that is where selective matters (Korthikanti et al.'s 5 a s^2 b).
          "full": the block output only, e h u (its input is the previous block's output), and while one block is
            recomputed its whole "none" set is alive once (the working set; "selective": the recomputed core).
        Derived from the code, not measured, for the Llama shapes: RMSNorm keeps its normalised x (e h u), its
        rsqrt (4 u bytes) and, in 16-bit, the fp32 copy of its input (4 h u bytes), per norm; SwiGLU 4 f/t (gate_up
        output 2 f/t, silu output, the product); with GQA (flatten copies the query) or RoPE (rotates it) SDPA keeps
        a query of its own, h/t. The SDPA output takes the query's layout: (b, s, a, d) when the query is a view of
        the QKV output, and then the dense input is a view of it, as for GPT; but when a rank holds more than one
        key/value group of more than one query head, GQA's flatten copies the query to (b, a, s, d), the output is
        laid out so too and the dense input is a transposed copy: h/t more, which selective drops (both cases are
        measured in tests/test_activation_memory.py: the Llama block at TP 1, 2 groups, and TP 2, 1 group); RoPE keeps the rotated keys, g d/t, and cos and sin, 2 s d per block
        (x cos + rotate_half(x) sin keeps only those, the factors without a gradient). With hidden_dropout > 0:
        two bool masks (CUDA's native_dropout), 2 h u bytes, and the embedding's, h u, on the first stage. The
        fused CUDA kernels take the attention dropout without a mask (they regenerate it from the RNG state), so
        attention_dropout adds nothing unless the scores are stored.
        Korthikanti et al. 2022 (arXiv:2205.05198, eq. 2-4) for reference: s b h (34 + 5 a s / h) bytes at t = 1,
        16-bit, with dropout masks; s b h (10 + 24 / t + 5 a s / (h t)) with TP; (34 + 5 a s / h) / t with SP. Their
        5 a s / h term (softmax output, dropout mask and output, 5 a s^2 b / t bytes) is what Assumptions
        .attention_scores "stored" adds in place of the logsumexp and SDPA output, the unfused math kernel (an
        explicit mask, or a head dimension neither fused kernel takes); "recomputed" (default) leaves it out.
        recompute_num_layers n: the first n blocks of each stage in the mode, the others "none".
        Each held micro-batch also keeps the stage's input (e s b h u: the received tensor, or the embedding output);
        the last stage adds its head once: the final norm's output (the head's input) and statistics, and the
        logits and their gradient in the model dtype, 2 e s b V / t (the loss works in fp32 chunks).
    pipeline buffers: the received activation and gradient, 2 x e s b h (x 1/t with SP).
    DP reduce buffer: the transient bf16 copy of the gradients (BF16_Optimizer) or the ZeRO reduce bucket; it exists
        after the last backward, when the activations are gone, so the peak takes the larger of the two.
    framework allowance: CUDA context, NCCL's own buffers, allocator fragmentation (an assumption, see Assumptions).

Time of one iteration at global batch B
    A micro-batch slot of stage i (forward + backward, recompute included):
        compute      = FLOPs_i / (peak x matmul_efficiency); FLOPs_i = b s (3 layers_i F_layer + r_i F_recompute +
                       6 h V [last stage]) / t, F_layer = training.metrics.layer_forward_flops_per_token (24 h^2 +
                       4 s h for GPT: Narayanan et al. 2021 eq. 3 per layer), r_i the stage's recomputing blocks
                       and F_recompute = F_layer ("full": one more forward), 4 s h ("selective": the attention
                       core's forward), 0 ("none"). Summed over stages, micro-batches and DP this is exactly
                       training.metrics.flops_per_iteration (hardware FLOPs).
        tensor_parallel = 4 all-reduces of e s b h per block (2 forward, 2 backward), + 2 per fully recomputed
                       block (its forward's, rerun in the backward; selective reruns none), +1 for the vocab-
                       parallel embedding on the first stage, +1 for the head's input gradient on the last; a ring
                       over t ranks. With SP each all-reduce becomes an all-gather and a reduce-scatter (the same
                       ring volume), and each column-parallel layer, which keeps its input's sequence shard, all-
                       gathers it again in the backward for its weight gradient: + half an all-reduce's volume for
                       each of the 2 per block and for the head.
        pipeline_p2p = 4 blocking transfers of e s b h / t (receive/send activation, receive/send gradient; 2 on the
                       first and last stage) and, with pipe_partitioned and no SP, an all-gather over TP to rebuild
                       each received tensor; with SP the shard is the tensor, nothing to rebuild.
        gradient_accumulation (BF16_Optimizer) = 12 N_i bytes of HBM traffic (zero the bf16 grads, read them, read
                       and write the fp32 buffer).
    The 1F1B pipeline runs (m + p - 1) slots of the slowest stage: m slots of work and p - 1 of bubble, a bubble
    fraction of (p - 1) / m. Then, not overlapped, on stage 0 (which ends last and holds most parameters):
    the tied-embedding all-reduce (4 V h / t bytes, 2 ranks), with SP the TP all-reduce of the replicated
    parameters' partial gradients (norms, row-parallel biases, the position table; fp32 under BF16_Optimizer), the
    DP gradient reduction, the optimizer step
    (HBM: Adam reads and writes master, m, v and reads the gradient, 28 N_i / d, writes the weights, weight_bytes N_i
    / d, and BF16_Optimizer casts the buffer for the reduce and back and zeroes it, 16 N_i), and the ZeRO-1
    all-gather. Ring volumes: all-reduce 2 (n - 1) / n x bytes, all-gather and reduce-scatter (n - 1) / n x bytes,
    at the per-direction bandwidth of one GPU's link times comm_efficiency. Which link: DeepSpeed's topology puts TP
    ranks next to each other, DP ranks TP apart and pipeline stages TP x DP apart, so TP uses NVLink when t <= GPUs
    per node, DP when t d <= GPUs per node, p2p when the whole pipeline fits in a node; otherwise InfiniBand, one
    HCA per GPU (for the 530B layout: TP on NVLink, DP and p2p on InfiniBand).
    TFLOP/s per GPU = hardware FLOPs (training.metrics.flops_per_iteration, the configured recompute counted, as the
    MT-NLG paper counts) / (seconds x GPUs), "hfu" that over the peak; "mfu" = model FLOPs (training.metrics
    .model_flops_per_iteration: 3 forwards' worth, no recompute, PaLM's definition) / (seconds x GPUs x peak). The
    trainer logs the same three.

Search (``search_layouts``, tools/plan.py --search, one node count)
    TP in 1 .. GPUs per node dividing the heads, key/value heads and FFN; PP dividing the layers with TP x PP
    dividing the GPUs; micro-batch 1, 2, 4, 8 where micro-batch x DP divides the full batch; SP off, and on when
    TP > 1 and TP divides the sequence; recompute "none", and "selective" and "full" on all blocks of each stage or
    on n of them (every n when a stage has <= 8 blocks, else 7 spread). The layouts that fit are ranked by their
    predicted full-batch iteration time (not the whole training: the ramp's share is the same for every layout
    of one DP size). Parameters are counted once per (TP, PP); stages 0, 1 and the last stand for all (the middle
    stages repeat stage 1 with fewer micro-batches held).

Whole training
    time = integral over tokens of seconds(batch(t)) / (batch(t) s): each ramp segment's tokens at its batch size's
    iteration time, then the rest at the full batch. If a ramp size does not divide by b d, the plan warns, names
    the sizes and a ramp that works (start and increment multiples of b d, increment nearest the configured one),
    and times the training with that ramp.

Tokens per parameter and the compute-optimal size (config-level, whatever the cluster)
    N = ParameterCounts.total (embeddings included, as Hoffmann et al. count), D = schedule.train_tokens, C = 6 N D.
    For that C: Hoffmann et al. 2022 (arXiv:2203.15556) approach 3, L(N, D) = E + A / N^alpha + B / D^beta with
    E = 1.69, A = 406.4, B = 410.7, alpha = 0.34, beta = 0.28 (section 3.3), minimised along 6 N D = C:
    N_opt = G (C/6)^a, D_opt = G^-1 (C/6)^b, a = beta / (alpha + beta), b = alpha / (alpha + beta),
    G = (alpha A / (beta B))^(1 / (alpha + beta)); and the rule of thumb of 20 tokens per parameter (Chinchilla
    itself, 70B on 1.4T tokens; approaches 1 and 2): N = sqrt(C / 120), D = 20 N.

JSON (``tools/plan.py --json``): one object
    config: str (the run config's path); gpu: Hardware fields; assumptions: Assumptions fields;
    deepspeed: DeepSpeedLayout fields; parameters: {stages: [{stage, layers, parameters_per_tp_rank,
        analytic_per_tp_rank, parameters_per_stage}], total, analytic_total}
    compute_optimal: {flops (C = 6 N D), run, chinchilla, twenty_tokens_per_parameter: each {parameters, tokens,
        tokens_per_parameter}, law: {E, A, B, alpha, beta}}
    plans: [one per node count: {nodes, gpus, tensor_parallel_size, pipeline_parallel_size, data_parallel_size
        (null if not whole), micro_batch_size, global_batch_size, micro_batches, errors: [str], warnings: [str],
        ramp: {start, increment, end, ramp_tokens, suggested} | null,
        memory: [per stage: StageMemory fields, bytes, plus total, margin, fits],
        flops: {first_batch, full_batch (hardware FLOPs, the configured recompute counted), first_batch_model,
            full_batch_model (model FLOPs, no recompute)},
        first_batch, full_batch: IterationTime fields (seconds; micro_batch: MicroBatchTime of the slowest stage;
            tflops_per_gpu and hfu from hardware FLOPs, mfu from model FLOPs),
        training: TrainingTime fields, measured: {iteration_seconds, tflops_per_gpu, model_tflops_per_gpu, hfu, mfu,
            predicted_over_measured} | null}]
    --search --json: {config, nodes, gpus, gpu, assumptions, ranked_by, layouts_tried, layouts_fitting, best,
        layouts: [Layout fields + peak_memory_bytes, peak_memory_gib, iteration_seconds, tflops_per_gpu, hfu, mfu]}
    Bytes are integers, times seconds, FLOPs floats. An impossible plan has errors and null figures where they
    cannot be computed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from model.config import ModelConfig
from model.gpt import FINAL_NORMS
from model.summary import StageCount, analytic_total_parameters, count_stages, total_from_stages
from training.config import RunConfig
from training.metrics import (
    flops_per_iteration,
    layer_forward_flops_per_token,
    model_flops_per_iteration,
    recompute_flops_per_token,
    tflops_per_gpu,
)
from training.schedules import BatchRamp

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "torch.float32": "fp32", "bfloat16": "bf16",
                 "torch.bfloat16": "bf16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
"""zero_optimization.reduce_bucket_size and allgather_bucket_size defaults (deepspeed/runtime/zero/config.py)."""
ATTENTION_SCORES = ("recomputed", "stored")
"""Assumptions.attention_scores: what a layer keeps of the s x s attention scores for its backward."""


@dataclass(frozen=True)
class Hardware:
    """One GPU model and its links. Every field can be overridden from tools/plan.py."""

    name: str
    peak_tflops: float
    """Dense bf16/fp16 tensor-core peak, TFLOP/s (the vendor data sheet, without sparsity)."""
    memory_gib: float
    """Memory per GPU, GiB: the data sheet's GB, which nvidia-smi reports as GiB (81920 MiB on an A100 80GB)."""
    hbm_gbytes_per_s: float
    """Memory bandwidth, GB/s (data sheet); bounds the element-wise gradient-accumulation and optimizer work."""
    nvlink_gbytes_per_s: float
    """NVLink per GPU, GB/s, both directions together as the data sheet quotes it; a ring uses half each way."""
    ib_gbits_per_s: float
    """InfiniBand per GPU, Gb/s in each direction (DGX nodes: one HCA per GPU)."""
    gpus_per_node: int = 8
    """GPUs per node behind one NVLink/NVSwitch fabric."""

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "memory_gib", "hbm_gbytes_per_s", "nvlink_gbytes_per_s", "ib_gbits_per_s",
                     "gpus_per_node"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {name} must be positive, got {getattr(self, name)!r}")


GPU_PRESETS: dict[str, Hardware] = {
    # NVIDIA A100 data sheet (SXM 80GB): 312 TFLOP/s bf16 dense, 2039 GB/s HBM2e, NVLink 3 600 GB/s;
    # DGX A100: 8 x 200 Gb/s HDR ConnectX-6, one per GPU (the MT-NLG cluster, Smith et al. 2022).
    "a100-80gb": Hardware("a100-80gb", 312.0, 80.0, 2039.0, 600.0, 200.0),
    # A100 SXM 40GB: the same compute and links, 1555 GB/s HBM2.
    "a100-40gb": Hardware("a100-40gb", 312.0, 40.0, 1555.0, 600.0, 200.0),
    # H100 SXM data sheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 900 GB/s; DGX H100: 8 x 400 Gb/s NDR.
    "h100-80gb": Hardware("h100-80gb", 989.0, 80.0, 3350.0, 900.0, 400.0),
    # H200 SXM data sheet: H100 compute, 141 GB HBM3e at 4.8 TB/s; DGX H200 keeps NVLink 4 and 8 x 400 Gb/s NDR.
    "h200": Hardware("h200", 989.0, 141.0, 4800.0, 900.0, 400.0),
}


@dataclass(frozen=True)
class Assumptions:
    """What the planner cannot read from a data sheet. Stated, defaulted, overridable; none fitted to the paper."""

    matmul_efficiency: float = 0.6
    """Fraction of peak a whole transformer layer sustains (large GEMMs run at ~80% of peak on A100; attention
    BMMs with head dim 160 and the memory-bound LayerNorm, GeLU, softmax and bias work pull it down; Korthikanti et
    al. 2022 report 42.1% model-FLOPs utilisation for a 530B model on 2240 A100s with full recomputation, about 56%
    of peak counting the recomputed forward, bubble and communication included, so a layer alone runs above that)."""
    comm_efficiency: float = 0.8
    """Fraction of a link's per-direction bandwidth that NCCL rings and p2p sustain on messages of tens of MB."""
    hbm_efficiency: float = 0.8
    """Fraction of HBM bandwidth that streaming element-wise kernels (the fp32 accumulation, Adam) sustain."""
    framework_gib: float = 2.0
    """Memory no tensor accounts for: the CUDA context (~0.5-1 GiB), NCCL's buffers, allocator fragmentation."""
    attention_scores: str = "recomputed"
    """'recomputed' (default), what the model runs: F.scaled_dot_product_attention(is_causal=True) without a mask
    (model/gpt.py) picks a fused kernel on CUDA, flash in bf16/fp16 (head dim <= 256) or else memory-efficient (also
    fp32), which stores no s x s attention scores and recomputes them in the backward, so Korthikanti et al.'s
    5 a s / h term is dropped. 'stored': keep it, the paper's formula, what the unfused math kernel holds (an
    explicit mask, or a head dimension neither fused kernel takes)."""

    def __post_init__(self) -> None:
        for name in ("matmul_efficiency", "comm_efficiency", "hbm_efficiency"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.framework_gib < 0:
            raise ValueError(f"framework_gib must be >= 0, got {self.framework_gib!r}")
        if self.attention_scores not in ATTENTION_SCORES:
            raise ValueError(f"attention_scores must be one of {ATTENTION_SCORES}, got {self.attention_scores!r}")

    @property
    def attention_scores_stored(self) -> bool:
        return self.attention_scores == "stored"


@dataclass(frozen=True)
class DeepSpeedLayout:
    """What DeepSpeed allocates and sends for this config; bytes per parameter unless named otherwise."""

    optimizer: str
    """'BF16_Optimizer' (bf16 + fp32 grad accumulation + ZeRO-1) or 'DeepSpeedZeroOptimizer' (any other)."""
    weight_bytes: int
    """The model's weights."""
    grad_bytes: int
    """Each parameter's .grad, in the model dtype, full size."""
    accumulation_bytes: int
    """BF16_Optimizer's full-size fp32 gradient-accumulation buffer (0 for the ZeRO optimizer)."""
    partition_grad_bytes: int
    """The ZeRO optimizer's fp32 gradient partition, per parameter of the partition (0 for BF16_Optimizer)."""
    communication_bytes: int
    """The dtype of the DP gradient reduction (communication_data_type; default the model's 16-bit dtype)."""
    reduce_bucket_elements: int
    """The ZeRO optimizer's reduce staging buffer (0 for BF16_Optimizer, which casts the whole buffer instead)."""
    pipe_partitioned: bool
    """Stages exchange 1/t of each activation per TP rank and all-gather it over TP (DeepSpeed's default)."""


def _dtype(name: str) -> str:
    name = DTYPE_ALIASES.get(str(name), str(name))
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(DTYPE_BYTES)}")
    return name


def deepspeed_layout(config: RunConfig) -> DeepSpeedLayout:
    """Which optimizer wrapper DeepSpeed 0.19.8 picks for this config, and what it holds (module docstring)."""
    ds = config.deepspeed
    zero = ds.get("zero_optimization", {})
    if zero.get("stage", 0) != 1:
        raise ValueError(f"{config.source}: zero_optimization.stage is {zero.get('stage', 0)}; the planner models "
                         f"ZeRO stage 1 (the recipe's): set zero_optimization.stage=1")
    precision = config.model.precision
    accumulation = _dtype(ds.get("data_types", {}).get("grad_accum_dtype") or precision)
    communication = _dtype(ds.get("communication_data_type") or precision)
    weight = DTYPE_BYTES[precision]
    # with SP the engine turns pipe_partitioned off (each TP rank sends its own sequence shard: training/engine.py)
    partitioned = bool(ds.get("pipeline", {}).get("pipe_partitioned", True)) and not config.parallelism.sequence_parallel
    if precision == "bf16" and accumulation == "fp32":
        return DeepSpeedLayout("BF16_Optimizer", weight, weight, 4, 0, DTYPE_BYTES[communication], 0, partitioned)
    bucket = int(zero.get("reduce_bucket_size", DEEPSPEED_BUCKET_ELEMENTS))
    return DeepSpeedLayout("DeepSpeedZeroOptimizer", weight, weight, 0, 4, DTYPE_BYTES[communication], bucket,
                           partitioned)


# ----------------------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParameterCounts:
    stages: list[StageCount]
    """Every stage of one TP rank, built on the meta device, with the closed-form count beside it."""
    total: int
    """One replica from the modules, the tied embedding once."""
    analytic_total: int
    """model.summary.analytic_total_parameters."""


def count_parameters(config: RunConfig) -> ParameterCounts:
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    stages = count_stages(config.model, tp, pp)
    return ParameterCounts(stages, total_from_stages(stages, config.model, tp),
                           analytic_total_parameters(config.model, tp))


def transformer_layers(count: StageCount) -> int:
    return sum(name == "TransformerLayer" for name in count.layers)


def hidden_tensor_bytes(model: ModelConfig, micro_batch: int) -> int:
    """One (b, s, h) activation in the model dtype: what a layer takes in and what a stage sends (2 s b h in bf16)."""
    return model.seq_length * micro_batch * model.hidden_size * DTYPE_BYTES[model.precision]


# -------------------------------------------------------------------------------------------------------- memory


ALL_MODES = ("none", "selective", "full")
STORING_MODES = ("none", "selective")


@dataclass(frozen=True)
class StoredTensor:
    """One row of what a block keeps for its backward: bytes per token of the micro-batch, and the recompute modes
    that keep it."""

    name: str
    bytes_per_token: float
    modes: tuple[str, ...]


def _norm_rows(model: ModelConfig, replicated: float, what: str) -> list[StoredTensor]:
    """What one norm keeps besides its input and output. ``replicated`` is h u, the norm's width on this rank."""
    dtype = DTYPE_BYTES[model.precision]
    if model.norm == "layernorm":  # native_layer_norm: the mean and 1/std of each position, fp32
        return [StoredTensor(f"{what}: mean and rstd (fp32)", 2 * 4 * replicated / model.hidden_size, STORING_MODES)]
    rows = [StoredTensor(f"{what}: rsqrt (fp32) and the normalised x (model dtype)",
                         4 * replicated / model.hidden_size + dtype * replicated, STORING_MODES)]
    if dtype != 4:  # RMSNorm computes in fp32: x.float() is a new tensor, kept by pow and by the mul
        rows.append(StoredTensor(f"{what}: the fp32 copy of its input", 4 * replicated, STORING_MODES))
    return rows


def layer_stored_tensors(model: ModelConfig, tensor_parallel_size: int, *, sequence_parallel: bool,
                         attention_scores_stored: bool = False, micro_batch: int = 1) -> list[StoredTensor]:
    """What one block of this implementation (model/gpt.py, TransformerLayer) keeps for its backward, per token of a
    micro-batch of ``micro_batch`` sequences on one TP rank, by recompute mode: the table behind
    layer_activation_bytes (module docstring)."""
    h, t, f = model.hidden_size, tensor_parallel_size, model.ffn_hidden_size
    dtype = DTYPE_BYTES[model.precision]
    u = 1.0 / t if sequence_parallel else 1.0  # outside the TP matmuls a rank holds s/t positions with SP
    replicated, heads = h * u, model.num_attention_heads / t
    kv = model.num_key_value_heads * model.head_dim / t
    query_copied = model.queries_per_key_value_head > 1 or model.position_embedding == "rope"
    # The SDPA output takes the query's memory layout. The query is a view of the QKV output, laid out (b, s, a, d),
    # unless a rank holds several key/value groups of several query heads: flatten then copies it to (b, a, s, d)
    # (RoPE's rotation keeps whichever layout it gets).
    query_contiguous = model.queries_per_key_value_head > 1 and model.num_key_value_heads // t > 1
    rows = [
        StoredTensor("block output (the next block's input)", dtype * replicated, ALL_MODES),
        StoredTensor("ln1 output, residual sum (ln2 input), ln2 output", 3 * dtype * replicated, STORING_MODES),
        *_norm_rows(model, replicated, "ln1"), *_norm_rows(model, replicated, "ln2"),
        StoredTensor("QKV output (q, k, v are views of it)", dtype * model.qkv_size / t, STORING_MODES),
    ]
    if query_copied:  # SDPA keeps a query of its own: GQA's flatten copies it, RoPE rotates it
        rows.append(StoredTensor("query copy (GQA) or rotated query (RoPE)", dtype * h / t, STORING_MODES))
    if model.position_embedding == "rope":  # the rotated keys; x cos and rotate_half(x) sin keep cos and sin only
        rows += [StoredTensor("rotated keys", dtype * kv, STORING_MODES),
                 StoredTensor("RoPE cos and sin, (s, d) each per block", 2 * dtype * model.head_dim / micro_batch,
                              STORING_MODES)]
    rows.append(StoredTensor("attention output, the dense layer's input", dtype * h / t, STORING_MODES))
    if attention_scores_stored:  # Korthikanti et al.: softmax output, dropout mask, dropout output (5 a s^2 b / t)
        rows.append(StoredTensor("s x s scores (Korthikanti et al.)", 5 * heads * model.seq_length * dtype / 2,
                                 ("none",)))
    else:  # the fused kernel keeps its output and one fp32 statistic per row and head
        rows.append(StoredTensor("SDPA logsumexp (fp32)", 4 * heads, ("none",)))
        if query_contiguous:  # its output is then (b, a, s, d) too: the dense input is a transposed copy
            rows.append(StoredTensor("SDPA output", dtype * h / t, ("none",)))
    if model.mlp == "swiglu":
        rows.append(StoredTensor("gate_up output, silu output, their product", dtype * 4 * f / t, STORING_MODES))
    else:
        rows.append(StoredTensor("fc1 output (GeLU input), GeLU output", dtype * 2 * f / t, STORING_MODES))
    if model.hidden_dropout > 0:  # CUDA's native_dropout keeps a bool mask
        rows.append(StoredTensor("hidden dropout masks (bool)", 2 * replicated, STORING_MODES))
    return rows


def layer_activation_bytes(model: ModelConfig, micro_batch: int, tensor_parallel_size: int, *,
                           sequence_parallel: bool, recompute: str, attention_scores_stored: bool = False) -> float:
    """Bytes one block keeps for its backward per micro-batch, its output counted ("full": the output alone, h u
    per token), by default without the s x s scores, which the fused kernel the model runs does not keep."""
    if recompute not in ALL_MODES:
        raise ValueError(f"recompute must be one of {ALL_MODES}, got {recompute!r}")
    rows = layer_stored_tensors(model, tensor_parallel_size, sequence_parallel=sequence_parallel,
                                attention_scores_stored=attention_scores_stored, micro_batch=micro_batch)
    tokens = model.seq_length * micro_batch
    return tokens * sum(row.bytes_per_token for row in rows if recompute in row.modes)


def micro_batches_held(stage: int, pipeline_parallel_size: int, micro_batches: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at once: min(p - stage, m)."""
    return min(pipeline_parallel_size - stage, micro_batches)


def recomputing_blocks(model: ModelConfig, count: StageCount, recompute: str) -> int:
    """Blocks of this stage that recompute: its first recompute_num_layers, or all of them (0 with "none")."""
    blocks = transformer_layers(count)
    if recompute == "none":
        return 0
    return blocks if model.recompute_num_layers is None else min(model.recompute_num_layers, blocks)


@dataclass(frozen=True)
class StageActivations:
    per_micro_batch: int
    """Held per micro-batch: the stage's input, each block's stored set (its mode's), the embedding dropout mask."""
    working_set: int
    """Alive once: a recomputed block's recomputed part ("full": its whole set) and the head on the last stage."""


def stage_activations(model: ModelConfig, count: StageCount, micro_batch: int, tensor_parallel_size: int, *,
                      sequence_parallel: bool = False, recompute: str | None = None,
                      attention_scores_stored: bool = False) -> StageActivations:
    """One stage's activations in ``recompute`` mode (default: the config's), recompute_num_layers applied."""
    recompute = model.recompute if recompute is None else recompute
    s, b, h, t = model.seq_length, micro_batch, model.hidden_size, tensor_parallel_size
    u = 1.0 / t if sequence_parallel else 1.0
    dtype = DTYPE_BYTES[model.precision]

    def layer(mode: str) -> float:
        return layer_activation_bytes(model, b, t, sequence_parallel=sequence_parallel, recompute=mode,
                                      attention_scores_stored=attention_scores_stored)

    blocks, recomputing = transformer_layers(count), recomputing_blocks(model, count, recompute)
    stored = recomputing * layer(recompute) + (blocks - recomputing) * layer("none")
    stage_input = hidden_tensor_bytes(model, b) * u
    first_stage_mask = s * b * h * u if count.stage == 0 and model.hidden_dropout > 0 else 0
    recomputed = layer("none") - (0.0 if recompute == "full" else layer(recompute)) if recomputing else 0.0
    head = 0.0
    if holds_head(count):  # the final norm's output (the head's input) and stats, the logits and their gradient
        norm = s * b * sum(row.bytes_per_token for row in _norm_rows(model, h * u, "final norm"))
        head = dtype * s * b * h * u + norm + 2 * dtype * s * b * model.padded_vocab_size(t) / t
    return StageActivations(per_micro_batch=int(stored + stage_input + first_stage_mask),
                            working_set=int(recomputed + head))


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of a pipeline stage at the full batch."""

    stage: int
    parameters: int
    """Parameters of this stage's TP rank (N_i)."""
    weights: int
    gradients: int
    """.grad in the model dtype."""
    gradient_accumulation: int
    """BF16_Optimizer's fp32 buffer, full size."""
    gradient_partition: int
    """The ZeRO optimizer's fp32 gradient partition (1/DP)."""
    master_weights: int
    """fp32, 1/DP (ZeRO-1)."""
    adam_states: int
    """exp_avg + exp_avg_sq, fp32, 1/DP (ZeRO-1)."""
    micro_batches_held: int
    activations_per_micro_batch: int
    """Per micro-batch in the configured recompute mode (StageActivations)."""
    activations_working_set: int
    activations: int
    """held x per micro-batch + working set: the configured mode (model.recompute, recompute_num_layers)."""
    activations_none: int
    """The same without recompute ..."""
    activations_selective: int
    """... with selective recompute (the config's recompute_num_layers) ..."""
    activations_full: int
    """... and with full recompute: the three side by side."""
    pipeline_buffers: int
    reduce_buffer: int
    framework_allowance: int
    capacity: int
    total: int = 0
    """Peak: every part, with the larger of activations and the reduce buffer (they are never alive together)."""
    margin: int = 0
    """capacity - total; negative when it does not fit."""
    fits: bool = True

    def __post_init__(self) -> None:
        static = (self.weights + self.gradients + self.gradient_accumulation + self.gradient_partition
                  + self.master_weights + self.adam_states + self.pipeline_buffers + self.framework_allowance)
        total = static + max(self.activations, self.reduce_buffer)
        object.__setattr__(self, "total", total)
        object.__setattr__(self, "margin", self.capacity - total)
        object.__setattr__(self, "fits", total <= self.capacity)


def stage_memory(config: RunConfig, layout: DeepSpeedLayout, count: StageCount, data_parallel_size: int,
                 micro_batches: int, hardware: Hardware, assumptions: Assumptions) -> StageMemory:
    model, n, d = config.model, count.parameters_per_tp_rank, data_parallel_size
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    held = micro_batches_held(count.stage, pp, micro_batches)
    by_mode = {mode: stage_activations(model, count, config.micro_batch_size, tp,
                                       sequence_parallel=config.parallelism.sequence_parallel, recompute=mode,
                                       attention_scores_stored=assumptions.attention_scores_stored)
               for mode in ALL_MODES}
    totals = {mode: held * act.per_micro_batch + act.working_set for mode, act in by_mode.items()}
    act = by_mode[model.recompute]
    hidden_tensor = hidden_tensor_bytes(model, config.micro_batch_size)
    reduce_buffer = (layout.communication_bytes * n if layout.optimizer == "BF16_Optimizer"
                     else layout.reduce_bucket_elements * layout.grad_bytes)
    # the received activation and gradient: the sequence shard with SP, else the whole tensor
    received = hidden_tensor / tp if config.parallelism.sequence_parallel else hidden_tensor
    return StageMemory(
        stage=count.stage, parameters=n, weights=layout.weight_bytes * n, gradients=layout.grad_bytes * n,
        gradient_accumulation=layout.accumulation_bytes * n, gradient_partition=layout.partition_grad_bytes * n // d,
        master_weights=4 * n // d, adam_states=8 * n // d, micro_batches_held=held,
        activations_per_micro_batch=act.per_micro_batch, activations_working_set=act.working_set,
        activations=totals[model.recompute], activations_none=totals["none"],
        activations_selective=totals["selective"], activations_full=totals["full"],
        pipeline_buffers=int(2 * received) if pp > 1 else 0, reduce_buffer=reduce_buffer if d > 1 else 0,
        framework_allowance=int(assumptions.framework_gib * GIB), capacity=int(hardware.memory_gib * GIB))


# ---------------------------------------------------------------------------------------------------------- time


def ring_all_reduce_seconds(nbytes: float, ranks: int, bytes_per_s: float) -> float:
    """Ring all-reduce: each rank sends and receives 2 (n - 1) / n of the buffer."""
    return 0.0 if ranks <= 1 else 2.0 * (ranks - 1) / ranks * nbytes / bytes_per_s


def ring_all_gather_seconds(nbytes: float, ranks: int, bytes_per_s: float) -> float:
    """Ring all-gather (or reduce-scatter) of a buffer of nbytes in all: (n - 1) / n of it per rank."""
    return 0.0 if ranks <= 1 else (ranks - 1) / ranks * nbytes / bytes_per_s


@dataclass(frozen=True)
class Rates:
    """Sustained rates of one GPU: peaks and link speeds (per direction) times the assumed efficiencies."""

    flops_per_s: float
    tensor_parallel_bytes_per_s: float
    """NVLink; InfiniBand if TP spans nodes."""
    pipeline_bytes_per_s: float
    """InfiniBand; NVLink if the whole pipeline fits in a node (else the slowest boundary paces it)."""
    data_parallel_bytes_per_s: float
    """InfiniBand; NVLink if a DP group fits in a node (TP x DP <= GPUs per node: DP ranks are TP apart)."""
    hbm_bytes_per_s: float


def sustained_rates(hardware: Hardware, assumptions: Assumptions, tensor_parallel_size: int,
                    pipeline_parallel_size: int, data_parallel_size: int) -> Rates:
    nvlink = hardware.nvlink_gbytes_per_s / 2 * 1e9 * assumptions.comm_efficiency
    infiniband = hardware.ib_gbits_per_s / 8 * 1e9 * assumptions.comm_efficiency
    node = hardware.gpus_per_node
    tp, dp = tensor_parallel_size, data_parallel_size

    def link(ranks_spanned: int) -> float:
        return nvlink if ranks_spanned <= node else infiniband

    return Rates(flops_per_s=hardware.peak_tflops * 1e12 * assumptions.matmul_efficiency,
                 tensor_parallel_bytes_per_s=link(tp), pipeline_bytes_per_s=link(tp * dp * pipeline_parallel_size),
                 data_parallel_bytes_per_s=link(tp * dp),
                 hbm_bytes_per_s=hardware.hbm_gbytes_per_s * 1e9 * assumptions.hbm_efficiency)


FINAL_NORM_LAYERS = {norm.__name__ for norm in FINAL_NORMS.values()}


def holds_head(count: StageCount) -> bool:
    """The last stage: it holds the final norm (and computes the logits and the loss)."""
    return any(name in FINAL_NORM_LAYERS for name in count.layers)


def stage_flops_per_micro_batch(model: ModelConfig, count: StageCount, micro_batch: int, tensor_parallel_size: int,
                                recompute: str | None = None) -> float:
    """Hardware FLOPs of one micro-batch's forward and backward on one GPU of the stage, the forwards that
    ``recompute`` (default: the config's mode) reruns included (module docstring)."""
    recompute = model.recompute if recompute is None else recompute
    s, h, t = model.seq_length, model.hidden_size, tensor_parallel_size
    layers = 3.0 * layer_forward_flops_per_token(model) * transformer_layers(count)
    layers += recompute_flops_per_token(model, recompute) * recomputing_blocks(model, count, recompute)
    logits = 6.0 * h * model.padded_vocab_size(t) if holds_head(count) else 0.0
    return micro_batch * s * (layers + logits) / t


@dataclass(frozen=True)
class MicroBatchTime:
    """One micro-batch slot (forward + backward) of one stage, seconds."""

    stage: int
    compute: float
    tensor_parallel: float
    pipeline_p2p: float
    gradient_accumulation: float
    total: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "total",
                           self.compute + self.tensor_parallel + self.pipeline_p2p + self.gradient_accumulation)


def tensor_parallel_all_reduces(model: ModelConfig, count: StageCount, sequence_parallel: bool) -> float:
    """All-reduces of one (b, s, h) tensor over TP per micro-batch on this stage; with sequence parallelism the same
    ring volume in all-gathers and reduce-scatters, one of each per all-reduce (module docstring)."""
    blocks = transformer_layers(count)
    rerun = recomputing_blocks(model, count, "full") if model.recompute == "full" else 0
    # each column-parallel layer keeps its input's sequence shard: its backward all-gathers it again (half an
    # all-reduce's volume; 2 per block, 1 for the head)
    regather = (blocks + 0.5 * holds_head(count)) if sequence_parallel else 0.0
    return 4.0 * blocks + 2.0 * rerun + regather + (count.stage == 0) + holds_head(count)


def micro_batch_time(config: RunConfig, layout: DeepSpeedLayout, count: StageCount, rates: Rates) -> MicroBatchTime:
    model, b = config.model, config.micro_batch_size
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    sequence_parallel = config.parallelism.sequence_parallel and tp > 1
    hidden_tensor = hidden_tensor_bytes(model, b)
    all_reduces = tensor_parallel_all_reduces(model, count, sequence_parallel)
    transfers = 0 if pp == 1 else 2 * ((count.stage > 0) + (count.stage < pp - 1))
    # with SP each rank sends its own sequence shard (pipe_partitioned is off); else 1/t and a TP all-gather when
    # DeepSpeed partitions the transfer, the whole tensor when it does not
    piece = hidden_tensor / tp if sequence_parallel or layout.pipe_partitioned else hidden_tensor
    rebuild = ring_all_gather_seconds(hidden_tensor, tp, rates.tensor_parallel_bytes_per_s) \
        if layout.pipe_partitioned and not sequence_parallel else 0.0
    accumulation_bytes = 12 * count.parameters_per_tp_rank if layout.optimizer == "BF16_Optimizer" else 0
    return MicroBatchTime(
        stage=count.stage,
        compute=stage_flops_per_micro_batch(model, count, b, tp) / rates.flops_per_s,
        tensor_parallel=all_reduces * ring_all_reduce_seconds(hidden_tensor, tp, rates.tensor_parallel_bytes_per_s),
        pipeline_p2p=transfers * piece / rates.pipeline_bytes_per_s + transfers / 2 * rebuild,
        gradient_accumulation=accumulation_bytes / rates.hbm_bytes_per_s)


@dataclass(frozen=True)
class IterationTime:
    """One optimizer step at one global batch, seconds by where they go, and the throughput that follows."""

    global_batch: int
    micro_batches: int
    """m, per pipeline."""
    bubble_fraction: float
    """(p - 1) / m."""
    micro_batch: MicroBatchTime
    """The slowest stage's slot, which paces the pipeline."""
    compute: float
    tensor_parallel: float
    pipeline_p2p: float
    gradient_accumulation: float
    bubble: float
    tied_embedding_reduce: float
    data_parallel_reduce: float
    optimizer_step: float
    zero_allgather: float
    sequence_parallel_reduce: float
    seconds: float
    flops: float
    """Hardware FLOPs: training.metrics.flops_per_iteration (the configured recompute counted)."""
    model_flops: float
    """Model FLOPs: training.metrics.model_flops_per_iteration (3 forwards' worth, no recompute)."""
    tflops_per_gpu: float
    """Hardware FLOPs per second per GPU (what the trainer logs as tflops_per_gpu)."""
    hfu: float
    """tflops_per_gpu / peak: hardware FLOPs utilisation."""
    mfu: float
    """Model FLOPs per second per GPU / peak: PaLM's MFU, no recompute counted (the trainer's "mfu")."""


@dataclass(frozen=True)
class AfterPipeline:
    """The non-overlapped work after the last backward, on stage 0 (ends last, holds the most parameters)."""

    tied_embedding_reduce: float
    data_parallel_reduce: float
    optimizer_step: float
    zero_allgather: float
    sequence_parallel_reduce: float
    """With SP: the TP all-reduce of the replicated parameters' partial gradients (norms, row-parallel biases, the
    position table), once per step, before the DP reduction (DeepSpeed sums them as it sums tied weights)."""


def sequence_parallel_parameters(model: ModelConfig, count: StageCount) -> int:
    """Parameters of a stage that every TP rank holds whole and, with SP, gets a partial gradient of."""
    norm = 2 * model.hidden_size if model.norm == "layernorm" else model.hidden_size
    biases = 2 * model.hidden_size if model.other_linears_have_bias else 0
    positions = model.max_position_embeddings * model.hidden_size if "PositionEmbedding" in count.layers else 0
    return transformer_layers(count) * (2 * norm + biases) + positions + norm * holds_head(count)


def after_pipeline_time(config: RunConfig, layout: DeepSpeedLayout, first: StageCount, data_parallel_size: int,
                        rates: Rates) -> AfterPipeline:
    model, n, d = config.model, first.parameters_per_tp_rank, data_parallel_size
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    tied_grad_bytes = (4 if layout.optimizer == "BF16_Optimizer" else layout.grad_bytes) \
        * model.padded_vocab_size(tp) // tp * model.hidden_size
    gradients = layout.communication_bytes * n
    if layout.optimizer == "BF16_Optimizer":
        reduce = ring_all_reduce_seconds(gradients, d, rates.data_parallel_bytes_per_s)
        full_buffer_passes = 16 * n  # cast to bf16 and back for the all-reduce (12), zero the buffer (4)
    else:
        reduce = ring_all_gather_seconds(gradients, d, rates.data_parallel_bytes_per_s)
        full_buffer_passes = layout.grad_bytes * n  # zero the .grad
    adam = (28 + layout.weight_bytes) * n / d
    return AfterPipeline(
        tied_embedding_reduce=ring_all_reduce_seconds(tied_grad_bytes, 2 if pp > 1 and model.tie_word_embeddings else 1,
                                                      rates.pipeline_bytes_per_s),
        data_parallel_reduce=reduce,
        optimizer_step=(adam + full_buffer_passes) / rates.hbm_bytes_per_s,
        zero_allgather=ring_all_gather_seconds(layout.weight_bytes * n, d, rates.data_parallel_bytes_per_s),
        sequence_parallel_reduce=ring_all_reduce_seconds(
            (4 if layout.optimizer == "BF16_Optimizer" else layout.grad_bytes) * sequence_parallel_parameters(model, first),
            tp if config.parallelism.sequence_parallel else 1, rates.tensor_parallel_bytes_per_s))


def iteration_time(config: RunConfig, layout: DeepSpeedLayout, counts: list[StageCount], data_parallel_size: int,
                   global_batch: int, hardware: Hardware, assumptions: Assumptions) -> IterationTime:
    """1F1B: (m + p - 1) slots of the slowest stage, then the DP reduction, the step and the all-gather."""
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    m = global_batch // (config.micro_batch_size * data_parallel_size)
    rates = sustained_rates(hardware, assumptions, tp, pp, data_parallel_size)
    slowest = max((micro_batch_time(config, layout, c, rates) for c in counts), key=lambda t: t.total)
    after = after_pipeline_time(config, layout, counts[0], data_parallel_size, rates)
    parts = dict(compute=m * slowest.compute, tensor_parallel=m * slowest.tensor_parallel,
                 pipeline_p2p=m * slowest.pipeline_p2p, gradient_accumulation=m * slowest.gradient_accumulation,
                 bubble=(pp - 1) * slowest.total, **dataclasses.asdict(after))
    seconds = sum(parts.values())
    flops = flops_per_iteration(config.model, global_batch, tp, pipeline_parallel_size=pp)
    model_flops = model_flops_per_iteration(config.model, global_batch, tp)
    gpus = tp * pp * data_parallel_size
    achieved = tflops_per_gpu(flops, seconds, gpus)
    return IterationTime(global_batch=global_batch, micro_batches=m, bubble_fraction=(pp - 1) / m,
                         micro_batch=slowest, **parts, seconds=seconds, flops=flops, model_flops=model_flops,
                         tflops_per_gpu=achieved, hfu=achieved / hardware.peak_tflops,
                         mfu=tflops_per_gpu(model_flops, seconds, gpus) / hardware.peak_tflops)


# ----------------------------------------------------------------------------------------------- ramp and training


def ramp_sizes_not_dividing(ramp: BatchRamp, unit: int) -> list[int]:
    """The ramp's global batch sizes that are not a whole number of micro-batches on every DP rank."""
    return [size for size in ramp.sizes() if size % unit]


def suggest_ramp(ramp: BatchRamp, unit: int) -> BatchRamp:
    """A ramp to the same end whose every size is a multiple of unit (micro-batch x DP): the increment is the
    multiple of unit nearest the configured one (ties: the larger), the start the size nearest the configured start."""
    candidates = range(unit, ramp.end + 1, unit)
    increment = min(candidates, key=lambda c: (abs(c - ramp.increment), -c))
    steps = max(0, round((ramp.end - ramp.start) / increment))
    start = ramp.end - steps * increment
    if start <= 0:
        start += increment
    return BatchRamp(start=start, increment=increment, end=ramp.end, ramp_tokens=ramp.ramp_tokens)


@dataclass(frozen=True)
class TrainingTime:
    tokens: float
    steps: float
    """Optimizer steps (fractional: segments are integrated in token space)."""
    seconds: float
    ramp_tokens: float
    ramp_steps: float
    ramp_seconds: float
    ramp_seconds_at_full_batch_rate: float
    """What the ramp's tokens would take at the full batch's seconds per token; the difference is the ramp's cost."""


def ramp_segments(ramp: BatchRamp, train_tokens: float) -> list[tuple[int, float]]:
    """(global batch, tokens trained at it), in order, up to train_tokens."""
    segments = []
    if ramp.num_increments and ramp.ramp_tokens:
        for k, size in enumerate(ramp.sizes()[:-1]):
            begin, end = k * ramp.tokens_per_increment, min((k + 1) * ramp.tokens_per_increment, train_tokens)
            if end > begin:
                segments.append((size, end - begin))
    done = sum(tokens for _, tokens in segments)
    if train_tokens > done:
        segments.append((ramp.end, train_tokens - done))
    return segments


def training_time(ramp: BatchRamp, train_tokens: float, seq_length: int,
                  seconds_per_step: Callable[[int], float]) -> TrainingTime:
    """Integrate seconds(batch(t)) / (batch(t) s) over the tokens: each segment's steps at its batch's step time."""
    segments = ramp_segments(ramp, train_tokens)
    steps = [tokens / (batch * seq_length) for batch, tokens in segments]
    seconds = [n * seconds_per_step(batch) for n, (batch, _) in zip(steps, segments, strict=True)]
    in_ramp = [i for i, (batch, _) in enumerate(segments) if batch != ramp.end]
    ramp_tokens = sum(segments[i][1] for i in in_ramp)
    full_rate = seconds_per_step(ramp.end) / (ramp.end * seq_length)
    return TrainingTime(tokens=train_tokens, steps=sum(steps), seconds=sum(seconds), ramp_tokens=ramp_tokens,
                        ramp_steps=sum(steps[i] for i in in_ramp), ramp_seconds=sum(seconds[i] for i in in_ramp),
                        ramp_seconds_at_full_batch_rate=ramp_tokens * full_rate)


# ------------------------------------------------------------------------------ tokens per parameter, compute-optimal


@dataclass(frozen=True)
class ScalingLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta: the loss of N parameters trained on D tokens."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float


CHINCHILLA = ScalingLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
"""Hoffmann et al. 2022 (arXiv:2203.15556), approach 3 (section 3.3), as published. Besiroglu et al. 2024
(arXiv:2404.10102) find these rounded values biased away from the paper's approaches 1 and 2, which give about 20
tokens per parameter: the planner prints that rule beside it."""


@dataclass(frozen=True)
class Allocation:
    """A model size and the tokens it is trained on."""

    parameters: float
    tokens: float
    tokens_per_parameter: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens_per_parameter", self.tokens / self.parameters)


def training_flops_6nd(parameters: float, tokens: float) -> float:
    """C = 6 N D, the budget the scaling laws are fitted in (the planner's hardware FLOPs also count attention and
    recompute: not comparable)."""
    return 6.0 * parameters * tokens


def chinchilla_optimal(flops: float, law: ScalingLaw = CHINCHILLA) -> Allocation:
    """The N and D minimising L(N, D) along 6 N D = C, Hoffmann et al.'s closed form: dL/dN = 0 with
    D = C / (6 N) gives N^(alpha + beta) = (alpha A / (beta B)) (C/6)^beta, so N = G (C/6)^a, D = G^-1 (C/6)^b."""
    exponents = law.alpha + law.beta
    g = (law.alpha * law.A / (law.beta * law.B)) ** (1.0 / exponents)
    budget = flops / 6.0
    return Allocation(g * budget ** (law.beta / exponents), budget ** (law.alpha / exponents) / g)


def twenty_tokens_per_parameter(flops: float) -> Allocation:
    """D = 20 N at C = 6 N D = 120 N^2: N = sqrt(C / 120)."""
    parameters = math.sqrt(flops / 120.0)
    return Allocation(parameters, 20.0 * parameters)


@dataclass(frozen=True)
class ComputeOptimal:
    """The run's tokens per parameter, and what its training compute would buy compute-optimally."""

    flops: float
    """C = 6 N D of the run."""
    run: Allocation
    """N = ParameterCounts.total (embeddings included, as Hoffmann et al. count), D = schedule.train_tokens."""
    chinchilla: Allocation
    """Hoffmann et al.'s approach-3 fit (CHINCHILLA) at that C."""
    twenty_tokens_per_parameter: Allocation
    """The rule of thumb at that C."""
    law: ScalingLaw = CHINCHILLA


def compute_optimal(config: RunConfig, parameters: ParameterCounts) -> ComputeOptimal:
    run = Allocation(parameters.total, config.schedule.train_tokens)
    flops = training_flops_6nd(run.parameters, run.tokens)
    return ComputeOptimal(flops, run, chinchilla_optimal(flops), twenty_tokens_per_parameter(flops))


# ----------------------------------------------------------------------------------------------------------- plan


@dataclass
class Plan:
    """Everything the planner says about one cluster size."""

    nodes: int
    gpus: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int | None
    micro_batch_size: int
    global_batch_size: int
    micro_batches: int | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ramp: dict[str, Any] | None = None
    memory: list[StageMemory] = field(default_factory=list)
    flops: dict[str, float] = field(default_factory=dict)
    first_batch: IterationTime | None = None
    full_batch: IterationTime | None = None
    training: TrainingTime | None = None
    measured: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def peak_memory(self) -> StageMemory | None:
        return max(self.memory, key=lambda m: m.total) if self.memory else None


def _check_batches(config: RunConfig, plan: Plan) -> BatchRamp | None:
    """Errors for a full batch that does not split; a warning and a working ramp for ramp sizes that do not."""
    unit = config.micro_batch_size * plan.data_parallel_size
    if config.global_batch_size % unit:
        plan.errors.append(
            f"the full batch train_batch_size={config.global_batch_size} is not divisible by micro-batch x DP = "
            f"{config.micro_batch_size} x {plan.data_parallel_size} = {unit}: choose a batch that is a multiple of "
            f"{unit} or another node count")
        return None
    ramp = config.batch_schedule()
    bad = ramp_sizes_not_dividing(ramp, unit)
    if not bad:
        return ramp
    better = suggest_ramp(ramp, unit)
    shown = ", ".join(map(str, bad[:10]))
    if len(bad) > 10:
        shown += f", ... ({len(bad)} of {len(ramp.sizes())} sizes)"
    plan.warnings.append(
        f"ramp batch sizes not divisible by micro-batch x DP = {unit} (training.config.check_world would refuse "
        f"them): {shown}. A ramp that works: --set schedule.batch.start={better.start} "
        f"--set schedule.batch.increment={better.increment} ({better.start} -> {better.end} in steps of "
        f"{better.increment}); the training time below assumes it")
    return better


def _check_memory(plan: Plan, hardware: Hardware) -> None:
    worst = plan.peak_memory()
    if worst is None or worst.fits:
        return
    parts = {"activations": worst.activations, "weights": worst.weights, "gradients": worst.gradients,
             "fp32 gradient accumulation": worst.gradient_accumulation, "Adam states": worst.adam_states,
             "master weights": worst.master_weights}
    largest = max(parts, key=parts.get)
    plan.errors.append(
        f"memory exceeded: stage {worst.stage} needs {worst.total / GIB:.1f} GiB of the {hardware.name}'s "
        f"{hardware.memory_gib:g} GiB (over by {-worst.margin / GIB:.1f} GiB); its largest part is {largest} "
        f"({parts[largest] / GIB:.1f} GiB)")


def _flops(config: RunConfig, first: int, full: int) -> dict[str, float]:
    """Hardware FLOPs (the configured recompute counted) and model FLOPs (none) at the first and the full batch."""
    model, tp = config.model, config.parallelism.tensor_parallel_size
    pp = config.parallelism.pipeline_parallel_size
    figures = {}
    for name, batch in (("first_batch", first), ("full_batch", full)):
        figures[name] = flops_per_iteration(model, batch, tp, pipeline_parallel_size=pp)
        figures[f"{name}_model"] = model_flops_per_iteration(model, batch, tp)
    return figures


def measured_throughput(config: RunConfig, gpus: int, iteration_seconds: float, hardware: Hardware,
                        predicted_seconds: float | None = None) -> dict[str, float]:
    """A measured full-batch iteration: TFLOP/s per GPU and HFU (hardware FLOPs, the configured recompute counted)
    and MFU (model FLOPs, no recompute), as the trainer logs them."""
    if iteration_seconds <= 0:
        raise ValueError(f"--iteration-seconds must be positive, got {iteration_seconds}")
    tp, batch = config.parallelism.tensor_parallel_size, config.global_batch_size
    pp = config.parallelism.pipeline_parallel_size
    achieved = tflops_per_gpu(flops_per_iteration(config.model, batch, tp, pipeline_parallel_size=pp),
                              iteration_seconds, gpus)
    model = tflops_per_gpu(model_flops_per_iteration(config.model, batch, tp), iteration_seconds, gpus)
    figures = {"iteration_seconds": iteration_seconds, "tflops_per_gpu": achieved, "model_tflops_per_gpu": model,
               "hfu": achieved / hardware.peak_tflops, "mfu": model / hardware.peak_tflops}
    if predicted_seconds:
        figures["predicted_over_measured"] = predicted_seconds / iteration_seconds
    return figures


def plan_cluster(config: RunConfig, nodes: int, hardware: Hardware, assumptions: Assumptions,
                 parameters: ParameterCounts, iteration_seconds: float | None = None) -> Plan:
    """The plan for one node count: errors (impossible) and warnings, memory, time and the whole training."""
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    gpus = nodes * hardware.gpus_per_node
    plan = Plan(nodes=nodes, gpus=gpus, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=None,
                micro_batch_size=config.micro_batch_size, global_batch_size=config.global_batch_size)
    try:
        plan.data_parallel_size = config.parallelism.data_parallel_size(gpus)
    except ValueError as error:
        model_parallel = tp * pp
        step = model_parallel // math.gcd(model_parallel, hardware.gpus_per_node)
        plan.errors.append(f"data parallelism is not a whole number: {nodes} nodes x {hardware.gpus_per_node} GPUs = "
                           f"{error}; use a multiple of {step} nodes")
        return plan
    if tp > hardware.gpus_per_node:
        plan.warnings.append(f"tensor parallelism {tp} spans nodes of {hardware.gpus_per_node} GPUs: its all-reduces "
                             f"are timed over InfiniBand")
    ramp = _check_batches(config, plan)
    if ramp is None:
        return plan
    layout, d = deepspeed_layout(config), plan.data_parallel_size
    plan.micro_batches = config.global_batch_size // (config.micro_batch_size * d)
    plan.ramp = {**dataclasses.asdict(ramp), "suggested": ramp != config.batch_schedule()}
    plan.memory = [stage_memory(config, layout, c, d, plan.micro_batches, hardware, assumptions)
                   for c in parameters.stages]
    _check_memory(plan, hardware)
    plan.flops = _flops(config, ramp.sizes()[0], ramp.end)
    times: dict[int, IterationTime] = {}

    def seconds(batch: int) -> float:
        if batch not in times:
            times[batch] = iteration_time(config, layout, parameters.stages, d, batch, hardware, assumptions)
        return times[batch].seconds

    plan.training = training_time(ramp, config.schedule.train_tokens, config.model.seq_length, seconds)
    seconds(ramp.sizes()[0])
    plan.first_batch, plan.full_batch = times[ramp.sizes()[0]], times[ramp.end]
    if iteration_seconds is not None:
        plan.measured = measured_throughput(config, gpus, iteration_seconds, hardware, plan.full_batch.seconds)
    return plan


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return dataclasses.asdict(plan)


def report_to_dict(config: RunConfig, hardware: Hardware, assumptions: Assumptions, parameters: ParameterCounts,
                   plans: list[Plan]) -> dict[str, Any]:
    """The --json document (schema in the module docstring)."""
    return {"config": config.source, "gpu": dataclasses.asdict(hardware),
            "assumptions": dataclasses.asdict(assumptions),
            "deepspeed": dataclasses.asdict(deepspeed_layout(config)),
            "parameters": dataclasses.asdict(parameters),
            "compute_optimal": dataclasses.asdict(compute_optimal(config, parameters)),
            "plans": [plan_to_dict(p) for p in plans]}


# --------------------------------------------------------------------------------------------------------- search


@dataclass(frozen=True)
class Layout:
    """One way to run the config on a cluster: the parallel sizes, the micro-batch and what is recomputed."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    micro_batch_size: int
    sequence_parallel: bool
    recompute: str
    recompute_num_layers: int | None
    """Blocks of each stage that recompute; None: all of them (and with recompute "none")."""


@dataclass(frozen=True)
class LayoutResult:
    layout: Layout
    peak_memory_bytes: int
    """The peak stage's total (StageMemory.total)."""
    fits: bool
    full_batch: IterationTime


def layout_config(config: RunConfig, layout: Layout) -> RunConfig:
    """The run config with the layout's sizes, micro-batch and recompute in place of its own."""
    model = dataclasses.replace(config.model, recompute=layout.recompute,
                                recompute_num_layers=layout.recompute_num_layers)
    parallelism = dataclasses.replace(config.parallelism, tensor_parallel_size=layout.tensor_parallel_size,
                                      pipeline_parallel_size=layout.pipeline_parallel_size,
                                      sequence_parallel=layout.sequence_parallel)
    deepspeed = {**config.deepspeed, "train_micro_batch_size_per_gpu": layout.micro_batch_size}
    return dataclasses.replace(config, model=model, parallelism=parallelism, deepspeed=deepspeed)


def recompute_layer_choices(blocks_per_stage: int) -> list[int | None]:
    """recompute_num_layers to try: every count when a stage has at most 8 blocks, else 7 spread over them;
    None (all blocks) first."""
    if blocks_per_stage <= 8:
        counts = range(1, blocks_per_stage)
    else:
        counts = sorted({max(1, round(blocks_per_stage * k / 8)) for k in range(1, 8)})
    return [None, *counts]


def candidate_layouts(config: RunConfig, gpus: int, gpus_per_node: int) -> list[Layout]:
    """TP dividing the heads, key/value heads and FFN, up to a node; PP dividing the layers with TP x PP dividing the
    GPUs; micro-batches 1, 2, 4, 8 that split the full batch over DP; SP on or off (on: TP > 1 and a sequence that
    divides); recompute none, selective and full, the latter two on some or all blocks of each stage."""
    model, batch = config.model, config.global_batch_size
    layouts = []
    for tp in range(1, gpus_per_node + 1):
        if model.num_attention_heads % tp or model.num_key_value_heads % tp or model.ffn_hidden_size % tp:
            continue
        for pp in (p for p in range(1, model.num_layers + 1) if model.num_layers % p == 0 and gpus % (tp * p) == 0):
            dp = gpus // (tp * pp)
            for micro_batch in (m for m in (1, 2, 4, 8) if batch % (m * dp) == 0):
                for sequence_parallel in (False, True) if tp > 1 and model.seq_length % tp == 0 else (False,):
                    modes = [("none", None)] + [(mode, n) for mode in ("selective", "full")
                                                for n in recompute_layer_choices(model.num_layers // pp)]
                    layouts += [Layout(tp, pp, dp, micro_batch, sequence_parallel, mode, n) for mode, n in modes]
    return layouts


def _distinct_stages(counts: list[StageCount]) -> list[StageCount]:
    """Stages 0, 1 and the last: the middle stages repeat stage 1 with fewer micro-batches held (the blocks divide
    evenly), so these three carry the peak memory and the slowest slot."""
    return [counts[i] for i in sorted({0, min(1, len(counts) - 1), len(counts) - 1})]


def search_layouts(config: RunConfig, nodes: int, hardware: Hardware, assumptions: Assumptions,
                   counts: Callable[[int, int], list[StageCount]] | None = None) -> tuple[int, list[LayoutResult]]:
    """Every candidate layout at ``nodes``: (how many were tried, those that fit, fastest full-batch iteration
    first). ``counts(tp, pp)`` gives the stages' parameter counts (default: count_stages, once per (tp, pp))."""
    cache: dict[tuple[int, int], list[StageCount]] = {}

    def stages(tp: int, pp: int) -> list[StageCount]:
        if (tp, pp) not in cache:
            full = counts(tp, pp) if counts else count_stages(config.model, tp, pp)
            cache[(tp, pp)] = _distinct_stages(full)
        return cache[(tp, pp)]

    layouts = candidate_layouts(config, nodes * hardware.gpus_per_node, hardware.gpus_per_node)
    results = []
    for layout in layouts:
        candidate = layout_config(config, layout)
        chosen = stages(layout.tensor_parallel_size, layout.pipeline_parallel_size)
        ds_layout, d = deepspeed_layout(candidate), layout.data_parallel_size
        m = config.global_batch_size // (layout.micro_batch_size * d)
        peak = max((stage_memory(candidate, ds_layout, c, d, m, hardware, assumptions) for c in chosen),
                   key=lambda memory: memory.total)
        if not peak.fits:
            continue
        timed = iteration_time(candidate, ds_layout, chosen, d, config.global_batch_size, hardware, assumptions)
        results.append(LayoutResult(layout, peak.total, peak.fits, timed))
    results.sort(key=lambda r: (r.full_batch.seconds, r.peak_memory_bytes))
    return len(layouts), results


def layout_result_to_dict(result: LayoutResult) -> dict[str, Any]:
    t = result.full_batch
    return {**dataclasses.asdict(result.layout), "peak_memory_bytes": result.peak_memory_bytes,
            "peak_memory_gib": result.peak_memory_bytes / GIB, "iteration_seconds": t.seconds,
            "tflops_per_gpu": t.tflops_per_gpu, "hfu": t.hfu, "mfu": t.mfu}


def search_to_dict(config: RunConfig, nodes: int, hardware: Hardware, assumptions: Assumptions, tried: int,
                   results: list[LayoutResult], top: int) -> dict[str, Any]:
    """The --search --json document: the best ``top`` layouts that fit, fastest full-batch iteration first."""
    return {"config": config.source, "nodes": nodes, "gpus": nodes * hardware.gpus_per_node,
            "gpu": dataclasses.asdict(hardware), "assumptions": dataclasses.asdict(assumptions),
            "ranked_by": "full-batch iteration seconds", "layouts_tried": tried, "layouts_fitting": len(results),
            "best": layout_result_to_dict(results[0]) if results else None,
            "layouts": [layout_result_to_dict(r) for r in results[:top]]}


# ----------------------------------------------------------------------------------------------------- formatting


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, width=118, initial_indent=indent, subsequent_indent=indent + "    ")


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def _stage_runs(stages: list[StageCount]) -> list[tuple[int, int, StageCount]]:
    """Consecutive stages with identical layers and counts, as (first, last, count)."""
    runs: list[tuple[int, int, StageCount]] = []
    for c in stages:
        if runs and runs[-1][2].layers == c.layers and runs[-1][2].parameters_per_tp_rank == c.parameters_per_tp_rank:
            runs[-1] = (runs[-1][0], c.stage, runs[-1][2])
        else:
            runs.append((c.stage, c.stage, c))
    return runs


def _layer_names(names: list[str]) -> str:
    """['TransformerLayer', 'TransformerLayer', 'FinalLayerNorm'] -> 'TransformerLayer x2, FinalLayerNorm'."""
    groups = [(name, len(list(run))) for name, run in itertools.groupby(names)]
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in groups)


FLOPS_CONVENTION = ("TFLOP/s per GPU and HFU count hardware FLOPs (the recomputed forwards included); MFU counts model "
                    "FLOPs, 3 forwards' worth without recompute (PaLM's definition, what the trainer logs as mfu)")


def recompute_label(model: ModelConfig) -> str:
    """'full', 'selective, first 2 blocks of each stage', 'none'."""
    if model.recompute == "none" or model.recompute_num_layers is None:
        return model.recompute
    return f"{model.recompute}, first {model.recompute_num_layers} blocks of each stage"


def format_header(config: RunConfig, hardware: Hardware, assumptions: Assumptions, parameters: ParameterCounts
                  ) -> str:
    model, layout = config.model, deepspeed_layout(config)
    tp = config.parallelism.tensor_parallel_size
    prose = [
        f"{config.source}: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
        f"seq {model.seq_length}, vocab {model.padded_vocab_size(tp):,} (padded); {model.precision}, recompute "
        f"{recompute_label(model)}; TP {tp} x PP {config.parallelism.pipeline_parallel_size}, sequence parallelism "
        f"{'on' if config.parallelism.sequence_parallel else 'off'}, micro-batch {config.micro_batch_size}",
        f"DeepSpeed: {layout.optimizer} (ZeRO-1), DP gradient reduction in {8 * layout.communication_bytes}-bit, "
        f"pipe_partitioned {layout.pipe_partitioned}",
        f"GPU {hardware.name}: {hardware.peak_tflops:g} TFLOP/s, {hardware.memory_gib:g} GiB, HBM "
        f"{hardware.hbm_gbytes_per_s:g} GB/s, NVLink {hardware.nvlink_gbytes_per_s:g} GB/s, InfiniBand "
        f"{hardware.ib_gbits_per_s:g} Gb/s per GPU, {hardware.gpus_per_node} per node",
        f"assumed: matmul efficiency {assumptions.matmul_efficiency:g}, link efficiency "
        f"{assumptions.comm_efficiency:g}, HBM efficiency {assumptions.hbm_efficiency:g}, framework allowance "
        f"{assumptions.framework_gib:g} GiB, attention scores {assumptions.attention_scores} "
        f"({'Korthikanti et al.' if assumptions.attention_scores_stored else 'fused SDPA kernel'})",
        FLOPS_CONVENTION,
    ]
    lines = [_wrap(line) for line in prose] + [
        "",
        f"{'parameters per TP rank':<24} {'layers':<54} {'meta device':>15} {'analytic':>15}",
    ]
    for first, last, c in _stage_runs(parameters.stages):
        name = f"stage {first}" if first == last else f"stages {first}-{last}"
        lines.append(f"  {name:<22} {_layer_names(c.layers):<54} {c.parameters_per_tp_rank:>15,} "
                     f"{c.analytic_per_tp_rank:>15,}")
    same = "equal" if parameters.total == parameters.analytic_total else "DIFFERENT"
    lines.append(f"  total, tied embedding once: {parameters.total:,} from the modules, {parameters.analytic_total:,} "
                 f"analytic ({same})")
    return "\n".join(lines + ["", format_compute_optimal(compute_optimal(config, parameters))])


def _count(number: float) -> str:
    """529.6e9 -> '529.6B', 3.7106e12 -> '3.711T': counts of parameters and tokens as people say them."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if number >= scale:
            return f"{number / scale:.4g}{suffix}"
    return f"{number:,.0f}"


def format_compute_optimal(optimal: ComputeOptimal) -> str:
    law = optimal.law
    rows = (("this run", optimal.run),
            ("Hoffmann et al. 2022, approach-3 fit", optimal.chinchilla),
            ("rule of thumb: 20 tokens per parameter", optimal.twenty_tokens_per_parameter))
    lines = [f"tokens per parameter, and the compute-optimal size for the run's C = 6 N D = {optimal.flops:.3g} FLOPs",
             f"  {'':<44} {'parameters N':>14} {'tokens D':>12} {'tokens per parameter':>22}"]
    lines += [f"  {name:<44} {_count(row.parameters):>14} {_count(row.tokens):>12} {row.tokens_per_parameter:>22.3g}"
              for name, row in rows]
    lines += [f"  the fit: L(N, D) = {law.E:g} + {law.A:g} / N^{law.alpha:g} + {law.B:g} / D^{law.beta:g}, minimised "
              f"along 6 N D = C", "  the rule: D = 20 N, so C = 120 N^2 and N = sqrt(C / 120)"]
    return "\n".join(lines)


def _memory_columns(plan: Plan) -> list[StageMemory]:
    """First, a middle and the last stage (the others repeat the middle one), and the peak if it is none of them."""
    stages = plan.memory
    picked = [stages[0]] + ([stages[len(stages) // 2]] if len(stages) > 2 else []) + \
        ([stages[-1]] if len(stages) > 1 else [])
    worst = plan.peak_memory()
    return picked if worst in picked else picked + [worst]


MEMORY_ROWS = (
    ("weights", "weights"), ("gradients (.grad)", "gradients"),
    ("fp32 gradient accumulation", "gradient_accumulation"), ("fp32 gradient partition", "gradient_partition"),
    ("fp32 master weights / DP", "master_weights"), ("Adam m + v (fp32) / DP", "adam_states"),
    ("activations per micro-batch", "activations_per_micro_batch"),
    ("activations working set (recompute, head)", "activations_working_set"),
    ("activations, all held + working set", "activations"),
    ("  ..., if recompute none", "activations_none"),
    ("  ..., if recompute selective", "activations_selective"),
    ("  ..., if recompute full", "activations_full"),
    ("pipeline p2p buffers", "pipeline_buffers"), ("DP reduce buffer (transient)", "reduce_buffer"),
    ("framework allowance", "framework_allowance"), ("peak", "total"), ("margin", "margin"),
)


def format_memory(plan: Plan) -> str:
    columns = _memory_columns(plan)
    lines = [f"  {'memory per GPU, GiB':<48}" + "".join(f"{'stage ' + str(m.stage):>11}" for m in columns)]
    lines.append(f"  {'micro-batches held (1F1B)':<48}" + "".join(f"{m.micro_batches_held:>11}" for m in columns))
    for label, name in MEMORY_ROWS:
        if not any(getattr(m, name) for m in columns):
            continue  # a part this optimizer does not have
        lines.append(f"  {label:<48}" + "".join(f"{_gib(getattr(m, name)):>11}" for m in columns))
    worst = plan.peak_memory()
    verdict = "fits" if worst.fits else "DOES NOT FIT"
    lines.append(_wrap(f"verdict: {verdict}: the peak stage ({worst.stage}) uses {_gib(worst.total)} of "
                       f"{_gib(worst.capacity)} GiB, margin {_gib(worst.margin)} GiB", "  "))
    return "\n".join(lines)


TIME_ROWS = ("compute", "tensor_parallel", "pipeline_p2p", "gradient_accumulation", "bubble",
             "tied_embedding_reduce", "sequence_parallel_reduce", "data_parallel_reduce", "optimizer_step",
             "zero_allgather")


def format_time(plan: Plan) -> str:
    columns = [plan.first_batch, plan.full_batch] if plan.first_batch.global_batch != plan.full_batch.global_batch \
        else [plan.full_batch]
    lines = [f"  {'iteration, seconds (share)':<30}" + "".join(f"{f'batch {t.global_batch}':>20}" for t in columns),
             f"  {'micro-batches per pipeline':<30}" + "".join(f"{t.micro_batches:>20}" for t in columns),
             f"  {'bubble (p - 1) / m':<30}" + "".join(f"{t.bubble_fraction:>20.3f}" for t in columns)]
    for name in TIME_ROWS:
        lines.append(f"  {name.replace('_', ' '):<30}" + "".join(
            f"{getattr(t, name):>11.3f} ({getattr(t, name) / t.seconds:>5.1%})" for t in columns))
    lines.append(f"  {'total':<30}" + "".join(f"{t.seconds:>20.3f}" for t in columns))
    lines.append(f"  {'TFLOP/s per GPU (HFU)':<30}" + "".join(
        f"{t.tflops_per_gpu:>11.1f} ({t.hfu:>5.1%})" for t in columns))
    lines.append(f"  {'MFU (model FLOPs)':<30}" + "".join(f"{t.mfu:>20.1%}" for t in columns))
    slot = plan.full_batch.micro_batch
    lines.append(f"  slowest stage {slot.stage}: {slot.total * 1e3:.1f} ms per micro-batch slot (compute "
                 f"{slot.compute * 1e3:.1f}, TP {slot.tensor_parallel * 1e3:.1f}, p2p {slot.pipeline_p2p * 1e3:.1f}, "
                 f"fp32 accumulation {slot.gradient_accumulation * 1e3:.1f})")
    return "\n".join(lines)


def format_plan(plan: Plan) -> str:
    d = plan.data_parallel_size
    head = f"== {plan.nodes} nodes: {plan.gpus} GPUs = TP {plan.tensor_parallel_size} x PP " \
           f"{plan.pipeline_parallel_size} x DP {d if d is not None else '?'} =="
    lines = [head] + [_wrap(f"warning: {w}", "  ") for w in plan.warnings] + \
        [_wrap(f"ERROR: {e}", "  ") for e in plan.errors]
    if plan.memory:
        lines.append(format_memory(plan))
    if plan.full_batch is not None:
        f = plan.flops
        lines.append(_wrap(f"FLOPs per iteration (hardware, recompute counted / model): batch {plan.first_batch.global_batch}: {f['first_batch']:.4g} / "
                           f"{f['first_batch_model']:.4g}; batch {plan.full_batch.global_batch}: "
                           f"{f['full_batch']:.4g} / {f['full_batch_model']:.4g}", "  "))
        lines.append(format_time(plan))
        lines.append(format_training(plan))
    if plan.measured:
        lines.append(format_measured(plan.measured))
    return "\n".join(lines)


def format_training(plan: Plan) -> str:
    t, r = plan.training, plan.ramp
    extra = t.ramp_seconds - t.ramp_seconds_at_full_batch_rate
    ramp = f"ramp {r['start']} -> {r['end']} by {r['increment']}" + (" (suggested)" if r["suggested"] else "")
    return _wrap(f"training {t.tokens:.4g} tokens: {t.steps:,.0f} steps, {t.seconds / 86400:.2f} days; {ramp}: "
                 f"{t.ramp_tokens:.3g} tokens in {t.ramp_steps:,.0f} steps, {t.ramp_seconds / 3600:.1f} h "
                 f"({extra / 3600:.1f} h more than at the full batch's rate)", "  ")


def format_measured(measured: dict[str, float]) -> str:
    line = (f"measured {measured['iteration_seconds']:g} s per iteration: {measured['tflops_per_gpu']:.1f} TFLOP/s "
            f"per GPU, HFU {measured['hfu']:.1%}; model FLOPs {measured['model_tflops_per_gpu']:.1f} TFLOP/s per GPU, "
            f"MFU {measured['mfu']:.1%}")
    if "predicted_over_measured" in measured:
        line += f"; predicted / measured time {measured['predicted_over_measured']:.3f}"
    return _wrap(line, "  ")


def format_comparison(plans: list[Plan]) -> str:
    """One line per node count: the figures to compare cluster sizes by."""
    lines = [f"{'nodes':>6} {'GPUs':>6} {'DP':>4} {'m':>5} {'bubble':>7} {'iter s':>8} {'TFLOP/s':>8} {'HFU':>6} "
             f"{'MFU':>6} {'days':>6} {'ramp h':>7} {'peak GiB':>9} {'margin':>7}"]
    for p in plans:
        if not p.ok:
            lines.append(_wrap(f"{p.nodes:>6} {p.gpus:>6}  impossible: {p.errors[0]}", ""))
            continue
        t, w = p.full_batch, p.peak_memory()
        lines.append(f"{p.nodes:>6} {p.gpus:>6} {p.data_parallel_size:>4} {t.micro_batches:>5} "
                     f"{t.bubble_fraction:>7.3f} {t.seconds:>8.2f} {t.tflops_per_gpu:>8.1f} {t.hfu:>6.1%} {t.mfu:>6.1%} "
                     f"{p.training.seconds / 86400:>6.2f} {p.training.ramp_seconds / 3600:>7.1f} "
                     f"{w.total / GIB:>9.2f} {w.margin / GIB:>7.2f}")
    return "\n".join(lines)


def _layout_row(rank: int | str, result: LayoutResult) -> str:
    layout, t = result.layout, result.full_batch
    layers = "-" if layout.recompute == "none" else layout.recompute_num_layers or "all"
    return (f"{rank:>4} {layout.tensor_parallel_size:>3} {layout.pipeline_parallel_size:>4} "
            f"{layout.data_parallel_size:>5} {layout.micro_batch_size:>6} {'on' if layout.sequence_parallel else 'off':>4} "
            f"{layout.recompute:>10} {layers!s:>9} {result.peak_memory_bytes / GIB:>9.2f} {t.seconds:>8.2f} "
            f"{t.tflops_per_gpu:>8.1f} {t.mfu:>6.1%}")


def describe_layout(result: LayoutResult) -> str:
    layout = result.layout
    blocks = "all" if layout.recompute_num_layers is None else str(layout.recompute_num_layers)
    recompute = layout.recompute if layout.recompute == "none" else f"{layout.recompute} on {blocks} blocks per stage"
    return (f"TP {layout.tensor_parallel_size} x PP {layout.pipeline_parallel_size} x DP {layout.data_parallel_size}, "
            f"micro-batch {layout.micro_batch_size}, sequence parallelism {'on' if layout.sequence_parallel else 'off'}, "
            f"recompute {recompute}: {result.full_batch.seconds:.2f} s per iteration, "
            f"{result.peak_memory_bytes / GIB:.2f} GiB peak, MFU {result.full_batch.mfu:.1%}")


def layout_settings(layout: Layout) -> str:
    """The --set options that give a run config this layout."""
    settings = [f"parallelism.tensor_parallel_size={layout.tensor_parallel_size}",
                f"parallelism.pipeline_parallel_size={layout.pipeline_parallel_size}",
                f"train_micro_batch_size_per_gpu={layout.micro_batch_size}",
                f"parallelism.sequence_parallel={str(layout.sequence_parallel).lower()}",
                f"model.recompute='\"{layout.recompute}\"'"]
    if layout.recompute_num_layers is not None:
        settings.append(f"model.recompute_num_layers={layout.recompute_num_layers}")
    return " ".join(f"--set {setting}" for setting in settings)


def format_search(config: RunConfig, nodes: int, hardware: Hardware, tried: int, results: list[LayoutResult],
                  top: int) -> str:
    gpus = nodes * hardware.gpus_per_node
    lines = [_wrap(f"{config.source} at {nodes} nodes ({gpus} GPUs, {hardware.name}): {tried} layouts tried, "
                   f"{len(results)} fit in {hardware.memory_gib:g} GiB; ranked by the predicted full-batch "
                   f"(batch {config.global_batch_size}) iteration time. {FLOPS_CONVENTION}"), ""]
    if not results:
        return "\n".join(lines + ["no layout fits"])
    lines.append(f"{'rank':>4} {'TP':>3} {'PP':>4} {'DP':>5} {'micro':>6} {'SP':>4} {'recompute':>10} "
                 f"{'n layers':>9} {'peak GiB':>9} {'iter s':>8} {'TFLOP/s':>8} {'MFU':>6}")
    lines += [_layout_row(rank, r) for rank, r in enumerate(results[:top], start=1)]
    lines += ["", _wrap(f"best: {describe_layout(results[0])}. As settings: {layout_settings(results[0].layout)}")]
    return "\n".join(lines)
