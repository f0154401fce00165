"""Hugging Face interop: a checkpoint of this project <-> a ``transformers`` ``GPT2LMHeadModel``, one layer at a time.

Both are the same function (pre-LN GPT, learned positions, GeLU MLP of ffn, tied embedding, causal attention scaled
by 1/sqrt(d)). The tensors differ in four ways, all handled by ``TensorMap`` below and nowhere else:

    here (TP shards merged)                               Hugging Face GPT-2
    word embedding [V_padded, h], rows split over TP      transformer.wte.weight [V, h]: padding rows dropped
    qkv.weight [3h, h], rows [heads, 3 (q,k,v), d]        attn.c_attn.weight [h, 3h], columns [3 (q,k,v), heads, d]
    Linear weights [out, in] (split over TP)              Conv1D weights [in, out]: the transpose
    blocks are layers 2..L+1 of the pipeline              transformer.h.0 .. h.{L-1}

The padded vocabulary rows (ids >= vocab_size, whose logits this project forces to -inf) are dropped on export: the
HF model has exactly the tokenizer's vocabulary and gives the same distribution. On import they are zeros.

The checkpoint layout (DeepSpeed's pipeline engine, via training/checkpoint.py), read and written here:

    <dir>/latest                                     the tag of the newest complete checkpoint, e.g. global_step1000
    <dir>/<tag>/layer_XX-model_YY-model_states.pt   layer XX of gpt_layer_specs on TP rank YY (a plain state_dict):
                                                     0 word embedding (tied: saved once), 1 positions,
                                                     2..L+1 transformer blocks, L+2 final LayerNorm
    <dir>/<tag>/mp_rank_MM_model_states.pt           one per stage x TP rank, MM = stage * TP + YY: DeepSpeed's
                                                     bookkeeping and the client_state (run_config, train_state)
    <dir>/<tag>/[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt   ZeRO fp32 master weights and Adam moments

Memory: only one layer's shards are read at a time (memory-mapped) and each output tensor is written as soon as it is
merged, into safetensors files whose headers are planned up front; peak memory follows the largest layer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from model.config import GPT2_VOCAB_SIZE, ModelConfig, ParallelConfig, preset
from training.checkpoint import read_latest, write_latest

HF_ARCHITECTURE = "GPT2LMHeadModel"
IMPORT_TAG = "global_step0"
IMPORT_RECORD = "hf_import.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
ACTIVATION_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
ACTIVATION_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                      "gelu_fast": "gelu_tanh"}  # the three tanh approximations agree to ~1e-7
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


# -- the map between the two models ----------------------------------------------------------------------------------

class TensorMap(NamedTuple):
    """One tensor of one layer, here and in Hugging Face."""

    ours: str
    """Key in the layer's state_dict (one layer_XX file)."""
    hf: str
    """Key in the HF GPT2LMHeadModel state_dict."""
    dims: tuple[str, ...]
    """Unsharded shape here, in the symbols of ``_dimensions`` (h, 3h, f, positions, padded_vocab)."""
    partition_dim: int | None = None
    """Dimension split over TP ranks here; None: replicated on every TP rank."""
    transposed: bool = False
    """HF's Conv1D stores [in, out], the transpose of our Linear's [out, in]."""
    layout: str = "plain"
    """"qkv": rows per head [heads, 3, d] here, [3, heads, d] in HF; "vocab": padding rows here only."""


class LayerMap(NamedTuple):
    index: int
    """Position in gpt_layer_specs, the XX of layer_XX files."""
    name: str
    tensors: tuple[TensorMap, ...]


