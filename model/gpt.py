"""The GPT, as a list of pipeline layers (GPT-2 by default, the Llama family by the config's architecture fields).

What flows between layers (and between pipeline stages) is documented here, once:

    batch for the first stage   (tokens (b, s) int64, position_ids (b, s) int64)
    batch for the last stage    (labels (b, s) int64, loss_mask (b, s) float)
    word embedding (tied or not) -> (word_embeddings (b, s, h), position_ids (b, s))
    PositionEmbedding ("learned") -> hidden (b, s, h): adds the position table, then dropout
      or EmbeddingDropout ("rope") -> hidden (b, s, h): dropout only; position_ids end here
    TransformerLayer x L        -> hidden (b, s, h)        <- the only tensor sent between stages
    FinalLayerNorm / FinalRMSNorm -> hidden (b, s, h)
    output head                 -> logits (b, s, V/R)       this rank's vocabulary slice (tied: the word embedding's
                                                             weight; untied: OutputHead, its own weight)
    loss_fn(logits, (labels, loss_mask)) -> scalar: masked mean over the micro-batch's tokens

RoPE rotates q and k inside each block's attention at positions 0 .. s-1 of the sample, which is what position_ids
holds by default (data/loader.py): so the tuple between stages stays the hidden tensor alone, for every architecture.

Packed samples (data.reset_attention_mask / data.reset_position_ids) add one tensor to the first stage's batch:

    batch for the first stage   (tokens, position_ids, segment_ids)   segment_ids (b, s) int64: the document of each
                                                                        token; position_ids restart at each document
    between the position layer and the final norm: (hidden, position_ids, segment_ids)   <- sent between stages

The two id tensors travel beside the hidden state with static shapes (whole (b, s) also under sequence parallelism;
DeepSpeed sends them and, being integers, expects no gradient for them), every block's attention masks across
documents (``document_mask``: block-diagonal causal) and rotates RoPE at each token's position in its document, and
the final norm drops them.

The pieces that differ between architectures are chosen from the config by the tables below (POSITION_LAYERS,
NORMS, FINAL_NORMS, MLPS); the skeleton (embedding -> blocks -> norm -> head) is one.

Every layer is built from (ModelConfig, ParallelContext, seed, layer_number) and initialises itself (model/init.py),
so a stage holds exactly its part of the unsplit model.

With sequence parallelism (parallelism.sequence_parallel) every (b, s, h) above between the embedding and the head
is this TP rank's sequence shard (b, s/R, h), the tensor sent between stages included (model/layers.py says where
the sequence is gathered and scattered); the logits are the whole sequence again.

Dropout draws from two random streams (model/random.py tabulates them): a dropout on a replicated activation (the
embedding dropout, and the hidden dropout after each row-parallel output, without sequence parallelism) from torch's
default stream, the same on every TP rank of a stage; a dropout on a sharded activation (the attention dropout inside
SDPA, on this rank's heads; with sequence parallelism also the embedding and hidden dropouts, on this rank's
positions) from the tensor-parallel stream, different on every TP rank and stage. The layers of one model share one
tensor-parallel ``RNGStream``.

Recomputation (model.recompute, per block: ModelConfig.recompute_at) happens in TransformerLayer: "full" stores the
block's input and reruns the block in the backward pass, "selective" stores q, k, v and reruns only the attention
core (SelfAttention), "none" stores everything. Both replay the dropout masks of the forward (model/random.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from common import deepspeed_internals as ds_internals
from model.config import ModelConfig, stages_per_rank
from model.init import normal_sharded_, parameter_seed
from model.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_shared_by_heads,
    partial_gradient_parameters,
)
from model.loss import GPTLoss, gpt_loss
from model.moe import MoEBlock, MoEMLP, sparse_layers
from model.parallel import ParallelContext
from model.random import RNGStream, checkpoint, tensor_parallel_stream_seed

Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""What a block takes and gives: the hidden state, or (hidden, position_ids, segment_ids) for packed samples."""

EMBEDDING_LAYER = 0  # layer_number of the embeddings in seeds; blocks are 1..L, the final norm L + 1


