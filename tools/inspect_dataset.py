"""Inspect an indexed dataset: counts, a document-length histogram, and the text of a document.

    python tools/inspect_dataset.py runs/data/botchan_text_document --document 3
"""

from __future__ import annotations

import argparse
import sys

from data.indexed_dataset import IndexedDataset, IndexFormatError
from data.summary import describe, format_histogram, length_histogram
from data.tokenizers import TOKENIZER_TYPES, build_tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="dataset path prefix, without .bin/.idx")
    parser.add_argument("--document", type=int, action="append", default=[],
                        help="decode and print document i (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=400, help="print at most this many tokens of a document")
    parser.add_argument("--verify", action="store_true", help="check every index entry, not only the header")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="GPT2BPETokenizer")
    parser.add_argument("--vocab-file", default=None)
    parser.add_argument("--merge-file", default=None)
    parser.add_argument("--tokenizer-model", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        dataset = IndexedDataset(args.prefix)
        if args.verify:
            dataset.verify()
    except IndexFormatError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for name, value in describe(dataset).items():
        print(f"{name:>24}: {value:.1f}" if isinstance(value, float) else f"{name:>24}: {value}")
    print("\ndocument length (tokens)   documents")
    print(format_histogram(length_histogram(dataset.document_lengths())))
    if args.document:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model)
        for document in args.document:
            if not 0 <= document < dataset.num_documents:
                print(f"error: document {document} is out of [0, {dataset.num_documents})", file=sys.stderr)
                return 1
            start = dataset.document_start(document)
            length = dataset.document_start(document + 1) - start
            ids = dataset.tokens[start : start + min(length, args.max_tokens)]
            print(f"\n--- document {document}: {length} tokens, ids {ids[:8].tolist()}...")
            print(tokenizer.decode(ids.tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
