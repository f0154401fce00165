"""Reading a checkpoint of this project, one layer at a time, checked against the split its run config claims.

The file names are model/checkpoint_files.py's; what each file holds:

    <dir>/<tag>/layer_XX-model_YY-model_states.pt   layer XX of gpt_layer_specs on TP rank YY (a plain state_dict)
    <dir>/<tag>/mp_rank_MM_model_states.pt           DeepSpeed's bookkeeping and the client_state (run_config,
                                                     train_state); MM = stage * TP + YY
    <dir>/<tag>/experts_XX-model_YY-ep_EE.pt         at expert-parallel size > 1: EP rank EE's experts of layer XX,
                                                     which its layer files do not hold; read_layer joins them, so a
                                                     layer reads the same whatever EP wrote it

Only one layer's shards are read at a time, memory-mapped, so only what is used is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf.tables import LayerMap, layer_maps, shard_shape
from model.checkpoint_files import layer_file, model_states_file, read_experts, read_latest
from model.config import ModelConfig, ParallelConfig, preset, upgrade_model_fields


def _load(path: Path) -> Any:
    """Tensors and plain containers only (no pickled code); memory-mapped, so only what is used is read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: the checkpoint is incomplete; convert another tag") from None
    except Exception as error:
        raise ValueError(f"{path} cannot be read as a PyTorch checkpoint file ({error}): it is truncated or was not "
                         "written by DeepSpeed; convert another tag") from None


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """A run config's "model" block (a preset name plus overrides, or every field) -> ModelConfig."""
    values = upgrade_model_fields(values)
    name = values.pop("preset", None)
    return preset(name, **values) if name else ModelConfig(**values)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint of this project on disk, checked against the split its run config claims."""

    directory: Path
    """The checkpoint directory, the one holding ``latest``."""
    tag: str
    model: ModelConfig
    parallel: ParallelConfig
    client_state: dict[str, Any]
    """What the trainer saved beside the model: run_config, train_state."""

    @property
    def tag_directory(self) -> Path:
        return self.directory / self.tag

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallel.tensor_parallel_size


def _resolve_tag(directory: Path, tag: str | None) -> str:
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory {directory} does not exist")
    if tag is None:
        tag = read_latest(directory)
        if tag is None:
            raise ValueError(f"{directory} has no `latest` file, so no complete checkpoint: point --checkpoint at the "
                             f"run's checkpoint directory (training.save), or pass --tag global_stepN to convert a "
                             f"specific checkpoint")
    elif not (directory / tag).is_dir():
        found = sorted(p.name for p in directory.iterdir() if p.is_dir())
        raise ValueError(f"{directory} has no checkpoint {tag!r}: found {found}")
    return tag


def open_checkpoint(directory: str | Path, tag: str | None = None) -> Checkpoint:
    """Find and check a checkpoint: ``latest`` (or ``tag``), the run config, every shard file present and no extra.

    Raises ValueError naming the file and the fix. Shapes are checked as each layer is read (``read_layer``).
    """
    directory = Path(directory)
    tag = _resolve_tag(directory, tag)
    states_file = model_states_file(directory / tag, 0)
    states = _load(states_file)
    if not isinstance(states, dict) or "run_config" not in states:
        raise ValueError(f"{states_file} has no run_config in its client_state: it was not written by this project's "
                         "trainer (training/checkpoint.py), so its model shape and split are unknown")
    run_config = states["run_config"]
    client_state = {key: states[key] for key in ("run_config", "train_state") if key in states}
    del states
    try:
        model = model_config_from_dict(run_config["model"])
        parallel = ParallelConfig(**{k: v for k, v in run_config.get("parallelism", {}).items()
                                     if k in ("tensor_parallel_size", "pipeline_parallel_size")})
        model.check_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{states_file}: its run_config does not describe a valid model and split: {error}") from None
    _check_files(directory / tag, model, parallel)
    return Checkpoint(directory, tag, model, parallel, client_state)


def _check_files(tag_directory: Path, model: ModelConfig, parallel: ParallelConfig) -> None:
    """Every layer file of every TP rank present, none beyond."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    claim = f"the run_config's tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
    states = sorted(p.name for p in tag_directory.glob("mp_rank_*_model_states.pt"))
    if len(states) != tp * pp:
        raise ValueError(f"{tag_directory} holds {len(states)} mp_rank_*_model_states.pt files but {claim} means "
                         f"{tp * pp}: the files come from another split, or some are missing")
    maps = layer_maps(model)
    expected = {layer_file(tag_directory, layer.index, rank).name for layer in maps for rank in range(tp)}
    present = {p.name for p in tag_directory.glob("layer_*-model_states.pt")}
    extra = sorted(present - expected)
    if extra:
        raise ValueError(f"{tag_directory} holds layer files that {claim} with {model.num_layers} layers does not "
                         f"have: {extra[:6]}: the run_config does not match the files (another TP size or depth)")
    missing = sorted(expected - present)
    if missing:
        raise ValueError(f"{tag_directory} is missing {len(missing)} shard file(s) of {claim}: {missing[:6]}: the "
                         f"checkpoint is incomplete (copy the missing files, or convert an earlier tag)")


def read_layer(checkpoint: Checkpoint, layer: LayerMap) -> list[dict[str, torch.Tensor]]:
    """The state_dict of each TP rank of one layer, shapes checked (memory-mapped: read as used)."""
    tp = checkpoint.tensor_parallel_size
    shards = []
    for rank in range(tp):
        path = layer_file(checkpoint.tag_directory, layer.index, rank)
        state = _load(path)
        if checkpoint.model.moe is not None and isinstance(state, dict):
            try:
                experts = read_experts(checkpoint.tag_directory, layer.index, rank, checkpoint.model.moe.num_experts)
            except ValueError:
                raise
            except Exception as error:
                raise ValueError(f"{checkpoint.tag_directory}: the expert files of layer {layer.index} cannot be read "
                                 f"({error}): they are truncated; convert another tag") from None
            state = {**state, **(experts or {})}
        _check_layer_state(path, state, layer, checkpoint.model, tp)
        shards.append(state)
    return shards


def _check_layer_state(path: Path, state: Any, layer: LayerMap, config: ModelConfig, tp: int) -> None:
    names = {t.ours for t in layer.tensors}
    if isinstance(state, dict) and names - set(state) and all(".experts." in name for name in names - set(state)):
        raise ValueError(f"{path} holds no experts (written at expert_parallel_size > 1) and "
                         f"{path.parent} has no experts_{layer.index:02d}-model_*-ep_*.pt files: the checkpoint is "
                         f"incomplete; copy its experts_* files or convert another tag")
    if not isinstance(state, dict) or set(state) != names:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path}: expected the {layer.name} tensors {sorted(names)}, found {found}: the file does "
                         f"not belong at layer index {layer.index} of a {config.num_layers}-layer model")
    for tensor in layer.tensors:
        expected = shard_shape(tensor, config, tp)
        if tuple(state[tensor.ours].shape) != expected:
            raise ValueError(f"{path}: {tensor.ours} has shape {tuple(state[tensor.ours].shape)}, but the "
                             f"checkpoint's run_config (tensor_parallel_size {tp}, hidden {config.hidden_size}, "
                             f"ffn {config.ffn_hidden_size}, vocab {config.vocab_size}) means {expected}: the file "
                             f"was written with another split or model shape than the run_config claims")

