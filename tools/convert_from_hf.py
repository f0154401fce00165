#!/usr/bin/env python
"""Import a Hugging Face model (safetensors) as a checkpoint of this project: GPT2LMHeadModel, LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, the Mixture-of-Experts MixtralForCausalLM,
Qwen2MoeForCausalLM and Qwen3MoeForCausalLM, or DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2, Moonlight: multi-head
latent attention, its fp8 block-scaled weights dequantised, its multi-token prediction layer read with model.mtp),
detected from its config.json (``architectures``, else ``model_type``).

    python tools/convert_from_hf.py --model hf/gpt2 --ds_config ds_configs/125m.json --output ckpts/from_gpt2 \\
        --set model.activation=gelu_tanh --start-tokens 0
    python tools/convert_from_hf.py --ds_config ds_configs/llama-tiny-cpu.json --set model.from_hf=hf/my-llama \\
        --output ckpts/from_my_llama

The checkpoint is split at the TP x PP of the run config. With model.from_hf (--model defaults to it) the model block
is filled from the HF config.json; without it, the model block must match the HF config (layers, hidden size, heads
and key/value heads, positions, vocabulary, ffn, norm eps, activation, RoPE theta and llama3 scaling, tied head,
biases; a mismatch is named with the --set that fixes it), and is compared before the split is checked. Options this
project's GPT does not have are refused by name (a sliding window shorter than the context, a rope_scaling other than
llama3, ...). It holds weights only: training continues from it with a fresh optimizer (train.py with
--set training.init_from=OUTPUT and the same model.from_hf). OUTPUT/hf_import.json records the token count the
schedules start from (--start-tokens) and the architecture; OUTPUT/hf_tokenizer/ holds the HF directory's tokenizer
files, which tools/convert_to_hf.py ships again and whose end-of-text id train.py takes as data.eod_token_id.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf.importer import import_from_hf


def run_config_for(ds_config: str, overrides: list[str], model: str | None):
    """The run config and the HF directory, checked in this order: the model (from model.from_hf, or the model block
    compared with the HF config), then the TP x PP split of that model."""
    from hf.config_map import check_model_matches, read_hf_config
    from runconfig.run import load_run_config

    config = load_run_config(ds_config, overrides, check_layout=False)
    if model is None and config.from_hf is None:
        raise ValueError("no Hugging Face model: pass --model DIR, or --set model.from_hf=DIR")
    hf_dir = model or config.from_hf
    if config.from_hf is not None and Path(config.from_hf).resolve() != Path(hf_dir).resolve():
        raise ValueError(f"--model {hf_dir} and model.from_hf = {config.from_hf} name different models: pass one")
    if config.from_hf is None:
        check_model_matches(config.model, read_hf_config(hf_dir), config.source, hf_dir)
    config.check_layout()
    return config, hf_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="the Hugging Face model directory (config.json, safetensors); default: the "
                        "run config's model.from_hf")
    parser.add_argument("--ds_config", required=True, help="the run's JSON config: model shape, TP and PP")
    parser.add_argument("--set", action="append", default=[], metavar="BLOCK.FIELD=VALUE", help="override a field")
    parser.add_argument("--output", required=True, help="the checkpoint directory to create")
    parser.add_argument("--start-tokens", type=int, default=0,
                        help="tokens already consumed: the learning rate and batch schedules start here (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        config, hf_dir = run_config_for(args.ds_config, args.set, args.model)
        output = import_from_hf(hf_dir, config.model, config.parallelism, args.output,
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
