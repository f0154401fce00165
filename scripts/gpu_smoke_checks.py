#!/usr/bin/env python
"""The checks of scripts/gpu_smoke.sh beyond training: each writes one record, and `summary` prints them as a table.

    check                   what runs                                                pass when
    flash                   one block of the config (bf16, its micro-batch and        SDPA runs it with the flash
                            sequence) forward and backward with SDPA limited to       kernel alone (else SDPA raises)
                            FLASH_ATTENTION
    hflm                    lm-eval's own HFLM on the export (fp32), same tasks       (the reference of compare-eval)
    hf-generate             transformers' greedy generate() on the export (fp32)      (the reference of compare-generate)
    compare-eval            tools/evaluate.py's --output against hflm's               every log-likelihood within 1e-4 per
                                                                                      token, is-greedy and acc equal
    compare-generate        tools/generate.py's tokens against hf-generate's          every token equal
    resume                  metrics.jsonl of the straight run, of the run stopped     steps after the resume differ from
                            at a checkpoint and of its resume                         the straight run by no more than
                                                                                      the steps before it (0: bitwise)
    stall                   the logs' "training stopped for X s" of sync and async    async / sync <= STALL_RATIO
                            saves (the first async save, which allocates the host
                            buffers, reported apart)
    document-masks          two 125m blocks on packed samples (documents closed by    logits and gradient norm within
                            the end token), fp32, model.attention_backend "flex"      1e-4 (relative) of SDPA's
                            against "sdpa", forward and backward, timed
    flex-memory             one block of the config, bf16, on samples of 8 packed      what the forward keeps within
                            documents at s 16384 and 32768, FlexAttention's forward   10% of the planner's figure at
                            and backward: what it keeps and its peak (CUDA's           each length; the peak grows at
                            allocator), against planner/memory.py's                   most 2.2x from 16k to 32k
    memory-snapshot         the 125m run's training.memory_snapshot at step 3         the pickle holds segments and
                            (torch.cuda.memory._dump_snapshot, Python stacks)         allocation events with Python
                                                                                      frames
    host-syncs              a dense and a sparse Llama block of the config, bf16,     every block 0; the grouped GEMM
                            their host syncs forward and backward (torch.cuda.        within 2e-2 of the loop; the
                            set_sync_debug_mode), and the 125m run's per step         model 0 in every step after the
                            (scripts/gpu_smoke_syncs.py)                              first
    skip                    a part that cannot run here, with the reason              (always "skip")

Each record is RUN/checks/<NN>-<name>.json: {"check", "status": "pass" | "fail" | "skip", "figure"}. `summary RUN`
prints the training rows (scripts/gpu_smoke.py's measured and planned figures) and every record, and exits 1 when
any check failed or is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STALL_RATIO = 0.1
"""The async save's stall against the sync save's (the issue's bound; benchmarks/bench_checkpoint_stall.py)."""
LOGLIK_BOUND_PER_TOKEN = 1e-4
"""fp32 on both sides: the bound tests/test_evaluation.py holds on CPU (measured there: 1e-7 per token)."""
STOPPED = re.compile(r"checkpoint global_step(\d+): training stopped for ([\d.]+) s \((sync|async)")


def write_record(run: Path, order: int, check: str, status: str, figure: str) -> dict:
    folder = run / "checks"
    folder.mkdir(parents=True, exist_ok=True)
    record = {"check": check, "status": status, "figure": figure}
    name = re.sub(r"[^a-z0-9]+", "-", check.lower()).strip("-")
    (folder / f"{order:02d}-{name}.json").write_text(json.dumps(record) + "\n")
    print(f"[{status}] {check}: {figure}")
    return record


# -- flash attention ------------------------------------------------------------------------------------------------

def flash(config_path: str, sets: list[str]) -> tuple[str, str]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from model.gpt import TransformerLayer
    from model.parallel import ParallelContext
    from model.random import RNGStream
    from runconfig.run import load_run_config

    if not torch.cuda.is_available():
        return "skip", "no CUDA device: the flash kernel runs on CUDA only"
    config = load_run_config(config_path, sets)
    model = config.model
    layer = TransformerLayer(model, ParallelContext(), config.training.seed, 1, RNGStream(0))
    layer = layer.to(device="cuda", dtype=torch.bfloat16).train()
    micro_batch = config.deepspeed["train_micro_batch_size_per_gpu"]
    x = torch.randn(micro_batch, model.seq_length, model.hidden_size, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        try:
            layer(x).float().square().mean().backward()  # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            layer(x).float().square().mean().backward()
            torch.cuda.synchronize()
        except RuntimeError as error:  # "No available kernel": the call's arguments rule the flash kernel out
            return "fail", f"SDPA limited to FLASH_ATTENTION refused the block: {str(error).splitlines()[0]}"
    seconds = time.perf_counter() - start
    return "pass", (f"a {Path(config_path).stem} block (b {micro_batch}, s {model.seq_length}, bf16) forward + "
                    f"backward on the flash kernel alone: {seconds * 1e3:.1f} ms")


# -- document masks: FlexAttention against the SDPA reference --------------------------------------------------------

DOCUMENT_MASK_BOUND = 1e-4
"""fp32 on both sides: the largest logit difference and the gradient norm's, relative (CPU forward: 1e-6)."""


def document_masks(config_path: str, sets: list[str]) -> tuple[str, str]:
    """Two blocks of the config's model, fp32, on packed samples of its micro-batch and sequence (documents of
    random lengths closed by the end token, reset positions): model.attention_backend "flex" against "sdpa", forward
    and backward, and the time of each."""
    import torch

    from runconfig.run import load_run_config

    if not torch.cuda.is_available():
        return "skip", "no CUDA device: FlexAttention's compiled kernel and its backward run on CUDA only"
    config = load_run_config(config_path, sets)
    micro_batch = config.deepspeed["train_micro_batch_size_per_gpu"]
    found = compare_attention_backends(config.model, micro_batch, config.data.eod_token_id, config.training.seed,
                                       torch.device("cuda"), backward=True)
    status = "pass" if max(found["logits_error"], found["norm_error"]) <= DOCUMENT_MASK_BOUND else "fail"
    return status, (f"2 {Path(config_path).stem} blocks, b {micro_batch} x s {config.model.seq_length}, "
                    f"{found['documents']} documents, fp32: flex - sdpa logits {found['logits_error']:.1e} "
                    f"(relative), gradient norm {found['norm_error']:.1e}; forward + backward "
                    f"{found['flex_s'] * 1e3:.1f} ms flex, {found['sdpa_s'] * 1e3:.1f} ms sdpa")


def compare_attention_backends(model_config, micro_batch: int, end: int, seed: int, device, backward: bool) -> dict:
    """Two blocks of ``model_config`` under each attention backend on the same packed samples (about 32 documents a
    row): the relative differences of the logits and of the gradient norm (0 without ``backward``), the documents,
    and each backend's time (the second call: the first compiles FlexAttention on CUDA)."""
    import dataclasses

    import torch

    from data.loader import documents
    from model.gpt import GPT

    length = model_config.seq_length
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(model_config.vocab_size, 50000), (micro_batch, length), generator=generator)
    tokens[torch.rand(micro_batch, length, generator=generator) < 32 / length] = end
    tokens = tokens.to(device)
    segment_ids, positions = documents(tokens, end)
    found = {}
    for backend in ("sdpa", "flex"):
        blocks = dataclasses.replace(model_config, num_layers=2, attention_backend=backend, precision="fp32")
        model = GPT(blocks, seed=seed).to(device).train()
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with torch.set_grad_enabled(backward):
                logits = model(tokens, positions, segment_ids)[..., :model_config.vocab_size]
                if backward:
                    logits.float().square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        grads = [p.grad.double().norm() for p in model.parameters() if p.grad is not None]
        found[backend] = (logits.detach(), torch.stack(grads).norm().item() if grads else 0.0, seconds)
    (reference, reference_norm, sdpa_s), (flex, flex_norm, flex_s) = found["sdpa"], found["flex"]
    return {"logits_error": ((flex - reference).abs().max() / reference.abs().max()).item(),
            "norm_error": abs(flex_norm - reference_norm) / reference_norm if backward else 0.0,
            "documents": int(segment_ids.max(dim=1).values.sum()) + micro_batch, "sdpa_s": sdpa_s, "flex_s": flex_s}


# -- document masks at long context: FlexAttention's memory, linear in s ------------------------------------------

FLEX_LENGTHS = (16384, 32768)
FLEX_PLAN_BOUND = 0.10
"""What one block's forward keeps against planner/memory.py layer_activation_bytes (the CPU blockwise kernel's
measure, benchmarks/bench_document_attention.py: 5% under it at 4k and 8k)."""
FLEX_GROWTH_BOUND = 2.2
"""The peak of the forward and backward from 16k to 32k positions: linear in s (an s x s mask would be 4x)."""


def flex_block_config(base, length: int):
    """The config's model as one block at ``length`` positions on FlexAttention, bf16, no dropout. A model with
    learned positions (125m: 2,048 of them) is let past its table: one block reads none of it."""
    import dataclasses

    return dataclasses.replace(base, num_layers=1, seq_length=length, attention_backend="flex", precision="bf16",
                               attention_dropout=0.0, hidden_dropout=0.0,
                               max_position_embeddings=max(base.max_position_embeddings, length))


def flex_memory(config_path: str, sets: list[str]) -> tuple[str, str]:
    """One block of the config's model (bf16, micro-batch 1, no dropout: FlexAttention has none) on a sample of 8
    equal packed documents at each of FLEX_LENGTHS: the bytes its forward keeps for the backward and the peak of
    the forward and backward above the start (torch.cuda's allocator), against the planner's figure."""
    import torch

    from model.gpt import TransformerLayer
    from model.parallel import ParallelContext
    from model.random import RNGStream
    from planner.memory import layer_activation_bytes
    from runconfig.run import load_run_config

    if not torch.cuda.is_available():
        return "skip", "no CUDA device: FlexAttention's compiled kernel and its backward run on CUDA only"
    base = load_run_config(config_path, sets).model
    device, found = torch.device("cuda"), {}
    for length in FLEX_LENGTHS:
        model = flex_block_config(base, length)
        layer = TransformerLayer(model, ParallelContext(), 1234, 1, RNGStream(0)).to(device, torch.bfloat16).train()
        segment_ids = (torch.arange(length, device=device) * 8 // length)[None]  # 8 equal documents
        positions = torch.arange(length, device=device)[None] - torch.searchsorted(segment_ids[0], segment_ids[0])
        x = torch.randn(1, length, model.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2):  # the first call compiles FlexAttention and makes the lazy states: measure the second
            layer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            out = layer((x, positions, segment_ids))[0]
            kept = torch.cuda.memory_allocated() - start
            out.float().square().mean().backward()
            del out
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start
        planned = layer_activation_bytes(model, 1, 1, sequence_parallel=False, recompute="none")
        found[length] = (kept, peak, planned)
        del layer, x
        torch.cuda.empty_cache()
    within = all(abs(kept / planned - 1) <= FLEX_PLAN_BOUND for kept, _, planned in found.values())
    growth = found[FLEX_LENGTHS[-1]][1] / found[FLEX_LENGTHS[0]][1]
    status = "pass" if within and growth <= FLEX_GROWTH_BOUND else "fail"
    return status, "; ".join(f"s {length}: kept {kept / 2**20:.0f} MiB (plan {planned / 2**20:.0f}, "
                             f"x{kept / planned:.3f}), peak {peak / 2**20:.0f} MiB"
                             for length, (kept, peak, planned) in found.items()) + \
        f"; peak x{growth:.2f} from {FLEX_LENGTHS[0]} to {FLEX_LENGTHS[-1]} (bf16, 8 documents, b 1)"


# -- references on the export ---------------------------------------------------------------------------------------

def hflm(model_dir: str, tasks: list[str], limit: float, output: Path) -> None:
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from evaluation.harness import SHIPPED_TASKS, offline, quiet_lm_eval, resolved_task_folders, task_manager
    from tools.evaluate import write_json

    offline()
    quiet_lm_eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = HFLM(pretrained=model_dir, batch_size=8, device=device, dtype="float32")
    with resolved_task_folders([SHIPPED_TASKS]) as folders:
        results = simple_evaluate(model=model, tasks=tasks, limit=limit, log_samples=True, bootstrap_iters=0,
                                  task_manager=task_manager(tasks, folders))
    write_json(output, results)


def hf_generate(model_dir: str, prompts: list[str], new_tokens: int, output: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, torch_dtype=torch.float32)
    model = model.to(device).eval()
    lines = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], device=device)
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.eos_token_id)
        lines.append(json.dumps({"prompt": prompt, "tokens": tokens[0, ids.shape[1]:].tolist()}) + "\n")
    output.write_text("".join(lines))


