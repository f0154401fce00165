"""A checkpoint of this project (any TP x PP) -> a Hugging Face model directory, one layer at a time.

Each layer's TP shards are read (hf/checkpoint_reader.py), merged into the HF tensors (hf/transforms.py) and written
at once into safetensors files whose headers are planned up front (hf/safetensors_writer.py): peak memory follows the
largest layer. The directory is staged beside the output and renamed into place when complete (hf/files.py).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from hf.checkpoint_reader import Checkpoint, open_checkpoint, read_layer
from hf.config_map import hf_config
from hf.files import progress_bar, publish, staging_directory
from hf.importer import read_import_record
from hf.safetensors_writer import SafetensorsShardWriter, parse_size
from hf.tables import (
    ARCHITECTURES,
    PRECISION_DTYPES,
    Architecture,
    compatible_architectures,
    exported_layers,
    exports_mtp,
    hf_copies,
    hf_shapes,
    keeps_fp32,
    resolve_architecture,
)
from hf.tokenizer import TOKENIZER_DIRECTORY, write_tokenizer
from hf.transforms import merge_to_hf

DEFAULT_MAX_SHARD_SIZE = "5GB"
log = logging.getLogger(__name__)


def _export_architecture(checkpoint: Checkpoint, name: str | None) -> Architecture:
    """``name``, else the architecture an imported checkpoint came from, else the first that fits the shape."""
    if name is None:
        record = read_import_record(checkpoint.directory)
        imported = record.get("architecture") if record else None
        if imported in ARCHITECTURES and ARCHITECTURES[imported] in compatible_architectures(checkpoint.model):
            name = imported
    return resolve_architecture(checkpoint.model, name)


def export_to_hf(checkpoint_dir: str | Path, output_dir: str | Path, *, tag: str | None = None,
                 max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, dtype: torch.dtype | None = None,
                 tokenizer: str | Path | None = None, architecture: str | None = None,
                 progress: bool = True) -> Path:
    """A checkpoint of this project (any TP x PP) -> an HF model directory (``architecture``, by default the one
    it was imported from or the first that fits its shape): config.json, generation_config.json, model.safetensors
    (sharded above ``max_shard_size``, with an index) and tokenizer files (``tokenizer``, else the ones an import
    carried in, else GPT-2's).

    One layer is read, merged and written at a time. The directory is written beside ``output_dir`` and renamed
    into place when complete. ``dtype`` defaults to the training precision; the tensors of ``FP32_TENSORS`` (the
    DeepSeek router's e_score_correction_bias) are fp32 whatever it is. The weights are never quantised.
    """
    checkpoint = open_checkpoint(checkpoint_dir, tag)
    config, output = checkpoint.model, Path(output_dir)
    target = _export_architecture(checkpoint, architecture)
    dtype = dtype or PRECISION_DTYPES[config.precision]
    max_bytes = parse_size(max_shard_size)
    carried = checkpoint.directory / TOKENIZER_DIRECTORY
    if tokenizer is None and carried.is_dir():
        tokenizer = carried
    staging = staging_directory(output)
    try:
        text = write_tokenizer(staging, config, tokenizer)
        hf = hf_config(config, dtype, text.eos_token_id, target, text.bos_token_id)
        hf.save_pretrained(str(staging))
        _generation_config(hf).save_pretrained(str(staging))
        maps, copies = exported_layers(config, target), hf_copies(config, target)
        if config.mtp is not None and not exports_mtp(target):
            log.warning("%s: model.mtp's %d depth(s) are not exported: %s stores no multi-token prediction module "
                        "(the export predicts the next token only)", checkpoint.directory, config.mtp.depth,
                        target.name)
        kept_fp32 = {name: torch.float32 for layer in maps for tensor in layer.tensors if keeps_fp32(tensor.ours)
                     for name in tensor.hf_names}
        writer = SafetensorsShardWriter(staging, hf_shapes(config, target), dtype, max_bytes, kept_fp32)
        for layer in progress_bar(maps, f"export {checkpoint.tag}", progress):
            shards = read_layer(checkpoint, layer)
            for tensor in layer.tensors:
                merged = merge_to_hf(tensor, [shard.pop(tensor.ours) for shard in shards], config)
                values = (merged,) if torch.is_tensor(merged) else merged
                for name, value in zip(tensor.hf_names, values, strict=True):
                    for each in (name, *copies.get(name, ())):  # DeepseekV3's MTP layers copy the embedding, head
                        writer.write(each, value)
            del shards
        writer.close()
        publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _generation_config(config):
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(config)