def _block_tensors(block: int) -> tuple[TensorMap, ...]:
    hf = f"transformer.h.{block}."
    return (
        TensorMap("ln1.weight", hf + "ln_1.weight", ("h",)),
        TensorMap("ln1.bias", hf + "ln_1.bias", ("h",)),
        TensorMap("attention.qkv.weight", hf + "attn.c_attn.weight", ("3h", "h"), 0, True, "qkv"),
        TensorMap("attention.qkv.bias", hf + "attn.c_attn.bias", ("3h",), 0, False, "qkv"),
        TensorMap("attention.dense.weight", hf + "attn.c_proj.weight", ("h", "h"), 1, True),
        TensorMap("attention.dense.bias", hf + "attn.c_proj.bias", ("h",)),
        TensorMap("ln2.weight", hf + "ln_2.weight", ("h",)),
        TensorMap("ln2.bias", hf + "ln_2.bias", ("h",)),
        TensorMap("mlp.fc1.weight", hf + "mlp.c_fc.weight", ("f", "h"), 0, True),
        TensorMap("mlp.fc1.bias", hf + "mlp.c_fc.bias", ("f",), 0),
        TensorMap("mlp.fc2.weight", hf + "mlp.c_proj.weight", ("h", "f"), 1, True),
        TensorMap("mlp.fc2.bias", hf + "mlp.c_proj.bias", ("h",)),
    )


def _require_gpt2_shape(config: ModelConfig) -> None:
    """The map below is GPT2LMHeadModel's; the Llama-family options of ModelConfig have no map to HF yet."""
    gpt2 = ModelConfig(num_layers=1, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                       seq_length=1)
    different = [name for name in ("position_embedding", "norm", "mlp", "num_key_value_heads", "tie_word_embeddings",
                                   "bias") if getattr(config, name) != getattr(gpt2, name)]
    if different:
        raise ValueError(f"only the GPT-2 shape converts to and from Hugging Face so far; this model differs in "
                         f"{', '.join(f'model.{name} = {getattr(config, name)!r}' for name in different)}")


def layer_maps(config: ModelConfig) -> list[LayerMap]:
    """Every saved layer, in pipeline order (the tied output head, layer L+3, is the embedding: not saved again)."""
    _require_gpt2_shape(config)
    embedding = TensorMap("weight", "transformer.wte.weight", ("padded_vocab", "h"), 0, layout="vocab")
    positions = TensorMap("weight", "transformer.wpe.weight", ("positions", "h"))
    final = (TensorMap("weight", "transformer.ln_f.weight", ("h",)), TensorMap("bias", "transformer.ln_f.bias", ("h",)))
    blocks = [LayerMap(2 + i, f"transformer block {i}", _block_tensors(i)) for i in range(config.num_layers)]
    return [LayerMap(0, "word embedding", (embedding,)), LayerMap(1, "position embedding", (positions,)), *blocks,
            LayerMap(config.num_layers + 2, "final LayerNorm", final)]


def _dimensions(config: ModelConfig, tensor_parallel_size: int) -> dict[str, int]:
    h = config.hidden_size
    return {"h": h, "3h": 3 * h, "f": config.ffn_hidden_size, "positions": config.max_position_embeddings,
            "padded_vocab": config.padded_vocab_size(tensor_parallel_size)}


def full_shape(tensor: TensorMap, config: ModelConfig, tensor_parallel_size: int) -> tuple[int, ...]:
    """The unsharded shape here (the vocabulary padded for this TP size)."""
    sizes = _dimensions(config, tensor_parallel_size)
    return tuple(sizes[d] for d in tensor.dims)


def shard_shape(tensor: TensorMap, config: ModelConfig, tensor_parallel_size: int) -> tuple[int, ...]:
    shape = list(full_shape(tensor, config, tensor_parallel_size))
    if tensor.partition_dim is not None:
        shape[tensor.partition_dim] //= tensor_parallel_size
    return tuple(shape)


