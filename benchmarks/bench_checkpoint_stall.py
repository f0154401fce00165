#!/usr/bin/env python
"""How long a checkpoint stops training, "sync" against "async" (training/checkpoint_engine.py), and what the
background writer costs the training loop meanwhile.

    python benchmarks/bench_checkpoint_stall.py [--hidden 512] [--layers 4] [--saves 4] [--ranks 1]
                                                [--loop-mb 400] [--rounds 3] [--directory DIR] [--only stall|loop]

    part    what runs                                     what is printed
    stall   --ranks (PP, fp32, ZeRO-1) train a GPT        per mode, the first save and the later ones apart (the
            (--hidden, --layers; GPT-2's vocabulary),      median of saves 2..--saves): training stopped (the seconds
            --saves checkpoints, each followed by steps    save() holds the training thread), the steps slowed (what
            until `latest` names it, then 2 more           the steps after it, to `latest` and 2 more, took over the
                                                          median step), the seconds until `latest` names it, the host
                                                          buffers allocated and their bytes; the ratio async / sync
                                                          of training stopped (goal <= 0.1) and of stopped + slowed
    loop    one process, torch threads 1, two loops:       the step time with nothing beside the loop, then beside:
            an MLP in cache (compute-bound) and an         the engine's writer thread (the GIL shared), a forked
            output layer over GPT-2's vocabulary           process writing the same snapshot (no GIL; the loop's
            (memory-bound); their state and --loop-mb      pages copy-on-write), a spawned process spinning (CPU
            of other tensors saved                         only) and one copying as many bytes (memory only);
                                                          --rounds interleaved rounds; then the share of its time
                                                          a pure-Python thread loses while the writer thread writes
                                                          --loop-mb (the GIL the writer holds)

The four neighbours separate what a writer costs the loop: the GIL (thread against process), the CPU (spinning) and
the memory bus (copying). Checkpoints go to --directory (default: a temporary folder under /tmp).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


# -- part 1: the stall of a save, --ranks ranks -----------------------------------------------------------------------
def measure_stall(directory: str, hidden: int, layers: int, saves: int, ranks: int) -> dict:
    import torch.distributed as dist

    from runconfig.run import parse_run_config
    from tests.test_model_parallel import deepspeed_config, micro_batches
    from training.checkpoint import Checkpointer
    from training.engine import build_engine

    raw = {**deepspeed_config("fp32"), "model": {"preset": "tiny", "num_layers": layers, "hidden_size": hidden,
                                                  "num_attention_heads": hidden // 64, "seq_length": 64},
           "parallelism": {"tensor_parallel_size": 1, "pipeline_parallel_size": ranks},
           "schedule": {"lr": 3e-3, "warmup_tokens": 0, "decay_tokens": 1e6, "train_tokens": 1e9}}
    config = parse_run_config(raw)
    engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, 1234)
    counter = iter(range(10**9))

    def step() -> float:
        start = time.perf_counter()
        engine.train_batch(data_iter=micro_batches(next(counter), 64, 0, 1))
        return time.perf_counter() - start

    results: dict = {"ranks": ranks}
    for mode in ("sync", "async"):
        save_dir = Path(directory) / mode
        checkpointer = Checkpointer(engine, save_dir, mode)
        buffers = checkpointer.files.buffers
        plain = [step() for _ in range(5)]
        per_save = []
        for number in range(saves):
            tag = f"global_step{1000 * (mode == 'async') + number + 1}"
            allocations, allocated = buffers.allocations, buffers.allocated_bytes
            dist.barrier()
            start = time.perf_counter()
            checkpointer.save(int(tag.removeprefix("global_step")), {"train_state": {}})
            blocked = time.perf_counter() - start
            timed, moved = [blocked], blocked if mode == "sync" else None  # sync commits inside save()
            while moved is None:  # steps until every writer is done and `latest` names the checkpoint
                timed.append(step())
                if checkpointer.poll() is not None:
                    moved = time.perf_counter() - start
            timed += [step() for _ in range(2)]  # the commit's step may have paid for it: counted, then 2 more
            plain += [step() for _ in range(3)]
            per_save.append({"blocked": blocked, "latest": moved,
                             "stall": sum(timed) - (len(timed) - 1) * statistics.median(plain),
                             "allocations": buffers.allocations - allocations,
                             "allocated": buffers.allocated_bytes - allocated})
        checkpointer.close()
        files = [p for p in (save_dir / tag).iterdir() if p.is_file()]
        results[mode] = {"saves": per_save, "median_step": statistics.median(plain),
                         "bytes": sum(p.stat().st_size for p in files)}
    return results


def report_stall(results: dict, saves: int) -> None:
    ranks = results["ranks"]
    print(f"stall: a checkpoint of {results['sync']['bytes'] / 1e6:,.0f} MB (rank 0's files) on {ranks} rank(s) "
          f"(PP {ranks}, fp32, ZeRO-1) on {os.cpu_count()} cores; median "
          f"step {results['sync']['median_step']:.2f} s; rank 0; later saves: the median of saves 2..{saves}")
    print(f"{'mode':<6} {'saves':<7} {'training stopped, s':>20} {'steps slowed, s':>16} {'until latest, s':>16} "
          f"{'buffers allocated':>18} {'MB allocated':>13}")
    later = {}
    for mode in ("sync", "async"):
        first, rest = results[mode]["saves"][0], results[mode]["saves"][1:]
        rows = [("first", first)]
        if rest:
            rows.append(("later", {key: statistics.median(save[key] for save in rest) for key in first}))
        for name, row in rows:
            print(f"{mode:<6} {name:<7} {row['blocked']:>20.2f} {row['stall'] - row['blocked']:>16.2f} "
                  f"{row['latest']:>16.2f} {row['allocations']:>18.0f} {row['allocated'] / 1e6:>13.1f}")
        later[mode] = rows[-1][1]
    stopped = later["async"]["blocked"] / later["sync"]["blocked"]
    total = later["async"]["stall"] / later["sync"]["stall"] if later["sync"]["stall"] > 0 else float("nan")
    print(f"training stopped, async / sync (later saves): {stopped:.3f} (goal <= 0.1); with the steps slowed while "
          f"the files are written and committed: {total:.3f}")


# -- part 2: the loop while the writer writes, one process ----------------------------------------------------------
LOOPS = {"mlp": "an MLP (8 x 256 x 256, batch 32, Adam): in cache, compute-bound",
         "head": "an output layer (64 tokens x 512 -> 50,304 logits, log-softmax, backward): memory-bound"}
WRITERS = {"none": "none", "thread": "thread (training process)", "process": "process (forked)",
           "spin": "CPU only (spawned, spinning)", "copy": "memory only (spawned, copying)"}


def _loop_step(kind: str) -> tuple[Callable[[], float], dict]:
    """One training step of the ``kind`` loop (LOOPS) and its state to save."""
    import torch

    if kind == "mlp":
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                                      for _ in range(8)])
        batch = torch.randn(32, 256)
    else:
        model, batch = torch.nn.Linear(512, 50304, bias=False), torch.randn(64, 512)
    optimizer = torch.optim.Adam(model.parameters())

    def step() -> float:
        start = time.perf_counter()
        model(batch).log_softmax(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    return step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _spin(ready, go, seconds: float) -> None:
    ready.set()
    go.wait()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _copy(ready, go, nbytes: int, passes: int) -> None:
    """What the writer does to memory without the disk: ``passes`` reads of ``nbytes`` and one write of them."""
    import torch

    torch.set_num_threads(1)
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    target.fill_(0)  # both touched before the clock starts: no page faults counted
    ready.set()
    go.wait()
    for _ in range(passes - 1):
        source.sum()
    target.copy_(source)


def _beside(target: Callable, args: tuple, step: Callable[[], float]) -> tuple[list[float], float]:
    """Steps while a spawned process (its own memory: no copy-on-write of the loop's pages) runs ``target``, from
    the moment it is ready; and how long it ran."""
    spawn = multiprocessing.get_context("spawn")
    ready, go = spawn.Event(), spawn.Event()
    process = spawn.Process(target=target, args=(ready, go, *args))
    process.start()
    ready.wait()
    start = time.perf_counter()
    go.set()
    steps = [step() for _ in iter(process.is_alive, False)]
    elapsed = time.perf_counter() - start
    process.join()
    return steps, elapsed


def measure_loop(directory: str, loop_mb: int, rounds: int, kind: str) -> dict:
    """The ``kind`` loop's steps with no writer, then beside each of WRITERS, --rounds interleaved rounds. The forked
    writer shares the loop's pages copy-on-write: each page the loop writes while it lives is copied. The spinning
    process runs as long as the thread's write took; the copying one reads as many bytes as the snapshot 3 times
    (torch's CRC-32, the engine's, the kernel's copy into the page cache) and writes them once."""
    import torch

    from training.checkpoint_engine import HostBuffers, SnapshotCheckpointEngine, host_snapshot, write_file

    torch.set_num_threads(1)
    torch.manual_seed(0)
    step, state = _loop_step(kind)
    state["other"] = {f"tensor_{i}": torch.randn(loop_mb * 2**20 // 16) for i in range(4)}  # loop_mb MB, fp32
    engine, process_buffers = SnapshotCheckpointEngine("async"), HostBuffers()
    times: dict[str, list[float]] = {writer: [] for writer in WRITERS}
    writes: dict[str, list[float]] = {writer: [] for writer in WRITERS if writer != "none"}
    fork = multiprocessing.get_context("fork")
    [step() for _ in range(10)]
    for number in range(rounds + 1):  # round 0 allocates the buffers and warms the page cache: not counted
        plain = [step() for _ in range(max(10, int(2.0 / statistics.median([step() for _ in range(3)]))))]
        folder = Path(directory) / f"{kind}{number}"
        folder.mkdir()
        start = time.perf_counter()
        engine.save(state, str(folder / "thread.pt"))
        engine.start()
        during = {"thread": [step() for _ in iter(lambda: engine.finished, True)]}
        elapsed = {"thread": time.perf_counter() - start}
        engine.wait()
        engine.forget()
        snapshot = host_snapshot(state, process_buffers, ("process.pt",))
        process_buffers.end_save()
        start = time.perf_counter()
        writer = fork.Process(target=write_file, args=(snapshot, folder / "process.pt"))
        writer.start()  # forked: it reads the snapshot it inherited, nothing is pickled over
        during["process"] = [step() for _ in iter(writer.is_alive, False)]
        elapsed["process"] = time.perf_counter() - start
        writer.join()
        nbytes = sum(buffer.nbytes() for buffer, _ in process_buffers.storages.values())
        during["spin"], elapsed["spin"] = _beside(_spin, (elapsed["thread"],), step)
        during["copy"], elapsed["copy"] = _beside(_copy, (nbytes, 3), step)
        if number > 0:
            times["none"] += plain
            for writer, steps in during.items():
                times[writer] += steps
                writes[writer].append(elapsed[writer])
    engine.cleanup()
    return {"kind": kind, "times": times, "writes": writes,
            "bytes": (Path(directory) / f"{kind}0" / "thread.pt").stat().st_size}


def report_loop(results: dict, rounds: int) -> None:
    times, writes = results["times"], results["writes"]
    plain_mean = statistics.mean(times["none"])
    print(f"loop: one process, torch threads 1, {LOOPS[results['kind']]}; saving {results['bytes'] / 1e6:,.0f} MB; "
          f"{rounds} rounds")
    print(f"{'beside the loop':<30} {'runs, s':>8} {'steps':>6} {'median step, ms':>16} {'mean step, ms':>14} "
          f"{'longest, ms':>12} {'mean vs none':>13}")
    for kind, name in WRITERS.items():
        write = f"{statistics.median(writes[kind]):.2f}" if kind in writes else "-"
        mean = statistics.mean(times[kind]) if times[kind] else float("nan")
        median = statistics.median(times[kind]) if times[kind] else float("nan")
        longest = max(times[kind], default=float("nan"))
        print(f"{name:<30} {write:>8} {len(times[kind]):>6} {median * 1e3:>16.2f} {mean * 1e3:>14.2f} "
              f"{longest * 1e3:>12.1f} {mean / plain_mean - 1:>+13.1%}")
    gil = (statistics.mean(times["thread"]) - statistics.mean(times["process"])) / plain_mean
    print(f"what the GIL costs the loop (thread - process, mean step over none): {gil:+.1%}")


def measure_gil(directory: str, loop_mb: int) -> dict:
    """A pure-Python thread (it needs the GIL all the time) counts its loop's turns per second with nothing else
    running, and while the engine's writer thread writes --loop-mb: the turns lost are the share of time the writer
    held the GIL (on a loaded machine, plus the CPU taken by others: hence the idle figure)."""
    import torch

    from training.checkpoint_engine import SnapshotCheckpointEngine

    state = {f"tensor_{i}": torch.randn(loop_mb * 2**20 // 16) for i in range(4)}
    engine = SnapshotCheckpointEngine("async")

    def turns_per_second(busy: Callable[[], bool]) -> float:
        start, turns = time.perf_counter(), 0
        while busy():
            turns += 1
        return turns / (time.perf_counter() - start)

    until = time.perf_counter() + 2.0
    results = {"none": turns_per_second(lambda: time.perf_counter() < until)}
    for number in range(2):  # the first save allocates the buffers: only the second is counted
        (Path(directory) / f"gil{number}").mkdir()
        engine.save(state, str(Path(directory) / f"gil{number}" / "state.pt"))
        engine.start()
        results["writer"] = turns_per_second(lambda: not engine.finished)
        engine.wait()
        engine.forget()
    engine.cleanup()
    return results


def report_gil(results: dict, loop_mb: int) -> None:
    lost = 1 - results["writer"] / results["none"]
    print(f"GIL: a pure-Python thread's turns per second, alone {results['none'] / 1e6:.2f} M, while the writer thread "
          f"writes {4 * (loop_mb // 4)} MB {results['writer'] / 1e6:.2f} M: {lost:.0%} of its time lost to the writer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--loop-mb", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("stall", "loop"))
    parser.add_argument("--ranks", type=int, default=1,
                        help="training processes (PP): 1 leaves the writer a core of its own on 2 cores, as a GPU node "
                             "leaves each rank spare cores; 2 on 2 cores gives it none, and the async stall is then "
                             "the writer's CPU time taken from training")
    parser.add_argument("--directory", help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    from tests.distributed import run_distributed

    with tempfile.TemporaryDirectory(dir=args.directory) as directory:
        if args.only != "loop":
            results = run_distributed(args.ranks, measure_stall, directory, args.hidden, args.layers, args.saves,
                                      args.ranks, timeout_s=3600)[0]
            report_stall(results, args.saves)
        if args.only != "stall":
            for kind in LOOPS:
                report_loop(measure_loop(directory, args.loop_mb, args.rounds, kind), args.rounds)
            report_gil(measure_gil(directory, args.loop_mb), args.loop_mb)


if __name__ == "__main__":
    main()
