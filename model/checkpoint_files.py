"""The file layout of this project's checkpoints, in one place: who reads or writes them (training, reshaping,
Hugging Face conversion) goes through these names.

    <save>/latest                                     the newest complete checkpoint's tag, moved atomically
    <save>/global_step<N>/                            one checkpoint (its tag)
        layer_<LL>-model_<TT>-model_states.pt         pipeline layer LL, tensor-parallel rank TT (DeepSpeed)
        mp_rank_<MM>_model_states.pt                  model-parallel rank MM: client state (run config, train
                                                      state, universal_checkpoint_info) (DeepSpeed)
        zero_pp_rank_<D>_mp_rank_<MM>_optim_states.pt ZeRO-1 optimizer shards (DeepSpeed)
        rank_state_<R>.pt                             global rank R: dropout streams, spike-guard EWM
        checkpoint.json                               layout, and every file's size and CRC-32
    <save>/universal/global_step<N>/                  DeepSpeed's universal conversion, for another layout

Nothing here imports torch or DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path

from common.files import write_text_atomically

LATEST = "latest"
RECORD = "checkpoint.json"
UNIVERSAL = "universal"


def tag_for_step(step: int) -> str:
    return f"global_step{step}"


def read_latest(directory: str | Path) -> str | None:
    path = Path(directory) / LATEST
    if not path.exists():
        return None
    tag = path.read_text().strip()
    if not tag or not (Path(directory) / tag).is_dir():
        raise ValueError(f"{path} names checkpoint {tag!r}, which does not exist in {directory}: restore that "
                         f"directory or point {LATEST} at a complete checkpoint")
    return tag


def write_latest(directory: str | Path, tag: str) -> None:
    """Atomically point ``latest`` at ``tag``."""
    write_text_atomically(Path(directory) / LATEST, tag)


def layer_file(tag_directory: Path, layer_index: int, tensor_parallel_rank: int) -> Path:
    """DeepSpeed's PipelineModule.ckpt_layer_path with axes (pipe, data, model): only the model (TP) rank is named."""
    return Path(tag_directory) / f"layer_{layer_index:02d}-model_{tensor_parallel_rank:02d}-model_states.pt"


def model_states_file(tag_directory: Path, model_parallel_rank: int) -> Path:
    return Path(tag_directory) / f"mp_rank_{model_parallel_rank:02d}_model_states.pt"


def rank_state_file(tag_directory: Path, rank: int) -> Path:
    return Path(tag_directory) / f"rank_state_{rank}.pt"
