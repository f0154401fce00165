#!/usr/bin/env python
"""Generate text from a checkpoint where it lives, at any TP x PP x DP, with a KV cache on every stage.

    python tools/generate.py --checkpoint runs/demo/checkpoints --prompt "I was" --prompt "The schoolmaster"
    deepspeed --num_gpus 4 tools/generate.py --checkpoint ckpts/x --prompts prompts.jsonl --output out.jsonl \\
        --max-new-tokens 64 --temperature 0.8 --top-p 0.95 --seed 7 --stop "\\n\\n"

Greedy by default (--temperature 0); sampling with --temperature, --top-k, --top-p, seeded by --seed (a layout
repeats its samples exactly). Each completion stops at the end-of-text token, a --stop sequence (cut off) or
--max-new-tokens. Prompts come from --prompt (repeatable) or a JSONL file of {"prompt": ...}; completions go to
--output (or stdout) as JSONL: {"prompt", "completion", "tokens"}. The prompts are split over the DP replicas.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.files import write_text_atomically
from tools.inference_options import add_model_options, is_rank_zero, open_pipeline, run_and_clean_up
from tools.streams import deepspeed_logs_to_stderr


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    prompts = parser.add_argument_group("the prompts")
    given = prompts.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    given.add_argument("--prompts", help="a JSONL file, one {\"prompt\": ...} per line")
    choice = parser.add_argument_group("the choice of tokens")
    choice.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens per prompt (64)")
    choice.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    choice.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    choice.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens whose "
                        "probability reaches p (1: all)")
    choice.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    choice.add_argument("--stop", action="append", default=[], help="stop at this text, cut off (repeatable)")
    choice.add_argument("--no-cache", action="store_true", help="rerun the whole sequence at every step (slow; "
                        "for checking the KV cache)")
    parser.add_argument("--output", help="write the completions here (JSONL; default: stdout)")
    return parser


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    path = Path(args.prompts)
    if not path.is_file():
        raise ValueError(f"--prompts {path} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompts.append(record["prompt"] if isinstance(record, dict) else None)
        except (json.JSONDecodeError, KeyError):
            prompts.append(None)
        if not isinstance(prompts[-1], str):
            raise ValueError(f"{path}:{number}: expected a JSON object with a \"prompt\" string, got {line[:80]!r}")
    return prompts


def completions(args: argparse.Namespace) -> list[dict]:
    from evaluation.generation import Generator, Sampling

    prompts = read_prompts(args)
    pipeline, tokenizer, _ = open_pipeline(args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    generator = Generator(pipeline, tokenizer.eos_token_id)

    def stop(generated: list[int]) -> bool:
        text = tokenizer.decode(generated, skip_special_tokens=True)
        return any(term in text for term in args.stop)

    encoded = [tokenizer.encode(prompt, add_special_tokens=False) or [tokenizer.eos_token_id] for prompt in prompts]
    outputs = generator.generate_all(encoded, args.max_new_tokens, sampling, stop if args.stop else None,
                                     use_cache=not args.no_cache)
    records = []
    for prompt, tokens in zip(prompts, outputs, strict=True):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        for term in args.stop:
            text = text.split(term)[0]
        records.append({"prompt": prompt, "completion": text, "tokens": tokens})
    return records


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    deepspeed_logs_to_stderr()  # stdout carries results only

    def work() -> int:
        records = completions(args)
        if is_rank_zero():
            lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
            if args.output:
                write_text_atomically(Path(args.output), lines)
            else:
                sys.stdout.write(lines)
        return 0

    return run_and_clean_up(work, (ValueError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())
