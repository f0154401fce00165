"""The door to DeepSpeed's private API (common/deepspeed_internals.py): one contract test per touch, the planner's
copies of DeepSpeed behaviour against DeepSpeed's own objects, the rule that keeps every touch in the door, and the
version check.

Run on a new DeepSpeed version before adding it to ``SUPPORTED_VERSIONS``: each failure names the DeepSpeed
attribute that moved or changed. All single-process; the touches' behaviour inside real runs is covered by

    touch                                           run that exercises it
    run_short_batches_as, is_dualpipev_engine        tests/test_dualpipev.py (the engine class, short batches)
    run_before_instruction, accumulated_gradients    tests/test_noise_scale.py (hooked norms equal DeepSpeed's)
    wrap_loss                                        tests/test_spike_guard.py
    stage_layer*, stage_forward_functions            tests/test_evaluation.py
    stop_loading_universal                           tests/test_reshape.py (a universal load, then a rollback)
    replace_checkpoint_engine                        tests/test_checkpoint_engine.py, tests/test_resume.py
    launcher_command                                 tests/test_sweep.py (a launched run)
    the optimizer wrapper's buffers                  tests/test_planner.py (memory parts against allocations)
    create_expert_parallel_groups, tag_expert_*,     tests/test_model_parallel.py (EP 2 equals EP 1 on ZeRO-1 and
      expert_parallel_marker, expert_param_group,      BF16_Optimizer, PP 2 with a stage without experts)
      pad_expert_norm_collectives
"""

from __future__ import annotations

import ast
import base64
import inspect
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from common import deepspeed_internals as door

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["common", "data", "model", "hf", "planner", "evaluation", "training", "lab", "tools", "train.py"]
DEEPSPEED_SOURCES = ["runtime/engine.py", "runtime/config.py", "runtime/utils.py", "runtime/bf16_optimizer.py",
                     "runtime/zero/stage_1_and_2.py", "runtime/pipe/engine.py", "runtime/pipe/module.py",
                     "runtime/pipe/dualpipev.py", "runtime/pipe/topology.py", "runtime/pipe/schedule.py",
                     "runtime/checkpoint_engine/checkpoint_engine.py",
                     "runtime/checkpoint_engine/torch_checkpoint_engine.py", "comm/comm.py", "comm/torch.py",
                     "launcher/launch.py", "ops/__init__.py", "utils/logging.py"]
"""The DeepSpeed modules whose objects the project holds: their private names may not be used outside the door."""
DOOR = (ROOT / "common" / "deepspeed_internals.py", ROOT / "common" / "deepspeed_conversion.py")
"""The door's two files: DeepSpeed's private API is used in these alone."""


SYS_MODULES_EDITS = ("pop", "popitem", "update", "setdefault", "clear", "__setitem__", "__delitem__")


def source_of(obj) -> str:
    return inspect.getsource(obj)


def require(condition: bool, attribute: str, change: str) -> None:
    assert condition, f"DeepSpeed's {attribute}: {change} (common/deepspeed_internals.py relies on it)"


# ------------------------------------------------------------------------------------------ (d) the version


def test_the_installed_version_is_supported():
    from importlib import metadata

    assert metadata.version("deepspeed") in door.SUPPORTED_VERSIONS == ("0.19.8",)
    door.check_version("0.19.8")


def test_another_version_is_refused_with_what_to_do():
    with pytest.raises(ImportError) as refused:
        door.check_version("0.20.0")
    message = str(refused.value)
    for part in ("0.20.0", "0.19.8", "deepspeed==0.19.8", "tests/test_deepspeed_internals.py", "SUPPORTED_VERSIONS"):
        assert part in message


# ------------------------------------------------------------------------------------------- (a) the engine


