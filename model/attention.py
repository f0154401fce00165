"""Causal self-attention over a tensor-parallel rank's heads, and what reads it: document masks, the KV cache of
generation, the attention-logit probe of the stability monitors.

    q (b, nh/R, s, d), k and v (b, g/R, s, d): this TP rank's query heads and its g/R key/value groups

SelfAttention is one block's attention (model/gpt.py assembles the blocks); its ``core`` (softmax(q k^T / sqrt(d)) v
with the attention dropout) is what selective recomputation reruns. Without document ids the core is SDPA's causal
kernel; with a packed sample's ``segment_ids`` (data.reset_attention_mask) it is block-diagonal causal
(``document_mask``): by default (model.attention_backend "auto") FlexAttention on CUDA and the blockwise kernel of
model/document_attention.py elsewhere, both in memory linear in s; SDPA with the s x s mask is the reference, and the
kernel under attention dropout (``document_kernel``). The core, its recomputation, the probe and the KV cache slot
are CausalAttention's, which model/mla.py's multi-head latent attention shares (with its own projections, v of
its own width, its own softmax scale, and a cache of its own: the latent, not k and v).

Under Ulysses context parallelism (parallelism.context_parallel_size CP > 1) s is this rank's slice of the sample,
s = S / CP: RoPE rotates q and k at the slice's global positions, then DeepSpeed's DistributedAttention trades the
sequence for heads (an all-to-all over the CP group: all S positions of nh / (R CP) query heads and their g / (R CP)
key/value groups), runs the core on them (document masks from the whole sample's (b, S) segment ids), and trades
back. Selective recomputation reruns the core between the all-to-alls, not the all-to-alls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from common.device import device_of
from model.config import ModelConfig
from model.document_attention import blockwise_document_attention
from model.init import parameter_seed
from model.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear, mark_shared_by_heads
from model.parallel import ParallelContext
from model.random import RNGStream, checkpoint


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(b, 1, s, s) bool, True where query i may attend to key j: j <= i and both in the same document (the same
    segment id). The block-diagonal causal mask of packed samples, Megatron's reset_attention_mask."""
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same_document = segment_ids[:, :, None] == segment_ids[:, None, :]  # (b, s, s)
    return (same_document & causal).unsqueeze(1)


def document_kernel(backend: str, device: torch.device, dropout: float) -> str:
    """The kernel of document masks for model.attention_backend: "auto" is FlexAttention on CUDA and the blockwise
    kernel elsewhere (both linear in s), SDPA's masked kernel where attention dropout applies (the only one with it)."""
    if backend != "auto":
        return backend
    if dropout > 0:
        return "sdpa"
    return "flex" if device.type == "cuda" else "blockwise"


class BlockMasks:
    """The FlexAttention block mask of the micro-batch a stage runs (model.attention_backend "flex"): made by the
    stage's first block from the packed sample's (b, s) ids and reused by the others, which receive the same ids
    tensor. One per model (gpt_layer_specs and GPTModel share it among their blocks, as they share RoPE's table);
    it holds the last micro-batch's ids and mask until the next one replaces them."""

    def __init__(self) -> None:
        self._segment_ids: torch.Tensor | None = None
        self._mask = None

    def of(self, segment_ids: torch.Tensor, heads_length_device: tuple[int, torch.device]):
        """The block mask of ``segment_ids`` (b, s), made once per ids tensor: block-diagonal causal."""
        if self._segment_ids is not segment_ids:
            from torch.nn.attention.flex_attention import create_block_mask

            def same_document_causal(batch, head, query, key):
                return (segment_ids[batch, query] == segment_ids[batch, key]) & (key <= query)

            length, device = heads_length_device
            self._mask = create_block_mask(same_document_causal, segment_ids.shape[0], None, length, length,
                                           device=device)
            self._segment_ids = segment_ids
        return self._mask


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor,
                            grouped: bool, block_masks: BlockMasks | None = None,
                            scale: float | None = None) -> torch.Tensor:
    """The attention of ``document_mask`` (model.attention_backend "flex"): FlexAttention with a block mask made from
    the (b, s) ids, so that the blocks outside every document's causal square are never computed; q (b, nh, s, d),
    k (b, g, s, d) and v (b, g, s, d_v) with ``grouped`` query heads per key head. No dropout (the config refuses it).
    ``block_masks``: the stage's, so that its blocks make the mask once per micro-batch (a new one when not given);
    ``scale``: the softmax scale (None: 1 / sqrt(d))."""
    mask = (block_masks or BlockMasks()).of(segment_ids, (q.shape[-2], q.device))
    return _flex_attention(q.device.type)(q, k, v, block_mask=mask, enable_gqa=grouped, scale=scale)


