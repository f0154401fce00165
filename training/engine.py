"""Build the DeepSpeed pipeline engine for a model and a parallel layout (collective: every rank calls it)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common import deepspeed_internals as ds_internals
from common.device import accelerator_device
from model.config import ModelConfig, ParallelConfig
from model.gpt import build_pipeline_model
from model.moe import keep_router_biases_fp32, set_gradient_scale, sparse_layers
from model.parallel import ParallelContext, build_parallel_context, init_distributed
from model.pipe_schedules import schedule_for, train_schedule
from model.random import default_stream_seed
from runconfig.dpo import DPOConfig
from runconfig.optimizer import check_qk_clip, muon_config
from training.compile import compile_blocks
from training.dpo import DPOLoss
from training.muon import QKClip, bind_partitions, build_muon


def weight_decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Megatron's rule: decay the matrices (and embeddings); never the biases and LayerNorm parameters (1-D).

    Every group is named (DeepSpeed's MoE handling keys groups by name). With expert parallelism (EP > 1) the
    experts, tagged by model/moe.py, form one more group, last, as DeepSpeed's optimizers read it (decayed, named
    "ep_size_EP", ``moe`` true: kept as given, not re-split by DeepSpeed)."""
    trained = [p for p in module.parameters() if p.requires_grad]
    dense = [p for p in trained if ds_internals.expert_group_of(p) is None]
    groups = [{"name": "decay", "params": [p for p in dense if p.ndim >= 2], "weight_decay": weight_decay},
              {"name": "no_decay", "params": [p for p in dense if p.ndim < 2], "weight_decay": 0.0}]
    names = {ds_internals.expert_group_of(p) for p in trained} - {None}
    for name in sorted(names):
        experts = [p for p in trained if ds_internals.expert_group_of(p) == name]
        groups.append(ds_internals.expert_param_group(experts, int(name.removeprefix("ep_size_")), weight_decay))
    return [group for group in groups if group["params"]]


SEQUENCE_SHARDS = ("splits the tensor sent between stages over the TP ranks as if they held the same one; with "
                   "parallelism.sequence_parallel each holds its own sequence shard")
DUALPIPEV_WHOLE_TENSORS = "DeepSpeed's DualPipeVEngine does not support (it sends whole tensors between stages)"


def _unpartitioned_pipe_transfers(deepspeed_config: dict[str, Any], why: str = SEQUENCE_SHARDS) -> dict[str, Any]:
    """With sequence parallelism each TP rank sends its own sequence shard to the next stage. DeepSpeed's default
    pipe_partitioned / grad_partitioned assume the TP ranks hold the same tensor: each sends 1/TP of it and the
    receivers all-gather the pieces, which would splice the ranks' different shards together. DualPipeVEngine does
    not support them at all. Turn both off; an explicit true is refused with ``why``."""
    pipeline = deepspeed_config.get("pipeline", {})
    for key in ("pipe_partitioned", "grad_partitioned"):
        if pipeline.get(key):
            raise ValueError(f"DeepSpeed's pipeline.{key} is true, which {why}: remove pipeline.{key} (it is turned "
                             f"off here)")
    return {**deepspeed_config, "pipeline": {**pipeline, "pipe_partitioned": False, "grad_partitioned": False}}


