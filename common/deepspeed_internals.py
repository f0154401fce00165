"""The one door to DeepSpeed's private API: every use of it in the project is a function of this module, or of its
second room, common/deepspeed_conversion.py (the universal-checkpoint converter), under the same rules.

DeepSpeed is pinned (``SUPPORTED_VERSIONS``); importing this module on another version raises ImportError. Each touch
has a contract test in tests/test_deepspeed_internals.py that names the DeepSpeed attribute when it moves or changes
meaning, so an upgrade is: install it, run that file, fix what it names, add the version here.

What counts as public (anything else is a touch, and lives here; tests/test_deepspeed_internals.py enforces it on
common, data, model, hf, planner, evaluation, training, lab, tools and train.py):

    deepspeed.initialize, deepspeed.init_distributed       the documented entry points
    deepspeed.pipe (PipelineModule, LayerSpec,            the documented pipeline API (DeepSpeed's docs, "Pipeline
      TiedLayerSpec, DualPipeVModule)                       Parallelism"), and what that package exports
    deepspeed.runtime.pipe.schedule                       documented there as "Extending Pipeline Parallelism": the
                                                            PipeSchedule base and its instruction classes
    deepspeed.accelerator                                 the documented accelerator abstraction
    deepspeed.checkpoint.constants                        the universal checkpoint's parameter-pattern keys
    python -m deepspeed.checkpoint.ds_to_universal        the documented universal-conversion command
    deepspeed.sequence.layer (DistributedAttention)       DeepSpeed-Ulysses' documented wrapper of a local attention
                                                            (blogs/deepspeed-ulysses: "from deepspeed.sequence.layer
                                                            import DistributedAttention"); model/attention.py
    the engine's public methods and attributes            train_batch, eval_batch, module, optimizer, grid, ...

A touch is then: an import of any other DeepSpeed module, an attribute starting with ``_`` of a DeepSpeed object,
an attribute of DeepSpeed's internals that its docs do not name (``INTERNAL_ATTRIBUTES``), an assignment of an
engine's ``__class__``, and an edit of ``sys.modules``.

    function                      DeepSpeed object used                              why we need it                                  caller
    skip_muon_kernels             sys.modules["deepspeed.runtime.zero.muon.          its import compiles Muon's kernels (1.2-1.7 s   training/engine.py
                                    muon_optimizer"] (replaced by a stub)              a rank) for runs that do not use Muon
    run_short_batches_as          DualPipeVEngine: engine.__class__ swapped;         batches of < 2 PP micro-batches run the         training/engine.py
                                    _train_schedule, _inference_schedule,              V-shaped schedule (model/pipe_schedules.py)
                                    _phase1_buffer overridden
    is_dualpipev_engine           deepspeed.runtime.pipe.dualpipev.DualPipeVEngine   which schedule and which checkpoint layout      training/engine.py,
                                                                                                                                       training/checkpoint.py
    run_before_instruction        PipelineEngine._INSTRUCTION_MAP (an instance       the noise scale reads the gradients before      training/noise_scale.py,
                                    map; _exec_schedule looks it up on self)           ReduceGrads averages them over DP; the MoE      training/engine.py
                                                                                       layers learn the micro-batch count;
                                                                                       MuonClip's maxima reduced before the step
    wrap_instructions             the same map, every handler wrapped                each instruction a profiler range               training/profiling.py
    flat_partition_layout         round_robin_bit16_*, partition_size, bf16_groups*  where each Muon parameter lies in its flat buffer training/muon.py
    accumulated_gradients         BF16_Optimizer.fp32_groups_gradients, bf16_groups; the gradient of one replica, before the DP      training/noise_scale.py
                                    DeepSpeedZeroOptimizer.bit16_groups,               reduction
                                    get_gradient_for_reduction, partition_gradients
    norm_dtype                    deepspeed.runtime.zero.utils.get_norm_dtype        norms in DeepSpeed's own accumulation dtype     training/noise_scale.py
    checkpoint_zipfile_           engine.checkpoint_engine.zipfile_serialization     the snapshot engine writes as DeepSpeed would   training/checkpoint.py
      serialization                 (an instance attribute of TorchCheckpointEngine)
    replace_checkpoint_engine     engine.checkpoint_engine (assigned)                every file DeepSpeed writes goes through ours   training/checkpoint.py
    CheckpointEngine,             deepspeed.runtime.checkpoint_engine.               the base class of the snapshot engine           training/checkpoint_engine.py
                                                                                                                                       (pending: imports it itself)
      CheckpointCommitInfo          checkpoint_engine
    stop_loading_universal        engine._config.load_universal_checkpoint           later loads (a rollback) read this run's        training/checkpoint.py
                                                                                       own format, not universal/
    skip_shared_memory_allreduce  deepspeed.ops.__compatible_ops__                   no 30 s shm all-reduce compile on CPU           model/parallel.py
                                    ["deepspeed_shm_comm"]
    pipe_data_model_topology      deepspeed.runtime.pipe.topology.                   the TP groups on DeepSpeed's own rank layout    model/parallel.py
                                    PipeModelDataParallelTopology
    partition_balanced            deepspeed.runtime.utils.partition_balanced         the stage boundaries DeepSpeed will cut         model/summary.py
    with_partition                PipelineModule._partition_layers (overridden),     model.mtp's depths and the head on the last     model/gpt.py
                                    parts, _set_bounds                                 stage, the depths weighed as blocks
    stage_layer_indices,          PipelineModule._local_start, _local_stop,          the layers of this rank's stage, by index       evaluation/loading.py
      stage_layer, tied_module      _modules (torch's), tied_modules
    stage_forward_functions       PipelineModule.forward_funcs                       the stage's layers in the order it runs them    evaluation/loading.py,
                                                                                                                                       evaluation/pipeline.py
    wrap_loss                     PipelineModule.loss_fn (replaced; the engine       the spike guard sees each micro-batch's loss    training/guards.py
                                    reads it at every ForwardPass on the last stage)
    launcher_command              python -m deepspeed.launcher.launch --world_info   what ``deepspeed --num_gpus`` starts on a node  lab/sweep.py
                                    (base64 JSON {host: [devices]}), --node_rank,
                                    --master_addr, --master_port
    deepspeed_logger              deepspeed.utils.logging.logger                     its handler is repointed at stderr              tools/streams.py
    create_expert_parallel_groups deepspeed.utils.groups.                            the EP and EDP groups, made by every rank       model/parallel.py
                                    _create_expert_data_and_model_parallel,            before the model (EP > 1), on DeepSpeed's
                                    _get_expert_parallel_group, mpu (set, restored)    own layout its optimizers reduce over
    expert_parallel_ranks         groups._get_expert_parallel_group_ranks,           the contract test checks them on the topology   tests
                                    _get_expert_data_parallel_group_ranks,
                                    _get_expert_model_parallel_world_size
    tag_expert_parameter,         param.allreduce = False, param.group_name          DeepSpeed's is_moe_param: EDP reduction         model/moe.py,
      expert_group_of                                                                                                                  training/engine.py
    expert_parallel_marker        deepspeed.moe.layer.MoE subclassed, __init__       turns engine.has_moe_layers on for a stage      model/gpt.py
                                    skipped; num_experts, set_deepspeed_parallelism    with experts (EP > 1)
    expert_param_group            param-group keys 'moe' and 'name'                  the experts' group, kept as given               training/engine.py
    pad_expert_norm_collectives   ZeRO: scaled_global_norm (wrapped),                a stage without experts runs the expert norm's  training/engine.py
                                    model_parallel_group; BF16_Optimizer:              cross-stage collectives with zeros (PP > 1
                                    has_moe_layers, expert_gradients (set),            would hang otherwise)
                                    get_grads_for_norm (wrapped)
    pad_norm_collectives          ZeRO: scaled_global_norm (wrapped),                a stage with fewer param groups (Muon: no        training/engine.py
                                    model_parallel_group                               embedding or head, so no "decay" group) runs
                                                                                       the others' cross-stage SUMs with zeros
    own_expert_checkpoints        engine.has_moe_layers (off during save and load)   its MoE save writes no layer files and its MoE  training/checkpoint.py
                                                                                       load wants expp_rank files: the experts are
                                                                                       saved in this project's files
    refresh_master_weights        optimizer.refresh_fp32_params                      fp32 masters re-read from weights restored      training/checkpoint.py
                                                                                       after a module-only load (the experts)
    (the universal-checkpoint converter's touches live in common/deepspeed_conversion.py, the door's second room)

Every function imports DeepSpeed itself, when called: importing this module reads only the installed version
(package metadata), so the floor stays cheap for the packages that never touch DeepSpeed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sys
import types
from collections.abc import Callable, Iterator
from importlib import metadata
from itertools import accumulate
from typing import Any

SUPPORTED_VERSIONS = ("0.19.8",)
"""The DeepSpeed versions every touch below was checked against (tests/test_deepspeed_internals.py)."""

PUBLIC_MODULES = ("deepspeed", "deepspeed.pipe", "deepspeed.runtime.pipe.schedule", "deepspeed.accelerator",
                  "deepspeed.checkpoint.constants", "deepspeed.checkpoint.ds_to_universal", "deepspeed.sequence.layer")
"""The DeepSpeed modules any package may import or run (the module docstring says why each is public)."""

PUBLIC_TOP_LEVEL = ("initialize", "init_distributed", "__version__")
"""The names of ``deepspeed`` itself any package may use."""

INTERNAL_ATTRIBUTES = ("forward_funcs", "loss_fn", "checkpoint_engine", "zipfile_serialization",
                       "fp32_groups_gradients", "bf16_groups", "bit16_groups", "get_gradient_for_reduction",
                       "partition_gradients", "tied_modules", "__compatible_ops__", "has_moe_layers",
                       "scaled_global_norm", "get_grads_for_norm", "expert_gradients", "DeepSpeedCheckpoint",
                       "refresh_fp32_params", "round_robin_bit16_groups", "round_robin_bit16_offsets",
                       "partition_size", "real_dp_process_group", "bf16_groups_flat")
"""DeepSpeed attributes without a leading underscore that its docs do not name: read or written only here."""

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def check_version(installed: str) -> None:
    """Raise ImportError unless ``installed`` is one of ``SUPPORTED_VERSIONS``, saying what to do."""
    if installed not in SUPPORTED_VERSIONS:
        raise ImportError(f"DeepSpeed {installed} is installed; this project touches DeepSpeed's private API "
                          f"(common/deepspeed_internals.py) and was checked against {', '.join(SUPPORTED_VERSIONS)} "
                          f"only. Install deepspeed=={SUPPORTED_VERSIONS[-1]}, or run "
                          f"tests/test_deepspeed_internals.py on {installed}, fix what it names, and add {installed!r} "
                          f"to SUPPORTED_VERSIONS")


check_version(metadata.version("deepspeed"))


# ------------------------------------------------------------------------------------------------- the engine


def skip_muon_kernels(optimizer_type: str) -> None:
    """DeepSpeed 0.19.8 imports its Muon optimizer module wherever it asks whether the optimizer is Muon (the ZeRO
    support check, BF16_Optimizer's and ZeRO-1's gradient paths: ``isinstance(optimizer, MuonWithAuxAdam)``), and
    that import compiles Muon's kernels with torch.compile: 1.2-1.7 s on every rank at every start, measured on CPU,
    for an optimizer the run does not use. A run whose optimizer is not Muon gets, in its place, a module whose
    MuonWithAuxAdam is a class no optimizer is an instance of: every such check answers "not Muon", as it does.
    The real module (and Muon's update, imported only once an optimizer is Muon) is left alone otherwise."""
    if "muon" in optimizer_type.lower() or MUON_MODULE in sys.modules:
        return
    stub = types.ModuleType(MUON_MODULE, "stands in for DeepSpeed's Muon optimizer module "
                                         "(common/deepspeed_internals.py)")
    stub.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {"__doc__": "no optimizer of this run is Muon"})
    sys.modules[MUON_MODULE] = stub


