"""The training objective: the vocab-parallel cross-entropy, the optional z-loss, and what the monitors read of it.

Per micro-batch, over its tokens with loss_mask 1 (T of them), with log Z_i the logsumexp of token i's logits over
the whole vocabulary (the cross-entropy has it already, on the vocabulary shards: model/layers.py):

    cross-entropy   CE = sum_i mask_i (log Z_i - logit_i[label_i]) / T
    z-loss          Z  = coef x sum_i mask_i (log Z_i)^2 / T        (training.z_loss = coef; PaLM's 1e-4)
    objective       CE + Z                                          what the backward differentiates

With training.loss_normalization "tokens", T is instead the step's target tokens over all its micro-batches and
data-parallel replicas divided by (micro-batches x DP) (``step_tokens``, set by the trainer): the engine's mean of
the micro-batch losses over accumulation and replicas is then sum over every target token of the step / their count.
Under context parallelism (CP > 1) a rank holds a slice of each micro-batch's positions, and "replicas" are DeepSpeed's
DP x CP ranks: T counts the slices' targets together, so the average is over whole micro-batches all the same.

The z-loss pulls log Z towards 0, so the output logits cannot drift together far from it (Wortsman et al. 2023's
output-logit divergence). ``GPTLoss`` is the pipeline's loss function (the last stage calls it once per
micro-batch). While ``recording``, it adds each micro-batch's terms to a small device tensor, never read on the host
there: the trainer reads it once per logged step (training/stability.py).

    record  [CE sum, Z sum, micro-batches, log Z sum, tokens]  summed; and min log Z, the smallest seen

Multi-token prediction (model.mtp, model/mtp.py): the last stage's outputs are (logits, the D depths' logits
(D b, s, V/R)). Depth k's cross-entropy CE_k is over the labels rolled k to the left with their loss mask, the last
k positions of each row masked (they would read rolled-around tokens), divided by the same T as CE (the paper's
1/T, eq. 24). The objective is then

    CE + Z + lambda / D x sum_k CE_k                                 lambda: ``mtp_weight``, set by the trainer each
                                                                     step from model.mtp's schedule

A forward without gradients (validation, the probes) returns CE (+ Z) alone, the next-token loss runs without MTP
report. Training forwards add [CE, CE_1 .. CE_D, 1] to ``mtp_sums`` (on the device; ``take_mtp`` at a log).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.config import MTPConfig
from model.layers import vocab_parallel_cross_entropy
from model.parallel import ParallelContext

RECORD_FIELDS = ("cross_entropy", "z_loss", "micro_batches", "log_z_sum", "tokens")


class GPTLoss:
    """``loss_fn(logits, (labels, loss_mask))`` of the pipeline: CE (+ Z) as a scalar, terms recorded on request."""

    def __init__(self, ctx: ParallelContext, z_loss: float = 0.0, mtp: MTPConfig | None = None) -> None:
        if z_loss < 0:
            raise ValueError(f"training.z_loss must be >= 0 (a coefficient, 1e-4 in PaLM), got {z_loss}")
        self.ctx, self.z_loss = ctx, z_loss
        self.mtp_depth = 0 if mtp is None else mtp.depth
        self.mtp_weight = 0.0 if mtp is None else mtp.loss_weight
        """lambda of model.mtp for the coming step (the trainer sets it from the schedule: MTPConfig.weight_at)."""
        self.mtp_sums: torch.Tensor | None = None  # (D + 2,) fp32: [CE, CE_1 .. CE_D, micro-batches] summed
        self.step_tokens: torch.Tensor | None = None
        """training.loss_normalization "tokens": the step's target tokens over all its micro-batches and replicas,
        divided by (micro-batches x DP), set by the trainer before the step. Each micro-batch's loss is then its sum
        over this: the engine's mean over micro-batches and replicas makes the global sum over all target tokens.
        None: each micro-batch's own mean."""
        self.recording = False
        self.sums: torch.Tensor | None = None  # (5,) fp32: RECORD_FIELDS
        self.min_log_z: torch.Tensor | None = None  # () fp32

    def __call__(self, logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                 labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        depth_logits = None
        if isinstance(logits, tuple):  # model.mtp: (logits, the depths' logits (D b, s, V/R))
            logits, depth_logits = logits
        targets, loss_mask = labels  # (b, s), (b, s)
        vocab_start = self.ctx.tensor_parallel_rank * logits.shape[-1]
        losses, log_z = vocab_parallel_cross_entropy(logits, targets, self.ctx.tensor_parallel_group, vocab_start,
                                                     return_log_z=True)  # (b, s) fp32 each
        mask = loss_mask.float()
        tokens = self.step_tokens if self.step_tokens is not None else self._micro_batch_tokens(mask)
        cross_entropy = (losses * mask).sum() / tokens
        z_term = self.z_loss * (log_z.square() * mask).sum() / tokens if self.z_loss else None
        if self.recording and torch.is_grad_enabled():  # the training forwards (not MuonClip's passes after them)
            self._record(cross_entropy, z_term, log_z.detach(), mask)
        objective = cross_entropy if z_term is None else cross_entropy + z_term
        if depth_logits is None or not torch.is_grad_enabled():
            return objective
        depths = self._depth_cross_entropies(depth_logits, targets, mask, tokens)  # (D,)
        record = torch.cat([cross_entropy.detach().view(1), depths.detach(), depths.new_ones(1)])
        self.mtp_sums = record if self.mtp_sums is None else self.mtp_sums + record
        return objective + (self.mtp_weight / self.mtp_depth) * depths.sum()

    def _depth_cross_entropies(self, depth_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                               tokens: torch.Tensor) -> torch.Tensor:
        """CE_1 .. CE_D (D,): depth k's labels and mask rolled k to the left, its last k positions masked."""
        positions = targets.shape[1]
        index = torch.arange(positions, device=mask.device)
        rolled = torch.cat([targets.roll(-k, dims=1) for k in range(1, self.mtp_depth + 1)])  # (D b, s)
        kept = torch.cat([mask.roll(-k, dims=1) * (index < positions - k)
                          for k in range(1, self.mtp_depth + 1)])  # (D b, s)
        vocab_start = self.ctx.tensor_parallel_rank * depth_logits.shape[-1]
        losses = vocab_parallel_cross_entropy(depth_logits, rolled, self.ctx.tensor_parallel_group, vocab_start)
        return (losses * kept).view(self.mtp_depth, -1).sum(dim=1) / tokens

    def take_mtp(self) -> torch.Tensor | None:
        """[CE, CE_1 .. CE_D, micro-batches] summed over the training forwards since the last take (on the
        device), and start again; None where none ran (not the last stage, or no model.mtp)."""
        sums, self.mtp_sums = self.mtp_sums, None
        return sums

    def mtp_losses(self, device: torch.device) -> dict[str, float | list[float]]:
        """Collective over the world (one SUM all-reduce; every rank calls it): the next-token cross-entropy
        (``loss``) and each depth's (``mtp_loss``) of the training forwards since the last take, the mean over the
        micro-batches of every data-parallel replica. The last stage's ranks hold the record, the others add zeros
        (its TP ranks count each micro-batch once each: the mean is unchanged). {} when none ran."""
        sums = self.take_mtp()
        sums = torch.zeros(self.mtp_depth + 2, device=device) if sums is None else sums.clone()
        dist.all_reduce(sums)
        *losses, count = sums.tolist()
        if not count:
            return {}
        return {"loss": losses[0] / count, "mtp_loss": [value / count for value in losses[1:]]}

    def _micro_batch_tokens(self, mask: torch.Tensor) -> torch.Tensor:
        """The divisor of a micro-batch's mean. Under context parallelism each CP rank holds a slice of the
        micro-batch's positions, and DeepSpeed averages the losses over DP x CP: the slices' target tokens summed
        over the CP group, / CP, make that average each micro-batch's mean over all its positions, whatever mask
        each slice holds."""
        count = mask.sum()  # a new tensor of data, no gradient: reduced in place
        if self.ctx.context_parallel_size > 1:
            dist.all_reduce(count, group=self.ctx.context_parallel_group)
            return count.clamp(min=1.0) / self.ctx.context_parallel_size
        return count.clamp(min=1.0)

    def _record(self, cross_entropy: torch.Tensor, z_term: torch.Tensor | None, log_z: torch.Tensor,
                mask: torch.Tensor) -> None:
        zero = torch.zeros((), device=log_z.device)
        terms = torch.stack([cross_entropy.detach(), zero if z_term is None else z_term.detach(), zero + 1,
                             (log_z * mask).sum(), mask.sum()])
        smallest = log_z.masked_fill(mask == 0, float("inf")).min()
        self.sums = terms if self.sums is None else self.sums + terms
        self.min_log_z = smallest if self.min_log_z is None else torch.minimum(self.min_log_z, smallest)

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The record since the last take (on the device), and start a new one; None if nothing was recorded."""
        if self.sums is None:
            return None
        record = (self.sums, self.min_log_z)
        self.sums = self.min_log_z = None
        return record


def gpt_loss(ctx: ParallelContext, logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Masked mean of the vocab-parallel cross-entropy over the micro-batch's tokens (no z-loss, nothing recorded)."""
    return GPTLoss(ctx)(logits, labels)
