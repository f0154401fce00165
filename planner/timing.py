"""Time of one iteration: compute, tensor-parallel and pipeline communication, the bubble, and what follows it.

Everything below is per GPU and per optimizer step unless named otherwise. t, p, d: tensor-, pipeline-, data-parallel
sizes; s sequence length, b micro-batch, h hidden, a heads, V padded vocabulary; N_i the parameters of one TP rank of
pipeline stage i (counted on the meta device by model/summary.py); m = global batch / (b d) micro-batches per pipeline.

    pipeline buffers: the received activation and gradient, 2 x e s b h (x 1/t with SP).
    DP reduce buffer: the transient bf16 copy of the gradients (BF16_Optimizer) or the ZeRO reduce bucket; it exists
        after the last backward, when the activations are gone, so the peak takes the larger of the two.
    framework allowance: CUDA context, NCCL's own buffers, allocator fragmentation (an assumption, see Assumptions).

Time of one iteration at global batch B
    A micro-batch slot of stage i (forward + backward, recompute included):
        compute      = FLOPs_i / (peak x matmul_efficiency); FLOPs_i = b s (3 layers_i F_layer + r_i F_recompute +
                       6 h V [last stage]) / t, F_layer = model.flops.layer_forward_flops_per_token (24 h^2 +
                       4 s h for GPT: Narayanan et al. 2021 eq. 3 per layer), r_i the stage's recomputing blocks
                       and F_recompute = F_layer ("full": one more forward), 4 s h ("selective": the attention
                       core's forward), 0 ("none"); on the last stage with model.mtp also its D depths, 3 x
                       sum_k (F_block(L + k) + 4 h^2 + 2 h V) and each recomputing depth block's own rerun
                       (model/flops.py). Summed over stages, micro-batches and DP this is exactly
                       model.flops.flops_per_iteration (hardware FLOPs).
        tensor_parallel = 4 all-reduces of e s b h per block (2 forward, 2 backward), + 2 per fully recomputed
                       block (its forward's, rerun in the backward; selective reruns none), +1 for the vocab-
                       parallel embedding on the first stage, +1 for the head's input gradient on the last; a ring
                       over t ranks. With SP each all-reduce becomes an all-gather and a reduce-scatter (the same
                       ring volume), and each column-parallel layer, which keeps its input's sequence shard, all-
                       gathers it again in the backward for its weight gradient: + half an all-reduce's volume for
                       each of the 2 per block and for the head. model.mtp's blocks count as blocks, and each depth
                       adds 2 (its embedding lookup, its logits' input gradient) and, with SP, half of one.
        pipeline_p2p = 4 blocking transfers of e s b h / t (receive/send activation, receive/send gradient; 2 on the
                       first and last stage) and, with pipe_partitioned and no SP, an all-gather over TP to rebuild
                       each received tensor; with SP the shard is the tensor, nothing to rebuild.
        expert_all_to_all (model.moe only) = (4 + 2 if fully recomputed) all-to-alls of e k' s b h (EP - 1) / EP
                       bytes per sparse block, at NVLink or, when an EP group spans nodes, InfiniBand
                       (planner/experts.py, which also splits the DP reduction, the step and the all-gather of the
                       experts over d / EP ranks).
        gradient_accumulation (BF16_Optimizer) = 12 N_i bytes of HBM traffic (zero the bf16 grads, read them, read
                       and write the fp32 buffer).
    The 1F1B pipeline runs (m + p - 1) slots of the slowest stage: m slots of work and p - 1 of bubble, a bubble
    fraction of (p - 1) / m. Under DualPipeV a rank holds two stages (its p2p counts both stages' transfers, whole
    tensors); its bubble is the replay of its instruction stream (planner/pipeline_schedule.py, pipeline_bubble)
    with the slowest rank's slot split into F and B, and over the two stages, by their FLOPs.
    Then, not overlapped, on stage 0 (which ends last and holds most parameters): the tied-embedding all-reduce
    (4 V h / t bytes, 2 ranks; none under DualPipeV, whose rank 0 holds both ends), with SP the TP all-reduce of the replicated
    parameters' partial gradients (norms, row-parallel biases, the position table; fp32 under BF16_Optimizer), the
    DP gradient reduction, the optimizer step
    (HBM: Adam reads and writes master, m, v and reads the gradient, 28 N_i / d, writes the weights, weight_bytes N_i
    / d, and BF16_Optimizer casts the buffer for the reduce and back and zeroes it, 16 N_i), and the ZeRO-1
    all-gather. Ring volumes: all-reduce 2 (n - 1) / n x bytes, all-gather and reduce-scatter (n - 1) / n x bytes,
    at the per-direction bandwidth of one GPU's link times comm_efficiency. Which link: DeepSpeed's topology puts TP
    ranks next to each other, DP ranks TP apart and pipeline stages TP x DP apart, so TP uses NVLink when t <= GPUs
    per node, DP when t d <= GPUs per node, p2p when the whole pipeline fits in a node; otherwise InfiniBand, one
    HCA per GPU (for the 530B layout: TP on NVLink, DP and p2p on InfiniBand).
    TFLOP/s per GPU = hardware FLOPs (model.flops.flops_per_iteration, the configured recompute counted, as the
    MT-NLG paper counts) / (seconds x GPUs), "hfu" that over the peak; "mfu" = model FLOPs (model.flops
    .model_flops_per_iteration: 3 forwards' worth, no recompute, PaLM's definition) / (seconds x GPUs x peak). The
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from model.config import ModelConfig
from model.flops import (
    block_recompute_flops_per_token,
    flops_per_iteration,
    layer_forward_flops_per_token,
    model_flops_per_iteration,
    mtp_forward_flops_per_token,
    recompute_flops_per_token,
    tflops_per_gpu,
)
from model.summary import StageCount
from planner.experts import (
    all_to_all_bytes,
    all_to_alls_per_micro_batch,
    expert_group_spans_nodes,
    expert_parameters_of,
)
from planner.hardware import DTYPE_BYTES, Assumptions, DeepSpeedLayout, Hardware
from planner.memory import (
    hidden_tensor_bytes,
    holds_head,
    mtp_blocks,
    recomputing_block_numbers,
    recomputing_blocks,
    transformer_layers,
)
from planner.muon import muon_stage
from planner.pipeline_schedule import pipeline_bubble
from runconfig.optimizer import muon_config
from runconfig.run import RunConfig


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
    expert_parallel_bytes_per_s: float = 0.0
    """The MoE all-to-all's: NVLink, InfiniBand if an EP group spans nodes (planner.experts)."""
    context_parallel_bytes_per_s: float = 0.0
    """Ulysses' all-to-alls: NVLink if a CP group fits in a node (TP x CP <= GPUs per node: CP peers are TP apart)."""
    fp32_flops_per_s: float = 0.0
    """fp32 matmuls on the CUDA cores (Muon's Newton-Schulz: planner/muon.py)."""


