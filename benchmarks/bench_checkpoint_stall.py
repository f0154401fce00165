#!/usr/bin/env python
"""How long a checkpoint stops training, "sync" against "async" (training/checkpoint_engine.py), and what the
writer process costs the training loop meanwhile.

    python benchmarks/bench_checkpoint_stall.py [--hidden 512] [--layers 4] [--saves 4] [--ranks 1]
                                                [--loop-mb 400] [--rounds 3] [--directory DIR] [--only stall|loop|gil]

    part    what runs                                     what is printed
    stall   --ranks (PP, fp32, ZeRO-1) train a GPT        per mode, the first save and the later ones apart (the
            (--hidden, --layers; GPT-2's vocabulary),      median of saves 2..--saves): training stopped (the seconds
            --saves checkpoints (the host buffers           save() holds the training thread), the steps slowed (what
            allocated before, by the trainer's             the steps after it, to `latest` and 2 more, took over the
            rehearsals), each followed by steps until      median step), the seconds until `latest` names it, the host
            `latest` names it, then 2 more                 buffers allocated and their bytes; the ratio async / sync
                                                          of training stopped (goal <= 0.1) and of stopped + slowed,
                                                          first and later saves; the writer process's CPU seconds
                                                          per save
    loop    one process, torch threads 1, two loops:       the step time with nothing beside the loop, then beside:
            an MLP in cache (compute-bound) and an         the engine's writer process (spawned, reading the shared
            output layer over GPT-2's vocabulary           buffers), a forked process writing the same snapshot
            (memory-bound); their state and --loop-mb
            of other tensors saved
                                                          (the loop's pages copy-on-write), a spawned process
                                                          spinning (CPU only) and one copying as many bytes (memory
                                                          only); --rounds interleaved rounds; then the share of its
                                                          time a pure-Python thread loses while the engine writes
                                                          --loop-mb: with its writer process, and with the writer
                                                          in a thread of the training process (the design before
                                                          it, sharing the GIL)

The four neighbours separate what a writer costs the loop: the writer's process against a forked one, the CPU
(spinning) and the memory bus (copying). Checkpoints go to --directory (default: a temporary folder under /tmp).
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
    import torch
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

    results: dict = {"ranks": ranks, "threads": torch.get_num_threads()}
    for mode in ("sync", "async"):
        save_dir = Path(directory) / mode
        checkpointer = Checkpointer(engine, save_dir, mode)
        buffers = checkpointer.files.buffers
        checkpointer.rehearse({"train_state": {}})  # as the trainer does: before its first step and after it
        plain = [step()]
        checkpointer.rehearse({"train_state": {}})
        plain += [step() for _ in range(4)]
        per_save = []
        for number in range(saves):
            tag = f"global_step{1000 * (mode == 'async') + number + 1}"
            allocations, allocated = buffers.allocations, buffers.allocated_bytes
            writer_cpu = checkpointer.files.writer.cpu_seconds()
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
                             "allocated": buffers.allocated_bytes - allocated,
                             "writer_cpu": checkpointer.files.writer.cpu_seconds() - writer_cpu})
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
    rows: dict[str, dict[str, dict]] = {}
    for mode in ("sync", "async"):
        first, rest = results[mode]["saves"][0], results[mode]["saves"][1:]
        rows[mode] = {"first": first}
        if rest:
            rows[mode]["later"] = {key: statistics.median(save[key] for save in rest) for key in first}
        for name, row in rows[mode].items():
            print(f"{mode:<6} {name:<7} {row['blocked']:>20.2f} {row['stall'] - row['blocked']:>16.2f} "
                  f"{row['latest']:>16.2f} {row['allocations']:>18.0f} {row['allocated'] / 1e6:>13.1f}")
    for name in rows["async"]:
        sync, run = rows["sync"][name], rows["async"][name]
        stopped = run["blocked"] / sync["blocked"]
        total = run["stall"] / sync["stall"] if sync["stall"] > 0 else float("nan")
        print(f"training stopped, async / sync ({name} saves): {stopped:.3f} (goal <= 0.1); with the steps slowed "
              f"while the files are written and committed: {total:.3f} (goal <= 0.1)")
    cpu = {mode: {name: row["writer_cpu"] for name, row in rows[mode].items()} for mode in rows}
    print("the writer process's CPU seconds per save (user + system): " + "; ".join(
        f"{mode} {name} {seconds:.2f} s" for mode in cpu for name, seconds in cpu[mode].items()))
    # The writer's CPU comes out of the training only where the training leaves no core free: then each of its CPU
    # seconds is one core-second of the training's busy cores, and the steps lose it spread over those cores.
    cores, threads = os.cpu_count() or 1, results["threads"] * ranks
    competing = max(0, min(1, threads + 1 - cores))  # 0: a core is free for the writer
    for name, row in rows["async"].items():
        taken = row["writer_cpu"] * competing / min(threads, cores)
        rest = (row["stall"] - taken) / rows["sync"][name]["stall"]
        print(f"async {name} saves: the training runs {results['threads']} thread(s) x {ranks} rank(s) on {cores} "
              f"cores, {'no core' if competing else 'a core'} free for the writer: its CPU takes {taken:.2f} s of the "
              f"steps; stopped + slowed less that, async / sync: {rest:.3f}")


# -- part 2: the loop while the writer writes, one process ----------------------------------------------------------
LOOPS = {"mlp": "an MLP (8 x 256 x 256, batch 32, Adam): in cache, compute-bound",
         "head": "an output layer (64 tokens x 512 -> 50,304 logits, log-softmax, backward): memory-bound"}
WRITERS = {"none": "none", "engine": "the engine's writer process", "process": "process (forked)",
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
    process runs as long as the engine's write took; the copying one reads as many bytes as the snapshot 3 times
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
        engine.save(state, str(folder / "engine.pt"))
        engine.start()
        during = {"engine": [step() for _ in iter(lambda: engine.finished, True)]}
        elapsed = {"engine": time.perf_counter() - start}
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
        during["spin"], elapsed["spin"] = _beside(_spin, (elapsed["engine"],), step)
        during["copy"], elapsed["copy"] = _beside(_copy, (nbytes, 3), step)
        if number > 0:
            times["none"] += plain
            for writer, steps in during.items():
                times[writer] += steps
                writes[writer].append(elapsed[writer])
    engine.cleanup()
    return {"kind": kind, "times": times, "writes": writes,
            "bytes": (Path(directory) / f"{kind}0" / "engine.pt").stat().st_size}


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
    gil = (statistics.mean(times["engine"]) - statistics.mean(times["process"])) / plain_mean
    print(f"the engine's writer against a forked one (mean step over none): {gil:+.1%}")


def measure_gil(directory: str, loop_mb: int, rounds: int = 3) -> dict:
    """A pure-Python thread (it needs the GIL all the time) counts its loop's turns per second with nothing else
    running, and while the engine writes --loop-mb: with its writer process ("process"), and with the files written
    by its hand-over thread itself, in the training process ("thread": the design before the writer process). The
    turns lost are the share of time the writer held the GIL, plus, on a loaded machine, the CPU taken by others:
    hence the idle figure, measured before each write, and the thread's wall time split by the kernel's schedstat
    into on a CPU, waiting for one (the machine's other jobs, the writer's own CPU) and blocked (the GIL). Also the
    writer process's CPU seconds per write."""
    import threading

    import torch

    from training.checkpoint_engine import SnapshotCheckpointEngine, write_file

    state = {f"tensor_{i}": torch.randn(loop_mb * 2**20 // 16) for i in range(4)}
    engines = {"process": SnapshotCheckpointEngine("async"), "thread": SnapshotCheckpointEngine("async")}
    engines["thread"].write_file = write_file  # torch.save in the training process, as before

    def schedstat() -> tuple[float, float]:
        """This thread's seconds on a CPU and waiting in a run queue so far."""
        on_cpu, waiting, _ = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9

    def turns_per_second(busy: Callable[[], bool]) -> tuple[float, float, float]:
        """Turns per second, and the shares of the wall time waiting for a CPU and blocked."""
        start, turns, (on_cpu, waiting) = time.perf_counter(), 0, schedstat()
        while busy():
            turns += 1
        wall, (on_cpu_end, waiting_end) = time.perf_counter() - start, schedstat()
        queued = (waiting_end - waiting) / wall
        return turns / wall, queued, max(0.0, 1 - (on_cpu_end - on_cpu) / wall - queued)

    def alone() -> tuple[float, float, float]:
        until = time.perf_counter() + 2.0
        return turns_per_second(lambda: time.perf_counter() < until)

    results: dict[str, list] = {"none": [], "process": [], "thread": [], "writer_cpu": []}
    for number in range(rounds + 1):  # round 0 allocates the buffers and warms the page cache: not counted
        for name, engine in engines.items():
            folder = Path(directory) / f"gil{number}{name}"
            folder.mkdir()
            none, cpu = alone(), engines["process"].writer.cpu_seconds()
            engine.save(state, str(folder / "state.pt"))
            engine.start()
            during = turns_per_second(lambda engine=engine: not engine.finished)
            engine.wait()
            engine.forget()
            if number > 0:
                results["none"].append(none)
                results[name].append(during)
                if name == "process":
                    results["writer_cpu"].append(engines["process"].writer.cpu_seconds() - cpu)
    for engine in engines.values():
        engine.cleanup()
    return {"writer_cpu": statistics.mean(results.pop("writer_cpu")),
            **{key: [statistics.mean(column) for column in zip(*rows, strict=True)] for key, rows in results.items()}}


def report_gil(results: dict, loop_mb: int) -> None:
    lost = {name: 1 - results[name][0] / results["none"][0] for name in ("process", "thread")}
    print(f"GIL: a pure-Python thread's turns per second, alone {results['none'][0] / 1e6:.2f} M, while the writer process "
          f"writes {4 * (loop_mb // 4)} MB {results['process'][0] / 1e6:.2f} M: {lost['process']:.0%} of its time lost to "
          f"the writer (goal <= 5%; it used {results['writer_cpu']:.2f} s of CPU a write); with the writer a thread of "
          f"the training process {results['thread'][0] / 1e6:.2f} M: {lost['thread']:.0%}")
    print("      of the pure-Python thread's wall time: " + "; ".join(
        f"{name} waiting for a CPU {results[key][1]:.0%}, blocked (the GIL) {results[key][2]:.0%}"
        for key, name in (("none", "alone"), ("process", "beside the writer process"),
                          ("thread", "beside a writer thread"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--loop-mb", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("stall", "loop", "gil"), help="one part (loop: its GIL measure too)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="training processes (PP): 1 leaves the writer a core of its own on 2 cores, as a GPU node "
                             "leaves each rank spare cores; 2 on 2 cores gives it none, and the async stall is then "
                             "the writer's CPU time taken from training")
    parser.add_argument("--directory", help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    from tests.distributed import run_distributed

    with tempfile.TemporaryDirectory(dir=args.directory) as directory:
        if args.only in (None, "stall"):
            results = run_distributed(args.ranks, measure_stall, directory, args.hidden, args.layers, args.saves,
                                      args.ranks, timeout_s=3600)[0]
            report_stall(results, args.saves)
        if args.only in (None, "loop"):
            for kind in LOOPS:
                report_loop(measure_loop(directory, args.loop_mb, args.rounds, kind), args.rounds)
        if args.only != "stall":
            report_gil(measure_gil(directory, args.loop_mb, args.rounds), args.loop_mb)


if __name__ == "__main__":
    main()
