#!/usr/bin/env python
"""Import a Hugging Face model (safetensors) as a checkpoint of this project: GPT2LMHeadModel, LlamaForCausalLM,
MistralForCausalLM or Qwen2ForCausalLM, detected from its config.json (``architectures``, else ``model_type``).

    python tools/convert_from_hf.py --model hf/gpt2 --ds_config ds_configs/125m.json --output ckpts/from_gpt2 \\
        --set model.activation=gelu_tanh --start-tokens 0
    python tools/convert_from_hf.py --model hf/my-llama --ds_config ds_configs/llama-tiny-cpu.json \\
        --output ckpts/from_my_llama

The checkpoint is split at the TP x PP of the run config, whose model block must match the HF config (layers,
hidden size, heads and key/value heads, positions, vocabulary, ffn, norm eps, activation, RoPE theta and llama3
scaling, tied head, biases; a mismatch is named with the --set that fixes it). Options this project's GPT does not
have are refused by name (a sliding window shorter than the context, a rope_scaling other than llama3, ...). It holds
weights only: training continues from it with a fresh optimizer (engine.load_checkpoint(OUTPUT,
load_module_only=True, load_optimizer_states=False, load_lr_scheduler_states=False)). OUTPUT/hf_import.json records
the token count the schedules start from (--start-tokens) and the architecture; OUTPUT/hf_tokenizer/ holds the HF
directory's tokenizer files, which tools/convert_to_hf.py ships again.
"""

from __future__ import annotations

import argparse
import sys

from hf.importer import import_from_hf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the Hugging Face model directory (config.json, safetensors)")
    parser.add_argument("--ds_config", required=True, help="the run's JSON config: model shape, TP and PP")
    parser.add_argument("--set", action="append", default=[], metavar="BLOCK.FIELD=VALUE", help="override a field")
    parser.add_argument("--output", required=True, help="the checkpoint directory to create")
    parser.add_argument("--start-tokens", type=int, default=0,
                        help="tokens already consumed: the learning rate and batch schedules start here (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        from training.config import load_run_config

        config = load_run_config(args.ds_config, args.set)
        output = import_from_hf(args.model, config.model, config.parallelism, args.output,
                                run_config=config.to_dict(), config_source=config.source,
                                start_tokens=args.start_tokens, progress=not args.no_progress)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {output} (TP {config.parallelism.tensor_parallel_size} x PP "
          f"{config.parallelism.pipeline_parallel_size}, starting at {args.start_tokens:,} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
