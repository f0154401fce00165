"""Concatenate indexed datasets (same dtype) into one, documents in order, as Megatron's merge tool does.

    python tools/merge_datasets.py --input runs/data/shards --output-prefix runs/data/all_text_document
    python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab_text_document

The shards of ``tools/preprocess_data.py --shard K/N --output-prefix P`` are merged by their prefix, every key at
once, into the datasets (and bytes) one run over all the inputs writes, ``P_{key}_document``; only when all N shards
are complete and come from the same run:

    python tools/merge_datasets.py --shards runs/data/corpus
"""

from __future__ import annotations

import argparse
import os
import sys

from data.indexed_dataset import IndexedDataset, IndexFormatError, merge_datasets
from data.sharding import ShardError, merge_shards


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
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+",
                        help="a directory of .bin/.idx pairs (merged in name order), or dataset prefixes in order")
    source.add_argument("--shards", metavar="OUTPUT_PREFIX",
                        help="the --output-prefix given to tools/preprocess_data.py --shard K/N: merge its N shards, "
                             "every key, into OUTPUT_PREFIX_{key}_document")
    parser.add_argument("--output-prefix", default=None,
                        help="path prefix of the merged dataset (with --shards: of the merged datasets, default the "
                             "--shards prefix)")
    return parser


def describe(prefix: str, merged: IndexedDataset) -> str:
    return (f"{prefix}: {merged.num_documents} documents, {len(merged)} sequences, {merged.num_tokens} tokens "
            f"({merged.dtype})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.shards:
            for key, merged in merge_shards(args.shards, args.output_prefix).items():
                print(f"merged the shards of {args.shards} ({key}) into {describe(merged.prefix, merged)}")
            return 0
        if not args.output_prefix:
            raise ValueError("--input needs --output-prefix")
        prefixes = input_prefixes(args.input)
        merged = merge_datasets(prefixes, args.output_prefix)
    except (IndexFormatError, ShardError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}: {merged.num_documents} documents, "
          f"{len(merged)} sequences, {merged.num_tokens} tokens ({merged.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
