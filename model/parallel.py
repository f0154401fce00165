"""The explicit parallel context: sizes, ranks and process groups of the tensor x pipeline x data split.

Built once per process on DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model; the model axis,
tensor parallelism, varies fastest, so TP ranks are neighbours on a node) and passed to every layer that shards.
Nothing here is a module global.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from common import deepspeed_internals as ds_internals
from model.config import ParallelConfig


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits in the TP x PP x DP grid.

    ``tensor_parallel_group`` is None when no process group exists: TP 1, a single process, or a meta-device build
    of one rank of a large run (which runs no forward pass). The data-parallel and pipeline groups are DeepSpeed's:
    its PipelineParallelGrid (``engine.grid``) builds them and its engine is their only user.
    """

    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    pipeline_parallel_size: int = 1
    pipeline_parallel_rank: int = 0
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    tensor_parallel_group: Any = None
    topology: Any = None
    sequence_parallel: bool = False
    """Activations outside the TP matmuls hold seq_length / TP positions on each TP rank (model/layers.py)."""
    expert_parallel_size: int = 1
    expert_parallel_group: Any = None
    """EP > 1: DeepSpeed's expert-parallel group of this rank (EP consecutive data ranks with this rank's TP and PP
    coordinates), which every MoEBlock dispatches over; None at EP 1 (experts replicated over DP)."""
    context_parallel_size: int = 1
    context_parallel_rank: int = 0
    context_parallel_group: Any = None
    """CP > 1: the CP consecutive ranks of DeepSpeed's data axis with this rank's TP and PP coordinates, which read the
    same samples, each its own seq_length / CP positions, and meet in attention (Ulysses' all-to-all). The
    data-parallel size and rank above count the replicas of the batch (DP); DeepSpeed's data axis is DP x CP."""

    def __post_init__(self) -> None:
        for axis in ("tensor", "pipeline", "data", "context"):
            size = getattr(self, f"{axis}_parallel_size")
            rank = getattr(self, f"{axis}_parallel_rank")
            if not 0 <= rank < size:
                raise ValueError(f"{axis}_parallel_rank {rank} is outside [0, {size})")

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_parallel_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_parallel_rank == self.pipeline_parallel_size - 1

    @property
    def data_axis_size(self) -> int:
        """DeepSpeed's data-parallel world, DP x CP: the ranks its engine averages gradients over and ZeRO-1 shards."""
        return self.data_parallel_size * self.context_parallel_size

    def describe(self) -> str:
        return (f"TP {self.tensor_parallel_rank}/{self.tensor_parallel_size} "
                f"PP {self.pipeline_parallel_rank}/{self.pipeline_parallel_size} "
                f"DP {self.data_parallel_rank}/{self.data_parallel_size}"
                + (f" CP {self.context_parallel_rank}/{self.context_parallel_size}"
                   if self.context_parallel_size > 1 else "")
                + (", sequence parallel" if self.sequence_parallel else ""))


def silence_harmless_distributed_warnings() -> None:
    """Hide exactly two warnings that every step would print on every rank, burying the training log.

    - ``c10d::broadcast_: an autograd kernel was not registered ...`` (UserWarning, at each backward): on gloo,
      DeepSpeed's pipeline sends activations with ``dist.broadcast`` on the stage output, which requires grad. The
      in-place broadcast on the source rank leaves the tensor and its grad_fn as they were, so the backward that
      DeepSpeed runs from the received gradient flows through unchanged; the warning only says broadcast has no
      autograd formula. The gradients that cross stages are checked against the unsplit model by
      tests/test_model_parallel.py::test_fp32_split_equals_unsplit (PP 2 and TP 2 x PP 2 x DP 2) and, for this op
      alone, by tests/test_parallel_layers.py::test_gradient_through_a_pipeline_send_is_exact.
    - ``torch.distributed.all_gather_into_tensor is deprecated`` (FutureWarning, at each ZeRO-1 step): torch 2.13
      renamed it all_gather_single and forwards the old name to it; DeepSpeed still calls the old name.
    Every other warning is left alone.
    """
    import warnings

    warnings.filterwarnings("ignore", message=r"c10d::broadcast_: an autograd kernel was not registered",
                            category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)


class RendezvousError(RuntimeError):
    """This rank could not reach the master (rank 0's store at MASTER_ADDR:MASTER_PORT) in time."""


