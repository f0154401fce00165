#!/usr/bin/env python
"""Forward + backward time of one MoE block (model/moe.py) against the dense SwiGLU MLP of the same active FLOPs, on
CPU, fp32, one torch thread; then the same block at EP 2 over 2 gloo processes, with the all-to-all's share.

    python benchmarks/bench_moe.py [--hidden 1024] [--experts 8] [--top-k 2] [--moe-ffn 1024] [--batch 4]
                                   [--seq 512] [--repeats 5] [--warmup 2] [--no-ep]

The block: MoEBlock at TP 1, softmax router, dropless, no shared expert, on x (b, s, h); the objective is
sum(out * g) + aux_loss_coeff * aux_loss for a fixed random g, as training attaches the aux loss. The dense MLP:
model/gpt.py's SwiGLUMLP with ffn_hidden_size = k F and no bias, the same matmul FLOPs as the k experts each token
visits. Each figure is the median of --repeats timed rounds after --warmup untimed ones; a round times one step of
each (block, dense, staged block below) in turn, gradients set to None first.

    printed                      what
    moe, dense, moe / dense      forward + backward of the block and of the dense MLP, and their ratio (goal <= 1.5)
    breakdown                    the same step cut at the block's stage boundaries (each stage's input a detached
                                 leaf, its backward run alone), forward | backward | total per stage:
                                   router    logits, softmax, top-k, gate weights, aux and z losses
                                   dispatch  sort_assignments (argsort, bincount), rows = tokens[order // k], the
                                             counts to the host; backward: the rows' gradient added back to tokens
                                   experts   one SwiGLU matmul pair per expert on its rows (Experts.forward)
                                   combine   unsort, weight and sum the k outputs of each token (combine)
                                 with each stage's share of their sum, the sum against the whole block (the rest:
                                 Python and the TP-region no-ops), and the experts' and the dense MLP's GFLOP/s:
                                 experts / dense isolates what the 8 smaller matmul pairs cost against one large one
    EP 2                         2 processes, each its own (b, s) tokens and 4 of the 8 experts: forward + backward
                                 (the slower rank's median), the time inside the all-to-alls (counts and rows forward,
                                 rows backward), and its share; the 1-process figure above is the EP 1 reference

The all-to-all time is measured by wrapping model.primitives._all_to_all, the one function both directions of
model.primitives.all_to_all call (the benchmark's own wrapper; primitives is not edited). It is wall time inside the
exchange, so it includes waiting for the other rank. On a 2-core machine the two ranks share the cores with
everything else that runs: the EP 2 figures are only as steady as the machine is idle.

Measured at the defaults (AMD EPYC, 2 cores, one thread per process, the other core busy with another benchmark):

    moe / dense          1.55 (1342 / 868 ms) with Experts.forward indexing self.gate_up[j], self.down[j]: the
                         backward of each index wrote a zero-filled [8, 2F, h] and [8, h, F] gradient and autograd
                         added the 8 of them (experts' backward 986 ms against a forward of 296 ms; 60 GFLOP/s)
                         1.07 (959 / 897 ms) with unbind(0), the same gradients bit for bit (experts' backward 618 ms,
                         81 GFLOP/s against the dense MLP's 86: the 8 matmul pairs of ~512 rows cost about 5% more
                         than one of 2048); experts 95%, combine 3-4%, router and dispatch under 1% each
                         (three runs with unbind: 1.06, 1.07, 1.13)
    EP 2                 948 ms per step (EP 1: 966 ms) when both cores were free: all-to-all 34-42 ms, 4.5%;
                         2.3-2.8 s when the other benchmark held a core (the ranks wait for a core, not for each
                         other): all-to-all 0.11-0.43 s, 4-15%
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.config import MoEConfig, preset  # noqa: E402
from model.gpt import SwiGLUMLP  # noqa: E402
from model.moe import MoEBlock, combine, sort_assignments  # noqa: E402
from model.parallel import ParallelContext  # noqa: E402

STAGES = ("router", "dispatch", "experts", "combine")
SEED, LAYER, INIT_STD = 1234, 1, 0.02


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-ffn", type=int, default=1024, help="F, the inner width of each expert")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps; the median is printed")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--no-ep", action="store_true", help="skip the 2-process EP 2 run")
    return parser.parse_args(argv)


def moe_config(args: argparse.Namespace) -> MoEConfig:
    return MoEConfig(num_experts=args.experts, top_k=args.top_k, moe_ffn_hidden_size=args.moe_ffn)


def build_block(args: argparse.Namespace, expert_group=None) -> MoEBlock:
    return MoEBlock(moe_config(args), args.hidden, ParallelContext(), seed=SEED, layer_number=LAYER,
                    init_std=INIT_STD, output_init_std=INIT_STD, expert_parallel_group=expert_group)


def build_dense(args: argparse.Namespace) -> SwiGLUMLP:
    config = preset("llama-tiny", hidden_size=args.hidden, num_attention_heads=8, num_key_value_heads=8,
                    ffn_hidden_size=args.top_k * args.moe_ffn)
    return SwiGLUMLP(config, ParallelContext(), SEED, LAYER)


def inputs(args: argparse.Namespace, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (args.batch, args.seq, args.hidden)
    return torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator)  # x, g


def _clear_gradients(*modules: torch.nn.Module) -> None:
    for module in modules:
        for parameter in module.parameters():
            parameter.grad = None


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def block_step(block: MoEBlock, x: torch.Tensor, g: torch.Tensor) -> None:
    x = x.detach().requires_grad_()
    out, stats = block(x)
    torch.autograd.backward([out, stats.aux_loss], [g, torch.tensor(block.moe.aux_loss_coeff)])


def dense_step(dense: SwiGLUMLP, x: torch.Tensor, g: torch.Tensor) -> None:
    dense(x.detach().requires_grad_()).backward(g)


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().requires_grad_()


def staged_step(block: MoEBlock, x: torch.Tensor, g: torch.Tensor) -> dict[str, tuple[float, float]]:
    """MoEBlock.forward at TP 1, EP 1 (the same calls, in order), cut at each stage boundary: (forward, backward)
    seconds per stage."""
    moe, clock = block.moe, time.perf_counter
    tokens = _leaf(x.reshape(-1, x.shape[-1]))  # (T, h)
    t0 = clock()
    routing = block.router(tokens)
    t1 = clock()
    order, counts, _ = sort_assignments(routing.experts, routing.weights, moe.num_experts, None)
    rows = _leaf(tokens)[order // moe.top_k]  # (n, h)
    counts_host = counts.tolist()
    t2 = clock()
    expert_rows = _leaf(rows)
    expert_out = block.experts(expert_rows, counts_host)  # (n, h)
    t3 = clock()
    combine_rows, weights = _leaf(expert_out), _leaf(routing.weights)
    out = combine(combine_rows, order, weights)  # (T, h)
    t4 = clock()
    out.backward(g.reshape(out.shape))
    t5 = clock()
    expert_out.backward(combine_rows.grad)
    t6 = clock()
    rows.backward(expert_rows.grad)  # into the (T, h) gradient of the tokens
    t7 = clock()
    torch.autograd.backward([routing.weights, routing.aux_loss], [weights.grad, torch.tensor(moe.aux_loss_coeff)])
    t8 = clock()
    return {"router": (t1 - t0, t8 - t7), "dispatch": (t2 - t1, t7 - t6), "experts": (t3 - t2, t6 - t5),
            "combine": (t4 - t3, t5 - t4)}


def measure_interleaved(block: MoEBlock, dense: SwiGLUMLP, x: torch.Tensor, g: torch.Tensor,
                        args: argparse.Namespace) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """Medians of the block's, the dense MLP's and the staged block's steps, taken in turns within each round, so
    that a change of load on the machine reaches the three alike."""
    moe_times, dense_times, stage_samples = [], [], []
    for index in range(args.warmup + args.repeats):
        _clear_gradients(block, dense)
        moe_s = timed(lambda: block_step(block, x, g))
        dense_s = timed(lambda: dense_step(dense, x, g))
        _clear_gradients(block)
        stages = staged_step(block, x, g)
        if index >= args.warmup:
            moe_times.append(moe_s)
            dense_times.append(dense_s)
            stage_samples.append(stages)
    medians = {stage: tuple(statistics.median(sample[stage][i] for sample in stage_samples) for i in (0, 1))
               for stage in STAGES}
    return statistics.median(moe_times), statistics.median(dense_times), medians


def matmul_flops(args: argparse.Namespace) -> float:
    """Forward + backward of the SwiGLU matmuls of T tokens through k F inner units: 3 matmuls (gate, up, down) of
    2 h kF T FLOPs each forward, twice that backward (input and weight gradients)."""
    tokens = args.batch * args.seq
    return 3 * 3 * 2 * args.hidden * args.top_k * args.moe_ffn * tokens


def report_single(args: argparse.Namespace) -> float:
    torch.set_num_threads(1)
    block, dense = build_block(args), build_dense(args)
    x, g = inputs(args, seed=0)
    moe_s, dense_s, stages = measure_interleaved(block, dense, x, g, args)
    routed = block.router(x.reshape(-1, args.hidden)).tokens_per_expert.tolist()
    print(f"one block, 1 process, fp32, 1 thread: h {args.hidden}, {args.experts} experts, top {args.top_k}, "
          f"F {args.moe_ffn}; tokens {args.batch} x {args.seq}; median of {args.repeats} after {args.warmup} warm-up")
    print(f"assignments per expert: {routed}")
    print(f"moe   forward + backward  {moe_s * 1e3:8.1f} ms")
    print(f"dense forward + backward  {dense_s * 1e3:8.1f} ms   (SwiGLUMLP, ffn {args.top_k * args.moe_ffn})")
    print(f"moe / dense               {moe_s / dense_s:8.2f}      (goal <= 1.5)")
    total = sum(sum(stages[s]) for s in STAGES)
    print("breakdown of the moe step  forward  backward    total   share")
    for stage in STAGES:
        forward, backward = stages[stage]
        print(f"  {stage:9s}              {forward * 1e3:7.1f}  {backward * 1e3:8.1f}  {(forward + backward) * 1e3:7.1f}"
              f"  {100 * (forward + backward) / total:5.1f}%")
    print(f"  sum of stages                              {total * 1e3:7.1f}   (whole block {moe_s * 1e3:.1f}: the rest "
          f"{(moe_s - total) * 1e3:+.1f})")
    flops = matmul_flops(args)
    experts_s = sum(stages["experts"])
    print(f"matmuls: experts {flops / experts_s / 1e9:.1f} GFLOP/s ({experts_s * 1e3:.1f} ms), dense "
          f"{flops / dense_s / 1e9:.1f} GFLOP/s ({dense_s * 1e3:.1f} ms); experts / dense {experts_s / dense_s:.2f}")
    return moe_s


# ------------------------------------------------------------------------------------------------------- EP 2


def _timed_all_to_all(spent: list[float]):
    import model.primitives as primitives

    if not callable(getattr(primitives, "_all_to_all", None)):
        raise RuntimeError("model.primitives._all_to_all is gone: point the benchmark's timer at the function that "
                           "model.primitives.all_to_all's forward and backward now call")
    exchange = primitives._all_to_all

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return exchange(*args, **kwargs)
        finally:
            spent[-1] += time.perf_counter() - start

    primitives._all_to_all = timed


def _ep_worker(args: argparse.Namespace) -> dict:
    """One EP rank: its own tokens, its 4 experts; per timed step, the step's and the all-to-alls' seconds."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.new_group(ranks=list(range(dist.get_world_size())))
    block = build_block(args, expert_group=group)
    x, g = inputs(args, seed=1 + dist.get_rank())
    spent: list[float] = []
    _timed_all_to_all(spent)
    steps, exchanges = [], []
    for index in range(args.warmup + args.repeats):
        _clear_gradients(block)
        dist.barrier(group)  # both ranks start together: the exchange times are not the other's late start
        spent.append(0.0)
        start = time.perf_counter()
        block_step(block, x, g)
        if index >= args.warmup:
            steps.append(time.perf_counter() - start)
            exchanges.append(spent[-1])
    routed = block.router(x.reshape(-1, args.hidden)).tokens_per_expert.tolist()
    return {"step": statistics.median(steps), "all_to_all": statistics.median(exchanges), "routed": routed}


def report_expert_parallel(args: argparse.Namespace, single_s: float) -> None:
    from tests.distributed import run_distributed

    per_rank = run_distributed(2, _ep_worker, args)
    print(f"EP 2, 2 processes (gloo), each {args.batch} x {args.seq} tokens of its own and {args.experts // 2} "
          f"experts; median of {args.repeats} after {args.warmup} warm-up")
    for rank, result in enumerate(per_rank):
        print(f"  rank {rank}: forward + backward {result['step'] * 1e3:8.1f} ms, inside all-to-all "
              f"{result['all_to_all'] * 1e3:7.1f} ms = {100 * result['all_to_all'] / result['step']:4.1f}%   "
              f"(assignments per expert {result['routed']})")
    slowest = max(per_rank, key=lambda result: result["step"])
    print(f"EP 2 step {slowest['step'] * 1e3:.1f} ms (slower rank), all-to-all share "
          f"{100 * slowest['all_to_all'] / slowest['step']:.1f}%; EP 1 above {single_s * 1e3:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    single_s = report_single(args)
    if not args.no_ep:
        report_expert_parallel(args, single_s)
    print(f"benchmark wall time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
