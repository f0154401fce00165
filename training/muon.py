"""Muon on tensor-parallel matrices: each Hugging Face matrix orthogonalised whole, AdamW for everything else.

What each parameter gets (``muon_param_groups``), and what one step does with it, on every rank:

    parameter                                      group                 update
    block matrices: attention.qkv, attention.dense, "muon" (EP > 1: the   Muon: momentum, Newton-Schulz on each
      mlp.gate_up / down (fc1 / fc2), MLA's         experts' "ep_size_N",  Hugging Face matrix whole (q, k, v, o,
      projections, shared and routed experts        "muon" true)          gate, up, down apart; experts per expert)
    embeddings, untied head, other 2-D (routers,   "decay"               AdamW (torch's functional AdamW)
      shared-expert gate)
    norms, biases (1-D)                            "no_decay"            AdamW, weight decay 0

DeepSpeed drives the step as it does Adam's: the gradients are averaged over DP, the global norm is computed and the
gradients clipped by ZeRO-1 (or BF16_Optimizer) exactly as for Adam, and only then is this optimizer's ``step`` called,
on each param group's flat fp32 partition (1/DP of the group's flattened parameters). A Muon group's step:

    1. momentum, elementwise on this rank's partition:   B = lerp(B, g, 1 - mu);  U = lerp(g, B, mu) (nesterov) or B
    2. all-gather U over the group's data-parallel group (ZeRO's partition group; EDP for experts): the whole flat
       group, each parameter's TP shard of U (``flat_partition_layout`` says where each lies)
    3. for each parameter overlapping this rank's partition: all-gather its TP shards over the TP group, merge them
       into the HF matrices (hf/transforms.py merge_to_hf), Newton-Schulz each in fp32, times lr x adjust_lr(HF
       shape), split back (split_from_hf) and keep this TP rank's shard
    4. W = W (1 - lr wd) - that, on this rank's partition

Without ZeRO (stage 0, fp32) the groups hold the parameters themselves: steps 2 and the partition are skipped.

Cost per step and stage, M the Muon parameters of the stage (this rank's TP shards), d the DP size, t the TP size:
momentum 4 M / d bytes (one fp32 state, sharded as Adam's exp_avg); a transient fp32 gather buffer of 4 M bytes;
communication an all-gather of 4 M bytes over DP (ZeRO's own parameter all-gather moves the same count in the
training dtype) and, per matrix, an all-gather of (t - 1) / t of it over TP; compute: every matrix orthogonalised
on the t TP ranks of the DP rank(s) whose partition it overlaps (about 1/d of the matrices per rank, plus those
cut by a partition boundary), 5 iterations of ~3 matmuls of the matrix's short side (``newton_schulz_flops``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adam import adam as functional_adam

from common import deepspeed_internals as ds_internals
from common.device import HOST, device_of
from hf.muon_matrices import muon_parameters, newton_schulz_flops
from hf.tables import TensorMap
from hf.transforms import merge_to_hf, split_from_hf
from model.config import ModelConfig
from model.parallel import ParallelContext
from runconfig.optimizer import NS_COEFFICIENTS, NS_EPS, MuonConfig


def newton_schulz(matrix: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation (its quintic, coefficients, steps and eps), in fp32 where torch's runs
    in bf16: the matrix divided by its Frobenius norm, then ``steps`` of X <- a X + (b A + c A^2) X, A = X X^T, on the
    wide orientation. Returns a new fp32 tensor of ``matrix``'s shape."""
    a, b, c = coefficients
    x = matrix.to(torch.float32, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr: str, shape: torch.Size) -> float:
    """torch.optim.Muon's per-matrix learning rate of an [A, B] matrix (its ``_adjust_lr``)."""
    rows, columns = shape[:2]
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, columns))
    return lr * math.sqrt(max(1, rows / columns))


@dataclass(frozen=True)
class FlatPartition:
    """Where a param group's parameters lie in its flat buffer, and this rank's partition of it
    (common/deepspeed_internals.py, flat_partition_layout)."""

    params: list[nn.Parameter]
    offsets: list[int]
    size: int
    """Elements per rank: rank r holds [r size, (r + 1) size) of the flat buffer."""
    rank: int
    group: Any

    @property
    def start(self) -> int:
        """Where this rank's partition begins in the flat buffer."""
        return self.rank * self.size

    def overlaps(self) -> Iterator[tuple[nn.Parameter, int, int, int]]:
        """(parameter, its offset, low, high) for each parameter with elements [low, high) of the flat buffer in
        this rank's partition. The same on every TP rank: the TP shards have the same shapes and offsets."""
        for param, offset in zip(self.params, self.offsets, strict=True):
            low, high = max(offset, self.start), min(offset + param.numel(), self.start + self.size)
            if low < high:
                yield param, offset, low, high