def is_dualpipev_engine(engine: Any) -> bool:
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine

    return isinstance(engine, DualPipeVEngine)


ScheduleMaker = Callable[[int, int, int, bool], Any]
"""(micro_batches, stages, stage_id, forward_only) -> the DeepSpeed PipeSchedule to run."""


def run_short_batches_as(engine: Any, make_schedule: ScheduleMaker) -> None:
    """Make a DualPipeVEngine (what deepspeed.initialize builds for a DualPipeVModule) take each batch's schedule
    from ``make_schedule``, which may be another than DualPipeVSchedule (it refuses fewer than 2 PP micro-batches).
    The engine stays DeepSpeed's: its class becomes a subclass that adds only the choice of the schedule, after
    deepspeed.initialize, which picks the engine class itself."""
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine

    class DualPipeVEngineWithShortBatches(DualPipeVEngine):
        # Both schedules number a micro-batch's phase-1 buffer micro_batch + m, with m the micro-batches of the
        # schedule being run. DualPipeVEngine adds the training batch's count instead, which differs for an
        # eval_batch of another size (the stability probe's one micro-batch): the turn-around would then hand the
        # phase-1 forward a buffer nobody filled. The engine follows the schedule it runs.
        _schedule_micro_batches = None

        def _phase1_buffer(self, buffer_id):
            return buffer_id + (self._schedule_micro_batches or self.micro_batches)

        def _train_schedule(self):
            self._schedule_micro_batches = self.micro_batches
            return make_schedule(self.micro_batches, self.num_stages, self.stage_id, False)

        def _inference_schedule(self, micro_batches):
            self._schedule_micro_batches = micro_batches
            return make_schedule(micro_batches, self.num_stages, self.stage_id, True)

    if not isinstance(engine, DualPipeVEngine):
        raise TypeError(f"run_short_batches_as needs a DualPipeVEngine, got {type(engine).__name__}")
    engine.__class__ = DualPipeVEngineWithShortBatches