def hf_shape(tensor: TensorMap, config: ModelConfig) -> tuple[int, ...]:
    shape = full_shape(tensor, config, 1)
    if tensor.layout == "vocab":
        shape = (config.vocab_size, *shape[1:])
    return tuple(reversed(shape)) if tensor.transposed else shape


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the exported model, in the order the export writes them."""
    return {t.hf: hf_shape(t, config) for layer in layer_maps(config) for t in layer.tensors}


def _qkv_hf_to_heads(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows [3, heads, d] -> [heads, 3, d] (any trailing dims)."""
    return tensor.reshape(3, num_heads, -1, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


def merge_to_hf(tensor: TensorMap, shards: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The TP shards of one tensor (rank order) -> the HF tensor. Replicated: rank 0's copy.

    One allocation: each shard is copied straight into its place in the output (no concatenated intermediate).
    """
    out = torch.empty(hf_shape(tensor, config), dtype=shards[0].dtype)
    ours = out.t() if tensor.transposed else out  # the output seen in our [out, in] orientation
    if tensor.partition_dim is None:
        ours.copy_(shards[0])
    elif tensor.layout == "qkv":  # rows [3, heads, d] in the output, [heads/R, 3, d] in each shard
        heads = config.num_attention_heads // len(shards)
        ours = ours.unflatten(0, (3, config.num_attention_heads, -1))
        for rank, shard in enumerate(shards):
            ours.narrow(1, rank * heads, heads).copy_(shard.unflatten(0, (heads, 3, -1)).transpose(0, 1))
    else:
        for rank, shard in enumerate(shards):
            size = shard.shape[tensor.partition_dim]
            start = rank * size
            size = min(size, ours.shape[tensor.partition_dim] - start)  # the vocabulary padding is dropped
            if size > 0:
                ours.narrow(tensor.partition_dim, start, size).copy_(shard.narrow(tensor.partition_dim, 0, size))
    return out


def split_from_hf(tensor: TensorMap, value: torch.Tensor, config: ModelConfig,
                  tensor_parallel_size: int) -> list[torch.Tensor]:
    """An HF tensor -> this project's shard for each TP rank (rank order), each its own storage."""
    full = value.t() if tensor.transposed else value
    if tensor.layout == "qkv":
        full = _qkv_hf_to_heads(full, config.num_attention_heads)
    elif tensor.layout == "vocab":
        padding = config.padded_vocab_size(tensor_parallel_size) - full.shape[0]
        full = torch.cat([full, full.new_zeros(padding, *full.shape[1:])])  # padded ids: logits are -inf anyway
    if tensor.partition_dim is None:
        return [full.clone(memory_format=torch.contiguous_format) for _ in range(tensor_parallel_size)]
    # clone: torch.save of a view would write the whole underlying storage into every shard file
    return [chunk.clone(memory_format=torch.contiguous_format)
            for chunk in full.chunk(tensor_parallel_size, dim=tensor.partition_dim)]


# -- reading a checkpoint of this project ----------------------------------------------------------------------------

def layer_file(tag_directory: Path, layer_index: int, tensor_parallel_rank: int) -> Path:
    """DeepSpeed's PipelineModule.ckpt_layer_path with axes (pipe, data, model): only the model (TP) rank is named."""
    return Path(tag_directory) / f"layer_{layer_index:02d}-model_{tensor_parallel_rank:02d}-model_states.pt"


def model_states_file(tag_directory: Path, model_parallel_rank: int) -> Path:
    return Path(tag_directory) / f"mp_rank_{model_parallel_rank:02d}_model_states.pt"


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
    values = dict(values)
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
        _check_layer_state(path, state, layer, checkpoint.model, tp)
        shards.append(state)
    return shards


def _check_layer_state(path: Path, state: Any, layer: LayerMap, config: ModelConfig, tp: int) -> None:
    names = {t.ours for t in layer.tensors}
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


# -- writing safetensors a tensor at a time --------------------------------------------------------------------------

def parse_size(size: str | int) -> int:
    """"5GB" -> 5e9 bytes (KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary), or plain bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            text, multiplier = text[: -len(unit)], factor
            break
    else:
        multiplier = 1
    try:
        value = float(text) * multiplier
    except ValueError:
        raise ValueError(f"size {size!r} is not a number of bytes like 5GB, 500MB or 2000000") from None
    if value <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return int(value)


class SafetensorsShardWriter:
    """Writes tensors whose names and shapes are known up front, one at a time and in that order, into safetensors
    files of at most ``max_shard_bytes`` each (a bigger tensor gets a file of its own), plus the index that
    ``from_pretrained`` reads when there is more than one file. Each file's header is written first, so no tensor is
    held after ``write`` returns."""

    def __init__(self, directory: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 max_shard_bytes: int) -> None:
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"cannot write dtype {dtype} to safetensors: use one of {list(_SAFETENSORS_DTYPES)}")
        self.directory, self.shapes, self.dtype = Path(directory), shapes, dtype
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.files = self._plan(max_shard_bytes)
        self.order = [name for names in self.files for name in names]
        self.position, self.file_number, self.handle = 0, -1, None

    def _bytes(self, name: str) -> int:
        return self.element_size * int(torch.Size(self.shapes[name]).numel())

    def _plan(self, max_shard_bytes: int) -> list[list[str]]:
        files, size = [[]], 0
        for name in self.shapes:
            if files[-1] and size + self._bytes(name) > max_shard_bytes:
                files.append([])
                size = 0
            files[-1].append(name)
            size += self._bytes(name)
        return files

    def file_name(self, number: int) -> str:
        if len(self.files) == 1:
            return "model.safetensors"
        return f"model-{number + 1:05d}-of-{len(self.files):05d}.safetensors"

    def _header(self, names: list[str]) -> bytes:
        entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            entries[name] = {"dtype": _SAFETENSORS_DTYPES[self.dtype], "shape": list(self.shapes[name]),
                             "data_offsets": [offset, offset + self._bytes(name)]}
            offset += self._bytes(name)
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        return struct.pack("<Q", len(header)) + header

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.position >= len(self.order) or name != self.order[self.position]:
            expected = self.order[self.position] if self.position < len(self.order) else "nothing more"
            raise RuntimeError(f"safetensors writer: got {name}, expected {expected}")
        if tuple(tensor.shape) != self.shapes[name]:
            raise RuntimeError(f"safetensors writer: {name} has shape {tuple(tensor.shape)}, planned {self.shapes[name]}")
        if self.file_number + 1 < len(self.files) and name == self.files[self.file_number + 1][0]:
            self._next_file()
        data = tensor.detach().to(self.dtype).contiguous().reshape(-1)
        self.handle.write(data.view(torch.uint8).numpy().data)
        self.position += 1

    def _next_file(self) -> None:
        if self.handle is not None:
            self.handle.close()
        self.file_number += 1
        self.handle = open(self.directory / self.file_name(self.file_number), "wb")
        self.handle.write(self._header(self.files[self.file_number]))

    def close(self) -> list[str]:
        """Finish (every planned tensor must have been written); returns the file names."""
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        if self.position != len(self.order):
            raise RuntimeError(f"safetensors writer closed after {self.position} of {len(self.order)} tensors")
        names = [self.file_name(number) for number in range(len(self.files))]
        if len(self.files) > 1:
            index = {"metadata": {"total_size": sum(self._bytes(n) for n in self.order)},
                     "weight_map": {n: self.file_name(i) for i, names_ in enumerate(self.files) for n in names_}}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


# -- export ----------------------------------------------------------------------------------------------------------

def hf_config(config: ModelConfig, dtype: torch.dtype, end_of_text_id: int | None):
    """The transformers GPT2Config of this model (vocabulary unpadded)."""
    from transformers import GPT2Config

    ffn = config.ffn_hidden_size
    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
        n_layer=config.num_layers, n_head=config.num_attention_heads,
        n_inner=None if ffn == 4 * config.hidden_size else ffn,
        activation_function=ACTIVATION_TO_HF[config.activation], layer_norm_epsilon=config.layernorm_epsilon,
        resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout,
        initializer_range=config.init_method_std, bos_token_id=end_of_text_id, eos_token_id=end_of_text_id,
        architectures=[HF_ARCHITECTURE], tie_word_embeddings=True, dtype=str(dtype).removeprefix("torch."))


def gpt2_tokenizer(model_max_length: int):
    """GPT-2's byte-level BPE from the files shipped in data/assets/gpt2, as a transformers tokenizer."""
    from transformers import GPT2Tokenizer

    from data.tokenizers import DEFAULT_MERGE_FILE, DEFAULT_VOCAB_FILE

    vocab = json.loads(Path(DEFAULT_VOCAB_FILE).read_text(encoding="utf-8"))
    lines = Path(DEFAULT_MERGE_FILE).read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    return GPT2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def write_tokenizer(directory: Path, config: ModelConfig, tokenizer_path: str | Path | None = None) -> int | None:
    """Tokenizer files that AutoTokenizer loads offline; returns the end-of-text id (None if it has none).

    Default: the shipped GPT-2 BPE (this project's default tokenizer), which only fits a 50,257-token vocabulary.
    """
    if tokenizer_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path), trust_remote_code=False)
        tokenizer.model_max_length = config.max_position_embeddings
    elif config.vocab_size == GPT2_VOCAB_SIZE:
        tokenizer = gpt2_tokenizer(config.max_position_embeddings)
    else:
        raise ValueError(f"model.vocab_size is {config.vocab_size}, not GPT-2's {GPT2_VOCAB_SIZE}: pass --tokenizer "
                         f"with the Hugging Face tokenizer directory the training data was tokenized with")
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer {tokenizer_path} has {len(tokenizer)} tokens, more than the model's "
                         f"vocabulary {config.vocab_size}: it is not the tokenizer this model was trained with")
    tokenizer.save_pretrained(str(directory))
    return tokenizer.eos_token_id


