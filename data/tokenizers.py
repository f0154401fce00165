"""Tokenizers behind one small interface: ``encode_batch``, ``decode``, ``eod_id``, ``vocab_size``.

Each class reproduces the ids of Megatron-LM's tokenizer of the same type name, so that datasets written here are
the same bytes as Megatron's:

- ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (default: the files shipped in
  ``data/assets/gpt2``); no special tokens are parsed from text; eod = ``<|endoftext|>`` (50256); 50,257 ids.
- ``SentencePieceTokenizer``: Megatron's wrapper, which appends ``<CLS> <SEP> <EOD> <MASK>`` (and pad/bos/eos pieces
  the model lacks) after the model's pieces and maps those strings in text to their ids; eod = ``<EOD>``.
- ``GPTSentencePieceTokenizer``: the plain model; eod = the model's ``</s>`` (eos) id.
- ``HuggingFaceTokenizer``: a ``tokenizer.json`` file or a directory holding one (as ``save_pretrained`` writes);
  special tokens are added as ``AutoTokenizer(text).input_ids`` does; eod = the eos token of
  ``tokenizer_config.json``, else ``eod_token``, else a usual end-of-text token found in the vocabulary.
"""

from __future__ import annotations

import io
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

GPT2_ASSETS = Path(__file__).resolve().parent / "assets" / "gpt2"
DEFAULT_VOCAB_FILE = str(GPT2_ASSETS / "vocab.json")
DEFAULT_MERGE_FILE = str(GPT2_ASSETS / "merges.txt")
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer")
_END_OF_TEXT_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


