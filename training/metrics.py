"""Throughput accounting: the GPU peaks, hardware and model FLOPs utilisation (the FLOPs: model/flops.py).

TFLOP/s per GPU counts hardware FLOPs (the figure Megatron and the MT-NLG paper quote); "hfu" is that over the GPU's
peak, "mfu" the model FLOPs over the peak.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


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