def muon_param_groups(module: nn.Module, tensors: dict[nn.Parameter, TensorMap],
                      weight_decay: float) -> list[dict[str, Any]]:
    """The stage's parameters in the table's groups (module docstring), each named; Muon's (``tensors``, from
    ``muon_parameters``) marked ``muon`` True. The experts at EP > 1 keep their own group (DeepSpeed reduces them over
    their EDP group), a Muon one."""
    muon = {id(p) for p in tensors}
    trained = [p for p in module.parameters() if p.requires_grad]
    dense = [p for p in trained if ds_internals.expert_group_of(p) is None]
    groups = [{"name": "muon", "params": [p for p in dense if id(p) in muon], "weight_decay": weight_decay,
               "muon": True},
              {"name": "decay", "params": [p for p in dense if p.ndim >= 2 and id(p) not in muon],
               "weight_decay": weight_decay, "muon": False},
              {"name": "no_decay", "params": [p for p in dense if p.ndim < 2], "weight_decay": 0.0, "muon": False}]
    for name in sorted({ds_internals.expert_group_of(p) for p in trained} - {None}):
        experts = [p for p in trained if ds_internals.expert_group_of(p) == name]
        if any(id(p) not in muon for p in experts):
            raise ValueError(f"Muon: expert group {name} holds parameters that are not expert matrices")
        group = ds_internals.expert_param_group(experts, int(name.removeprefix("ep_size_")), weight_decay)
        groups.append({**group, "muon": True})
    return [group for group in groups if group["params"]]


