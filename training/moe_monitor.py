"""What the Mixture-of-Experts layers did between two logged steps: their auxiliary losses and how evenly they loaded
their experts (model/moe.py; nothing here for a dense model).

    logged as            what
    moe_aux_loss         the load-balancing loss E sum_e f_e P_e, unscaled, averaged over the sparse layers and their
                         training forwards (1.0 when the router spreads tokens evenly and uniformly)
    moe_z_loss           the router z-loss mean(logsumexp(logits)^2), averaged alike
    moe_sequence_aux_loss  DeepSeek-V3's sequence-wise balance loss, unscaled (model/router.py
                         sequence_balance_loss: per sequence sum_e f_e P_e, 1.0 when even), averaged alike; only
                         with model.moe.sequence_aux_loss_coeff > 0 (the router computes it only then)
    moe_load_imbalance   per sparse layer, the tokens of its busiest expert over the mean per expert, counted over
                         every data-parallel replica; the largest over the layers (1.0: perfectly even)
    moe_imbalance_per_layer  {layer_number: that ratio}
    moe_dropped_fraction the share of the assignments the capacity dropped (0 when dropless)

With the "sigmoid_bias" router (DeepSeek-V3's aux-loss-free balancing) ``after_step`` also moves each router's bias
by the step's counts of its layer, summed over every rank: one more SUM all-reduce, every step whose update was
applied. A step the optimizer skipped (an fp16 overflow, a non-finite gradient, the spike guard; the same on every
rank) leaves the bias as it was: its counts are dropped, as its weights' update is. They are still logged.

Each layer counts its forwards as they run (MoEMLP, once per micro-batch, not again in a recompute); ``after_step``
moves the counts of the step into this monitor's sums on the device, nothing read on the host; ``take``, at a logged
step, is one SUM all-reduce over every rank of a (layers, 5 + E) fp64 table: a stage holds its own layers' rows,
every data-parallel replica adds its tokens, and only TP rank 0 of each stage contributes (its TP peers routed the
same tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from common.device import accelerator_device
from model.config import ModelConfig
from model.moe import sparse_layers
from model.parallel import ParallelContext

FIELDS = 5  # aux sum, z sum, forwards, dropped, sequence aux sum; then tokens per expert


class MoEMonitor:
    def __init__(self, module: Any, config: ModelConfig, ctx: ParallelContext) -> None:
        self.layers = sparse_layers(module)
        self.enabled = config.moe is not None  # the same on every rank: take() is collective when it is
        # model.mtp's blocks are numbered L + 1 .. L + D (model/mtp.py): sparse ones are counted and balanced too
        self.num_layers, self.ctx = config.num_layers + (config.mtp.depth if config.mtp else 0), ctx
        self.num_experts = config.moe.num_experts if config.moe else 0
        self.top_k = config.moe.top_k if config.moe else 0
        self.sequence_loss = config.moe is not None and config.moe.sequence_aux_loss_coeff > 0
        sigmoid = config.moe is not None and config.moe.router == "sigmoid_bias"
        self.bias_update_rate = config.moe.bias_update_rate if sigmoid else 0.0
        self._sums: torch.Tensor | None = None

    def after_step(self, applied: bool = True) -> None:
        """Add the step's counts of this stage's sparse layers to the sums (on the device; no communication), and,
        when the step's update was ``applied``, move the aux-loss-free routers' bias (collective: one SUM all-reduce
        of the step's counts, every rank)."""
        if not self.enabled:
            return
        if self._sums is None:
            self._sums = torch.zeros(self.num_layers, FIELDS + self.num_experts, dtype=torch.float64,
                                     device=accelerator_device())  # meets no module: the communication device
        steps = {layer_number: layer.take_stats() for layer_number, layer in self.layers}
        if self.bias_update_rate and applied:
            self._update_biases(steps)
        for layer_number, stats in steps.items():
            if stats is None or self.ctx.tensor_parallel_rank != 0:
                continue
            row = torch.cat([torch.stack([stats.aux_loss.double(), stats.z_loss.double(),
                                          torch.tensor(float(stats.forwards), dtype=torch.float64,
                                                       device=stats.aux_loss.device),
                                          stats.dropped.double(), stats.sequence_aux_loss.double()]),
                             stats.tokens_per_expert.double()])
            self._sums[layer_number - 1] += row.to(self._sums.device)

    def _update_biases(self, steps: dict[int, Any]) -> None:
        """DeepSeek-V3's aux-loss-free balancing: every router's bias moves by the step's counts of its layer summed
        over every rank (each data-parallel replica's tokens; TP peers count the same tokens, which the sign rule
        does not see), so that every copy of a layer's bias moves alike."""
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=accelerator_device())
        for layer_number, stats in steps.items():
            if stats is not None:
                counts[layer_number - 1] = stats.tokens_per_expert.double().to(counts.device)
        dist.all_reduce(counts)
        for layer_number, layer in self.layers:
            layer.block.router.update_bias(counts[layer_number - 1], self.bias_update_rate)

    def take(self) -> dict[str, Any]:
        """Collective when the model has experts: the values since the last call, the same on every rank."""
        if not self.enabled or self._sums is None:
            return {}
        sums, self._sums = self._sums, None
        dist.all_reduce(sums)
        rows = sums[sums[:, 2] > 0].cpu()  # the sparse layers that ran a training forward
        if not len(rows):
            return {}
        numbers = [int(n) + 1 for n in torch.nonzero(sums[:, 2] > 0).flatten().tolist()]
        forwards, tokens = rows[:, 2], rows[:, FIELDS:]
        imbalance = tokens.max(dim=1).values / tokens.mean(dim=1).clamp(min=1e-12)
        assignments = tokens.sum()
        logged = {"moe_aux_loss": float((rows[:, 0] / forwards).mean()),
                  "moe_z_loss": float((rows[:, 1] / forwards).mean()),
                  "moe_load_imbalance": float(imbalance.max()),
                  "moe_imbalance_per_layer": {n: float(r) for n, r in zip(numbers, imbalance, strict=True)},
                  "moe_dropped_fraction": float(rows[:, 3].sum() / assignments) if assignments > 0 else 0.0}
        if self.sequence_loss:
            logged["moe_sequence_aux_loss"] = float((rows[:, 4] / forwards).mean())
        return logged
