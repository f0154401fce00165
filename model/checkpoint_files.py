"""The file layout of this project's checkpoints, in one place: who reads or writes them (training, reshaping,
Hugging Face conversion) goes through these names.

    <save>/latest                                     the newest complete checkpoint's tag, moved atomically
    <save>/global_step<N>/                            one checkpoint (its tag)
        layer_<LL>-model_<TT>-model_states.pt         pipeline layer LL, tensor-parallel rank TT (DeepSpeed); at
                                                      EP > 1 without the experts of a sparse layer (model/moe.py)
        experts_<LL>-model_<TT>-ep_<EE>.pt            at EP > 1: the experts of layer LL held by EP rank EE
                                                      ([E / EP, ...] each; training/expert_checkpoint.py)
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


def expert_file(tag_directory: Path, layer_index: int, tensor_parallel_rank: int, expert_parallel_rank: int) -> Path:
    """Not ``layer_*``: DeepSpeed globs ``layer_<LL>-*model_states.pt`` for a layer's TP shards, and its checkpoint
    reader counts every ``layer_*`` file as one."""
    return (Path(tag_directory) /
            f"experts_{layer_index:02d}-model_{tensor_parallel_rank:02d}-ep_{expert_parallel_rank:02d}.pt")


def expert_files(tag_directory: Path, layer_index: int, tensor_parallel_rank: int) -> list[Path]:
    """The expert files of one layer and TP rank, in EP-rank order (none when written at EP 1)."""
    pattern = f"experts_{layer_index:02d}-model_{tensor_parallel_rank:02d}-ep_*.pt"
    return sorted(Path(tag_directory).glob(pattern))


def read_experts(tag_directory: Path, layer_index: int, tensor_parallel_rank: int,
                 num_experts: int) -> dict[str, Any] | None:
    """The whole [E, ...] expert tensors of one layer and TP rank, by their names in the layer, concatenated from
    the EP ranks' files; None when the checkpoint was written at EP 1 (they are in the layer file). Memory-mapped."""
    import torch

    paths = expert_files(tag_directory, layer_index, tensor_parallel_rank)
    if not paths:
        return None
    expected = [expert_file(tag_directory, layer_index, tensor_parallel_rank, rank).name for rank in range(len(paths))]
    if [path.name for path in paths] != expected:
        raise ValueError(f"{tag_directory} holds expert files {[path.name for path in paths]} for layer "
                         f"{layer_index}, TP rank {tensor_parallel_rank}, not {expected}: the checkpoint is "
                         f"incomplete; restore the missing files or use another tag")
    shards = [torch.load(path, map_location="cpu", weights_only=True, mmap=True) for path in paths]
    whole = {name: torch.cat([shard[name] for shard in shards]) for name in shards[0]}
    for name, tensor in whole.items():
        if tensor.shape[0] != num_experts:
            raise ValueError(f"{paths[0].parent}: the {len(paths)} expert files of layer {layer_index} hold "
                             f"{tensor.shape[0]} experts of {name}, not model.moe.num_experts {num_experts}: they "
                             f"come from another model or are incomplete")
    return whole


def model_states_file(tag_directory: Path, model_parallel_rank: int) -> Path:
    return Path(tag_directory) / f"mp_rank_{model_parallel_rank:02d}_model_states.pt"


def rank_state_file(tag_directory: Path, rank: int) -> Path:
    return Path(tag_directory) / f"rank_state_{rank}.pt"


BLOCK_PREFIX = r"\d+\.(depths\.\d+\.block\.)?"
"""The DeepSpeed names of a block's parameters start so: its layer index, or model.mtp's layer index and depth."""


