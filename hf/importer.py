"""A Hugging Face model directory -> a checkpoint of this project at any TP x PP, which train.py starts from.

    <output>/latest -> global_step0, the layer files, one mp_rank file per stage x TP rank (client state: run_config,
    hf_import), <output>/hf_import.json (the import record: start tokens, source, architecture, split) and
    <output>/hf_tokenizer/ (the HF directory's tokenizer files, when it has any)

The weights are read from safetensors one tensor at a time (never pickle), split for TP (hf/transforms.py) and written
one layer at a time; the checkpoint is staged beside the output and renamed into place when complete.

Block-scaled fp8 checkpoints (DeepSeek-V3's own release; config.json's quantization_config: quant_method "fp8",
weight_block_size [b_r, b_c], read by hf/config_map.py fp8_block_size) are dequantised as each tensor is read:

    tensor                            dtype, shape                          what the import makes of it
    <name>                            float8_e4m3fn [R, C]                  fp32 w = <name>.float() x S, then the run's
    <name>_scale_inv                  fp32 [ceil(R / b_r), ceil(C / b_c)]     precision (S: each element's block's
                                                                              scale; the last row and column of blocks
                                                                              partial where b_r, b_c do not divide)
    any other tensor (norms, embedding, router, e_score_correction_bias)    as it is

DeepSeek-V3's multi-token prediction module (model.layers.{num_hidden_layers}, which transformers'
DeepseekV3ForCausalLM ignores) is read into model.mtp's depths when the run config sets model.mtp (depth
num_nextn_predict_layers; its copies of the embedding and the head are not read: the depths share the trunk's).
Without model.mtp, the tensors of layers past the last block are skipped with a logged notice and listed in the
import record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from hf.config_map import architecture_of, check_model_matches, fp8_block_size, read_hf_config
from hf.files import progress_bar, publish, staging_directory
from hf.tables import (
    ARCHITECTURES,
    HF_ARCHITECTURE,
    PRECISION_DTYPES,
    Architecture,
    LayerMap,
    hf_tensor_shapes,
    keeps_fp32,
    layer_maps,
)
from hf.tokenizer import TOKENIZER_DIRECTORY, copy_tokenizer
from hf.transforms import split_from_hf
from model.checkpoint_files import layer_file, model_states_file, write_latest
from model.config import ModelConfig, ParallelConfig

IMPORT_TAG = "global_step0"
IMPORT_RECORD = "hf_import.json"
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
log = logging.getLogger(__name__)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """weight [R, C] float8_e4m3fn and scale_inv [ceil(R / b_r), ceil(C / b_c)] -> fp32 [R, C], each element times
    the scale of its (b_r, b_c) block; the blocks of the last row and column are cut where b_r, b_c do not divide."""
    rows, columns = weight.shape
    block_rows, block_columns = block_size
    expected = (math.ceil(rows / block_rows), math.ceil(columns / block_columns))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"the scale_inv has shape {tuple(scale_inv.shape)}, but a [{rows}, {columns}] weight in "
                         f"blocks of {list(block_size)} (quantization_config.weight_block_size) needs {expected}")
    scale = scale_inv.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_columns, 1)
    return weight.float() * scale[:, :columns]


class HFWeights:
    """The tensors of an HF model directory's safetensors file(s), read one at a time (never pickle)."""

    def __init__(self, hf_dir: str | Path, architecture: Architecture = ARCHITECTURES[HF_ARCHITECTURE],
                 fp8_block_size: tuple[int, int] | None = None) -> None:
        """``fp8_block_size``: quantization_config.weight_block_size of a block-scaled fp8 checkpoint (the module
        docstring's table), None for an unquantised one."""
        from safetensors import safe_open

        self.directory, self.architecture, self.fp8_block_size = Path(hf_dir), architecture, fp8_block_size
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
        prefix = architecture.base_prefix
        for file in files:
            handle = self._stack.enter_context(safe_open(str(self.directory / file), framework="pt"))
            for key in handle.keys():
                canonical = key if key.startswith((prefix, "lm_head.")) else prefix + key
                self.location[canonical] = (handle, key, file)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.location:
            raise ValueError(f"{self.directory}: the weights have no {name}: not a complete "
                             f"{self.architecture.name}")
        handle, key, file = self.location[name]
        tensor = handle.get_tensor(key)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{self.directory / file}: {key} has shape {tuple(tensor.shape)}, but config.json means "
                             f"{shape}: the weights do not match the config")
        if tensor.dtype == getattr(torch, "float8_e4m3fn", None):
            return self._dequantized(name, tensor)
        return tensor

    def _dequantized(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """A float8_e4m3fn weight times its <name>_scale_inv, block by block (fp32)."""
        _, key, file = self.location[name]
        scale_name = f"{name}_scale_inv"
        problems = {"config.json has no quantization_config.weight_block_size": self.fp8_block_size is None,
                    f"it has {weight.ndim} dimensions, not 2": weight.ndim != 2,
                    f"the weights have no {scale_name}": scale_name not in self.location}
        why = next((problem for problem, found in problems.items() if found), None)
        if why is not None:
            raise ValueError(f"{self.directory / file}: {key} is float8_e4m3fn, but {why}: only DeepSeek's "
                             f"block-scaled fp8 (2-D weights, one fp32 <name>_scale_inv per block) is dequantised here")
        scale_handle, scale_key, scale_file = self.location[scale_name]
        try:
            return dequantize_fp8_blocks(weight, scale_handle.get_tensor(scale_key), self.fp8_block_size)
        except ValueError as error:
            raise ValueError(f"{self.directory / scale_file}: {scale_key}: {error}: the scales do not match the "
                             f"weights and config.json") from None

    def layers_past(self, num_layers: int) -> dict[int, int]:
        """Layer index -> its count of tensors, for every ``model.layers.N.*`` with N >= num_layers."""
        counts = Counter(int(match.group(1)) for match in map(_LAYER_INDEX.match, self.location) if match)
        return {index: counts[index] for index in sorted(counts) if index >= num_layers}

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()


def import_from_hf(hf_dir: str | Path, model: ModelConfig, parallel: ParallelConfig, output_dir: str | Path, *,
                   run_config: dict[str, Any] | None = None, config_source: str = "the run config",
                   start_tokens: int = 0, progress: bool = True) -> Path:
    """An HF model directory (one of ``ARCHITECTURES``) -> a checkpoint of this project split ``parallel`` ways
    (TP x PP), which ``engine.load_checkpoint(dir, load_module_only=True, load_optimizer_states=False,
    load_lr_scheduler_states=False)`` loads (the optimizer starts fresh). ``model`` must match the HF model.

    Writes ``<output>/latest`` -> ``global_step0``, the layer files, one mp_rank file per stage x TP rank (client
    state: run_config, hf_import), ``<output>/hf_import.json`` (the start token count; see ``read_import_record``)
    and ``<output>/hf_tokenizer/`` (the HF directory's tokenizer files, when it has any).
    """
    hf_dir, output = Path(hf_dir), Path(output_dir)
    hf = read_hf_config(hf_dir)
    architecture = architecture_of(hf)
    check_model_matches(model, hf, config_source, hf_dir)
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    model.check_parallel(tp, pp)
    if start_tokens < 0:
        raise ValueError(f"--start-tokens must be >= 0, got {start_tokens}")
    record = {"tag": IMPORT_TAG, "start_tokens": int(start_tokens), "source": str(hf_dir.resolve()),
              "architecture": architecture.name, "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    staging = staging_directory(output)
    try:
        tag_directory = staging / IMPORT_TAG
        tag_directory.mkdir()
        with HFWeights(hf_dir, architecture, fp8_block_size(hf)) as weights:
            depths = model.mtp.depth if model.mtp is not None else 0  # model.mtp: its depths are layers L .. L+D-1
            record["skipped_hf_layers"] = _skip_layers_past_the_blocks(weights, hf_dir, model.num_layers + depths, hf)
            for layer in progress_bar(layer_maps(model, architecture), f"import {hf_dir.name}", progress):
                _write_layer(tag_directory, layer, weights, model, tp)
        if run_config is None:  # the least that open_checkpoint (and so the export) needs
            run_config = {"model": model.to_dict(), "parallelism": {"tensor_parallel_size": tp,
                                                                    "pipeline_parallel_size": pp}}
        client_state = {"run_config": run_config, "hf_import": record}
        for model_parallel_rank in range(tp * pp):
            torch.save(_model_states(client_state, tp * pp), model_states_file(tag_directory, model_parallel_rank))
        copy_tokenizer(hf_dir, staging / TOKENIZER_DIRECTORY)
        (staging / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        write_latest(staging, IMPORT_TAG)
        publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output




def _skip_layers_past_the_blocks(weights: HFWeights, hf_dir: Path, num_layers: int, hf) -> list[int]:
    """The layers of the HF weights past the last block, which are not imported (the module docstring), logged."""
    skipped = weights.layers_past(num_layers)
    if skipped:
        predicted = getattr(hf, "num_nextn_predict_layers", 0) or 0
        what = (f"DeepSeek's multi-token prediction module{'s' if predicted > 1 else ''} (num_nextn_predict_layers "
                f"{predicted})" if predicted else "not blocks of config.json's num_hidden_layers")
        log.warning("%s: skipping %d tensors of model.layers.%s, %s: not imported, the checkpoint predicts the next "
                    "token only", hf_dir, sum(skipped.values()), "/".join(map(str, skipped)), what)
    return list(skipped)


def _write_layer(tag_directory: Path, layer: LayerMap, weights: HFWeights, model: ModelConfig, tp: int) -> None:
    precision = PRECISION_DTYPES[model.precision]
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for tensor in layer.tensors:
        values = [weights.get(name, shape) for name, shape in hf_tensor_shapes(tensor, model).items()]
        value = values[0] if isinstance(tensor.hf, str) else values  # a sequence for a tensor fused here
        dtype = torch.float32 if keeps_fp32(tensor.ours) else precision
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

    {"tag": "global_step0", "start_tokens": int, "source": HF dir, "architecture": an ARCHITECTURES name,
     "tensor_parallel_size": int, "pipeline_parallel_size": int, "skipped_hf_layers": [the model.layers.N not
     imported, N >= num_hidden_layers: DeepSeek's multi-token prediction] (absent in records written before it)}
    """
    path = Path(directory) / IMPORT_RECORD
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if not isinstance(record.get("start_tokens"), int) or record["start_tokens"] < 0:
        raise ValueError(f"{path}: start_tokens must be a non-negative integer, got {record.get('start_tokens')!r}")
    return record
