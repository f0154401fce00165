#!/usr/bin/env python
"""Generate text from a checkpoint where it lives, at any TP x PP x DP, with a KV cache on every stage.

    python tools/generate.py --checkpoint runs/demo/checkpoints --prompt "I was" --prompt "The schoolmaster"
    deepspeed --num_gpus 4 tools/generate.py --checkpoint ckpts/x --prompts prompts.jsonl --output out.jsonl \\
        --max-new-tokens 64 --temperature 0.8 --top-p 0.95 --seed 7 --stop "\\n\\n"

Greedy by default (--temperature 0); sampling with --temperature, --top-k, --top-p, seeded by --seed (a layout
repeats its samples exactly). Each completion stops at the end-of-text token, a --stop sequence (cut off) or
--max-new-tokens. Prompts come from --prompt (repeatable) or a JSONL file of {"prompt": ...}; completions go to
--output (or stdout) as JSONL: {"prompt", "completion", "tokens"}. The prompts are split over the DP replicas.

With --chat each prompt is a user's turn (after --system, if given), or a JSONL line's {"messages": [...]}, rendered
by the chat template (the checkpoint tokenizer's own, or --chat-template FILE) with the assistant's generation
prompt; the answer stops at the template's end-of-turn token (the first special token it writes after an
assistant's message), which is not part of the completion:

    python tools/generate.py --checkpoint runs/sft/checkpoints --chat --prompt "Where do bees live?"
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
    chat = parser.add_argument_group("chat")
    chat.add_argument("--chat", action="store_true", help="prompts are user turns (or JSONL {\"messages\": [...]}), "
                      "rendered by the chat template; stop at its end-of-turn token")
    chat.add_argument("--chat-template", default="tokenizer", help="'tokenizer' (default: the checkpoint "
                      "tokenizer's own) or a Jinja template file")
    chat.add_argument("--system", help="with --chat: a system message before each user turn")
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


def read_prompts(args: argparse.Namespace) -> list[str | list[dict]]:
    """Prompt strings; with --chat, message lists (a --prompt or a JSONL "prompt" as the user's turn)."""
    if args.prompt:
        return [chat_messages(prompt, args.system) if args.chat else prompt for prompt in args.prompt]
    path = Path(args.prompts)
    if not path.is_file():
        raise ValueError(f"--prompts {path} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if args.chat and isinstance(record, dict) and isinstance(record.get("messages"), list):
                prompts.append(record["messages"])
                continue
            prompts.append(record["prompt"] if isinstance(record, dict) else None)
        except (json.JSONDecodeError, KeyError):
            prompts.append(None)
        if not isinstance(prompts[-1], str):
            wanted = "a \"messages\" list or a \"prompt\" string" if args.chat else "a \"prompt\" string"
            raise ValueError(f"{path}:{number}: expected a JSON object with {wanted}, got {line[:80]!r}")
        if args.chat:
            prompts[-1] = chat_messages(prompts[-1], args.system)
    return prompts


def chat_messages(user: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def end_of_turn(tokenizer, template: str) -> int:
    """The first special token the template writes after an assistant's message (its end of turn), else the
    tokenizer's end-of-text."""
    user = [{"role": "user", "content": "x"}]
    before = render(tokenizer, template, user)
    whole = tokenizer.apply_chat_template([*user, {"role": "assistant", "content": "y"}], chat_template=template,
                                          tokenize=True, return_dict=True)["input_ids"]
    special = set(tokenizer.all_special_ids)
    after = whole[len(before):] if whole[:len(before)] == before else whole
    return next((token for token in after if token in special), tokenizer.eos_token_id)


def render(tokenizer, template: str, messages: list[dict]) -> list[int]:
    """The conversation with the assistant's generation prompt, as token ids."""
    return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def completions(args: argparse.Namespace) -> list[dict]:
    from evaluation.generation import Generator, Sampling

    prompts = read_prompts(args)
    pipeline, tokenizer, _ = open_pipeline(args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    if args.chat:
        from data.chat import load_chat_template

        template = load_chat_template(args.chat_template, tokenizer)
        turn_end = end_of_turn(tokenizer, template)
        encoded = [render(tokenizer, template, messages) for messages in prompts]
    else:
        turn_end = None
        encoded = [tokenizer.encode(prompt, add_special_tokens=False) or [tokenizer.eos_token_id] for prompt in prompts]
    generator = Generator(pipeline, tokenizer.eos_token_id)

    def stop(generated: list[int]) -> bool:
        if generated and generated[-1] == turn_end:
            return True
        text = tokenizer.decode(generated, skip_special_tokens=True)
        return any(term in text for term in args.stop)

    outputs = generator.generate_all(encoded, args.max_new_tokens, sampling,
                                     stop if args.stop or turn_end is not None else None, use_cache=not args.no_cache)
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
