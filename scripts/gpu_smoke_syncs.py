#!/usr/bin/env python
"""Host synchronisations on a GPU, for scripts/gpu_smoke.sh: what tests/host_syncs.py's audit counts on CPU, counted
by torch itself (``torch.cuda.set_sync_debug_mode``: tests/host_syncs.py CudaSyncCounter).

    where                         what                                                   pass when
    the training runs             with GPU_SMOKE_HOST_SYNCS=1, scripts/gpu_smoke_train.py (read by the check)
                                  prints one line per step and rank, its syncs by owner:
      [host-syncs] rank 0 | step 5 | 9 syncs | model 0 | training 4 | deepspeed 5 | other 0 | model at: -
                                  (on CPU, --allow-cpu, tests/host_syncs.py's audit counts
                                  what CUDA would do)
    check host-syncs              a dense and a sparse block of the config made a Llama   every block 0, forward and
                                  block (RoPE, SwiGLU; the sparse one 8 experts top 2 on  backward (a sparse block on
                                  the grouped GEMM, its groups padded), bf16, the run's   the per-expert loop: 1 read
                                  micro-batch and sequence, forward and backward counted  per forward); the grouped
                                  apart, the dense one also on packed documents           GEMM within GROUPED_BOUND of
                                  (FlexAttention, its block mask made in the count); the  the loop; the model's syncs
                                  grouped GEMM against the loop on the same block; the    0 in every step after the
                                  125m run's step lines                                   first
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OWNERS = ("model", "training", "deepspeed", "other")
STEP_LINE = re.compile(r"\[host-syncs\] rank (\d+) \| step (\d+) \| (\d+) syncs \| model (\d+) \| training (\d+) \| "
                       r"deepspeed (\d+) \| other (\d+)")
GROUPED_BOUND = 2e-2
"""The grouped GEMM against the loop, bf16, relative to the largest value: CUTLASS and cuBLAS round their fp32 sums
to bf16 apart (an ulp is 2^-8 of a value); on CPU the two are bitwise equal (tests/test_moe.py)."""


# -- counting ---------------------------------------------------------------------------------------------------------

def owners(counter) -> Counter:
    """Syncs by owner (OWNERS) of a CudaSyncCounter or a HostSyncAudit: a block's are the model's."""
    found = Counter({owner: 0 for owner in OWNERS})
    for event in counter.events:
        owner, syncs = (event[0], 1) if isinstance(event, tuple) else (event.scope, event.syncs)
        owner = "model" if owner.startswith("block") else owner
        found[owner if owner in OWNERS else "other"] += syncs
    return found


def step_line(rank: int, step: int, counter) -> str:
    found, where = owners(counter), Counter()
    for event in counter.events:
        owner, at = (event[0], event[1]) if isinstance(event, tuple) else (event.scope, event.where)
        if owner == "model" or owner.startswith("block"):
            where[at] += 1
    model_at = ", ".join(f"{at} x{n}" for at, n in where.most_common(3)) or "-"
    return (f"[host-syncs] rank {rank} | step {step} | {sum(found.values())} syncs | "
            + " | ".join(f"{owner} {found[owner]}" for owner in OWNERS) + f" | model at: {model_at}")


def count_steps(rank: int):
    """Count each training step's syncs from the first step on (Trainer.train_step to the next one: the step, its
    log and status) and print a line a step; returns the function that prints the last step's and stops."""
    import torch

    from tests.host_syncs import CudaSyncCounter, HostSyncAudit
    from training.trainer import Trainer

    original, state = Trainer.train_step, {"counter": None, "step": None}

    def train_step(trainer, loader):
        if state["counter"] is None:
            counter = CudaSyncCounter() if torch.cuda.is_available() else HostSyncAudit(trainer.engine.module)
            state["counter"] = counter.__enter__()
        elif state["step"] is not None:
            print(step_line(rank, state["step"], state["counter"]), flush=True)
            state["counter"].events.clear()
        state["step"] = trainer.state.step + 1
        return original(trainer, loader)

    def finish() -> None:
        Trainer.train_step = original
        if state["counter"] is not None:
            state["counter"].__exit__(None, None, None)
            print(step_line(rank, state["step"], state["counter"]), flush=True)

    Trainer.train_step = train_step
    return finish


