#!/usr/bin/env python
"""Peak memory of exporting a checkpoint many times larger than one layer to Hugging Face (tools/convert_to_hf.py).

Writes a synthetic checkpoint in the exact layout the trainer writes (layer_XX-model_YY files of every TP rank with
random weights, one mp_rank file per stage x TP rank carrying the run_config, `latest`): the export opens and checks
it like a trained one. The export then runs in a fresh process, which reports how far its resident memory rose above
what it held before the export (peak RSS, the kernel's high-water mark VmHWM reset just before; ru_maxrss where that
reset is unavailable), next to the largest layer (all its TP shards) and the whole model.

    python benchmarks/bench_export_memory.py                  # 24 layers, h 1536: 2.8 GB, largest layer 113 MB (~1 min)
    python benchmarks/bench_export_memory.py --layers 48 --hidden 2048 --workdir /scratch/bench

The growth is the layer's shards (memory-mapped, as they are read) plus the largest merged tensor (a third of a
block), plus a constant of some 30 MB (the tokenizer, the allocator's cache): with a 50 MB layer (h 1024) that
constant alone is 0.6 x the layer; at real sizes it vanishes.

The vocabulary is small (8192) so that a transformer block, not the embedding, is the largest layer; a word-level
tokenizer of that size is shipped with the export.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf.tables import layer_maps, shard_shape
from model.checkpoint_files import layer_file, model_states_file
from model.config import ModelConfig
from training.checkpoint import write_latest

TAG = "global_step1"


def write_synthetic_checkpoint(directory: Path, config: ModelConfig, tensor_parallel_size: int,
                               pipeline_parallel_size: int) -> dict[str, int]:
    """Random weights in the trainer's layout; returns the byte sizes of the largest layer and of the model."""
    tag_directory = directory / TAG
    tag_directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    largest, total = 0, 0
    for layer in layer_maps(config):
        layer_bytes = 0
        for rank in range(tensor_parallel_size):
            state = {t.ours: torch.randn(shard_shape(t, config, tensor_parallel_size), generator=generator)
                     for t in layer.tensors}
            layer_bytes += sum(v.numel() * v.element_size() for v in state.values())
            torch.save(state, layer_file(tag_directory, layer.index, rank))
        largest, total = max(largest, layer_bytes), total + layer_bytes
    run_config = {"model": config.to_dict(), "parallelism": {"tensor_parallel_size": tensor_parallel_size,
                                                             "pipeline_parallel_size": pipeline_parallel_size}}
    for rank in range(tensor_parallel_size * pipeline_parallel_size):
        torch.save({"module": None, "run_config": run_config}, model_states_file(tag_directory, rank))
    write_latest(directory, TAG)
    return {"largest_layer_bytes": largest, "model_bytes": total}


def write_word_level_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(str(directory))


def _rss_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_export(checkpoint: Path, output: Path, tokenizer: Path, max_shard_size: str) -> dict[str, float]:
    """Runs in the child process: everything imported first, then the peak RSS growth of the export alone."""
    import transformers  # noqa: F401  (imported before the baseline: the export uses it for config and tokenizer)

    from hf.export import export_to_hf

    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        high_water = "VmHWM"
    except OSError:
        high_water = None
    baseline = _rss_bytes("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    export_to_hf(checkpoint, output, max_shard_size=max_shard_size, tokenizer=tokenizer, progress=False)
    seconds = time.perf_counter() - start
    peak = _rss_bytes(high_water) if high_water else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"baseline_rss_bytes": baseline, "peak_rss_bytes": peak, "peak_growth_bytes": peak - baseline,
            "seconds": seconds, "method": high_water or "ru_maxrss"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--workdir", help="where the checkpoint and export go (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--child", nargs=4, metavar=("CHECKPOINT", "OUTPUT", "TOKENIZER", "MAX_SHARD"),
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        checkpoint, output, tokenizer, max_shard = args.child
        print(json.dumps(measure_export(Path(checkpoint), Path(output), Path(tokenizer), max_shard)))
        return 0
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                         seq_length=args.hidden, vocab_size=args.vocab, make_vocab_size_divisible_by=128)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_export_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        sizes = write_synthetic_checkpoint(workdir / "checkpoint", config, args.tp, args.pp)
        write_word_level_tokenizer(workdir / "tokenizer", config.vocab_size)
        child = [sys.executable, __file__, "--child", str(workdir / "checkpoint"), str(workdir / "hf"),
                 str(workdir / "tokenizer"), args.max_shard_size]
        result = json.loads(subprocess.run(child, check=True, capture_output=True, text=True,
                                           env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.strip().splitlines()[-1])
        report(config, args, sizes, result, workdir / "hf")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def report(config: ModelConfig, args: argparse.Namespace, sizes: dict[str, int], result: dict, hf_dir: Path) -> None:
    mb = 1e6
    largest, model, growth = sizes["largest_layer_bytes"], sizes["model_bytes"], result["peak_growth_bytes"]
    written = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    print(f"model: {config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}, fp32, "
          f"TP {args.tp} x PP {args.pp}")
    print(f"checkpoint (model weights)   {model / mb:10.1f} MB   ({model / largest:.1f} x the largest layer)")
    print(f"largest layer (all TP shards){largest / mb:10.1f} MB")
    print(f"safetensors written          {written / mb:10.1f} MB in {result['seconds']:.1f} s")
    print(f"export peak RSS growth       {growth / mb:10.1f} MB   = {growth / largest:.2f} x the largest layer, "
          f"{growth / model:.3f} x the model  ({result['method']}; RSS before export "
          f"{result['baseline_rss_bytes'] / mb:.0f} MB)")


if __name__ == "__main__":
    sys.exit(main())
