"""The door's expert-parallel touches (common/deepspeed_internals.py): DeepSpeed's expert tags, param groups, the
marker that turns its MoE handling on, the norm collectives a stage without experts pads, and the groups' ranks.
The rest of the door's contract tests, and the rule that keeps every touch in the door, are
tests/test_deepspeed_internals.py's; the training parity these serve is tests/test_model_parallel.py's EP 2 runs."""

from __future__ import annotations

import types

import pytest
import torch

from common import deepspeed_internals as door
from tests.test_deepspeed_internals import require, source_of


def test_expert_tags_are_what_deepspeed_calls_an_expert_parameter():
    from deepspeed.moe.utils import is_moe_param

    expert, dense = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(3))
    door.tag_expert_parameter(expert, 4)
    assert is_moe_param(expert) and not is_moe_param(dense)
    assert door.expert_group_of(expert) == "ep_size_4" and door.expert_group_of(dense) is None
    require("f\"ep_size_{expert_parallel_size_}\"" in source_of(door_groups()._create_expert_data_and_model_parallel),
            "groups._create_expert_data_and_model_parallel", "no longer names its groups ep_size_{EP}")


def door_groups():
    from deepspeed.utils import groups

    return groups


def test_an_expert_param_group_is_kept_as_given():
    from deepspeed.moe.utils import configure_moe_param_groups, is_moe_param_group

    expert = torch.nn.Parameter(torch.zeros(2, 3))
    door.tag_expert_parameter(expert, 2)
    groups = [{"name": "decay", "params": [torch.nn.Parameter(torch.zeros(3, 3))], "weight_decay": 0.1},
              door.expert_param_group([expert], 2, 0.1)]
    assert configure_moe_param_groups(groups) is groups
    assert is_moe_param_group(groups[1]) and groups[1]["name"] == "ep_size_2"


def test_the_marker_turns_has_moe_layers_on_and_holds_nothing():
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime.engine import DeepSpeedEngine

    marker = door.expert_parallel_marker(num_experts=8, expert_parallel_size=2)
    assert isinstance(marker, MoE) and list(marker.parameters()) == [] and list(marker.state_dict()) == []
    assert (marker.num_experts, marker.num_local_experts, marker.expert_group_name) == (8, 4, "ep_size_2")
    marker.set_deepspeed_parallelism(False)  # the engine calls it on every module that has it: nothing happens
    engine = source_of(DeepSpeedEngine)
    require("isinstance(module, MoE)" in engine and "self.has_moe_layers = True" in engine,
            "DeepSpeedEngine.has_moe_layers", "is no longer set by an isinstance check on deepspeed.moe.layer.MoE")
    require("module.num_experts" in engine and "set_deepspeed_parallelism" in engine,
            "DeepSpeedEngine._configure_distributed_model", "no longer reads num_experts or calls "
            "set_deepspeed_parallelism")


def test_the_norm_collectives_a_stage_without_experts_pads():
    from deepspeed.runtime import utils
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    step = source_of(BF16_Optimizer.step)
    require("self.get_grads_for_norm()" in step and "if self.has_moe_layers:" in step,
            "BF16_Optimizer.step", "no longer takes the expert norms from get_grads_for_norm when has_moe_layers")
    require("self.expert_gradients" in source_of(BF16_Optimizer.get_grads_for_reduction),
            "BF16_Optimizer.get_grads_for_reduction", "no longer returns expert_gradients")
    require("groups._get_expert_parallel_group(exp_name)" in source_of(utils.get_norm_with_moe_layers),
            "runtime.utils.get_norm_with_moe_layers", "no longer sums each expert group over its EP group")
    zero = source_of(DeepSpeedZeroOptimizer.scaled_global_norm)
    require("for i, group in enumerate(self.bit16_groups)" in zero and "self.get_grad_norm_direct(" in zero,
            "DeepSpeedZeroOptimizer.scaled_global_norm", "no longer takes one norm per param group")
    direct = source_of(DeepSpeedZeroOptimizer.get_grad_norm_direct)
    require(direct.count("self._model_parallel_all_reduce(") == 2 and "total_norm = torch.tensor(0.0, dtype=torch."
            "float32)" in direct, "DeepSpeedZeroOptimizer.get_grad_norm_direct",
            "no longer all-reduces one fp32 scalar over model_parallel_group per group")
    require("self.model_parallel_group" in source_of(DeepSpeedZeroOptimizer._model_parallel_all_reduce),
            "DeepSpeedZeroOptimizer.model_parallel_group", "is no longer the group of the norm's all-reduce")


def _expert_groups_of_a_world(tensor_parallel_size: int, pipeline_parallel_size: int, expert_parallel_size: int):
    from model.config import ParallelConfig
    from model.parallel import build_parallel_context

    ctx = build_parallel_context(ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                                pipeline_parallel_size=pipeline_parallel_size,
                                                expert_parallel_size=expert_parallel_size))
    expert, expert_data, expert_tensor = door.expert_parallel_ranks(expert_parallel_size)
    import torch.distributed as dist

    return {"expert": expert, "expert_data": expert_data, "expert_tensor": expert_tensor,
            "group_size": dist.get_world_size(ctx.expert_parallel_group)}


