#!/usr/bin/env python
"""Step time of train.py (DeepSpeed pipeline engine, ZeRO-1, one process) against a plain PyTorch loop.

Same tiny model, same micro-batches, same optimizer (AdamW 0.9/0.95, weight decay 0.1 on matrices, clipping 1.0),
one CPU thread each. Prints the median step time of both and their ratio (goal: <= 1.15).

    python benchmarks/bench_train_overhead.py [--steps 40] [--layers 4] [--hidden 256] [--seq 128] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def model_overrides(args) -> list[str]:
    heads = max(1, args.hidden // 64)
    return [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", f"model.num_attention_heads={heads}",
            f"model.seq_length={args.seq}", "parallelism.tensor_parallel_size=1", "parallelism.pipeline_parallel_size=1",
            f"train_batch_size={args.batch}", f"train_micro_batch_size_per_gpu={args.batch}", "schedule.batch={}",
            "training.log_interval=1", "training.eval_iters=0", "training.save_interval=0", "training.eval_interval=0",
            f"training.max_steps={args.steps}"]


def prepare_data(workdir: Path) -> Path:
    from data.preprocess import PreprocessConfig, preprocess

    preprocess(PreprocessConfig(input=str(ROOT / "data/corpus/botchan.jsonl"), output_prefix=str(workdir / "corpus"),
                                append_eod=True, workers=1, progress=False))
    return workdir / "corpus_text_document"


def time_train_py(args, prefix: Path, workdir: Path) -> list[float]:
    save = workdir / "run"
    command = [sys.executable, "train.py", "--ds_config", "ds_configs/tiny-cpu.json", "--set", f"training.save={save}",
               "--set", f'data.blend=[[1.0, "{prefix}"]]']
    for item in model_overrides(args):
        command += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29561"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [args.batch / r["samples_per_second"] for r in records if r["kind"] == "train"]


def time_plain_pytorch(args, prefix: Path) -> list[float]:
    import torch

    from data.gpt_dataset import build_gpt_datasets
    from data.loader import MicroBatchLoader
    from model.config import preset
    from model.gpt import GPT
    from training.engine import weight_decay_groups

    torch.set_num_threads(1)
    config = preset("tiny", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=max(1, args.hidden // 64),
                    seq_length=args.seq)
    train, _, _ = build_gpt_datasets([str(prefix)], "969,30,1", args.seq, [args.steps * args.batch, 0, 0], 1234)
    loader = MicroBatchLoader(train, args.batch, 0, 1)
    torch.manual_seed(1234)
    model = GPT(config, seed=1234)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        (tokens, positions), (labels, mask) = next(loader)
        optimizer.zero_grad(set_to_none=True)
        model.loss(tokens, positions, labels, mask).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = prepare_data(Path(tmp))
        ours = time_train_py(args, prefix, Path(tmp))
        plain = time_plain_pytorch(args, prefix)
    skip = max(2, args.steps // 5)  # warm-up steps
    ours_median, plain_median = statistics.median(ours[skip:]), statistics.median(plain[skip:])
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, {args.steps} steps, "
          f"1 thread; medians over steps {skip + 1}..{args.steps}")
    print(f"train.py (DeepSpeed pipeline engine, ZeRO-1): {ours_median * 1000:8.1f} ms/step")
    print(f"plain PyTorch loop (AdamW, clip_grad_norm_):   {plain_median * 1000:8.1f} ms/step")
    print(f"ratio: {ours_median / plain_median:.3f} (goal <= 1.15)")


if __name__ == "__main__":
    main()
