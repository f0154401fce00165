"""Text generation over the pipeline, with a KV cache sharded like the attention heads and held per stage.

One sequence at a time per data-parallel replica: the first step runs the prompt through every stage (each stage's
attentions cache what they need of past tokens, model/attention.py AttentionCache: the keys and values of their own
heads, or multi-head latent attention's latent and rope key, model/mla.py), each later step one token at the
position after the cache. The last stage chooses the token (greedy: the vocabulary-parallel argmax; sampling: the
last position's logits gathered over TP, then temperature, top-k, top-p and a seeded generator on TP rank 0) and
sends it to every rank of its replica, which all then know when to stop: the end-of-text token, a stop sequence in
the decoded text, or max_new_tokens. Without the cache (``use_cache=False``) each step reruns the whole sequence:
the same tokens, the slow way (tested token for token).

With sequence parallelism a step of one token cannot be split over the TP ranks: generation refuses it
(tools/generate.py and tools/evaluate.py build their stage without it; weights do not depend on it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.device import HOST
from evaluation.pipeline import Pipeline
from model.layers import vocab_parallel_argmax


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else sampled."""

    temperature: float = 0.0
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the most likely tokens whose probabilities sum to at least p (1: all)."""
    seed: int = 0
    """Seeds one generator per sequence (seed + the sequence's index): a layout repeats its samples exactly."""

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_from(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token from (V,) logits: temperature, then top-k, then top-p (the smallest set whose probability reaches p,
    the most likely token always kept), then a draw from ``generator``, a host one: the logits come to the host
    (V floats a token), so that a seed draws the same tokens on every device."""
    logits = logits.to(HOST, torch.float32) / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= sampling.top_p  # mass before this token already reaches p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator).item())


class Generator:
    """Generates on one pipeline (module docstring); every rank of a replica calls it with the same prompt."""

    def __init__(self, pipeline: Pipeline, end_of_text: int | None) -> None:
        self.pipeline, self.end_of_text = pipeline, end_of_text
        self.ctx = pipeline.ctx

    def _choose(self, logits: torch.Tensor | None, sampling: Sampling, generator: torch.Generator) -> int | None:
        """The next token from the last position's logits (last stage; None elsewhere)."""
        if logits is None:
            return None
        last = logits[:, -1:]  # (1, 1, V/R)
        group = self.ctx.tensor_parallel_group
        if sampling.greedy:
            return int(vocab_parallel_argmax(last, group, self.ctx.tensor_parallel_rank * last.shape[-1]).item())
        if self.ctx.tensor_parallel_size > 1:
            pieces = [torch.empty_like(last) for _ in range(self.ctx.tensor_parallel_size)]
            dist.all_gather(pieces, last.contiguous(), group=group)
            last = torch.cat(pieces, dim=-1)
        vocab = self.pipeline.config.vocab_size  # the padded ids' logits are -inf: drop them
        return sample_from(last[0, 0, :vocab], sampling, generator) if self.ctx.tensor_parallel_rank == 0 else None

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop: Callable[[list[int]], bool] | None = None, use_cache: bool = True, index: int = 0
                 ) -> list[int]:
        """The tokens after ``prompt`` (at most max_new_tokens; the end-of-text token, when chosen, is the last)."""
        if self.ctx.sequence_parallel:
            raise ValueError("generation steps of one token cannot be split over the TP ranks: run it with "
                             "parallelism.sequence_parallel off (the weights are the same)")
        if not prompt:
            raise ValueError("an empty prompt: give at least one token (e.g. the end-of-text token)")
        limit = self.pipeline.config.max_position_embeddings
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(f"{len(prompt)} prompt tokens + {max_new_tokens} new ones exceed the model's "
                             f"{limit} positions: shorten the prompt or max_new_tokens")
        generator = torch.Generator(device=HOST).manual_seed(sampling.seed + index)  # host: sample_from draws there
        device = self.pipeline.stage.device
        tokens, generated, cached = list(prompt), [], 0
        with self.pipeline.caches() if use_cache else contextlib.nullcontext(), torch.no_grad():
            for _ in range(max_new_tokens):
                start = cached if use_cache else 0
                window = torch.tensor([tokens[start:]], dtype=torch.int64, device=device)
                positions = torch.arange(start, len(tokens), device=device).unsqueeze(0)
                token = self.pipeline.broadcast_token(
                    self._choose(self.pipeline.logits(window, positions), sampling, generator))
                cached = len(tokens)
                tokens.append(token)
                generated.append(token)
                if token == self.end_of_text or (stop is not None and stop(generated)):
                    break
        return generated

    def generate_all(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
                     stop: Callable[[list[int]], bool] | None = None, use_cache: bool = True) -> list[list[int]]:
        """Every prompt, split over the DP replicas (prompt i on replica i mod DP), results on every rank."""
        ctx = self.ctx
        mine = {}
        for index in range(ctx.data_parallel_rank, len(prompts), ctx.data_parallel_size):
            mine[index] = self.generate(prompts[index], max_new_tokens, sampling, stop, use_cache, index)
        shared = self.pipeline.share(mine)
        return [shared[index] for index in range(len(prompts))]
