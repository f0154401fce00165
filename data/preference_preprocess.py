"""Preference records -> pairs of (tokens, completion mask), tokenised as TRL 1.16's ``DPOTrainer`` does
(``tools/preprocess_data.py --preference``); the files are data/preference.py's.

Records (one JSON object per line), TRL's preference formats:

    kind                          record                                            how the prompt is found
    conversational                {"prompt": [msgs], "chosen": [msgs],               given
                                  "rejected": [msgs]}
    conversational, implicit      {"chosen": [msgs], "rejected": [msgs]}            the messages both start with
                                                                                    (TRL's extract_prompt); also
                                                                                    when "prompt" is a string beside
                                                                                    lists (TRL's maybe_extract_prompt)
    plain                         {"prompt": str, "chosen": str, "rejected": str}   given
    plain, implicit               {"chosen": str, "rejected": str}                  the characters both start with,
                                                                                    a space before the first
                                                                                    difference left to the
                                                                                    completions (extract_prompt)

Tokenisation, as ``DPOTrainer._prepare_dataset`` (a record's "tools" and "chat_template_kwargs" are passed to the
template as TRL passes them):

    conversational   prompt_ids = apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
                     full_ids   = apply_chat_template(prompt + completion, tokenize=True)
    plain            completion += eos_token unless it ends with it (TRL's add_eos);
                     prompt_ids = tokenizer(prompt), full_ids = tokenizer(prompt + completion)
    both             P = the common prefix of prompt_ids with each full_ids; the sequence is full_ids and its mask
                     [0] * P + [1] * (len - P) (TRL's completion_mask: everything after the prompt, the template's
                     end-of-turn token and what follows it included)
    --seq-length S   the model's seq_length: a sequence may have L = S + 1 tokens, as a training sample of this
                     project (S inputs, S labels), TRL's max_length L. truncate: each sequence cut to its first L
                     tokens, a pair whose prompt alone has L tokens or more refused (TRL's truncation_mode
                     "keep_start", its only mode, drops it); drop: a pair with a sequence over L tokens refused

Refused records (counted by reason, one line each naming the file, line and what is wrong; not errors):

    reason                          when                                        TRL
    empty completion                chosen or rejected has no text (or no       trains on it (eos alone, or the
                                    token after the prompt)                     template's turn markers)
    chosen identical to rejected    the two sequences have the same tokens      trains on it: a constant loss
    prompt not a prefix             prompt_ids is not a prefix of full_ids      warns and starts the completion
                                    (the template renders the prompt alone      where they diverge: the model
                                    differently, or tokens merge across the     learns from a context it never
                                    boundary)                                   sees at inference
    longer than seq_length          drop: a sequence over S + 1 tokens;         truncate: drops the first
                                    truncate: the prompt alone has >= S + 1     kind, keeps the second (a
                                    tokens, or the sequences are the same       constant loss)
                                    once truncated

A malformed line (not JSON, a missing key, strings mixed with lists, a message without a string content, a template
that cannot render it) is a bad line as in ``data.preprocess``: it stops the run naming the file and line, or with
``skip_bad_lines`` is counted. Every input line is a kept pair, a refused record or a skipped line, and the summary
says how many of each. TRL's extract_prompt has one slip this does not copy: when chosen and rejected differ from
their first character and chosen ends with a space, TRL takes all of chosen but its last character as the prompt.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field

import numpy as np

from data.chat import BadRecord, Example, Refused, _messages, load_chat_template, load_hf_tokenizer, parse_record
from data.chat_preprocess import ChatPreprocessConfig, ChatPreprocessReport, masked_batches
from data.indexed_dataset import optimal_dtype
from data.loss_mask import loss_mask_prefix, tokens_prefix
from data.preference import (
    TRUNCATION,
    data_fingerprint,
    preference_meta_path,
    remove_preference_meta,
    write_preference_meta,
)
from data.preprocess import BadInputError, Task, _LineNumbers

EMPTY, IDENTICAL, NOT_A_PREFIX, TOO_LONG = ("empty completion", "chosen identical to rejected", "prompt not a prefix",
                                            "longer than seq_length")
REFUSAL_REASONS = (EMPTY, IDENTICAL, NOT_A_PREFIX, TOO_LONG)
COMPLETIONS = ("chosen", "rejected")


class PairRefused(Refused):
    """A well-formed pair that is not written: ``reason`` (one of REFUSAL_REASONS) counts it, ``detail`` explains."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason)
        self.detail = detail