@functools.cache
def _flex_attention(device_type: str):
    """FlexAttention, compiled on CUDA (its fused kernel), eager elsewhere (forward only on CPU: torch's own limit)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


DOCUMENTS_WITH_A_CACHE = "document masks (packed samples) are for training: a KV cache holds one sequence"


class AttentionCache:
    """What one block's attention keeps of the tokens it has seen, for generation (inference only): a few tensors with
    the sequence on dim -2, which grow together. The attention says what they are (``CausalAttention.new_cache``):

        cache                   holds, per layer, on each TP rank             values per token (one sequence)
        KVCache (SelfAttention) keys (b, g/R, past, d), values likewise        2 d g/R
        LatentKVCache (MLA,     the normed kv latent (b, past, r_kv) and the   r_kv + d_r (all of it on every rank)
          model/mla.py)           rotated shared rope key (b, past, d_r)

    ``kv_caches(module)`` gives every attention of a stage an empty one for one sequence (or batch) at a time."""

    def __init__(self, values_per_token: int) -> None:
        self.values_per_token = values_per_token
        """What one token adds to this layer's cache on this TP rank (batch of 1): the cache's memory per token is
        this times the element size (``bytes_per_token``)."""
        self.tensors: tuple[torch.Tensor, ...] | None = None

    @property
    def length(self) -> int:
        """past: the tokens the cache holds."""
        return 0 if self.tensors is None else self.tensors[0].shape[-2]

    def extend(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append each tensor's s new positions (dim -2) to the cached ones; return them all, cached first."""
        if self.tensors is not None:
            new = tuple(torch.cat([cached, tensor], dim=-2) for cached, tensor in zip(self.tensors, new, strict=True))
        self.tensors = new
        return new

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """The bytes one token adds to this layer's cache on this TP rank, in ``dtype`` (the model's: bf16 2)."""
        return self.values_per_token * dtype.itemsize


class KVCache(AttentionCache):
    """The keys and values of SelfAttention, on this rank's heads (AttentionCache), ``tensors`` = (keys, values):

        keys           (b, g/R, past, d_k): the key heads of this TP rank, rotated, as transformers' cache holds them
        values         (b, g/R, past, d_v)

    A forward with a cache attends over the cached positions and its own, then appends its keys and values; RoPE
    rotates the new q and k at positions past .. past + s - 1. ``heads``, ``key_width``, ``value_width``: g/R, d_k and
    d_v (SelfAttention: d both; an MLA without its latent cache would hold nh/R heads of d_n + d_r and d_v)."""

    def __init__(self, heads: int, key_width: int, value_width: int) -> None:
        super().__init__(heads * (key_width + value_width))


