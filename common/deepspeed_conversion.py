"""The door's second room: DeepSpeed's universal-checkpoint converter (ds_to_universal), run step by step with ours
between its steps. The rules of common/deepspeed_internals.py hold here (importing it checks DeepSpeed's version);
tests/test_deepspeed_internals.py counts both files as the door.

    function                DeepSpeed object used                              why we need it                        caller
    convert_to_universal    ds_to_universal: DeepSpeedCheckpoint, its ZeRO-1/2 the experts' fragments, spread over the   training/universal_
                              steps (_check_for_required_state,                 expert-data-parallel groups, are merged  conversion.py
                              _create_checkpoint_paths, _group_per_tp_shapes,   by us between its extraction and its
                              _aggregate_autoep_zero12_metadata,                merge; its optimizer_state.pt's param
                              _extract_zero_shard_files, _merge_tp_slice_files, groups padded (its loader zips them
                              _save_optimizer_state)                            with the run's)
                            DeepSpeedCheckpoint.get_zero_checkpoint_state       a group with one momentum (Muon's) is
                              (wrapped), the optimizer state's layout           shown to the converter, which reads
                              (BASE_OPTIMIZER_STATE "state" by group,           exp_avg and exp_avg_sq by name, as
                              PARAM_SLICE_MAPPINGS)                             Adam's two moments; renamed back after

DeepSpeed's universal loader (load_hp_checkpoint_state) reads every ``<state>.pt`` of a parameter's folder under its
own name and rebuilds the flat state from whatever keys it found, so ``momentum_buffer.pt`` comes back as Muon's
state of that name; only the converter needs the two names.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.deepspeed_internals import SUPPORTED_VERSIONS  # noqa: F401 - the version check, on import

ONE_MOMENTUM = "momentum_buffer"
"""The state a Muon group keeps for each flat partition (training/muon.py), in place of Adam's two moments."""

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
"""The states DeepSpeed's converter extracts and merges for every parameter, by these names."""

PADDED_PARAM_GROUPS = 8
"""More than any run here makes (decay, no decay, the experts', Muon's)."""


class OneMomentumAsAdamMoments:
    """A DeepSpeedCheckpoint (attributes passed through) whose ZeRO states show each group holding one momentum as
    Adam's two moments, the same tensor under both names; the names of that group's parameters are marked as empty
    files in ``marks``. Pickled into the converter's extraction workers, so a module-level class."""

    def __init__(self, checkpoint: Any, marks: str) -> None:
        self.checkpoint, self.marks = checkpoint, marks

    def __getattr__(self, name: str) -> Any:
        if name in ("checkpoint", "marks"):  # while unpickling, before __dict__ is back
            raise AttributeError(name)
        return getattr(self.checkpoint, name)

    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int) -> dict[str, Any]:
        from deepspeed.checkpoint import constants

        state = self.checkpoint.get_zero_checkpoint_state(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index)
        optimizer = state[constants.OPTIMIZER_STATE_DICT]
        for group, moments in optimizer[constants.BASE_OPTIMIZER_STATE]["state"].items():
            if ONE_MOMENTUM in moments:
                momentum = moments.pop(ONE_MOMENTUM)
                moments.update(dict.fromkeys(ADAM_MOMENTS, momentum))
                for name in optimizer[constants.PARAM_SLICE_MAPPINGS][group]:
                    (Path(self.marks) / name).touch()
        return state


def _rename_one_momentum(zero_dir: str, marks: str) -> None:
    """Each marked parameter's merged ``exp_avg.pt`` back to ``momentum_buffer.pt``; its copy as exp_avg_sq gone."""
    for mark in Path(marks).iterdir():
        folder = Path(zero_dir) / mark.name
        (folder / f"{ADAM_MOMENTS[0]}.pt").rename(folder / f"{ONE_MOMENTUM}.pt")
        (folder / f"{ADAM_MOMENTS[1]}.pt").unlink()


def convert_to_universal(input_folder: str, output_folder: str, workers: int,
                         merge_own: Callable[[str, str, dict[str, Any], int, int], set[str]]) -> None:
    """DeepSpeed's universal-checkpoint converter (ds_to_universal.main's ZeRO-1/2 path, strict) with one step of
    ours between its extraction of every rank's ZeRO fragments (``<output>/tmp/<name>/<tp>/<state>.<dp>``) and its
    merge over TP: ``merge_own(temp_dir, zero_dir, slice_shapes, dp_degree, tp_degree)`` writes the universal files
    of the parameters it takes (``<zero_dir>/<name>/<state>.pt``) and returns their names, which DeepSpeed's merge
    then leaves out. ``slice_shapes``: {name: [shape of each TP rank's slice]}. A group with one momentum (Muon's)
    goes through as Adam's two moments (``OneMomentumAsAdamMoments``) and comes out as ``momentum_buffer.pt``.

    Its optimizer_state.pt keeps the checkpoint's param groups, which DeepSpeed's universal loader zips with the
    run's (load_hp_checkpoint_state_from_checkpoint_dir): a run with more groups (the experts' own at EP > 1, from a
    checkpoint written at EP 1) would leave its last groups unloaded, silently. Nothing but their number is read, so
    the list is padded with copies of its last group to ``PADDED_PARAM_GROUPS``."""
    import argparse
    import os
    import shutil

    import torch
    from deepspeed.checkpoint import constants
    from deepspeed.checkpoint import ds_to_universal as converter

    args = argparse.Namespace(input_folder=input_folder, output_folder=output_folder, num_extract_workers=workers,
                              num_merge_workers=max(1, workers // 2), keep_temp_folder=False, strict=True,
                              inject_missing_state=False)
    checkpoint = converter.DeepSpeedCheckpoint(input_folder)
    converter._check_for_required_state(checkpoint)
    converter._create_checkpoint_paths(output_folder, checkpoint.get_iteration(), checkpoint.tp_degree,
                                       checkpoint.pp_degree)
    shapes_by_rank, _, _ = converter._aggregate_autoep_zero12_metadata(checkpoint.model_state_metadata)
    slice_shapes = converter._group_per_tp_shapes(shapes_by_rank, checkpoint.pp_degree, checkpoint.tp_degree)
    temp_dir, zero_dir = os.path.join(output_folder, "tmp"), os.path.join(output_folder, "zero")
    marks = os.path.join(output_folder, "one_momentum")
    os.makedirs(marks, exist_ok=True)
    converter._extract_zero_shard_files(args, OneMomentumAsAdamMoments(checkpoint, marks), temp_dir)
    taken = merge_own(temp_dir, zero_dir, slice_shapes, checkpoint.dp_degree, checkpoint.tp_degree)
    converter._merge_tp_slice_files(args, checkpoint.get_checkpoint_info(constants.UNIVERSAL_CHECKPOINT_INFO),
                                    checkpoint.tp_degree, slice_shapes, temp_dir, exclude_param_names=taken)
    _rename_one_momentum(zero_dir, marks)
    converter._save_optimizer_state(args, checkpoint)
    state_path = os.path.join(zero_dir, "optimizer_state.pt")
    state = torch.load(state_path, weights_only=False)
    groups = state[constants.PARAM_GROUPS]
    groups.extend(dict(groups[-1]) for _ in range(PADDED_PARAM_GROUPS - len(groups)))
    torch.save(state, state_path)
    shutil.rmtree(temp_dir, ignore_errors=True)
    shutil.rmtree(marks, ignore_errors=True)
    for path in checkpoint.mp_rank_files:
        shutil.copy2(path, output_folder)
