#!/usr/bin/env python
"""The Python half of scripts/gpu_smoke.sh: check the environment, choose the planner's hardware, report.

    python scripts/gpu_smoke.py check [--allow-cpu]     torch sees CUDA; every module the run imports is installed
    python scripts/gpu_smoke.py plan-args [--gpu P]     tools/plan.py's hardware arguments for the visible GPU
    python scripts/gpu_smoke.py report RUN CONFIG...    measured (RUN/CONFIG/metrics.jsonl, RUN/CONFIG.log) beside
        [--compiled EAGER:COMPILED]                     predicted (RUN/CONFIG.plan.json), one row per config; then
                                                        run COMPILED (training.compile) against run EAGER
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# What train.py and tools/preprocess_data.py import beyond the standard library, for this run (GPT-2 BPE, a
# checkpoint directory, hence TensorBoard), and the package that provides each.
REQUIRED_MODULES = {"torch": "torch (a CUDA build)", "deepspeed": "deepspeed==0.19.8 (wheels/, see --build-wheels)",
                    "numpy": "numpy", "tokenizers": "tokenizers", "tensorboard": "tensorboard",
                    "safetensors": "safetensors"}
# What the checks on the checkpoint import besides (scripts/gpu_smoke_checks.py): without them those checks fail.
CHECK_MODULES = {"transformers": "transformers", "lm_eval": "lm-eval (its wheels: --build-wheels)"}
# tools/plan.py's presets by product (training/metrics.py GPU_PEAKS); --peak-tflops and --memory-gib are given too.
PLAN_PRESETS = {"A100": "a100-80gb", "H100": "h100-80gb", "H800": "h100-80gb", "GH200": "h100-80gb", "H200": "h200"}
PLAN_RATIOS = {"plan_iteration_ratio": "iteration time", "plan_tokens_per_second_ratio": "tokens/s",
               "plan_memory_ratio": "peak reserved memory"}
"""The trainer's measured / planned figures in metrics.jsonl (training.plan_hardware), reported per config."""
WARMUP_STEPS = 10
"""Steps left out of the measured figures: CUDA context, cuBLAS heuristics and the caching allocator settle."""
GIB = 2**30