def wait_for_master(address: str, port: int, timeout_s: float) -> None:
    """Return once MASTER_ADDR:MASTER_PORT accepts a TCP connection, or raise RendezvousError after timeout_s.

    torch's own store client retries for the whole process-group timeout (30 min here, which collectives need) and
    then names neither the address nor the cause; a node whose master is down or misnamed should say so sooner.
    """
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=min(5.0, timeout_s)):
                return
        except OSError as error:
            last_error = error
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"cannot reach the master at MASTER_ADDR:MASTER_PORT = {address}:{port} within {timeout_s:g} s "
                f"({last_error}). Check that rank 0's node is up and started, that {address} is its address as seen "
                f"from this node (--master_addr), and that port {port} is open between the nodes "
                f"(training.rendezvous_timeout_s sets this limit)")
        time.sleep(0.5)


def init_distributed(timeout_minutes: int = 30, rendezvous_timeout_s: float | None = None) -> None:
    """Initialise torch.distributed through DeepSpeed: NCCL on GPUs, gloo on CPU, no code change.

    The launcher (deepspeed, torchrun, or a test's spawn helper) provides RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*.
    With ``rendezvous_timeout_s``, every rank but 0 (which hosts the store) first waits at most that long for the
    master to accept connections.
    """
    import datetime

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if dist.is_initialized():
        return
    silence_harmless_distributed_warnings()
    if rendezvous_timeout_s is not None and int(os.environ.get("RANK", "0")) != 0 and "MASTER_ADDR" in os.environ:
        wait_for_master(os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")), rendezvous_timeout_s)
    if get_accelerator().device_name() == "cpu":
        # DeepSpeed compiles a shared-memory all-reduce on first use on CPU (30 s); gloo alone is enough for the
        # CPU runs of this project (tests and demos), so skip the compile.
        ds_internals.skip_shared_memory_allreduce()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               timeout=datetime.timedelta(minutes=timeout_minutes))
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))


def build_parallel_context(parallel: ParallelConfig) -> ParallelContext:
    """The tensor-parallel process groups of this world (collective: every rank must call it), and this rank's place.

    Only the groups this project uses are created here: the TP groups, which the sharded layers and the
    vocab-parallel loss need when they are built, before DeepSpeed's PipelineModule (and its grid) exists. Every
    other group is DeepSpeed's own, created once by the PipelineModule's PipelineParallelGrid. On CUDA every
    ``new_group`` call is an ncclCommSplit of the world communicator that all ranks join (DeepSpeed binds the device
    at init_process_group), so a group nobody uses is start-up time on every rank: at TP 8 x PP 35 x DP 16 (4,480
    GPUs) the data-parallel groups built here before were 280 such splits. The TP groups have the ranks of the grid's
    slice groups (560 more there); tests/test_process_groups.py counts every call. With
    ``parallelism.expert_parallel_size`` EP > 1, DeepSpeed's expert-parallel and expert-data-parallel groups are made
    here too (world / EP groups of each kind; every rank makes all of them), before any stage is built.
    """
    world_size = dist.get_world_size()
    dp_size, cp = parallel.data_parallel_size(world_size), parallel.context_parallel_size
    topology = ds_internals.pipe_data_model_topology(parallel.pipeline_parallel_size, parallel.tensor_parallel_size,
                                                     parallel.data_axis_size(world_size))
    rank = dist.get_rank()
    tp_group = _my_group(topology.get_axis_comm_lists("model"), rank)
    # CP groups: consecutive coordinates of each data axis (same TP and PP), so CP peers sit TP ranks apart
    cp_group = _my_group([axis[start:start + cp] for axis in topology.get_axis_comm_lists("data")
                          for start in range(0, len(axis), cp)], rank)
    coord = topology.get_coord(rank)
    expert_parallel_size, expert_group = parallel.expert_parallel_size, None
    if expert_parallel_size > 1:  # collective: every rank, also on stages without sparse blocks
        expert_group = ds_internals.create_expert_parallel_groups(
            expert_parallel_size, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, dp_size)
    return ParallelContext(tensor_parallel_size=parallel.tensor_parallel_size, tensor_parallel_rank=coord.model,
                           pipeline_parallel_size=parallel.pipeline_parallel_size, pipeline_parallel_rank=coord.pipe,
                           data_parallel_size=dp_size, data_parallel_rank=coord.data // cp,
                           context_parallel_size=cp, context_parallel_rank=coord.data % cp,
                           context_parallel_group=cp_group,
                           tensor_parallel_group=tp_group, topology=topology,
                           sequence_parallel=parallel.sequence_parallel and parallel.tensor_parallel_size > 1,
                           expert_parallel_size=expert_parallel_size, expert_parallel_group=expert_group)


def _my_group(rank_lists: list[list[int]], rank: int) -> Any:
    """new_group is collective: every rank creates every group, in the same order, and keeps the one it belongs to.

    An axis of size 1 gets no group (None): the primitives are then identities.
    """
    mine = None
    for ranks in rank_lists:
        if len(ranks) == 1:
            continue
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = group
    return mine
