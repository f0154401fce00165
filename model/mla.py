"""Multi-head latent attention (MLA: DeepSeek-V2 and V3, Kimi-K2) over a tensor-parallel rank's heads.

Queries, keys and values are projected through low-rank latents. Each query and key head is a part without
positions (qk_nope) and a rotated part (qk_rope), the key's rotated part one head that all heads share; the value
heads have a width of their own (DeepSeek-V3: 128, q and k 128 + 64). The maths is transformers' DeepseekV3Attention (tests/test_mla.py compares the two). With
R the tensor-parallel size, nh heads, r_q = q_lora_rank, r_kv = kv_lora_rank, d_n, d_r, d_v the nope, rope and v
head widths:

    tensor                  weight                    sharding        input -> output
    q_a_proj                [r_q, h] (+ bias)         replicated      x (b, s*, h) -> (b, s*, r_q)
    q_a_layernorm           [r_q]                     replicated      RMSNorm (eps 1e-6)
    q_b_proj                [nh (d_n + d_r), r_q]     rows: heads r   (b, s*, r_q), gathered -> q (b, s, nh/R (d_n+d_r))
      or q_proj (r_q null)  [nh (d_n + d_r), h]       rows: heads r   x, gathered -> q
    kv_a_proj_with_mqa      [r_kv + d_r, h] (+ bias)  replicated      x -> latent (b, s*, r_kv), k_rope (b, s*, d_r)
    kv_a_layernorm          [r_kv]                    replicated      the latent; RMSNorm (eps 1e-6)
    kv_b_proj               [nh (d_n + d_v), r_kv]    rows: heads r   latent, gathered -> k_nope, v (b, s, nh/R ..)
    k_rope enters the TP region (copy; all-gather of the sequence)    (b, s*, d_r) -> (b, s, d_r), every rank
    dense (HF's o_proj)     [h, nh d_v] (+ bias)      columns: heads  (b, s, nh/R d_v) -> (b, s*, h)

s*: the whole sequence s, or this rank's s/R positions under sequence parallelism, where the block's input and
output are sequence shards. Rows laid out per head ([nh, d_n + d_r], [nh, d_n + d_v]) make a contiguous slice of
rows whole heads: TP rank r holds heads [r nh/R, (r+1) nh/R), and the full weight is the concatenation of the shards.

The gradients of the replicated down-projections and their norms: every path out of them enters the TP region
after the norm (q_b_proj and kv_b_proj, column-parallel, and k_rope's entry), whose backward sums the gradients of
the ranks' heads. Without sequence parallelism each rank sees the whole sequence and that sum: whole gradients,
equal on every rank, nothing to reduce. With it each rank sees its s/R positions: partial sums, reduced over TP
once per step with every replicated parameter (model/layers.py sequence_parallel_parameters). Entering the region
before a norm would leave that norm the gradient of its rank's heads alone, a partial sum that nothing reduces
without sequence parallelism.

The core is CausalAttention's (model/attention.py): q = [q_nope, rope(q_rope)] (b, nh/R, s, d_n + d_r), k = [k_nope,
rope(k_rope) for every head], v (b, nh/R, s, d_v) (SDPA and the document-mask kernels take its own width). Its
softmax scale is 1/sqrt(d_n + d_r), times yarn_mscale(factor, mscale_all_dim)^2 where rope_scaling gives
mscale_all_dim (DeepSeek's YaRN: transformers' yarn_apply_mscale); YaRN's attention factor multiplies cos and sin
as for plain attention (model/layers.py RotaryEmbedding). rope_interleave: the rope part's pairs (x0, x1), (x2, x3),
.. each turned by one frequency, laid out [turned evens; turned odds] (transformers'
apply_rotary_pos_emb_interleave; q and k alike, so q.k does not see the layout); false: rotate_half's pairs
(x_i, x_{i + d_r/2}).

The KV cache of generation (``LatentKVCache``, what ``new_cache`` makes for kv_caches()) holds what MLA needs of
the past tokens and no more:

    tensor       shape              what                                                on each TP rank
    latent       (b, past, r_kv)    kv_a_layernorm's output, before kv_b_proj           all of it (replicated)
    rope_keys    (b, past, d_r)     the shared rope key, rotated at its position        all of it (replicated)

r_kv + d_r values per token and layer (DeepSeek-V3: 512 + 64 = 576), where a cache of keys and values would hold
nh/R (d_n + d_r + d_v) (V3 at TP 1: 128 x (192 + 128) = 40,960). A forward with the cache projects its s new tokens,
rotates their rope key (and queries) at positions past .. past + s - 1, appends latent and rope key, up-projects the
whole cached latent with kv_b_proj into this rank's heads (k_nope and v at past + s positions), and attends the s
queries over them with CausalAttention.core's bottom-right causal mask. Up-projecting the whole past at every step is
simple and exact, not fast. DeepSeek's inference absorbs kv_b_proj instead: its k_nope rows folded into the queries
(q_nope W_uk, per head, scores the latent directly) and its v rows into the output projection, so that a decode step
reads r_kv + d_r values a past token and never forms k or v. That absorbed form is what a GPU decode would use; it is
not built here. Document masks (segment_ids) and sequence parallelism (the latent would hold this rank's positions
only) are refused with a cache.

Not built yet, and refused: Ulysses context parallelism and qk_layernorm (model/config), Hugging Face conversion
(hf/tables.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import DOCUMENTS_WITH_A_CACHE, AttentionCache, BlockMasks, CausalAttention
from model.config import ModelConfig
from model.init import normal_sharded_, parameter_seed
from model.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear, apply_rope, yarn_mscale
from model.parallel import ParallelContext
from model.primitives import Group, copy_to_tensor_parallel_region, gather_from_sequence_parallel_region
from model.random import RNGStream

LATENT_NORM_EPSILON = 1e-6
"""The epsilon of q_a_layernorm and kv_a_layernorm: DeepSeek's and transformers' (DeepseekV3RMSNorm's default; the
config's rms_norm_eps, model.layernorm_epsilon here, is the block norms')."""


class LatentKVCache(AttentionCache):
    """MLA's cache of one layer (module docstring): the normed kv latent (b, past, r_kv) and the rotated shared rope
    key (b, past, d_r), whole on every TP rank; r_kv + d_r values per token."""

    def __init__(self, kv_lora_rank: int, qk_rope_head_dim: int) -> None:
        super().__init__(kv_lora_rank + qk_rope_head_dim)

    @property
    def latent(self) -> torch.Tensor | None:
        return None if self.tensors is None else self.tensors[0]

    @property
    def rope_keys(self) -> torch.Tensor | None:
        return None if self.tensors is None else self.tensors[1]


class ReplicatedLinear(nn.Module):
    """y = x A^T + b with A [N, K] whole on every TP rank (MLA's down-projections): no communication. Its input and
    output are replicated (b, s, ·), or this rank's positions (b, s/R, ·) under sequence parallelism, where its
    gradients are partial sums over TP (module docstring)."""

    def __init__(self, in_features: int, out_features: int, *, init_std: float, seed: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        normal_sharded_(self.weight, init_std, seed)  # the rows of the one full matrix, the same on every rank
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        return f"in {in_features}, out {out_features}, bias={self.bias is not None} (replicated)"


def enter_tensor_parallel_region(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """(b, s, n) replicated, or this rank's positions (b, s/R, n) under sequence parallelism -> (b, s, n) on every TP
    rank, used by this rank's heads: the gradient is summed over TP on the way back (reduce-scattered to the
    positions under sequence parallelism)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tensor_parallel_region(x, group)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x0, x1), (x2, x3), .. of x (b, heads, s, d) by their position, out [turned evens; turned
    odds]: transformers' apply_rotary_pos_emb_interleave. cos and sin (s, d) or (b, 1, s, d) as rope_cos_sin makes
    them, cat(freqs, freqs): the first half holds each pair's angle."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def latent_softmax_scale(config: ModelConfig) -> float:
    """1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times yarn_mscale(factor, mscale_all_dim)^2 where rope_scaling
    gives mscale_all_dim: transformers' yarn_apply_mscale, which scales every dimension of q.k, the unrotated ones
    too (DeepSeek's reference)."""
    scale = config.head_dim ** -0.5  # head_dim is d_n + d_r under MLA (model/config/attention.py)
    scaling = config.rope_scaling
    if scaling is not None and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class MultiHeadLatentAttention(CausalAttention):
    """Causal multi-head latent attention over this rank's heads (module docstring): built as SelfAttention is, from
    (config, ctx, seed, layer_number, rng), sharing the model's ``rotary`` and ``block_masks``."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_number: int,
                 rng: RNGStream, recompute_core: bool = False, rotary: RotaryEmbedding | None = None,
                 block_masks: BlockMasks | None = None) -> None:
        super().__init__(config, layer_number, rng, recompute_core, 1, block_masks, latent_softmax_scale(config))
        tp, heads = ctx.tensor_parallel_size, config.num_attention_heads
        if heads % tp:
            raise ValueError(f"model.num_attention_heads ({heads}) is not divisible by the tensor-parallel size "
                             f"({tp}): each rank holds whole heads")
        h, std = config.hidden_size, config.init_method_std
        self.heads = heads // tp
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank, self.rope_interleave = config.q_lora_rank, config.rope_interleave
        self.group, self.sequence_parallel = ctx.tensor_parallel_group, ctx.sequence_parallel
        bias = config.other_linears_have_bias  # transformers' attention_bias: the down-projections and the output

        def seed_of(name: str) -> int:
            return parameter_seed(seed, layer_number, f"attention.{name}")

        q_width = heads * config.head_dim  # nh (d_n + d_r)
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, q_width, ctx, init_std=std, seed=seed_of("q_proj"), bias=False)
        else:
            self.q_a_proj = ReplicatedLinear(h, config.q_lora_rank, init_std=std, seed=seed_of("q_a_proj"), bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPSILON)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, q_width, ctx, init_std=std,
                                                 seed=seed_of("q_b_proj"), bias=False)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, config.kv_lora_rank + config.qk_rope_head_dim, init_std=std,
                                                   seed=seed_of("kv_a_proj_with_mqa"), bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=LATENT_NORM_EPSILON)
        kv_width = heads * (config.qk_nope_head_dim + config.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(config.kv_lora_rank, kv_width, ctx, init_std=std,
                                              seed=seed_of("kv_b_proj"), bias=False)
        self.dense = RowParallelLinear(config.attention_size, h, ctx, init_std=config.output_layer_init_std,
                                       seed=seed_of("dense"), bias=bias)
        self.rotary = rotary or RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x (b, s*, h) (module docstring); ``position_ids``, ``segment_ids`` (b, s): a packed sample's positions and
        documents, as SelfAttention takes them; without, one causal sequence past .. past + s - 1 (past: the tokens a
        KV cache holds, 0 without one)."""
        self._check_cache(segment_ids)
        q, k, v = self._project_and_hook(x, position_ids, segment_ids)
        context = self._core_or_recompute(q, k, v, segment_ids)  # (b, nh/R, s, d_v)
        b, s = q.shape[0], q.shape[2]
        return self.dense(context.transpose(1, 2).reshape(b, s, self.heads * self.v_head_dim))  # (b, s*, h)

    def _project(self, x: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """q (b, nh/R, s, d_n + d_r), k (b, nh/R, keys, d_n + d_r) and v (b, nh/R, keys, d_v), keys = past + s with
        a KV cache (the cache takes the new latent and rope key), s without."""
        d_n, d_r, d_v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q = self._queries(x)  # (b, s, nh/R (d_n + d_r)): the whole sequence, also when x holds this rank's positions
        b, s = q.shape[:2]
        q_nope, q_rope = q.view(b, s, self.heads, d_n + d_r).transpose(1, 2).split([d_n, d_r], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, d_r], dim=-1)  # (b, s*, r_kv), d_r
        latent = self.kv_a_layernorm(latent)  # (b, s*, r_kv): what the cache holds, whole on every rank
        k_rope = enter_tensor_parallel_region(k_rope, self.group, self.sequence_parallel).unsqueeze(1)  # (b, 1, s, d_r)
        past = 0 if self.kv_cache is None else self.kv_cache.length
        cos, sin = self.rotary.cos_sin(s, q_rope.dtype, q_rope.device, offset=past, position_ids=position_ids)
        rotate = apply_rope_interleaved if self.rope_interleave else apply_rope
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope, cos, sin)
        if self.kv_cache is not None:  # (b, past + s, r_kv) and (b, past + s, d_r)
            latent, rope_keys = self.kv_cache.extend(latent, k_rope.squeeze(1))
            k_rope = rope_keys.unsqueeze(1)  # (b, 1, past + s, d_r)
        kv = self.kv_b_proj(latent)  # (b, keys, nh/R (d_n + d_v)), keys = past + s: this rank's heads
        keys = kv.shape[1]
        k_nope, v = kv.view(b, keys, self.heads, d_n + d_v).transpose(1, 2).split([d_n, d_v], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (b, nh/R, s, d_n + d_r)
        k = torch.cat((k_nope, k_rope.expand(-1, self.heads, -1, -1)), dim=-1)  # (b, nh/R, keys, d_n + d_r)
        return q, k, v

    def logit_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Kimi-K2's rule, exact: head j's query rows (q_proj's or q_b_proj's) times sqrt(gamma_j) on its d_n
        unrotated features and gamma_j on its d_r rotated ones, kv_b_proj's key rows of head j times sqrt(gamma_j)
        (its value rows 1); the rope key, which all heads share (kv_a_proj_with_mqa), is left alone. Head j's logit
        q_nope.k_nope + q_rope.k_rope is then gamma_j times its logit before."""
        d_n, d_r, d_v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        gamma = gamma.view(self.heads, 1)
        root = gamma.sqrt()
        queries = torch.cat([root.expand(-1, d_n), gamma.expand(-1, d_r)], dim=1).reshape(-1)  # (nh/R (d_n + d_r),)
        keys = torch.cat([root.expand(-1, d_n), torch.ones_like(gamma).expand(-1, d_v)], dim=1).reshape(-1)
        query_projection = self.q_proj if self.q_proj is not None else self.q_b_proj
        return [(query_projection.weight, queries), (self.kv_b_proj.weight, keys)]

    def new_cache(self) -> LatentKVCache:
        """The latent and the rope key (module docstring): kv_b_proj gives this rank's heads from the whole latent."""
        return LatentKVCache(self.kv_lora_rank, self.qk_rope_head_dim)

    def _check_cache(self, segment_ids: torch.Tensor | None) -> None:
        if self.kv_cache is None:
            return
        if segment_ids is not None:
            raise ValueError(DOCUMENTS_WITH_A_CACHE)
        if self.sequence_parallel:  # the latent enters the TP region inside kv_b_proj: x holds s/R positions
            raise ValueError("a KV cache of model.attention_type \"mla\" holds the whole latent of every position: "
                             "generate with parallelism.sequence_parallel off (the weights are the same)")

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # the norm before entering the TP region

    def extra_repr(self) -> str:
        latent = f"q latent {self.q_lora_rank}" if self.q_lora_rank is not None else "q_proj"
        return (f"{self.heads} heads on this rank, q/k {self.qk_nope_head_dim} + {self.qk_rope_head_dim} rope "
                f"({'interleaved' if self.rope_interleave else 'halves'}), v {self.v_head_dim}, {latent}, kv latent "
                f"{self.kv_lora_rank}, softmax scale {self.softmax_scale:.6g}")
