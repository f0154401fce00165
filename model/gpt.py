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
The blocks share one RotaryEmbedding (``shared_rotary``): a stage makes the cos and sin table once per micro-batch,
at its first block, and the others rotate with it.

Packed samples (data.reset_attention_mask / data.reset_position_ids) add one tensor to the first stage's batch:

    batch for the first stage   (tokens, position_ids, segment_ids)   segment_ids (b, s) int64: the document of each
                                                                        token; position_ids restart at each document
    between the position layer and the final norm: (hidden, position_ids, segment_ids)   <- sent between stages

The two id tensors travel beside the hidden state with static shapes (whole (b, s) also under sequence parallelism;
DeepSpeed sends them and, being integers, expects no gradient for them), every block's attention masks across
documents (model/attention.py ``document_mask``: block-diagonal causal) and rotates RoPE at each token's position in
its document, and the final norm drops them.

The pieces that differ between architectures are chosen from the config by the tables below (POSITION_LAYERS,
ATTENTIONS, NORMS, FINAL_NORMS, MLPS); the skeleton (embedding -> blocks -> norm -> head) is one.

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
core (model/attention.py CausalAttention, MLA's too), "none" stores everything. Both replay the dropout masks of the
forward (model/random.py).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from common import deepspeed_internals as ds_internals
from model.attention import BlockMasks, SelfAttention
from model.config import ModelConfig, stages_per_rank
from model.init import normal_sharded_, parameter_seed
from model.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    partial_gradient_parameters,
)
from model.loss import GPTLoss, gpt_loss
from model.mla import MultiHeadLatentAttention
from model.moe import MoEBlock, MoEMLP, sparse_layers
from model.mtp import MultiTokenPrediction, head_logits, token_embeddings
from model.parallel import ParallelContext
from model.random import RNGStream, checkpoint, tensor_parallel_stream_seed

Hidden = torch.Tensor | tuple[torch.Tensor, ...]
"""What a block takes and gives: the hidden state, or (hidden, position_ids, segment_ids) for packed samples; with
model.mtp the tokens last: (hidden, tokens) or (hidden, position_ids, segment_ids, tokens)."""


def unpack(x: Hidden, carries_tokens: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """(hidden, the packed sample's ids or (), the tokens model.mtp carries or None)."""
    if not isinstance(x, tuple):
        return x, (), None
    if carries_tokens:
        return x[0], x[1:-1], x[-1]
    return x[0], x[1:], None


def pack(hidden: torch.Tensor, packed_ids: tuple[torch.Tensor, ...], tokens: torch.Tensor | None) -> Hidden:
    carried = (*packed_ids, *(() if tokens is None else (tokens,)))
    return (hidden, *carried) if carried else hidden

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
        self.carries_tokens = config.mtp is not None

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, *positions_and_documents = inputs  # (b, s), then (b, s) position_ids [, (b, s) segment_ids]
        carried = (tokens,) if self.carries_tokens else ()  # for model.mtp's depths on the last stage
        return self.embed(tokens), *positions_and_documents, *carried  # (b, s, h), ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens)  # (b, s) -> (b, s, h), or this rank's (b, s/R, h) under sequence parallelism


def output_logits(embedding: WordEmbedding, hidden: Hidden) -> torch.Tensor | tuple[torch.Tensor, ...]:
    if isinstance(hidden, tuple):  # model.mtp: (normed, what its depths read), passed on
        return embedding.logits(hidden[0]), *hidden[1:]
    return embedding.logits(hidden)  # (b, s, V/R)


class OutputHead(VocabParallelEmbedding):
    """The untied output head (tie_word_embeddings False): its own [V/R, h] vocab-parallel weight on the last stage,
    the same layout, init std and -inf padded rows as the tied head. Its forward is the logits."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int) -> None:
        super().__init__(config.padded_vocab_size(ctx.tensor_parallel_size), config.hidden_size, ctx,
                         vocab_size=config.vocab_size, init_std=config.init_method_std,
                         seed=parameter_seed(seed, EMBEDDING_LAYER, "output_head"))

    def forward(self, hidden: Hidden) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if isinstance(hidden, tuple):  # model.mtp: (normed, what its depths read), passed on
            return self.logits(hidden[0]), *hidden[1:]
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
        self.ctx, self.carries_tokens = ctx, config.mtp is not None
        self.weight = nn.Parameter(torch.empty(config.max_position_embeddings, config.hidden_size))
        normal_sharded_(self.weight, config.init_method_std, parameter_seed(seed, EMBEDDING_LAYER, "position"))
        self.dropout = HiddenDropout(config.hidden_dropout, ctx, rng or RNGStream(tensor_parallel_stream_seed(seed, ctx)))

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> Hidden:
        # (b, s, h) or this rank's (b, s/R, h); (b, s) position_ids [, (b, s) segment_ids] [, (b, s) tokens]
        word_embeddings, ids, tokens = unpack(inputs, self.carries_tokens)
        positions = _sequence_shard(self.ctx, ids[0], word_embeddings.shape[1])
        hidden = self.dropout(word_embeddings + F.embedding(positions, self.weight))  # like word_embeddings
        return pack(hidden, ids if len(ids) > 1 else (), tokens)  # the positions go on with a packed sample's ids


class EmbeddingDropout(nn.Module):
    """The position layer of a RoPE model: the embedding dropout alone (positions act in attention)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, rng: RNGStream | None = None) -> None:
        super().__init__()
        self.dropout = HiddenDropout(config.hidden_dropout, ctx, rng or RNGStream(tensor_parallel_stream_seed(seed, ctx)))
        self.carries_tokens = config.mtp is not None

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> Hidden:
        word_embeddings, ids, tokens = unpack(inputs, self.carries_tokens)  # RoPE acts in attention (module docstring)
        hidden = self.dropout(word_embeddings)  # (b, s, h)
        return pack(hidden, ids if len(ids) > 1 else (), tokens)


