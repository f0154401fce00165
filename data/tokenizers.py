"""Tokenizers behind one small interface: ``encode_batch``, ``decode``, ``eod_id``, ``vocab_size``.

Each class reproduces the ids of Megatron-LM's tokenizer of the same type name, so that datasets written here are
the same bytes as Megatron's:

- ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (default: the files shipped in
  ``data/assets/gpt2``); eod = ``<|endoftext|>`` (50256); 50,257 ids. ``<|endoftext|>`` written in a text is text
  (1279, 91, 437, 1659, 5239, 91, 29), the rule of Megatron-DeepSpeed's GPT2BPETokenizer; with
  ``parse_special_tokens`` it is the id 50256, the rule of Megatron-LM's current one (through `transformers`).
- ``SentencePieceTokenizer``: Megatron's wrapper, which appends ``<CLS> <SEP> <EOD> <MASK>`` (and pad/bos/eos pieces
  the model lacks) after the model's pieces and maps those strings in text to their ids; eod = ``<EOD>``.
- ``GPTSentencePieceTokenizer``: the plain model; eod = the model's ``</s>`` (eos) id.
- ``HuggingFaceTokenizer``: a ``tokenizer.json`` file or a directory holding one (as ``save_pretrained`` writes);
  special tokens are added as ``AutoTokenizer(text).input_ids`` does; eod = the eos token of
  ``tokenizer_config.json``, else ``eod_token``, else a usual end-of-text token found in the vocabulary.

The two byte-level BPE types run on one of two backends with the same ids: tiktoken (about 3x faster) where
``data.tiktoken_bpe`` proves the vocabulary converts exactly, else Hugging Face `tokenizers`. ``backend="auto"``
picks tiktoken when exact and says why not otherwise (``backend_note``); ``"tiktoken"`` refuses a vocabulary that is
not exact; ``"tokenizers"`` always uses `tokenizers`.
"""

from __future__ import annotations

import io
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from common.files import write_bytes_atomically
from data.tiktoken_bpe import (
    NotExactError,
    TiktokenEncoder,
    TiktokenVocabulary,
    gpt2_files_document,
    tiktoken_vocabulary,
)

GPT2_ASSETS = Path(__file__).resolve().parent / "assets" / "gpt2"
DEFAULT_VOCAB_FILE = str(GPT2_ASSETS / "vocab.json")
DEFAULT_MERGE_FILE = str(GPT2_ASSETS / "merges.txt")
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer")
TOKENIZER_BACKENDS = ("auto", "tiktoken", "tokenizers")
GPT2_EOD_TOKEN = "<|endoftext|>"
_END_OF_TEXT_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


class Tokenizer(ABC):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int  # number of ids the tokenizer can produce (before any padding for tensor parallelism)
    eod_id: int  # id appended after every document with --append-eod
    backend: str = "tokenizers"  # what encodes: "tiktoken", "tokenizers" or "sentencepiece"
    backend_note: str = ""  # why backend="auto" did not choose tiktoken, if it did not

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids."""

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]


def _byte_level_bpe(vocab_file: str, merge_file: str, parse_special_tokens: bool = False):
    """GPT-2's tokenizer from its two files with the `tokenizers` library (GPT-2's regex)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    tokenizer = RustTokenizer(models.BPE.from_file(vocab_file, merge_file))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    if parse_special_tokens:
        tokenizer.add_special_tokens([AddedToken(GPT2_EOD_TOKEN, special=True, normalized=False)])
    return tokenizer


def select_backend(backend: str, build_tiktoken: Callable[[], TiktokenEncoder]) -> tuple[TiktokenEncoder | None, str]:
    """(the tiktoken encoder, or None to use `tokenizers`; why not tiktoken). Raises if tiktoken is requested but
    would not give the same ids."""
    if backend not in TOKENIZER_BACKENDS:
        raise ValueError(f"unknown tokenizer backend {backend!r}; choose one of {', '.join(TOKENIZER_BACKENDS)}")
    if backend == "tokenizers":
        return None, "tokenizers requested"
    try:
        return build_tiktoken(), ""
    except (NotExactError, ImportError) as error:
        reason = "tiktoken is not installed" if isinstance(error, ImportError) else str(error)
        if backend == "tiktoken":
            raise ValueError(f"--tokenizer-backend tiktoken: {reason}; use --tokenizer-backend auto or "
                             f"tokenizers") from error
        return None, f"tiktoken would not give the same ids: {reason}"