def sustained_rates(hardware: Hardware, assumptions: Assumptions, tensor_parallel_size: int,
                    pipeline_parallel_size: int, data_parallel_size: int, expert_parallel_size: int = 1,
                    context_parallel_size: int = 1) -> Rates:
    """``data_parallel_size``: DeepSpeed's data axis (DP x CP), whose groups the gradients are reduced over."""
    nvlink = hardware.nvlink_gbytes_per_s / 2 * 1e9 * assumptions.comm_efficiency
    infiniband = hardware.ib_gbits_per_s / 8 * 1e9 * assumptions.comm_efficiency
    node = hardware.gpus_per_node
    tp, dp = tensor_parallel_size, data_parallel_size

    def link(ranks_spanned: int) -> float:
        return nvlink if ranks_spanned <= node else infiniband

    return Rates(flops_per_s=hardware.peak_tflops * 1e12 * assumptions.matmul_efficiency,
                 tensor_parallel_bytes_per_s=link(tp), pipeline_bytes_per_s=link(tp * dp * pipeline_parallel_size),
                 data_parallel_bytes_per_s=link(tp * dp),
                 hbm_bytes_per_s=hardware.hbm_gbytes_per_s * 1e9 * assumptions.hbm_efficiency,
                 expert_parallel_bytes_per_s=infiniband if expert_group_spans_nodes(
                     tp, pipeline_parallel_size, dp, expert_parallel_size, node) else nvlink,
                 context_parallel_bytes_per_s=link(tp * context_parallel_size),
                 fp32_flops_per_s=hardware.fp32_peak_tflops * 1e12 * assumptions.matmul_efficiency)