def extract_prompt(chosen: list | str, rejected: list | str) -> tuple[list | str, list | str, list | str]:
    """(prompt, chosen, rejected): what both start with, and the rest of each (TRL's extract_prompt, on messages or
    characters; a space before the first difference goes to the completions). Both must be non-empty."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):  # TRL's loop: without a difference, index ends one short
        if chosen[index] != rejected[index]:
            if index > 0 and chosen[index - 1] == " ":
                index -= 1
            break
    return chosen[:index], chosen[index:], rejected[index:]


def _is_empty(completion: list | str) -> bool:
    if isinstance(completion, str):
        return not completion.strip()
    return all(isinstance(m, dict) and isinstance(m.get("content"), str) and not m["content"].strip()
               for m in completion)


def _common_prefix_length(ids: list[int], other: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b), min(len(ids), len(other)))


@dataclass
class Pair:
    """One record, tokenised: its two sequences with their completion masks."""

    chosen: Example
    rejected: Example
    truncated: bool = False  # a sequence was cut to seq_length


class PreferenceEncoder:
    """One parsed record -> a :class:`Pair`; raises :class:`PairRefused` or BadRecord."""

    def __init__(self, tokenizer, template: str | None, seq_length: int | None = None,
                 truncation: str = "truncate") -> None:
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation {truncation!r}: choose one of {', '.join(TRUNCATION)}")
        self.tokenizer, self.template, self.seq_length, self.truncation = tokenizer, template, seq_length, truncation
        self.max_tokens = None if seq_length is None else seq_length + 1  # TRL's max_length (module docstring)

    def __call__(self, record: dict) -> Pair:
        prompt, chosen, rejected = self.split(record)
        conversational = isinstance(chosen, list)
        if conversational:
            options = self._template_options(record)
            prompt_ids = self._chat_tokens(prompt, True, options)
            full = [self._chat_tokens(prompt + completion, False, options) for completion in (chosen, rejected)]
        else:
            prompt_ids = self.tokenizer(text=prompt)["input_ids"]
            full = [self.tokenizer(text=prompt + self._with_eos(completion))["input_ids"]
                    for completion in (chosen, rejected)]
        prompt_length = self._prompt_length(list(prompt_ids), [list(ids) for ids in full])
        examples = [Example(list(ids), [0] * prompt_length + [1] * (len(ids) - prompt_length)) for ids in full]
        return self._fit(*examples, prompt_length)

    # ------------------------------------------------------------------------------------------------- records

    def split(self, record: dict) -> tuple[list | str, list | str, list | str]:
        """(prompt, chosen, rejected) of a record, checked; the prompt extracted when it is implicit."""
        missing = [key for key in COMPLETIONS if key not in record]
        if missing:
            raise BadRecord(f"a preference record needs 'chosen' and 'rejected' (and optionally 'prompt'); it lacks "
                            f"{' and '.join(map(repr, missing))} (it has {sorted(record)[:8]})")
        chosen, rejected = record["chosen"], record["rejected"]
        kinds = {type(chosen), type(rejected)}
        if kinds not in ({str}, {list}):
            raise BadRecord(f"'chosen' and 'rejected' must both be strings or both lists of messages, got "
                            f"{type(chosen).__name__} and {type(rejected).__name__}")
        for name, completion in zip(COMPLETIONS, (chosen, rejected), strict=True):
            if not completion:
                raise PairRefused(EMPTY, f"'{name}' is empty")
        prompt = record.get("prompt")
        if prompt is None or (isinstance(prompt, str) and kinds == {list}):  # TRL's maybe_extract_prompt
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
        elif type(prompt) not in kinds:
            raise BadRecord(f"'prompt' is a {type(prompt).__name__} but 'chosen' and 'rejected' are "
                            f"{type(chosen).__name__}s: give all three as strings or all as lists of messages")
        if isinstance(chosen, list):
            for name, value in (("prompt", prompt), *zip(COMPLETIONS, (chosen, rejected), strict=True)):
                if value:
                    _messages(value, f"'{name}'")
        for name, completion in zip(COMPLETIONS, (chosen, rejected), strict=True):
            if not completion or _is_empty(completion):
                raise PairRefused(EMPTY, f"the {name} completion has no text")
        return prompt, chosen, rejected

    def _template_options(self, record: dict) -> dict:
        """What TRL passes to the template besides the messages: the record's tools and chat_template_kwargs."""
        tools = record.get("tools")
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as error:
                raise BadRecord(f"'tools' is a string but not JSON ({error.msg})") from None
        extra = record.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            raise BadRecord(f"'chat_template_kwargs' must be an object, got {type(extra).__name__}")
        return {"tools": tools, **extra}

    # ---------------------------------------------------------------------------------------------- tokenising

    def _chat_tokens(self, messages: list[dict], generation_prompt: bool, options: dict) -> list[int]:
        """TRL's _tokenize of a conversation: apply_chat_template(tokenize=True, return_dict=True)."""
        if self.template is None:
            raise BadRecord("a conversational record needs a chat template: pass --chat-template tokenizer|FILE")
        try:
            out = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=True,
                                                     return_dict=True, add_generation_prompt=generation_prompt,
                                                     **options)
        except Exception as error:  # jinja errors, raise_exception() of the template
            raise BadRecord(f"the chat template cannot render it ({type(error).__name__}: {error})") from None
        return list(out["input_ids"])

    def _with_eos(self, completion: str) -> str:
        """TRL's add_eos: plain-text completions end with the eos token's text."""
        eos = self.tokenizer.eos_token
        if eos is None:
            raise BadRecord("a plain-text completion ends with the tokenizer's eos token (TRL's add_eos), and this "
                            "tokenizer has none")
        return completion if completion.endswith(eos) else completion + eos

    def _prompt_length(self, prompt_ids: list[int], full: list[list[int]]) -> int:
        for name, ids in zip(COMPLETIONS, full, strict=True):
            common = _common_prefix_length(prompt_ids, ids)
            if common < len(prompt_ids):
                decode = self.tokenizer.decode
                raise PairRefused(NOT_A_PREFIX, f"the prompt's tokens are not a prefix of prompt + {name}: they "
                                                f"diverge at token {common}, {decode(prompt_ids[common:common + 3])!r} "
                                                f"vs {decode(ids[common:common + 3])!r}")
            if len(ids) == len(prompt_ids):
                raise PairRefused(EMPTY, f"no token of the {name} completion follows the prompt's")
        return len(prompt_ids)

    def _fit(self, chosen: Example, rejected: Example, prompt_length: int) -> Pair:
        """The pair within seq_length (truncated or refused), and not two identical sequences."""
        limit, lengths = self.max_tokens, (len(chosen.ids), len(rejected.ids))
        if chosen.ids == rejected.ids:
            raise PairRefused(IDENTICAL, f"both sequences are the same {lengths[0]} tokens")
        if limit is None or max(lengths) <= limit:
            return Pair(chosen, rejected)
        if self.truncation == "drop":
            raise PairRefused(TOO_LONG, f"chosen {lengths[0]} and rejected {lengths[1]} tokens, more than "
                                        f"--seq-length {self.seq_length} + 1 (--preference-truncation drop)")
        if prompt_length >= limit:
            raise PairRefused(TOO_LONG, f"the prompt alone has {prompt_length} tokens, at least --seq-length "
                                        f"{self.seq_length} + 1: truncated, no completion token would be left (TRL "
                                        f"drops it too)")
        chosen, rejected = (Example(e.ids[:limit], e.mask[:limit]) for e in (chosen, rejected))
        if chosen.ids == rejected.ids:
            raise PairRefused(TOO_LONG, f"truncated to {limit} tokens (--seq-length {self.seq_length} + 1), chosen "
                                        f"and rejected are the same: they differ only after that")
        return Pair(chosen, rejected, truncated=True)


