"""Multi-token prediction (model.mtp: DeepSeek-V3's MTP, its paper's section 2.2), on the last pipeline stage.

Depth k = 1 .. D predicts, at position i, token t_{i+k+1} from the depth before it and the embedding of t_{i+k}:

    h^0_i     the trunk's hidden state after its last block, before the final norm          (b, s*, h)
    e^k_i     Emb(t_{i+k}): the trunk's word embedding (the same weight) of the tokens rolled k to the left
    h'^k_i    eh_proj([enorm(e^k_i); hnorm(h^{k-1}_i)])       2h -> h; the embedding's half first, as the official
                                                              weights' eh_proj reads it (the paper writes h's first)
    h^k       block_k(h'^k)                                  a TransformerLayer, layer number L + k: its seeds, its
                                                              recompute mode and model.moe's dense-or-sparse choice
    logits^k  head(norm_k(h^k))                              norm_k its own (HF: shared_head.norm); head the trunk's
                                                              output head, shared (HF: shared_head.head, a copy)

s*: the whole sequence, or this TP rank's s/R positions under sequence parallelism, as between the trunk's blocks;
enorm, hnorm, eh_proj and norm_k are replicated over TP (eh_proj is ``ReplicatedLinear``: their gradients are
partial sums over TP under sequence parallelism, reduced with every replicated parameter: model/layers.py).
The last k positions of depth k read rolled-around tokens: their cross-entropy is masked (model/loss.py).

In the pipeline (model/gpt.py gpt_layer_specs) MTP adds three layers after the head, all on the last stage:

    L + 2  final norm        (hidden, *ids, tokens) -> (normed, hidden, *ids, tokens)   keeps h^0 for depth 1
    L + 3  output head       -> (logits, hidden, *ids, tokens)
    L + 4  token_embeddings  the tied word embedding: -> (logits, hidden, *ids, e)      e (D b, s*, h): depths
                                                                                         stacked on the batch
    L + 5  MultiTokenPrediction (saved as layer_{L+5}) -> (logits, normed h^1..D (D b, s*, h))
    L + 6  head_logits       the shared head: -> (logits, logits^1..D (D b, s, V/R))   what the loss reads

*ids: a packed sample's (position_ids, segment_ids), for the depths' blocks; tokens (b, s): the first stage's, carried
beside the hidden state from the embedding on (8 bytes a position, no gradient). The depths' FLOPs are D blocks':
the pipeline's partition counts the MultiTokenPrediction layer as D blocks (model/gpt.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from model.config import ModelConfig
from model.init import parameter_seed
from model.mla import ReplicatedLinear


class MTPDepth(nn.Module):
    """Depth k: enorm, hnorm, eh_proj, its block, its final norm (module docstring)."""

    def __init__(self, config: ModelConfig, seed: int, depth: int, block: nn.Module,
                 norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        h, layer_number = config.hidden_size, config.num_layers + depth
        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = ReplicatedLinear(2 * h, h, init_std=config.init_method_std, bias=False,
                                        seed=parameter_seed(seed, layer_number, "mtp.eh_proj"))
        self.block = block
        self.final_norm = norm()

    def forward(self, previous: torch.Tensor, embedded: torch.Tensor,
                packed_ids: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """previous h^{k-1} and e^k (b, s*, h) -> h^k (b, s*, h), before norm_k."""
        combined = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))
        out = self.block((combined, *packed_ids) if packed_ids else combined)
        return out[0] if isinstance(out, tuple) else out


class MultiTokenPrediction(nn.Module):
    """The D depths as one pipeline layer: (logits, h^0, *ids, e) -> (logits, norm_k(h^k) for k = 1 .. D stacked on
    the batch (D b, s*, h)). ``block(layer_number)`` and ``norm()`` build the trunk's kind of block and norm."""

    def __init__(self, config: ModelConfig, seed: int, block: Callable[[int], nn.Module],
                 norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.depths = nn.ModuleList(MTPDepth(config, seed, k, block(config.num_layers + k), norm)
                                    for k in range(1, config.mtp.depth + 1))

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden, *packed_ids, embedded = inputs
        outputs = []
        for depth, embedding in zip(self.depths, embedded.chunk(len(self.depths), dim=0), strict=True):
            hidden = depth(hidden, embedding, tuple(packed_ids))
            outputs.append(depth.final_norm(hidden))
        return logits, torch.cat(outputs, dim=0)  # (b, s, V/R), (D b, s*, h)


def rolled_tokens(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """(b, s) -> (D b, s): the tokens rolled k = 1 .. D to the left, depth k's rows k - 1 (b rows each); each row's
    last k positions hold its first tokens (masked in the loss)."""
    return torch.cat([tokens.roll(-k, dims=1) for k in range(1, depth + 1)], dim=0)


def token_embeddings(embedding: nn.Module, inputs: tuple[torch.Tensor, ...], depth: int) -> tuple[torch.Tensor, ...]:
    """The forward of the tied word embedding at L + 4: e^1 .. e^D in one lookup (one collective)."""
    *kept, tokens = inputs
    return *kept, embedding.embed(rolled_tokens(tokens, depth))


def head_logits(head: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of the shared output head at L + 6: the depths' logits beside the trunk's."""
    logits, normed = inputs
    return logits, head.logits(normed)