def stage_flops_per_micro_batch(model: ModelConfig, count: StageCount, micro_batch: int, tensor_parallel_size: int,
                                recompute: str | None = None, pipeline_parallel_size: int | None = None) -> float:
    """Hardware FLOPs of one micro-batch's forward and backward on one GPU of the stage, the forwards that
    ``recompute`` (default: the config's mode) reruns included (module docstring)."""
    recompute = model.recompute if recompute is None else recompute
    s, h, t, trunk = model.seq_length, model.hidden_size, tensor_parallel_size, model.num_layers
    layers = 3.0 * layer_forward_flops_per_token(model) * transformer_layers(count)
    rerun = recomputing_block_numbers(model, count, recompute, pipeline_parallel_size)
    layers += recompute_flops_per_token(model, recompute) * sum(n <= trunk for n in rerun)
    if mtp_blocks(model, count):  # model.mtp's depths (last stage): blocks, eh_proj and logits; each block's rerun
        layers += 3.0 * mtp_forward_flops_per_token(model, t)
        layers += sum(block_recompute_flops_per_token(model, n, recompute) for n in rerun if n > trunk)
    logits = 6.0 * h * model.padded_vocab_size(t) if holds_head(count) else 0.0
    return micro_batch * s * (layers + logits) / t


def forward_share(model: ModelConfig, count: StageCount, tensor_parallel_size: int,
                  pipeline_parallel_size: int | None = None) -> float:
    """The forward's part of a micro-batch's FLOPs on this stage, the recompute counted in the backward (1/3 without
    recompute, 1/4 with full): how a slot is split into F and B for the schedule replay."""
    forward = stage_flops_per_micro_batch(model, count, 1, tensor_parallel_size, "none", pipeline_parallel_size) / 3
    return forward / stage_flops_per_micro_batch(model, count, 1, tensor_parallel_size,
                                                 pipeline_parallel_size=pipeline_parallel_size)


@dataclass(frozen=True)
class MicroBatchTime:
    """One micro-batch slot (forward + backward) of one stage, seconds."""

    stage: int
    compute: float
    tensor_parallel: float
    pipeline_p2p: float
    gradient_accumulation: float
    expert_all_to_all: float = 0.0
    """A Mixture-of-Experts model's dispatch and combine over the EP group (planner.experts); 0 for a dense one."""
    context_all_to_all: float = 0.0
    """Ulysses' all-to-alls over the CP group (context_all_to_all_bytes); 0 at CP 1."""
    total: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.compute + self.tensor_parallel + self.pipeline_p2p
                           + self.gradient_accumulation + self.expert_all_to_all + self.context_all_to_all)


def tensor_parallel_all_reduces(model: ModelConfig, count: StageCount, sequence_parallel: bool,
                                pipeline_parallel_size: int | None = None) -> float:
    """All-reduces of one (b, s, h) tensor over TP per micro-batch on this stage; with sequence parallelism the same
    ring volume in all-gathers and reduce-scatters, one of each per all-reduce (module docstring)."""
    blocks, depths = transformer_layers(count) + mtp_blocks(model, count), mtp_blocks(model, count)
    rerun = recomputing_blocks(model, count, "full", pipeline_parallel_size) if model.recompute == "full" else 0
    # each column-parallel layer keeps its input's sequence shard: its backward all-gathers it again (half an
    # all-reduce's volume; 2 per block, 1 for the head, 1 for each model.mtp depth's pass through it)
    heads = holds_head(count) + depths
    regather = (blocks + 0.5 * heads) if sequence_parallel else 0.0
    # model.mtp: each depth's embedding lookup (vocab-parallel: one all-reduce) and its head's input gradient
    return 4.0 * blocks + 2.0 * rerun + regather + (count.stage == 0) + depths + heads