class CausalAttention(nn.Module):
    """What a block's attention does once it has projected q, k and v, whatever its projections (SelfAttention here,
    MultiHeadLatentAttention in model/mla.py): the core, softmax(q k^T scale) v causal with the attention dropout and
    the document-mask kernels; its selective recomputation; the attention-logit probe (``max_logit``); the KV cache
    slot (``kv_cache``, set by kv_caches() to what ``new_cache`` makes: each attention says what it keeps).

        q (b, nh/R, s, d), k (b, g/R, s, d), v (b, g/R, s, d_v): this TP rank's query heads, nh/g of them per key/value
        head; d_v = d but under MLA; scale: ``softmax_scale``, None for 1 / sqrt(d) (SDPA's default)
    """

    def __init__(self, config: ModelConfig, layer_number: int, rng: RNGStream, recompute_core: bool,
                 queries_per_group: int, block_masks: BlockMasks | None = None,
                 softmax_scale: float | None = None) -> None:
        super().__init__()
        self.recompute_core = recompute_core  # selective recomputation: store q, k, v; rerun the core in backward
        self.queries_per_group = queries_per_group
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout
        self.backend = config.attention_backend  # the kernel of document masks (document_kernel)
        self.block_masks = block_masks or BlockMasks()
        self.rng = rng  # the tensor-parallel stream: these heads' dropout masks are this rank's own
        self.kv_cache: AttentionCache | None = None  # set for inference by kv_caches()
        self.layer_number = layer_number
        self.max_logit: torch.Tensor | None = None  # set by a forward inside attention_logit_probe()
        self.step_logits: torch.Tensor | None = None  # each head's, of the training forwards: MuonClip's (QKClip)
        self.logit_hook: Callable[..., None] | None = None  # MuonClip's passes after a step (training/muon.py)

    def _project(self, x: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """q, k, v of ``x`` through this rank's projections, rotated at their positions (and through the KV cache,
        where one is set): what ``core`` takes."""
        raise NotImplementedError(f"{type(self).__name__} defines no projections (_project)")

    def _project_and_hook(self, x: torch.Tensor, position_ids: torch.Tensor | None,
                          segment_ids: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """``_project``; with a ``logit_hook`` (MuonClip's passes) the hook sees q and k first, may scale the query
        and key rows, and the projections run again through them (on every TP rank, as the forward's collectives
        need)."""
        q, k, v = self._project(x, position_ids)
        if self.logit_hook is not None:
            self.logit_hook(self, q, k, segment_ids)
            q, k, v = self._project(x, position_ids)
        return q, k, v

    def logit_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Per-row factors of this rank's query and key projections that scale query head j's logits by ``gamma[j]``
        (nh/R,) > 0, exactly: MuonClip's (training/muon.py QKClip)."""
        raise NotImplementedError(f"{type(self).__name__} cannot scale its heads' logits (logit_rows)")

    def head_maxima(self, q: torch.Tensor, k: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
        """Each head's largest logit (nh/R,) at this attention's softmax scale, fp32 on the device (``head_logits``
        is at 1 / sqrt(d))."""
        largest = head_logits(q, k, segment_ids)  # (nh/R,) of q.k / sqrt(d): the logits over a positive constant
        if self.softmax_scale is not None:
            largest = largest * (self.softmax_scale * q.shape[-1] ** 0.5)
        return largest

    def new_cache(self) -> AttentionCache:
        """An empty cache of what this attention needs of past tokens (AttentionCache's table)."""
        raise NotImplementedError(f"{type(self).__name__} defines no KV cache (new_cache)")

    def _core_or_recompute(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           segment_ids: torch.Tensor | None) -> torch.Tensor:
        if self.recompute_core and self.training and torch.is_grad_enabled():
            return checkpoint(self.rng, self.core, q, k, v, segment_ids)
        return self.core(q, k, v, segment_ids)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T scale) v with the attention dropout, causal: what selective recomputation reruns.

        With a KV cache the s queries are the last s of the keys' positions: one query sees every key, several see
        the keys up to their own position (a bottom-right causal mask). With ``segment_ids`` (b, s) the mask is
        block-diagonal causal: a query sees the keys up to its own position in its own document (``document_mask``;
        made here from the (b, s) ids, so recomputation stores those, not the (b, s, s) mask)."""
        dropout = self.dropout if self.training else 0.0
        queries, keys = q.shape[-2], k.shape[-2]
        training_step = self.step_logits is not None and torch.is_grad_enabled()  # a recomputation repeats it
        if self.max_logit is not None or training_step:  # the fused kernel never forms the scores: form them here
            largest = self.head_maxima(q, k, segment_ids)
            if self.max_logit is not None:
                self.max_logit = torch.maximum(self.max_logit, largest)
            if training_step:
                self.step_logits = torch.maximum(self.step_logits, largest)
        kernel = None if segment_ids is None else document_kernel(self.backend, q.device, dropout)
        grouped = self.queries_per_group > 1
        if kernel == "flex":
            return flex_document_attention(q, k, v, segment_ids, grouped, self.block_masks, self.softmax_scale)
        if kernel == "blockwise":
            return blockwise_document_attention(q, k, v, segment_ids, self.softmax_scale)  # (b, nh/R, s, d_v)
        mask = None
        if segment_ids is not None:
            mask = document_mask(segment_ids)  # (b, 1, s, s)
        elif keys > queries > 1:
            mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(diagonal=keys - queries)
        with self.rng.fork(enabled=dropout > 0):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  is_causal=queries == keys and segment_ids is None,
                                                  dropout_p=dropout, scale=self.softmax_scale,
                                                  enable_gqa=grouped)  # (b, nh/R, s, d_v)


class SelfAttention(CausalAttention):
    """Causal self-attention over this rank's heads: fused QKV column-parallel, output row-parallel.

    With g key/value heads (groups) of q = heads / g query heads each, the QKV output rows are laid out per group,
    [g, q + 2, head_dim]: the group's q query heads, then its key head, then its value head. Query head j belongs to
    group j // q (transformers' repeat_kv order). A contiguous slice of rows is therefore a set of whole groups with
    all their heads, so TP rank r holds groups [r g/R, (r+1) g/R) and attends alone; the full weight is the plain
    concatenation of the shards on dim 0. Multi-head attention (q = 1) is GPT-2's [heads, 3, head_dim].
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_number: int,
                 rng: RNGStream, recompute_core: bool = False, rotary: RotaryEmbedding | None = None,
                 block_masks: BlockMasks | None = None) -> None:
        """``rotary``: the RoPE of the model's blocks, shared so that a stage makes cos and sin once per micro-batch
        (model/layers.py RotaryEmbedding); a new one when not given (a RoPE config). ``block_masks``: the model's
        FlexAttention block masks, shared likewise (BlockMasks)."""
        super().__init__(config, layer_number, rng, recompute_core, config.queries_per_key_value_head, block_masks)
        h = config.hidden_size
        self.groups = config.num_key_value_heads // ctx.tensor_parallel_size
        self.heads = self.groups * self.queries_per_group
        self.head_dim = config.head_dim
        self.qkv = ColumnParallelLinear(h, config.qkv_size, ctx, init_std=config.init_method_std,
                                        seed=parameter_seed(seed, layer_number, "attention.qkv"),
                                        bias=config.qkv_has_bias)
        self.dense = RowParallelLinear(config.attention_size, h, ctx,
                                       init_std=config.output_layer_init_std,
                                       seed=parameter_seed(seed, layer_number, "attention.dense"),
                                       bias=config.other_linears_have_bias)
        self.rotary = None
        if config.position_embedding == "rope":
            self.rotary = rotary or RotaryEmbedding(self.head_dim, config.rope_theta, config.rope_scaling)
        self.q_norm = self.k_norm = None
        if config.qk_layernorm:  # per head, weights shared by the heads: partial gradients over TP
            self.q_norm, self.k_norm = head_norm(config), head_norm(config)
            for parameter in (*self.q_norm.parameters(), *self.k_norm.parameters()):
                mark_shared_by_heads(parameter)
        # Ulysses context parallelism (CP > 1): this rank holds s / CP positions of every head of this TP rank; an
        # all-to-all over the CP group gives the core all s positions of nh / (R CP) heads, and another gives back
        # (DeepSpeed's DistributedAttention, in (b, s, heads, d) order). RoPE rotates before, at global positions.
        self.context_parallel_rank = ctx.context_parallel_rank
        self.ulysses = None
        if ctx.context_parallel_size > 1:
            from deepspeed.sequence.layer import DistributedAttention

            self.ulysses = DistributedAttention(self._sequence_first_core, ctx.context_parallel_group,
                                                scatter_idx=2, gather_idx=1)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids``, ``segment_ids`` (b, s): a packed sample's positions and documents (documents never see
        each other; RoPE at each token's position in its document); without, one causal sequence 0 .. s-1."""
        if segment_ids is not None and self.kv_cache is not None:
            raise ValueError(DOCUMENTS_WITH_A_CACHE)
        if self.ulysses is not None and self.kv_cache is not None:
            raise ValueError("generation runs at context_parallel_size 1: load the checkpoint with CP 1")
        q, k, v = self._project_and_hook(x, position_ids, segment_ids)
        b, s = q.shape[0], q.shape[2]
        if self.ulysses is None:
            context = self._core_or_recompute(q, k, v, segment_ids)  # (b, nh/R, s, d)
        else:  # DeepSpeed's order (b, s, heads, d); segment_ids (b, S) are the whole sample's
            context = self.ulysses(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None,
                                   segment_ids).transpose(1, 2)  # (b, nh/R, s, d)
        context = context.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)  # (b, s, nh d/R)
        return self.dense(context)  # (b, s, h)

    def _project(self, x: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """q (b, nh/R, s, d), k and v (b, g/R, keys, d), keys = past + s with a KV cache, s without."""
        qkv = self.qkv(x)  # (b, s, ...): the whole sequence, also when x holds this rank's positions only
        b, s = qkv.shape[:2]
        per_group = self.queries_per_group
        qkv = qkv.view(b, s, self.groups, per_group + 2, self.head_dim)  # (b, s, g/R, q + 2, d)
        qkv = qkv.permute(0, 2, 3, 1, 4)  # (b, g/R, q + 2, s, d)
        q = qkv[:, :, :per_group].flatten(1, 2)  # (b, nh/R, s, d), query head j in group j // q
        k, v = qkv[:, :, per_group], qkv[:, :, per_group + 1]  # each (b, g/R, s, d)
        if self.q_norm is not None:  # on each head's d features, before RoPE (Qwen3's order)
            q, k = self.q_norm(q), self.k_norm(k)
        past = 0 if self.kv_cache is None else self.kv_cache.length
        if self.rotary is not None:  # under CP, s is this rank's slice: positions from its start in the sample
            start = past + (self.context_parallel_rank * s if position_ids is None else 0)
            q, k = self.rotary(q, k, offset=start, position_ids=position_ids)
        if self.kv_cache is not None:
            k, v = self.kv_cache.extend(k, v)  # each (b, g/R, past + s, d)
        return q, k, v

    def logit_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The fused qkv's rows (and its bias's), ``qk_row_factors``."""
        rows = qk_row_factors(gamma, self.groups, self.queries_per_group, self.head_dim)
        return [(param, rows) for param in (self.qkv.weight, self.qkv.bias) if param is not None]

    def new_cache(self) -> KVCache:
        """This rank's g/R key/value heads, rotated keys and values of head_dim each."""
        return KVCache(self.groups, self.head_dim, self.head_dim)

    def _sequence_first_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             segment_ids: torch.Tensor | None) -> torch.Tensor:
        """The core between Ulysses' all-to-alls: q (b, S, nh/(R CP), d), k and v (b, S, g/(R CP), d), all S
        positions of this CP rank's heads (whole key/value groups: query head j's group j // q came with it)."""
        context = self._core_or_recompute(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), segment_ids)
        return context.transpose(1, 2)  # (b, S, nh/(R CP), d)

    def extra_repr(self) -> str:
        return (f"{self.groups} key/value groups of {self.queries_per_group} query heads on this rank, "
                f"head_dim {self.head_dim}")


