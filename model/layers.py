"""Megatron-style tensor-parallel layers: where the tensors are sharded.

With R = tensor-parallel size and r this rank:

    layer                    weight shard        bias shard      input               output
    VocabParallelEmbedding   [V/R, h]  rows      -               ids (b, s)          (b, s, h) replicated
    ColumnParallelLinear     [N/R, K]  rows      [N/R]           (b, s, K) replic.   (b, s, N/R) sharded
      with n sub-matrices    [n N/R, K] rows r of each of the n [N, K] blocks, stacked (SwiGLU's gate and up: n = 2)
    RowParallelLinear        [N, K/R]  columns   [N] replicated  (b, s, K/R) sharded (b, s, N) replicated
    RMSNorm                  [h]       replicated                (b, s, h) replic.   (b, s, h) replicated
    rotary (RoPE)            no parameters; applied to this rank's own q and k heads, nothing to shard
    vocab_parallel_cross_entropy                                 logits (b, s, V/R)  loss (b, s) replicated

Every sharded parameter carries ``tensor_model_parallel = True`` (with Megatron's partition_dim/stride): DeepSpeed's
ZeRO gradient norm counts such a parameter on every TP rank and a replicated one on TP rank 0 only; without the
attribute the clipped norm is silently wrong.

Sequence parallelism (ctx.sequence_parallel, Korthikanti et al. 2022) changes only the replicated columns: what is
"replicated (b, s, h)" above is then this rank's sequence shard (b, s/R, h), positions [r s/R, (r+1) s/R).

    layer                    input                          output
    VocabParallelEmbedding   ids (b, s)                     (b, s/R, h): reduce-scattered instead of all-reduced
      as the output head     (b, s/R, h), all-gathered      (b, s, V/R)
    ColumnParallelLinear     (b, s/R, K), all-gathered      (b, s, N/R)   stores the shard, gathers again in backward
    RowParallelLinear        (b, s, K/R)                    (b, s/R, N): reduce-scattered, then the bias
    norms, dropouts, adds    (b, s/R, h)                    (b, s/R, h)

A replicated parameter then sees only this rank's positions, so its gradient is a partial sum over the TP ranks:
``sequence_parallel_parameters`` lists them (every parameter not marked tensor_model_parallel: the norms, the
row-parallel biases, the position table) and their gradients are all-reduced over TP once per step, before the
optimizer and its gradient norm see them (model/gpt.py, GPTPipelineModule). The per-head q/k norms
(model.qk_layernorm) are replicated but see only this rank's heads, and the MoE router and shared-expert gate weight
this rank's partial expert outputs (model/moe.py): their gradients are partial sums with or without sequence
parallelism (``partial_gradient_parameters`` lists what is reduced in each case).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from common.device import HOST
from model.init import normal_sharded_
from model.parallel import ParallelContext
from model.primitives import (
    Group,
    all_gather_sequence,
    copy_to_tensor_parallel_region,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_parallel_region,
)


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, partition_stride: int = 1) -> None:
    """partition_stride (Megatron's name): how many sub-matrices each shard stacks, one slice of each."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = partition_stride


def mark_shared_by_heads(param: nn.Parameter) -> None:
    """A replicated parameter applied to every attention head (the per-head q/k norms, model.qk_layernorm): each TP
    rank holds some of the heads, so its gradient is a partial sum over the TP ranks, with or without sequence
    parallelism."""
    param.shared_by_heads = True


def mark_partial_over_tensor_parallel(param: nn.Parameter) -> None:
    """A replicated parameter that each TP rank applies to its own partial results (the MoE router and shared-expert
    gate, model/moe.py: they weight this rank's slice of the experts' outputs before the reduce): its gradient is a
    partial sum over the TP ranks, with or without sequence parallelism."""
    param.partial_over_tensor_parallel = True


def sequence_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """With sequence parallelism, the parameters whose gradients are partial sums over the TP ranks: every
    trainable one that is not sharded (the module docstring)."""
    return [p for p in module.parameters() if p.requires_grad and not getattr(p, "tensor_model_parallel", False)]


def partial_gradient_parameters(module: nn.Module, sequence_parallel: bool) -> list[nn.Parameter]:
    """The parameters whose gradients are partial sums over the TP ranks, to be all-reduced over TP once per step:
    with sequence parallelism every replicated one (sequence_parallel_parameters), without it those shared by the
    heads (mark_shared_by_heads) and those applied to partial results (mark_partial_over_tensor_parallel) only."""
    if sequence_parallel:
        return sequence_parallel_parameters(module)
    return [p for p in module.parameters() if p.requires_grad and (
        getattr(p, "shared_by_heads", False) or getattr(p, "partial_over_tensor_parallel", False))]


def all_reduce_sequence_parallel_gradients(module: nn.Module, group: Group) -> None:
    """Sum the partial gradients of ``sequence_parallel_parameters`` over the TP group (in place, one all-reduce)."""
    grads = [p.grad for p in sequence_parallel_parameters(module) if p.grad is not None]
    if group_size(group) == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(summed.view_as(grad))


class _SequenceGatherLinear(torch.autograd.Function):
    """y = all_gather_seq(x) A^T + b that stores the shard x, not the gathered input: the backward gathers it again
    (one more all-gather of (b, s/R, K) per layer, Megatron's choice), so the stored input is 1/R of the sequence."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(all_gather_sequence(x, group), weight, bias)  # (b, s, N/R)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathered = all_gather_sequence(x, ctx.group)  # (b, s, K)
        grad_input = reduce_scatter_sequence(grad.matmul(weight), ctx.group)  # summed over the TP ranks' N/R slices
        flat_grad = grad.reshape(-1, grad.shape[-1])  # (b s, N/R)
        grad_weight = flat_grad.t().matmul(gathered.reshape(-1, gathered.shape[-1]))
        grad_bias = flat_grad.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group,
                           sequence_parallel: bool) -> torch.Tensor:
    """Enter a TP region and multiply: a replicated (b, s, K), or with sequence parallelism a shard (b, s/R, K)
    that is all-gathered, -> (b, s, N/R). Input gradients are summed over the TP ranks either way."""
    if sequence_parallel and group_size(group) > 1:
        return _SequenceGatherLinear.apply(x, weight, bias, group)
    return F.linear(copy_to_tensor_parallel_region(x, group), weight, bias)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; rank r holds ids [r V/R, (r+1) V/R).

    ``vocab_size`` is the tokenizer's real vocabulary; rows from there up to ``num_embeddings`` are padding. Used as
    the output head too (tied), where the logits of the padding rows are -inf: padded ids never get probability.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ParallelContext, *, vocab_size: int,
                 init_std: float, seed: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.vocab_size = num_embeddings, embedding_dim, vocab_size
        self.group, self.sequence_parallel = ctx.tensor_parallel_group, ctx.sequence_parallel
        rows = _divide(num_embeddings, ctx.tensor_parallel_size, "padded vocabulary")
        self.vocab_start = ctx.tensor_parallel_rank * rows
        self.vocab_end = self.vocab_start + rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))
        mark_tensor_parallel(self.weight, partition_dim=0)
        normal_sharded_(self.weight, init_std, seed, shard_dim=0, shard_offset=self.vocab_start)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (b, s): ids another rank owns
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        embedded = F.embedding(local_ids, self.weight)  # (b, s, h), partial
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(embedded, self.group)  # (b, s/R, h), this rank's
        return reduce_from_tensor_parallel_region(embedded, self.group)  # (b, s, h), replicated

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output head: (b, s, h) replicated, or (b, s/R, h) with sequence parallelism -> (b, s, V/R) logits of this
        rank's vocabulary slice."""
        logits = column_parallel_linear(hidden, self.weight, None, self.group, self.sequence_parallel)  # (b, s, V/R)
        padded = self.vocab_end - max(self.vocab_size, self.vocab_start)
        if padded > 0:
            # In place on the matmul output (its backward does not read it): no copy of the logits. Outside autograd:
            # the cross-entropy's gradient at a -inf logit is exactly 0 (softmax 0; labels are real ids), so autograd's
            # handling of an in-place fill, a copy of the whole (b, s, V/R) gradient to zero its padded columns, would
            # only zero zeros.
            with torch.no_grad():
                logits[..., -padded:].fill_(float("-inf"))
        return logits

    def extra_repr(self) -> str:
        return (f"vocab rows [{self.vocab_start}, {self.vocab_end}) of {self.num_embeddings} "
                f"(real vocabulary {self.vocab_size}), dim {self.embedding_dim}")


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A [N, K] split by output rows: rank r computes output features [r N/R, (r+1) N/R).

    With ``sub_matrices`` n > 1, A is n matrices [N, K] stacked ([n N, K], e.g. SwiGLU's [gate; up]) and each is
    split on its own: rank r holds [A_1 rows r; ...; A_n rows r], shape [n N/R, K], so that its output features are
    n slices it can use together (silu(gate) * up). ``out_features`` is N, the width of one sub-matrix. The
    unsharded layer (R = 1) holds A itself, and init draws each of its n N rows from that row's own generator.
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, *, init_std: float, seed: int,
                 bias: bool = True, sub_matrices: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features, self.sub_matrices = in_features, out_features, sub_matrices
        self.group, self.sequence_parallel = ctx.tensor_parallel_group, ctx.sequence_parallel
        rows = _divide(out_features, ctx.tensor_parallel_size, "output features")
        self.row_start = ctx.tensor_parallel_rank * rows
        self.weight = nn.Parameter(torch.empty(sub_matrices * rows, in_features))
        mark_tensor_parallel(self.weight, partition_dim=0, partition_stride=sub_matrices)
        for index, block in enumerate(self.weight.data.split(rows)):  # [rows, K] views, rows r of sub-matrix index
            normal_sharded_(block, init_std, seed, shard_dim=0, shard_offset=index * out_features + self.row_start)
        self.bias = nn.Parameter(torch.zeros(sub_matrices * rows)) if bias else None
        if self.bias is not None:
            mark_tensor_parallel(self.bias, partition_dim=0, partition_stride=sub_matrices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, K) replicated, or (b, s/R, K) gathered with sequence parallelism; grads summed over TP
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel)  # (b, s, N/R)

    def extra_repr(self) -> str:
        rows = self.weight.shape[0] // self.sub_matrices
        stacked = f" in each of {self.sub_matrices} stacked matrices" if self.sub_matrices > 1 else ""
        return (f"in {self.in_features}, out rows [{self.row_start}, {self.row_start + rows}) of {self.out_features}"
                f"{stacked}, bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A [N, K] split by input columns: rank r holds A[:, r K/R:(r+1) K/R] and a sharded input.

    The partial products are summed across TP, then the (replicated) bias is added once.
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, *, init_std: float, seed: int,
                 bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel = ctx.tensor_parallel_group, ctx.sequence_parallel
        columns = _divide(in_features, ctx.tensor_parallel_size, "input features")
        self.column_start = ctx.tensor_parallel_rank * columns
        self.weight = nn.Parameter(torch.empty(out_features, columns))
        mark_tensor_parallel(self.weight, partition_dim=1)
        normal_sharded_(self.weight, init_std, seed, shard_dim=1, shard_offset=self.column_start)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # (b, s, N), this rank's share of the sum over K
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)  # (b, s/R, N), this rank's positions
        else:
            y = reduce_from_tensor_parallel_region(partial, self.group)  # (b, s, N) replicated
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in columns [{self.column_start}, {self.column_start + self.weight.shape[1]}) of {self.in_features}, "
                f"out {self.out_features}, bias={self.bias is not None} (added once, after the reduce)")


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, replicated on every TP rank (as LayerNorm).

    Computed in fp32 and cast back before the weight, as transformers' LlamaRMSNorm does (so bf16 results match it).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (b, s, h) fp32
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps} (replicated)"


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The head_dim / 2 rotation frequencies (fp32, on the host), llama3-scaled when ``scaling`` says so.

    The same operations as transformers' _compute_default_rope_parameters and _compute_llama3_parameters
    (modeling_rope_utils.py), so the values are bitwise theirs: long wavelengths (> original context / low_freq_factor)
    are divided by ``factor``, short ones (< original context / high_freq_factor) kept, and those between
    interpolated smoothly.
    """
    # host: built once, on the CPU as transformers computes it (bitwise its values); the module's buffer
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=HOST).to(dtype=torch.float) / head_dim
    powers = theta ** exponents
    inv_freq = 1.0 / powers
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, powers, scaling)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inverse_frequencies(head_dim: int, theta: float, powers: torch.Tensor, scaling: dict) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023), the operations of transformers' _compute_yarn_parameters: each dimension
    interpolated (divided by ``factor``) or extrapolated (kept) by a linear ramp between the dimensions that turn
    beta_fast and beta_slow times over the original context."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:
        return (head_dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    # host: built once on the CPU as transformers computes it (bitwise its values); the module's buffer
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device=HOST)
    extrapolation = 1 - torch.clamp((dims - low) / (high - low), 0, 1)
    return (1.0 / (factor * powers)) * (1 - extrapolation) + (1.0 / powers) * extrapolation


def rope_attention_scaling(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by: 1, or YaRN's attention factor (given, or 0.1 ln(factor) + 1, with
    mscale / mscale_all_dim as transformers reads them)."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"]))
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 mscale ln(factor) + 1 (1 at factor <= 1): transformers' yarn_get_mscale, eq. 21 of Peng et al."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_cos_sin(inv_freq: torch.Tensor, seq_length: int, dtype: torch.dtype,
                 device: torch.device, offset: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (s, d) of positions offset .. offset + s - 1 (a KV cache holds the first ``offset``), in fp32,
    times ``scale`` (rope_attention_scaling), then cast to ``dtype`` (transformers' order of operations).

    Frequencies are laid out [f_0 .. f_{d/2-1}, f_0 .. f_{d/2-1}]: Hugging Face Llama's non-interleaved convention,
    whose partner of dimension i is i + d/2 (rotate_half), so Llama weights need no row permutation. ``inv_freq`` on
    ``device`` (RotaryEmbedding's buffer) is used as it is; one on the host is copied there."""
    positions = torch.arange(offset, offset + seq_length, device=device, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]  # (s, d/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (s, d)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rope_cos_sin_at(inv_freq: torch.Tensor, position_ids: torch.Tensor,
                    dtype: torch.dtype, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (b, 1, s, d) at each sample's own positions ``position_ids`` (b, s): positions that restart at each
    document of a packed sample (data.reset_position_ids). The same operations as ``rope_cos_sin``, so positions
    0 .. s-1 give the same values."""
    freqs = position_ids.float()[..., None] * inv_freq.to(position_ids.device)  # (b, s, d/2)
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # (b, 1, s, d): one rotation for every head
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x (b, heads, s, d) by its position: x cos + rotate_half(x) sin, as transformers does."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
    return x * cos + rotated * sin


class RotaryEmbedding(nn.Module):
    """RoPE on this rank's q and k heads (b, heads, s, d) at positions offset .. offset + s - 1 (offset: the tokens a KV
    cache already holds, and under context parallelism this rank's start in the sample), or at given per-token
    positions; no parameters, nothing sharded.

    The frequencies are a buffer, so they move with the module (no host-to-device copy in the step), non-persistent
    (a checkpoint need not hold them: they follow from the config), and kept fp32 whatever the module is cast to
    (``_apply``): a bf16 model must not round them.

    cos and sin are made once per micro-batch for all the blocks of a stage: the blocks of one model share one
    RotaryEmbedding (model/gpt.py), which keeps the last table it made with what it was made for,

        key                                          the table is made again when
        positions: the ``position_ids`` tensor       a new micro-batch's ids arrive (packed samples: positions
          itself, or none (offset .. offset + s - 1)   restart at each document), or offset / s change (a KV cache
        offset, s, dtype, device                       grows; context parallelism's start is the same for a rank)
        inference mode                               a table made under torch.inference_mode would not be saved for
                                                       a backward

    A full recompute reruns its blocks' rotations in the backward pass: from the kept table when it still holds the
    micro-batch's positions, otherwise made again by the same operations (bitwise the same values). YaRN's attention
    factor multiplies the table once (``attention_scaling``)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, theta, scaling), persistent=False)
        self.attention_scaling = rope_attention_scaling(scaling)  # 1, or YaRN's factor on cos and sin
        self._table: tuple | None = None  # (key, position_ids, cos, sin): the last one made

    def _apply(self, fn, recurse: bool = True):
        """Moves as any module, but a cast (module.to(torch.bfloat16), .half()) leaves the frequencies fp32: they are
        made again on the new device from the config (the model's build, not its step)."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            frequencies = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
            self.inv_freq = frequencies.to(self.inv_freq.device)
        self._table = None
        return self

    def cos_sin(self, length: int, dtype: torch.dtype, device: torch.device, offset: int = 0,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``position_ids`` (b, s) -> each (b, 1, s, d), or of positions offset .. offset + length - 1
        -> each (s, d): the kept table when its key matches (class docstring). Inside a compiled block
        (training.compile) the table is made in the block's graph, where inductor fuses it, and not kept: the key's
        torch.is_inference_mode_enabled() breaks a graph, and at that break torch 2.13 replayed the views q and k
        wrongly from the block's second call on (a RuntimeError with a garbage shape)."""
        if torch.compiler.is_compiling():
            return self._make(length, dtype, device, offset, position_ids)
        version = None if position_ids is None else position_ids._version  # an id tensor written in place is new
        key = (length, offset, dtype, device, torch.is_inference_mode_enabled(), version)
        if self._table is not None and self._table[0] == key and self._table[1] is position_ids:
            return self._table[2], self._table[3]
        cos, sin = self._make(length, dtype, device, offset, position_ids)
        self._table = (key, position_ids, cos, sin)
        return cos, sin

    def _make(self, length: int, dtype: torch.dtype, device: torch.device, offset: int,
              position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids is not None:
            return rope_cos_sin_at(self.inv_freq, position_ids, dtype, self.attention_scaling)
        return rope_cos_sin(self.inv_freq, length, dtype, device, offset, self.attention_scaling)

    def forward(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids`` (b, s): each token's position in its document (packed samples, training only);
        without, positions offset .. offset + s - 1."""
        cos, sin = self.cos_sin(q.shape[-2], q.dtype, q.device, offset, position_ids)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim {self.head_dim}, theta {self.theta}, scaling {self.scaling}"


# The loss works in fp32 on at most this many logits at a time (64 MiB), never on a full-size fp32 copy.
LOSS_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(rows: int, vocab: int) -> list[slice]:
    step = max(1, LOSS_CHUNK_ELEMENTS // vocab)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _shifted_exp(logits: torch.Tensor, logits_max: torch.Tensor) -> torch.Tensor:
    """exp(logits - max) in a new fp32 tensor (rows, V/R); the logits themselves are never written."""
    return logits.to(torch.float32, copy=True).sub_(logits_max.unsqueeze(-1)).exp_()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary: three all-reduces of (b, s) tensors, never the full logits.

    Memory, with t = b s tokens and logits (t, V/R) in their own dtype (bf16 on GPUs):
    - fp32 throughout, one chunk of rows at a time (``LOSS_CHUNK_ELEMENTS``): no full-size fp32 tensor exists;
    - saved for backward: the logits themselves (the input, not a copy: the pipeline engine keeps them until the
      backward anyway) and five per-token tensors (global max, sum of exps, local label, two masks);
    - backward recomputes each chunk's softmax from the logits, makes it the gradient in place
      (softmax - one_hot(label)) x d loss, and writes it straight into the gradient, in the logits' dtype.
    Every value is computed by the same fp32 operations as over the whole tensor at once.
    """

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, ignore_index):
        ctx.set_materialize_grads(False)  # log Z unused (no z-loss): its gradient is None, the backward as before
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)  # (t, V/R)
        logits_max = flat.max(dim=-1).values.float()  # (t,): the max of bf16 values is exact in bf16
        if group_size(group) > 1:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)

        labels = labels.reshape(-1)  # (t,)
        ignored = labels == ignore_index
        local_labels = labels - vocab_start
        mine = (local_labels >= 0) & (local_labels < vocab) & ~ignored
        local_labels = local_labels.masked_fill(~mine, 0)
        target_logit = flat.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).float()
        target_logit = target_logit.sub_(logits_max).masked_fill_(~mine, 0.0)  # (t,), global max subtracted

        sum_exp = torch.empty_like(logits_max)  # (t,)
        for rows in _row_chunks(flat.shape[0], vocab):
            sum_exp[rows] = _shifted_exp(flat[rows], logits_max[rows]).sum(dim=-1)
        if group_size(group) > 1:
            torch.distributed.all_reduce(target_logit, group=group)
            torch.distributed.all_reduce(sum_exp, group=group)
        loss = (sum_exp.log() - target_logit).masked_fill_(ignored, 0.0)  # (t,)

        ctx.save_for_backward(logits, logits_max, sum_exp, local_labels, mine, ignored)
        log_z = sum_exp.log().add_(logits_max)  # (t,): logsumexp of the whole vocabulary's logits
        return loss.view(logits.shape[:-1]), log_z.view(logits.shape[:-1])  # (b, s) each

    @staticmethod
    def backward(ctx, grad_loss, grad_log_z):
        logits, logits_max, sum_exp, local_labels, mine, ignored = ctx.saved_tensors
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)  # (t, V/R)
        if grad_loss is None:
            grad_loss = torch.zeros_like(logits_max)
        scale = grad_loss.reshape(-1).masked_fill(ignored, 0.0)  # (t,)
        grad = torch.empty_like(flat)  # (t, V/R) in the logits' dtype
        for rows in _row_chunks(flat.shape[0], vocab):
            softmax = _shifted_exp(flat[rows], logits_max[rows]).div_(sum_exp[rows].unsqueeze(-1))
            if grad_log_z is None:
                # d loss / d logits = softmax - one_hot(label), on the rank that owns the label
                softmax.scatter_add_(-1, local_labels[rows].unsqueeze(-1), -mine[rows].unsqueeze(-1).to(softmax.dtype))
                grad[rows] = softmax.mul_(scale[rows].unsqueeze(-1))
            else:  # and d log Z / d logits = softmax
                label_scale = (mine[rows].to(softmax.dtype) * scale[rows]).unsqueeze(-1)
                softmax.mul_((scale[rows] + grad_log_z.reshape(-1)[rows]).unsqueeze(-1))
                grad[rows] = softmax.scatter_add_(-1, local_labels[rows].unsqueeze(-1), -label_scale)
        return grad.view(logits.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group, vocab_start: int,
                                 ignore_index: int = -100, return_log_z: bool = False):
    """Per-token loss (b, s) from this rank's logits slice (b, s, V/R) starting at global id ``vocab_start``.

    Equals F.cross_entropy(gathered_logits, labels, reduction="none", ignore_index=ignore_index), in fp32. With
    ``return_log_z`` also log Z (b, s) fp32, torch.logsumexp of the gathered logits, differentiable (the z-loss):
    the cross-entropy has it already, max + log(sum of exps), so it costs nothing more.
    """
    loss, log_z = _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, ignore_index)
    return (loss, log_z) if return_log_z else loss


def vocab_parallel_argmax(logits: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
    """The global argmax (b, s) of logits split by vocabulary, this rank's slice (b, s, V/R) starting at global id
    ``vocab_start``: the first id holding the largest value, as torch.argmax of the gathered logits gives it. Two
    all-reduces of (b, s) tensors; the logits are never gathered."""
    local_max, local_index = logits.float().max(dim=-1)  # first maximum of this slice
    if group_size(group) <= 1:
        return local_index + vocab_start
    global_max = local_max.clone()
    torch.distributed.all_reduce(global_max, op=torch.distributed.ReduceOp.MAX, group=group)
    candidate = torch.where(local_max == global_max, local_index + vocab_start,
                            torch.full_like(local_index, torch.iinfo(torch.int64).max))
    torch.distributed.all_reduce(candidate, op=torch.distributed.ReduceOp.MIN, group=group)
    return candidate
