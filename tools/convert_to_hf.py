#!/usr/bin/env python
"""Export a checkpoint of this project (any TP x PP) to a Hugging Face transformers model directory.

    python tools/convert_to_hf.py --checkpoint runs/demo/checkpoints --output runs/demo/hf
    python tools/convert_to_hf.py --checkpoint ckpts/530b --tag global_step1000 --output hf/530b --max-shard-size 10GB

The architecture follows the model's shape: GPT2LMHeadModel for the GPT-2 shape; for the Llama family (RoPE,
RMSNorm, SwiGLU) the one an imported checkpoint came from, else LlamaForCausalLM (bias "none" or "all") or
Qwen2ForCausalLM (bias "qkv"); a Mixture-of-Experts model (model.moe) as MixtralForCausalLM, Qwen2MoeForCausalLM
or Qwen3MoeForCausalLM, the one its shape fits; --architecture chooses among those that fit (e.g.
MistralForCausalLM).
The output loads offline with AutoModelForCausalLM.from_pretrained(OUTPUT) and AutoTokenizer.from_pretrained(OUTPUT):
config.json, generation_config.json, model.safetensors (or model-0000N-of-0000M.safetensors and an index),
tokenizer files (--tokenizer, else those an import carried in, else GPT-2's). The padded vocabulary rows are dropped
(the HF vocabulary is the tokenizer's). One layer is held in memory at a time; the directory appears only when
complete.
"""

from __future__ import annotations

import argparse
import sys

from hf.export import DEFAULT_MAX_SHARD_SIZE, export_to_hf
from hf.tables import ARCHITECTURES, PRECISION_DTYPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="the run's checkpoint directory (holding `latest`)")
    parser.add_argument("--tag", help="a checkpoint other than the latest, e.g. global_step1000")
    parser.add_argument("--output", required=True, help="the Hugging Face model directory to create")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help=f"largest safetensors file, e.g. 2GB, 500MB (default {DEFAULT_MAX_SHARD_SIZE})")
    parser.add_argument("--dtype", choices=sorted(PRECISION_DTYPES), help="weights dtype (default: training precision)")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer directory to ship (default: the one an import "
                                            "carried into CHECKPOINT/hf_tokenizer, else the GPT-2 BPE in "
                                            "data/assets/gpt2, which fits a 50,257-token vocabulary)")
    parser.add_argument("--architecture", choices=sorted(ARCHITECTURES),
                        help="the transformers class to export as (default: the imported one, else the first that "
                             "fits the model's shape)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        output = export_to_hf(args.checkpoint, args.output, tag=args.tag, max_shard_size=args.max_shard_size,
                              dtype=PRECISION_DTYPES[args.dtype] if args.dtype else None, tokenizer=args.tokenizer,
                              architecture=args.architecture, progress=not args.no_progress)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