def test_muon_stub_answers_not_muon_where_deepspeed_asks(monkeypatch):
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.zero import stage_1_and_2

    statement = f"from {door.MUON_MODULE} import MuonWithAuxAdam"
    for module in (bf16_optimizer, stage_1_and_2):
        require(statement in source_of(module), f"{module.__name__} (import of MuonWithAuxAdam)",
                f"no longer runs {statement!r}: the stub would stand in for nothing")
    monkeypatch.setitem(sys.modules, door.MUON_MODULE, None)  # restored (removed) after the test
    del sys.modules[door.MUON_MODULE]
    door.skip_muon_kernels("Muon")
    assert door.MUON_MODULE not in sys.modules  # a Muon run imports the real module
    door.skip_muon_kernels("Adam")
    stub = sys.modules[door.MUON_MODULE]
    assert isinstance(stub, types.ModuleType) and not isinstance(torch.optim.AdamW([torch.zeros(1)]),
                                                                 stub.MuonWithAuxAdam)
    door.skip_muon_kernels("Adam")  # a second engine in the process keeps the first stub
    assert sys.modules[door.MUON_MODULE] is stub


def test_dualpipev_engine_methods_the_subclass_overrides():
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    for name, parameters in (("_phase1_buffer", ["self", "buffer_id"]), ("_train_schedule", ["self"]),
                             ("_inference_schedule", ["self", "micro_batches"])):
        require(hasattr(DualPipeVEngine, name), f"DualPipeVEngine.{name}", "is gone")
        found = list(inspect.signature(getattr(DualPipeVEngine, name)).parameters)
        require(found == parameters, f"DualPipeVEngine.{name}", f"takes {found}, not {parameters}")
    require("self._train_schedule()" in source_of(PipelineEngine.train_batch), "PipelineEngine.train_batch",
            "no longer asks self._train_schedule() for its schedule")
    require("self._inference_schedule(" in source_of(PipelineEngine.eval_batch), "PipelineEngine.eval_batch",
            "no longer asks self._inference_schedule() for its schedule")
    engine = types.SimpleNamespace(micro_batches=5)
    require(DualPipeVEngine._phase1_buffer(engine, 2) == 7, "DualPipeVEngine._phase1_buffer",
            "is no longer buffer_id + micro_batches (the V-shaped schedule numbers its buffers so)")
    require(DualPipeVEngine.__mro__[1] is PipelineEngine, "DualPipeVEngine", "no longer derives from PipelineEngine")
    import deepspeed

    require("DualPipeVEngine if isinstance(model, DualPipeVModule)" in source_of(deepspeed.initialize),
            "deepspeed.initialize", "no longer builds a DualPipeVEngine for a DualPipeVModule")


def test_short_batch_engine_takes_its_schedules_and_buffers_from_the_schedule_run():
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine

    engine = object.__new__(DualPipeVEngine)  # DeepSpeed's class, no construction: only the swapped methods run
    engine.micro_batches, engine.num_stages, engine.stage_id = 8, 2, 1
    asked = []
    door.run_short_batches_as(engine, lambda *args: asked.append(args) or "schedule")
    assert type(engine).__name__ == "DualPipeVEngineWithShortBatches" and door.is_dualpipev_engine(engine)
    assert engine._phase1_buffer(3) == 11
    assert engine._inference_schedule(1) == "schedule" and engine._phase1_buffer(0) == 1
    assert engine._train_schedule() == "schedule" and engine._phase1_buffer(0) == 8
    assert asked == [(1, 2, 1, True), (8, 2, 1, False)]
    with pytest.raises(TypeError, match="needs a DualPipeVEngine"):
        door.run_short_batches_as(types.SimpleNamespace(), lambda *args: None)