# ----------------------------------------------------------------------------------------------------- the files


@dataclass
class PreferencePreprocessConfig(ChatPreprocessConfig):
    """The chat path's settings, and how pairs are fitted to the sequence length."""

    seq_length: int | None = None  # the model's: a sequence (prompt + completion) may have seq_length + 1 tokens
    truncation: str = "truncate"  # one of data.preference.TRUNCATION: how a pair longer than seq_length is fitted

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.truncation not in TRUNCATION:
            raise ValueError(f"--preference-truncation {self.truncation!r}: choose one of {', '.join(TRUNCATION)}")
        if self.seq_length is not None and self.seq_length < 1:
            raise ValueError(f"--seq-length must be at least 1 (a prompt token and a completion token), got "
                             f"{self.seq_length}")
        if self.append_eod or self.eod_is_target:
            raise ValueError("--append-eod and --eod-is-target do not apply to preference data: TRL ends plain-text "
                             "completions with the eos token and conversational ones with the template's end of turn")
        if self.loss_on != "assistant":
            raise ValueError("--loss-on does not apply to preference data: the mask is each completion's tokens")


@dataclass
class PairBatch:
    """One batch, tokenised: the kept pairs' sequences (chosen, rejected, chosen, ...) back to back with their masks,
    and what was left out."""

    source: int
    records: int
    input_bytes: int
    tokens: np.ndarray
    masks: np.ndarray  # uint8, same length
    lengths: np.ndarray  # (2 * pairs,)
    truncated: int
    bad: list[tuple[int, str]]
    refused: list[tuple[int, str, str]]  # (record number, reason, detail)


