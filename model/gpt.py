"""The GPT, as a list of pipeline layers.

What flows between layers (and between pipeline stages) is documented here, once:

    batch for the first stage   (tokens (b, s) int64, position_ids (b, s) int64)
    batch for the last stage    (labels (b, s) int64, loss_mask (b, s) float)
    word embedding (tied)       -> (word_embeddings (b, s, h), position_ids (b, s))
    PositionEmbedding           -> hidden (b, s, h)
    TransformerLayer x L        -> hidden (b, s, h)        <- the only tensor sent between stages
    FinalLayerNorm              -> hidden (b, s, h)
    output head (tied)          -> logits (b, s, V/R)       this rank's vocabulary slice
    loss_fn(logits, (labels, loss_mask)) -> scalar: masked mean over the micro-batch's tokens

Every layer is built from (ModelConfig, ParallelContext, seed, layer_number) and initialises itself (model/init.py),
so a stage holds exactly its part of the unsplit model.

Dropout draws from two random streams (model/random.py tabulates them): the embedding dropout (PositionEmbedding) and
the hidden dropout after each row-parallel output (TransformerLayer) from torch's default stream, the same on every
TP rank of a stage; the attention dropout inside SDPA (SelfAttention) from the tensor-parallel stream, different on
every TP rank and stage. The layers of one model share one tensor-parallel ``RNGStream``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.init import normal_sharded_, parameter_seed
from model.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy
from model.parallel import ParallelContext
from model.random import RNGStream, checkpoint, tensor_parallel_stream_seed

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

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, position_ids = inputs  # (b, s), (b, s)
        return super().forward(tokens), position_ids  # (b, s, h), (b, s)


def output_logits(embedding: WordEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return embedding.logits(hidden)  # (b, s, V/R)


class PositionEmbedding(nn.Module):
    """Adds the learned absolute position embedding (replicated on every TP rank), then dropout."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.max_position_embeddings, config.hidden_size))
        normal_sharded_(self.weight, config.init_method_std, parameter_seed(seed, EMBEDDING_LAYER, "position"))
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        word_embeddings, position_ids = inputs  # (b, s, h), (b, s)
        return self.dropout(word_embeddings + F.embedding(position_ids, self.weight))  # (b, s, h)


class SelfAttention(nn.Module):
    """Causal self-attention over this rank's heads: fused QKV column-parallel, output row-parallel.

    The QKV output rows are laid out per head, [heads, 3, head_dim], so a contiguous slice of rows is a set of
    whole heads with their q, k and v.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_number: int,
                 rng: RNGStream) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads // ctx.tensor_parallel_size
        self.head_dim = config.head_dim
        self.dropout = config.attention_dropout
        self.rng = rng  # the tensor-parallel stream: these heads' dropout masks are this rank's own
        self.qkv = ColumnParallelLinear(h, 3 * h, ctx, init_std=config.init_method_std,
                                        seed=parameter_seed(seed, layer_number, "attention.qkv"))
        self.dense = RowParallelLinear(h, h, ctx, init_std=config.output_layer_init_std,
                                       seed=parameter_seed(seed, layer_number, "attention.dense"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads, 3, self.head_dim)  # (b, s, nh/R, 3, d)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (b, nh/R, s, d)
        dropout = self.dropout if self.training else 0.0
        with self.rng.fork(enabled=dropout > 0):
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)  # (b, nh/R, s, d)
        context = context.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)  # (b, s, h/R)
        return self.dense(context)  # (b, s, h)


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_number: int) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, ctx,
                                        init_std=config.init_method_std, seed=parameter_seed(seed, layer_number, "mlp.fc1"))
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, ctx,
                                     init_std=config.output_layer_init_std,
                                     seed=parameter_seed(seed, layer_number, "mlp.fc2"))
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))  # (b, s, ffn/R) inside


class TransformerLayer(nn.Module):
    """Pre-LN block: x + drop(attn(ln1(x))), then + drop(mlp(ln2(x))).

    ``rng`` is the model's tensor-parallel stream, shared by all its layers; a layer built alone gets its own.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_number: int,
                 rng: RNGStream | None = None) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attention = SelfAttention(config, ctx, seed, layer_number,
                                       rng or RNGStream(tensor_parallel_stream_seed(seed, ctx)))
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config, ctx, seed, layer_number)
        self.dropout = nn.Dropout(config.hidden_dropout)  # on replicated (b, s, h): the default stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.ln1(x)))  # (b, s, h)
        return x + self.dropout(self.mlp(self.ln2(x)))


class FinalLayerNorm(nn.LayerNorm):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int) -> None:
        super().__init__(config.hidden_size, eps=config.layernorm_epsilon)