def universal_checkpoint_info(config: ModelConfig) -> dict[str, Any]:
    """How DeepSpeed's universal-checkpoint converter merges this model's TP slices, by parameter name.

    Names are DeepSpeed's: the layer index in gpt_layer_specs, then the module path (0: the word embedding, tied:
    ``tied_modules.word_embeddings.weight`` (also L + 3's), untied: ``0.weight``; 1: positions (no parameter with
    RoPE); 2 .. L + 1: blocks; L + 2: the final norm; L + 3: the untied head, ``{L+3}.weight``). Only patterns that
    match a parameter of this config are listed (the converter's strict mode asserts that each matches).
    Everything not listed is column-parallel and concatenated on dim 0: QKV, whose rows are grouped per key/value
    group ([q heads of the group, k, v]; per head for multi-head attention), so a TP slice holds whole groups and the
    concatenation of the slices is the full weight, GQA included; its bias; fc1 and its bias. SwiGLU's gate_up
    stacks the rank's gate and up rows, so it is merged as two sub-parameters. The vocabulary padding is cut off and
    re-added for the new TP. MLA (model/mla.py): its down-projections and their norms are replicated; q_b_proj (or
    q_proj) and kv_b_proj hold whole heads per rank (concatenated), its output projection is ``dense``.
    model.mtp (model/mtp.py): layer L + 5 holds ``depths.{k}.block.`` (a block, named as the others after that
    prefix: ``BLOCK_PREFIX``) and the replicated enorm, hnorm, eh_proj and final_norm; the last stage's copy of the
    embedding and an untied head are tied modules (``tied_modules.output_head.weight``).
    """
    from deepspeed.checkpoint import constants as uc

    block = BLOCK_PREFIX
    last = config.num_layers + 3
    embedding = r"tied_modules\.word_embeddings\.weight$"
    if config.tie_word_embeddings:
        vocabulary = [embedding]
    elif config.mtp is not None:  # model/gpt.py: the last stage's copies of the embedding and the head are tied
        vocabulary = [embedding, r"tied_modules\.output_head\.weight$"]
    else:
        vocabulary = [r"0\.weight$", rf"{last}\.weight$"]
    norm_parameters = r"(weight|bias)" if config.norm == "layernorm" else r"weight"
    mlp_in, mlp_out = ("fc1", "fc2") if config.mlp == "gelu" else ("gate_up", "down")
    replicated = [
        *([r"1\.weight$"] if config.position_embedding == "learned" else []),  # positions
        block + rf"ln[12]\.{norm_parameters}$",
        *([block + rf"attention\.[qk]_norm\.{norm_parameters}$"] if config.qk_layernorm else []),
        *_latent_attention_replicated(config, block),
        # row-parallel biases are added once, after the all-reduce
        *([block + r"attention\.dense\.bias$", block + rf"mlp\.{mlp_out}\.bias$"]
          if config.other_linears_have_bias else []),
        rf"{config.num_layers + 2}\.{norm_parameters}$",  # the final norm
        *([rf"\d+\.depths\.\d+\.(enorm|hnorm|final_norm)\.{norm_parameters}$", r"\d+\.depths\.\d+\.eh_proj\.weight$"]
          if config.mtp is not None else []),  # model/mtp.py: replicated
    ]
    info = {
        uc.UNIVERSAL_CHECKPOINT_VERSION_KEY: uc.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        uc.VOCABULARY_PARAMETER_PATTERNS: vocabulary,
        uc.ORIGINAL_VOCAB_SIZE: config.vocab_size,
        uc.PIPELINE_REPLICATED_PARAMETER_PATTERNS: [embedding] if config.tie_word_embeddings or config.mtp else [],
        uc.TP_REPLICATED_PARAMETER_PATTERNS: replicated,
        uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [block + r"attention\.dense\.weight$",
                                                     block + rf"mlp\.{mlp_out}\.weight$"],
    }
    if config.mlp == "swiglu":
        info[uc.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = [block + rf"mlp\.{mlp_in}\.(weight|bias)$"]
    if config.moe is not None:
        _add_experts(info, config)
    return info


def _latent_attention_replicated(config: ModelConfig, block: str) -> list[str]:
    """MLA's replicated tensors: the down-projections (their biases with bias "all") and the latent norms."""
    if config.attention_type != "mla":
        return []
    down = r"(q_a_proj|kv_a_proj_with_mqa)" if config.q_lora_rank is not None else r"kv_a_proj_with_mqa"
    norms = r"(q_a_layernorm|kv_a_layernorm)" if config.q_lora_rank is not None else r"kv_a_layernorm"
    parameters = r"(weight|bias)" if config.other_linears_have_bias else r"weight"
    return [block + rf"attention\.{down}\.{parameters}$", block + rf"attention\.{norms}\.weight$"]


def _add_experts(info: dict[str, Any], config: ModelConfig) -> None:
    """The sparse blocks' tensors (model/moe.py) but the experts: the router and the shared expert's gate
    replicated, the shared expert split as the dense SwiGLU. Listed only where the config has a sparse block, as the
    converter's strict mode wants. The experts ([E_l, 2 F/R, h], [E_l, h, F/R] at any EP) are not the converter's:
    their ZeRO fragments are spread over the expert-data-parallel groups, which it does not know, so
    training/universal_conversion.py merges them itself and leaves them out of its merge."""
    from deepspeed.checkpoint import constants as uc

    moe, block = config.moe, BLOCK_PREFIX + r"mlp\.block\."
    if not any(moe.is_sparse(number) for number in range(1, config.num_layers + 1)):
        return
    info[uc.TP_REPLICATED_PARAMETER_PATTERNS].append(block + r"router\.weight$")
    if moe.shared_expert_ffn_hidden_size:
        info[uc.TP_REPLICATED_PARAMETER_PATTERNS].append(block + r"shared_expert\.gate$")
        info[uc.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0].append(block + r"shared_expert\.gate_up$")
        info[uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(block + r"shared_expert\.down$")
