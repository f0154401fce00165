"""The router of the MoE block (model/moe.py): fp32 logits of the tokens against the experts, softmax (Mixtral, Qwen)
or sigmoid scores with DeepSeek-V3's aux-loss-free bias, the top-k experts and their gate weights, the load-balancing
(aux), sequence-wise balance and z losses, and the counts per expert on the device.

    router.weight               [E, h]            replicated; gradient a partial sum over TP (model/moe.py)
    router.expert_bias (buffer) [E] fp32          "sigmoid_bias" only; no gradient, update_bias after each step

The losses are over the tokens given, or with a statistics group (the TP group of the sequence-split dispatch) over
its ranks' tokens together, the same on every rank; the sequence-wise loss over each sequence of the tokens given.

DeepSeek-V3's router ("sigmoid_bias", as transformers' DeepseekV3TopkRouter computes it), E experts in G = n_group
groups of E / G, T tokens:

    step                                                              shape
    scores s = sigmoid(logits); choice c = s + expert_bias            (T, E) each
    group score: the sum of the group's two best c                    (T, G)
    keep the topk_group best groups, c of the others -inf             (T, E)
    the top_k experts by c; their gate weights from s, divided by     experts (T, k), weights (T, k)
      their sum + 1e-20 (norm_topk_prob), times routed_scaling_factor

Ties. Every choice (groups, then experts) takes the larger value and, between equal values, the lower index, on every
device (top_k_experts: a stable sort). transformers takes torch.topk's, which its kernels do not specify: where the
tie decides nothing (the tied candidates all kept, or all left; the two best of a group, whose sum is the same) the
two agree (tests/test_deepseek_routing.py); where it straddles the cut they may not: on CPU, torch.topk of four
equal scores, k 2, chooses experts [2, 3] (torch 2.13), this router [0, 1].
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
    sequence_aux_loss: torch.Tensor
    """(): DeepSeek-V3's sequence-wise balance loss, unweighted (sequence_balance_loss); 0 unless
    sequence_aux_loss_coeff > 0."""
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


def group_limited_top_k(choice: torch.Tensor, k: int, groups: int, kept_groups: int) -> torch.Tensor:
    """The k best experts (T, k) of ``choice`` (T, E), best first, among the ``kept_groups`` of the ``groups``
    groups of E / groups consecutive experts whose two best scores sum highest (DeepSeek-V3's group-limited routing;
    ties as top_k_experts). Every group kept: top_k_experts itself."""
    if kept_groups == groups:
        return top_k_experts(choice, k)
    tokens, experts = choice.shape
    group_scores = choice.view(tokens, groups, experts // groups).topk(2, dim=-1).values.sum(dim=-1)  # (T, G)
    kept = top_k_experts(group_scores, kept_groups)  # (T, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # (T, G)
    masked = choice.masked_fill(~keep.repeat_interleave(experts // groups, dim=1), float("-inf"))  # (T, E)
    return top_k_experts(masked, k)


def sequence_balance_loss(probabilities: torch.Tensor, experts: torch.Tensor, sequence_length: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (its paper's eqs. 17-20), unweighted, the mean over the sequences:
    ``probabilities`` (T, E) the tokens' normalised scores s' (each row sums to 1), ``experts`` (T, k) their
    choices, T = b s tokens of b sequences of ``sequence_length`` s, in order. Per sequence sum_e f_e P_e, with
    f_e = E / (k s) x (tokens routed to e) and P_e = the mean over its tokens of s'_e; the gradient reaches the
    router through P only."""
    num_experts, k = probabilities.shape[1], experts.shape[1]
    chosen = torch.zeros_like(probabilities).scatter_(1, experts, 1.0)  # (T, E), 0 or 1
    routed_fraction = chosen.view(-1, sequence_length, num_experts).sum(dim=1) * (num_experts / (k * sequence_length))
    mean_probability = probabilities.view(-1, sequence_length, num_experts).mean(dim=1)  # (b, E)
    return (routed_fraction * mean_probability).sum(dim=-1).mean()


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
        self.groups, self.kept_groups, self.scaling = moe.n_group, moe.topk_group, moe.routed_scaling_factor
        self.sequence_loss = moe.sequence_aux_loss_coeff > 0
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        normal_sharded_(self.weight, init_std, seed)
        mark_partial_over_tensor_parallel(self.weight)
        if moe.router == "sigmoid_bias":  # fp32 and saved in checkpoints; the caller keeps it fp32 under bf16
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, device=self.weight.device))

    def forward(self, tokens: torch.Tensor, statistics_group: Group = None,
                sequence_length: int | None = None) -> Routing:
        """``statistics_group``: the TP group when each of its ranks routes tokens of its own (the sequence-split
        dispatch): the aux and z losses and the counts are then over the group's tokens together, the same on every
        rank, and each token's gradient stays on its rank (the sums' all-reduce has an identity backward).
        ``sequence_length``: the tokens are sequences of this many, in order (the sequence-wise loss; None: one)."""
        logits = fp32_linear(tokens, self.weight)  # (T, E) fp32
        if self.kind == "softmax":
            scores = probabilities = logits.softmax(dim=-1)
            experts = top_k_experts(scores, self.top_k)
            denominator_floor = 0.0
        else:  # the bias chooses, it does not weigh (DeepSeek-V3)
            scores = logits.sigmoid()
            probabilities = scores / scores.sum(dim=-1, keepdim=True)
            choice = scores.detach() + self.expert_bias.float()
            experts = group_limited_top_k(choice, self.top_k, self.groups, self.kept_groups)
            denominator_floor = 1e-20  # transformers' DeepseekV3TopkRouter's
        weights = scores.gather(-1, experts)  # (T, k)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + denominator_floor)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        sequence_loss = self._sequence_loss(probabilities, experts, tokens.shape[0] if sequence_length is None
                                            else sequence_length, statistics_group)
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
        return Routing(logits, experts, weights, aux_loss, z_sum / total, sequence_loss, tokens_per_expert, counts)

    def _sequence_loss(self, probabilities: torch.Tensor, experts: torch.Tensor, sequence_length: int,
                       statistics_group: Group) -> torch.Tensor:
        if not self.sequence_loss:
            return probabilities.new_zeros(())
        if group_size(statistics_group) > 1:  # model/config/parallel.py refuses the layout first
            raise ValueError("model.moe.sequence_aux_loss_coeff > 0 under the sequence-split dispatch: each TP rank "
                             "routes part of every sequence; turn sequence_parallel off, or the loss off (0)")
        return sequence_balance_loss(probabilities, experts, sequence_length)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's rule, after a step: b_e += rate sign(mean load - load_e), so an overloaded expert is chosen
        less. ``tokens_per_expert`` (E,) must be the same on every replica (the caller sums it over the data and
        pipeline ranks), so that every copy of the bias moves alike."""
        load = tokens_per_expert.float()
        self.expert_bias.add_(torch.sign(load.mean() - load).to(self.expert_bias.device), alpha=rate)

    def extra_repr(self) -> str:
        groups = f", top {self.kept_groups} of {self.groups} groups" if self.groups > 1 else ""
        return (f"{self.kind}, experts {self.num_experts}, top {self.top_k}{groups}, "
                f"norm_topk_prob={self.norm_topk_prob}, scaling {self.scaling}, fp32 (gradient partial over TP)")
