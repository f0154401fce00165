"""A checkpoint's model at any TP x PP x DP for inference: this rank's stage, its weights, and the tokenizer.

The stage is the training model's own (model/gpt.py build_pipeline_model: the same LayerSpecs and the same
partitioning), built at the requested layout, with sequence parallelism off (a generation step of one token cannot
be split over the sequence; the weights do not depend on it). Its weights come from the checkpoint's layer files,
written at whatever TP the run had:

    same TP            each layer's file of this TP rank, as saved
    another TP         each layer's TP shards merged into the whole tensor and split for this TP rank, by the
                       layer maps (hf/tables.py layer_maps: every tensor of the files, parameters and persistent
                       buffers such as the sigmoid_bias router's expert_bias) and hf/transforms.py merge_shards /
                       split_shards, in our own layout: no Hugging Face name is needed, so any shape loads, one that
                       no HF architecture fits too; copies and slices only, so the weights are exact
    another PP or DP   nothing to convert: a stage reads the layer files of its own layers

Only weights are read (no optimizer state), one layer at a time, memory-mapped. The layout comes from the
checkpoint's run config unless the caller gives another. The routers' expert_bias stays fp32 in a bf16 or fp16
stage, as in training (model/moe.py keep_router_biases_fp32), so that the experts are chosen as there.
"""

from __future__ import annotations

import dataclasses

import os
from pathlib import Path

import torch

from common import deepspeed_internals as ds_internals
from common.net import free_port
from evaluation.pipeline import Pipeline, Stage
from hf.checkpoint_reader import Checkpoint, open_checkpoint, read_layer
from hf.tables import PRECISION_DTYPES, LayerMap, layer_maps
from hf.tokenizer import TOKENIZER_DIRECTORY, gpt2_tokenizer, load_tokenizer
from hf.transforms import merge_shards, split_shards
from model.config import GPT2_VOCAB_SIZE, ModelConfig, ParallelConfig
from model.gpt import build_pipeline_model
from model.moe import keep_router_biases_fp32, sparse_layers
from model.parallel import ParallelContext, build_parallel_context, init_distributed


def one_process_defaults() -> None:
    """A plain ``python tools/x.py`` (no launcher) is a world of one: the variables a launcher would set."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def layer_state(checkpoint: Checkpoint, layer: LayerMap, model: ModelConfig, tensor_parallel_size: int,
                tensor_parallel_rank: int) -> dict[str, torch.Tensor]:
    """One layer's state_dict for TP rank ``tensor_parallel_rank`` of ``tensor_parallel_size`` (module docstring)."""
    saved_tp = checkpoint.tensor_parallel_size
    if saved_tp == tensor_parallel_size:
        path_shards = read_layer(checkpoint, layer)
        return dict(path_shards[tensor_parallel_rank])
    shards = read_layer(checkpoint, layer)
    state = {}
    for tensor in layer.tensors:
        whole = merge_shards(tensor, [shard[tensor.ours] for shard in shards], checkpoint.model)
        state[tensor.ours] = split_shards(tensor, whole, model, tensor_parallel_size)[tensor_parallel_rank]
    return state


def _load_stage_weights(module, checkpoint: Checkpoint, model: ModelConfig, ctx: ParallelContext) -> None:
    """Every layer of this rank's stage (the tied head: the embedding it shares, layer 0)."""
    maps = {layer.index: layer for layer in layer_maps(model)}
    head = model.num_layers + 3
    for index in ds_internals.stage_layer_indices(module):
        source = 0 if index == head and model.tie_word_embeddings else index
        if model.tie_word_embeddings and source == 0:
            target = ds_internals.tied_module(module, "word_embeddings")
        else:
            target = ds_internals.stage_layer(module, index)
        state = layer_state(checkpoint, maps[source], model, ctx.tensor_parallel_size, ctx.tensor_parallel_rank)
        target.load_state_dict(state, strict=True)


def load_stage(checkpoint_dir: str | Path, tag: str | None = None, parallel: ParallelConfig | None = None,
               dtype: torch.dtype | None = None) -> tuple[Stage, Checkpoint]:
    """This rank's stage of the checkpoint's model at ``parallel`` (default: the checkpoint's TP x PP), its weights
    loaded, in eval mode, in ``dtype`` (default: the training precision). Collective: every rank calls it."""
    checkpoint = open_checkpoint(checkpoint_dir, tag)
    model = dataclasses.replace(checkpoint.model, mtp=None)  # the next-token model: model.mtp's depths train only
    parallel = parallel or ParallelConfig(checkpoint.parallel.tensor_parallel_size,
                                          checkpoint.parallel.pipeline_parallel_size)
    parallel = ParallelConfig(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                              partition_method=parallel.partition_method, sequence_parallel=False)
    model.check_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    one_process_defaults()
    init_distributed()
    ctx = build_parallel_context(parallel)
    module = build_pipeline_model(model, ctx, seed=0, partition_method=parallel.partition_method)
    module.to(dtype or PRECISION_DTYPES[model.precision]).eval()
    keep_router_biases_fp32(sparse_layers(module))  # before loading: the saved fp32 bias is copied in exactly
    with torch.no_grad():
        _load_stage_weights(module, checkpoint, model, ctx)
    return Stage(ds_internals.stage_forward_functions(module), module, ctx, model), checkpoint


def load_pipeline(checkpoint_dir: str | Path, tag: str | None = None, parallel: ParallelConfig | None = None,
                  dtype: torch.dtype | None = None) -> tuple[Pipeline, Checkpoint]:
    stage, checkpoint = load_stage(checkpoint_dir, tag, parallel, dtype)
    return Pipeline(stage), checkpoint


def checkpoint_tokenizer(checkpoint: Checkpoint | Path, tokenizer: str | Path | None = None, model: ModelConfig | None = None):
    """The tokenizer of a checkpoint: ``tokenizer`` (an HF tokenizer directory) if given, else the one an import
    carried (<checkpoint>/hf_tokenizer), else GPT-2's when the vocabulary is GPT-2's; otherwise a ValueError that
    names the option to pass."""
    directory = checkpoint.directory if isinstance(checkpoint, Checkpoint) else Path(checkpoint)
    model = model or checkpoint.model
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if (directory / TOKENIZER_DIRECTORY).is_dir():
        return load_tokenizer(directory / TOKENIZER_DIRECTORY)
    if model.vocab_size == GPT2_VOCAB_SIZE:
        return gpt2_tokenizer(model.max_position_embeddings)
    raise ValueError(f"{directory} carries no tokenizer ({TOKENIZER_DIRECTORY}/) and its vocabulary "
                     f"({model.vocab_size:,}) is not GPT-2's: pass --tokenizer DIR, the Hugging Face tokenizer "
                     f"directory the training data was tokenised with")