def build_engine(model_config: ModelConfig, parallel_config: ParallelConfig, deepspeed_config: dict[str, Any],
                 seed: int, z_loss: float = 0.0, compiled: bool = False,
                 dpo: DPOConfig | None = None) -> tuple[Any, ParallelContext]:
    """torch.distributed, the TP/DP groups, this rank's pipeline stage, and the DeepSpeed engine around it.

    ``deepspeed_config`` holds DeepSpeed's own keys only. torch's default random stream is seeded per pipeline stage,
    the same on every TP rank of a stage, so that dropout masks of replicated activations agree across TP ranks; the
    model's tensor-parallel stream is seeded per TP rank and stage (model/random.py says which serves which dropout).
    ``z_loss``: the z-loss coefficient of the objective (model/loss.py). ``compiled``: training.compile, the stage's
    blocks compiled (training/compile.py); the module's ``compiled_blocks`` says how many. ``dpo``: training.dpo, the
    preference loss (training/dpo.py) as the pipeline's loss function and ``module.objective`` instead of the
    next-token one.
    """
    import deepspeed

    init_distributed()
    device = accelerator_device()
    if model_config.attention_backend == "flex" and device.type != "cuda":
        raise ValueError(f"model.attention_backend \"flex\" trains on CUDA only: torch has no FlexAttention backward "
                         f"on {device.type}; use \"sdpa\" here (the same attention, tests/test_document_masks.py)")
    context = build_parallel_context(parallel_config)
    deepspeed_config = {**deepspeed_config, "train_batch_size": deepspeed_batch_size(
        deepspeed_config["train_batch_size"], context)}
    schedule = parallel_config.pipeline_schedule
    if schedule == "dualpipev":
        deepspeed_config = _unpartitioned_pipe_transfers(deepspeed_config, DUALPIPEV_WHOLE_TENSORS)
        micro_batches = deepspeed_config["train_batch_size"] // (deepspeed_config["train_micro_batch_size_per_gpu"]
                                                                * context.data_axis_size)
        if micro_batches < 2 * context.pipeline_parallel_size:  # DualPipeVEngine asserts it; train.py says it earlier
            raise ValueError(f"DualPipeV needs at least 2 x PP = {2 * context.pipeline_parallel_size} micro-batches "
                             f"per pipeline at the full batch (train_batch_size), got {micro_batches}; smaller batches "
                             f"of a ramp run the V-shaped schedule (engine.set_train_batch_size)")
    elif context.sequence_parallel:
        deepspeed_config = _unpartitioned_pipe_transfers(deepspeed_config)
    torch.manual_seed(default_stream_seed(seed, context))
    module = build_pipeline_model(model_config, context, seed, parallel_config.partition_method, z_loss, schedule)
    module.compiled_blocks = compile_blocks(module) if compiled else 0
    muon = muon_config(deepspeed_config)
    if muon is not None:  # our optimizer as DeepSpeed's client optimizer (training/muon.py); DeepSpeed's Muon unused
        deepspeed_config = {**{k: v for k, v in deepspeed_config.items() if k != "optimizer"},
                            "zero_allow_untested_optimizer": True}
    ds_internals.skip_muon_kernels(str(deepspeed_config.get("optimizer", {}).get("type", "")))
    if muon is not None:
        optimizer = build_muon(module, model_config, context, muon)
        param_groups = optimizer.param_groups
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=deepspeed_config)
        bind_partitions(optimizer, engine.optimizer)
        check_qk_clip(muon, model_config, context.context_parallel_size)
        if muon.qk_clip is not None:  # MuonClip: the per-head maxima, reduced over DP (training/muon.py QKClip)
            optimizer.clip = QKClip(muon.qk_clip, engine.module, engine.grid.get_data_parallel_group(),
                                    muon.qk_clip_passes, optimizer.apply_clip)
            engine.module.qk_clip = optimizer.clip  # what the stability monitor logs of it (training/stability.py)
            ds_internals.run_before_instruction(engine, "OptimizerStep", optimizer.clip.before_step)
            ds_internals.run_before_instruction(engine, "ForwardPass", optimizer.clip.forward_started)
    else:
        weight_decay = deepspeed_config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
        param_groups = weight_decay_groups(module, weight_decay)
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=param_groups, config=deepspeed_config)
    if dpo is not None:
        objective = DPOLoss(context, dpo)
        ds_internals.wrap_loss(engine, lambda next_token_loss: objective)
        engine.module.objective = objective
    _pad_stages_with_fewer_groups(engine, context, param_groups)
    if schedule == "dualpipev":
        ds_internals.run_short_batches_as(engine, _dualpipev_or_vshape)
    sparse = sparse_layers(engine.module)
    keep_router_biases_fp32(sparse)
    if sparse:  # the attached auxiliary losses follow the loss's S / micro-batches (the ramp, fp16's overflows)
        ds_internals.run_before_instruction(engine, "ForwardPass", lambda: set_gradient_scale(
            sparse, engine.micro_batches, loss_scale_of(engine)))
    return engine, context