def context_all_to_all_bytes(model: ModelConfig, micro_batch: int, tensor_parallel_size: int,
                             context_parallel_size: int) -> float:
    """What one block's Ulysses all-to-alls send per GPU in one forward: q, k and v (the QKV rows, q_rows / t) out and
    the attention output (a / t) back, e (s / CP) b per row, each keeping 1 / CP of it home: (CP - 1) / CP. The
    backward sends the gradients the same way."""
    cp = context_parallel_size
    if cp <= 1:
        return 0.0
    rows = (model.qkv_size + model.attention_size) / tensor_parallel_size
    return DTYPE_BYTES[model.precision] * model.seq_length / cp * micro_batch * rows * (cp - 1) / cp


def context_all_to_alls(model: ModelConfig, count: StageCount, pipeline_parallel_size: int | None) -> int:
    """Forwards' worth of Ulysses all-to-alls per micro-batch on this stage: 2 per block (forward and backward), 3
    for a fully recomputed block (its forward runs again; selective recomputation reruns the core between them)."""
    rerun = recomputing_blocks(model, count, "full", pipeline_parallel_size) if model.recompute == "full" else 0
    return 2 * transformer_layers(count) + rerun


def micro_batch_time(config: RunConfig, layout: DeepSpeedLayout, count: StageCount, rates: Rates) -> MicroBatchTime:
    model, b = config.model, config.micro_batch_size
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    cp = config.parallelism.context_parallel_size
    sequence_parallel = config.parallelism.sequence_parallel and tp > 1
    hidden_tensor = hidden_tensor_bytes(model, b, cp)
    all_reduces = tensor_parallel_all_reduces(model, count, sequence_parallel, pp)
    # per micro-batch, each stage boundary of the rank receives and sends an activation and a gradient; a DualPipeV
    # rank has both of its stages' boundaries (the last rank turns micro-batches around without a transfer)
    per_boundary = 4 if count.phases else 2
    transfers = 0 if pp == 1 else per_boundary * ((count.stage > 0) + (count.stage < pp - 1))
    # with SP each rank sends its own sequence shard (pipe_partitioned is off); else 1/t and a TP all-gather when
    # DeepSpeed partitions the transfer, the whole tensor when it does not
    piece = hidden_tensor / tp if sequence_parallel or layout.pipe_partitioned else hidden_tensor
    rebuild = ring_all_gather_seconds(hidden_tensor, tp, rates.tensor_parallel_bytes_per_s) \
        if layout.pipe_partitioned and not sequence_parallel else 0.0
    accumulation_bytes = 12 * count.parameters_per_tp_rank if layout.optimizer == "BF16_Optimizer" else 0
    return MicroBatchTime(
        stage=count.stage,
        compute=stage_flops_per_micro_batch(model, count, b, tp, pipeline_parallel_size=pp) / cp / rates.flops_per_s,
        tensor_parallel=all_reduces * ring_all_reduce_seconds(hidden_tensor, tp, rates.tensor_parallel_bytes_per_s),
        pipeline_p2p=transfers * piece / rates.pipeline_bytes_per_s + transfers / 2 * rebuild,
        gradient_accumulation=accumulation_bytes / rates.hbm_bytes_per_s,
        expert_all_to_all=all_to_alls_per_micro_batch(model, count, pp) * all_to_all_seconds(
            model, b, config.parallelism.expert_parallel_size, rates, tp, sequence_parallel),
        context_all_to_all=context_all_to_alls(model, count, pp) * context_all_to_all_bytes(model, b, tp, cp)
        / (rates.context_parallel_bytes_per_s or 1.0))