class Tokenizer(ABC):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int  # number of ids the tokenizer can produce (before any padding for tensor parallelism)
    eod_id: int  # id appended after every document with --append-eod

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids."""

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]


def _byte_level_bpe(vocab_file: str, merge_file: str):
    """GPT-2's tokenizer from its two files with the `tokenizers` library (GPT-2's regex, no added tokens)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    for path in (vocab_file, merge_file):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GPT-2 BPE file {path} does not exist (--vocab-file/--merge-file)")
    tokenizer = RustTokenizer(models.BPE.from_file(vocab_file, merge_file))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE: "Hello world" -> [15496, 995], eod 50256, vocab_size 50257 with the shipped files."""

    def __init__(self, vocab_file: str | None = None, merge_file: str | None = None) -> None:
        self.vocab_file = vocab_file or DEFAULT_VOCAB_FILE
        self.merge_file = merge_file or DEFAULT_MERGE_FILE
        self._tokenizer = _byte_level_bpe(self.vocab_file, self.merge_file)
        self.vocab_size = self._tokenizer.get_vocab_size()
        eod = self._tokenizer.token_to_id("<|endoftext|>")
        if eod is None:
            raise ValueError(f"{self.vocab_file} has no <|endoftext|> token: not a GPT-2 vocabulary")
        self.eod_id = eod

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


class GPTSentencePieceTokenizer(Tokenizer):
    """A SentencePiece model as it is; eod is its eos (``</s>``) id."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        if not model_file or not os.path.isfile(model_file):
            raise FileNotFoundError(f"SentencePiece model {model_file!r} does not exist (--tokenizer-model)")
        self.model_file = model_file
        self._model = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self._model.get_piece_size()
        self.eod_id = self._model.eos_id()
        if self.eod_id < 0:
            raise ValueError(f"{model_file} has no eos piece, so no end-of-document id; train it with eos_id >= 0")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._model.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._model.decode(list(ids))


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``SentencePieceTokenizer``: special pieces appended to the vocabulary, eod = ``<EOD>``."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        pieces = {self._model.id_to_piece(i): i for i in range(self._model.get_piece_size())}
        self._special: dict[str, int] = {}
        for piece in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(pieces, piece)
        for piece_id, fallback in ((self._model.pad_id(), "<PAD>"), (self._model.bos_id(), "<BOS>"),
                                   (self._model.eos_id(), "<EOS>")):
            in_model = 0 <= piece_id < self._model.get_piece_size()
            self._add_special(pieces, self._model.id_to_piece(piece_id) if in_model else fallback)
        self._special_by_id = {index: piece for piece, index in self._special.items()}
        self.vocab_size = len(pieces)
        self.eod_id = self._special["<EOD>"]

    def _add_special(self, pieces: dict[str, int], piece: str) -> None:
        if piece not in pieces:
            pieces[piece] = len(pieces)
        self._special[piece] = pieces[piece]

    def _encode_one(self, text: str) -> list[int]:
        """Split the text at the earliest special piece, left to right, as Megatron does."""
        ids: list[int] = []
        while True:
            found = [(text.find(piece), piece) for piece in self._special if piece in text]
            if not found:
                return ids + self._model.encode(text)
            position, piece = min(found, key=lambda found_piece: found_piece[0])  # ties: first registered
            ids += self._model.encode(text[:position]) + [self._special[piece]]
            text = text[position + len(piece) :]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._encode_one(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        text, pending = "", []
        for index in ids:
            if index in self._special_by_id:
                text += self._model.decode(pending) + " " + self._special_by_id[index] + " "
                pending = []
            else:
                pending.append(index)
        return text + self._model.decode(pending)


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer from ``tokenizer.json`` or a directory holding it."""

    def __init__(self, path: str, eod_token: str | None = None, add_special_tokens: bool = True) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.path = path
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} does not exist: --tokenizer-model takes a tokenizer.json or a "
                                    f"directory holding one")
        self._tokenizer = RustTokenizer.from_file(file)
        self.add_special_tokens = add_special_tokens
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        usual = (t for t in _END_OF_TEXT_CANDIDATES if self._tokenizer.token_to_id(t) is not None)
        token = eod_token or _configured_eos(directory) or next(usual, None)
        eod = self._tokenizer.token_to_id(token) if token else None
        if eod is None:
            raise ValueError(f"{path}: cannot tell the end-of-document token (no eos_token in tokenizer_config.json "
                             f"and none of {_END_OF_TEXT_CANDIDATES} in the vocabulary); pass eod_token=")
        self.eod_id = eod

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=self.add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def _configured_eos(directory: str) -> str | None:
    """The eos token named by a saved tokenizer's config files, if any."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            with open(os.path.join(directory, name)) as stream:
                token = json.load(stream).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            return token
    return None


def build_tokenizer(
    tokenizer_type: str = "GPT2BPETokenizer",
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
) -> Tokenizer:
    """A tokenizer from Megatron's ``--tokenizer-type`` name and its file flags."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer"):
        if not tokenizer_model:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
        if tokenizer_type == "SentencePieceTokenizer":
            return SentencePieceTokenizer(tokenizer_model)
        if tokenizer_type == "GPTSentencePieceTokenizer":
            return GPTSentencePieceTokenizer(tokenizer_model)
        return HuggingFaceTokenizer(tokenizer_model)
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")


def train_sentencepiece(
    texts: Iterable[str],
    model_prefix: str,
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    input_sentence_size: int = 0,
    seed_sentencepiece_size: int = 1_000_000,
) -> str:
    """Train a SentencePiece model on texts (each line of each text is one training sentence).

    Writes ``{model_prefix}.model`` through a temporary name and returns its path. Ids: unk 0, bos 1, eos 2 (the eod
    of GPTSentencePieceTokenizer), no pad.
    """
    import sentencepiece

    def sentences() -> Iterable[str]:
        for text in texts:
            yield from (line for line in text.splitlines() if line.strip())

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences()), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        character_coverage=character_coverage, input_sentence_size=input_sentence_size,
        shuffle_input_sentence=input_sentence_size > 0, seed_sentencepiece_size=seed_sentencepiece_size,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=os.cpu_count() or 1,
    )
    path = f"{model_prefix}.model"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "wb") as stream:
        stream.write(model.getvalue())
    os.replace(temporary, path)
    return path