def test_instruction_hook_runs_before_the_handler_through_the_instance_map():
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    require(schedule.ReduceGrads in PipelineEngine._INSTRUCTION_MAP, "PipelineEngine._INSTRUCTION_MAP",
            "has no handler for ReduceGrads")
    engine = object.__new__(PipelineEngine)
    calls = []
    engine._reserve_pipe_buffers = lambda count: None
    engine._INSTRUCTION_MAP = {schedule.ReduceGrads: lambda self, **kwargs: calls.append(("reduce", kwargs))}
    door.run_before_instruction(engine, "ReduceGrads", lambda: calls.append("hook"))

    class OneStep(schedule.PipeSchedule):
        def steps(self):
            yield [schedule.ReduceGrads()]

    PipelineEngine._exec_schedule(engine, OneStep(1, 1, 0))
    require(calls == ["hook", ("reduce", {})], "PipelineEngine._exec_schedule",
            f"no longer dispatches through self._INSTRUCTION_MAP (calls: {calls})")
    calls.clear()
    door.wrap_instructions(engine, lambda name, execute: (calls.append(f"enter {name}"), execute(),
                                                          calls.append(f"leave {name}")))
    PipelineEngine._exec_schedule(engine, OneStep(1, 1, 0))
    require(calls == ["enter ReduceGrads", "hook", ("reduce", {}), "leave ReduceGrads"],
            "PipelineEngine._exec_schedule", f"wrapped handlers are not what it runs (calls: {calls})")


def test_loss_function_is_read_from_the_module_at_every_forward():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    require("self.module.loss_fn(outputs, labels)" in source_of(PipelineEngine._exec_forward_pass),
            "PipelineEngine._exec_forward_pass", "no longer calls self.module.loss_fn(outputs, labels)")
    engine = types.SimpleNamespace(module=types.SimpleNamespace(loss_fn=lambda outputs, labels: outputs - labels))
    door.wrap_loss(engine, lambda loss_fn: lambda outputs, labels: 10 * loss_fn(outputs, labels))
    assert engine.module.loss_fn(5, 2) == 30


# --------------------------------------------------------------------------------------- (a) the optimizers


def test_optimizer_buffers_the_noise_scale_reads():
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls, attributes in ((BF16_Optimizer, ("fp32_groups_gradients", "bf16_groups")),
                            (DeepSpeedZeroOptimizer, ("bit16_groups", "partition_gradients"))):
        built = source_of(cls)
        for attribute in attributes:
            require(f"self.{attribute} =" in built, f"{cls.__name__}.{attribute}", "is no longer set")
    require(list(inspect.signature(DeepSpeedZeroOptimizer.get_gradient_for_reduction).parameters) == ["self", "param"],
            "DeepSpeedZeroOptimizer.get_gradient_for_reduction", "no longer takes (param)")
    bf16 = types.SimpleNamespace(fp32_groups_gradients=[["g00", "g01"], ["g10"]], bf16_groups=[["p00", "p01"], ["p10"]])
    assert door.accumulated_gradients(bf16) == [("p00", "g00"), ("p01", "g01"), ("p10", "g10")]
    zero2 = types.SimpleNamespace(bit16_groups=[], get_gradient_for_reduction=None, partition_gradients=True)
    with pytest.raises(ValueError, match="ZeRO stage 2"):
        door.accumulated_gradients(zero2)


