"""The hardware and the assumptions a plan rests on, and what DeepSpeed allocates for the config.

A GPU preset (``GPU_PRESETS``: data-sheet peaks, memory and links), the ``Assumptions`` no data sheet gives
(efficiencies, a framework allowance, whether attention stores its scores), and ``DeepSpeedLayout``: which optimizer
wrapper DeepSpeed 0.19.8 picks for the run config and the bytes per parameter it holds.

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
"""

from __future__ import annotations

from dataclasses import dataclass

from common.dtypes import BYTES_PER_ELEMENT as DTYPE_BYTES
from common.dtypes import precision_name
from runconfig.run import RunConfig

GIB = 2**30
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
    fp32_tflops: float = 0.0
    """Dense fp32 peak on the CUDA cores, TFLOP/s (data sheet; not TF32): Muon's Newton-Schulz runs there
    (planner/muon.py). 0: unknown, taken as peak_tflops x 67 / 989 (the H100's ratio)."""

    @property
    def fp32_peak_tflops(self) -> float:
        return self.fp32_tflops or self.peak_tflops * 67.0 / 989.0

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "memory_gib", "hbm_gbytes_per_s", "nvlink_gbytes_per_s", "ib_gbits_per_s",
                     "gpus_per_node"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {name} must be positive, got {getattr(self, name)!r}")


GPU_PRESETS: dict[str, Hardware] = {
    # NVIDIA A100 data sheet (SXM 80GB): 312 TFLOP/s bf16 dense, 2039 GB/s HBM2e, NVLink 3 600 GB/s;
    # DGX A100: 8 x 200 Gb/s HDR ConnectX-6, one per GPU (the MT-NLG cluster, Smith et al. 2022).
    # fp32 on the CUDA cores (no TF32): A100 19.5 TFLOP/s, H100 / H200 / H800 SXM 67 TFLOP/s (data sheets).
    "a100-80gb": Hardware("a100-80gb", 312.0, 80.0, 2039.0, 600.0, 200.0, fp32_tflops=19.5),
    # A100 SXM 40GB: the same compute and links, 1555 GB/s HBM2.
    "a100-40gb": Hardware("a100-40gb", 312.0, 40.0, 1555.0, 600.0, 200.0, fp32_tflops=19.5),
    # H100 SXM data sheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 900 GB/s; DGX H100: 8 x 400 Gb/s NDR.
    "h100-80gb": Hardware("h100-80gb", 989.0, 80.0, 3350.0, 900.0, 400.0, fp32_tflops=67.0),
    # H200 SXM data sheet: H100 compute, 141 GB HBM3e at 4.8 TB/s; DGX H200 keeps NVLink 4 and 8 x 400 Gb/s NDR.
    "h200": Hardware("h200", 989.0, 141.0, 4800.0, 900.0, 400.0, fp32_tflops=67.0),
    # H800 SXM, the export version of the H100 SXM that trained DeepSeek-V3: H100's compute (989 TFLOP/s bf16 dense)
    # and memory (80 GB HBM3, 3.35 TB/s), NVLink cut to 400 GB/s (both directions; the data sheet's 400 is from
    # memory). Links as the DeepSeek-V3 report (arXiv:2412.19437, sections 3.1, 3.2.2; recalled) gives them: 8 GPUs per node
    # on NVLink and NVSwitch, nodes on InfiniBand at 50 GB/s per GPU (= 400 Gb/s, one NDR HCA per GPU, 8 per node),
    # where the report also says NVLink sustains 160 GB/s, roughly 3.2 times IB: 80% of 200 GB/s each way, what
    # comm_efficiency 0.8 assumes here too.
    "h800": Hardware("h800", 989.0, 80.0, 3350.0, 400.0, 400.0, fp32_tflops=67.0),
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


def deepspeed_layout(config: RunConfig) -> DeepSpeedLayout:
    """Which optimizer wrapper DeepSpeed 0.19.8 picks for this config, and what it holds (module docstring)."""
    ds = config.deepspeed
    zero = ds.get("zero_optimization", {})
    if zero.get("stage", 0) != 1:
        raise ValueError(f"{config.source}: zero_optimization.stage is {zero.get('stage', 0)}; the planner models "
                         f"ZeRO stage 1 (the recipe's): set zero_optimization.stage=1")
    precision = config.model.precision
    accumulation = precision_name(ds.get("data_types", {}).get("grad_accum_dtype") or precision)
    communication = precision_name(ds.get("communication_data_type") or precision)
    weight = DTYPE_BYTES[precision]
    # with SP the engine turns pipe_partitioned off (each TP rank sends its own sequence shard: training/engine.py),
    # and under DualPipeV, which sends whole tensors
    partitioned = (bool(ds.get("pipeline", {}).get("pipe_partitioned", True)) and not config.parallelism.sequence_parallel
                   and config.parallelism.pipeline_schedule == "1f1b")
    if precision == "bf16" and accumulation == "fp32":
        return DeepSpeedLayout("BF16_Optimizer", weight, weight, 4, 0, DTYPE_BYTES[communication], 0, partitioned)
    bucket = int(zero.get("reduce_bucket_size", DEEPSPEED_BUCKET_ELEMENTS))
    return DeepSpeedLayout("DeepSpeedZeroOptimizer", weight, weight, 0, 4, DTYPE_BYTES[communication], bucket,
                           partitioned)