@lru_cache(maxsize=4)
def _gpt2_vocabulary(vocab_file: str, merge_file: str, file_stamps: tuple) -> TiktokenVocabulary:
    """tiktoken's tables of a GPT-2 vocabulary, checked once per process and per version of the files."""
    document = gpt2_files_document(vocab_file, merge_file)
    eod = document["model"]["vocab"].get(GPT2_EOD_TOKEN)
    if eod is None:
        raise ValueError(f"{vocab_file} has no {GPT2_EOD_TOKEN} token: not a GPT-2 vocabulary")
    return tiktoken_vocabulary(document, vocab_file, extra_special={GPT2_EOD_TOKEN: eod})


def _file_stamps(*paths: str) -> tuple:
    return tuple((os.path.realpath(path), os.stat(path).st_size, os.stat(path).st_mtime_ns) for path in paths)


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE: "Hello world" -> [15496, 995], eod 50256, vocab_size 50257 with the shipped files."""

    def __init__(self, vocab_file: str | None = None, merge_file: str | None = None, backend: str = "auto",
                 parse_special_tokens: bool = False) -> None:
        self.vocab_file = vocab_file or DEFAULT_VOCAB_FILE
        self.merge_file = merge_file or DEFAULT_MERGE_FILE
        self.parse_special_tokens = parse_special_tokens
        for path in (self.vocab_file, self.merge_file):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"GPT-2 BPE file {path} does not exist (--vocab-file/--merge-file)")
        self._tiktoken, self.backend_note = select_backend(backend, self._tiktoken_encoder)
        if self._tiktoken is not None:
            self.backend = "tiktoken"
            self.vocab_size = len(self._tiktoken.vocabulary.token_bytes)
            eod = self._tiktoken.vocabulary.special_tokens.get(GPT2_EOD_TOKEN)
        else:
            self._tokenizer = _byte_level_bpe(self.vocab_file, self.merge_file, parse_special_tokens)
            self.vocab_size = self._tokenizer.get_vocab_size()
            eod = self._tokenizer.token_to_id(GPT2_EOD_TOKEN)
        if eod is None:
            raise ValueError(f"{self.vocab_file} has no {GPT2_EOD_TOKEN} token: not a GPT-2 vocabulary")
        self.eod_id = eod

    def _tiktoken_encoder(self) -> TiktokenEncoder:
        stamps = _file_stamps(self.vocab_file, self.merge_file)
        return TiktokenEncoder(_gpt2_vocabulary(self.vocab_file, self.merge_file, stamps), self.parse_special_tokens)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._tiktoken is not None:
            return self._tiktoken.encode_batch(texts)
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        if self._tiktoken is not None:
            return self._tiktoken.decode(ids)
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
        self.backend = "sentencepiece"
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
    """A Hugging Face fast tokenizer from ``tokenizer.json`` or a directory holding it.

    Its added tokens written in a text are always their ids, as ``AutoTokenizer`` (and so Megatron) does. A byte-level
    BPE file that converts exactly runs on tiktoken (see ``data.tiktoken_bpe``).
    """

    def __init__(self, path: str, eod_token: str | None = None, add_special_tokens: bool = True,
                 backend: str = "auto") -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.path = path
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} does not exist: --tokenizer-model takes a tokenizer.json or a "
                                    f"directory holding one")
        self.file = file
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
        self._tiktoken, self.backend_note = select_backend(backend, self._tiktoken_encoder)
        self.backend = "tokenizers" if self._tiktoken is None else "tiktoken"

    def _tiktoken_encoder(self) -> TiktokenEncoder:
        with open(self.file, encoding="utf-8") as stream:
            vocabulary = tiktoken_vocabulary(json.load(stream), self.file)
        return TiktokenEncoder(vocabulary, parse_special_tokens=True, add_special_tokens=self.add_special_tokens,
                               fallback=self._encode_with_tokenizers)

    def _encode_with_tokenizers(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._tiktoken is not None:
            return self._tiktoken.encode_batch(texts)
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
    backend: str = "auto",
    parse_special_tokens: bool = False,
) -> Tokenizer:
    """A tokenizer from Megatron's ``--tokenizer-type`` name and its file flags.

    backend: one of TOKENIZER_BACKENDS, for the byte-level BPE types. parse_special_tokens: for GPT2BPETokenizer
    (the other types already map their special tokens written in text to their ids, as Megatron does).
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file, backend, parse_special_tokens)
    if not tokenizer_model:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, backend=backend)
    if backend == "tiktoken":
        raise ValueError(f"--tokenizer-backend tiktoken is for byte-level BPE (GPT2BPETokenizer, "
                         f"HuggingFaceTokenizer), not {tokenizer_type}")
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    return GPTSentencePieceTokenizer(tokenizer_model)


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
    write_bytes_atomically(path, model.getvalue())
    return path
