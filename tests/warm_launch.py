"""train.py's ranks started from a warm process: what DeepSpeed's per-node launcher does, without the 5-10 s a launch
spends starting Python processes that import torch, DeepSpeed and the project again.

``python -m deepspeed.launcher.launch`` (deepspeed/launcher/launch.py, 0.19.8) starts one ``python -u train.py
--local_rank=N ...`` per local rank, each with the launcher's environment plus RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR, MASTER_PORT and the accelerator's visible-devices variable, and its
output going where the launcher's does; when a rank exits non-zero it terminates the others and exits with that
rank's code. ``launch`` does the same with the ranks forked from the suite's server process
(tests/distributed.py, which has imported torch, DeepSpeed and the project's training modules once): each rank
takes the same environment, working directory and arguments, runs train.py as ``__main__``, and writes to the
same two files as its peers (stdout and stderr, appended as a pipe would interleave them). What it returns is what
``subprocess.run`` returns for the launcher.

The real launchers keep their own tests: tests/test_launchers.py (``deepspeed --num_gpus``, the hostfile, torchrun,
the multi-node rendezvous) and tests/test_faults.py (a rank's SIGTERM and SIGKILL, relaunches): see docs/testing.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rank(rank: int, world_size: int, port: int, env: dict[str, str], cwd: str, arguments: list[str], stdout: str,
          stderr: str) -> None:
    """One rank, in a process forked from the warm server: the launcher's environment and output, then train.py."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_SIZE": str(world_size), "CROSS_RANK": "0", "CROSS_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(world_size)))})
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(target, fd)
        os.close(target)
    for stream in (sys.stdout, sys.stderr):  # python -u: every write goes out at once
        stream.reconfigure(line_buffering=True, write_through=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a fresh interpreter's dispositions, not the server's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    script = arguments[0]
    sys.argv = [script, f"--local_rank={rank}", *arguments[1:]]
    # as a fresh interpreter's: the script's folder, then PYTHONPATH's entries (a test may hide a package with one)
    python_path = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:1] = [str(Path(script).resolve().parent), *python_path]
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")  # train.py ends with os._exit(main()) once its files are written
    except SystemExit as exit_:
        code = exit_.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
        status = 0 if code is None else code if isinstance(code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _terminate(processes) -> None:
    """What the launcher's sigkill_handler does to the ranks still running: SIGTERM, then SIGKILL after 30 s."""
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    deadline = time.monotonic() + 30
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()


def launch(arguments: list[str], processes: int, port: int, env: dict[str, str], timeout: float,
           cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``processes`` ranks of ``arguments`` (the script and its arguments) on one node, as the launcher starts them;
    the launcher's exit status, output and error output. A run past ``timeout`` seconds raises
    subprocess.TimeoutExpired, as subprocess.run does, once its ranks are ended."""
    from tests.distributed import start_context

    context = start_context()
    with tempfile.TemporaryDirectory() as folder:
        stdout, stderr = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        ranks = [context.Process(target=_rank, args=(rank, processes, port, env, str(cwd), arguments,
                                                                    stdout, stderr))
                 for rank in range(processes)]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + timeout
        status = 0
        while any(process.exitcode is None for process in ranks):
            failed = [process.exitcode for process in ranks if process.exitcode not in (None, 0)]
            if failed:
                status = failed[0] % 256  # the launcher's sys.exit(code): a signal's -N becomes 256 - N
                _terminate(ranks)
                break
            if time.monotonic() > deadline:
                _terminate(ranks)
                raise subprocess.TimeoutExpired(arguments, timeout)
            time.sleep(0.1)
        else:
            status = next((process.exitcode % 256 for process in ranks if process.exitcode != 0), 0)
        for process in ranks:
            process.join()
        return subprocess.CompletedProcess(["warm", *arguments], status, Path(stdout).read_text() if
                                           os.path.exists(stdout) else "",
                                           Path(stderr).read_text() if os.path.exists(stderr) else "")