class TensorParallelMuon(torch.optim.Optimizer):
    """Muon for the block matrices, each orthogonalised as the whole HF matrix across the TP shards, and AdamW for
    the rest (module docstring). Built before deepspeed.initialize (a client optimizer: ZeRO-1 or BF16_Optimizer
    wraps it), then ``bind``-ed to the flat partitions the wrapper made of its groups."""

    def __init__(self, param_groups: list[dict[str, Any]], options: MuonConfig, tensors: dict[nn.Parameter, TensorMap],
                 model_config: ModelConfig, context: ParallelContext) -> None:
        defaults = dict(lr=options.lr, weight_decay=options.weight_decay, momentum=options.momentum,
                        nesterov=options.nesterov, ns_steps=options.ns_steps, adjust_lr=options.adjust_lr,
                        betas=options.betas, eps=options.eps)
        super().__init__(param_groups, defaults)
        self.tensors = {id(param): tensor for param, tensor in tensors.items()}
        self.model_config, self.context = model_config, context
        self.partitions: dict[str, FlatPartition] = {}
        self.clip: QKClip | None = None  # MuonClip (optimizer.qk_clip): its rows' factors, applied after the update
        self.newton_schulz_flops = 0  # run on this rank so far, counted on the host from the shapes

    def bind(self, partitions: dict[str, FlatPartition]) -> None:
        """The flat partitions DeepSpeed's optimizer made of each group (by group name): from now on the groups hold
        those, not the parameters."""
        self.partitions = dict(partitions)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One step of every group DeepSpeed hands over (ZeRO-1 steps one group at a time)."""
        if self.clip is not None and self.clip.attentions and not self.clip.fresh:
            raise RuntimeError("MuonClip: the optimizer stepped without this step's per-head maxima reduced first "
                               "(QKClip.before_step, hooked before DeepSpeed's OptimizerStep instruction); this "
                               "schedule did not run the hook, so the clip would use the previous step's factors")
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
            if self.clip is not None and self.clip.factors:
                self._clip_rows(group)

    @torch.no_grad()
    def apply_clip(self) -> None:
        """MuonClip's factors now, outside a step (its passes): each clipped row of what this rank updates (the fp32
        masters, or the parameters without ZeRO) and, where those are ZeRO's or BF16_Optimizer's copies, of the
        model's weights."""
        for group in self.param_groups:
            self._clip_rows(group)
        if self.partitions:
            self.clip.scale_model_rows()

    def _clip_rows(self, group: dict[str, Any]) -> None:
        """MuonClip's row factors on what this rank updates of the group: the parameters, or its flat partition."""
        factors = self.clip.factors
        partition = self.partitions.get(group["name"])
        if partition is None:
            for param in group["params"]:
                if id(param) in factors:
                    scale_rows(param, factors[id(param)])
            return
        (flat,) = group["params"]
        for param, offset, low, high in partition.overlaps():
            if id(param) not in factors:
                continue
            columns = param.numel() // param.shape[0]  # the factors of the rows the overlap touches, per element
            first, last = (low - offset) // columns, -(-(high - offset) // columns)
            per_element = factors[id(param)][first:last].repeat_interleave(columns)
            skip = low - offset - first * columns
            flat[low - partition.start:high - partition.start].mul_(per_element[skip:skip + high - low])

    def _adamw_step(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's single-tensor update (its functional form), on whatever the group holds."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, device=HOST)  # host: torch's AdamW counts its steps on the host (capturable off)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        functional_adam(
            params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
            [self.state[p]["exp_avg_sq"] for p in params], [], [self.state[p]["step"] for p in params],
            foreach=False, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _momentum_update(self, flat: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """B = lerp(B, g, 1 - mu) in place; returns what Newton-Schulz orthogonalises (torch's Muon)."""
        grad, momentum = flat.grad, group["momentum"]
        state = self.state[flat]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - momentum)
        return grad.lerp(buffer, momentum) if group["nesterov"] else buffer.clone()

    def _muon_step(self, group: dict[str, Any]) -> None:
        partition = self.partitions.get(group["name"])
        lr, decay = group["lr"], group["weight_decay"]
        if partition is None:  # no ZeRO: the group holds the parameters, each update whole on this rank
            for param in group["params"]:
                if param.grad is None:
                    continue
                orthogonal = self.orthogonal_shard(param, self._momentum_update(param, group), group)
                param.mul_(1 - lr * decay).sub_(orthogonal)
            return
        (flat,) = group["params"]
        update = self._momentum_update(flat, group)  # (P,), this rank's partition
        world = dist.get_world_size(group=partition.group) if partition.group is not None else 1
        if world > 1:
            pieces = [torch.empty_like(update) for _ in range(world)]
            dist.all_gather(pieces, update, group=partition.group)
            whole = torch.cat(pieces)  # (world P,): the whole flat group
        else:
            whole = update
        flat.mul_(1 - lr * decay)
        for param, offset, low, high in partition.overlaps():
            shard = whole[offset:offset + param.numel()].view(param.shape)
            orthogonal = self.orthogonal_shard(param, shard, group).reshape(-1)
            flat[low - partition.start:high - partition.start].sub_(orthogonal[low - offset:high - offset])

    def orthogonal_shard(self, param: nn.Parameter, shard: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Collective over the TP group: this rank's shard of lr x adjust_lr x NS(each HF matrix of the whole
        update), from this rank's ``shard`` of the update (the shape of ``param``)."""
        tensor, ctx = self.tensors[id(param)], self.context
        if ctx.tensor_parallel_size > 1:
            shards = [torch.empty_like(shard) for _ in range(ctx.tensor_parallel_size)]
            dist.all_gather(shards, shard.contiguous(), group=ctx.tensor_parallel_group)
        else:
            shards = [shard]
        merged = merge_to_hf(tensor, shards, self.model_config)
        matrices = (merged,) if torch.is_tensor(merged) else merged
        self.newton_schulz_flops += sum(newton_schulz_flops(*m.shape, group["ns_steps"]) for m in matrices)
        scaled = tuple(newton_schulz(matrix, group["ns_steps"]).mul_(
            adjusted_lr(group["lr"], group["adjust_lr"], matrix.shape)) for matrix in matrices)
        value = scaled[0] if torch.is_tensor(merged) else scaled
        return split_from_hf(tensor, value, self.model_config, ctx.tensor_parallel_size)[ctx.tensor_parallel_rank]


class QKClip:
    """MuonClip (Kimi-K2): after each optimizer step, every attention head whose largest pre-softmax logit in the
    step's forwards passed tau has its logits scaled by gamma = tau / max, through its query and key rows (the
    attention's ``logit_rows``: exact for MHA, GQA and MLA, whose rope key shared by the heads is left alone).

    Each attention keeps its heads' maxima through the step's training forwards (model/attention.py ``step_logits``,
    the scores formed a chunk at a time beside the fused kernel); ``before_step``, run just before DeepSpeed's
    OptimizerStep, all-reduces them (MAX, one vector per stage) over the data-parallel group, turns them into row
    factors and starts the next step's record. The optimizer multiplies its fp32 masters' rows by them right after its
    update (the weight in the Muon group, a qkv bias in AdamW's), so ZeRO's gather hands the model the clipped
    weights.

    The logit is the step's own, before its update, which can move it past tau again (by tens at lr 1.0:
    tests/test_muon_clip.py). ``passes`` > 0 (optimizer.params.qk_clip_passes) makes the clip hold on the step's
    batch: ``clip_after_step`` then runs forwards of the step's micro-batches through the updated weights, each
    attention clipping its own rows (``_clip_in_pass``) before its output goes on, until a pass finds no head above
    tau."""

    def __init__(self, tau: float, module: nn.Module, data_parallel_group: Any = None, passes: int = 0,
                 apply: Any = None) -> None:
        from model.attention import CausalAttention

        self.tau, self.group, self.passes = tau, data_parallel_group, passes
        self.apply = apply
        """The optimizer's ``apply_clip``: ``factors`` on its masters' rows and the model's (the passes)."""
        self.attentions = [m for m in module.modules() if isinstance(m, CausalAttention)]
        self.factors: dict[int, torch.Tensor] = {}
        """id(parameter) -> its rows' factors, for the coming update (or, in a pass, one attention's now)."""
        self.parameters: dict[int, nn.Parameter] = {}
        """id(parameter) -> the model's parameter, for each key of ``factors``."""
        self.largest: torch.Tensor | None = None
        """The last step's per-head maxima (this stage's heads, reduced over DP), before clipping: on the device."""
        self.fresh = False
        """The factors are this step's: set by ``before_step``, cleared by the next forward (``forward_started``),
        so that an optimizer step the reduction did not precede fails instead of clipping by stale factors."""
        self._pass_largest: torch.Tensor | None = None
        self.device = device_of(module)
        dtype = self.attentions[0].dense.weight.dtype if self.attentions else torch.float32
        self.pass_tolerance = pass_tolerance(dtype)
        """How far above tau a pass may find a head and still stop: fp32's (or bf16's) rounding of rows scaled to
        tau, not a clip to make."""
        self.passes_run = 0
        """The passes ``clip_after_step`` ran after the last step, 0 after a skipped one (the trainer sets it; logged as
        qk_clip_passes)."""
        self._start_record()

    def forward_started(self) -> None:
        self.fresh = False

    def _start_record(self) -> None:
        for attention in self.attentions:
            attention.step_logits = torch.full((), float("-inf"), device=device_of(attention))

    def before_step(self) -> None:
        """Collective over the data-parallel group of this stage."""
        if not self.attentions:
            return
        maxima = torch.cat([a.step_logits.float().expand(a.heads) for a in self.attentions])
        self.largest = self._reduce(maxima)
        self._set_factors(self.attentions, self.largest)
        self._start_record()
        self.fresh = True

    def scale_model_rows(self) -> None:
        """The factors on the model's own weights (where the optimizer's masters are copies of them)."""
        for key, factors in self.factors.items():
            scale_rows(self.parameters[key].data, factors)

    def _reduce(self, maxima: torch.Tensor) -> torch.Tensor:
        if self.group is not None and dist.get_world_size(group=self.group) > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        return maxima

    def _set_factors(self, attentions: list[nn.Module], maxima: torch.Tensor, tolerance: float = 0.0) -> None:
        gamma = torch.where(maxima > self.tau * (1 + tolerance), self.tau / maxima, torch.ones_like(maxima))
        self.factors, self.parameters = {}, {}
        for attention, heads in zip(attentions, gamma.split([a.heads for a in attentions]), strict=True):
            for param, rows in attention.logit_rows(heads):
                self.factors[id(param)], self.parameters[id(param)] = rows, param

    def start_pass(self) -> None:
        self._pass_largest = torch.full((), float("-inf"), device=self.device)  # a stage without attention too
        for attention in self.attentions:
            attention.logit_hook = self._clip_in_pass

    def end_pass(self) -> torch.Tensor:
        """This rank's largest logit of the pass, before its clipping (a device scalar)."""
        for attention in self.attentions:
            attention.logit_hook = None
        self.factors = {}
        return self._pass_largest

    def _clip_in_pass(self, attention: nn.Module, q: torch.Tensor, k: torch.Tensor,
                      segment_ids: torch.Tensor | None) -> None:
        """One attention's heads on one micro-batch, reduced over DP (every replica runs the pass in step): their
        rows scaled now, by 1 where under tau (exact: no host sync to decide)."""
        maxima = self._reduce(attention.head_maxima(q, k, segment_ids))
        self._pass_largest = torch.maximum(self._pass_largest, maxima.amax())
        self._set_factors([attention], maxima, self.pass_tolerance)
        self.apply()


def clip_after_step(engine: Any, micro_batches: list, clip: QKClip) -> int:
    """MuonClip's passes (``QKClip``): forwards of the step's ``micro_batches`` (this rank's, as train_batch took
    them) through the updated weights, each attention clipping its rows before its output goes on, until a pass
    finds every head at or below tau (to the rounding of the scaled rows, ``pass_tolerance``) or ``clip.passes``
    ran. The last pass's forwards then had no head above tau. Collective over every rank; one host read a pass.
    Returns the passes run (the trainer keeps it in ``clip.passes_run`` for the log)."""
    for done in range(1, clip.passes + 1):
        clip.start_pass()
        try:
            engine.eval_batch(data_iter=iter(micro_batches), num_micro_batches=len(micro_batches))  # as evaluation
        finally:
            largest = clip.end_pass()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        if float(largest) <= clip.tau * (1 + clip.pass_tolerance):
            return done
    if dist.get_rank() == 0:
        print(f"[qk_clip] after {clip.passes} passes the last still found a logit of {float(largest):.4g} above tau "
              f"{clip.tau} (and clipped it; later blocks may still pass tau): raise optimizer.params.qk_clip_passes, "
              f"or lower the learning rate", flush=True)
    return clip.passes


def scale_rows(tensor: torch.Tensor, rows: torch.Tensor) -> None:
    """``tensor`` (rows, ...) times one factor per row, in place."""
    tensor.mul_(rows.view(-1, *[1] * (tensor.ndim - 1)))


def pass_tolerance(dtype: torch.dtype) -> float:
    """How far above tau (relative) a pass leaves a head: the rounding of a logit whose query and key rows were scaled
    to tau in ``dtype``, 4 of its epsilons (bf16: 3.1e-2; fp16: 3.9e-3), and at least 1e-5 (fp32). Scaling such a
    head again would move bf16 weights by less than their spacing, while the fp32 masters kept shrinking."""
    return max(1e-5, 4 * torch.finfo(dtype).eps)


def as_pipeline_layers(model: nn.Module) -> nn.Module:
    """The one-process GPT (model/gpt.py) under a pipeline module's parameter names ("<layer index>.<key>", the
    layer_XX indices), for ``build_muon`` on one process (a tied head is the embedding, layer 0)."""
    layers = nn.Module()
    count = len(model.layers)
    for index, module in ((0, model.word_embeddings), (1, model.position_embedding), (count + 2, model.final_norm),
                          (count + 3, model.output_head), *((2 + i, layer) for i, layer in enumerate(model.layers))):
        if module is not None:
            layers.add_module(str(index), module)
    return layers


def build_muon(module: nn.Module, model_config: ModelConfig, context: ParallelContext,
               options: MuonConfig) -> TensorParallelMuon:
    """The stage's optimizer, before deepspeed.initialize."""
    tensors = muon_parameters(module, model_config)
    return TensorParallelMuon(muon_param_groups(module, tensors, options.weight_decay), options, tensors,
                              model_config, context)


def bind_partitions(optimizer: TensorParallelMuon, wrapper: Any) -> None:
    """After deepspeed.initialize: where ZeRO-1 / BF16_Optimizer (``wrapper``, engine.optimizer) put each group's
    parameters in its flat buffer. Without a wrapper (the engine's optimizer is ours) the groups keep the
    parameters."""
    if wrapper is optimizer:
        return
    layouts = ds_internals.flat_partition_layout(wrapper)
    optimizer.bind({group["name"]: FlatPartition(*layout)
                    for group, layout in zip(optimizer.param_groups, layouts, strict=True)})