def _staging_directory(output: Path) -> Path:
    """A sibling of ``output`` (same filesystem, so the final rename is atomic)."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"output {output} already exists and is not empty: remove it or choose another path")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _publish(staging: Path, output: Path) -> None:
    if output.exists():
        output.rmdir()  # empty (checked before starting)
    os.rename(staging, output)


def _progress(items: Iterable, description: str, enabled: bool):
    from tqdm.auto import tqdm

    items = list(items)
    return tqdm(items, desc=description, unit="layer", total=len(items), disable=not enabled, file=sys.stderr)


def export_to_hf(checkpoint_dir: str | Path, output_dir: str | Path, *, tag: str | None = None,
                 max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, dtype: torch.dtype | None = None,
                 tokenizer: str | Path | None = None, progress: bool = True) -> Path:
    """A checkpoint of this project (any TP x PP) -> a GPT2LMHeadModel directory: config.json,
    generation_config.json, model.safetensors (sharded above ``max_shard_size``, with an index) and tokenizer files.

    One layer is read, merged and written at a time. The directory is written beside ``output_dir`` and renamed
    into place when complete. ``dtype`` defaults to the training precision.
    """
    checkpoint = open_checkpoint(checkpoint_dir, tag)
    config, output = checkpoint.model, Path(output_dir)
    dtype = dtype or PRECISION_DTYPES[config.precision]
    max_bytes = parse_size(max_shard_size)
    staging = _staging_directory(output)
    try:
        end_of_text = write_tokenizer(staging, config, tokenizer)
        hf = hf_config(config, dtype, end_of_text)
        hf.save_pretrained(str(staging))
        _generation_config(hf).save_pretrained(str(staging))
        writer = SafetensorsShardWriter(staging, hf_shapes(config), dtype, max_bytes)
        for layer in _progress(layer_maps(config), f"export {checkpoint.tag}", progress):
            shards = read_layer(checkpoint, layer)
            for tensor in layer.tensors:
                writer.write(tensor.hf, merge_to_hf(tensor, [shard.pop(tensor.ours) for shard in shards], config))
            del shards
        writer.close()
        _publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _generation_config(config):
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(config)


# -- import ----------------------------------------------------------------------------------------------------------

def read_hf_config(hf_dir: str | Path):
    """The GPT2Config of an HF model directory; ValueError for any other architecture or an unsupported option."""
    path = Path(hf_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: --model must be a Hugging Face model directory") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    architectures = raw.get("architectures") or []
    if architectures != [HF_ARCHITECTURE] or raw.get("model_type") != "gpt2":
        raise ValueError(f"{path}: architecture {architectures or raw.get('model_type')!r} is not supported: only "
                         f"{HF_ARCHITECTURE} (model_type gpt2) converts to this project's GPT")
    from transformers import GPT2Config

    config = GPT2Config.from_dict(raw)  # GPT-2's defaults for keys an older config.json lacks
    unsupported = {"activation_function": config.activation_function not in ACTIVATION_FROM_HF,
                   "scale_attn_weights": not config.scale_attn_weights,
                   "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
                   "add_cross_attention": config.add_cross_attention,
                   "tie_word_embeddings": not config.tie_word_embeddings}
    for key, bad in unsupported.items():
        if bad:
            raise ValueError(f"{path}: {key} = {getattr(config, key)!r} has no equivalent in this project's GPT "
                             f"(activations {sorted(ACTIVATION_FROM_HF)}, attention scaled by 1/sqrt(d), no cross "
                             "attention, output head tied to the embedding)")
    return config


def model_fields_from_hf(config) -> dict[str, Any]:
    """The ModelConfig fields an HF GPT2Config fixes."""
    return {"num_layers": config.n_layer, "hidden_size": config.n_embd, "num_attention_heads": config.n_head,
            "max_position_embeddings": config.n_positions, "vocab_size": config.vocab_size,
            "ffn_hidden_size": config.n_inner or 4 * config.n_embd, "layernorm_epsilon": config.layer_norm_epsilon,
            "activation": ACTIVATION_FROM_HF[config.activation_function]}


def check_model_matches(model: ModelConfig, hf, config_source: str, hf_source: str) -> None:
    """ValueError naming every ModelConfig field that differs from the HF model's."""
    wanted = model_fields_from_hf(hf)
    wrong = [f"model.{field} is {getattr(model, field)!r} in {config_source}, the HF model has {value!r}"
             for field, value in wanted.items() if getattr(model, field) != value]
    if wrong:
        fixes = " ".join(f"--set model.{field}={json.dumps(value)}" for field, value in wanted.items()
                         if getattr(model, field) != value)
        raise ValueError(f"the run config's model does not match {hf_source}:\n  " + "\n  ".join(wrong) +
                         f"\nset these fields in the model block (or pass {fixes})")


