"""training.loss_normalization "tokens": the step's loss is its summed token losses over its target-token count.

DeepSpeed's pipeline engine averages the micro-batch losses of a step over its accumulation steps, and the gradient
all-reduce averages the replicas. With m micro-batches per replica, d replicas and N target tokens in the whole
global batch, a micro-batch whose loss is its own sum divided by N / (m d) makes that average

    (1 / (m d)) sum over replicas and micro-batches of sum_i mask_i loss_i / (N / (m d))  =  sum over the step / N

whatever the split, and so do the gradients: what TRL (num_items_in_batch) and Megatron-LM (--calculate-per-token-
loss) compute. Before each step every rank takes the step's micro-batches from its loader (each rank's loader yields
its replica's micro-batches, whether or not its stage reads them), counts their targets, and sums the counts over its
data-parallel group; model/loss.py GPTLoss divides by ``step_tokens`` = N / (m d). Under context parallelism d is
DeepSpeed's data axis, DP x CP: each CP rank counts the targets of its slices, and the sum over the axis is N all the
same. Evaluation keeps each
micro-batch's mean (``step_tokens`` is cleared after the step).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


def take_micro_batches(loader: Iterator, count: int) -> list[Any]:
    """The step's ``count`` micro-batches of this replica, ((tokens, positions[, segment_ids]), (labels, loss_mask))
    each."""
    return [next(loader) for _ in range(count)]


def set_step_tokens(objective: Any, micro_batches: list[Any], data_parallel_group: Any,
                    data_parallel_size: int, rows: slice = slice(None)) -> torch.Tensor:
    """Collective over the data-parallel group: ``objective.step_tokens`` = N / (m d) for these micro-batches (module
    docstring); returns N. A step without any target token divides by 1 (its loss is 0). ``rows``: the rows of each
    micro-batch counted (training.dpo's SFT term counts the chosen rows, training/dpo.py)."""
    masks = [labels[1][rows] for _, labels in micro_batches]
    count = torch.stack([mask.float().sum() for mask in masks]).sum()  # on the masks' device
    if data_parallel_size > 1:
        dist.all_reduce(count, group=data_parallel_group)
    objective.step_tokens = count.clamp(min=1.0) / (len(micro_batches) * data_parallel_size)
    return count


def clear_step_tokens(objective: Any) -> None:
    objective.step_tokens = None