def run_before_instruction(engine: Any, instruction: str, hook: Callable[[], None]) -> None:
    """Call ``hook()`` each time the pipeline engine is about to execute ``instruction`` (a class name of
    deepspeed.runtime.pipe.schedule, e.g. "ReduceGrads"). ``PipelineEngine._exec_schedule`` dispatches through
    ``self._INSTRUCTION_MAP``; an instance map (the class's, or one already installed) shadows the class's."""
    from deepspeed.runtime.pipe import schedule

    kind = getattr(schedule, instruction)
    handlers = dict(engine._INSTRUCTION_MAP)
    execute = handlers[kind]

    def hook_then_execute(engine: Any, **kwargs: Any) -> Any:
        hook()
        return execute(engine, **kwargs)

    handlers[kind] = hook_then_execute
    engine._INSTRUCTION_MAP = handlers


def wrap_instructions(engine: Any, wrap: Callable[[str, Callable[[], Any]], Any]) -> None:
    """Run every instruction of the pipeline engine as ``wrap(name, execute)``: ``name`` its class name (ForwardPass,
    SendActivation, ...), ``execute()`` DeepSpeed's handler. Through the same instance ``_INSTRUCTION_MAP`` as
    run_before_instruction (either may be installed first)."""
    handlers = dict(engine._INSTRUCTION_MAP)

    def wrapped(kind: type, execute: Callable[..., Any]) -> Callable[..., Any]:
        return lambda engine, **kwargs: wrap(kind.__name__, lambda: execute(engine, **kwargs))

    engine._INSTRUCTION_MAP = {kind: wrapped(kind, execute) for kind, execute in handlers.items()}


