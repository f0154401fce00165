"""train.py under the real launchers of the design card, on CPU processes (the rest of the suite starts its ranks from
a warm process with the launcher's environment, tests/warm_launch.py; these runs prove the launchers themselves, and
that the warm start is the real thing).

- ``deepspeed --hostfile HOSTS train.py ...`` with a one-node hostfile (``localhost slots=4``): the reference.
- torchrun (``python -m torch.distributed.run --nproc_per_node 4``), which passes no --local_rank: the same run.
- The tests' warm start (tests/launch.py run_training): the same run, bitwise.
- Two nodes on one machine: two ``deepspeed.launcher.launch`` processes, started exactly as DeepSpeed's multi-node
  runner starts one on each node over pdsh (the same base64 world info, master address and port; node_rank 0 and
  1; 2 ranks each). The ranks find each other through MASTER_ADDR:PORT as they would across machines, and the run
  must be the single-node run: the same rank -> (TP, PP, DP) map, bitwise the same losses, the same checkpoint.
- A rank whose master never answers stops within training.rendezvous_timeout_s, naming MASTER_ADDR:PORT.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import free_port
from tests.launch import (
    ROOT,
    final_weights,
    launcher_env,
    node_launcher,
    run_training,
    same_weights,
    train_arguments,
    trajectory,
)

STEPS = 2
TP2_PP2 = ["parallelism.tensor_parallel_size=2", "parallelism.pipeline_parallel_size=2"]
# Not anchored at a line start: another rank's write of more than PIPE_BUF bytes (DeepSpeed's config dump) is not
# atomic, so a rank's one-write line can land in the middle of it. The line itself is one small write and stays whole.
RANK_LINE = re.compile(r"rank (\d+) of 4 on \S+ \(local rank (\d+)\): (TP \d/2 PP \d/2 DP \d/1)")


def rank_map(output: str) -> dict[int, tuple[int, str]]:
    """{rank: (local rank, "TP a/2 PP b/2 DP c/1")} from the line each rank prints once it has its place."""
    return {int(rank): (int(local), where) for rank, local, where in RANK_LINE.findall(output)}


def checkpoint_files(save: Path) -> list[str]:
    tag = (save / "latest").read_text()
    return sorted(path.name for path in (save / tag).iterdir())


@pytest.fixture(scope="module")
def hostfile_run(corpus, tmp_path_factory) -> tuple[Path, str]:
    """deepspeed --hostfile hosts ... on one node with 4 slots (the launcher's own ssh check needs no_ssh_check on a
    machine that cannot ssh to itself; a real cluster keeps it)."""
    work = tmp_path_factory.mktemp("hostfile")
    hosts = work / "hosts"
    hosts.write_text("localhost slots=4\n")
    save = work / "checkpoints"
    deepspeed = Path(sys.executable).parent / "deepspeed"
    command = [str(deepspeed), "--hostfile", str(hosts), "--no_ssh_check", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *train_arguments(corpus, save, STEPS, TP2_PP2)]
    result = subprocess.run(command, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return save, result.stdout + result.stderr


@pytest.mark.distributed
def test_the_real_deepspeed_command_with_a_hostfile_trains_and_checkpoints(hostfile_run):
    save, output = hostfile_run
    assert [step for step, *_ in trajectory(save)] == [1, 2]
    assert (save / "latest").read_text() == "global_step2"
    assert rank_map(output) == {0: (0, "TP 0/2 PP 0/2 DP 0/1"), 1: (1, "TP 1/2 PP 0/2 DP 0/1"),
                                2: (2, "TP 0/2 PP 1/2 DP 0/1"), 3: (3, "TP 1/2 PP 1/2 DP 0/1")}
    assert "c10d::broadcast_" not in output and "all_gather_into_tensor` is deprecated" not in output
    assert "written by process" in output and "(forked at start-up)" in output  # train.py's fork_early


def launch_node(node_rank: int, world_info: dict[str, list[int]], port: int, arguments: list[str]
                ) -> subprocess.Popen:
    """What DeepSpeed's PDSHRunner runs on node ``node_rank`` (deepspeed/launcher/multinode_runner.py)."""
    return subprocess.Popen(node_launcher(world_info, node_rank, port, arguments), cwd=ROOT, env=launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def same_run(save: Path, reference: Path) -> None:
    """Bitwise the same run: losses, learning rates and batches, the checkpoint's files, weights, and the fp32
    master weights and Adam moments of every rank."""
    assert trajectory(save) == trajectory(reference)
    assert checkpoint_files(save) == checkpoint_files(reference)
    assert same_weights(final_weights(save), final_weights(reference))
    tag = (save / "latest").read_text()
    for name in checkpoint_files(save):
        if name.startswith("zero_pp_rank"):  # the fp32 master weights and Adam moments of every rank
            ours = torch.load(save / tag / name, weights_only=False)["optimizer_state_dict"]
            theirs = torch.load(reference / tag / name, weights_only=False)["optimizer_state_dict"]
            assert torch.equal(_flat_states(ours), _flat_states(theirs)), name


@pytest.mark.distributed
def test_torchrun_trains_as_the_real_deepspeed_command(corpus, hostfile_run, tmp_path):
    """torchrun sets LOCAL_RANK and passes no --local_rank: the same ranks in the same places, the same run."""
    reference, reference_output = hostfile_run
    save = tmp_path / "checkpoints"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *train_arguments(corpus, save, STEPS, TP2_PP2)]
    result = subprocess.run(command, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert rank_map(result.stdout + result.stderr) == rank_map(reference_output)
    same_run(save, reference)


@pytest.mark.distributed
def test_the_tests_warm_start_equals_the_real_deepspeed_command(corpus, hostfile_run, tmp_path):
    """The ranks the rest of the suite forks from its warm process (tests/warm_launch.py) get what the launcher
    gives: the same ranks, local ranks and places, and bitwise the same run."""
    reference, reference_output = hostfile_run
    save = tmp_path / "checkpoints"
    result = run_training(corpus, save, STEPS, TP2_PP2)
    assert result.args[0] == "warm"
    assert rank_map(result.stdout + result.stderr) == rank_map(reference_output)
    assert "(forked at start-up)" in result.stdout  # the warm rank's checkpoint writer: no torch import of its own
    same_run(save, reference)


@pytest.mark.distributed
def test_two_real_node_launchers_train_as_one_node(corpus, hostfile_run, tmp_path):
    reference, reference_output = hostfile_run
    save = tmp_path / "checkpoints"
    world_info = {"node-a": [0, 1], "node-b": [0, 1]}
    port = free_port()
    arguments = train_arguments(corpus, save, STEPS, TP2_PP2)
    nodes = [launch_node(node_rank, world_info, port, arguments) for node_rank in (1, 0)]  # node 1 starts first
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-4000:]
    ranks = rank_map("".join(outputs))
    # Ranks 0-1 on node 0 and 2-3 on node 1, local ranks 0-1 on each; the same place in the grid as on one node.
    assert {rank: local for rank, (local, _) in ranks.items()} == {0: 0, 1: 1, 2: 0, 3: 1}
    assert {rank: where for rank, (_, where) in ranks.items()} == \
        {rank: where for rank, (_, where) in rank_map(reference_output).items()}
    same_run(save, reference)


def _flat_states(optimizer_state: dict) -> torch.Tensor:
    tensors = [value for value in optimizer_state["single_partition_of_fp32_groups"]]
    for state in optimizer_state["base_optimizer_state"]["state"].values():
        tensors += [state["exp_avg"], state["exp_avg_sq"]]
    return torch.cat([t.flatten().float() for t in tensors])


def test_an_unreachable_master_stops_in_bounded_time_naming_it(corpus, tmp_path):
    """Rank 1 of 2 whose rank 0 never starts: nothing listens at the master's port."""
    port = free_port()
    env = {**launcher_env(), "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    arguments = train_arguments(corpus, tmp_path / "checkpoints", STEPS,
                                ["parallelism.pipeline_parallel_size=1", "training.rendezvous_timeout_s=3"])
    start = time.monotonic()
    result = subprocess.run([sys.executable, *arguments], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"cannot reach the master at MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port} within 3 s" in result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 120  # start-up (imports, dataset checks) plus the 3 s; torch alone would wait 30 minutes
