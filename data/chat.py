"""Chat and prompt/completion records -> token ids and a loss mask, as TRL's SFTTrainer masks them.

Records (one JSON object per line):

- chat: ``{"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}``, rendered with a chat
  template (the tokenizer's own or a Jinja file);
- prompt/completion: ``{"prompt": "...", "completion": "..."}`` (strings, tokenised as TRL does: the prompt, then the
  prompt and completion together) or ``{"prompt": [messages], "completion": [messages]}`` (conversational, rendered
  with the chat template: the prompt with its generation prompt, then prompt and completion together).

The mask is 1 on the tokens the loss is taken on (``loss_on``):

- ``assistant`` (default): every assistant turn of a chat, its end-of-turn token included; the completion of a
  prompt/completion record.
- ``completion``: the completion of a prompt/completion record; of a chat, only its last message, which must be the
  assistant's (the chat read as prompt = messages[:-1], completion = messages[-1]).
- ``all``: every token.

How the assistant tokens of a chat are found:

1. The template has ``{% generation %}`` blocks: ``apply_chat_template(..., return_assistant_tokens_mask=True,
   return_dict=True)`` marks the tokens of the blocks (TRL's ``assistant_only_loss``).
2. It has none: incremental rendering. The tokens of messages[:i] (with the generation prompt before an assistant
   turn) must be a prefix of those of messages[:i+1], and so on up to the whole conversation, else the record is bad
   (the message says where the tokens diverge); an assistant turn is the tokens between the generation prompt before
   it and the rendering that ends with it, less whitespace-only tokens after its last special token (the newline a
   template writes after its end-of-turn token, outside the turn: the same tokens as a ``{% generation %}`` block
   around the reply and its end-of-turn token). Conversational prompt/completion records use the same rule.

With ``append_eod`` the end-of-document id (the tokenizer's eos, unless told otherwise) is appended. It is no target
(TRL's assistant mask counts the template's tokens only): it separates the records in the token stream, and training
takes each packed sample's documents from the dataset's index, not from it (data/loader.py), so a template whose
end-of-turn token is that same eos (Qwen's <|im_end|>, Llama 3's <|eot_id|>) stays whole. With ``eod_is_target`` it is
a target when the record ends with a target (only whitespace after its last target token), or with ``all``: the model
then learns to end a document after the last reply.
A record without any target token is refused (counted by reason, not an error).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LOSS_ON = ("assistant", "completion", "all")
TOKENIZER_TEMPLATE = "tokenizer"  # --chat-template tokenizer: the template saved with the tokenizer
_GENERATION_TAG = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """A chat template that cannot be used (missing, unreadable, not prefix-stable)."""


@dataclass
class Example:
    """One record, tokenised: ids and the 0/1 loss mask of the same length."""

    ids: list[int]
    mask: list[int]


class Refused(Exception):
    """A well-formed record that yields no target token; ``reason`` is the short reason it is counted under."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BadRecord(Exception):
    """A malformed record (or one the template cannot render): handled as the preprocessor's bad lines."""


def has_generation_blocks(template: str) -> bool:
    return bool(_GENERATION_TAG.search(template))


def strip_generation_blocks(template: str) -> str:
    """The template without its ``{% generation %}``/``{% endgeneration %}`` tags (what they enclose stays)."""
    return _GENERATION_TAG.sub("", template)


def load_chat_template(choice: str | None, tokenizer) -> str | None:
    """The template text: ``tokenizer`` -> the tokenizer's own, else the Jinja file at that path; None -> None."""
    if choice is None:
        return None
    if choice == TOKENIZER_TEMPLATE:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        if not isinstance(template, str) or not template:
            raise ChatTemplateError("--chat-template tokenizer: the tokenizer has no chat template (no chat_template "
                                    "in its tokenizer_config.json or chat_template.jinja); pass --chat-template FILE "
                                    "with a Jinja template")
        return template
    if not os.path.isfile(choice):
        raise ChatTemplateError(f"--chat-template {choice}: no such file (pass a Jinja template file, or "
                                f"'{TOKENIZER_TEMPLATE}' for the tokenizer's own template)")
    with open(choice, encoding="utf-8") as stream:
        return stream.read()


def load_hf_tokenizer(tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None,
                      tokenizer_model: str | None = None):
    """A transformers tokenizer (what renders chat templates) from the preprocessor's tokenizer flags, offline."""
    if tokenizer_type == "GPT2BPETokenizer":
        from transformers import GPT2Tokenizer

        from data.tokenizers import DEFAULT_MERGE_FILE, DEFAULT_VOCAB_FILE

        with open(vocab_file or DEFAULT_VOCAB_FILE, encoding="utf-8") as stream:
            vocab = json.load(stream)
        with open(merge_file or DEFAULT_MERGE_FILE, encoding="utf-8") as stream:  # as hf.tokenizer.gpt2_tokenizer
            merges = [tuple(line.split()) for line in stream.read().splitlines()
                      if line and not line.startswith("#version")]
        return GPT2Tokenizer(vocab=vocab, merges=merges)
    if tokenizer_type != "HuggingFaceTokenizer":
        raise ValueError(f"chat and prompt/completion data need a Hugging Face tokenizer: --tokenizer-type "
                         f"GPT2BPETokenizer or HuggingFaceTokenizer, not {tokenizer_type}")
    if not tokenizer_model:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
    if os.path.isdir(tokenizer_model):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_model, trust_remote_code=False, local_files_only=True)
    if not os.path.isfile(tokenizer_model):
        raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: no such file or directory")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=tokenizer_model)