def all_to_all_seconds(model: ModelConfig, micro_batch: int, expert_parallel_size: int, rates: Rates,
                       tensor_parallel_size: int = 1, sequence_parallel: bool = False) -> float:
    """One all-to-all of a sparse block's micro-batch: e k' T h (P - 1) / P bytes per GPU (T / t under the
    sequence-split dispatch) at the EP group's link (planner.experts); 0 at EP 1."""
    if expert_parallel_size <= 1:
        return 0.0
    return all_to_all_bytes(model, micro_batch, expert_parallel_size, tensor_parallel_size,
                            sequence_parallel) / rates.expert_parallel_bytes_per_s


@dataclass(frozen=True)
class IterationTime:
    """One optimizer step at one global batch, seconds by where they go, and the throughput that follows."""

    global_batch: int
    micro_batches: int
    """m, per pipeline."""
    schedule: str
    """The stream the pipeline runs for this batch: "1f1b", "dualpipev" or "vshape" (DualPipeV's stages below 2p)."""
    bubble_fraction: float
    """The bubble over the pipeline's compute, m slots: (p - 1) / m for 1F1B, the replay's otherwise."""
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
    """Adam's HBM traffic; with Muon its Newton-Schulz and the update's gathers too (planner/muon.py)."""
    zero_allgather: float
    sequence_parallel_reduce: float
    seconds: float
    flops: float
    """Hardware FLOPs: model.flops.flops_per_iteration (the configured recompute counted)."""
    model_flops: float
    """Model FLOPs: model.flops.model_flops_per_iteration (3 forwards' worth, no recompute)."""
    tflops_per_gpu: float
    """Hardware FLOPs per second per GPU (what the trainer logs as tflops_per_gpu)."""
    hfu: float
    """tflops_per_gpu / peak: hardware FLOPs utilisation."""
    mfu: float
    """Model FLOPs per second per GPU / peak: PaLM's MFU, no recompute counted (the trainer's "mfu"); for a
    Mixture-of-Experts model on the active parameters' FLOPs (model/flops.py), as Megatron-LM counts it."""
    expert_all_to_all: float = 0.0
    """m slots of the slowest stage's MoE all-to-all (planner.experts); 0 for a dense model."""
    context_all_to_all: float = 0.0
    """m slots of the slowest stage's Ulysses all-to-alls; 0 at CP 1."""


@dataclass(frozen=True)
class AfterPipeline:
    """The non-overlapped work after the last backward, on stage 0 (ends last, holds the most parameters)."""

    tied_embedding_reduce: float
    data_parallel_reduce: float
    optimizer_step: float
    """Adam's HBM traffic; with Muon its Newton-Schulz and the update's gathers too (planner/muon.py)."""
    zero_allgather: float
    sequence_parallel_reduce: float
    """With SP: the TP all-reduce of the replicated parameters' partial gradients (norms, row-parallel biases, the
    position table), once per step, before the DP reduction (DeepSpeed sums them as it sums tied weights); with
    model.qk_layernorm, SP or not, also the per-head q/k norms'."""


def sequence_parallel_parameters(model: ModelConfig, count: StageCount) -> int:
    """Parameters of a stage that every TP rank holds whole and, with SP, gets a partial gradient of."""
    norm = 2 * model.hidden_size if model.norm == "layernorm" else model.hidden_size
    biases = 2 * model.hidden_size if model.other_linears_have_bias else 0
    positions = model.max_position_embeddings * model.hidden_size if "PositionEmbedding" in count.layers else 0
    depths = mtp_blocks(model, count)  # model.mtp: each depth's block, its 3 norms and eh_proj (2 h^2), replicated
    mtp = depths * (2 * norm + biases + 3 * norm + 2 * model.hidden_size ** 2)
    return transformer_layers(count) * (2 * norm + biases) + positions + norm * holds_head(count) + mtp