class WordEmbedding(VocabParallelEmbedding):
    """The word embedding, shared (tied) by the first stage's input and the last stage's output head.

    Its forward is the input side. The first stage's copy is a real layer of the pipeline, so DeepSpeed saves and
    loads it (layer_00); the last stage uses it through ``output_logits`` (a function DeepSpeed neither saves nor
    loads) and receives the loaded weight from the first stage when DeepSpeed synchronises tied weights.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int) -> None:
        super().__init__(config.padded_vocab_size(ctx.tensor_parallel_size), config.hidden_size, ctx,
                         vocab_size=config.vocab_size, init_std=config.init_method_std,
                         seed=parameter_seed(seed, EMBEDDING_LAYER, "word_embeddings"))

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, *positions_and_documents = inputs  # (b, s), then (b, s) position_ids [, (b, s) segment_ids]
        return super().forward(tokens), *positions_and_documents  # (b, s, h), ...


def output_logits(embedding: WordEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return embedding.logits(hidden)  # (b, s, V/R)


class OutputHead(VocabParallelEmbedding):
    """The untied output head (tie_word_embeddings False): its own [V/R, h] vocab-parallel weight on the last stage,
    the same layout, init std and -inf padded rows as the tied head. Its forward is the logits."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int) -> None:
        super().__init__(config.padded_vocab_size(ctx.tensor_parallel_size), config.hidden_size, ctx,
                         vocab_size=config.vocab_size, init_std=config.init_method_std,
                         seed=parameter_seed(seed, EMBEDDING_LAYER, "output_head"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)  # (b, s, h) replicated -> (b, s, V/R)


class HiddenDropout(nn.Module):
    """Dropout on a (b, s, h) activation outside the TP matmuls: replicated, it draws from torch's default stream
    (the same mask on every TP rank); a sequence shard (sequence parallelism), from the tensor-parallel stream."""

    def __init__(self, p: float, ctx: ParallelContext, rng: RNGStream) -> None:
        super().__init__()
        self.p, self.rng, self.on_shards = p, rng, ctx.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.rng.fork(enabled=self.on_shards):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, {'tensor-parallel stream (sequence shards)' if self.on_shards else 'default stream'}"


def _sequence_shard(ctx: ParallelContext, full: torch.Tensor, shard_length: int) -> torch.Tensor:
    """This TP rank's positions [r s/R, (r+1) s/R) of a (b, s) tensor (all of it without sequence parallelism)."""
    if not ctx.sequence_parallel:
        return full
    start = ctx.tensor_parallel_rank * shard_length
    return full[:, start:start + shard_length]


class PositionEmbedding(nn.Module):
    """Adds the learned absolute position embedding (replicated on every TP rank), then dropout."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, rng: RNGStream | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(config.max_position_embeddings, config.hidden_size))
        normal_sharded_(self.weight, config.init_method_std, parameter_seed(seed, EMBEDDING_LAYER, "position"))
        self.dropout = HiddenDropout(config.hidden_dropout, ctx, rng or RNGStream(tensor_parallel_stream_seed(seed, ctx)))

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> Hidden:
        word_embeddings, position_ids, *documents = inputs  # (b, s, h) or this rank's (b, s/R, h), (b, s) [, (b, s)]
        positions = _sequence_shard(self.ctx, position_ids, word_embeddings.shape[1])
        hidden = self.dropout(word_embeddings + F.embedding(positions, self.weight))  # like word_embeddings
        return (hidden, position_ids, *documents) if documents else hidden


class EmbeddingDropout(nn.Module):
    """The position layer of a RoPE model: the embedding dropout alone (positions act in attention)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, rng: RNGStream | None = None) -> None:
        super().__init__()
        self.dropout = HiddenDropout(config.hidden_dropout, ctx, rng or RNGStream(tensor_parallel_stream_seed(seed, ctx)))

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> Hidden:
        word_embeddings, position_ids, *documents = inputs  # RoPE acts in attention (the module docstring)
        hidden = self.dropout(word_embeddings)  # (b, s, h)
        return (hidden, position_ids, *documents) if documents else hidden