def test_flat_partition_layout_reads_where_each_optimizer_flattens():
    """Muon's partitions (training/muon.py): ZeRO-1's round-robin lists and offsets, BF16_Optimizer's packed groups;
    the partitions are cut at rank x partition_size in both (what the basic optimizer's group then holds)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls, attributes in ((DeepSpeedZeroOptimizer, ("round_robin_bit16_groups", "round_robin_bit16_offsets",
                                                      "partition_size", "real_dp_process_group")),
                            (BF16_Optimizer, ("bf16_groups", "bf16_groups_flat", "real_dp_process_group"))):
        built = source_of(cls)
        for attribute in attributes:
            require(f"self.{attribute}" in built, f"{cls.__name__}.{attribute}", "is no longer set")
    require("dp_index * partition_size, partition_size" in source_of(BF16_Optimizer), "BF16_Optimizer partitions",
            "are no longer cut at rank x partition_size")
    require("param_group['params'] = [self.single_partition_of_fp32_groups[i]]" in source_of(DeepSpeedZeroOptimizer),
            "DeepSpeedZeroOptimizer.single_partition_of_fp32_groups", "is no longer what the basic optimizer steps")
    zero = types.SimpleNamespace(round_robin_bit16_groups=[["a", "b"]], round_robin_bit16_offsets=[[0, 6]],
                                 partition_size=[5], real_dp_process_group=[None])
    assert door.flat_partition_layout(zero) == [(["a", "b"], [0, 6], 5, 0, None)]
    bf16 = types.SimpleNamespace(bf16_groups=[[torch.zeros(2, 3), torch.zeros(4)]], bf16_groups_flat=[torch.zeros(10)],
                                 real_dp_process_group=[None])
    (params, offsets, size, rank, group), = door.flat_partition_layout(bf16)
    assert (offsets, size, rank) == ([0, 6], 10, 0)
    with pytest.raises(ValueError, match="no flat partitions in SimpleNamespace"):
        door.flat_partition_layout(types.SimpleNamespace())


def test_norm_dtype_is_fp64_on_cpu():
    assert door.norm_dtype() is torch.float64


# ---------------------------------------------------------------------------------------- (a) checkpoints


def test_checkpoint_engine_serialization_flag_and_where_deepspeed_writes():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        CHECKPOINT_SERIALIZATION,
        TorchCheckpointEngine,
    )
    from deepspeed.runtime.pipe.engine import PipelineEngine

    for serialization in (True, False):
        config = types.SimpleNamespace(checkpoint_config={CHECKPOINT_SERIALIZATION: serialization})
        engine = types.SimpleNamespace(checkpoint_engine=TorchCheckpointEngine(config))
        require(door.checkpoint_zipfile_serialization(engine) is serialization,
                "TorchCheckpointEngine.zipfile_serialization", "no longer holds checkpoint.serialization")
    assert door.checkpoint_zipfile_serialization(types.SimpleNamespace(checkpoint_engine=types.SimpleNamespace()))
    require("checkpoint_engine=self.checkpoint_engine" in source_of(PipelineEngine.module_state_dict),
            "PipelineEngine.module_state_dict", "no longer writes the layer files through self.checkpoint_engine")
    engine = types.SimpleNamespace(checkpoint_engine="theirs")
    door.replace_checkpoint_engine(engine, "ours")
    assert engine.checkpoint_engine == "ours"


def test_checkpoint_engine_base_class_has_the_methods_ours_implements():
    for method in ("create", "save", "load", "commit", "makedirs"):
        require(callable(getattr(door.CheckpointEngine, method, None)), f"CheckpointEngine.{method}", "is gone")
    assert {"tag", "save_dir", "save_latest"} <= set(inspect.signature(door.CheckpointCommitInfo).parameters)
    with pytest.raises(AttributeError):
        door.NoSuchThing  # noqa: B018


def test_universal_load_flag_is_read_at_every_load():
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    require("self.load_universal_checkpoint" in source_of(DeepSpeedConfig), "DeepSpeedConfig.load_universal_checkpoint",
            "is no longer set from checkpoint.load_universal")
    engine = object.__new__(DeepSpeedEngine)
    engine._config = types.SimpleNamespace(load_universal_checkpoint=True)
    assert DeepSpeedEngine.load_universal_checkpoint(engine) is True
    door.stop_loading_universal(engine)
    require(DeepSpeedEngine.load_universal_checkpoint(engine) is False, "DeepSpeedEngine.load_universal_checkpoint()",
            "no longer returns self._config.load_universal_checkpoint")


# ---------------------------------------------------------------------------- (a) process groups and layers


def test_shared_memory_allreduce_is_skipped_by_its_builder_name():
    import importlib

    import deepspeed
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    comm_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm's name torch is torch itself

    require(ShareMemCommBuilder.NAME == "deepspeed_shm_comm", "ShareMemCommBuilder.NAME",
            f"is {ShareMemCommBuilder.NAME!r}")
    require("deepspeed.ops.__compatible_ops__.get(builder.NAME, False)" in source_of(comm_torch.build_shm_op),
            "deepspeed.comm.torch.build_shm_op", "no longer consults deepspeed.ops.__compatible_ops__")
    before = deepspeed.ops.__compatible_ops__.get("deepspeed_shm_comm")
    try:
        door.skip_shared_memory_allreduce()
        assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    finally:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = before


def test_topology_is_pipe_data_model_with_model_fastest():
    topology = door.pipe_data_model_topology(2, 2, 2)  # PP, TP, DP
    assert topology.get_axis_names() == ["pipe", "data", "model"]
    assert topology.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    coord = topology.get_coord(5)
    assert (coord.pipe, coord.data, coord.model) == (1, 0, 1)


def test_partition_balanced_cuts_as_pipeline_module_does():
    from deepspeed.runtime.pipe.module import PipelineModule

    require("ds_utils.partition_balanced(weights=binary_weights, num_parts=num_stages)"
            in source_of(PipelineModule._partition_layers), "PipelineModule._partition_layers",
            "no longer cuts 'type:' layers with runtime.utils.partition_balanced")
    assert door.partition_balanced([0, 0, 1, 1, 1, 1, 0, 0], 2) == [0, 4, 8]
    assert door.partition_balanced([0, 0, 1, 1, 1, 0, 0], 3) == [0, 3, 4, 7]


def test_with_partition_adjusts_the_bounds_before_the_stage_is_built():
    from deepspeed.runtime.pipe.module import PipelineModule

    init = source_of(PipelineModule.__init__)
    partitioned, built = init.find("self._partition_layers(method=partition_method)"), init.find("self._build()")
    require(0 <= partitioned < built, "PipelineModule.__init__",
            "no longer partitions (_partition_layers) before it builds the stage (_build)")
    require("self.parts[stage_id]" in source_of(PipelineModule._partition_layers), "PipelineModule.parts",
            "no longer holds the stage boundaries")
    require("self._local_start = start" in source_of(PipelineModule._set_bounds), "PipelineModule._set_bounds",
            "no longer sets _local_start")

    class Cut(PipelineModule):  # stands for DeepSpeed's cut: stage 1 of 2 over 6 layers
        def _partition_layers(self, method="uniform"):
            self.parts = [0, 4, 6]
            self._set_bounds(start=4, stop=6)

    adjusted_class = door.with_partition(Cut, lambda parts, method: [0, 3, parts[-1]], stage=1)
    adjusted = adjusted_class.__new__(adjusted_class)  # the partition alone, no process group
    adjusted._partition_layers("type:TransformerLayer")
    assert adjusted.parts == [0, 3, 6] and (adjusted._local_start, adjusted._local_stop) == (3, 6)


def test_stage_layers_as_pipeline_module_builds_them():
    from deepspeed.runtime.pipe.module import PipelineModule

    built = source_of(PipelineModule._build)
    for fragment, what in (("specs[self._local_start:self._local_stop]", "_local_start / _local_stop"),
                           ("self.add_module(name, module)", "_modules[str(index)]"),
                           ("self.forward_funcs.append(layer)", "forward_funcs"),
                           ("self.tied_modules[layer.key]", "tied_modules")):
        require(fragment in built, f"PipelineModule.{what}", f"is no longer built by {fragment!r}")
    require("name = str(layer_idx)" in built, "PipelineModule._modules", "layers are no longer named by their index")
    module = torch.nn.Module()
    module._local_start, module._local_stop = 2, 4
    module.add_module("2", torch.nn.Linear(1, 1))
    module.tied_modules = {"word_embeddings": "tied"}
    module.forward_funcs = ["a", "b"]
    assert list(door.stage_layer_indices(module)) == [2, 3]
    assert isinstance(door.stage_layer(module, 2), torch.nn.Linear)
    assert door.tied_module(module, "word_embeddings") == "tied"
    assert door.stage_forward_functions(module) == ["a", "b"] and door.stage_forward_functions(module) is not \
        module.forward_funcs


# ------------------------------------------------------------------------------------------- (a) launching


def test_launcher_command_is_read_back_by_deepspeeds_launcher(monkeypatch):
    from deepspeed.launcher import launch

    command = door.launcher_command([4, 5], 29511)
    assert command[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]
    monkeypatch.setattr(sys, "argv", ["launch", *command[4:], "train.py"])
    args = launch.parse_args()
    require((args.node_rank, args.master_addr, args.master_port) == (0, "127.0.0.1", 29511),
            "deepspeed.launcher.launch.parse_args", "reads --node_rank / --master_addr / --master_port otherwise")
    require(json.loads(base64.urlsafe_b64decode(args.world_info)) == {"localhost": [4, 5]},
            "deepspeed.launcher.launch --world_info", "is no longer base64 of the JSON {host: [devices]}")
    require("base64.urlsafe_b64decode(args.world_info)" in source_of(launch.main), "deepspeed.launcher.launch.main",
            "no longer decodes --world_info with urlsafe base64")


def test_deepspeed_logger_is_the_one_its_modules_log_through():
    from deepspeed.utils import logger

    assert door.deepspeed_logger() is logger and logger.name == "DeepSpeed"


# -------------------------------------------------------------------- (b) the planner's copies of DeepSpeed


def _run_config(precision: str, accumulation: str | None):
    from runconfig.run import parse_run_config

    raw = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "Adam", "params": {"weight_decay": 0.1}},
           "model": {"preset": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                     "seq_length": 16, "precision": precision},
           "parallelism": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2},
           "schedule": {"lr": 1e-3, "warmup_tokens": 0, "decay_tokens": 1e6, "train_tokens": 1e6}}
    if precision != "fp32":
        raw[precision] = {"enabled": True}
    if accumulation:
        raw["data_types"] = {"grad_accum_dtype": accumulation}
    return parse_run_config(raw, check_layout=False)


@pytest.mark.parametrize("precision,accumulation", [("bf16", "fp32"), ("bf16", None), ("fp16", None),
                                                    ("fp32", None)])
def test_planner_picks_the_optimizer_wrapper_deepspeed_picks(precision, accumulation, monkeypatch):
    """DeepSpeedEngine._do_optimizer_sanity_check on the config's dtypes, against planner.hardware.deepspeed_layout;
    which class each wrapper constant builds is checked in the source here, and measured (allocations) by
    tests/test_planner.py::test_memory_parts_match_deepspeed_allocations."""
    from deepspeed.runtime import engine as ds_engine
    from deepspeed.runtime.engine import BFLOAT16, ZERO_OPTIMIZATION, DeepSpeedEngine

    from planner.hardware import deepspeed_layout

    config = _run_config(precision, accumulation)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    model_dtype = dtypes[precision]
    engine = types.SimpleNamespace(
        get_data_types=lambda: (model_dtype, dtypes[accumulation or precision]), zero_optimization=lambda: True,
        zero_optimization_stage=lambda: 1, zero_cpu_offload=lambda: False, zero_compute_grad_norm=lambda: True,
        zero_allow_untested_optimizer=lambda: False, global_rank=0, pipeline_parallelism=True)
    # its ZeRO support check logs through torch.distributed and imports Muon (8 s); the optimizer is one it supports
    monkeypatch.setattr(ds_engine, "is_zero_supported_optimizer", lambda optimizer: True)
    wrapper = DeepSpeedEngine._do_optimizer_sanity_check(engine, torch.optim.AdamW([torch.zeros(1)]))
    picked = {BFLOAT16: "BF16_Optimizer", ZERO_OPTIMIZATION: "DeepSpeedZeroOptimizer"}[wrapper]
    assert deepspeed_layout(config).optimizer == picked
    for method, built in ((DeepSpeedEngine._configure_bf16_optimizer, "BF16_Optimizer("),
                          (DeepSpeedEngine._configure_zero_optimizer, "DeepSpeedZeroOptimizer if not self.zenflow")):
        require(built in source_of(method), f"DeepSpeedEngine.{method.__name__}", f"no longer builds {built}")


def _planner_instruction_names() -> tuple[set[str], set[tuple[str, str]]]:
    """The class names of DeepSpeed's schedule the planner compares ``type(instruction).__name__`` with, and the
    (startswith / endswith, part) tests it applies to them."""
    names, parts = set(), set()
    for node in ast.walk(ast.parse((ROOT / "planner" / "pipeline_schedule.py").read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith") and isinstance(node.args[0], ast.Constant):
            parts.add((node.func.attr, node.args[0].value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier() and \
                node.value[0].isupper():
            names.add(node.value)
    return names - {part for _, part in parts}, parts


def test_planner_instruction_names_are_deepspeeds_instruction_classes():
    from deepspeed.runtime.pipe import schedule

    names, parts = _planner_instruction_names()
    assert parts == {("startswith", "Send"), ("endswith", "Activation")}
    assert names == {"ForwardPass", "BackwardPass", "SendActivation", "SendGrad", "RecvActivation", "RecvGrad",
                     "CommitP2P"}
    for name in sorted(names):
        cls = getattr(schedule, name, None)
        require(isinstance(cls, type) and issubclass(cls, schedule.PipeInstruction),
                f"deepspeed.runtime.pipe.schedule.{name}", "is no longer a PipeInstruction")
    instructions = [name for name, cls in vars(schedule).items()
                    if isinstance(cls, type) and issubclass(cls, schedule.PipeInstruction)]
    for test, part in parts:
        require(any(getattr(name, test)(part) for name in instructions), "deepspeed.runtime.pipe.schedule",
                f"has no instruction class whose name {test} {part!r}")


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (3, 7)])
def test_dualpipev_buffers_are_the_planners_phase_times_m_plus_b(stages, micro_batches):
    """The planner and the V-shaped schedule hold micro-batch b of phase f in buffer f m + b, as DualPipeVEngine
    numbers them (``_phase1_buffer``): every buffer DeepSpeed's DualPipeVSchedule names is one of those 2m, and each
    phase's passes use their own half."""
    from deepspeed.runtime.pipe import schedule

    for stage_id in range(stages):
        dual = schedule.DualPipeVSchedule(micro_batches, stages, stage_id)
        assert dual.num_pipe_buffers() == 2 * micro_batches
        for step in dual:
            for instruction in step:
                if isinstance(instruction, (schedule.ForwardPass, schedule.BackwardPass)):
                    buffer, phase = instruction.kwargs["buffer_id"], instruction.kwargs["phase"]
                    require(divmod(buffer, micro_batches)[0] == phase, "DualPipeVSchedule's buffer_id",
                            f"is no longer phase x m + micro-batch: {instruction} at m = {micro_batches}")