def read_step_lines(log: Path) -> list[dict]:
    return [dict(zip(("rank", "step", "syncs", *OWNERS), map(int, match.groups()), strict=True))
            for match in STEP_LINE.finditer(log.read_text(errors="replace"))]


# -- the blocks -------------------------------------------------------------------------------------------------------

def llama_blocks(model_config, seed: int, device, dtype):
    """A dense block (layer 1) and a sparse one (layer 2, 8 experts top 2) of the config made a Llama block, sharing
    one RotaryEmbedding as a model's blocks do."""
    from model.config import MoEConfig
    from model.gpt import TransformerLayer, shared_rotary
    from model.parallel import ParallelContext
    from model.random import RNGStream

    moe = MoEConfig(num_experts=8, top_k=2, moe_ffn_hidden_size=max(8, model_config.ffn_hidden_size // 4),
                    first_dense_layers=1, aux_loss_coeff=0.01)
    config = dataclasses.replace(model_config, position_embedding="rope", norm="rmsnorm", mlp="swiglu", moe=moe,
                                 num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    rng, rotary = RNGStream(seed), shared_rotary(config)
    return [TransformerLayer(config, ParallelContext(), seed, n, rng, rotary).to(device=device, dtype=dtype).train()
            for n in (1, 2)]


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out


def _forward_backward(block, inputs):
    out = _hidden(block(inputs))
    out.float().square().mean().backward()
    return out


def _documents(x):
    """Fresh (b, s) position and segment ids of two documents a sample, the second from s / 2 on: a new micro-batch's
    (FlexAttention makes its block mask for each)."""
    import torch

    length = x.shape[1]
    segments = (torch.arange(length, device=x.device) >= length // 2).long().repeat(x.shape[0], 1)
    return torch.arange(length, device=x.device) - segments * (length // 2), segments


def block_syncs(model_config, micro_batch: int, seed: int, device, dtype, counting) -> dict:
    """Syncs of each block's forward and backward, each counted apart by ``counting(block)`` (a context manager with
    ``events``), after two warm-up steps: the dense block on one sequence and on packed documents (made inside the
    count), the sparse one; the sparse block's kernel, and its grouped GEMM against the loop."""
    import torch

    dense, sparse = llama_blocks(model_config, seed, device, dtype)
    x = torch.randn(micro_batch, model_config.seq_length, model_config.hidden_size, device=device, dtype=dtype,
                    requires_grad=True)
    found, places = {}, Counter()
    for name, block, inputs in (("dense", dense, lambda: x), ("dense packed", dense, lambda: (x, *_documents(x))),
                                ("sparse", sparse, lambda: x)):
        for _ in range(2):
            _forward_backward(block, inputs())
        with counting(block) as forward:
            out = _hidden(block(inputs()))
        objective = out.float().square().mean()
        with counting(block) as backward:
            objective.backward()
        for phase, counter in (("forward", forward), ("backward", backward)):
            found[f"{name} {phase}"] = sum(owners(counter).values())
            places.update(f"{name} {phase}: {at}" for at in _places(counter))
    found.update(_grouped_against_loop(sparse, x))
    if places:
        found["at"] = places  # where each synchronisation was made
    return found


def _places(counter) -> list[str]:
    """Where each of a count's synchronisations was made (the first frame outside torch, as the counter saw it)."""
    return [event[1] if isinstance(event, tuple) else event.where for event in counter.events]


def _grouped_against_loop(block, x) -> dict:
    experts = block.mlp.block.experts
    kernel = "grouped" if experts.runs_grouped(x) else "loop"
    results = []
    for run in ("grouped", "loop"):
        experts.kernel = run
        block.zero_grad(set_to_none=True)
        x.grad = None
        out = _forward_backward(block, x)
        results.append([out.detach(), x.grad, experts.gate_up.grad, experts.down.grad])
    experts.kernel = "auto"
    worst = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()
                for a, b in zip(*results, strict=True))
    return {"kernel": kernel, "grouped_vs_loop": worst}


# -- the check ---------------------------------------------------------------------------------------------------------

def host_syncs(config_path: str, sets: list[str], train_log: Path) -> tuple[str, str]:
    import torch

    from runconfig.run import load_run_config
    from tests.host_syncs import CudaSyncCounter

    if not torch.cuda.is_available():
        return "skip", "no CUDA device: torch.cuda.set_sync_debug_mode counts CUDA's syncs (tests/test_host_syncs.py " \
                       "counts what they would be on CPU)"
    config = load_run_config(config_path, sets)
    micro_batch = config.deepspeed["train_micro_batch_size_per_gpu"]
    found = block_syncs(config.model, micro_batch, config.training.seed, torch.device("cuda"), torch.bfloat16,
                        lambda block: CudaSyncCounter())
    return judge(found, read_step_lines(train_log) if train_log.exists() else [], micro_batch,
                 config.model.seq_length)


def judge(found: dict, steps: list[dict], micro_batch: int, length: int) -> tuple[str, str]:
    """pass or fail, and the figure, from block_syncs' counts and the training run's step lines."""
    expected = {"dense forward": 0, "dense backward": 0, "dense packed forward": 0, "dense packed backward": 0,
                "sparse forward": 0 if found["kernel"] == "grouped" else 1, "sparse backward": 0}
    problems = [f"{name} {found[name]}" for name in expected if found[name] != expected[name]]
    if found["grouped_vs_loop"] > GROUPED_BOUND:
        problems.append(f"grouped GEMM against the loop {found['grouped_vs_loop']:.2g} > {GROUPED_BOUND}")
    figure = (f"blocks (b {micro_batch}, s {length}, bf16, RoPE, 8 experts top 2 on the {found['kernel']} kernel): "
              f"dense forward {found['dense forward']} / backward {found['dense backward']} (packed documents, "
              f"FlexAttention: {found['dense packed forward']} / {found['dense packed backward']}), sparse forward "
              f"{found['sparse forward']} / backward {found['sparse backward']} syncs; grouped GEMM against the loop "
              f"{found['grouped_vs_loop']:.1e} (relative)")
    rank0 = [line for line in steps if line["rank"] == 0 and line["step"] > 1]
    if not rank0:
        problems.append("no [host-syncs] step lines after step 1 in the training log")
    else:
        totals = [line["syncs"] for line in rank0]
        largest = max(rank0, key=lambda line: line["syncs"])
        figure += (f"; training, rank 0, steps {rank0[0]['step']}-{rank0[-1]['step']}: median "
                   f"{statistics.median(totals):g} syncs a step (model {statistics.median(r['model'] for r in rank0):g}"
                   f", training {statistics.median(r['training'] for r in rank0):g}, deepspeed "
                   f"{statistics.median(r['deepspeed'] for r in rank0):g}), largest {largest['syncs']} at step "
                   f"{largest['step']}")
        model_steps = [line["step"] for line in rank0 if line["model"]]
        if model_steps:
            problems.append(f"the model synchronised in steps {model_steps[:5]} (the log's 'model at')")
    if found.get("at"):  # where the blocks synchronised: what the next change must look at
        figure += "; blocks synchronised at " + ", ".join(f"{at} x{n}" for at, n in found["at"].most_common(4))
    return ("fail" if problems else "pass"), figure + ("; " + "; ".join(problems) if problems else "")
