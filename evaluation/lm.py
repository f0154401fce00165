"""The lm-evaluation-harness model of this project: a TemplateLM over the forward-only pipeline.

What it does as lm-eval's own Hugging Face backend (HFLM) does, so that scores compare:

    step                      HFLM (lm_eval/models/huggingface.py)               here
    context / continuation    TemplateLM._encode_pair (inherited)                the same (inherited)
    empty context             the prefix token: BOS, else EOS                    the same
    tok_encode                tokenizer.encode(s, add_special_tokens=False)      the same
    one request's input       (ctx + cont)[-(max_length + 1):][:-1], right-      the same; max_length is the model's
                              padded with 0 in its batch                          max_position_embeddings, as HFLM reads
                                                                                  it from the exported config
    scores                    log_softmax of the whole vocabulary; sum over      vocabulary-parallel: the same sums
                              the continuation; is_greedy: argmax at every        from each TP rank's slice, nothing
                              continuation token                                 gathered (evaluation/pipeline.py)
    rolling log-likelihood    get_rolling_token_windows(prefix, max_length,      the same windows, summed
                              context_len=1) + make_disjoint_window
    generate_until            greedy, context left-truncated to max_length -     the same, with the KV cache of
                              max_gen_toks, until + the EOS string, cut at the   evaluation/generation.py
                              first stop sequence

Where it differs, by design: requests are sorted longest first (as HFLM does) and dealt to the data-parallel replicas
in turn (request j of that order to replica j mod DP), each replica batching its share; the results are gathered on
every rank. lm-eval sees one process (rank 0 of 1) on every rank, builds every request on every rank and gets every
result, so nothing of its own multi-process path is used. ``requests_scored`` counts what this replica scored.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from evaluation.generation import Generator, Sampling
from evaluation.pipeline import IGNORE, Pipeline, pad_batch

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's


class ParallelLM(TemplateLM):
    def __init__(self, pipeline: Pipeline, tokenizer, batch_size: int = 8, max_length: int | None = None) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
        self.pipeline, self.tokenizer, self.batch_size = pipeline, tokenizer, batch_size
        self._max_length = max_length or pipeline.config.max_position_embeddings
        self.generator = Generator(pipeline, tokenizer.eos_token_id)
        self.requests_scored = 0
        """Log-likelihood requests this rank's replica computed (rolling windows count one each)."""

    # -- the tokenizer, as HFLM uses it -----------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, left_truncate_len: int | None = None, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        encoding = self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- log-likelihoods ----------------------------------------------------------------------------------------------

    def _window(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """The input and its labels: continuation tokens where they are predicted, IGNORE elsewhere."""
        if not continuation or len(continuation) > self.max_length:
            raise ValueError(f"a continuation of {len(continuation)} tokens: it must hold 1 to max_length "
                             f"({self.max_length}) tokens")
        whole = (context + continuation)[-(self.max_length + 1):]
        inputs = whole[:-1]
        labels = [IGNORE] * (len(inputs) - len(continuation)) + continuation
        return inputs, labels

    def _score(self, windows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One batch: (sum of log p over the continuation, every continuation token the argmax) per window."""
        multiple = self.pipeline.sequence_multiple
        device = self.pipeline.stage.device
        tokens = pad_batch([inputs for inputs, _ in windows], device, multiple)
        labels = pad_batch([labels for _, labels in windows], device, multiple, pad_id=IGNORE)
        labels = labels[:, :tokens.shape[1]]
        with torch.no_grad():
            scored = self.pipeline.token_log_likelihoods(tokens, labels)
        if scored is None:
            return []
        log_likelihood, greedy = scored
        counted = (labels != IGNORE).sum(-1)
        return [(float(log_likelihood[row].sum()), bool(greedy[row].sum() == counted[row]))
                for row in range(len(windows))]

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        windows = [self._window(list(context), list(continuation)) for _, context, continuation in requests]
        order = sorted(range(len(windows)), key=lambda i: (-len(windows[i][0]), tuple(windows[i][0])))
        ctx = self.pipeline.ctx
        mine = order[ctx.data_parallel_rank::ctx.data_parallel_size]
        results: dict[int, tuple[float, bool]] = {}
        was_training = self.pipeline.stage.module.training
        self.pipeline.stage.module.eval()
        try:
            for start in range(0, len(mine), self.batch_size):
                batch = mine[start:start + self.batch_size]
                results.update(zip(batch, self._score([windows[i] for i in batch]), strict=False))
        finally:
            self.pipeline.stage.module.train(was_training)
        self.requests_scored += len(mine)
        shared = self.pipeline.share(results)
        return [shared[i] for i in range(len(windows))]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, request in enumerate(requests):
            (string,) = request.args
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_likelihood, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += log_likelihood
        return totals

    # -- generation ---------------------------------------------------------------------------------------------------

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Each request's greedy (or, with do_sample, sampled) continuation, cut at its first stop sequence; the
        requests dealt to the DP replicas in turn, the texts gathered on every rank."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        jobs = [self._generation_job(*request.args, eos) for request in requests]
        ctx, mine = self.pipeline.ctx, {}
        was_training = self.pipeline.stage.module.training
        self.pipeline.stage.module.eval()
        try:
            for index in range(ctx.data_parallel_rank, len(jobs), ctx.data_parallel_size):
                prompt, max_new, until, sampling = jobs[index]
                tokens = self.generator.generate(prompt, max_new, sampling, stop=self._stops(until), index=index)
                mine[index] = postprocess_generated_text(self.tok_decode(tokens), until, None)
        finally:
            self.pipeline.stage.module.train(was_training)
        shared = self.pipeline.share(mine)
        return [shared[index] for index in range(len(jobs))]

    def _generation_job(self, context: str, gen_kwargs: dict, eos: str) -> tuple[list[int], int, list[str], Sampling]:
        kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_new = kwargs.pop("max_gen_toks")
        room = self.max_length - max_new
        if room <= 0:
            raise ValueError(f"max_gen_toks {max_new} leaves no room for a context in the model's {self.max_length} "
                             f"positions: lower the task's generation_kwargs.max_gen_toks")
        sampling = Sampling(temperature=float(kwargs.get("temperature", 0.0))) if kwargs.get("do_sample") else Sampling()
        return self.tok_encode(context, left_truncate_len=room), max_new, until, sampling

    def _stops(self, until: list[str]):
        """Stop once the decoded text holds a stop sequence (the text is cut there afterwards, as HFLM cuts it)."""
        def stop(generated: list[int]) -> bool:
            text = self.tok_decode(generated, skip_special_tokens=False)
            return any(term and term in text for term in until)
        return stop
