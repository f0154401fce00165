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
    receiver all-gathers it over the TP group.

Memory of stage i
    weights + grads + accumulation buffer + master + Adam       as above
    activations = held x per_micro_batch + working_set, held = min(p - i, m) (a 1F1B stage keeps the micro-batches
        whose backward has not run: DeepSpeed's ``TrainSchedule.num_pipe_buffers``).
        Per layer and micro-batch, Korthikanti et al. 2022 (arXiv:2205.05198, eq. 2-4), 16-bit activations, 1-byte
        dropout masks: s b h (34 + 5 a s / h) at t = 1; with tensor parallelism s b h (10 + 24 / t + 5 a s / (h t));
        with sequence parallelism s b h (34 + 5 a s / h) / t (not used by this project's layers). The 5 a s / h
        term is the s x s attention scores (softmax output, dropout mask, dropout output). By default
        (Assumptions.attention_scores "recomputed") it is dropped: the model calls F.scaled_dot_product_attention
        with is_causal=True and no mask (model/gpt.py), which on CUDA runs a fused flash or memory-efficient kernel
        that keeps q, k, v, the output and a row's softmax statistics (4 a s b / t bytes, fp32: 0.02% of the rest at
        530B, left out) and recomputes the scores in the backward: s b h (10 + 24 / t). "stored" keeps the term
        (the unfused math kernel: an explicit mask, or a head dimension neither fused kernel takes).
        Full recompute (activation checkpointing of every block): a layer keeps only its input, 2 s b h, and one
        layer's full set is alive while it is recomputed (the working set). Each held micro-batch also keeps the
        stage's output (2 s b h, DeepSpeed's pipe buffer); the last stage adds its head once: final LayerNorm and
        head inputs 4 s b h and the fp32 logits 4 s b V / t. fp32 activations scale all of it by 2.
    pipeline buffers: the received activation and gradient, 2 x 2 s b h.
    DP reduce buffer: the transient bf16 copy of the gradients (BF16_Optimizer) or the ZeRO reduce bucket; it exists
        after the last backward, when the activations are gone, so the peak takes the larger of the two.
    framework allowance: CUDA context, NCCL's own buffers, allocator fragmentation (an assumption, see Assumptions).

Time of one iteration at global batch B
    A micro-batch slot of stage i (forward + backward, recompute included):
        compute      = FLOPs_i / (peak x matmul_efficiency); FLOPs_i = layers_i 96 b s h^2 (1 + s/(6h)) / t
                       (72 without recompute; Narayanan et al. 2021 eq. 3 per layer) + 6 b s h V / t on the last stage
                       (the logits, never recomputed). Summed over stages, micro-batches and DP this is exactly
                       training.metrics.flops_per_iteration.
        tensor_parallel = (4 + 2 if recompute) all-reduces of 2 s b h per layer (+1 for the vocab-parallel embedding
                       on the first stage, +1 for the head's input gradient on the last), a ring over t ranks.
        pipeline_p2p = 4 blocking transfers of 2 s b h / t (receive/send activation, receive/send gradient; 2 on the
                       first and last stage) and an all-gather over TP to rebuild each received tensor.
        gradient_accumulation (BF16_Optimizer) = 12 N_i bytes of HBM traffic (zero the bf16 grads, read them, read
                       and write the fp32 buffer).
    The 1F1B pipeline runs (m + p - 1) slots of the slowest stage: m slots of work and p - 1 of bubble, a bubble
    fraction of (p - 1) / m. Then, not overlapped, on stage 0 (which ends last and holds most parameters):
    the tied-embedding all-reduce (4 V h / t bytes, 2 ranks), the DP gradient reduction, the optimizer step
    (HBM: Adam reads and writes master, m, v and reads the gradient, 28 N_i / d, writes the weights, weight_bytes N_i
    / d, and BF16_Optimizer casts the buffer for the reduce and back and zeroes it, 16 N_i), and the ZeRO-1
    all-gather. Ring volumes: all-reduce 2 (n - 1) / n x bytes, all-gather and reduce-scatter (n - 1) / n x bytes,
    at the per-direction bandwidth of one GPU's link times comm_efficiency. Which link: DeepSpeed's topology puts TP
    ranks next to each other, DP ranks TP apart and pipeline stages TP x DP apart, so TP uses NVLink when t <= GPUs
    per node, DP when t d <= GPUs per node, p2p when the whole pipeline fits in a node; otherwise InfiniBand, one
    HCA per GPU (for the 530B layout: TP on NVLink, DP and p2p on InfiniBand).
    TFLOP/s per GPU = training.metrics.flops_per_iteration / (seconds x GPUs) (recompute counted, as the paper does);
    "mfu" is that over the peak (the definition the trainer logs), "mfu_without_recompute" uses the 72 factor.

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
        flops: {first_batch, full_batch, first_batch_recompute, full_batch_recompute, first_batch_no_recompute,
            full_batch_no_recompute} (the plain keys follow the config's activation_checkpointing),
        first_batch, full_batch: IterationTime fields (seconds; micro_batch: MicroBatchTime of the slowest stage),
        training: TrainingTime fields, measured: {iteration_seconds, tflops_per_gpu, mfu, mfu_without_recompute,
            predicted_over_measured} | null}]
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
from training.metrics import flops_per_iteration, layer_forward_flops_per_token, tflops_per_gpu
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
    partitioned = bool(ds.get("pipeline", {}).get("pipe_partitioned", True))
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