class HFWeights:
    """The tensors of an HF model directory's safetensors file(s), read one at a time (never pickle)."""

    def __init__(self, hf_dir: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(hf_dir)
        index, single = self.directory / "model.safetensors.index.json", self.directory / "model.safetensors"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif single.exists():
            files = [single.name]
        elif any(self.directory.glob("pytorch_model*.bin")):
            raise ValueError(f"{self.directory} holds pytorch_model.bin (pickle), which is not read here: save it as "
                             "safetensors first (from_pretrained(...).save_pretrained(dir), safetensors by default)")
        else:
            raise ValueError(f"{self.directory} has no model.safetensors or model.safetensors.index.json")
        self._stack = contextlib.ExitStack()
        self.location: dict[str, tuple[Any, str, str]] = {}
        for file in files:
            handle = self._stack.enter_context(safe_open(str(self.directory / file), framework="pt"))
            for key in handle.keys():
                canonical = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
                self.location[canonical] = (handle, key, file)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.location:
            raise ValueError(f"{self.directory}: the weights have no {name}: not a complete GPT2LMHeadModel")
        handle, key, file = self.location[name]
        tensor = handle.get_tensor(key)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{self.directory / file}: {key} has shape {tuple(tensor.shape)}, but config.json means "
                             f"{shape}: the weights do not match the config")
        return tensor

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()