def check(allow_cpu: bool) -> int:
    missing = []
    for module, package in REQUIRED_MODULES.items():
        try:
            importlib.import_module(module)
        except ImportError as error:
            missing.append(f"{package} ({error})")
    if missing:
        print("missing: " + "; ".join(missing), file=sys.stderr)
        return 1
    for module, package in CHECK_MODULES.items():
        if importlib.util.find_spec(module) is None:
            print(f"warning: {package} is not installed: the checks that need {module} will fail", file=sys.stderr)
    import deepspeed
    import torch

    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"deepspeed {deepspeed.__version__}")
    try:
        import common.deepspeed_internals  # noqa: F401  (refuses a DeepSpeed version it was not checked against)
    except ImportError as error:
        print(error, file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        if allow_cpu:
            print("no CUDA device: rehearsing on CPU")
            return 0
        print("torch sees no CUDA device (torch.cuda.is_available() is False): a CPU build of torch, or no driver",
              file=sys.stderr)
        return 1
    from training.metrics import match_gpu

    name = torch.cuda.get_device_name()
    gpu = match_gpu(name)
    memory = torch.cuda.get_device_properties(0).total_memory / GIB
    peak = f"{gpu.product}, dense bf16 peak {gpu.dense_bf16_tflops:g} TFLOP/s" if gpu else "not in GPU_PEAKS: no MFU"
    print(f"GPU 0 of {torch.cuda.device_count()}: {name} ({peak}), {memory:.1f} GiB")
    return 0


def plan_args(preset: str | None) -> list[str]:
    """--gpu PRESET (the closest of tools/plan.py's), with the visible GPU's own peak and memory when known."""
    import torch

    if not torch.cuda.is_available():
        return ["--gpu", preset or "h200"]
    from training.metrics import match_gpu

    gpu = match_gpu(torch.cuda.get_device_name())
    memory = torch.cuda.get_device_properties(0).total_memory / GIB
    family = gpu.product.split()[0] if gpu else ""
    chosen = preset or PLAN_PRESETS.get(family, "a100-80gb")
    if chosen == "a100-80gb" and family == "A100" and memory < 60:
        chosen = "a100-40gb"
    args = ["--gpu", chosen, "--memory-gib", f"{memory:.1f}"]
    return args + (["--peak-tflops", f"{gpu.dense_bf16_tflops:g}"] if gpu else [])


def measured(run: Path, config: str) -> dict[str, float | None]:
    """Medians over the steps after WARMUP_STEPS (training.log_interval 1: one record per step; a run of fewer than
    twice that many steps, a CPU rehearsal, leaves out its first step only), and the peak memory of rank 0."""
    from training.metrics_log import read_metrics

    records = read_metrics(run / config / "metrics.jsonl")
    warmup = WARMUP_STEPS if len(records) >= 2 * WARMUP_STEPS else 1
    records = [r for r in records if r["step"] > warmup]
    result: dict[str, float | None] = {"steps": float(len(records))}
    if records:
        result["seconds"] = statistics.median(r["global_batch"] / r["samples_per_second"] for r in records)
        result["tokens_per_second"] = statistics.median(r["tokens_per_second"] for r in records)
        result["tflops"] = statistics.median(r["tflops_per_gpu"] for r in records)
        mfus = [r["mfu"] for r in records if r.get("mfu") is not None]
        result["mfu"] = statistics.median(mfus) if mfus else None
        for key in PLAN_RATIOS:  # the trainer's own measured / planned (training/plan_check.py), when it planned
            ratios = [r[key] for r in records if r.get(key) is not None]
            result[key] = statistics.median(ratios) if ratios else None
    log = (run / f"{config}.log").read_text(errors="replace") if (run / f"{config}.log").exists() else ""
    memory = re.search(r"\[memory\] rank 0 \| peak allocated ([\d.]+) GiB \| peak reserved ([\d.]+) GiB", log)
    result["allocated_gib"], result["reserved_gib"] = (float(memory[1]), float(memory[2])) if memory else (None, None)
    return result


def predicted(run: Path, config: str) -> dict[str, float]:
    plan = json.loads((run / f"{config}.plan.json").read_text())["plans"][0]
    full = plan["full_batch"]
    return {"seconds": full["seconds"], "tflops": full["tflops_per_gpu"], "mfu": full["mfu"],
            "peak_gib": max(stage["total"] for stage in plan["memory"]) / GIB}


def _pair(value: float | None, plan: float | None, fmt: str) -> str:
    return " / ".join("n/a" if x is None else format(x, fmt) for x in (value, plan))


def report(run: Path, configs: list[str]) -> int:
    print(f"measured (median over the steps counted, those after a warm-up of {WARMUP_STEPS}; 1 in a short "
          f"rehearsal) / predicted by tools/plan.py")
    header = f"{'config':<8}{'steps':>6}  {'s per step':>15}  {'TFLOP/s per GPU':>15}  {'MFU':>15}  " \
             f"{'peak GiB: allocated, reserved / plan':>38}"
    print(header)
    status = 0
    for config in configs:
        try:
            got, plan = measured(run, config), predicted(run, config)
        except (OSError, KeyError, ValueError, json.JSONDecodeError) as error:
            print(f"{config:<8}no result: {error}")
            status = 1
            continue
        memory = "n/a" if got["allocated_gib"] is None else f"{got['allocated_gib']:.2f}, {got['reserved_gib']:.2f}"
        print(f"{config:<8}{got['steps']:>6.0f}  {_pair(got.get('seconds'), plan['seconds'], '.3f'):>15}  "
              f"{_pair(got.get('tflops'), plan['tflops'], '.1f'):>15}  {_pair(got.get('mfu'), plan['mfu'], '.1%'):>15}  "
              f"{memory + ' / ' + format(plan['peak_gib'], '.2f'):>38}")
        ratios = [f"{name} {got[key]:.3f}" for key, name in PLAN_RATIOS.items() if got.get(key) is not None]
        print(f"{'':<8}the trainer's measured / planned (training/plan_check.py, median): "
              f"{', '.join(ratios) if ratios else 'n/a (no plan logged)'}")
    return status


def compiled_against_eager(run: Path, eager: str, compiled: str) -> str:
    """One line: the compiled run's median tokens/s and MFU against the eager run's, and the compile time its trainer
    logged (training/compile.py); the same steps counted in both (``measured``)."""
    try:
        base, got = measured(run, eager), measured(run, compiled)
    except (OSError, KeyError, ValueError) as error:
        return f"{compiled}: no result: {error}"
    if not got["steps"] or not base["steps"]:
        return f"{compiled}: no steps counted"
    log = (run / f"{compiled}.log").read_text(errors="replace") if (run / f"{compiled}.log").exists() else ""
    clock = re.search(r"\[compile\] .* in about ([\d.]+) s", log)
    mfu = _pair(got.get("mfu"), base.get("mfu"), ".1%")
    return (f"{compiled} (training.compile) against {eager}: tokens/s {got['tokens_per_second']:,.0f} / "
            f"{base['tokens_per_second']:,.0f} ({got['tokens_per_second'] / base['tokens_per_second']:.3f}x), "
            f"MFU {mfu}; compiled in about {clock[1] + ' s' if clock else 'n/a (no [compile] line)'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check").add_argument("--allow-cpu", action="store_true")
    commands.add_parser("plan-args").add_argument("--gpu", default=None)
    reporting = commands.add_parser("report")
    reporting.add_argument("run", type=Path)
    reporting.add_argument("configs", nargs="+")
    reporting.add_argument("--compiled", default=None, metavar="EAGER:COMPILED",
                           help="the run of COMPILED (training.compile) against that of EAGER, both in RUN")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.allow_cpu)
    if args.command == "plan-args":
        print(" ".join(plan_args(args.gpu)))
        return 0
    status = report(args.run, args.configs)
    if args.compiled:
        print(compiled_against_eager(args.run, *args.compiled.split(":", 1)))
    return status


if __name__ == "__main__":
    sys.exit(main())