@dataclass
class PreferencePreprocessReport(ChatPreprocessReport):
    """What a preference run wrote, refused and skipped; pairs + refused + skipped = records read."""

    meta: str = ""  # the path of the JSON
    records: int = 0  # lines (or rows) read
    pairs: int = 0
    truncated: int = 0  # pairs kept with a sequence cut to seq_length
    refused_lines: list[str] = field(default_factory=list)  # every refused record: "file:line: reason (detail)"

    def count(self, batch: PairBatch, where: _LineNumbers) -> None:
        """Add a batch's pairs, refused records and sizes (its bad lines: data.preprocess._record_bad_lines)."""
        for number, reason, detail in batch.refused:
            self.refused[reason] += 1
            self.refused_lines.append(f"{where(batch.source, number)}: {reason} ({detail})")
        self.records += batch.records
        self.pairs += batch.lengths.size // 2
        self.documents += batch.lengths.size
        self.truncated += batch.truncated
        self.tokens["text"] += batch.tokens.size
        self.target_tokens += int(np.count_nonzero(batch.masks))
        self.input_bytes += batch.input_bytes

    def summary(self) -> str:
        """The chat path's summary (outputs, skipped lines, token counts), then the JSON, every refused record and
        the records' count."""
        lines = [super().summary(), f"  {self.meta} (written last)"]
        if self.refused_lines:
            lines += ["refused, one line each:"] + [f"  {line}" for line in self.refused_lines]
        lines.append(f"{self.records} records: {self.pairs} pairs written ({self.truncated} truncated to seq_length), "
                     f"{sum(self.refused.values())} refused, {self.skipped} bad lines skipped")
        return "\n".join(lines)


class PairBatchEncoder:
    """Parses and encodes batches of records (runs in the worker processes)."""

    def __init__(self, encoder: PreferenceEncoder, dtype: np.dtype) -> None:
        self.encoder, self.dtype = encoder, dtype

    def __call__(self, task: Task) -> PairBatch:
        source, first, records = task
        sequences, bad, refused, truncated = [], [], [], 0
        for number, record in enumerate(records, start=first):
            try:
                pair = self.encoder(parse_record(record))
            except BadRecord as error:
                bad.append((number, str(error)))
            except PairRefused as error:
                refused.append((number, error.reason, error.detail))
            else:
                sequences += [pair.chosen, pair.rejected]
                truncated += pair.truncated
        lengths = np.fromiter((len(e.ids) for e in sequences), dtype=np.int64, count=len(sequences))
        total = int(lengths.sum())
        return PairBatch(source, len(records), sum(len(r) for r in records if isinstance(r, bytes)),
                         np.fromiter(itertools.chain.from_iterable(e.ids for e in sequences), self.dtype, total),
                         np.fromiter(itertools.chain.from_iterable(e.mask for e in sequences), np.uint8, total),
                         lengths, truncated, bad, refused)


def build_preference_encoder(config: PreferencePreprocessConfig, tokenizer=None) -> PreferenceEncoder:
    """The encoder of the config; tokenizer: a transformers tokenizer, else loaded from the config's flags."""
    if tokenizer is None:
        tokenizer = load_hf_tokenizer(config.tokenizer_type, config.vocab_file, config.merge_file,
                                      config.tokenizer_model)
    return PreferenceEncoder(tokenizer, load_chat_template(config.chat_template, tokenizer), config.seq_length,
                             config.truncation)


def preprocess_preference(config: PreferencePreprocessConfig, tokenizer=None) -> PreferencePreprocessReport:
    """Tokenise preference records into the masked pair and write the JSON last; returns what was written."""
    start = time.perf_counter()
    encoder = build_preference_encoder(config, tokenizer)
    prefix = tokens_prefix(config.output_prefix)
    report = PreferencePreprocessReport([prefix, loss_mask_prefix(prefix)], "TRL's DPOTrainer tokenisation (the "
                                        "completion: every token after the prompt's)",
                                        meta=preference_meta_path(config.output_prefix))
    remove_preference_meta(config.output_prefix)  # until the new one is written, the data is incomplete
    _write_pairs(config, encoder, optimal_dtype(len(encoder.tokenizer)), report)
    write_preference_meta(config.output_prefix, {
        "pairs": report.pairs, "seq_length": config.seq_length, "truncation": config.truncation,
        "tokenizer": config.tokenizer_model or config.tokenizer_type,
        "fingerprint": data_fingerprint(config.output_prefix), "refused": dict(report.refused)})
    report.seconds = time.perf_counter() - start
    return report


def _write_pairs(config: PreferencePreprocessConfig, encoder: PreferenceEncoder, dtype: np.dtype,
                 report: PreferencePreprocessReport) -> None:
    with masked_batches(config, report, PairBatchEncoder(encoder, dtype), dtype) as batches:
        for batch, where in batches:
            report.count(batch, where)
        if report.pairs == 0:
            raise BadInputError(f"{', '.join(config.files[:3])}: no pairs (every record was refused or bad: "
                                f"{dict(report.refused)}); nothing was written")
