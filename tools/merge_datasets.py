"""Concatenate indexed datasets (same dtype) into one, documents in order, as Megatron's merge tool does.

    python tools/merge_datasets.py --input runs/data/shards --output-prefix runs/data/all_text_document
    python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab_text_document
"""

from __future__ import annotations

import argparse
import os
import sys

from data.indexed_dataset import IndexFormatError, merge_datasets


def input_prefixes(inputs: list[str]) -> list[str]:
    """Prefixes from a directory (every .idx/.bin pair in it, sorted by name) or from prefixes given in order."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        names = sorted(name[: -len(".idx")] for name in os.listdir(inputs[0]) if name.endswith(".idx"))
        prefixes = [os.path.join(inputs[0], name) for name in names]
        if not prefixes:
            raise IndexFormatError(f"{inputs[0]}: no .idx files in this directory")
        return prefixes
    return [path[:-4] if path.endswith((".idx", ".bin")) else path for path in inputs]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="a directory of .bin/.idx pairs (merged in name order), or dataset prefixes in order")
    parser.add_argument("--output-prefix", required=True, help="path prefix of the merged dataset")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prefixes = input_prefixes(args.input)
        merged = merge_datasets(prefixes, args.output_prefix)
    except (IndexFormatError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}: {merged.num_documents} documents, "
          f"{len(merged)} sequences, {merged.num_tokens} tokens ({merged.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