# --------------------------------------------------------------------------- (c) every touch is in the door


def _deepspeed_private_names() -> set[str]:
    """Private names (one leading underscore) DeepSpeed's held objects define, and those the door touches."""
    import deepspeed

    names = set()
    sources = [Path(deepspeed.__file__).parent / name for name in DEEPSPEED_SOURCES]
    for path in [*sources, *DOOR]:
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
                node.attr if isinstance(node, ast.Attribute) else ""
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _public(module: str) -> bool:
    return any(module == public or module.startswith(public + ".") for public in door.PUBLIC_MODULES[1:]) or \
        module in ("deepspeed",) + tuple(f"deepspeed.{name}" for name in door.PUBLIC_TOP_LEVEL)


def private_touches(path: Path, private_names: set[str]) -> list[str]:
    """Each use of DeepSpeed's private API in ``path`` (common/deepspeed_internals.py's rule), as 'line: what'."""
    found = []
    tree = ast.parse(path.read_text())
    imports_deepspeed = any(isinstance(node, ast.Import) and any(a.name == "deepspeed" and not a.asname
                                                                 for a in node.names) for node in ast.walk(tree))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed" and not node.level:
            for alias in node.names:
                if not (_public(node.module) and node.module != "deepspeed" or _public(f"{node.module}.{alias.name}")):
                    found.append(f"{line}: imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            found += [f"{line}: imports {a.name}" for a in node.names
                      if a.name.split(".")[0] == "deepspeed" and not _public(a.name)]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if imports_deepspeed and dotted.startswith("deepspeed.") and isinstance(node.ctx, ast.Load) and not _public(dotted) and \
                    not any(dotted.startswith(p + ".") for p in door.PUBLIC_MODULES[1:]):
                found.append(f"{line}: uses {dotted}")
            receiver = _dotted(node.value)
            if node.attr in private_names and receiver not in ("self", "cls"):
                found.append(f"{line}: names {node.attr}")
            elif node.attr in door.INTERNAL_ATTRIBUTES:
                found.append(f"{line}: names {node.attr}")
            elif node.attr == "__class__" and isinstance(node.ctx, ast.Store):
                found.append(f"{line}: assigns __class__")
            elif receiver == "sys.modules" and node.attr in SYS_MODULES_EDITS:
                found.append(f"{line}: edits sys.modules")
        elif isinstance(node, ast.Subscript) and _dotted(node.value) == "sys.modules" and \
                isinstance(node.ctx, (ast.Store, ast.Del)):
            found.append(f"{line}: edits sys.modules")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
            if text.startswith("deepspeed.") and text.replace(".", "").replace("_", "").isalnum() and \
                    not _public(text):
                found.append(f"{line}: names module {text}")
    return found


