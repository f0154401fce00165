"""Train a SentencePiece tokenizer on a corpus (JSONL with --json-keys, or plain text, one document per file).

    python tools/train_tokenizer.py --input data/corpus/botchan.jsonl --model-prefix runs/tok/botchan \\
        --vocab-size 2000

Ids: unk 0, bos 1, eos 2, no pad. Use the model with --tokenizer-type GPTSentencePieceTokenizer (eod = eos) or
SentencePieceTokenizer (Megatron's wrapper, eod = an added <EOD>) and --tokenizer-model {model-prefix}.model.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator

from data.tokenizers import train_sentencepiece


def read_texts(path: str, json_keys: list[str]) -> Iterator[str]:
    """The texts of a JSONL file (each key of each line) or of a plain text file (the whole file)."""
    if not path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as stream:
            yield stream.read()
        return
    with open(path, encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            try:
                record = json.loads(line)
                yield from (record[key] for key in json_keys)
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: {type(error).__name__}: {error}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="JSONL or text files")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys of the JSONL records to train on")
    parser.add_argument("--model-prefix", required=True, help="writes {model-prefix}.model")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--model-type", choices=["bpe", "unigram", "char", "word"], default="bpe")
    parser.add_argument("--character-coverage", type=float, default=1.0)
    parser.add_argument("--max-documents", type=int, default=None, help="train on the first N documents only")
    parser.add_argument("--input-sentence-size", type=int, default=0,
                        help="sample this many lines for training (0: all)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    texts = itertools.chain.from_iterable(read_texts(path, args.json_keys) for path in args.input)
    try:
        path = train_sentencepiece(itertools.islice(texts, args.max_documents), args.model_prefix, args.vocab_size,
                                   args.model_type, args.character_coverage, args.input_sentence_size)
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
