#!/usr/bin/env python
"""Evaluation and generation speed, one process, one model: this project's adapter against lm-eval's HFLM and
transformers' generate() on the same weights.

    python benchmarks/bench_evaluate.py [--layers 6] [--hidden 256] [--requests 400] [--new-tokens 64]

A random GPT2LMHeadModel (GPT-2's vocabulary, --layers, --hidden, 256 positions), imported here at TP 1 x PP 1: the
same weights on both sides. Log-likelihood: the alice_choice requests (context and four endings each) through
HFLM._loglikelihood_tokens and ParallelLM._loglikelihood_tokens, batch 8 each, best of 3; requests per second.
Generation: 4 prompts, greedy, --new-tokens each (no early stop), transformers' generate(use_cache=True) against
evaluation/generation.py with its KV cache, best of 3; milliseconds per token. Goals: at least 0.8x HFLM's requests
per second, at most 1.5x generate()'s milliseconds per token.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
    os.environ.setdefault(name, "1")

ROOT = Path(__file__).resolve().parents[1]


def build_model(directory: Path, layers: int, hidden: int) -> tuple[Path, Path]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf.config_map import model_fields_from_hf, read_hf_config
    from hf.importer import import_from_hf
    from hf.tokenizer import gpt2_tokenizer
    from model.config import ModelConfig, ParallelConfig

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=hidden // 64, n_positions=256, activation_function="gelu")
    GPT2LMHeadModel(config).save_pretrained(str(directory / "hf"))
    gpt2_tokenizer(256).save_pretrained(str(directory / "hf"))
    model = ModelConfig(**model_fields_from_hf(read_hf_config(directory / "hf")), seq_length=256)
    import_from_hf(directory / "hf", model, ParallelConfig(1, 1), directory / "checkpoint", progress=False)
    return directory / "hf", directory / "checkpoint"


def choice_requests(tokenizer, count: int) -> list:
    lines = (ROOT / "evaluation/tasks/alice/alice_choice_test.jsonl").read_text().splitlines()
    requests = []
    for line in lines:
        doc = json.loads(line)
        context = tokenizer.encode(doc["ctx"])
        for ending in doc["endings"]:
            requests.append(((doc["ctx"], " " + ending), context, tokenizer.encode(" " + ending)))
        if len(requests) >= count:
            break
    return requests[:count]


def best_of(runs: int, work) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM

    from evaluation.generation import Generator
    from evaluation.lm import ParallelLM
    from evaluation.loading import checkpoint_tokenizer, load_pipeline

    with tempfile.TemporaryDirectory() as scratch:
        hf_dir, checkpoint_dir = build_model(Path(scratch), args.layers, args.hidden)
        pipeline, checkpoint = load_pipeline(checkpoint_dir)
        tokenizer = checkpoint_tokenizer(checkpoint)
        ours = ParallelLM(pipeline, tokenizer, batch_size=8)
        theirs = HFLM(pretrained=str(hf_dir), batch_size=8, device="cpu")
        requests = choice_requests(tokenizer, args.requests)
        their_seconds = best_of(3, lambda: theirs._loglikelihood_tokens(requests, disable_tqdm=True))
        our_seconds = best_of(3, lambda: ours._loglikelihood_tokens(requests))
        print(f"log-likelihood, {len(requests)} requests, batch 8: HFLM {len(requests) / their_seconds:.1f} "
              f"requests/s, here {len(requests) / our_seconds:.1f} requests/s: {their_seconds / our_seconds:.2f}x "
              f"(goal >= 0.8x)")

        model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
        prompts = [tokenizer.encode(text) for text in ("Alice was", "The Queen said to the",
                                                        "Down, down, down.", "'Curiouser and curiouser!' cried")]
        generator = Generator(pipeline, end_of_text=None)  # no early stop: exactly --new-tokens each

        def hf_generate():
            for prompt in prompts:
                with torch.no_grad():
                    model.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens, do_sample=False, use_cache=True,
                                   pad_token_id=tokenizer.eos_token_id)

        tokens = len(prompts) * args.new_tokens
        their_ms = 1e3 * best_of(3, hf_generate) / tokens
        our_ms = 1e3 * best_of(3, lambda: [generator.generate(p, args.new_tokens) for p in prompts]) / tokens
        print(f"generation, {len(prompts)} prompts x {args.new_tokens} tokens, greedy, KV cache: transformers "
              f"{their_ms:.2f} ms/token, here {our_ms:.2f} ms/token: {our_ms / their_ms:.2f}x (goal <= 1.5x)")


if __name__ == "__main__":
    main()