# -- comparisons ----------------------------------------------------------------------------------------------------

def _responses(results: dict) -> dict[str, list]:
    return {task: [(s["arguments"], s["resps"]) for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def compare_eval(ours_path: Path, theirs_path: Path, tokenizer_dir: str) -> tuple[str, str]:
    from transformers import AutoTokenizer

    from evaluation.harness import metric_values

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ours, theirs = json.loads(ours_path.read_text()), json.loads(theirs_path.read_text())
    requests, worst, problems = 0, 0.0, []
    for task, documents in _responses(theirs).items():
        mine = _responses(ours).get(task, [])
        if len(mine) != len(documents):
            return "fail", f"{task}: {len(mine)} documents scored, lm-eval's HFLM scored {len(documents)}"
        for (arguments, their_resps), (_, my_resps) in zip(documents, mine, strict=True):
            for request, their, my in zip(arguments, their_resps, my_resps, strict=True):
                their, my = their[0], my[0]
                their_value, my_value = (their[0], my[0]) if isinstance(their, list) else (their, my)
                if isinstance(their, list) and their[1] != my[1]:
                    problems.append(f"{task}: is-greedy differs")
                tokens = len(tokenizer.encode(request[-1])) + 1
                worst = max(worst, abs(my_value - their_value) / tokens)
                requests += 1
    accuracies = {k: v for k, v in metric_values(theirs).items() if k.endswith(("/acc", "/acc_norm"))}
    problems += [f"{k} {metric_values(ours).get(k)} != {v}" for k, v in accuracies.items()
                 if metric_values(ours).get(k) != v]
    figure = (f"{requests} requests, largest |log-likelihood difference| {worst:.1e} per token (bound "
              f"{LOGLIK_BOUND_PER_TOKEN:g}); {', '.join(f'{k} {v:.4f}' for k, v in accuracies.items())}")
    if worst > LOGLIK_BOUND_PER_TOKEN or problems or requests == 0:
        return "fail", figure + ("; " + "; ".join(problems[:3]) if problems else "")
    return "pass", figure


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare_generate(ours_path: Path, theirs_path: Path) -> tuple[str, str]:
    ours, theirs = _jsonl(ours_path), _jsonl(theirs_path)
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(ours, theirs, strict=False))
    tokens = sum(len(b["tokens"]) for b in theirs)
    figure = f"{same} of {len(theirs)} prompts' greedy tokens equal ({tokens} tokens from transformers)"
    return ("pass" if same == len(theirs) == len(ours) and tokens else "fail"), figure


def _losses(path: Path) -> dict[int, float]:
    from training.metrics_log import read_metrics

    return {record["step"]: record["loss"] for record in read_metrics(path)}


def resume(straight: Path, stopped: Path, resumed: Path) -> tuple[str, str]:
    """``stopped`` and ``resumed`` are the same run's metrics.jsonl before and after the relaunch (read_metrics keeps
    the last record of each step, so ``resumed`` is read for the steps after the stop only)."""
    reference, before = _losses(straight), _losses(stopped)
    stop = max(before)
    after = {step: loss for step, loss in _losses(resumed).items() if step > stop}
    if not after or any(step not in reference for step in [*before, *after]):
        return "fail", f"missing steps: stopped at {stop}, resumed steps {sorted(after)}, straight {len(reference)}"
    noise = max(abs(before[s] - reference[s]) for s in before)
    gap = max(abs(after[s] - reference[s]) for s in after)
    figure = (f"steps {min(after)}-{max(after)} after the resume at {stop}: largest |loss difference| from the "
              f"straight run {gap:.3g}; steps 1-{stop} of two launches: {noise:.3g}")
    if gap == noise == 0:
        return "pass", figure + " (bitwise)"
    return ("pass" if gap <= noise else "fail"), figure + " (the GPU run is not bitwise repeatable)"


def stall(sync_logs: list[Path], async_logs: list[Path]) -> tuple[str, str]:
    def stops(paths: list[Path], mode: str) -> list[tuple[int, float]]:
        found = [(int(m[1]), float(m[2])) for p in paths for m in STOPPED.finditer(p.read_text(errors="replace"))
                 if m[3] == mode]
        return sorted(found)

    synced, asynced = stops(sync_logs, "sync"), stops(async_logs, "async")
    if not synced or len(asynced) < 2:
        return "fail", f"saves found: {len(synced)} sync, {len(asynced)} async (need 1 and 2)"
    first, later = asynced[0][1], statistics.median(s for _, s in asynced[1:])
    sync = statistics.median(s for _, s in synced)
    ratio = later / sync if sync else math.inf
    figure = (f"async {later:.3f} s (first save, allocating its host buffers: {first:.3f} s) against sync "
              f"{sync:.3f} s: ratio {ratio:.3f} (bound {STALL_RATIO})")
    return ("pass" if ratio <= STALL_RATIO else "fail"), figure


# -- the memory snapshot --------------------------------------------------------------------------------------------

def memory_snapshot(path: Path) -> tuple[str, str]:
    """The snapshot training.memory_snapshot dumped: allocator segments, and allocation events recorded since the
    trainer started, with Python frames (stacks "python")."""
    import pickle

    if not path.exists():
        return "fail", f"no snapshot at {path}"
    with open(path, "rb") as file:  # our own run's file (torch.cuda.memory._dump_snapshot writes a pickle)
        snapshot = pickle.load(file)
    segments = snapshot.get("segments", [])
    events = [event for trace in snapshot.get("device_traces", []) for event in trace]
    python = [event for event in events if any(str(frame.get("filename", "")).endswith(".py")
                                                 for frame in event.get("frames", []))]
    reserved = sum(segment.get("total_size", 0) for segment in segments) / 2**30
    figure = (f"{path.name}: {len(segments)} segments ({reserved:.2f} GiB reserved), {len(events)} allocator events, "
              f"{len(python)} with Python frames, {path.stat().st_size / 2**20:.1f} MiB")
    return ("pass" if segments and python else "fail"), figure


# -- the table ------------------------------------------------------------------------------------------------------

def summary(run: Path, configs: list[str], expected: int) -> int:
    import gpu_smoke  # scripts/gpu_smoke.py, beside this file

    rows, failed = [], 0
    for config in configs:
        try:
            got, plan = gpu_smoke.measured(run, config), gpu_smoke.predicted(run, config)
        except (OSError, KeyError, ValueError, json.JSONDecodeError) as error:
            rows.append((f"train {config}", "fail", f"no result: {error}"))
            continue
        ok = got.get("tflops") is not None and got.get("plan_iteration_ratio") is not None  # and it was planned
        memory = "n/a" if got["allocated_gib"] is None else f"{got['allocated_gib']:.2f}"
        mfu = "n/a" if got.get("mfu") is None else f"{got['mfu']:.1%}"
        ratios = ", ".join(f"{name} {got[key]:.2f}" for key, name in gpu_smoke.PLAN_RATIOS.items()
                           if got.get(key) is not None) or "n/a"
        rows.append((f"train {config} (bf16, TP 1 x PP 1)", "pass" if ok else "fail",
                     f"{got.get('tokens_per_second', 0):,.0f} tokens/s, {got.get('tflops') or 0:.1f} TFLOP/s, MFU "
                     f"{mfu} (plan {plan['mfu']:.1%}), peak {memory} GiB (plan {plan['peak_gib']:.2f}); the "
                     f"trainer's measured / planned: {ratios}"))
    records = sorted((run / "checks").glob("*.json")) if (run / "checks").exists() else []
    rows += [(r["check"], r["status"], r["figure"]) for r in map(lambda p: json.loads(p.read_text()), records)]
    if len(records) < expected:
        rows.append((f"{expected - len(records)} check(s)", "fail", "did not write a record (see the log above)"))
    width = max(len(check) for check, _, _ in rows)
    print(f"{'check':<{width}}  result  figure")
    for check, status, figure in rows:
        print(f"{check:<{width}}  {status:<6}  {figure}")
        failed += status == "fail"
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


def _host_syncs(args: argparse.Namespace) -> tuple[str, str]:
    from gpu_smoke_syncs import host_syncs  # scripts/gpu_smoke_syncs.py, beside this file

    return host_syncs(args.ds_config, args.set, args.train_log)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, arguments in {"flash": ["run", "order", "ds_config"], "hflm": ["model", "output"],
                            "hf-generate": ["model", "output"], "compare-eval": ["run", "order", "ours", "theirs",
                                                                                 "tokenizer"],
                            "compare-generate": ["run", "order", "ours", "theirs"],
                            "resume": ["run", "order", "straight", "stopped", "resumed"],
                            "skip": ["run", "order", "check", "reason"], "summary": ["run", "expected"],
                            "memory-snapshot": ["run", "order", "snapshot"],
                            "document-masks": ["run", "order", "ds_config"],
                            "flex-memory": ["run", "order", "ds_config"],
                            "host-syncs": ["run", "order", "ds_config"]}.items():
        command = commands.add_parser(name)
        for argument in arguments:
            command.add_argument(argument)
    commands.choices["flash"].add_argument("--set", action="append", default=[])
    commands.choices["document-masks"].add_argument("--set", action="append", default=[])
    commands.choices["flex-memory"].add_argument("--set", action="append", default=[])
    commands.choices["host-syncs"].add_argument("--set", action="append", default=[])
    commands.choices["host-syncs"].add_argument("--train-log", type=Path, required=True)
    commands.choices["hflm"].add_argument("--tasks", required=True)
    commands.choices["hflm"].add_argument("--limit", type=float, default=None)
    commands.choices["hf-generate"].add_argument("--prompt", action="append", required=True)
    commands.choices["hf-generate"].add_argument("--max-new-tokens", type=int, default=32)
    commands.choices["summary"].add_argument("configs", nargs="+")
    stalling = commands.add_parser("stall")
    for argument in ("run", "order"):
        stalling.add_argument(argument)
    stalling.add_argument("--sync-log", action="append", type=Path, required=True)
    stalling.add_argument("--async-log", action="append", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "hflm":
        hflm(args.model, args.tasks.split(","), args.limit, Path(args.output))
        return 0
    if args.command == "hf-generate":
        hf_generate(args.model, args.prompt, args.max_new_tokens, Path(args.output))
        return 0
    if args.command == "summary":
        return summary(Path(args.run), args.configs, int(args.expected))
    checks = {
        "flash": lambda: ("flash attention (SDPA)", *flash(args.ds_config, args.set)),
        "compare-eval": lambda: ("tools/evaluate.py against lm-eval's HFLM on the export",
                                 *compare_eval(Path(args.ours), Path(args.theirs), args.tokenizer)),
        "compare-generate": lambda: ("tools/generate.py against transformers' generate()",
                                     *compare_generate(Path(args.ours), Path(args.theirs))),
        "resume": lambda: ("resume from an async checkpoint",
                           *resume(Path(args.straight), Path(args.stopped), Path(args.resumed))),
        "stall": lambda: ("checkpoint stall, async against sync", *stall(args.sync_log, args.async_log)),
        "memory-snapshot": lambda: ("CUDA memory snapshot (training.memory_snapshot)",
                                    *memory_snapshot(Path(args.snapshot))),
        "document-masks": lambda: ("document masks: FlexAttention against SDPA",
                                   *document_masks(args.ds_config, args.set)),
        "flex-memory": lambda: ("document masks at 16k and 32k: FlexAttention's memory against the plan",
                                *flex_memory(args.ds_config, args.set)),
        "host-syncs": lambda: ("host synchronisations per block and step", *_host_syncs(args)),
        "skip": lambda: (args.check, "skip", args.reason),
    }
    check, status, figure = checks[args.command]()
    write_record(Path(args.run), int(args.order), check, status, figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