def partial_gradient_parameters(model: ModelConfig, count: StageCount, sequence_parallel: bool) -> int:
    """Parameters of a stage whose gradients are partial sums over TP (model/layers.py): with SP every replicated
    one; the per-head q/k norms (2 x (2d | d) per block) with or without SP; a sparse block's router (E h) and
    shared-expert gate (h) with or without SP (model/moe.py: every TP rank combines only its partial outputs)."""
    head_norms = 0
    if model.qk_layernorm:
        head_norms = len(count.blocks) * 2 * (2 if model.norm == "layernorm" else 1) * model.head_dim
    if model.moe is not None:
        gate = model.hidden_size if model.moe.shared_expert_ffn_hidden_size and model.moe.shared_expert_gate else 0
        head_norms += sum(model.moe.is_sparse(n) for n in count.blocks) * (model.moe.num_experts * model.hidden_size
                                                                           + gate)
    return head_norms + (sequence_parallel_parameters(model, count) if sequence_parallel else 0)


def after_pipeline_time(config: RunConfig, layout: DeepSpeedLayout, first: StageCount, data_parallel_size: int,
                        rates: Rates) -> AfterPipeline:
    model, n, d = config.model, first.parameters_per_tp_rank, data_parallel_size
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    tied_grad_bytes = (4 if layout.optimizer == "BF16_Optimizer" else layout.grad_bytes) \
        * model.padded_vocab_size(tp) // tp * model.hidden_size
    # a Mixture-of-Experts model's experts are reduced, stepped and gathered over the expert-data-parallel group, d /
    # EP ranks with the DP group's link (planner.experts); the dense parameters over DP
    experts = expert_parameters_of(first)
    dense, edp = n - experts, d // config.parallelism.expert_parallel_size
    gradients, expert_gradients = layout.communication_bytes * dense, layout.communication_bytes * experts
    if layout.optimizer == "BF16_Optimizer":
        reduce = (ring_all_reduce_seconds(gradients, d, rates.data_parallel_bytes_per_s)
                  + ring_all_reduce_seconds(expert_gradients, edp, rates.data_parallel_bytes_per_s))
        full_buffer_passes = 16 * n  # cast to bf16 and back for the all-reduce (12), zero the buffer (4)
    else:
        reduce = (ring_all_gather_seconds(gradients, d, rates.data_parallel_bytes_per_s)
                  + ring_all_gather_seconds(expert_gradients, edp, rates.data_parallel_bytes_per_s))
        full_buffer_passes = layout.grad_bytes * n  # zero the .grad
    adam = (28 + layout.weight_bytes) * dense / d + (28 + layout.weight_bytes) * experts / edp
    muon = muon_config(config.deepspeed)
    muon_seconds = 0.0
    if muon is not None:  # planner/muon.py: Newton-Schulz in fp32, the update's gathers over DP and TP
        step = muon_stage(model, first, tp, config.parallelism.expert_parallel_size, muon.ns_steps)
        adam -= 8 * (step.dense_parameters / d + step.expert_parameters / edp)  # one state to read and write
        gathered = 4 * (step.dense_parameters / d + step.expert_parameters / edp) * tp
        muon_seconds = (step.flops_per_rank(d, edp) / rates.fp32_flops_per_s
                        + ring_all_gather_seconds(4 * step.dense_parameters, d, rates.data_parallel_bytes_per_s)
                        + ring_all_gather_seconds(4 * step.expert_parameters, edp, rates.data_parallel_bytes_per_s)
                        + ring_all_gather_seconds(gathered, tp, rates.tensor_parallel_bytes_per_s))
    # the tied embedding's two ends live on the first and the last stage (model.mtp's depths embed tokens there
    # too, tied or not); under DualPipeV both on rank 0
    tied_ranks = 2 if pp > 1 and (model.tie_word_embeddings or model.mtp) and not first.phases else 1
    return AfterPipeline(
        tied_embedding_reduce=ring_all_reduce_seconds(tied_grad_bytes, tied_ranks, rates.pipeline_bytes_per_s),
        data_parallel_reduce=reduce,
        optimizer_step=(adam + full_buffer_passes) / rates.hbm_bytes_per_s + muon_seconds,
        zero_allgather=(ring_all_gather_seconds(layout.weight_bytes * dense, d, rates.data_parallel_bytes_per_s)
                        + ring_all_gather_seconds(layout.weight_bytes * experts, edp,
                                                  rates.data_parallel_bytes_per_s)),
        sequence_parallel_reduce=ring_all_reduce_seconds(
            (4 if layout.optimizer == "BF16_Optimizer" else layout.grad_bytes)
            * partial_gradient_parameters(model, first, config.parallelism.sequence_parallel),
            tp, rates.tensor_parallel_bytes_per_s))


