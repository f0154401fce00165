"""Throughput accounting: FLOPs per iteration, TFLOP/s per GPU, hardware and model FLOPs utilisation.

Two counts of one iteration's FLOPs (B global batch in sequences, s sequence length, l layers, h hidden, V padded
vocabulary; GPT shape, Narayanan et al. 2021, eq. 3):
    model FLOPs, 3 forwards' worth (forward + backward), no recompute: what the model needs, PaLM's (Chowdhery et al.
        2022, appendix B) definition of MFU:       F_model = 72 B s l h^2 (1 + s / (6 h) + V / (12 l h))
    hardware FLOPs, what the GPUs compute: the model FLOPs plus the recomputed forwards of model.recompute, per block
        (its first recompute_num_layers blocks of each pipeline stage, or all):
        "full"      one more forward of the block: 24 h^2 + 4 s h per token (all blocks: 96 and V / (16 l h))
        "selective" the attention core's forward only, softmax(Q K^T) V: 4 s h per token
        "none"      nothing
TFLOP/s per GPU counts hardware FLOPs (the figure Megatron and the MT-NLG paper quote); "hfu" is that over the GPU's
peak, "mfu" the model FLOPs over the peak. The logits (2 h V per token forward) are never recomputed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from model.config import ModelConfig


@dataclass(frozen=True)
class GpuPeak:
    """One GPU product: its dense bf16 tensor-core peak and the rule that recognises its device name."""

    product: str
    dense_bf16_tflops: float
    """Without sparsity. NVIDIA's data sheets print the 2:4-sparsity figure with an asterisk; dense is half of it."""
    pattern: str
    """A regular expression searched in the upper-cased ``torch.cuda.get_device_name()``; word boundaries keep
    "L4" off "L40S" and "H200" off "GH200"."""
    datasheet: str


A100_DATASHEET = ("NVIDIA A100 Tensor Core GPU data sheet: BFLOAT16 Tensor Core 312 TFLOPS (624*), PCIe and SXM, "
                  "40 and 80 GB")

# Most specific first: the first pattern that matches names the product. An SXM part's device name carries no form
# factor ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"), so each family's SXM rule comes after its
# PCIe and NVL rules and takes the rest of the family.
GPU_PEAKS: tuple[GpuPeak, ...] = (
    # Blackwell: "NVIDIA B200"; the GPU of a GB200 superchip reports "NVIDIA GB200".
    GpuPeak("GB200", 2500.0, r"\bGB200\b", "NVIDIA GB200 NVL72 data sheet: FP16/BF16 Tensor Core 5 PFLOPS* per GPU"),
    GpuPeak("B200", 2250.0, r"\bB200\b", "NVIDIA HGX B200 data sheet: FP16/BF16 Tensor Core 4.5 PFLOPS* per GPU"),
    # Hopper. "NVIDIA GH200 480GB" (Grace Hopper superchip), "NVIDIA H200 NVL", "NVIDIA H200" (SXM), "NVIDIA H100 NVL",
    # "NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3" (SXM).
    GpuPeak("GH200", 989.0, r"\bGH200\b", "NVIDIA GH200 Grace Hopper Superchip data sheet: FP16/BF16 1,979 TFLOPS*"),
    GpuPeak("H200 NVL", 835.0, r"\bH200\b.*\bNVL\b", "NVIDIA H200 Tensor Core GPU data sheet: H200 NVL BFLOAT16 "
                                                      "1,671 TFLOPS*"),
    GpuPeak("H200 SXM", 989.0, r"\bH200\b", "NVIDIA H200 Tensor Core GPU data sheet: H200 SXM BFLOAT16 1,979 TFLOPS*"),
    GpuPeak("H100 NVL", 835.0, r"\bH100\b.*\bNVL\b", "NVIDIA H100 Tensor Core GPU data sheet: H100 NVL BFLOAT16 "
                                                      "1,671 TFLOPS* per GPU"),
    GpuPeak("H100 PCIe", 756.0, r"\bH100\b.*\bPCIE\b", "NVIDIA H100 Tensor Core GPU data sheet: H100 PCIe BFLOAT16 "
                                                        "1,513 TFLOPS*"),
    GpuPeak("H100 SXM", 989.0, r"\bH100\b", "NVIDIA H100 Tensor Core GPU data sheet: H100 SXM BFLOAT16 1,979 TFLOPS*"),
    # H800 / A800: the export variants of H100 / A100, with their compute (narrower NVLink).
    GpuPeak("H800 PCIe", 756.0, r"\bH800\b.*\bPCIE\b", "NVIDIA H800 data sheet: H800 PCIe BF16 1,513 TFLOPS*"),
    GpuPeak("H800 SXM", 989.0, r"\bH800\b", "NVIDIA H800 data sheet: H800 SXM BF16 1,979 TFLOPS*"),
    # Ampere: "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB".
    GpuPeak("A100 PCIe (40 or 80 GB)", 312.0, r"\bA100\b.*\bPCIE\b", A100_DATASHEET),
    GpuPeak("A100 SXM (40 or 80 GB)", 312.0, r"\bA100\b", A100_DATASHEET),
    GpuPeak("A800", 312.0, r"\bA800\b", "NVIDIA A800 data sheet: BFLOAT16 Tensor Core 312 TFLOPS (624*)"),
    # Ada: "NVIDIA L40S", "NVIDIA L40", "NVIDIA L4".
    GpuPeak("L40S", 362.05, r"\bL40S\b", "NVIDIA L40S data sheet: BFLOAT16 Tensor Core 362.05 TFLOPS (733*)"),
    GpuPeak("L40", 181.05, r"\bL40\b", "NVIDIA L40 data sheet: BFLOAT16 Tensor Core 181.05 TFLOPS (362.1*)"),
    GpuPeak("L4", 121.0, r"\bL4\b", "NVIDIA L4 data sheet: BF16 Tensor Core 242 TFLOPS*"),
    # Volta has no bf16: its fp16 tensor-core peak, for fp16 runs. "Tesla V100S-PCIE-32GB", "Tesla V100-PCIE-16GB",
    # "Tesla V100-SXM2-32GB".
    GpuPeak("V100S PCIe", 130.0, r"\bV100S\b", "NVIDIA V100 data sheet: V100S PCIe Tensor Performance 130 TFLOPS"),
    GpuPeak("V100 PCIe", 112.0, r"\bV100\b.*\bPCIE\b", "NVIDIA V100 data sheet: V100 PCIe Tensor Performance 112 "
                                                        "TFLOPS"),
    GpuPeak("V100 SXM2", 125.0, r"\bV100\b", "NVIDIA V100 data sheet: V100 SXM2 Tensor Performance 125 TFLOPS"),
)
"""* the data sheet's figure with sparsity, twice the dense peak."""