def _checked_files() -> list[Path]:
    files = []
    for name in CHECKED:
        path = ROOT / name
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return [path for path in files if path not in DOOR]


@pytest.fixture(scope="module")
def private_names() -> set[str]:
    return _deepspeed_private_names()


def test_no_module_outside_the_door_touches_deepspeeds_private_api(private_names):
    touches = []
    for path in _checked_files():
        relative = path.relative_to(ROOT).as_posix()
        touches += [f"{relative}:{touch}" for touch in private_touches(path, private_names)]
    assert sorted(touches) == [], "move these into the door (common/deepspeed_internals.py, or deepspeed_conversion.py for the converter)"


def test_the_rule_sees_each_kind_of_touch(tmp_path, private_names):
    bad = tmp_path / "bad.py"
    bad.write_text('"""deepspeed.runtime.utils is named in a docstring, which is fine."""\n'
                   "import sys\n"
                   "import deepspeed\n"
                   "from deepspeed.pipe import PipelineModule\n"
                   "from deepspeed.runtime.utils import partition_balanced\n"
                   "import deepspeed.runtime.zero.utils\n"
                   "deepspeed.initialize\n"
                   "deepspeed.ops.__compatible_ops__['x'] = False\n"
                   "engine._INSTRUCTION_MAP = {}\n"
                   "self._INSTRUCTION_MAP = {}\n"
                   "module.forward_funcs\n"
                   "engine.__class__ = PipelineModule\n"
                   "sys.modules['deepspeed.runtime.zero.muon.muon_optimizer'] = None\n"
                   "command = ['-m', 'deepspeed.launcher.launch', '-m', 'deepspeed.checkpoint.ds_to_universal']\n"
                   "sys.modules.pop('deepspeed')\n")
    assert sorted(private_touches(bad, private_names)) == sorted([
        "5: imports deepspeed.runtime.utils.partition_balanced", "6: imports deepspeed.runtime.zero.utils",
        "8: uses deepspeed.ops.__compatible_ops__", "8: uses deepspeed.ops", "8: names __compatible_ops__",
        "9: names _INSTRUCTION_MAP", "11: names forward_funcs", "12: assigns __class__", "13: edits sys.modules",
        "13: names module deepspeed.runtime.zero.muon.muon_optimizer", "14: names module deepspeed.launcher.launch",
        "15: edits sys.modules"])
