"""The DPO objective (training.dpo, runconfig/dpo.py) as the pipeline's loss function, on the last stage.

Where a pair travels, and who computes what:

    what                      where                                         shape, sharding
    a pair (chosen, rejected) rows 2i and 2i + 1 of one micro-batch          the micro-batch is even; any split of
                                                                            the global batch into micro-batches and
                                                                            replicas keeps pairs whole
    first stage's batch       (tokens, position_ids)                        (b, s) each, as for the next-token loss
    last stage's batch        (labels, loss_mask, reference_logps)          (b, s), (b, s) float, (b,) fp32: each
                                                                            row's summed completion log-prob under
                                                                            the reference, precomputed
    summed log-prob           -sum_i mask_i CE_i over the row               (b,) fp32, from the vocab-parallel
                                                                            cross-entropy (model/layers.py): the
                                                                            same on every TP rank
    pair loss, rewards        here, the last stage, no communication        (b/2,)

With the log-ratios rho_c = logp_c - ref_c and rho_r = logp_r - ref_r of a pair, and delta = rho_c - rho_r
(TRL 1.16's DPOTrainer, loss types "sigmoid" and "ipo"):

    sigmoid   -(1 - eps) log sigma(beta delta) - eps log sigma(-beta delta)     eps: label_smoothing (cDPO)
    ipo       (rho_c / n_c - rho_r / n_r - 1 / (2 beta))^2                       n: the completion's target count
    rewards   beta rho_c, beta rho_r; accuracy [beta rho_c > beta rho_r]; margin their difference

The step's loss is the mean of the pair losses over the global batch's pairs: every micro-batch holds b/2 pairs, so
its own mean, averaged by DeepSpeed over the accumulation steps and the data-parallel replicas, is that mean whatever
the split. The SFT term (rpo_alpha, TRL's "sft" loss) is the NLL of the chosen rows' targets over their count in the
whole global batch: ``step_tokens`` = N_chosen / (m d) set by the trainer (training/loss_normalization.py, counting
rows 0::2), as the next-token loss under "tokens"; None: the micro-batch's own count.

Each training forward adds [rewards chosen, rewards rejected, accuracies, margins, logps chosen, logps rejected]
summed over its pairs, and its pair count, to a device tensor (no host read in the step); ``take_metrics`` reduces
it over the world at a logged step, under TRL's names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.layers import vocab_parallel_cross_entropy
from model.parallel import ParallelContext
from runconfig.dpo import DPOConfig

METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
CHOSEN_ROWS, REJECTED_ROWS = slice(0, None, 2), slice(1, None, 2)


def pair_losses(config: DPOConfig, chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor,
                chosen_targets: torch.Tensor, rejected_targets: torch.Tensor) -> torch.Tensor:
    """Each pair's loss (P,) from its log-ratios (P,) and its completions' target counts (P,) (module docstring)."""
    if config.loss_type == "ipo":
        delta = (chosen_logratios / chosen_targets.clamp(min=1.0)
                 - rejected_logratios / rejected_targets.clamp(min=1.0))
        return (delta - 1 / (2 * config.beta)) ** 2
    logits = config.beta * (chosen_logratios - rejected_logratios)
    smoothing = config.label_smoothing
    return -(1 - smoothing) * F.logsigmoid(logits) - smoothing * F.logsigmoid(-logits)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   ctx: ParallelContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(-log p of each label (b, s), each row's summed log-prob of its targets (b,)), fp32, from this TP rank's
    logits (b, s, V/R): the policy's in DPOLoss and the reference's in tools/reference_logps.py, the same masking."""
    vocab_start = ctx.tensor_parallel_rank * logits.shape[-1]
    token_losses = vocab_parallel_cross_entropy(logits, labels, ctx.tensor_parallel_group, vocab_start)
    return token_losses, -(token_losses * loss_mask.float()).sum(dim=1)


class DPOLoss:
    """``loss_fn(logits, (labels, loss_mask, reference_logps))`` of the pipeline under training.dpo."""

    def __init__(self, ctx: ParallelContext, config: DPOConfig) -> None:
        self.ctx, self.config = ctx, config
        self.step_tokens: torch.Tensor | None = None
        """The SFT term's divisor: the step's chosen target tokens over (micro-batches x DP); None: the
        micro-batch's own (module docstring)."""
        self.sums: torch.Tensor | None = None  # (7,) fp32: METRIC_NAMES summed over pairs, then the pair count

    def __call__(self, logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if isinstance(logits, tuple):
            raise ValueError("training.dpo does not combine with model.mtp (the last stage gave the depths' logits)")
        targets, loss_mask, reference_logps = labels  # (b, s), (b, s), (b,)
        if targets.shape[0] % 2:
            raise ValueError(f"training.dpo needs whole pairs in a micro-batch (rows 2i, 2i + 1), got {targets.shape[0]} "
                             f"rows: make train_micro_batch_size_per_gpu even")
        token_losses, logps = sequence_logps(logits, targets, loss_mask, self.ctx)  # (b, s), (b,) fp32
        mask = loss_mask.float()
        reference_logps = reference_logps.float()
        chosen_logratios = logps[CHOSEN_ROWS] - reference_logps[CHOSEN_ROWS]  # (b/2,)
        rejected_logratios = logps[REJECTED_ROWS] - reference_logps[REJECTED_ROWS]
        targets_per_row = mask.sum(dim=1)  # (b,)
        losses = pair_losses(self.config, chosen_logratios, rejected_logratios, targets_per_row[CHOSEN_ROWS],
                             targets_per_row[REJECTED_ROWS])
        objective = losses.mean()
        if self.config.rpo_alpha:
            chosen_mask = mask[CHOSEN_ROWS]
            tokens = self.step_tokens if self.step_tokens is not None else chosen_mask.sum().clamp(min=1.0)
            objective = objective + self.config.rpo_alpha * (token_losses[CHOSEN_ROWS] * chosen_mask).sum() / tokens
        if torch.is_grad_enabled():  # training forwards only: evaluation does not enter the step's record
            self._record(chosen_logratios.detach(), rejected_logratios.detach(), logps.detach())
        return objective

    def _record(self, chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, logps: torch.Tensor) -> None:
        chosen_rewards, rejected_rewards = self.config.beta * chosen_logratios, self.config.beta * rejected_logratios
        terms = torch.stack([chosen_rewards.sum(), rejected_rewards.sum(),
                             (chosen_rewards > rejected_rewards).float().sum(),
                             (chosen_rewards - rejected_rewards).sum(), logps[CHOSEN_ROWS].sum(),
                             logps[REJECTED_ROWS].sum(), torch.ones_like(chosen_rewards).sum()])
        self.sums = terms if self.sums is None else self.sums + terms

    def take_metrics(self, device: torch.device) -> dict[str, float]:
        """Collective over the world (one SUM all-reduce; every rank calls it): TRL's metrics of the training
        forwards since the last take, means over the pairs of every micro-batch and replica. The last stage's ranks
        hold the record, the others add zeros; its TP ranks count each pair once each, which leaves the means as they
        are. {} when none ran."""
        sums = torch.zeros(len(METRIC_NAMES) + 1, device=device) if self.sums is None else self.sums
        self.sums = None
        dist.all_reduce(sums)
        *totals, pairs = sums.tolist()
        if not pairs:
            return {}
        return {name: total / pairs for name, total in zip(METRIC_NAMES, totals, strict=True)}