UNKNOWN_GPU_MESSAGE = ("MFU n/a: set training.peak_tflops_per_gpu (the dense bf16 peak of {name!r} is not in "
                       "training/metrics.py GPU_PEAKS)")


def layer_forward_flops_per_token(config: ModelConfig) -> float:
    """Forward FLOPs of one transformer block per token: 2 x its matmul weights, plus the attention core.

    Weights: QKV (h x (query + 2 key/value heads) x head_dim), the output projection (h x h), the MLP (2 matrices of
    h x ffn for GeLU, 3 for SwiGLU). The core, QK^T and the weighted sum of V, is 4 s h per token for every query head
    (grouped-query attention repeats K and V; causality is not discounted, as in Narayanan et al.). For the GPT
    shape this is 24 h^2 + 4 s h, so the total below is eq. 3 of Narayanan et al. 2021.
    """
    h = config.hidden_size
    weights = h * config.qkv_size + h * h + (3 if config.mlp == "swiglu" else 2) * h * config.ffn_hidden_size
    return 2.0 * weights + 4.0 * config.seq_length * h


RECOMPUTE_MODES = ("none", "selective", "full")


def recompute_flops_per_token(config: ModelConfig, recompute: str) -> float:
    """Forward FLOPs one block recomputes in its backward, per token: all of them ("full"), the attention core's 4 s h
    ("selective": QK^T and the weighted sum of V, the s-dependent term of layer_forward_flops_per_token), or none."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if recompute == "full":
        return layer_forward_flops_per_token(config)
    return 4.0 * config.seq_length * config.hidden_size if recompute == "selective" else 0.0


def recomputed_blocks(config: ModelConfig, pipeline_parallel_size: int | None, recompute: str | None = None) -> int:
    """Blocks of the whole model that recompute: model.recompute_num_layers of each of the pipeline stages (every
    block when it is None), or none with recompute "none"."""
    recompute = config.recompute if recompute is None else recompute
    if recompute == "none":
        return 0
    if config.recompute_num_layers is None:
        return config.num_layers
    if pipeline_parallel_size is None:
        raise ValueError("model.recompute_num_layers counts blocks per pipeline stage: pass pipeline_parallel_size")
    per_stage = config.num_layers // pipeline_parallel_size
    return min(config.recompute_num_layers, per_stage) * pipeline_parallel_size


def _recompute_mode(config: ModelConfig, recompute: str | bool | None) -> str:
    """None: the config's mode; a string: that mode; the old booleans: True "full", False "none"."""
    if recompute is None:
        return config.recompute
    if isinstance(recompute, bool):
        return "full" if recompute else "none"
    return recompute