def iteration_time(config: RunConfig, layout: DeepSpeedLayout, counts: list[StageCount], data_parallel_size: int,
                   global_batch: int, hardware: Hardware, assumptions: Assumptions) -> IterationTime:
    """m slots of the slowest rank and the bubble (planner.pipeline_schedule.pipeline_bubble: (p - 1) slots for 1F1B,
    the replay of the schedule's instruction streams otherwise), then the DP reduction, the step and the
    all-gather."""
    from model.pipe_schedules import schedule_for  # imports DeepSpeed

    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    cp = config.parallelism.context_parallel_size
    m = global_batch // (config.micro_batch_size * data_parallel_size)
    schedule = schedule_for(config.parallelism.pipeline_schedule, m, pp)
    rates = sustained_rates(hardware, assumptions, tp, pp, data_parallel_size * cp,
                            config.parallelism.expert_parallel_size, cp)
    slowest_count, slowest = max(((c, micro_batch_time(config, layout, c, rates)) for c in counts),
                                 key=lambda pair: pair[1].total)
    after = after_pipeline_time(config, layout, counts[0], data_parallel_size * cp, rates)
    if schedule == "1f1b":
        bubble, bubble_fraction = (pp - 1) * slowest.total, (pp - 1) / m
    else:  # every rank costs the slowest one's slot, split into F and B, and over its two stages, by their FLOPs
        forward = slowest.total * forward_share(config.model, slowest_count, tp, pp)
        phases = [stage_flops_per_micro_batch(config.model, c, 1, tp, pipeline_parallel_size=pp)
                  for c in slowest_count.phases]
        shares = (phases[0] / sum(phases), phases[1] / sum(phases))
        bubble = pipeline_bubble("dualpipev", pp, m, forward, slowest.total - forward, shares)
        bubble_fraction = bubble / (m * slowest.total)
    parts = dict(compute=m * slowest.compute, tensor_parallel=m * slowest.tensor_parallel,
                 pipeline_p2p=m * slowest.pipeline_p2p, gradient_accumulation=m * slowest.gradient_accumulation,
                 bubble=bubble, **dataclasses.asdict(after))
    if config.model.moe is not None:
        parts["expert_all_to_all"] = m * slowest.expert_all_to_all
    if cp > 1:
        parts["context_all_to_all"] = m * slowest.context_all_to_all
    seconds = sum(parts.values())
    flops = flops_per_iteration(config.model, global_batch, tp, pipeline_parallel_size=pp)
    model_flops = model_flops_per_iteration(config.model, global_batch, tp)
    gpus = tp * pp * data_parallel_size * cp
    achieved = tflops_per_gpu(flops, seconds, gpus)
    return IterationTime(global_batch=global_batch, micro_batches=m, schedule=schedule,
                         bubble_fraction=bubble_fraction, micro_batch=slowest, **parts, seconds=seconds, flops=flops,
                         model_flops=model_flops, tflops_per_gpu=achieved, hfu=achieved / hardware.peak_tflops,
                         mfu=tflops_per_gpu(model_flops, seconds, gpus) / hardware.peak_tflops)