def _messages(value, what: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRecord(f"{what} must be a non-empty list of messages, got {type(value).__name__}"
                        + (" (empty)" if value == [] else ""))
    for number, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRecord(f"{what}[{number}] must be an object with a string 'role'")
        if not isinstance(message.get("content"), str):
            raise BadRecord(f"{what}[{number}] ({message['role']}) must have a string 'content', got "
                            f"{type(message.get('content')).__name__}")
    return value


def _snippet(tokenizer, ids: Sequence[int]) -> str:
    return repr(tokenizer.decode(list(ids)))[:60]


class ChatEncoder:
    """Turns one parsed record into an :class:`Example`; raises :class:`Refused` or :class:`BadRecord`."""

    def __init__(self, tokenizer, template: str | None, loss_on: str = "assistant", append_eod: bool = False,
                 eod_id: int | None = None, eod_is_target: bool = False) -> None:
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on {loss_on!r}: choose one of {', '.join(LOSS_ON)}")
        self.tokenizer, self.template, self.loss_on, self.append_eod = tokenizer, template, loss_on, append_eod
        self.eod_is_target = eod_is_target
        self.eod_id = tokenizer.eos_token_id if eod_id is None else eod_id
        if append_eod and self.eod_id is None:
            raise ValueError("--append-eod: the tokenizer has no eos token")
        self.generation_blocks = template is not None and has_generation_blocks(template)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids = set(tokenizer.all_special_ids) | {int(i) for i in added}

    # ---------------------------------------------------------------------------------------------- entry point

    def __call__(self, record: dict) -> Example:
        if "messages" in record:
            messages = _messages(record["messages"], "'messages'")
            ids, mask = self._chat(messages)
        elif "prompt" in record and "completion" in record:
            prompt, completion = record["prompt"], record["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):
                ids, mask = self._text_prompt_completion(prompt, completion)
            elif isinstance(prompt, list) and isinstance(completion, list):
                ids, mask = self._chat_prompt_completion(_messages(prompt, "'prompt'"),
                                                         _messages(completion, "'completion'"))
            else:
                raise BadRecord(f"'prompt' and 'completion' must both be strings or both lists of messages, got "
                                f"{type(prompt).__name__} and {type(completion).__name__}")
        else:
            raise BadRecord(f"expected 'messages', or 'prompt' and 'completion' (the record has {sorted(record)[:8]})")
        if self.loss_on == "all":
            mask = [1] * len(ids)
        if self.append_eod:
            target = self.eod_is_target and (self.loss_on == "all" or self._ends_with_target(ids, mask))
            ids, mask = ids + [self.eod_id], mask + [int(target)]
        if not ids:
            raise Refused("no tokens")
        if not any(mask):
            raise Refused("no target token")
        return Example(ids, mask)

    def _ends_with_target(self, ids: list[int], mask: list[int]) -> bool:
        """Whether the record ends with a target turn: only whitespace (the template's) after its last target."""
        last = next((i for i in range(len(mask) - 1, -1, -1) if mask[i]), None)
        return last is not None and not self.tokenizer.decode(ids[last + 1 :]).strip()

    # ------------------------------------------------------------------------------------------------ rendering

    def _need_template(self) -> str:
        if self.template is None:
            raise BadRecord("a chat record needs a chat template: pass --chat-template tokenizer|FILE")
        return self.template

    def _render_text(self, messages: list[dict], generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self._need_template(), tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except BadRecord:
            raise
        except Exception as error:  # jinja errors, raise_exception() of the template
            raise BadRecord(f"the chat template cannot render it ({type(error).__name__}: {error})") from None

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        """Token ids of a rendering, tokenised as apply_chat_template(tokenize=True) does."""
        return self.tokenizer(self._render_text(messages, generation_prompt), add_special_tokens=False)["input_ids"]

    def _after_prompt(self, messages: list[dict], mask: list[int]) -> list[int]:
        """The mask left on the tokens of the last message: those that end after the text rendered before it."""
        prompt, text = self._render_text(messages[:-1], True), self._render_text(messages)
        if not text.startswith(prompt):
            raise BadRecord(f"the chat template renders messages[:{len(messages) - 1}] with the generation prompt "
                            f"as text that does not start the whole conversation's, so the last message cannot be "
                            f"told apart for --loss-on completion")
        offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return [m if end > len(prompt) else 0 for m, (_, end) in zip(mask, offsets, strict=True)]

    def _tokens_with_blocks(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        try:
            out = self.tokenizer.apply_chat_template(messages, chat_template=self._need_template(), tokenize=True,
                                                     return_dict=True, return_assistant_tokens_mask=True)
        except BadRecord:
            raise
        except Exception as error:
            raise BadRecord(f"the chat template cannot render it ({type(error).__name__}: {error})") from None
        return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]

    def _check_prefix(self, shorter: list[int], longer: list[int], what: str) -> None:
        if longer[: len(shorter)] != shorter:
            at = next((i for i, (a, b) in enumerate(zip(shorter, longer, strict=False)) if a != b), min(len(shorter), len(longer)))
            raise BadRecord(
                f"the chat template is not prefix-stable: the tokens of {what} are not a prefix of the tokens that "
                f"follow (they diverge at token {at}: {_snippet(self.tokenizer, shorter[at:at + 4])} vs "
                f"{_snippet(self.tokenizer, longer[at:at + 4])}), so the assistant's tokens cannot be told by "
                f"incremental rendering; add {{% generation %}} blocks around the assistant's reply and its "
                f"end-of-turn token in the template")

    def _turn_end(self, ids: list[int], start: int, end: int) -> int:
        """End of an assistant turn: whitespace-only tokens after its last special token are the template's."""
        last = next((i for i in range(end - 1, start - 1, -1) if ids[i] in self.special_ids), None)
        if last is None or last == end - 1:
            return end
        if self.tokenizer.decode(ids[last + 1 : end]).strip():
            return end
        return last + 1

    def incremental_mask(self, messages: list[dict], targets: Sequence[int]) -> tuple[list[int], list[int]]:
        """(ids, mask) of a conversation whose messages at ``targets`` are targets, by incremental rendering."""
        steps: list[tuple[str, list[int]]] = []  # each a prefix of the next, the last the whole conversation
        spans = []
        for i in range(len(messages)):
            if i in targets:
                if i == 0:
                    raise BadRecord("the first message is a target, so there is no prompt to render before it; "
                                    "start the conversation with a system or user message, or use a template "
                                    "with {% generation %} blocks")
                steps.append((f"messages[:{i}] with the generation prompt", self._render(messages[:i], True)))
            steps.append((f"messages[:{i + 1}]", self._render(messages[: i + 1])))
            if i in targets:
                spans.append((len(steps[-2][1]), len(steps[-1][1])))
        for (what, shorter), (_, longer) in zip(steps, steps[1:], strict=False):
            self._check_prefix(shorter, longer, what)
        ids = steps[-1][1]
        mask = [0] * len(ids)
        for start, end in spans:
            for position in range(start, self._turn_end(ids, start, end)):
                mask[position] = 1
        return ids, mask

    # ------------------------------------------------------------------------------------------------ the kinds

    def _chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        if self.loss_on == "completion":
            if messages[-1]["role"] != "assistant":
                raise Refused("--loss-on completion: the last message is not the assistant's")
            targets = [len(messages) - 1]
        else:
            targets = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if self.loss_on == "all":
            return self._render(messages), []
        if not targets:
            raise Refused("no assistant message")
        if not self.generation_blocks:
            return self.incremental_mask(messages, targets)
        ids, mask = self._tokens_with_blocks(messages)
        if self.loss_on == "completion" and len(messages) > 1:  # only the blocks of the last message
            mask = self._after_prompt(messages, mask)
        return ids, mask

    def _chat_prompt_completion(self, prompt: list[dict], completion: list[dict]) -> tuple[list[int], list[int]]:
        messages = prompt + completion
        if self.loss_on == "all":
            return self._render(messages), []
        prompt_ids, ids = self._render(prompt, True), self._render(messages)
        self._check_prefix(prompt_ids, ids, "the prompt with the generation prompt")
        end = self._turn_end(ids, len(prompt_ids), len(ids))
        return ids, [0] * len(prompt_ids) + [1] * (end - len(prompt_ids)) + [0] * (len(ids) - end)

    def _text_prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        ids = self.tokenizer(prompt + completion)["input_ids"]
        if ids[: len(prompt_ids)] != prompt_ids:
            raise BadRecord(f"the tokens of the prompt are not a prefix of the tokens of prompt + completion (the "
                            f"text at the boundary, {prompt[-10:] + completion[:10]!r}, tokenises across it); "
                            f"move the whitespace between them to the start of the completion")
        return ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))


def parse_record(record: bytes | dict) -> dict:
    """A JSONL line (or a row `datasets` read) as a dict; raises BadRecord with the reason."""
    if isinstance(record, bytes):
        try:
            text = record.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadRecord(f"invalid UTF-8 at byte offset {error.start} of the line") from None
        if not text.strip():
            raise BadRecord("blank line (expected one JSON object)")
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise BadRecord(f"malformed JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    return record


def as_arrays(example: Example, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(example.ids, dtype=dtype), np.asarray(example.mask, dtype=np.uint8)