def wrap_loss(engine: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace the pipeline module's loss function by ``wrap(loss_fn)``: the engine reads ``module.loss_fn`` at
    every ForwardPass of the last stage."""
    engine.module.loss_fn = wrap(engine.module.loss_fn)


# --------------------------------------------------------------------------------------------- the optimizers


def accumulated_gradients(optimizer: Any) -> list[tuple[Any, Any]]:
    """(parameter, this replica's accumulated gradient) before the DP reduction, for DeepSpeed's ZeRO-1 and
    BF16 optimizers: BF16_Optimizer adds them into ``fp32_groups_gradients[group][index]`` (views of its flat fp32
    buffer); DeepSpeedZeroOptimizer at stage 1 leaves them in ``param.grad`` (``get_gradient_for_reduction``)."""
    if hasattr(optimizer, "fp32_groups_gradients") and hasattr(optimizer, "bf16_groups"):  # BF16_Optimizer
        return [(param, optimizer.fp32_groups_gradients[i][j])
                for i, group in enumerate(optimizer.bf16_groups) for j, param in enumerate(group)]
    if hasattr(optimizer, "bit16_groups") and hasattr(optimizer, "get_gradient_for_reduction"):  # ZeRO 1/2
        if getattr(optimizer, "partition_gradients", False):
            raise ValueError("the noise scale needs the whole local gradient before the data-parallel reduction; "
                             "ZeRO stage 2 reduces it during backward: use zero_optimization.stage 1")
        return [(param, optimizer.get_gradient_for_reduction(param))
                for group in optimizer.bit16_groups for param in group]
    raise ValueError(f"the noise scale reads the accumulated gradients of DeepSpeed's ZeRO-1 optimizer or its "
                     f"BF16_Optimizer, not of {type(optimizer).__name__}: set zero_optimization.stage to 1")


def flat_partition_layout(optimizer: Any) -> list[tuple[list[Any], list[int], int, int, Any]]:
    """Per ZeRO-1 / BF16_Optimizer group: (params in flat order, offsets, partition size, rank r, group); r: [r size, ..)."""
    import torch.distributed as torch_dist
    zero, on = hasattr(optimizer, "round_robin_bit16_offsets"), torch_dist.is_initialized()
    if not (zero or hasattr(optimizer, "bf16_groups_flat")):
        raise ValueError(f"no flat partitions in {type(optimizer).__name__}: Muon's are ZeRO-1's or BF16_Optimizer's")
    layouts = []
    for index, params in enumerate(optimizer.round_robin_bit16_groups if zero else optimizer.bf16_groups):
        group = optimizer.real_dp_process_group[index]
        world, rank = (torch_dist.get_world_size(group), torch_dist.get_rank(group)) if on else (1, 0)
        offsets = optimizer.round_robin_bit16_offsets[index] if zero else accumulate([0] + [p.numel() for p in params])
        size = optimizer.partition_size[index] if zero else optimizer.bf16_groups_flat[index].numel() // world
        layouts.append((list(params), list(offsets)[:len(params)], int(size), rank, group))
    return layouts


def norm_dtype() -> Any:
    """The dtype DeepSpeed accumulates gradient norms in: fp64 where the device has it."""
    from deepspeed.runtime.zero.utils import get_norm_dtype

    return get_norm_dtype()


# ------------------------------------------------------------------------------------------------ checkpoints


def checkpoint_zipfile_serialization(engine: Any) -> bool:
    """Whether DeepSpeed's own checkpoint engine would write torch's zipfile format (the instance attribute
    TorchCheckpointEngine sets from ``checkpoint.serialization``; other engines have none: the default, True)."""
    return engine.checkpoint_engine.__dict__.get("zipfile_serialization", True)


def replace_checkpoint_engine(engine: Any, checkpoint_engine: Any) -> None:
    """Every file DeepSpeed writes (its pipeline layer files included) goes through ``engine.checkpoint_engine``."""
    engine.checkpoint_engine = checkpoint_engine


def stop_loading_universal(engine: Any) -> None:
    """After a run has loaded a universal checkpoint (``checkpoint.load_universal``), make later
    ``load_checkpoint`` calls (a spike rollback) read this run's own format: the flag is read at every load."""
    engine._config.load_universal_checkpoint = False


def __getattr__(name: str) -> Any:
    """``CheckpointEngine`` (the base class of DeepSpeed's checkpoint engines) and ``CheckpointCommitInfo`` (what
    its ``commit`` receives), imported from DeepSpeed on first use."""
    if name in ("CheckpointEngine", "CheckpointCommitInfo"):
        from deepspeed.runtime.checkpoint_engine import checkpoint_engine

        return getattr(checkpoint_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------- process groups, layers


def skip_shared_memory_allreduce() -> None:
    """DeepSpeed compiles a shared-memory all-reduce on first use on CPU (30 s); mark it unavailable so that gloo
    does the CPU runs' collectives (``deepspeed.ops.__compatible_ops__``, probed lazily, is a plain dict)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def pipe_data_model_topology(pipeline_parallel_size: int, tensor_parallel_size: int, data_parallel_size: int) -> Any:
    """DeepSpeed's rank layout (axes pipe, data, model; model fastest), the one its PipelineParallelGrid builds."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=pipeline_parallel_size, num_mp=tensor_parallel_size,
                                         num_dp=data_parallel_size)


def partition_balanced(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's split of ``weights`` into ``parts`` contiguous parts (``parts + 1`` boundaries), as
    PipelineModule's 'type:' and 'parameters' partition methods cut the layers."""
    from deepspeed.runtime.utils import partition_balanced as balanced

    return balanced(weights=weights, num_parts=parts)


def with_partition(base: type, adjust: Callable[[list[int], str], list[int]], stage: int) -> type:
    """A subclass of ``base`` (PipelineModule or DualPipeVModule) whose stage boundaries are ``adjust(parts,
    method)`` of those DeepSpeed cuts, set before it builds this ``stage``'s layers and indexes the tied ones."""

    class AdjustedPartition(base):
        def _partition_layers(self, method: str = "uniform") -> None:
            super()._partition_layers(method)
            self.parts = list(adjust(list(self.parts), method))
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return AdjustedPartition


def stage_layer_indices(module: Any) -> range:
    """The indices (in the whole LayerSpec list) of the layers this rank's stage holds."""
    return range(module._local_start, module._local_stop)


def stage_layer(module: Any, index: int) -> Any:
    """The module built for layer ``index`` of this rank's stage (not a tied one: ``tied_module``)."""
    return module._modules[str(index)]


def tied_module(module: Any, key: str) -> Any:
    """The module a TiedLayerSpec of ``key`` builds, held once by the stage."""
    return module.tied_modules[key]


def stage_forward_functions(module: Any) -> list[Callable[..., Any]]:
    """The stage's layers in the order PipelineModule.forward runs them (tied layers and plain functions included)."""
    return list(module.forward_funcs)


# --------------------------------------------------------------------------------------------- launch, logging


def launcher_command(devices: list[int], master_port: int, master_addr: str = "127.0.0.1") -> list[str]:
    """What ``deepspeed --num_gpus N`` starts on one node: DeepSpeed's per-node launcher, told this node's
    ``devices`` (``--world_info``: base64 of the JSON {host: [devices]}, which the runner builds from a hostfile).
    The caller appends the script and its arguments."""
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": devices}).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}", "--node_rank=0",
            f"--master_addr={master_addr}", f"--master_port={master_port}"]


def deepspeed_logger() -> Any:
    """DeepSpeed's logger (``deepspeed.utils.logging.logger``), created at its first import."""
    from deepspeed.utils.logging import logger

    return logger


# ----------------------------------------------------------------------------------------- expert parallelism


def expert_group_name(expert_parallel_size: int) -> str:
    """The key DeepSpeed files an expert-parallel size's groups under (``groups._EXPERT_*_GROUP``), which the expert
    parameters' ``group_name`` and their param group's ``name`` must equal."""
    return f"ep_size_{expert_parallel_size}"


class _ParallelSizes:
    """The getters ``_create_expert_data_and_model_parallel`` reads from an mpu (TP, PP; the DP size through the
    module-global ``groups.mpu``), before the PipelineParallelGrid exists."""

    def __init__(self, tensor_parallel_size: int, pipeline_parallel_size: int, data_parallel_size: int) -> None:
        self.sizes = (tensor_parallel_size, pipeline_parallel_size, data_parallel_size)

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.sizes[0]

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.sizes[1]

    def get_data_parallel_world_size(self) -> int:
        return self.sizes[2]


def create_expert_parallel_groups(expert_parallel_size: int, tensor_parallel_size: int, pipeline_parallel_size: int,
                                  data_parallel_size: int) -> Any:
    """Collective (every rank, before the model is built): DeepSpeed's expert-parallel and expert-data-parallel
    groups of this layout (``groups._create_expert_data_and_model_parallel``: EP groups are EP consecutive data
    ranks with the same TP and PP coordinates; EDP groups the ranks holding the same experts), and this rank's EP
    group. It also sets DeepSpeed's expert tensor-parallel size to TP, which its BF16 norm needs for TP-sharded
    experts. ``groups.mpu`` is set to the sizes for the call only (its DP-size check reads it; unset, it would clone
    the world group); the engine sets it to its grid."""
    from deepspeed.utils import groups

    sizes = _ParallelSizes(tensor_parallel_size, pipeline_parallel_size, data_parallel_size)
    previous, groups.mpu = groups.mpu, sizes
    try:
        groups._create_expert_data_and_model_parallel(expert_parallel_size, mpu=sizes)
    finally:
        groups.mpu = previous
    return groups._get_expert_parallel_group(expert_group_name(expert_parallel_size))


def expert_parallel_ranks(expert_parallel_size: int) -> tuple[list[int], list[int], int]:
    """This rank's EP group ranks, its EDP group ranks and DeepSpeed's expert tensor-parallel size."""
    from deepspeed.utils import groups

    name = expert_group_name(expert_parallel_size)
    return (list(groups._get_expert_parallel_group_ranks(name)), list(groups._get_expert_data_parallel_group_ranks(name)),
            groups._get_expert_model_parallel_world_size())


def tag_expert_parameter(parameter: Any, expert_parallel_size: int) -> None:
    """DeepSpeed's mark of an expert parameter (``moe.utils.is_moe_param``: ``allreduce`` False), reduced over the
    EDP group named ``group_name`` by its optimizers and left out of the DP all-reduce."""
    parameter.allreduce = False
    parameter.group_name = expert_group_name(expert_parallel_size)


def expert_parallel_marker(num_experts: int, expert_parallel_size: int) -> Any:
    """A parameter-less ``deepspeed.moe.layer.MoE`` (its ``__init__`` skipped): registered on a stage that holds
    expert parameters, it turns the engine's ``has_moe_layers`` on (an isinstance check), which routes the expert
    gradients to the EDP reduction and the expert norm. ``set_deepspeed_parallelism`` (called by the engine on it)
    does nothing: the groups exist already (create_expert_parallel_groups)."""
    from deepspeed.moe.layer import MoE
    from torch.nn import Module

    class ExpertParallelMarker(MoE):
        def __init__(self) -> None:
            Module.__init__(self)  # not MoE's: it would build DeepSpeed's own experts and gate
            self.num_experts, self.ep_size = num_experts, expert_parallel_size
            self.num_local_experts = num_experts // expert_parallel_size
            self.expert_group_name = expert_group_name(expert_parallel_size)

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass

        def forward(self, *args: Any) -> Any:
            raise RuntimeError("the expert-parallel marker only flags a stage for DeepSpeed; it does not run")

    return ExpertParallelMarker()


def expert_param_group(params: list[Any], expert_parallel_size: int, weight_decay: float) -> dict[str, Any]:
    """The experts' param group as DeepSpeed's optimizers read it (``'moe'`` True, ``'name'`` the EP group's name):
    ``configure_moe_param_groups`` keeps groups that already have ``'moe'`` as they are."""
    return {"name": expert_group_name(expert_parallel_size), "moe": True, "params": params,
            "weight_decay": weight_decay}


def pad_expert_norm_collectives(engine: Any, expert_parallel_size: int, missing_groups: int) -> None:
    """On a pipeline stage without experts, issue the cross-stage collectives that the stages with experts run for
    their expert group's norm, with zeros, so that every stage runs the same sequence (otherwise PP > 1 hangs):
    ZeRO-1 as ``pad_norm_collectives``; BF16_Optimizer (``step``): ``has_moe_layers`` on, with ``get_grads_for_norm``
    giving the expert group one zero, so that ``get_norm_with_moe_layers`` runs the same model-parallel and EP SUMs
    (and ``expert_gradients`` empty, which ``get_grads_for_reduction`` then returns)."""
    import torch

    optimizer = engine.optimizer
    name = expert_group_name(expert_parallel_size)
    if hasattr(optimizer, "bf16_groups"):  # BF16_Optimizer
        own = optimizer.get_grads_for_norm

        def with_zero_expert_group(for_clipping: bool = False) -> Any:
            if for_clipping:
                return own(for_clipping=True)
            dense, experts = own()
            return dense, {**experts, name: [torch.zeros(1, device=engine.device)]}

        optimizer.has_moe_layers = True
        optimizer.expert_gradients = {}  # set only with experts; get_grads_for_reduction reads it once on
        optimizer.get_grads_for_norm = with_zero_expert_group
        return
    pad_norm_collectives(engine, missing_groups)


def pad_norm_collectives(engine: Any, missing_groups: int) -> None:
    """ZeRO-1's gradient norm (``scaled_global_norm``) runs one SUM over ``model_parallel_group`` (across the stages)
    per param group: on a stage with ``missing_groups`` fewer groups than another, run those with zeros, added to
    the norm, so that every stage runs the same sequence (otherwise PP > 1 hangs). BF16_Optimizer reduces all its
    groups' norms at once: nothing to pad."""
    import torch
    import torch.distributed as torch_dist

    optimizer = engine.optimizer
    if missing_groups <= 0 or hasattr(optimizer, "bf16_groups") or not hasattr(optimizer, "scaled_global_norm"):
        return
    scaled = optimizer.scaled_global_norm

    def with_missing_groups(norm_type: int = 2) -> Any:
        norm = scaled(norm_type)
        squares = torch.zeros((), dtype=torch.float32, device=norm.device)
        for _ in range(missing_groups):
            part = torch.zeros((), dtype=torch.float32, device=norm.device)
            torch_dist.all_reduce(part, group=optimizer.model_parallel_group)
            squares = squares + part
        return torch.sqrt(norm.float() ** 2 + squares).to(norm.dtype)

    optimizer.scaled_global_norm = with_missing_groups


def expert_group_of(parameter: Any) -> str | None:
    """The EP group name DeepSpeed reduces ``parameter`` over (tag_expert_parameter), None for a dense one."""
    if getattr(parameter, "allreduce", True) is False:
        return parameter.group_name
    return None


@contextlib.contextmanager
def own_expert_checkpoints(engine: Any) -> Iterator[Any]:
    """``with own_expert_checkpoints(engine): engine.save_checkpoint(...)`` (or load_checkpoint): the engine's
    ``has_moe_layers`` off for the call, so that it saves and loads as for a dense model (layer files, mp_rank and
    ZeRO files) and not through its MoE path (expp_rank optimizer files, no layer files, DeepSpeed's own MoE
    layers only). The ZeRO optimizer keeps its own flag: it still shards and restores the experts over their
    expert-data-parallel groups. The experts' weights are this project's files (training/expert_checkpoint.py)."""
    was = engine.has_moe_layers
    engine.has_moe_layers = False
    try:
        yield engine
    finally:
        engine.has_moe_layers = was


def refresh_master_weights(engine: Any) -> None:
    """The optimizer's fp32 master weights copied again from the model's, after weights were set outside a
    DeepSpeed load (which refreshes them itself when it loads the module only)."""
    engine.optimizer.refresh_fp32_params()

