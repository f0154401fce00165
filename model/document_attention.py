"""Attention of packed samples in memory linear in the sequence: each block of queries against its documents' keys.

The documents of a packed sample are contiguous and its segment ids non-decreasing (data/loader.py), so query i may
attend exactly the keys [start_i, i], start_i the first position of its document: a band, not an s x s pattern.
The kernels of model.attention_backend for document masks (model/attention.py picks one):

    kernel       where                          kept for the backward                 largest transient
    "sdpa"       the reference                  the (b, 1, s, s) mask, SDPA's          (b, h, s, s) scores
                                                (b, h, s, s) additive mask
    "flex"       CUDA ("auto"), compiled        q, k, v, out, FlexAttention's          its tiles; the block mask
                                                logsumexp; the block mask              (b, s/128, s/128) per stage
    "blockwise"  elsewhere ("auto"), this       q, k, v, out, the logsumexp (b, h, s)  (b, h, B, L) fp32 scores of
                 module                         fp32: what SDPA's fused kernel keeps   one block of B queries

A block of B queries [i0, i1) reads the keys [min_b start_{i0}, i1): L is at most the longest document plus B, so
the blocks outside every document are never computed. The forward keeps each query's logsumexp; the backward
recomputes each block's probabilities from it (FlashAttention's recurrence, in torch ops): exact in fp32 up to the
order of the sums, no dropout (the config refuses it with these kernels). B is chosen so that one block's scores
stay within ``MAX_SCORES`` fp32 values (16 MiB), at least 16 queries. The block ranges are read on the host once
per call: this kernel is for the CPU, where that costs nothing; on CUDA "auto" runs FlexAttention.

Layout: q (b, g, r, s, d), k (b, g, s, d) and v (b, g, s, d_v) (d_v = d but under MLA, model/mla.py): g key/value
groups of r query heads each (query head j of the attention is group j // r, head j % r: transformers' repeat_kv
order), so a group's keys are read once for its r query heads.
"""

from __future__ import annotations

import math

import torch

from common.device import HOST

MAX_SCORES = 1 << 22
MIN_BLOCK = 16


def document_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) int64: the first position of each token's document, for non-decreasing (b, s) segment ids."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return torch.where(starts, index, 0).cummax(dim=1).values


def query_blocks(starts: torch.Tensor, heads: int) -> list[tuple[int, int, int]]:
    """(i0, i1, j0) of each block of queries [i0, i1) and the first key j0 any of them reads (on the host)."""
    batch, length = starts.shape
    longest = int((torch.arange(length, device=starts.device) - starts).amax()) + 1  # host: the CPU kernel's plan
    # a block of B queries reads at most longest + B keys: B (longest + B) <= MAX_SCORES / (b h)
    budget = MAX_SCORES / (batch * heads)
    block = min(length, max(MIN_BLOCK, int((math.sqrt(longest**2 + 4 * budget) - longest) / 2)))
    firsts = starts[:, ::block].amin(dim=0).to(HOST).tolist()  # host: the CPU kernel's plan
    return [(i0, min(i0 + block, length), first) for i0, first in zip(range(0, length, block), firsts, strict=True)]


def _allowed(starts: torch.Tensor, i0: int, i1: int, j0: int) -> torch.Tensor:
    """(b, 1, 1, B, L) bool: query i in [i0, i1) may read key j in [j0, i1): start_i <= j <= i."""
    queries = torch.arange(i0, i1, device=starts.device)
    keys = torch.arange(j0, i1, device=starts.device)
    allowed = (keys[None, None, :] >= starts[:, i0:i1, None]) & (keys[None, None, :] <= queries[None, :, None])
    return allowed[:, None, None]


def _scores(q: torch.Tensor, k: torch.Tensor, starts: torch.Tensor, i0: int, i1: int, j0: int,
            scale: float) -> torch.Tensor:
    """(b, g, r, B, L) fp32 scores q.k * scale of one block, -inf where a query may not read the key."""
    scores = torch.einsum("bgrid,bgjd->bgrij", q[..., i0:i1, :].float(), k[..., j0:i1, :].float()) * scale
    return scores.masked_fill_(~_allowed(starts, i0, i1, j0), float("-inf"))


class _DocumentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor, scale: float):
        starts = document_starts(segment_ids)
        blocks = query_blocks(starts, q.shape[1] * q.shape[2])
        b, g, r, s, _ = q.shape  # out laid out (b, s, g, r, d_v), as SDPA lays its output: the dense input is a view
        out = torch.empty(b, s, g, r, v.shape[-1], dtype=q.dtype, device=q.device).permute(0, 2, 3, 1, 4)
        log_sum_exp = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # (b, g, r, s)
        for i0, i1, j0 in blocks:
            scores = _scores(q, k, starts, i0, i1, j0, scale)
            largest = scores.amax(dim=-1, keepdim=True)  # every query reads itself: finite
            probabilities = (scores - largest).exp_()
            total = probabilities.sum(dim=-1, keepdim=True)
            context = torch.einsum("bgrij,bgjd->bgrid", probabilities, v[..., j0:i1, :].float()) / total
            out[..., i0:i1, :] = context.to(out.dtype)
            log_sum_exp[..., i0:i1] = (largest + total.log()).squeeze(-1)
        ctx.save_for_backward(q, k, v, out, log_sum_exp, segment_ids)  # the ids are the stage's: nothing new kept
        ctx.scale, ctx.blocks = scale, blocks
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, log_sum_exp, segment_ids = ctx.saved_tensors
        scale, starts = ctx.scale, document_starts(segment_ids)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        grad_v = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        delta = (grad_out.float() * out.float()).sum(dim=-1)  # (b, g, r, s): rowsum(dO * O)
        for i0, i1, j0 in ctx.blocks:
            probabilities = (_scores(q, k, starts, i0, i1, j0, scale) - log_sum_exp[..., i0:i1, None]).exp_()
            grad_block = grad_out[..., i0:i1, :].float()  # (b, g, r, B, d)
            grad_v[..., j0:i1, :] += torch.einsum("bgrij,bgrid->bgjd", probabilities, grad_block)
            grad_probabilities = torch.einsum("bgrid,bgjd->bgrij", grad_block, v[..., j0:i1, :].float())
            grad_scores = probabilities.mul_(grad_probabilities - delta[..., i0:i1, None]).mul_(scale)
            grad_q[..., i0:i1, :] = torch.einsum("bgrij,bgjd->bgrid", grad_scores, k[..., j0:i1, :].float())
            grad_k[..., j0:i1, :] += torch.einsum("bgrij,bgrid->bgjd", grad_scores, q[..., i0:i1, :].float())
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


def blockwise_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor,
                                 scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T scale) v under the block-diagonal causal mask of (b, s) ``segment_ids``: q (b, nh, s, d), k
    (b, g, s, d) and v (b, g, s, d_v), nh / g query heads per key/value head -> (b, nh, s, d_v); ``scale`` None:
    1 / sqrt(d). What document_mask + SDPA gives, in memory linear in s (module docstring)."""
    batch, heads, length, width = q.shape
    groups = k.shape[1]
    grouped = q.reshape(batch, groups, heads // groups, length, width)
    scale = width ** -0.5 if scale is None else scale
    return _DocumentAttention.apply(grouped, k, v, segment_ids, scale).reshape(batch, heads, length, v.shape[-1])