def loss_scale_of(engine: Any) -> float:
    """The factor DeepSpeed's backward multiplies the loss by and its optimizer divides the gradients by: fp16's
    current loss scale (ZeRO's ``loss_scale``, the dynamic scaler's or one set by ``override_loss_scale``), 1 for
    BF16_Optimizer, which has none. A host float: reading it syncs nothing."""
    scale = getattr(engine.optimizer, "loss_scale", None)
    return 1.0 if scale is None else float(scale)


def deepspeed_batch_size(samples: int, context: ParallelContext) -> int:
    """What DeepSpeed calls the batch (train_batch_size) for a global batch of ``samples``: micro-batch x
    accumulation x its data axis, which under context parallelism holds each sample CP times (one slice per CP rank).
    The run's batch sizes (the config, the ramp, the counters, the log) count samples; only the engine sees this."""
    return samples * context.context_parallel_size


def set_global_batch(engine: Any, context: ParallelContext, samples: int) -> None:
    """The engine's batch for a global batch of ``samples`` (the batch ramp): micro-batches per step follow."""
    if engine.train_batch_size() != deepspeed_batch_size(samples, context):
        engine.set_train_batch_size(deepspeed_batch_size(samples, context))


def _pad_stages_with_fewer_groups(engine: Any, context: ParallelContext, param_groups: list[dict[str, Any]]) -> None:
    """Collective over the pipeline. ZeRO-1's gradient norm runs one cross-stage all-reduce per param group, so the
    stages agree on the largest group count (MAX over the pipeline group) and a stage with fewer groups runs the
    missing ones with zeros (common/deepspeed_internals.py): a stage without experts where others have them (and
    BF16_Optimizer's expert norm, pad_expert_norm_collectives), a stage without the "decay" group where Muon took the
    block matrices and the embedding and head are elsewhere (the middle of the pipeline; DualPipeV's second rank)."""
    if context.pipeline_parallel_size == 1:
        return
    count = torch.tensor([len(param_groups)], dtype=torch.int64, device=engine.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=engine.grid.get_pipe_parallel_group())
    missing = int(count.item()) - len(param_groups)
    if context.expert_parallel_size > 1 and not any(group.get("moe") for group in param_groups):
        ds_internals.pad_expert_norm_collectives(engine, context.expert_parallel_size, missing)
    else:
        ds_internals.pad_norm_collectives(engine, missing)


def pipeline_schedule_of(engine: Any, micro_batches: int | None = None) -> str:
    """The stream the engine runs for a batch of ``micro_batches`` (default: the current batch): "1f1b", "dualpipev",
    or "vshape" (DualPipeV's module below 2 PP micro-batches, model/pipe_schedules.py)."""
    micro_batches = engine.micro_batches if micro_batches is None else micro_batches
    return schedule_for("dualpipev" if ds_internals.is_dualpipev_engine(engine) else "1f1b", micro_batches,
                        engine.num_stages)


def _dualpipev_or_vshape(micro_batches: int, stages: int, stage_id: int, forward_only: bool) -> Any:
    """The schedule a DualPipeV engine runs for a batch (common/deepspeed_internals.py, run_short_batches_as):
    DeepSpeed's DualPipeVSchedule from 2 PP micro-batches up, the V-shaped one on the same module below."""
    name = schedule_for("dualpipev", micro_batches, stages)
    return train_schedule(name, micro_batches, stages, stage_id, forward_only=forward_only)
