"""Chat and prompt/completion corpora -> a token dataset and its loss-mask dataset (``tools/preprocess_data.py`` with
``--chat-template`` or ``--loss-on``).

Writes ``{output_prefix}_text_document.bin/.idx`` (Megatron's format, one sequence per document, through the same
builder as the text path) and ``{output_prefix}_loss_mask_document.bin/.idx`` (uint8 0/1 per token, the same
sequences and document index; read the pair with ``data.loss_mask.MaskedDocuments``). How the masks are derived:
``data.chat``. Reading, workers, bad lines and the progress bar are those of ``data.preprocess``: a malformed line
stops the run naming the file and line, or with ``skip_bad_lines`` is counted; a record with no target token is
refused and counted by reason, never an error.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field

import numpy as np

from data.chat import (
    LOSS_ON,
    BadRecord,
    ChatEncoder,
    Refused,
    has_generation_blocks,
    load_chat_template,
    load_hf_tokenizer,
    parse_record,
)
from data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from data.loss_mask import loss_mask_prefix, tokens_prefix
from data.preprocess import (
    BadInputError,
    PreprocessConfig,
    Task,
    _LineNumbers,
    _Progress,
    _record_bad_lines,
    encode_stream,
    read_batches,
)


@dataclass
class ChatPreprocessConfig(PreprocessConfig):
    """The text path's settings, and the chat template and what the loss is on."""

    chat_template: str | None = None  # "tokenizer" (its own), a Jinja file, or None (prompt/completion strings only)
    loss_on: str = "assistant"  # one of data.chat.LOSS_ON
    eod_is_target: bool = False  # the appended end-of-document token a target after a target (else never: TRL's)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"--loss-on {self.loss_on!r}: choose one of {', '.join(LOSS_ON)}")
        if self.json_keys != ("text",):
            raise ValueError("--json-keys does not apply to chat data: records are read by their 'messages', or "
                             "'prompt' and 'completion', keys")
        if self.eod_is_target and not self.append_eod:
            raise ValueError("--eod-is-target says whether the token --append-eod adds is a target: add --append-eod")
        if self.shard is not None:
            raise ValueError("--shard is not supported with chat data yet: tokenise the whole input in one run")


@dataclass
class ChatPreprocessReport:
    """What a chat run wrote, refused and skipped."""

    outputs: list[str]  # [tokens prefix, loss-mask prefix]
    masks_from: str = ""  # how the assistant tokens were found
    documents: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: {"text": 0})
    target_tokens: int = 0
    refused: Counter = field(default_factory=Counter)  # reason -> records
    refused_examples: list[str] = field(default_factory=list)  # the first few "file:line: reason"
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    input_bytes: int = 0
    seconds: float = 0.0

    @property
    def target_fraction(self) -> float:
        return self.target_tokens / max(self.tokens["text"], 1)

    def summary(self) -> str:
        tokens, refused = self.tokens["text"], sum(self.refused.values())
        reasons = ", ".join(f"{count} {reason}" for reason, count in self.refused.most_common())
        lines = [f"masks from {self.masks_from}"]
        lines += [f"  {prefix}.bin/.idx" for prefix in self.outputs]
        if self.refused_examples:
            lines.append("refused (no target token), the first ones:")
            lines += [f"  {example}" for example in self.refused_examples]
        if self.skipped:
            lines.append(f"skipped {self.skipped} bad lines; the first ones:")
            lines += [f"  {example}" for example in self.skipped_examples]
        lines.append(f"{self.documents} documents written, {tokens} tokens, {self.target_fraction:.1%} of them "
                     f"targets; refused {refused}" + (f" ({reasons})" if reasons else "")
                     + f"; skipped {self.skipped} bad lines; {self.seconds:.1f} s")
        return "\n".join(lines)


@dataclass
class ChatBatch:
    """One batch, tokenised: the kept documents' ids and masks back to back, and what was left out."""

    source: int
    num_documents: int
    input_bytes: int
    tokens: np.ndarray
    masks: np.ndarray  # uint8, same length
    lengths: np.ndarray  # (num_documents,)
    bad: list[tuple[int, str]]
    refused: list[tuple[int, str]]