def flops_per_iteration(config: ModelConfig, global_batch: int, tensor_parallel_size: int,
                        recompute: str | bool | None = None, pipeline_parallel_size: int | None = None) -> float:
    """Hardware FLOPs of one optimizer step of ``global_batch`` sequences: the model FLOPs (3 forwards' worth) plus
    the forwards that ``recompute`` reruns (default: the config's mode; True / False mean "full" / "none"). With
    model.recompute_num_layers set, ``pipeline_parallel_size`` says how many blocks that is.

    GPT shape: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with every block fully recomputed, 72 B s l h^2 (1 + s/(6h) +
    V/(12 l h)) with none (model_flops_per_iteration).
    """
    mode = _recompute_mode(config, recompute)
    tokens = global_batch * config.seq_length
    recomputed = recomputed_blocks(config, pipeline_parallel_size, mode) * recompute_flops_per_token(config, mode)
    return model_flops_per_iteration(config, global_batch, tensor_parallel_size) + tokens * recomputed


def model_flops_per_iteration(config: ModelConfig, global_batch: int, tensor_parallel_size: int) -> float:
    """Model FLOPs of one optimizer step: forward + backward, 3 forwards' worth, no recompute (PaLM's MFU)."""
    tokens = global_batch * config.seq_length
    logits = 3.0 * 2.0 * config.hidden_size * config.padded_vocab_size(tensor_parallel_size)
    return tokens * (3.0 * config.num_layers * layer_forward_flops_per_token(config) + logits)


def tflops_per_gpu(flops: float, iteration_seconds: float, num_gpus: int) -> float:
    return flops / (iteration_seconds * num_gpus * 1e12)


def match_gpu(device_name: str) -> GpuPeak | None:
    """The product a ``torch.cuda.get_device_name()`` string names, by the first rule of GPU_PEAKS that matches."""
    name = device_name.upper()
    return next((gpu for gpu in GPU_PEAKS if re.search(gpu.pattern, name)), None)


def resolve_peak_tflops(configured: float | None, device_name: str | None,
                        info: Callable[[str], None] | None = None) -> float | None:
    """The peak MFU divides by: ``training.peak_tflops_per_gpu`` when set, else the named GPU's dense bf16 peak.

    None on CPU (``device_name`` None) and for a GPU not in GPU_PEAKS; for a GPU, one line says which product and
    peak were taken, or that MFU is not available and how to give the peak. ``info`` receives it (default: print on
    rank 0), once per process and device name however often this is called.
    """
    if configured:
        return configured
    if device_name is None:
        return None
    gpu = match_gpu(device_name)
    if gpu is None:
        _report_once(UNKNOWN_GPU_MESSAGE.format(name=device_name), info)
        return None
    _report_once(f"MFU against the {gpu.product}'s dense bf16 peak, {gpu.dense_bf16_tflops:g} TFLOP/s per GPU "
                 f"(device {device_name!r}; training.peak_tflops_per_gpu overrides it)", info)
    return gpu.dense_bf16_tflops


def detect_peak_tflops(info: Callable[[str], None] | None = None) -> float | None:
    """The dense bf16 peak of the visible GPU by name; None on CPU or an unknown GPU (said once, see above)."""
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return resolve_peak_tflops(None, name, info)


_REPORTED: set[str] = set()
"""Messages already given by this process: the trainer may be built more than once (tests, rollbacks)."""


def _report_once(message: str, info: Callable[[str], None] | None) -> None:
    if message in _REPORTED:
        return
    _REPORTED.add(message)
    (info or _print_on_rank_zero)(message)


def _print_on_rank_zero(message: str) -> None:
    import os

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(message, flush=True)


def mfu(achieved_tflops: float, peak_tflops: float | None) -> float | None:
    """Utilisation of the peak: pass model TFLOP/s for MFU, hardware TFLOP/s for HFU; None without a peak (CPU)."""
    return None if not peak_tflops else achieved_tflops / peak_tflops