def qk_row_factors(gamma: torch.Tensor, groups: int, queries_per_group: int, head_dim: int) -> torch.Tensor:
    """Per row of a fused qkv shard ([g, q + 2, d] rows: a group's q query heads, its key head, its value head), the
    factor that scales query head j's logits by ``gamma[j]`` exactly: the group's key rows by sqrt(min gamma), each
    query head's by gamma_j / that, the value rows by 1. One query head per group (MHA): sqrt(gamma) on both, Kimi-K2's
    rule."""
    gamma = gamma.view(groups, queries_per_group)
    key = gamma.amin(dim=1, keepdim=True).sqrt()  # (g, 1)
    per_head = torch.cat([gamma / key, key, torch.ones_like(key)], dim=1)  # (g, q + 2)
    return per_head.repeat_interleave(head_dim, dim=1).reshape(-1)  # (g (q + 2) d,)


def head_norm(config: ModelConfig) -> nn.Module:
    """model.qk_layernorm's norm of one query or key head: config.norm's kind, head_dim wide."""
    if config.norm == "layernorm":
        return nn.LayerNorm(config.head_dim, eps=config.layernorm_epsilon)
    return RMSNorm(config.head_dim, eps=config.layernorm_epsilon)


PROBE_MIN_ROWS = 64
"""The fewest query rows the probe scores at once: from 4 rows on, a CPU's BLAS blocks the matmul as it blocks the
whole one (under 4 it sums in another order), so the maximum is bitwise the unchunked one's."""