POSITION_LAYERS = {"learned": PositionEmbedding, "rope": EmbeddingDropout}


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
ATTENTIONS = {"mha": SelfAttention, "mla": MultiHeadLatentAttention}  # model.attention_type: each block's attention


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(ln1(x))), then + drop(mlp(ln2(x))); ln1 and ln2 are config.norm's norm. In a
    sparse layer of a Mixture-of-Experts model (config.moe.is_sparse) the MLP is model/moe.py's MoEMLP.

    ``rng`` is the model's tensor-parallel stream, shared by all its layers, ``rotary`` its RoPE (``shared_rotary``:
    cos and sin made once per micro-batch for a stage's blocks) and ``block_masks`` its FlexAttention block masks
    (likewise once per micro-batch); a layer built alone gets its own.
    ``recompute`` is this block's mode, config.recompute_at(layer_number, PP): "full" checkpoints the whole block,
    "selective" only its attention core, "none" nothing.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_number: int,
                 rng: RNGStream | None = None, rotary: RotaryEmbedding | None = None,
                 block_masks: BlockMasks | None = None, carries_tokens: bool | None = None) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.carries_tokens = config.mtp is not None if carries_tokens is None else carries_tokens
        self.rng = rng or RNGStream(tensor_parallel_stream_seed(seed, ctx))
        self.recompute = config.recompute_at(layer_number, ctx.pipeline_parallel_size)
        self.ln1 = NORMS[config.norm](config)
        self.attention = ATTENTIONS[config.attention_type](config, ctx, seed, layer_number, self.rng,
                                                           recompute_core=self.recompute == "selective",
                                                           rotary=rotary, block_masks=block_masks)
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
        """The hidden state alone, or with a packed sample's (position_ids, segment_ids) and model.mtp's tokens,
        passed on untouched."""
        hidden, packed_ids, tokens = unpack(x, self.carries_tokens)  # () or (position_ids, segment_ids)
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            hidden = checkpoint(self.rng, self.block, hidden, *packed_ids)
        else:
            hidden = self.block(hidden, *packed_ids)
        return pack(hidden, packed_ids, tokens)

    def block(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
              segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        attention = self.attention(self.ln1(x), position_ids, segment_ids)
        x = x + self.dropout(attention)  # (b, s, h), or (b, s/R, h) with sequence parallelism
        return x + self.dropout(self.mlp(self.ln2(x)))

    def extra_repr(self) -> str:
        return f"recompute={self.recompute}"


class FinalNorm:
    """The last norm: where a packed sample's positions and documents end (the head sees the hidden state alone).
    With model.mtp it keeps what the depths read: (normed, hidden, *ids, tokens) (model/mtp.py)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int) -> None:
        super().__init__(config.hidden_size, eps=config.layernorm_epsilon)
        self.carries_tokens = config.mtp is not None

    def forward(self, x: Hidden) -> Hidden:
        if self.carries_tokens:
            return super().forward(x[0]), *x
        return super().forward(x[0] if isinstance(x, tuple) else x)


class FinalLayerNorm(FinalNorm, nn.LayerNorm):
    pass


class FinalRMSNorm(FinalNorm, RMSNorm):
    pass


FINAL_NORMS = {"layernorm": FinalLayerNorm, "rmsnorm": FinalRMSNorm}


def shared_rotary(config: ModelConfig) -> RotaryEmbedding | None:
    """The one RoPE of a model's blocks (a RoPE config; None otherwise): each stage's blocks then rotate with the same
    cos and sin table, made by the first block of each micro-batch (model/layers.py RotaryEmbedding), rotary_dim wide
    (head_dim, or MLA's qk_rope_head_dim)."""
    if config.position_embedding != "rope":
        return None
    return RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)


def gpt_layer_specs(config: ModelConfig, ctx: ParallelContext, seed: int, rng: RNGStream | None = None) -> list:
    """The whole model as DeepSpeed LayerSpecs, first layer to last (the one place the model is assembled).

    ``rng``: the tensor-parallel stream the blocks share (a new one seeded for this rank when not given). The blocks
    share one RotaryEmbedding and one BlockMasks too: a stage builds only its own blocks, so each stage holds one."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    rng = rng or RNGStream(tensor_parallel_stream_seed(seed, ctx))
    rotary, block_masks = shared_rotary(config), BlockMasks()
    embedding = partial(TiedLayerSpec, "word_embeddings", WordEmbedding, config, ctx, seed, tied_weight_attr="weight")
    if config.tie_word_embeddings:
        first, head = embedding(), embedding(forward_fn=output_logits)  # the first is a module: saved as layer_00
        shared_head = partial(embedding, forward_fn=head_logits)
    elif config.mtp is not None:  # the last stage embeds tokens too, and the depths share the head
        first, output_head = embedding(), partial(TiedLayerSpec, "output_head", OutputHead, config, ctx, seed,
                                                  tied_weight_attr="weight")
        head, shared_head = output_head(), partial(output_head, forward_fn=head_logits)
    else:
        first, head = LayerSpec(WordEmbedding, config, ctx, seed), LayerSpec(OutputHead, config, ctx, seed)
    layers = [
        first,
        LayerSpec(POSITION_LAYERS[config.position_embedding], config, ctx, seed, rng),
        *[LayerSpec(TransformerLayer, config, ctx, seed, n, rng, rotary, block_masks)
          for n in range(1, config.num_layers + 1)],
        LayerSpec(FINAL_NORMS[config.norm], config, ctx, seed),
        head,
    ]
    if config.mtp is not None:  # model/mtp.py: L + 4 .. L + 6, on the last stage (GPTPipelineModule's partition)
        def block(number: int) -> TransformerLayer:
            return TransformerLayer(config, ctx, seed, number, rng, rotary, block_masks, carries_tokens=False)

        layers += [embedding(forward_fn=partial(token_embeddings, depth=config.mtp.depth)),
                   LayerSpec(MultiTokenPrediction, config, seed, block, partial(NORMS[config.norm], config)),
                   shared_head()]
    return layers


def partition_weights(config: ModelConfig) -> list[int]:
    """The cost of each layer of gpt_layer_specs in blocks, as the pipeline's partition balances them (DeepSpeed's
    'type:TransformerLayer' method, plus model.mtp's D blocks)."""
    weights = [0, 0] + [1] * config.num_layers + [0, 0]
    if config.mtp is not None:
        weights += [0, config.mtp.depth, 0]
    return weights


def mtp_partition(config: ModelConfig, parts: list[int], method: str) -> list[int]:
    """The stage boundaries of a model.mtp pipeline, from those DeepSpeed cut by ``method``: under the default
    'type:TransformerLayer' balanced with the depths as D blocks (``partition_weights``); then the final norm, the
    head and the depths on the last stage (a boundary after the last block, where a balance that sees no cost in
    them may put it, moves before the final norm)."""
    if method.lower() == "type:transformerlayer":
        parts = ds_internals.partition_balanced(partition_weights(config), len(parts) - 1)
    final_norm = config.num_layers + 2
    return [*parts[:-2], min(parts[-2], final_norm), parts[-1]]


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
    if config.mtp is not None:
        base = ds_internals.with_partition(base, partial(mtp_partition, config), ctx.pipeline_parallel_rank)

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
    objective = GPTLoss(ctx, z_loss, config.mtp)
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
        rotary, block_masks = shared_rotary(config), BlockMasks()
        self.layers = nn.ModuleList(TransformerLayer(config, self.ctx, seed, n, self.tensor_parallel_rng, rotary,
                                                     block_masks) for n in range(1, config.num_layers + 1))
        self.final_norm = FINAL_NORMS[config.norm](config, self.ctx, seed)
        self.output_head = None if config.tie_word_embeddings else OutputHead(config, self.ctx, seed)
        self.mtp = None
        if config.mtp is not None:
            def block(number: int) -> TransformerLayer:
                return TransformerLayer(config, self.ctx, seed, number, self.tensor_parallel_rng, rotary, block_masks,
                                        carries_tokens=False)

            self.mtp = MultiTokenPrediction(config, seed, block, partial(NORMS[config.norm], config))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``segment_ids`` (b, s): the documents of packed samples (module docstring), or None: one sequence.
        Logits (b, s, V/R); with model.mtp (logits, the depths' logits (D b, s, V/R)), as the pipeline's last stage
        gives them to the loss."""
        segments = () if segment_ids is None else (segment_ids,)
        hidden = self.position_embedding(self.word_embeddings((tokens, position_ids, *segments)))
        for layer in self.layers:
            hidden = layer(hidden)
        hidden = self.final_norm(hidden)
        head = self.word_embeddings if self.output_head is None else self.output_head
        logits = output_logits(head, hidden)  # (b, s, V/R): the tied or the untied head's
        if self.mtp is None:
            return logits
        embedded = token_embeddings(self.word_embeddings, logits, len(self.mtp.depths))
        return head_logits(head, self.mtp(embedded))

    def loss(self, tokens, position_ids, labels, loss_mask, *, segment_ids=None) -> torch.Tensor:
        return gpt_loss(self.ctx, self(tokens, position_ids, segment_ids), (labels, loss_mask))