@pytest.mark.distributed
def test_expert_groups_are_consecutive_data_ranks_of_one_tp_and_pp_coordinate():
    """8 processes, TP 2 x PP 1 x DP 4, EP 2: DeepSpeed's EP groups are EP consecutive data ranks with the same TP
    and PP coordinates, its EDP groups the data ranks d, d + EP, ... (the same experts), and its expert TP size TP."""
    from tests.distributed import run_distributed

    tp, pp, ep, world = 2, 1, 2, 8
    topology = door.pipe_data_model_topology(pp, tp, world // (tp * pp))
    per_rank = run_distributed(world, _expert_groups_of_a_world, tp, pp, ep)
    for rank, result in enumerate(per_rank):
        coord = topology.get_coord(rank)
        first = coord.data - coord.data % ep
        expected = [topology.get_rank(pipe=coord.pipe, data=d, model=coord.model) for d in range(first, first + ep)]
        same_experts = [topology.get_rank(pipe=coord.pipe, data=d, model=coord.model)
                        for d in range(coord.data % ep, world // (tp * pp), ep)]
        assert result["expert"] == expected and result["expert_data"] == same_experts
        assert result["expert_tensor"] == tp and result["group_size"] == ep


def test_expert_checkpoints_take_deepspeeds_dense_path_while_has_moe_layers_is_off():
    from deepspeed.runtime.engine import DeepSpeedEngine

    save, load = source_of(DeepSpeedEngine.save_checkpoint), source_of(DeepSpeedEngine._load_checkpoint)
    require("if self.has_moe_layers:" in save and "self._save_moe_checkpoint(" in save
            and "if not self.has_moe_layers:" in save and "self._save_checkpoint(" in save,
            "DeepSpeedEngine.save_checkpoint", "no longer chooses its MoE or dense save by has_moe_layers")
    require("if self.has_moe_layers and not self.load_universal_checkpoint():" in load
            and "load_moe_state_dict(" in load, "DeepSpeedEngine._load_checkpoint",
            "no longer reads its MoE expert files only when has_moe_layers is set")
    engine = types.SimpleNamespace(has_moe_layers=True)
    with pytest.raises(RuntimeError, match="inside"):
        with door.own_expert_checkpoints(engine):
            assert engine.has_moe_layers is False
            raise RuntimeError("inside")
    assert engine.has_moe_layers is True  # restored, also when the save fails


def test_the_converter_steps_ours_runs_between(tmp_path):
    import inspect

    from deepspeed.checkpoint import constants, universal_checkpoint
    from deepspeed.checkpoint import ds_to_universal as converter
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    require(list(inspect.signature(converter._merge_tp_slice_files).parameters) ==
            ["args", "uc_info", "tp_degree", "slice_shapes", "temp_dir", "exclude_param_names"],
            "ds_to_universal._merge_tp_slice_files", "no longer takes exclude_param_names")
    for name in ("_check_for_required_state", "_create_checkpoint_paths", "_group_per_tp_shapes",
                 "_aggregate_autoep_zero12_metadata", "_extract_zero_shard_files", "_save_optimizer_state",
                 "DeepSpeedCheckpoint"):
        require(hasattr(converter, name), f"ds_to_universal.{name}", "is gone")
    # the fragments ours reads: <tmp>/<name>/<tp>/<state>.<dp, 2 digits>
    converter.dump_param_fragment(str(tmp_path), 1, 3, "fp32", torch.arange(6.0), "7.w", 2, 3)
    assert torch.equal(torch.load(tmp_path / "7.w" / "1" / "fp32.03", weights_only=False), torch.tensor([2.0, 3, 4]))
    loader = source_of(universal_checkpoint.load_hp_checkpoint_state)
    require(all(key in loader for key in ("EP_IS_EXPERT_PARAM", "EP_NUM_EXPERTS", "PARAM_N_SUB_PARAMS", "CAT_DIM")),
            "universal_checkpoint.load_hp_checkpoint_state", "no longer reads the expert and sub-parameter markers")
    require(constants.EP_IS_EXPERT_PARAM == "is_expert_param" and "full_hp_param[ep_start:ep_end]" in loader,
            "universal_checkpoint.load_hp_checkpoint_state", "no longer cuts an expert tensor to the rank's EP share")
    groups = source_of(ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir)
    require("zip(self.optimizer.param_groups, optim_sd['param_groups'])" in groups,
            "ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir",
            "no longer pairs the run's param groups with the checkpoint's by position (the padding may go)")
    for optimizer in (DeepSpeedZeroOptimizer, BF16_Optimizer):
        require(callable(getattr(optimizer, "refresh_fp32_params", None)), f"{optimizer.__name__}.refresh_fp32_params",
                "is gone")
