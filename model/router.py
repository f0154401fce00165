"""The router of the MoE block (model/moe.py): fp32 logits of the tokens against the experts, softmax (Mixtral, Qwen)
or sigmoid scores with DeepSeek-V3's aux-loss-free bias, the top-k experts and their gate weights, the load-balancing
(aux) and z losses, and the counts per expert on the device.

    router.weight               [E, h]            replicated; gradient a partial sum over TP (model/moe.py)
    router.expert_bias (buffer) [E] fp32          "sigmoid_bias" only; no gradient, update_bias after each step

The losses are over the tokens given, or with a statistics group (the TP group of the sequence-split dispatch) over
its ranks' tokens together, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.config import MoEConfig
from model.init import normal_sharded_
from model.layers import mark_partial_over_tensor_parallel
from model.primitives import Group, group_size, reduce_from_tensor_parallel_region


@dataclass
class Routing:
    """One router call over T tokens (every tensor fp32 but the integer ones)."""

    logits: torch.Tensor
    """(T, E): tokens @ router.weight^T."""
    experts: torch.Tensor
    """(T, k) int64: the selected experts, best first."""
    weights: torch.Tensor
    """(T, k): their gate weights (scores, normalised over the k when norm_topk_prob)."""
    aux_loss: torch.Tensor
    """(): E sum_e f_e P_e, f_e = tokens_per_expert[e] / (T k), P_e = mean probability of e over the tokens."""
    z_loss: torch.Tensor
    """(): mean over the tokens of logsumexp(logits)^2."""
    tokens_per_expert: torch.Tensor
    """(E,) int64: assignments of these T tokens routed to each expert (before any capacity drop): the dispatch's."""
    counts: torch.Tensor
    """(E,) int64: tokens_per_expert over the statistics group's tokens together (``tokens_per_expert`` without
    one): what the aux loss and the monitors count."""


class _Fp32Linear(torch.autograd.Function):
    """x @ w^T in fp32, keeping x and w for the backward as they are (bf16 in a bf16 model), not their fp32 copies:
    the same values as F.linear(x.float(), w.float()), forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return (grad @ weight.float()).to(x.dtype), (grad.t() @ x.float()).to(weight.dtype)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:
        return F.linear(x, weight)
    return _Fp32Linear.apply(x, weight)


def top_k_experts(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best experts (T, k) of each token's scores (T, E), best first. A tie goes to the lower expert index, on
    every device: a stable descending sort keeps equal scores in index order, whereas torch.topk leaves the order of
    equal values unspecified (its CPU kernel is deterministic, its CUDA kernels need not agree with it)."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def expert_histogram(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how many entries of ``experts`` (any shape) name each expert. A scatter-add into E zeros on the
    device: torch.bincount reads its input's min and max on the host first, to size its output (two syncs on CUDA)."""
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class Router(nn.Module):
    """logits = tokens @ weight^T in fp32; softmax (or sigmoid) scores; top-k; gate weights; aux and z losses."""

    def __init__(self, moe: MoEConfig, hidden_size: int, *, init_std: float, seed: int) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.kind, self.norm_topk_prob = (moe.num_experts, moe.top_k, moe.router,
                                                                        moe.norm_topk_prob)
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        normal_sharded_(self.weight, init_std, seed)
        mark_partial_over_tensor_parallel(self.weight)
        if moe.router == "sigmoid_bias":  # fp32 and saved in checkpoints; the caller keeps it fp32 under bf16
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, device=self.weight.device))

    def forward(self, tokens: torch.Tensor, statistics_group: Group = None) -> Routing:
        """``statistics_group``: the TP group when each of its ranks routes tokens of its own (the sequence-split
        dispatch): the aux and z losses and the counts are then over the group's tokens together, the same on every
        rank, and each token's gradient stays on its rank (the sums' all-reduce has an identity backward)."""
        logits = fp32_linear(tokens, self.weight)  # (T, E) fp32
        if self.kind == "softmax":
            scores = probabilities = logits.softmax(dim=-1)
            experts = top_k_experts(scores, self.top_k)
        else:  # the bias chooses, it does not weigh (DeepSeek-V3)
            scores = logits.sigmoid()
            probabilities = scores / scores.sum(dim=-1, keepdim=True)
            experts = top_k_experts(scores.detach() + self.expert_bias.float(), self.top_k)
        weights = scores.gather(-1, experts)  # (T, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        tokens_per_expert = expert_histogram(experts, self.num_experts)  # (E,), the dispatch's too
        counts, probability_sum = tokens_per_expert, probabilities.sum(dim=0)  # (E,) each
        z_sum, total = torch.logsumexp(logits, dim=-1).square().sum(), tokens.shape[0]
        if group_size(statistics_group) > 1:
            counts = counts.clone()
            dist.all_reduce(counts, group=statistics_group)  # integers, no gradient
            probability_sum = reduce_from_tensor_parallel_region(probability_sum, statistics_group)
            z_sum = reduce_from_tensor_parallel_region(z_sum, statistics_group)
            total *= group_size(statistics_group)
        routed_fraction = counts.float() / (total * self.top_k)  # f_e, sums to 1
        aux_loss = self.num_experts * (routed_fraction * probability_sum / total).sum()
        return Routing(logits, experts, weights, aux_loss, z_sum / total, tokens_per_expert, counts)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's rule, after a step: b_e += rate sign(mean load - load_e), so an overloaded expert is chosen
        less. ``tokens_per_expert`` (E,) must be the same on every replica (the caller sums it over the data and
        pipeline ranks), so that every copy of the bias moves alike."""
        load = tokens_per_expert.float()
        self.expert_bias.add_(torch.sign(load.mean() - load).to(self.expert_bias.device), alpha=rate)

    def extra_repr(self) -> str:
        return (f"{self.kind}, experts {self.num_experts}, top {self.top_k}, norm_topk_prob={self.norm_topk_prob}, "
                f"fp32 (gradient partial over TP)")
