#!/usr/bin/env python
"""Train a GPT with tensor x pipeline x data parallelism on DeepSpeed.

    deepspeed --hostfile hosts train.py --ds_config ds_configs/530b.json
    deepspeed --num_gpus 8 train.py --ds_config ds_configs/1.3b.json --data-path 0.7 data/a_text_document 0.3 data/b_text_document
    torchrun --nproc_per_node 4 train.py --ds_config ds_configs/tiny-cpu.json --set schedule.warmup_tokens=1e4

The whole run is one JSON (DeepSpeed's keys plus the model, parallelism, schedule, data and training blocks; see
runconfig/); --set overrides any field. A run with a checkpoint directory resumes from its latest complete
checkpoint by itself; SIGTERM or SIGINT writes a checkpoint and exits cleanly.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ds_config", required=True, help="the run's JSON config (ds_configs/*.json)")
    parser.add_argument("--set", action="append", default=[], metavar="BLOCK.FIELD=VALUE",
                        help="override a config field, e.g. --set schedule.warmup_tokens=1e6 (repeatable)")
    parser.add_argument("--data-path", nargs="+", metavar="WEIGHT PREFIX",
                        help="datasets and weights, Megatron style: W1 PREFIX1 W2 PREFIX2 ... (or one PREFIX); "
                             "replaces data.blend")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher (LOCAL_RANK is read from the environment)")
    return parser.parse_args(argv)


def data_path_to_blend(items: list[str]) -> list[list]:
    if len(items) == 1:
        return [[1.0, items[0]]]
    if len(items) % 2:
        raise ValueError(f"--data-path takes WEIGHT PREFIX pairs, got {len(items)} items: {items}")
    try:
        return [[float(items[i]), items[i + 1]] for i in range(0, len(items), 2)]
    except ValueError:
        raise ValueError(f"--data-path: every other item must be a weight (a number), got {items}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from training.checkpoint_writer import WriterProcess

    WriterProcess.fork_early()  # before anything runs: the checkpoint writer, forked with torch already imported
    from runconfig.run import load_run_config

    overrides = list(args.set)
    try:
        config = load_run_config(args.ds_config, overrides)
        if args.data_path:
            from runconfig.blocks import DataConfig

            config.data = DataConfig(**{**config.data.__dict__, "blend": data_path_to_blend(args.data_path)})
        config.check_world(int(os.environ.get("WORLD_SIZE", "1")))  # before any process group is built
        from training.run import check_buildable

        check_buildable(config)  # the checks that need training code (training/run.py)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    from data.index_cache import IndexCacheTimeout
    from model.parallel import RendezvousError
    from training.checkpoint import CheckpointWriteError
    from training.run import run
    from training.trainer import TrainingStopped

    try:
        run(config)
    except (ValueError, TrainingStopped, CheckpointWriteError, RendezvousError, IndexCacheTimeout) as error:
        print(f"error (rank {os.environ.get('RANK', '0')}): {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def exit_now(status: int) -> None:
    """Exit once everything is written: the exit handlers run, then the process ends without tearing the
    interpreter down (freeing torch's and DeepSpeed's modules takes 1-2 s per process; every file is closed and the
    process group destroyed by then)."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