def gpt_layer_specs(config: ModelConfig, ctx: ParallelContext, seed: int, rng: RNGStream | None = None) -> list:
    """The whole model as DeepSpeed LayerSpecs, first layer to last (the one place the model is assembled).

    ``rng``: the tensor-parallel stream the blocks share (a new one seeded for this rank when not given)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    rng = rng or RNGStream(tensor_parallel_stream_seed(seed, ctx))
    embedding = partial(TiedLayerSpec, "word_embeddings", WordEmbedding, config, ctx, seed, tied_weight_attr="weight")
    return [
        embedding(),  # a module: saved as layer_00
        LayerSpec(PositionEmbedding, config, ctx, seed),
        *[LayerSpec(TransformerLayer, config, ctx, seed, n, rng) for n in range(1, config.num_layers + 1)],
        LayerSpec(FinalLayerNorm, config, ctx, seed),
        embedding(forward_fn=output_logits),
    ]


def universal_checkpoint_info(config: ModelConfig) -> dict[str, Any]:
    """How DeepSpeed's universal-checkpoint converter merges this model's TP slices, by parameter name.

    Names are DeepSpeed's: the layer index in gpt_layer_specs, then the module path (0 and L + 3: the tied word
    embedding, ``tied_modules.word_embeddings.weight``; 1: positions; 2 .. L + 1: blocks; L + 2: the final norm).
    Everything not listed is column-parallel and concatenated on dim 0: QKV (rows grouped per head, so TP slices
    hold whole heads), its bias, fc1 and its bias. The vocabulary padding is cut off and re-added for the new TP.
    """
    from deepspeed.checkpoint import constants as uc

    block = r"\d+\."
    word_embedding = r"tied_modules\.word_embeddings\.weight$"
    return {
        uc.UNIVERSAL_CHECKPOINT_VERSION_KEY: uc.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        uc.VOCABULARY_PARAMETER_PATTERNS: [word_embedding],
        uc.ORIGINAL_VOCAB_SIZE: config.vocab_size,
        uc.PIPELINE_REPLICATED_PARAMETER_PATTERNS: [word_embedding],
        uc.TP_REPLICATED_PARAMETER_PATTERNS: [
            r"1\.weight$",  # positions
            block + r"ln[12]\.(weight|bias)$",
            block + r"attention\.dense\.bias$",  # row-parallel biases are added once, after the all-reduce
            block + r"mlp\.fc2\.bias$",
            rf"{config.num_layers + 2}\.(weight|bias)$",  # the final norm
        ],
        uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [block + r"attention\.dense\.weight$",
                                                     block + r"mlp\.fc2\.weight$"],
    }


def gpt_loss(ctx: ParallelContext, logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Masked mean of the vocab-parallel cross-entropy over the micro-batch's tokens."""
    targets, loss_mask = labels  # (b, s), (b, s)
    vocab_start = ctx.tensor_parallel_rank * logits.shape[-1]
    losses = vocab_parallel_cross_entropy(logits, targets, ctx.tensor_parallel_group, vocab_start)  # (b, s) fp32
    loss_mask = loss_mask.float()
    return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def build_pipeline_model(config: ModelConfig, ctx: ParallelContext, seed: int, partition_method: str):
    """The DeepSpeed PipelineModule of this rank's stage (collective: all ranks call it).

    Its ``tensor_parallel_rng`` is the stage's tensor-parallel stream, which checkpoints save and restore. Activation
    checkpointing replays that stream in the recompute (model/random.py)."""
    from deepspeed.pipe import PipelineModule

    config.check_parallel(ctx.tensor_parallel_size, ctx.pipeline_parallel_size)
    rng = RNGStream(tensor_parallel_stream_seed(seed, ctx))
    module = PipelineModule(
        layers=gpt_layer_specs(config, ctx, seed, rng),
        topology=ctx.topology,
        loss_fn=partial(gpt_loss, ctx),
        partition_method=partition_method,
        activation_checkpoint_interval=1 if config.activation_checkpointing else 0,
        activation_checkpoint_func=partial(checkpoint, rng),
        checkpointable_layers=["TransformerLayer"],
    )
    module.tensor_parallel_rng = rng
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
        self.position_embedding = PositionEmbedding(config, self.ctx, seed)
        self.layers = nn.ModuleList(TransformerLayer(config, self.ctx, seed, n, self.tensor_parallel_rng)
                                    for n in range(1, config.num_layers + 1))
        self.final_norm = FinalLayerNorm(config, self.ctx, seed)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.position_embedding(self.word_embeddings((tokens, position_ids)))
        for layer in self.layers:
            hidden = layer(hidden)
        return output_logits(self.word_embeddings, self.final_norm(hidden))  # (b, s, V/R)

    def loss(self, tokens, position_ids, labels, loss_mask) -> torch.Tensor:
        return gpt_loss(self.ctx, self(tokens, position_ids), (labels, loss_mask))
