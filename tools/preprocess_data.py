"""Tokenise a corpus into Megatron indexed datasets: {output_prefix}_{key}_document.bin/.idx per --json-keys key.

Flags are Megatron-LM's where the meaning is the same, so existing scripts keep working, e.g.

    python tools/preprocess_data.py --input data/corpus/botchan.jsonl --output-prefix runs/data/botchan \\
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 2

With the same tokenizer and --append-eod the output is the same bytes as Megatron's tool writes.

On a cluster, each of N jobs tokenises one slice and the shards are merged (the bytes of one run):

    python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix runs/data/corpus --append-eod \\
        --workers 16 --shard $SLURM_ARRAY_TASK_ID/64          # jobs 0..63
    python tools/merge_datasets.py --shards runs/data/corpus  # -> runs/data/corpus_text_document.bin/.idx

Chat ({"messages": [{"role": ..., "content": ...}, ...]}) and prompt/completion ({"prompt": ..., "completion": ...})
records, with --chat-template and/or --loss-on, are written as tokens plus a loss mask, as TRL's SFTTrainer masks:

    python tools/preprocess_data.py --input data/corpus/chat_demo.jsonl --output-prefix runs/data/chat \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR --chat-template tokenizer
    # -> runs/data/chat_text_document.bin/.idx (tokens) and runs/data/chat_loss_mask_document.bin/.idx (uint8 0/1)

Preference pairs (TRL's formats: {"prompt": ..., "chosen": ..., "rejected": ...}, the prompt optional), with
--preference, are written as TRL's DPOTrainer tokenises them, chosen and rejected as documents 2i and 2i + 1:

    python tools/preprocess_data.py --input data/corpus/preference_demo.jsonl --output-prefix runs/data/pref \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR --chat-template tokenizer --preference
    # -> runs/data/pref_text_document, runs/data/pref_loss_mask_document and, last, runs/data/pref_preference.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from data.chat import LOSS_ON
from data.chat_preprocess import ChatPreprocessConfig, ChatPreprocessReport, preprocess_chat
from data.preference import TRUNCATION
from data.preference_preprocess import PreferencePreprocessConfig, preprocess_preference
from data.preprocess import INPUT_FORMATS, BadInputError, PreprocessConfig, preprocess
from data.sharding import parse_shard
from data.tokenizers import DEFAULT_MERGE_FILE, DEFAULT_VOCAB_FILE, TOKENIZER_BACKENDS, TOKENIZER_TYPES


def shard_argument(text: str) -> tuple[int, int]:
    try:
        return parse_shard(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("input data")
    data.add_argument("--input", required=True, nargs="+",
                      help="JSONL files (one JSON object per line, .gz allowed), json/parquet/arrow files or saved "
                           "dataset directories read with `datasets`, or glob patterns (quoted; matches in name "
                           "order); read in the order given as one corpus")
    data.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                      help="auto: a directory is a saved dataset, .parquet/.arrow by suffix, anything else JSONL")
    data.add_argument("--json-keys", nargs="+", default=["text"],
                      help="keys to tokenise, one output dataset each (default: text)")
    data.add_argument("--skip-bad-lines", action="store_true",
                      help="skip lines that are malformed, lack a key, are not UTF-8 or have no tokens; they are "
                           "counted and reported at the end (default: stop at the first, naming file and line)")
    tokenization = parser.add_argument_group("tokenizer")
    tokenization.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="GPT2BPETokenizer")
    tokenization.add_argument("--vocab-file", default=None, help=f"GPT-2 vocab.json (default: {DEFAULT_VOCAB_FILE})")
    tokenization.add_argument("--merge-file", default=None, help=f"GPT-2 merges.txt (default: {DEFAULT_MERGE_FILE})")
    tokenization.add_argument("--tokenizer-model", default=None,
                              help="SentencePiece .model, or Hugging Face tokenizer.json or directory holding one")
    tokenization.add_argument("--append-eod", action="store_true",
                              help="append the end-of-document token to every document")
    tokenization.add_argument("--parse-special-tokens", action="store_true",
                              help="GPT2BPETokenizer: <|endoftext|> written inside a text becomes the id 50256 (a "
                                   "document boundary), as Megatron-LM's current GPT2BPETokenizer does. Default: it "
                                   "is text (1279, 91, 437, 1659, 5239, 91, 29), as Megatron-DeepSpeed's does. "
                                   "HuggingFaceTokenizer and SentencePieceTokenizer always map their special tokens")
    tokenization.add_argument("--tokenizer-backend", choices=TOKENIZER_BACKENDS, default="auto",
                              help="byte-level BPE engine, same ids either way: tiktoken (about 3x faster) when the "
                                   "vocabulary provably converts exactly, else Hugging Face tokenizers (auto says "
                                   "why); tiktoken refuses a vocabulary that does not convert exactly")
    chat = parser.add_argument_group(
        "chat and prompt/completion data",
        "Either flag switches to records of 'messages' (chat) or 'prompt' and 'completion' (strings, or lists of "
        "messages), tokenised through the Hugging Face tokenizer of --tokenizer-type GPT2BPETokenizer or "
        "HuggingFaceTokenizer (special tokens written in text are their ids), into {output_prefix}_text_document "
        "(tokens) and {output_prefix}_loss_mask_document (uint8, 1 where the token is a target; same documents). "
        "Records with no target token are refused and counted. See docs/data.md")
    chat.add_argument("--chat-template", default=None, metavar="tokenizer|FILE",
                      help="render chat records with the tokenizer's own chat template ('tokenizer') or a Jinja "
                           "file. Assistant tokens come from its {%% generation %%} blocks, else from rendering "
                           "the conversation message by message (each rendering must be a token prefix of the next, "
                           "else the record is bad)")
    chat.add_argument("--loss-on", choices=LOSS_ON, default=None,
                      help="assistant (default): every assistant turn with its end-of-turn token, and the "
                           "completion of prompt/completion records; completion: the completion, and of a chat only "
                           "its last (assistant) message; all: every token. The end-of-document token that "
                           "--append-eod adds is no target (TRL's mask): it only separates the records")
    chat.add_argument("--eod-is-target", action="store_true",
                      help="with --append-eod: the end-of-document token is a target when the record ends with a "
                           "target (only whitespace after it), or with --loss-on all, so that the model learns to "
                           "end a document after the last reply (what this tool did before)")
    preference = parser.add_argument_group(
        "preference data",
        "--preference reads TRL's preference records, {\"prompt\": ..., \"chosen\": ..., \"rejected\": ...} (strings, "
        "or lists of messages rendered with --chat-template; without 'prompt' it is what chosen and rejected start "
        "with), tokenised as TRL's DPOTrainer does: the mask is 1 on each completion's tokens. Pair i is documents 2i "
        "(prompt + chosen) and 2i + 1 (prompt + rejected) of the token and loss-mask datasets; "
        "{output_prefix}_preference.json is written last. Records with an empty completion, chosen identical to "
        "rejected, a prompt whose tokens are not a prefix, or that do not fit --seq-length are refused, one line "
        "each, and counted. See docs/preference-data.md")
    preference.add_argument("--preference", action="store_true", help="the input is preference pairs")
    preference.add_argument("--seq-length", type=int, default=None, metavar="N",
                            help="the model's seq_length: a sequence (prompt + completion) may have N + 1 tokens, as "
                                 "a training sample (TRL's max_length N + 1). Default: no limit")
    preference.add_argument("--preference-truncation", choices=TRUNCATION, default="truncate",
                            help="a pair with a sequence over N + 1 tokens: truncate keeps the first N + 1 tokens of "
                                 "each (TRL's truncation_mode keep_start) and refuses a pair whose prompt alone is "
                                 "that long (TRL drops it); drop refuses the pair")
    output = parser.add_argument_group("output data")
    output.add_argument("--output-prefix", required=True, help="path prefix of the outputs, without suffix")
    output.add_argument("--dataset-impl", choices=["mmap"], default="mmap",
                        help="accepted for old Megatron scripts; mmap (MMIDIDX) is the only format")
    runtime = parser.add_argument_group("runtime")
    runtime.add_argument("--workers", type=int, default=1,
                         help="tokenising processes (multiprocessing.Pool); 1 tokenises in the main process")
    runtime.add_argument("--batch-size", type=int, default=64, help="documents per task sent to a worker")
    runtime.add_argument("--log-interval", type=int, default=1000,
                         help="accepted for Megatron scripts; progress is the bar on stderr")
    runtime.add_argument("--no-progress", action="store_true", help="no progress bar")
    runtime.add_argument("--shard", type=shard_argument, default=None, metavar="K/N",
                         help="tokenise only the K-th (0-based) of N disjoint slices of the inputs (whole files, or "
                              "byte ranges of plain JSONL cut at line starts) into "
                              "{output_prefix}-shardKKKKKofNNNNN_{key}_document (zero-padded); "
                              "tools/merge_datasets.py --shards {output_prefix} joins the N shards into the bytes "
                              "of one run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.preference:
        return _main_preference(args)
    if args.seq_length is not None or args.preference_truncation != "truncate":
        print("error: --seq-length and --preference-truncation apply to --preference data", file=sys.stderr)
        return 1
    if args.chat_template is not None or args.loss_on is not None:
        return _main_chat(args)
    try:
        config = PreprocessConfig(
            input=args.input, output_prefix=args.output_prefix, json_keys=tuple(args.json_keys),
            workers=args.workers, append_eod=args.append_eod, tokenizer_type=args.tokenizer_type,
            vocab_file=args.vocab_file, merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
            tokenizer_backend=args.tokenizer_backend, parse_special_tokens=args.parse_special_tokens,
            skip_bad_lines=args.skip_bad_lines, input_format=args.input_format, batch_size=args.batch_size,
            progress=not args.no_progress, shard=args.shard,
        )
        report = preprocess(config)
    except (BadInputError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0


def _chat_options(args: argparse.Namespace) -> dict:
    return dict(input=args.input, output_prefix=args.output_prefix, json_keys=tuple(args.json_keys),
                workers=args.workers, append_eod=args.append_eod, tokenizer_type=args.tokenizer_type,
                vocab_file=args.vocab_file, merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                skip_bad_lines=args.skip_bad_lines, input_format=args.input_format, batch_size=args.batch_size,
                progress=not args.no_progress, shard=args.shard, chat_template=args.chat_template,
                loss_on=args.loss_on or "assistant", eod_is_target=args.eod_is_target)


def _main_chat(args: argparse.Namespace) -> int:
    return _run(lambda: preprocess_chat(ChatPreprocessConfig(**_chat_options(args))))


def _main_preference(args: argparse.Namespace) -> int:
    if args.loss_on is not None:
        print("error: --loss-on does not apply to --preference data: the mask is each completion's tokens",
              file=sys.stderr)
        return 1
    return _run(lambda: preprocess_preference(PreferencePreprocessConfig(
        **_chat_options(args), seq_length=args.seq_length, truncation=args.preference_truncation)))


def _run(preprocessing: Callable[[], ChatPreprocessReport]) -> int:
    try:
        report = preprocessing()
    except (BadInputError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