def import_from_hf(hf_dir: str | Path, model: ModelConfig, parallel: ParallelConfig, output_dir: str | Path, *,
                   run_config: dict[str, Any] | None = None, config_source: str = "the run config",
                   start_tokens: int = 0, progress: bool = True) -> Path:
    """A GPT2LMHeadModel directory -> a checkpoint of this project split ``parallel`` ways (TP x PP), which
    ``engine.load_checkpoint(dir, load_module_only=True, load_optimizer_states=False,
    load_lr_scheduler_states=False)`` loads (the optimizer starts fresh). ``model`` must match the HF model.

    Writes ``<output>/latest`` -> ``global_step0``, the layer files, one mp_rank file per stage x TP rank (client
    state: run_config, hf_import) and ``<output>/hf_import.json`` (the start token count; see ``read_import_record``).
    """
    hf_dir, output = Path(hf_dir), Path(output_dir)
    hf = read_hf_config(hf_dir)
    check_model_matches(model, hf, config_source, str(hf_dir / "config.json"))
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    model.check_parallel(tp, pp)
    if start_tokens < 0:
        raise ValueError(f"--start-tokens must be >= 0, got {start_tokens}")
    record = {"tag": IMPORT_TAG, "start_tokens": int(start_tokens), "source": str(hf_dir.resolve()),
              "architecture": HF_ARCHITECTURE, "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    staging = _staging_directory(output)
    try:
        tag_directory = staging / IMPORT_TAG
        tag_directory.mkdir()
        with HFWeights(hf_dir) as weights:
            for layer in _progress(layer_maps(model), f"import {hf_dir.name}", progress):
                _write_layer(tag_directory, layer, weights, model, tp)
        client_state = {"run_config": run_config, "hf_import": record}
        for model_parallel_rank in range(tp * pp):
            torch.save(_model_states(client_state, tp * pp), model_states_file(tag_directory, model_parallel_rank))
        (staging / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        write_latest(staging, IMPORT_TAG)
        _publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _write_layer(tag_directory: Path, layer: LayerMap, weights: HFWeights, model: ModelConfig, tp: int) -> None:
    dtype = PRECISION_DTYPES[model.precision]
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for tensor in layer.tensors:
        value = weights.get(tensor.hf, hf_shape(tensor, model))
        for rank, piece in enumerate(split_from_hf(tensor, value, model, tp)):
            shards[rank][tensor.ours] = piece.to(dtype)
    for rank, state in enumerate(shards):
        torch.save(state, layer_file(tag_directory, layer.index, rank))


def _model_states(client_state: dict[str, Any], model_parallel_world_size: int) -> dict[str, Any]:
    """What DeepSpeed's load_checkpoint reads from mp_rank_XX_model_states.pt for a pipeline module loaded with
    load_module_only=True ("module": None sends it to the layer files), plus the client state."""
    return {"module": None, "buffer_names": [], "optimizer": None, "lr_scheduler": None, "global_steps": 0,
            "global_samples": 0, "skipped_steps": 0, "dp_world_size": 1,
            "mp_world_size": model_parallel_world_size, **client_state}


def read_import_record(directory: str | Path) -> dict[str, Any] | None:
    """``<directory>/hf_import.json`` of an imported checkpoint, or None for any other directory.

    {"tag": "global_step0", "start_tokens": int, "source": HF dir, "architecture": "GPT2LMHeadModel",
     "tensor_parallel_size": int, "pipeline_parallel_size": int}
    """
    path = Path(directory) / IMPORT_RECORD
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if not isinstance(record.get("start_tokens"), int) or record["start_tokens"] < 0:
        raise ValueError(f"{path}: start_tokens must be a non-negative integer, got {record.get('start_tokens')!r}")
    return record
