"""The tokenizer that travels with a model: GPT-2's shipped BPE by default, or an HF tokenizer directory.

An import copies the HF model's tokenizer files, byte for byte, into ``<checkpoint>/hf_tokenizer/``; an export writes
the tokenizer (that one, or ``--tokenizer``, or GPT-2's) with ``save_pretrained`` so that AutoTokenizer loads it
offline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from model.config import GPT2_VOCAB_SIZE, ModelConfig

TOKENIZER_DIRECTORY = "hf_tokenizer"
# What save_pretrained of a tokenizer may write (slow and fast, SentencePiece and BPE); copied as they are
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")


def gpt2_tokenizer(model_max_length: int):
    """GPT-2's byte-level BPE from the files shipped in data/assets/gpt2, as a transformers tokenizer."""
    from transformers import GPT2Tokenizer

    from data.tokenizers import DEFAULT_MERGE_FILE, DEFAULT_VOCAB_FILE

    vocab = json.loads(Path(DEFAULT_VOCAB_FILE).read_text(encoding="utf-8"))
    lines = Path(DEFAULT_MERGE_FILE).read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    return GPT2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def write_tokenizer(directory: Path, config: ModelConfig, tokenizer_path: str | Path | None = None):
    """Tokenizer files that AutoTokenizer loads offline; returns the tokenizer (its eos/bos ids go in config.json).

    Default: the shipped GPT-2 BPE (this project's default tokenizer), which only fits a 50,257-token vocabulary.
    """
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path)
        tokenizer.model_max_length = config.max_position_embeddings
    elif config.vocab_size == GPT2_VOCAB_SIZE:
        tokenizer = gpt2_tokenizer(config.max_position_embeddings)
    else:
        raise ValueError(f"model.vocab_size is {config.vocab_size}, not GPT-2's {GPT2_VOCAB_SIZE}: pass --tokenizer "
                         f"with the Hugging Face tokenizer directory the training data was tokenized with")
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer {tokenizer_path} has {len(tokenizer)} tokens, more than the model's "
                         f"vocabulary {config.vocab_size}: it is not the tokenizer this model was trained with")
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def load_tokenizer(directory: str | Path):
    """An HF tokenizer directory, offline, no remote code."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False, local_files_only=True)


def end_of_text_id(directory: str | Path) -> int | None:
    """The id of the end-of-text token of an HF tokenizer directory (Llama 3: <|end_of_text|>, 128001)."""
    return load_tokenizer(directory).eos_token_id


def copy_tokenizer(hf_dir: Path, destination: Path) -> None:
    """The tokenizer files of an HF model directory, byte for byte (none: nothing is written)."""
    files = [hf_dir / name for name in TOKENIZER_FILES if (hf_dir / name).is_file()]
    if files:
        destination.mkdir()
        for file in files:
            shutil.copy2(file, destination / file.name)