POSITION_LAYERS = {"learned": PositionEmbedding, "rope": EmbeddingDropout}


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(b, 1, s, s) bool, True where query i may attend to key j: j <= i and both in the same document (the same
    segment id). The block-diagonal causal mask of packed samples, Megatron's reset_attention_mask."""
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same_document = segment_ids[:, :, None] == segment_ids[:, None, :]  # (b, s, s)
    return (same_document & causal).unsqueeze(1)


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor,
                            grouped: bool) -> torch.Tensor:
    """The attention of ``document_mask`` (model.attention_backend "flex"): FlexAttention with a block mask made from
    the (b, s) ids, so that the blocks outside every document's causal square are never computed; q (b, nh, s, d),
    k and v (b, g, s, d) with ``grouped`` query heads per key head. No dropout (the config refuses it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(batch, head, query, key):
        return (segment_ids[batch, query] == segment_ids[batch, key]) & (key <= query)

    length = q.shape[-2]
    block_mask = create_block_mask(same_document_causal, q.shape[0], None, length, length, device=q.device)
    return _flex_attention(q.device.type)(q, k, v, block_mask=block_mask, enable_gqa=grouped)


@functools.cache
def _flex_attention(device_type: str):
    """FlexAttention, compiled on CUDA (its fused kernel), eager elsewhere (forward only on CPU: torch's own limit)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


class KVCache:
    """The keys and values one block's attention has seen, on this rank's heads (inference only).

        keys, values   (b, g/R, past, d) each: the key/value heads of this TP rank, like the attention itself

    A forward with a cache attends over the cached positions and its own, then appends its keys and values; RoPE
    rotates the new q and k at positions past .. past + s - 1, so the cache holds rotated keys, as transformers'
    does. ``kv_caches(module)`` gives every attention of a stage its own for one sequence (or batch) at a time."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (b, g/R, s, d) keys and values; return all of them, cached first."""
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)
        self.keys, self.values = keys, values
        return keys, values