def layer_activation_bytes(seq_length: int, micro_batch: int, hidden: int, heads: int, tensor_parallel_size: int,
                           sequence_parallel: bool = False, attention_scores_stored: bool = False) -> float:
    """Bytes one transformer layer stores for its backward, per micro-batch (Korthikanti et al. 2022, eq. 2-4),
    by default without the s x s scores, which the fused kernel the model runs does not keep (module docstring)."""
    sbh = seq_length * micro_batch * hidden
    # softmax output, dropout mask and dropout output: 5 a s^2 b bytes, none with a fused attention kernel
    attention_scores = 5.0 * heads * seq_length / hidden if attention_scores_stored else 0.0
    if sequence_parallel:
        return sbh * (34.0 + attention_scores) / tensor_parallel_size
    return sbh * (10.0 + 24.0 / tensor_parallel_size + attention_scores / tensor_parallel_size)


def micro_batches_held(stage: int, pipeline_parallel_size: int, micro_batches: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at once: min(p - stage, m)."""
    return min(pipeline_parallel_size - stage, micro_batches)


@dataclass(frozen=True)
class StageActivations:
    per_micro_batch_recompute: int
    """Held per micro-batch with activation checkpointing: the layer inputs and the stage output."""
    per_micro_batch_no_recompute: int
    """Held per micro-batch without it: every layer's Korthikanti set and the stage output."""
    working_set_recompute: int
    """Alive once with checkpointing: one layer recomputed for its backward (+ the head on the last stage)."""
    working_set_no_recompute: int
    """Alive once without it: the head on the last stage."""


def stage_activations(model: ModelConfig, count: StageCount, micro_batch: int, tensor_parallel_size: int,
                      attention_scores_stored: bool = False) -> StageActivations:
    s, b, h, t = model.seq_length, micro_batch, model.hidden_size, tensor_parallel_size
    scale = DTYPE_BYTES[model.precision] / 2  # the formulas count 16-bit activations
    hidden_tensor = hidden_tensor_bytes(model, b)
    layer = layer_activation_bytes(s, b, h, model.num_attention_heads, t,
                                   attention_scores_stored=attention_scores_stored) * scale
    layers = transformer_layers(count)
    first_stage_mask = s * b * h if "PositionEmbedding" in count.layers and model.hidden_dropout > 0 else 0
    # the last stage's head: final LayerNorm and head inputs, and the fp32 logits of this rank's vocabulary slice
    head = 2 * hidden_tensor + 4 * s * b * model.padded_vocab_size(t) / t if holds_head(count) else 0
    return StageActivations(
        per_micro_batch_recompute=int(layers * hidden_tensor + hidden_tensor + first_stage_mask),
        per_micro_batch_no_recompute=int(layers * layer + hidden_tensor + first_stage_mask),
        working_set_recompute=int((layer if layers else 0) + head), working_set_no_recompute=int(head))


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
    activations_per_micro_batch_recompute: int
    activations_per_micro_batch_no_recompute: int
    activations_recompute: int
    """held x per micro-batch + working set, with activation checkpointing."""
    activations_no_recompute: int
    """The same without it."""
    activations: int
    """The one in force (model.recompute == "full")."""
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
    act = stage_activations(model, count, config.micro_batch_size, tp, assumptions.attention_scores_stored)
    held = micro_batches_held(count.stage, pp, micro_batches)
    with_recompute = held * act.per_micro_batch_recompute + act.working_set_recompute
    without = held * act.per_micro_batch_no_recompute + act.working_set_no_recompute
    hidden_tensor = hidden_tensor_bytes(model, config.micro_batch_size)
    reduce_buffer = (layout.communication_bytes * n if layout.optimizer == "BF16_Optimizer"
                     else layout.reduce_bucket_elements * layout.grad_bytes)
    return StageMemory(
        stage=count.stage, parameters=n, weights=layout.weight_bytes * n, gradients=layout.grad_bytes * n,
        gradient_accumulation=layout.accumulation_bytes * n, gradient_partition=layout.partition_grad_bytes * n // d,
        master_weights=4 * n // d, adam_states=8 * n // d, micro_batches_held=held,
        activations_per_micro_batch_recompute=act.per_micro_batch_recompute,
        activations_per_micro_batch_no_recompute=act.per_micro_batch_no_recompute,
        activations_recompute=with_recompute, activations_no_recompute=without,
        activations=with_recompute if model.recompute == "full" else without,
        pipeline_buffers=2 * hidden_tensor if pp > 1 else 0, reduce_buffer=reduce_buffer if d > 1 else 0,
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
                                recompute: bool) -> float:
    """FLOPs of one micro-batch's forward and backward on one GPU of the stage (module docstring)."""
    s, h, t = model.seq_length, model.hidden_size, tensor_parallel_size
    passes = 4.0 if recompute else 3.0
    layers = passes * micro_batch * s * layer_forward_flops_per_token(model) * transformer_layers(count)
    logits = 6.0 * micro_batch * s * h * model.padded_vocab_size(t) if holds_head(count) else 0.0
    return (layers + logits) / t


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


def micro_batch_time(config: RunConfig, layout: DeepSpeedLayout, count: StageCount, rates: Rates) -> MicroBatchTime:
    model, b = config.model, config.micro_batch_size
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    recompute = model.recompute == "full"
    hidden_tensor = hidden_tensor_bytes(model, b)
    all_reduces = transformer_layers(count) * (6 if recompute else 4)
    all_reduces += ("PositionEmbedding" in count.layers) + holds_head(count)
    transfers = 0 if pp == 1 else 2 * ((count.stage > 0) + (count.stage < pp - 1))
    piece = hidden_tensor / tp if layout.pipe_partitioned else hidden_tensor
    rebuild = ring_all_gather_seconds(hidden_tensor, tp, rates.tensor_parallel_bytes_per_s) if layout.pipe_partitioned \
        else 0.0
    accumulation_bytes = 12 * count.parameters_per_tp_rank if layout.optimizer == "BF16_Optimizer" else 0
    return MicroBatchTime(
        stage=count.stage,
        compute=stage_flops_per_micro_batch(model, count, b, tp, recompute) / rates.flops_per_s,
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
    seconds: float
    flops: float
    """training.metrics.flops_per_iteration (recompute as configured)."""
    tflops_per_gpu: float
    mfu: float
    """tflops_per_gpu / peak (the trainer's definition)."""


@dataclass(frozen=True)
class AfterPipeline:
    """The non-overlapped work after the last backward, on stage 0 (ends last, holds the most parameters)."""

    tied_embedding_reduce: float
    data_parallel_reduce: float
    optimizer_step: float
    zero_allgather: float


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
        zero_allgather=ring_all_gather_seconds(layout.weight_bytes * n, d, rates.data_parallel_bytes_per_s))


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
    flops = flops_per_iteration(config.model, global_batch, tp)
    achieved = tflops_per_gpu(flops, seconds, tp * pp * data_parallel_size)
    return IterationTime(global_batch=global_batch, micro_batches=m, bubble_fraction=(pp - 1) / m,
                         micro_batch=slowest, **parts, seconds=seconds, flops=flops, tflops_per_gpu=achieved,
                         mfu=achieved / hardware.peak_tflops)


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
    model, tp = config.model, config.parallelism.tensor_parallel_size
    figures = {}
    for name, batch in (("first_batch", first), ("full_batch", full)):
        figures[name] = flops_per_iteration(model, batch, tp)
        figures[f"{name}_recompute"] = flops_per_iteration(model, batch, tp, recompute=True)
        figures[f"{name}_no_recompute"] = flops_per_iteration(model, batch, tp, recompute=False)
    return figures


def measured_throughput(config: RunConfig, gpus: int, iteration_seconds: float, hardware: Hardware,
                        predicted_seconds: float | None = None) -> dict[str, float]:
    """A measured full-batch iteration: TFLOP/s per GPU (recompute counted) and MFU, as the trainer logs them."""
    if iteration_seconds <= 0:
        raise ValueError(f"--iteration-seconds must be positive, got {iteration_seconds}")
    tp, batch = config.parallelism.tensor_parallel_size, config.global_batch_size
    achieved = tflops_per_gpu(flops_per_iteration(config.model, batch, tp), iteration_seconds, gpus)
    without = tflops_per_gpu(flops_per_iteration(config.model, batch, tp, recompute=False), iteration_seconds, gpus)
    figures = {"iteration_seconds": iteration_seconds, "tflops_per_gpu": achieved,
               "mfu": achieved / hardware.peak_tflops, "mfu_without_recompute": without / hardware.peak_tflops}
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


def format_header(config: RunConfig, hardware: Hardware, assumptions: Assumptions, parameters: ParameterCounts
                  ) -> str:
    model, layout = config.model, deepspeed_layout(config)
    tp = config.parallelism.tensor_parallel_size
    prose = [
        f"{config.source}: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
        f"seq {model.seq_length}, vocab {model.padded_vocab_size(tp):,} (padded); {model.precision}, recompute "
        f"{model.recompute}; TP {tp} x PP "
        f"{config.parallelism.pipeline_parallel_size}, micro-batch {config.micro_batch_size}",
        f"DeepSpeed: {layout.optimizer} (ZeRO-1), DP gradient reduction in {8 * layout.communication_bytes}-bit, "
        f"pipe_partitioned {layout.pipe_partitioned}",
        f"GPU {hardware.name}: {hardware.peak_tflops:g} TFLOP/s, {hardware.memory_gib:g} GiB, HBM "
        f"{hardware.hbm_gbytes_per_s:g} GB/s, NVLink {hardware.nvlink_gbytes_per_s:g} GB/s, InfiniBand "
        f"{hardware.ib_gbits_per_s:g} Gb/s per GPU, {hardware.gpus_per_node} per node",
        f"assumed: matmul efficiency {assumptions.matmul_efficiency:g}, link efficiency "
        f"{assumptions.comm_efficiency:g}, HBM efficiency {assumptions.hbm_efficiency:g}, framework allowance "
        f"{assumptions.framework_gib:g} GiB, attention scores {assumptions.attention_scores} "
        f"({'Korthikanti et al.' if assumptions.attention_scores_stored else 'fused SDPA kernel'})",
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
    ("activations, per micro-batch, recompute", "activations_per_micro_batch_recompute"),
    ("  ..., without recompute", "activations_per_micro_batch_no_recompute"),
    ("activations, all held + working set, recompute", "activations_recompute"),
    ("  ..., without recompute", "activations_no_recompute"),
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
             "tied_embedding_reduce", "data_parallel_reduce", "optimizer_step", "zero_allgather")


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
    lines.append(f"  {'TFLOP/s per GPU (MFU)':<30}" + "".join(
        f"{t.tflops_per_gpu:>11.1f} ({t.mfu:>5.1%})" for t in columns))
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
        lines.append(_wrap(f"FLOPs per iteration (recompute / without): batch {plan.first_batch.global_batch}: "
                           f"{f['first_batch_recompute']:.4g} / {f['first_batch_no_recompute']:.4g}; batch "
                           f"{plan.full_batch.global_batch}: {f['full_batch_recompute']:.4g} / "
                           f"{f['full_batch_no_recompute']:.4g}", "  "))
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
            f"per GPU, MFU {measured['mfu']:.1%} ({measured['mfu_without_recompute']:.1%} without recompute)")
    if "predicted_over_measured" in measured:
        line += f"; predicted / measured time {measured['predicted_over_measured']:.3f}"
    return _wrap(line, "  ")


def format_comparison(plans: list[Plan]) -> str:
    """One line per node count: the figures to compare cluster sizes by."""
    lines = [f"{'nodes':>6} {'GPUs':>6} {'DP':>4} {'m':>5} {'bubble':>7} {'iter s':>8} {'TFLOP/s':>8} {'MFU':>6} "
             f"{'days':>6} {'ramp h':>7} {'peak GiB':>9} {'margin':>7}"]
    for p in plans:
        if not p.ok:
            lines.append(_wrap(f"{p.nodes:>6} {p.gpus:>6}  impossible: {p.errors[0]}", ""))
            continue
        t, w = p.full_batch, p.peak_memory()
        lines.append(f"{p.nodes:>6} {p.gpus:>6} {p.data_parallel_size:>4} {t.micro_batches:>5} "
                     f"{t.bubble_fraction:>7.3f} {t.seconds:>8.2f} {t.tflops_per_gpu:>8.1f} {t.mfu:>6.1%} "
                     f"{p.training.seconds / 86400:>6.2f} {p.training.ramp_seconds / 3600:>7.1f} "
                     f"{w.total / GIB:>9.2f} {w.margin / GIB:>7.2f}")
    return "\n".join(lines)