def largest_logit(q: torch.Tensor, k: torch.Tensor, segment_ids: torch.Tensor | None = None,
                  max_scores: int = 2**26) -> torch.Tensor:
    """The largest of ``head_logits``: one fp32 device scalar."""
    return head_logits(q, k, segment_ids, max_scores).amax()


def head_logits(q: torch.Tensor, k: torch.Tensor, segment_ids: torch.Tensor | None = None,
                max_scores: int = 2**26) -> torch.Tensor:
    """Each query head's largest attention logit q.k / sqrt(d) over the pairs attention computes (query i, key
    j <= i; with ``segment_ids``, of the same document too), fp32, on the device, (nh/R,): q (b, nh/R, s, d),
    k (b, g/R, s, d) with nh/g query heads per key head (training only: no cache).

    The scores are formed a chunk at a time, whole heads while they fit, else query rows of one head (at least
    PROBE_MIN_ROWS): a chunk's fp32 scores, their mask and its fp32 keys and queries hold at most ``max_scores`` x 4
    bytes (256 MiB) at any s, as long as one head's keys (s d fp32) and PROBE_MIN_ROWS rows leave room (s = 128k,
    d = 128: 64 MiB of keys, 300 rows at once)."""
    q, k = q.detach(), k.detach()
    batch, heads, length, dim = q.shape
    queries_per_group, budget = heads // k.shape[1], max_scores * 4
    per_row = batch * (length * 5 + dim * 4)  # one query row of one head: fp32 scores and a bool mask, its query
    keys = batch * length * dim * 4  # one head's fp32 keys
    head_chunk = max(1, min(heads, budget // (length * per_row + keys)))
    row_chunk = length if head_chunk > 1 else min(length, max(PROBE_MIN_ROWS, (budget - keys) // per_row))
    largest = torch.full((heads,), float("-inf"), device=q.device)
    for start in range(0, heads, head_chunk):
        heads_of_chunk = slice(start, min(start + head_chunk, heads))
        head_ids = torch.arange(heads_of_chunk.start, heads_of_chunk.stop, device=q.device)
        keys_t = k[:, head_ids // queries_per_group].float().transpose(-1, -2)  # (b, chunk, d, s): j // (nh/g)
        for first in range(0, length, row_chunk):
            rows = slice(first, min(first + row_chunk, length))
            largest[heads_of_chunk] = torch.maximum(largest[heads_of_chunk],
                                                    _chunk_max(q[:, head_ids, rows], keys_t, rows, segment_ids))
    return largest


def _chunk_max(q: torch.Tensor, keys_t: torch.Tensor, rows: slice, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """Each head's largest attended logit in one chunk, (chunk,) (the scores die on return, before the next chunk's
    are made)."""
    scores = (q.float() @ keys_t).div_(q.shape[-1] ** 0.5)  # (b, chunk, rows, s) fp32
    unattended = _unattended(rows, keys_t.shape[-1], segment_ids, q.device)
    return scores.masked_fill_(unattended, float("-inf")).amax(dim=(0, 2, 3))


def _unattended(rows: slice, length: int, segment_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """True where query i (in ``rows``) does not see key j: j > i, or another document. (rows, s), or (b, 1, rows, s)
    with ``segment_ids``: the rows of ``document_mask``'s complement."""
    queries = torch.arange(rows.start, rows.stop, device=device)
    future = torch.arange(length, device=device)[None, :] > queries[:, None]  # (rows, s)
    if segment_ids is None:
        return future
    other_document = segment_ids[:, rows, None] != segment_ids[:, None, :]  # (b, rows, s)
    return other_document.bitwise_or_(future).unsqueeze(1)


@contextmanager
def attention_logit_probe(module: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Inside, every attention of ``module`` keeps the largest logit of its forwards; on exit the dict maps each
    block's layer_number (1 .. L) to it (a device scalar: read on the host when it suits the caller)."""
    attentions = [m for m in module.modules() if isinstance(m, CausalAttention)]
    found: dict[int, torch.Tensor] = {}
    for attention in attentions:
        attention.max_logit = torch.full((), float("-inf"), device=device_of(attention))
    try:
        yield found
    finally:
        for attention in attentions:
            found[attention.layer_number] = attention.max_logit.amax()
            attention.max_logit = None


@contextmanager
def kv_caches(module: nn.Module) -> Iterator[list[AttentionCache]]:
    """Give every attention in ``module`` (a stage, or the whole GPT) an empty cache of its own kind for the duration
    (``CausalAttention.new_cache``: SelfAttention's keys and values, MLA's latent)."""
    attentions = [m for m in module.modules() if isinstance(m, CausalAttention)]
    caches = [attention.new_cache() for attention in attentions]
    for attention, cache in zip(attentions, caches, strict=True):
        attention.kv_cache = cache
    try:
        yield caches
    finally:
        for attention in attentions:
            attention.kv_cache = None