class ChatBatchEncoder:
    """Parses and encodes batches of records (runs in the worker processes)."""

    def __init__(self, encoder: ChatEncoder, dtype: np.dtype) -> None:
        self.encoder, self.dtype = encoder, dtype

    def __call__(self, task: Task) -> ChatBatch:
        source, first, records = task
        ids, masks, bad, refused = [], [], [], []
        for number, record in enumerate(records, start=first):
            try:
                example = self.encoder(parse_record(record))
            except BadRecord as error:
                bad.append((number, str(error)))
            except Refused as error:
                refused.append((number, error.reason))
            else:
                ids.append(example.ids)
                masks.append(example.mask)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        total = int(lengths.sum())
        return ChatBatch(source, len(ids), sum(len(r) for r in records if isinstance(r, bytes)),
                         np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=total),
                         np.fromiter(itertools.chain.from_iterable(masks), dtype=np.uint8, count=total),
                         lengths, bad, refused)


def build_chat_encoder(config: ChatPreprocessConfig, tokenizer=None) -> tuple[ChatEncoder, str]:
    """The encoder and how its masks are found; tokenizer: a transformers tokenizer, else from the config's flags."""
    if tokenizer is None:
        tokenizer = load_hf_tokenizer(config.tokenizer_type, config.vocab_file, config.merge_file,
                                      config.tokenizer_model)
    template = load_chat_template(config.chat_template, tokenizer)
    if template is None:
        masks_from = "prompt/completion tokens (no chat template)"
    elif has_generation_blocks(template):
        masks_from = "the {% generation %} blocks of the chat template"
    else:
        masks_from = "incremental rendering (the chat template has no {% generation %} blocks)"
    if config.loss_on == "all":
        masks_from = "--loss-on all (every token)"
    return ChatEncoder(tokenizer, template, config.loss_on, config.append_eod,
                       eod_is_target=config.eod_is_target), masks_from


def preprocess_chat(config: ChatPreprocessConfig, tokenizer=None) -> ChatPreprocessReport:
    """Tokenise chat / prompt-completion records into the token and loss-mask datasets; returns what was written."""
    start = time.perf_counter()
    encoder, masks_from = build_chat_encoder(config, tokenizer)
    dtype = optimal_dtype(len(encoder.tokenizer))
    prefix = tokens_prefix(config.output_prefix)
    report = ChatPreprocessReport([prefix, loss_mask_prefix(prefix)], masks_from)
    with masked_batches(config, report, ChatBatchEncoder(encoder, dtype), dtype) as batches:
        for batch, where in batches:
            for number, reason in batch.refused:
                report.refused[reason] += 1
                if len(report.refused_examples) < 10:
                    report.refused_examples.append(f"{where(batch.source, number)}: {reason}")
            report.documents += batch.num_documents
            report.tokens["text"] += batch.tokens.size
            report.target_tokens += int(np.count_nonzero(batch.masks))
            report.input_bytes += batch.input_bytes
        if report.documents == 0:
            raise BadInputError(f"{', '.join(config.files[:3])}: no documents (every record was refused or "
                                f"bad: {dict(report.refused)}); nothing was written")
    report.seconds = time.perf_counter() - start
    return report


@contextmanager
def masked_batches(config: PreprocessConfig, report, batch_encoder, dtype: np.dtype) -> Iterator:
    """The encoded batches of ``config``'s input, each as (batch, line numbers) for the caller to count in
    ``report``, then written, one sequence a document, to the token and loss-mask builders of ``report.outputs``
    (its bad lines recorded first, the progress bar moved after). An error inside leaves no dataset behind (the
    builders' own cleanup); chat data and preference pairs (data/preference_preprocess.py) write through it."""
    slices = config.slices()
    where, progress = _LineNumbers(config, slices), _Progress(config, slices)
    try:
        with ExitStack() as stack:
            tokens = stack.enter_context(IndexedDatasetBuilder(report.outputs[0], dtype))
            masks = stack.enter_context(IndexedDatasetBuilder(report.outputs[1], np.uint8))
            batches = stack.enter_context(closing(encode_stream(config, read_batches(config, slices),
                                                                batch_encoder)))

            def written() -> Iterator:
                for batch in batches:
                    _record_bad_lines(config, batch, report, where)
                    yield batch, where
                    ones = np.ones(batch.lengths.size, dtype=np.int64)
                    tokens.add_documents(batch.tokens, batch.lengths, ones)
                    masks.add_documents(batch.masks, batch.lengths, ones)
                    progress.update(report, batch.input_bytes)

            yield written()
    finally:
        progress.close()
