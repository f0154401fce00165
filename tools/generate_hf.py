#!/usr/bin/env python
"""Generate text with an exported model through plain `transformers` (offline, no remote code).

    python tools/generate_hf.py --model runs/demo/hf --prompt "I was" --max-new-tokens 40
"""

from __future__ import annotations

import argparse
import sys


def generate(model_dir: str, prompt: str, max_new_tokens: int, seed: int, greedy: bool) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    torch.manual_seed(seed)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=not greedy, top_k=50,
                                pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model directory (tools/convert_to_hf.py)")
    parser.add_argument("--prompt", default="I was")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of top-k sampling")
    args = parser.parse_args(argv)
    print(generate(args.model, args.prompt, args.max_new_tokens, args.seed, args.greedy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
