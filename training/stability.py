"""The stability monitors: what Wortsman et al. 2023 watch to see a large run's instabilities in a small one.

    monitor                    measured on                                   when                   logged as
    z-loss term                the step's training micro-batches (last stage) every step, read at a log  z_loss
    log Z mean and minimum     the same (the cross-entropy's logsumexp)      every step, read at a log  log_z_mean, log_z_min
    largest attention logit    one fixed micro-batch (the run's first),      every stability_interval   attention_logit_per_layer,
      q.k / sqrt(d), per block   forward only (eval mode), scores formed      steps                    max_attention_logit
                                 for it alone (model/gpt.py)
    update / weight RMS ratio  every parameter, per group ("matrices":       every stability_interval   update_rms_ratio
                                 >= 2-D, decayed; "vectors": norms, biases)   steps                    {group: ratio}
                                 ||w_after - w_before|| / ||w_before||
    MuonClip (qk_clip set)     the last step's training forwards: its        every logged step        qk_clip_max_logit,
                                 largest logit before clipping, and the                                 qk_clipped_heads,
                                 heads clipped (training/muon.py QKClip);                               qk_clip_passes
                                 with qk_clip_passes, the passes it ran

Nothing is read on the host between logs: the values stay on the device until the logged step, where one SUM and one
MAX all-reduce of a small vector (every rank: ranks that hold none of a value contribute 0 or -inf) bring them to
rank 0 — two small reads per logged step. The sums are ratios of sums, so that a value held by several ranks (TP ranks
of the last stage, data-parallel replicas) counts the same on each side of the fraction. A replicated parameter is
counted on TP rank 0 only, the tied embedding on the first stage only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from common.device import device_of
from model.attention import attention_logit_probe
from model.loss import GPTLoss
from model.parallel import ParallelContext

GROUPS = ("matrices", "vectors")


def _group_of(parameter: torch.Tensor) -> str:
    """The weight-decay rule's split (training/engine.py weight_decay_groups): matrices decay, vectors do not."""
    return "matrices" if parameter.ndim >= 2 else "vectors"


class StabilityMonitor:
    def __init__(self, engine: Any, ctx: ParallelContext, num_layers: int, interval: int, z_loss: float,
                 probe_batch_factory) -> None:
        """``probe_batch_factory()`` returns the fixed micro-batch the attention logits are measured on (called
        once, at the first measurement)."""
        self.engine, self.ctx, self.num_layers, self.interval = engine, ctx, num_layers, interval
        self.objective: GPTLoss = engine.module.objective
        self.clip = getattr(engine.module, "qk_clip", None)  # MuonClip's record of its last step (training/engine.py)
        self.records = interval > 0 or z_loss > 0 or self.clip is not None
        self.make_probe_batch, self.probe_batch = probe_batch_factory, None
        self._before: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None
        self._pending_logits: dict[int, torch.Tensor] | None = None
        self._pending_update: torch.Tensor | None = None

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def _counted_parameters(self) -> list[tuple[str, torch.Tensor]]:
        counted = []
        for name, parameter in self.engine.module.named_parameters():
            if not parameter.requires_grad:
                continue
            if "tied_modules" in name and not self.ctx.is_first_stage:
                continue  # the last stage's copy of the tied embedding
            if not getattr(parameter, "tensor_model_parallel", False) and self.ctx.tensor_parallel_rank != 0:
                continue  # replicated over TP: counted once
            counted.append((_group_of(parameter), parameter))
        return counted

    def before_step(self, step: int) -> None:
        """``step``: the number the coming step will have (1-based). Nothing when no monitor is on (under
        training.dpo the objective is DPOLoss, which keeps no log Z record)."""
        if not self.records:
            return
        self.objective.take()  # the record holds one step: the last one before a log
        self.objective.recording = self.records
        if self.due(step):
            self._before = [(group, p, p.detach().clone()) for group, p in self._counted_parameters()]

    def after_step(self, step: int) -> None:
        if not self.records:
            return
        self.objective.recording = False
        if not self.due(step):
            return
        sums = torch.zeros(2 * len(GROUPS), device=device_of(self.engine.module))
        for group, parameter, before in self._before or []:
            index = 2 * GROUPS.index(group)
            sums[index] += (parameter.detach().float() - before.float()).square().sum()
            sums[index + 1] += before.float().square().sum()
        self._before, self._pending_update = None, sums
        self._pending_logits = self._probe_attention()

    def _probe_attention(self) -> dict[int, torch.Tensor]:
        if self.probe_batch is None:
            self.probe_batch = self.make_probe_batch()
        with attention_logit_probe(self.engine.module) as found:
            self.engine.eval_batch(data_iter=iter([self.probe_batch]), num_micro_batches=1)
        return found

    def take(self) -> dict[str, Any]:
        """The monitors' values since the last take, as log fields (collective: every rank calls it at a log)."""
        if not self.records:
            return {}
        record = self.objective.take()
        device = device_of(self.engine.module)  # where the records and the probe's logits are, and NCCL reduces
        summed = torch.zeros(6 + 2 * len(GROUPS), device=device)  # [record, update sums, clipped heads]
        largest = torch.full((2 + self.num_layers,), float("-inf"), device=device)  # [-min log Z, clip, per block]
        if record is not None:
            summed[:5], largest[0] = record[0], -record[1]
        if self._pending_update is not None:
            summed[5:-1] = self._pending_update
        clip = self.clip.largest if self.clip is not None else None
        if clip is not None and clip.numel():  # each DP replica holds the same reduced maxima: counted once
            summed[-1] = (clip > self.clip.tau).sum() / self.ctx.data_parallel_size
            largest[1] = clip.max()
        for layer, value in (self._pending_logits or {}).items():
            largest[1 + layer] = value
        measured = self._pending_logits is not None
        self._pending_update = self._pending_logits = None
        dist.all_reduce(summed)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return self._fields(summed.tolist(), largest.tolist(), measured)

    def _fields(self, summed: list[float], largest: list[float], measured: bool) -> dict[str, Any]:
        cross_entropy, z_term, micro_batches, log_z_sum, tokens = summed[:5]
        fields: dict[str, Any] = {}
        if self.clip is not None and math.isfinite(largest[1]):
            fields["qk_clip_max_logit"], fields["qk_clipped_heads"] = largest[1], round(summed[-1])
            if self.clip.passes:  # a host count, the same on every rank (clip_after_step)
                fields["qk_clip_passes"] = self.clip.passes_run
        if micro_batches:
            fields["z_loss"] = z_term / micro_batches
            fields["log_z_mean"] = log_z_sum / tokens
            fields["log_z_min"] = -largest[0]
        if measured:
            per_layer = largest[2:]
            fields["attention_logit_per_layer"] = per_layer
            fields["max_attention_logit"] = max(per_layer)
            update = summed[5:-1]
            fields["update_rms_ratio"] = {group: math.sqrt(update[2 * i]) / math.sqrt(update[2 * i + 1])
                                          for i, group in enumerate(GROUPS) if update[2 * i + 1] > 0}
        return fields
