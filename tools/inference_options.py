"""What tools/evaluate.py and tools/generate.py share: the checkpoint, its layout, its tokenizer, a clean exit.

The layout is the checkpoint's own TP x PP unless --ds_config or --set say otherwise (--set alone edits the
checkpoint's saved run config); DP is what the launched world leaves. Launched like train.py: the deepspeed launcher,
torchrun, or one plain process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from common.dtypes import PRECISIONS as DTYPES
from common.dtypes import torch_dtype
from model.config import ParallelConfig, set_option


def add_model_options(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model")
    model.add_argument("--checkpoint", required=True, help="a checkpoint directory (holding `latest`): trained, "
                       "imported from Hugging Face or reshaped")
    model.add_argument("--tag", help="a checkpoint other than the latest, e.g. global_step1000")
    model.add_argument("--ds_config", help="a run config whose parallelism gives the layout (default: the "
                       "checkpoint's own)")
    model.add_argument("--set", action="append", default=[], metavar="BLOCK.FIELD=VALUE",
                       help="override the layout, e.g. --set parallelism.tensor_parallel_size=2")
    model.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default: the one the checkpoint "
                       "carries, else GPT-2's for a 50,257-token vocabulary)")
    model.add_argument("--dtype", choices=DTYPES, help="compute in this precision (default: the training precision)")
    model.add_argument("--local_rank", "--local-rank", type=int, help="set by the deepspeed launcher")


def layout(args: argparse.Namespace) -> ParallelConfig:
    """The TP x PP to run at (module docstring); DP is checked against the world here, before any process group."""
    from hf.checkpoint_reader import open_checkpoint
    from runconfig.fields import apply_overrides
    from runconfig.run import load_run_config

    if args.ds_config:
        parallel = load_run_config(args.ds_config, args.set).parallelism
    else:
        saved = open_checkpoint(args.checkpoint, args.tag).client_state["run_config"]
        raw = apply_overrides({"parallelism": saved.get("parallelism", {})}, args.set)
        unknown = sorted(set(raw) - {"parallelism"})
        if unknown:
            raise ValueError(f"--set {unknown[0]}...: only parallelism.* can be set for an evaluation (the model is "
                             f"the checkpoint's)")
        parallel = ParallelConfig(**{k: v for k, v in raw["parallelism"].items()
                                     if k in ("tensor_parallel_size", "pipeline_parallel_size", "partition_method")})
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % parallel.model_parallel_size:
        raise ValueError(f"the layout TP {parallel.tensor_parallel_size} x PP {parallel.pipeline_parallel_size} "
                         f"needs a multiple of {parallel.model_parallel_size} processes, and {world} were launched: "
                         f"launch {parallel.model_parallel_size}, or choose a layout that fits, e.g. "
                         f"{set_option('parallelism.tensor_parallel_size', 1)} "
                         f"{set_option('parallelism.pipeline_parallel_size', 1)}")
    return parallel


def open_pipeline(args: argparse.Namespace):
    """(pipeline, tokenizer, checkpoint) of this rank at the requested layout."""
    from evaluation.loading import checkpoint_tokenizer, load_pipeline

    dtype = torch_dtype(args.dtype) if args.dtype else None
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's PipelineModule prints its partition: not a result
        pipeline, checkpoint = load_pipeline(Path(args.checkpoint), args.tag, layout(args), dtype)
    return pipeline, checkpoint_tokenizer(checkpoint, args.tokenizer), checkpoint


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run_and_clean_up(work: Callable[[], int], errors: tuple[type[BaseException], ...]) -> int:
    """``work()``, its known errors printed once (rank 0) without a traceback, and the process group shut down."""
    import torch.distributed as dist

    status = 2
    try:
        status = work()
    except errors as error:
        if is_rank_zero():
            print(f"error: {error}", file=sys.stderr)
    finally:
        if dist.is_available() and dist.is_initialized():
            if status == 0:
                dist.barrier()
            dist.destroy_process_group()
    return status
