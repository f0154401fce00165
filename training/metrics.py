"""Throughput accounting: model FLOPs per iteration, TFLOP/s per GPU and MFU.

Narayanan et al. 2021, eq. 3, with activation recomputation (one extra forward):
    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))
and without it
    F = 72 B s l h^2 (1 + s / (6 h) + V / (12 l h))
B global batch (sequences), s sequence length, l layers, h hidden, V padded vocabulary.
"""

from __future__ import annotations

from model.config import ModelConfig

# Dense bf16/fp16 tensor-core peaks, TFLOP/s, from the vendors' data sheets.
GPU_PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "H800": 989.0, "A800": 312.0, "V100": 125.0}


def flops_per_iteration(config: ModelConfig, global_batch: int, tensor_parallel_size: int,
                        recompute: bool | None = None) -> float:
    """Model FLOPs of one optimizer step of ``global_batch`` sequences (recompute defaults to the config's)."""
    recompute = config.activation_checkpointing if recompute is None else recompute
    s, layers, h = config.seq_length, config.num_layers, config.hidden_size
    vocab = config.padded_vocab_size(tensor_parallel_size)
    factor, vocab_term = (96.0, vocab / (16.0 * layers * h)) if recompute else (72.0, vocab / (12.0 * layers * h))
    return factor * global_batch * s * layers * h * h * (1.0 + s / (6.0 * h) + vocab_term)


def tflops_per_gpu(flops: float, iteration_seconds: float, num_gpus: int) -> float:
    return flops / (iteration_seconds * num_gpus * 1e12)


def detect_peak_tflops() -> float | None:
    """The dense bf16 peak of the visible GPU by name; None on CPU or an unknown GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().upper()
    return next((peak for key, peak in GPU_PEAK_TFLOPS.items() if key in name), None)


def mfu(achieved_tflops: float, peak_tflops: float | None) -> float | None:
    return None if not peak_tflops else achieved_tflops / peak_tflops
