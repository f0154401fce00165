"""A checkpoint to DeepSpeed's universal format: its converter, and the experts merged by us.

    python -m training.universal_conversion --input <save>/<tag> --output <save>/universal/<tag>.tmp

DeepSpeed's converter (common/deepspeed_conversion.py convert_to_universal) extracts every rank's ZeRO fragments,
``tmp/<name>/<tp>/<state>.<dp>``, and merges each parameter's fragments in data-parallel order, then over TP. That
order is wrong for the experts of an expert-parallel run: each EP rank's experts ([E_l, ...]) are sharded over its
expert-data-parallel group, the data-parallel ranks d with d mod EP = its EP rank, in the order d div EP (DeepSpeed's
groups: EP groups are EP consecutive data-parallel ranks). So the experts are ours (``merge_experts``):

    for each TP rank t:  [E, ...] = concat over EP ranks e of (concat over k of the fragment of d = k EP + e)
    over TP:             gate_up [E, 2F, h] = [gates of t = 0 .. R-1 ; ups of t = 0 .. R-1] on dim 1 (each TP slice
                         stacks its gate and up rows); down [E, h, F] = concat on dim 2

written with DeepSpeed's expert markers (``is_expert_param``, ``ep_num_experts``), so that its universal loader
takes the E / EP experts of the loading rank's EP rank, then its TP slice (two sub-parameters on dim 1 for gate_up;
dim 2 for down). At EP 1 the same step is the plain concatenation, so every EP goes this one way.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

from common import deepspeed_conversion
from model.checkpoint_files import BLOCK_PREFIX

EXPERT_PARAMETER = re.compile(BLOCK_PREFIX + r"mlp\.block\.experts\.(gate_up|down)$")
"""The experts' parameters by their DeepSpeed names (pipeline layer index, then the module path: model/moe.py)."""

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _expert_parallel_size(slice_shapes: dict[str, list], num_experts: int) -> int:
    local = {shapes[0][0] for name, shapes in slice_shapes.items() if EXPERT_PARAMETER.search(name)}
    if len(local) != 1 or num_experts % next(iter(local)):
        raise ValueError(f"the experts' slices hold {sorted(local)} experts each, which does not divide "
                         f"model.moe.num_experts {num_experts}: the checkpoint's files disagree with its run_config")
    return num_experts // next(iter(local))


def _rank_slice(folder: Path, state: str, expert_parallel_size: int, data_parallel_size: int,
                shape: list[int]) -> torch.Tensor:
    """One TP rank's [E, ...] of one state: its EP ranks' experts in order, each from its EDP fragments in order."""
    parts = [folder / f"{state}.{k * expert_parallel_size + e:02d}"
             for e in range(expert_parallel_size) for k in range(data_parallel_size // expert_parallel_size)]
    flat = torch.cat([torch.load(path, weights_only=True) for path in parts if path.exists()])
    return flat.reshape(expert_parallel_size * shape[0], *shape[1:])


def merge_experts(num_experts: int, temp_dir: str, zero_dir: str, slice_shapes: dict[str, list],
                  data_parallel_size: int, tensor_parallel_size: int) -> set[str]:
    """The experts' universal files (module docstring); returns their names."""
    from deepspeed.checkpoint import constants as uc

    names = {name for name in slice_shapes if EXPERT_PARAMETER.search(name)}
    if not names:
        return names
    expert_parallel_size = _expert_parallel_size(slice_shapes, num_experts)
    for name in sorted(names):
        gate_up = name.endswith("gate_up")
        output = Path(zero_dir) / name
        output.mkdir(parents=True, exist_ok=True)
        for state in STATES:
            slices = [_rank_slice(Path(temp_dir) / name / str(t), state, expert_parallel_size, data_parallel_size,
                                  list(slice_shapes[name][t])) for t in range(tensor_parallel_size)]
            if gate_up:
                halves = [piece.chunk(2, dim=1) for piece in slices]
                whole = torch.cat([half[0] for half in halves] + [half[1] for half in halves], dim=1)
                layout: dict[str, Any] = {uc.CAT_DIM: 1, uc.PARAM_N_SUB_PARAMS: 2}
            else:
                whole, layout = torch.cat(slices, dim=2), {uc.CAT_DIM: 2}
            torch.save({uc.PARAM: whole, uc.EP_IS_EXPERT_PARAM: True, uc.EP_NUM_EXPERTS: num_experts, **layout},
                       output / f"{state}.pt")
        steps = sorted((Path(temp_dir) / name / "0").glob("step.*"))
        if steps:
            torch.save(torch.load(steps[0], weights_only=True), output / "step.pt")
    return names


def convert(input_folder: str | Path, output_folder: str | Path, workers: int) -> None:
    from hf.checkpoint_reader import model_config_from_dict
    from model.checkpoint_files import model_states_file

    states = torch.load(model_states_file(Path(input_folder), 0), map_location="cpu", weights_only=True)
    model = model_config_from_dict(dict(states["run_config"]["model"]))
    num_experts = model.moe.num_experts if model.moe is not None else 0

    def merge_own(temp_dir: str, zero_dir: str, slice_shapes: dict[str, list], dp: int, tp: int) -> set[str]:
        return merge_experts(num_experts, temp_dir, zero_dir, slice_shapes, dp, tp) if num_experts else set()

    deepspeed_conversion.convert_to_universal(str(input_folder), str(output_folder), workers, merge_own)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="a checkpoint's tag directory, <save>/global_stepN")
    parser.add_argument("--output", required=True, help="where the universal checkpoint goes")
    parser.add_argument("--workers", type=int, default=2, help="processes extracting the ZeRO fragments")
    args = parser.parse_args(argv)
    convert(args.input, args.output, args.workers)


if __name__ == "__main__":
    main()