class SelfAttention(nn.Module):
    """Causal self-attention over this rank's heads: fused QKV column-parallel, output row-parallel.

    With g key/value heads (groups) of q = heads / g query heads each, the QKV output rows are laid out per group,
    [g, q + 2, head_dim]: the group's q query heads, then its key head, then its value head. Query head j belongs to
    group j // q (transformers' repeat_kv order). A contiguous slice of rows is therefore a set of whole groups with
    all their heads, so TP rank r holds groups [r g/R, (r+1) g/R) and attends alone; the full weight is the plain
    concatenation of the shards on dim 0. Multi-head attention (q = 1) is GPT-2's [heads, 3, head_dim].
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_number: int,
                 rng: RNGStream, recompute_core: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.recompute_core = recompute_core  # selective recomputation: store q, k, v; rerun the core in backward
        self.groups = config.num_key_value_heads // ctx.tensor_parallel_size
        self.queries_per_group = config.queries_per_key_value_head
        self.heads = self.groups * self.queries_per_group
        self.head_dim = config.head_dim
        self.dropout = config.attention_dropout
        self.backend = config.attention_backend  # the kernel of document masks: "sdpa" or "flex"
        self.rng = rng  # the tensor-parallel stream: these heads' dropout masks are this rank's own
        self.qkv = ColumnParallelLinear(h, config.qkv_size, ctx, init_std=config.init_method_std,
                                        seed=parameter_seed(seed, layer_number, "attention.qkv"),
                                        bias=config.qkv_has_bias)
        self.dense = RowParallelLinear(config.attention_size, h, ctx,
                                       init_std=config.output_layer_init_std,
                                       seed=parameter_seed(seed, layer_number, "attention.dense"),
                                       bias=config.other_linears_have_bias)
        self.rotary = (RotaryEmbedding(self.head_dim, config.rope_theta, config.rope_scaling)
                       if config.position_embedding == "rope" else None)
        self.q_norm = self.k_norm = None
        if config.qk_layernorm:  # per head, weights shared by the heads: partial gradients over TP
            self.q_norm, self.k_norm = head_norm(config), head_norm(config)
            for parameter in (*self.q_norm.parameters(), *self.k_norm.parameters()):
                mark_shared_by_heads(parameter)
        self.kv_cache: KVCache | None = None  # set for inference by kv_caches()
        self.layer_number = layer_number
        self.max_logit: torch.Tensor | None = None  # set by a forward inside attention_logit_probe()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids``, ``segment_ids`` (b, s): a packed sample's positions and documents (documents never see
        each other; RoPE at each token's position in its document); without, one causal sequence 0 .. s-1."""
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
        if segment_ids is not None and self.kv_cache is not None:
            raise ValueError("document masks (packed samples) are for training: a KV cache holds one sequence")
        if self.rotary is not None:
            q, k = self.rotary(q, k, offset=past, position_ids=position_ids)
        if self.kv_cache is not None:
            k, v = self.kv_cache.extend(k, v)  # each (b, g/R, past + s, d)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            context = checkpoint(self.rng, self.core, q, k, v, segment_ids)
        else:
            context = self.core(q, k, v, segment_ids)  # (b, nh/R, s, d)
        context = context.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)  # (b, s, nh d/R)
        return self.dense(context)  # (b, s, h)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v with the attention dropout, causal: what selective recomputation reruns.

        With a KV cache the s queries are the last s of the keys' positions: one query sees every key, several see
        the keys up to their own position (a bottom-right causal mask). With ``segment_ids`` (b, s) the mask is
        block-diagonal causal: a query sees the keys up to its own position in its own document (``document_mask``;
        made here from the (b, s) ids, so recomputation stores those, not the (b, s, s) mask)."""
        dropout = self.dropout if self.training else 0.0
        queries, keys = q.shape[-2], k.shape[-2]
        if self.max_logit is not None:  # the fused kernel never forms the scores: form them for the probe only
            self.max_logit = torch.maximum(self.max_logit, largest_logit(q, k, segment_ids))
        if segment_ids is not None and self.backend == "flex":
            return flex_document_attention(q, k, v, segment_ids, self.queries_per_group > 1)
        mask = None
        if segment_ids is not None:
            mask = document_mask(segment_ids)  # (b, 1, s, s)
        elif keys > queries > 1:
            mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(diagonal=keys - queries)
        with self.rng.fork(enabled=dropout > 0):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  is_causal=queries == keys and segment_ids is None,
                                                  dropout_p=dropout,
                                                  enable_gqa=self.queries_per_group > 1)  # (b, nh/R, s, d)

    def extra_repr(self) -> str:
        return (f"{self.groups} key/value groups of {self.queries_per_group} query heads on this rank, "
                f"head_dim {self.head_dim}")


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_number: int) -> None:
        super().__init__()
        bias = config.other_linears_have_bias
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, ctx, bias=bias,
                                        init_std=config.init_method_std, seed=parameter_seed(seed, layer_number, "mlp.fc1"))
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, ctx, bias=bias,
                                     init_std=config.output_layer_init_std,
                                     seed=parameter_seed(seed, layer_number, "mlp.fc2"))
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))  # (b, s, ffn/R) inside


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): h -> 2 x ffn (one column-parallel matrix) -> ffn -> h (row-parallel).

    ``gate_up.weight`` is [gate; up], each [ffn, h]; TP rank r holds [gate rows r; up rows r] ([2 ffn/R, h]), so its
    own gate and up features meet without communication. Merging shards: split each in 2 halves, concatenate the
    first halves, then the second (DeepSpeed's PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0).
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_number: int) -> None:
        super().__init__()
        bias = config.other_linears_have_bias
        self.gate_up = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, ctx, bias=bias, sub_matrices=2,
                                            init_std=config.init_method_std,
                                            seed=parameter_seed(seed, layer_number, "mlp.gate_up"))
        self.down = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, ctx, bias=bias,
                                      init_std=config.output_layer_init_std,
                                      seed=parameter_seed(seed, layer_number, "mlp.down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # each (b, s, ffn/R)
        return self.down(F.silu(gate) * up)  # (b, s, h)


MLPS = {"gelu": MLP, "swiglu": SwiGLUMLP}


def _layer_norm(config: ModelConfig) -> nn.Module:
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


def _rms_norm(config: ModelConfig) -> nn.Module:
    return RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)


NORMS = {"layernorm": _layer_norm, "rmsnorm": _rms_norm}  # the blocks' two norms (replicated on every TP rank)


def head_norm(config: ModelConfig) -> nn.Module:
    """model.qk_layernorm's norm of one query or key head: config.norm's kind, head_dim wide."""
    if config.norm == "layernorm":
        return nn.LayerNorm(config.head_dim, eps=config.layernorm_epsilon)
    return RMSNorm(config.head_dim, eps=config.layernorm_epsilon)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(ln1(x))), then + drop(mlp(ln2(x))); ln1 and ln2 are config.norm's norm. In a
    sparse layer of a Mixture-of-Experts model (config.moe.is_sparse) the MLP is model/moe.py's MoEMLP.

    ``rng`` is the model's tensor-parallel stream, shared by all its layers; a layer built alone gets its own.
    ``recompute`` is this block's mode, config.recompute_at(layer_number, PP): "full" checkpoints the whole block,
    "selective" only its attention core, "none" nothing.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_number: int,
                 rng: RNGStream | None = None) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.rng = rng or RNGStream(tensor_parallel_stream_seed(seed, ctx))
        self.recompute = config.recompute_at(layer_number, ctx.pipeline_parallel_size)
        self.ln1 = NORMS[config.norm](config)
        self.attention = SelfAttention(config, ctx, seed, layer_number, self.rng,
                                       recompute_core=self.recompute == "selective")
        self.ln2 = NORMS[config.norm](config)
        if config.moe is not None and config.moe.is_sparse(layer_number):
            self.mlp = MoEMLP(MoEBlock(config.moe, config.hidden_size, ctx, seed=seed, layer_number=layer_number,
                                       init_std=config.init_method_std,
                                       output_init_std=config.output_layer_init_std,
                                       expert_parallel_group=ctx.expert_parallel_group))
        else:
            self.mlp = MLPS[config.mlp](config, ctx, seed, layer_number)
        self.dropout = HiddenDropout(config.hidden_dropout, ctx, self.rng)

    def forward(self, x: Hidden) -> Hidden:
        """The hidden state alone, or with a packed sample's (position_ids, segment_ids), passed on untouched."""
        hidden, documents = (x[0], x[1:]) if isinstance(x, tuple) else (x, ())
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            hidden = checkpoint(self.rng, self.block, hidden, *documents)
        else:
            hidden = self.block(hidden, *documents)
        return (hidden, *documents) if documents else hidden

    def block(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
              segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        attention = self.attention(self.ln1(x), position_ids, segment_ids)
        x = x + self.dropout(attention)  # (b, s, h), or (b, s/R, h) with sequence parallelism
        return x + self.dropout(self.mlp(self.ln2(x)))

    def extra_repr(self) -> str:
        return f"recompute={self.recompute}"


class FinalLayerNorm(nn.LayerNorm):
    """The last norm: where a packed sample's positions and documents end (the head sees the hidden state alone)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int) -> None:
        super().__init__(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, x: Hidden) -> torch.Tensor:
        return super().forward(x[0] if isinstance(x, tuple) else x)


class FinalRMSNorm(RMSNorm):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int) -> None:
        super().__init__(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, x: Hidden) -> torch.Tensor:
        return super().forward(x[0] if isinstance(x, tuple) else x)


FINAL_NORMS = {"layernorm": FinalLayerNorm, "rmsnorm": FinalRMSNorm}


def largest_logit(q: torch.Tensor, k: torch.Tensor, segment_ids: torch.Tensor | None = None,
                  max_scores: int = 2**26) -> torch.Tensor:
    """The largest attention logit q.k / sqrt(d) over the pairs attention computes (query i, key j <= i; with
    ``segment_ids``, of the same document too), fp32, on the device: q (b, nh/R, s, d), k (b, g/R, s, d) with nh/g
    query heads per key head (training only: no cache). The scores are formed a few heads at a time, at most
    ``max_scores`` fp32 values (256 MiB) at once, whatever s is."""
    q, k = q.detach(), k.detach()
    heads, queries_per_group, length = q.shape[1], q.shape[1] // k.shape[1], q.shape[-2]
    if segment_ids is None:
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(diagonal=1)
    else:
        future = ~document_mask(segment_ids)  # (b, 1, s, s): the future and the other documents
    chunk = max(1, max_scores // (q.shape[0] * length * length))
    largest = torch.tensor(float("-inf"), device=q.device)
    for start in range(0, heads, chunk):
        head_ids = torch.arange(start, min(start + chunk, heads), device=q.device)
        keys = k[:, head_ids // queries_per_group].float()  # query head j reads key head j // (nh/g)
        scores = q[:, head_ids].float() @ keys.transpose(-1, -2) / k.shape[-1] ** 0.5  # (b, chunk, s, s)
        largest = torch.maximum(largest, scores.masked_fill_(future, float("-inf")).amax())
    return largest


@contextmanager
def attention_logit_probe(module: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Inside, every attention of ``module`` keeps the largest logit of its forwards; on exit the dict maps each
    block's layer_number (1 .. L) to it (a device scalar: read on the host when it suits the caller)."""
    attentions = [m for m in module.modules() if isinstance(m, SelfAttention)]
    found: dict[int, torch.Tensor] = {}
    for attention in attentions:
        attention.max_logit = torch.tensor(float("-inf"), device=attention.dense.weight.device)
    try:
        yield found
    finally:
        for attention in attentions:
            found[attention.layer_number] = attention.max_logit
            attention.max_logit = None


@contextmanager
def kv_caches(module: nn.Module) -> Iterator[list[KVCache]]:
    """Give every attention in ``module`` (a stage, or the whole GPT) an empty KV cache for the duration."""
    attentions = [m for m in module.modules() if isinstance(m, SelfAttention)]
    caches = [KVCache() for _ in attentions]
    for attention, cache in zip(attentions, caches, strict=True):
        attention.kv_cache = cache
    try:
        yield caches
    finally:
        for attention in attentions:
            attention.kv_cache = None


def gpt_layer_specs(config: ModelConfig, ctx: ParallelContext, seed: int, rng: RNGStream | None = None) -> list:
    """The whole model as DeepSpeed LayerSpecs, first layer to last (the one place the model is assembled).

    ``rng``: the tensor-parallel stream the blocks share (a new one seeded for this rank when not given)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    rng = rng or RNGStream(tensor_parallel_stream_seed(seed, ctx))
    if config.tie_word_embeddings:
        embedding = partial(TiedLayerSpec, "word_embeddings", WordEmbedding, config, ctx, seed,
                            tied_weight_attr="weight")
        first, head = embedding(), embedding(forward_fn=output_logits)  # the first is a module: saved as layer_00
    else:
        first, head = LayerSpec(WordEmbedding, config, ctx, seed), LayerSpec(OutputHead, config, ctx, seed)
    return [
        first,
        LayerSpec(POSITION_LAYERS[config.position_embedding], config, ctx, seed, rng),
        *[LayerSpec(TransformerLayer, config, ctx, seed, n, rng) for n in range(1, config.num_layers + 1)],
        LayerSpec(FINAL_NORMS[config.norm], config, ctx, seed),
        head,
    ]


def build_pipeline_model(config: ModelConfig, ctx: ParallelContext, seed: int, partition_method: str,
                         z_loss: float = 0.0, pipeline_schedule: str = "1f1b"):
    """The DeepSpeed PipelineModule of this rank's stage (collective: all ranks call it).

    Its ``tensor_parallel_rng`` is the stage's tensor-parallel stream, which checkpoints save and restore.
    Recomputation replays that stream (model/random.py). With sequence parallelism the replicated parameters'
    gradients are summed over the TP group once per step, where DeepSpeed sums the tied embedding's: DeepSpeed's
    pipeline engine all-reduces every (parameter, group) pair that ``get_tied_weights_and_groups`` lists (the fp32
    accumulation buffer under BF16_Optimizer, ``.grad`` otherwise) after the last backward of the step, before the
    data-parallel reduction, the gradient norm and the optimizer. The per-head q/k norms (model.qk_layernorm) are
    reduced the same way at any TP > 1: each rank's heads give a part of their gradient
    (model/layers.py, partial_gradient_parameters). Its ``loss_fn`` is a GPTLoss (model/loss.py) with ``z_loss``.

    ``pipeline_schedule`` "dualpipev" builds DeepSpeed's DualPipeVModule instead: the same layer list cut into 2 PP
    stages, this rank holding stage r and 2 PP - 1 - r (so both ends of the tied embedding, on rank 0: its gradient
    needs no all-reduce over the pipeline). Layer files in checkpoints are named by layer index, as under 1F1B.

    With expert parallelism (EP > 1), a stage that holds sparse blocks also holds a parameter-less
    ``expert_parallel_marker`` (common/deepspeed_internals.py): DeepSpeed's engine then reduces the expert gradients
    over the expert-data-parallel group and counts them in the norm over the EP group."""
    from deepspeed.pipe import DualPipeVModule, PipelineModule

    base = DualPipeVModule if pipeline_schedule == "dualpipev" else PipelineModule

    class GPTPipelineModule(base):
        def get_tied_weights_and_groups(self):
            pairs = super().get_tied_weights_and_groups()
            if ctx.tensor_parallel_size > 1:
                pairs += [(p, ctx.tensor_parallel_group)
                          for p in partial_gradient_parameters(self, ctx.sequence_parallel)]
            return pairs

    config.check_parallel(ctx.tensor_parallel_size, ctx.pipeline_parallel_size, ctx.sequence_parallel,
                          stages_per_rank(pipeline_schedule))
    rng = RNGStream(tensor_parallel_stream_seed(seed, ctx))
    objective = GPTLoss(ctx, z_loss)
    module = GPTPipelineModule(
        layers=gpt_layer_specs(config, ctx, seed, rng),
        topology=ctx.topology,
        loss_fn=objective,
        partition_method=partition_method,
    )
    module.tensor_parallel_rng = rng
    module.expert_parallel_size = ctx.expert_parallel_size  # its checkpoints' layout (training/checkpoint.py)
    if ctx.expert_parallel_size > 1 and sparse_layers(module):  # DeepSpeed's engine: has_moe_layers on this stage
        module.expert_parallel_marker = ds_internals.expert_parallel_marker(config.moe.num_experts,
                                                                            ctx.expert_parallel_size)
    module.objective = objective  # the loss function itself, also when a guard wraps loss_fn (training/guards.py)
    return module


class GPT(nn.Module):
    """The same layers run in sequence in one process: the unsplit reference, and the model the HF export mirrors.

    With a TP context it is one tensor-parallel rank of the full depth (no pipeline).
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext | None = None, seed: int = 1234) -> None:
        super().__init__()
        self.ctx = ctx or ParallelContext()
        self.tensor_parallel_rng = RNGStream(tensor_parallel_stream_seed(seed, self.ctx))
        self.word_embeddings = WordEmbedding(config, self.ctx, seed)
        self.position_embedding = POSITION_LAYERS[config.position_embedding](config, self.ctx, seed,
                                                                              self.tensor_parallel_rng)
        self.layers = nn.ModuleList(TransformerLayer(config, self.ctx, seed, n, self.tensor_parallel_rng)
                                    for n in range(1, config.num_layers + 1))
        self.final_norm = FINAL_NORMS[config.norm](config, self.ctx, seed)
        self.output_head = None if config.tie_word_embeddings else OutputHead(config, self.ctx, seed)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``segment_ids`` (b, s): the documents of packed samples (module docstring), or None: one sequence."""
        documents = () if segment_ids is None else (segment_ids,)
        hidden = self.position_embedding(self.word_embeddings((tokens, position_ids, *documents)))
        for layer in self.layers:
            hidden = layer(hidden)
        hidden = self.final_norm(hidden)
        if self.output_head is None:
            return output_logits(self.word_embeddings, hidden)  # (b, s, V/R)
        return self.output_head(hidden)  # (b, s, V/R)

    def loss(self, tokens, position_ids, labels, loss_mask, segment_ids=None) -> torch.Tensor:
        return gpt_loss(self.ctx, self(tokens, position_ids, segment_ids), (labels, loss_mask))
