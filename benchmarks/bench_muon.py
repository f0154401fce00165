#!/usr/bin/env python
"""One optimizer step of Muon (training/muon.py) against AdamW's, on one process, at a preset's shape (125m).

    python benchmarks/bench_muon.py [--preset 125m] [--layers N] [--repeats 3] [--threads 1] [--gpu h200]

    what runs                                           what is printed
    the preset's GPT in fp32 on CPU (one process, TP 1),  seconds per step (the median of --repeats after one warm
    random gradients; torch.optim.AdamW on every          step) of AdamW, of Muon (Newton-Schulz in fp32 on every
    parameter, then TensorParallelMuon (Muon on the       HF matrix of the blocks, AdamW on the rest), their ratio;
    block matrices, AdamW on the rest)                    the Newton-Schulz FLOPs of one step (newton_schulz_flops,
                                                          what a plan adds per step) and the FLOP/s they ran at

At TP t the same matrices are orthogonalised whole on each of the t ranks (training/muon.py's docstring): a rank's
Newton-Schulz time does not shrink with TP, while its AdamW time does.

Then the planner's figure (tools/plan.py, ds_configs/<preset>.json on one node of --gpu, Adam as configured and Muon
in its place): the optimizer step's seconds of each and the Muon optimizer states beside Adam's (planner/muon.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from model.config import preset
from model.gpt import GPT
from model.parallel import ParallelContext
from runconfig.optimizer import MuonConfig
from training.muon import as_pipeline_layers, build_muon, muon_parameters

ROOT = Path(__file__).resolve().parents[1]


def _time_steps(optimizer: torch.optim.Optimizer, repeats: int) -> float:
    optimizer.step()  # the states allocated
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--layers", type=int, default=None, help="fewer blocks than the preset's (same widths)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gpu", default="h200", help="the planner's figure for this GPU preset ('' for none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = {"precision": "fp32", "seq_length": 128}
    if args.layers:
        overrides["num_layers"] = args.layers
    config = preset(args.preset, **overrides)
    model = GPT(config, seed=1)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    holder = as_pipeline_layers(model)
    matrices = muon_parameters(holder, config)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    adamw_s = _time_steps(adamw, args.repeats)
    del adamw
    muon = build_muon(holder, config, ParallelContext(), MuonConfig(lr=1e-4, weight_decay=0.1))
    muon_s = _time_steps(muon, args.repeats)
    flops = muon.newton_schulz_flops / (args.repeats + 1)  # what it ran, per step (the HF matrices' shapes)
    count = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {config.num_layers} layers, h {config.hidden_size}, {count / 1e6:.1f}M parameters, "
          f"{sum(p.numel() for p in matrices) / 1e6:.1f}M in {len(matrices)} Muon tensors; {args.threads} thread(s)")
    print(f"AdamW step      {adamw_s * 1e3:9.1f} ms")
    print(f"Muon step       {muon_s * 1e3:9.1f} ms   ({muon_s / adamw_s:.1f} x AdamW)")
    print(f"Newton-Schulz   {flops / 1e9:9.2f} GFLOP a step (5 iterations, fp32): {flops / muon_s / 1e9:.1f} GFLOP/s "
          f"here")
    if args.gpu and not args.layers:
        _planned(args.preset, args.gpu)


def _planned(preset_name: str, gpu: str) -> None:
    """The planner's optimizer step and states for the preset's shipped config on one node, Adam and Muon."""
    from planner.hardware import GPU_PRESETS, Assumptions
    from planner.memory import count_parameters
    from planner.plan import plan_cluster
    from runconfig.run import load_run_config

    path = ROOT / "ds_configs" / f"{preset_name}.json"
    if not path.exists():
        return
    muon = 'optimizer={"type": "Muon", "params": {"weight_decay": 0.1}}'
    for name, overrides in (("Adam", []), ("Muon", [muon])):
        config = load_run_config(path, overrides)
        plan = plan_cluster(config, 1, GPU_PRESETS[gpu], Assumptions(), count_parameters(config))
        step, memory = plan.full_batch, plan.peak_memory()
        print(f"planned, {gpu} x {plan.gpus} (DP {plan.data_parallel_size}): {name} step {step.optimizer_step * 1e3:.2f} ms "
              f"of a {step.seconds:.3f} s iteration; optimizer states {memory.adam_states / 2**20:.0f} MiB a GPU, "
              f"step buffers {memory.optimizer_workspace / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
