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

And how DeepSpeed's universal-checkpoint converter merges this model's TP slices (``universal_checkpoint_info``,
saved in the client state of every checkpoint). Nothing here imports torch or DeepSpeed at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.files import write_text_atomically
from model.config import ModelConfig

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


def universal_checkpoint_info(config: ModelConfig, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """How DeepSpeed's universal-checkpoint converter merges this model's TP slices, by parameter name.

    Names are DeepSpeed's: the layer index in gpt_layer_specs, then the module path (0: the word embedding, tied:
    ``tied_modules.word_embeddings.weight`` (also L + 3's), untied: ``0.weight``; 1: positions (no parameter with
    RoPE); 2 .. L + 1: blocks; L + 2: the final norm; L + 3: the untied head, ``{L+3}.weight``). Only patterns that
    match a parameter of this config are listed (the converter's strict mode asserts that each matches).
    Everything not listed is column-parallel and concatenated on dim 0: QKV, whose rows are grouped per key/value
    group ([q heads of the group, k, v]; per head for multi-head attention), so a TP slice holds whole groups and the
    concatenation of the slices is the full weight, GQA included; its bias; fc1 and its bias. SwiGLU's gate_up
    stacks the rank's gate and up rows, so it is merged as two sub-parameters. The vocabulary padding is cut off and
    re-added for the new TP. ``tensor_parallel_size``: the TP of the checkpoint it describes (a Mixture-of-Experts
    model's expert shards are recorded with their widths).
    """
    from deepspeed.checkpoint import constants as uc

    block = r"\d+\."
    last = config.num_layers + 3
    vocabulary = ([r"tied_modules\.word_embeddings\.weight$"] if config.tie_word_embeddings
                  else [r"0\.weight$", rf"{last}\.weight$"])
    norm_parameters = r"(weight|bias)" if config.norm == "layernorm" else r"weight"
    mlp_in, mlp_out = ("fc1", "fc2") if config.mlp == "gelu" else ("gate_up", "down")
    replicated = [
        *([r"1\.weight$"] if config.position_embedding == "learned" else []),  # positions
        block + rf"ln[12]\.{norm_parameters}$",
        *([block + rf"attention\.[qk]_norm\.{norm_parameters}$"] if config.qk_layernorm else []),
        # row-parallel biases are added once, after the all-reduce
        *([block + r"attention\.dense\.bias$", block + rf"mlp\.{mlp_out}\.bias$"]
          if config.other_linears_have_bias else []),
        rf"{config.num_layers + 2}\.{norm_parameters}$",  # the final norm
    ]
    info = {
        uc.UNIVERSAL_CHECKPOINT_VERSION_KEY: uc.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        uc.VOCABULARY_PARAMETER_PATTERNS: vocabulary,
        uc.ORIGINAL_VOCAB_SIZE: config.vocab_size,
        uc.PIPELINE_REPLICATED_PARAMETER_PATTERNS: vocabulary if config.tie_word_embeddings else [],
        uc.TP_REPLICATED_PARAMETER_PATTERNS: replicated,
        uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [block + r"attention\.dense\.weight$",
                                                     block + rf"mlp\.{mlp_out}\.weight$"],
    }
    if config.mlp == "swiglu":
        info[uc.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = [block + rf"mlp\.{mlp_in}\.(weight|bias)$"]
    if config.moe is not None:
        _add_experts(info, config, tensor_parallel_size)
    return info


def _add_experts(info: dict[str, Any], config: ModelConfig, tensor_parallel_size: int) -> None:
    """The sparse blocks' tensors (model/moe.py): the router and the shared expert's gate replicated; the shared
    expert split as the dense SwiGLU; experts.gate_up [E, 2 F/R, h] as gate and up cut on dim 1 and experts.down
    [E, h, F/R] cut on dim 2, through DeepSpeed's sub-parameter shapes with each TP rank's widths. Listed only where
    the config has a sparse block, as the converter's strict mode wants."""
    from deepspeed.checkpoint import constants as uc

    moe, block = config.moe, r"\d+\.mlp\.block\."
    if not any(moe.is_sparse(number) for number in range(1, config.num_layers + 1)):
        return
    experts, ffn, widths = moe.num_experts, moe.moe_ffn_hidden_size, [moe.moe_ffn_hidden_size // tensor_parallel_size]
    info[uc.TP_REPLICATED_PARAMETER_PATTERNS].append(block + r"router\.weight$")
    gate_up, down = block + r"experts\.gate_up$", block + r"experts\.down$"
    info[uc.PARAMETER_WITH_SUB_PARAMS] = [
        {"patterns": [gate_up], "shape": (experts, (ffn, ffn), config.hidden_size), "partition_dim": 1},
        {"patterns": [down], "shape": (experts, config.hidden_size, (ffn,)), "partition_dim": 2}]
    info[uc.SUB_PARAM_SHARD_WIDTHS] = {gate_up: [widths * tensor_parallel_size] * 2,
                                       down: [widths * tensor_parallel_size]}
    if moe.shared_expert_ffn_hidden_size:
        info[uc.TP_REPLICATED_PARAMETER_PATTERNS].append(block + r"shared_expert\.gate$")
        info[uc.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0].append(block + r"shared_expert\.gate_up$")
        info[uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(block + r"shared_expert\.down$")
