"""Mixture-of-Experts block: a deterministic top-k router, a dropless all-to-all dispatch over the expert-parallel
group with uneven splits, SwiGLU experts stored as [E_local, ...] tensors and TP-sharded like the dense SwiGLUMLP,
and an optional shared expert, with a sigmoid gate (Qwen2-MoE) or without (DeepSeek-V3). Its configuration (MoEConfig, ``model.moe``) and the
checks of the expert-parallel size are in model/config/moe.py, which imports no torch.

With E experts, k = top_k, F = moe_ffn_hidden_size, F_s = shared_expert_ffn_hidden_size, R the tensor-parallel and
P the expert-parallel size (EP ranks are data-parallel ranks with the same TP and PP coordinates), E_l = E / P, this
TP rank r and EP rank p, which owns the experts [p E_l, (p + 1) E_l):

    tensor                      shape             sharding
    router.weight               [E, h]            replicated; gradient a partial sum over TP (below) and over EP
    router.expert_bias (buffer) [E] fp32          replicated ("sigmoid_bias" only); no gradient, update_bias
    experts.gate_up             [E_l, 2 F/R, h]   experts of p; per expert rows r of gate and of up, stacked
                                                  (SwiGLUMLP's gate_up: partition_dim 1, stride 2)
    experts.down                [E_l, h, F/R]     experts of p; columns r (partition_dim 2)
    shared_expert.gate_up       [2 F_s/R, h]      rows r of gate and of up, stacked, as SwiGLUMLP's gate_up
    shared_expert.down          [h, F_s/R]        columns r, as SwiGLUMLP's down
    shared_expert.gate          [1, h]            replicated; gradient a partial sum over TP (shared_expert_gate)

Every expert parameter carries ``expert_parallel = True``; at EP > 1 also DeepSpeed's expert tags (``allreduce``
False, ``group_name`` "ep_size_P", common/deepspeed_internals.py tag_expert_parameter), so that its optimizers
reduce the expert gradients over the expert-data-parallel group (the ranks holding the same experts, divided by the
full DP size: each expert's gradient already sums its EP group's tokens through the all-to-all's backward) and count
them once in the gradient norm. Each expert draws its weights from seeds of its global
index (model/init.py), so any TP x EP split holds exactly the slices of the unsplit block.

The dispatch of one forward, T = b s tokens of this EP rank (the whole sequence, also with sequence parallelism),
n = assignments kept (T k when dropless), m = assignments received from the EP group:

    step                                                         shape
    1 enter the TP region: copy, or all-gather the sequence      (b, s, h) or (b, s/R, h) -> tokens (T, h), the same on
                                                                 every TP rank of this EP rank
    2 route in fp32: logits, scores, top-k, gate weights; counts (T, E), (T, E), experts (T, k), weights (T, k),
      per expert (one histogram, on the device)                  tokens_per_expert (E,)
    3 sort the assignments by expert (stable: token order kept)  order (n,), counts (E,); rows tokens[order // k] (n, h)
    4 all-to-all the counts over EP, read them on the host       (P, E_l): rows from rank q for local expert j
    5 all-to-all the rows, uneven splits                         (n, h) -> (m, h), by source rank, then expert
    6 regroup by local expert (stable), run each expert          (m, h) -> (m, h), partial over TP
    7 ungroup, reverse all-to-all                                (m, h) -> (n, h)
    8 unsort, weight, sum over the k choices in router order     (T, k, h) -> (T, h), partial over TP
    9 + sigmoid(tokens w_gate^T) * shared expert (or ungated)    (T, h), partial over TP
    10 leave the TP region: all-reduce, or reduce-scatter         (b, s, h) or (b, s/R, h)

The sequence-split dispatch (MoEBlock.splits_the_sequence: sequence parallelism at R > 1 with EP > 1), as
Megatron-LM's all-to-all dispatcher: each TP rank routes its own T / R tokens (b, s/R, h) and sends their rows, so
the all-to-all, between nodes as often as not, carries 1/R of the bytes (tests/test_moe_dispatch.py counts them):

    step                                                         shape
    1 route this rank's tokens, no gather; the aux and z losses  (T/R, h); their sums and the counts all-reduced
      over the TP group's tokens (Router's statistics_group)     over TP, the same on every TP rank
    2-5 as above, on this rank's rows, with this TP rank's       (n/R, h) -> (m_r, h)
      peers of the EP group; the received counts of every TP
      rank gathered with them (the one host read)
    6 gather the received rows over TP, regroup, run the         (m_r, h) -> (M, h), M = sum over TP of m_r, partial
      TP-sharded experts                                         over TP
    7 reduce-scatter back to the rank that received each row,    (M, h) -> (m_r, h) whole -> (n/R, h)
      ungroup, reverse all-to-all
    8 combine; the shared expert on the gathered sequence,       (T/R, h) whole, no reduce-scatter but the shared
      reduce-scattered back                                      expert's

Each token's output is its own k rows, weighted and summed in a fixed order, so it does not depend on the split; an
expert's rows arrive from rank 0, 1, ... in token order, the order of the unsplit block over the ranks' tokens
concatenated. Only the matmul blocking of different row counts can change last bits. The experts run one matmul
pair per local expert on its contiguous rows (Experts.forward), exact; on CUDA in bf16, torch's grouped GEMM
(model/grouped_gemm.py: one kernel for all local experts, each group padded to 16 bytes) instead. The two give the
same bits on CPU, forward and backward (tests/test_moe.py); on CPU the loop is the faster (1.35 s against 1.78 s
for a forward and backward at h 1024, F 1024, 8 experts, 4,096 rows, one thread).

Host reads (what stops a CUDA stream, tests/host_syncs.py): none at EP 1 on the grouped GEMM, whose group ends are a
cumsum on the device (the loop reads the counts once); at EP > 1 one, step 4's split sizes, which the all-to-all of
the rows takes on the host (Megatron-LM's dispatcher reads them too); a capacity adds one, the number kept.
The aux and z losses and the counts are over this EP rank's tokens, as a data-parallel replica's loss is over its
own: an EP rank is a data-parallel rank, with the same data at any EP.

Gradients. Every TP rank routes the same tokens but combines only its partial expert outputs (steps 8 and 9), so the
router's and the shared gate's gradients are partial sums over TP, with or without sequence parallelism: they are
marked (model.layers.mark_partial_over_tensor_parallel) for the per-step TP all-reduce. The auxiliary losses
(MoEStats) are computed whole on every TP rank, so when attached their gradient reaches x through the TP all-reduce
of step 1's backward (and the router through the TP all-reduce of its gradient) R times: attach them multiplied by
MoEStats.loss_scale = 1 / R. Under the sequence-split dispatch each TP rank routes tokens of its own, which makes the
router's gradient a sum over TP all the same; the losses, from statistics all-reduced with an identity backward,
reach each token once: MoEStats.loss_scale = 1. The router computes in fp32 but keeps its input and weight as they
are for its backward (fp32_linear: no fp32 copy of the (T, h) tokens in a bf16 model).

Capacity (capacity_factor, None by default: dropless). Each EP rank keeps at most C = ceil(capacity_factor T k / E)
of its own assignments per expert, the highest gate weights first (ties: the earlier assignment), before the
dispatch; a dropped assignment adds nothing to its token (no renormalisation, as in Switch/GShard). C counts this
rank's tokens only, so with a capacity the results depend on the split (and the micro-batch): the unsplit block
ranks all tokens against one C over their concatenation, the split one each rank's tokens against its own C.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import deepspeed_internals as ds_internals
from model.config import MoEConfig
from model.grouped_gemm import grouped_swiglu, use_grouped_gemm
from model.init import normal_sharded_, parameter_seed
from model.layers import mark_partial_over_tensor_parallel, mark_tensor_parallel
from model.parallel import ParallelContext
from model.primitives import (
    Group,
    all_gather_single,
    all_to_all,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_rows_from_tensor_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_rows_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from model.random import recomputing
from model.router import Router, expert_histogram


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _divide(numerator: int, denominator: int, what: str) -> int:
    _require(numerator % denominator == 0,
             f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


# ------------------------------------------------------------------------------------------------------ the experts


def _init_swiglu_(gate_up: torch.Tensor, down: torch.Tensor, ffn: int, row_start: int, *, init_std: float,
                  output_init_std: float, seed_gate_up: int, seed_down: int) -> None:
    """gate_up [2 F/R, h] (rows r of gate, then of up) and down [h, F/R] (columns r) as ColumnParallelLinear with
    sub_matrices 2 and RowParallelLinear initialise them: each global row / column from its own generator."""
    rows = gate_up.shape[0] // 2
    for index, block in enumerate(gate_up.split(rows)):  # [F/R, h] views: rows r of gate (0) and of up (1)
        normal_sharded_(block, init_std, seed_gate_up, shard_dim=0, shard_offset=index * ffn + row_start)
    normal_sharded_(down, output_init_std, seed_down, shard_dim=1, shard_offset=row_start)


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # each (n, F/R)
    return F.linear(F.silu(gate) * up, down)  # (n, h), partial over TP


class Experts(nn.Module):
    """This EP rank's E_l SwiGLU experts, global indices [first, first + E_l), each TP-sharded as SwiGLUMLP."""

    def __init__(self, moe: MoEConfig, hidden_size: int, ctx: ParallelContext, *, first: int, count: int,
                 init_std: float, output_init_std: float, seed: int, layer_number: int) -> None:
        super().__init__()
        self.first, self.ffn, self.num_experts = first, moe.moe_ffn_hidden_size, moe.num_experts
        self.kernel = "auto"
        """The experts' matmuls: "auto" (torch's grouped GEMM on CUDA in bf16, one matmul pair per expert
        elsewhere), or "grouped" / "loop" anywhere (benchmarks/bench_moe.py times both; tests/host_syncs.py runs
        CUDA's kernel on CPU)."""
        self.alignment: int | None = None
        """Rows per group of the grouped GEMM (None: grouped_alignment, what the kernel needs on the device)."""
        self.awaiting_files = False
        """Loaded from a layer file without experts (written at EP > 1): they are still to come from the expert
        files (training/expert_checkpoint.py restore_experts); forward refuses to run until they have."""
        rows = _divide(moe.moe_ffn_hidden_size, ctx.tensor_parallel_size, "model.moe.moe_ffn_hidden_size")
        self.row_start = ctx.tensor_parallel_rank * rows
        self.gate_up = nn.Parameter(torch.empty(count, 2 * rows, hidden_size))
        self.down = nn.Parameter(torch.empty(count, hidden_size, rows))
        mark_tensor_parallel(self.gate_up, partition_dim=1, partition_stride=2)
        mark_tensor_parallel(self.down, partition_dim=2)
        for parameter in (self.gate_up, self.down):
            parameter.expert_parallel = True
        for local, expert in enumerate(range(first, first + count)):
            _init_swiglu_(self.gate_up.data[local], self.down.data[local], self.ffn, self.row_start,
                          init_std=init_std, output_init_std=output_init_std,
                          seed_gate_up=parameter_seed(seed, layer_number, f"moe.experts.{expert}.gate_up"),
                          seed_down=parameter_seed(seed, layer_number, f"moe.experts.{expert}.down"))

    @property
    def split(self) -> bool:
        """EP > 1: this rank holds some of the experts."""
        return self.gate_up.shape[0] != self.num_experts

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """At EP > 1 the experts stay out of the layer file: DeepSpeed's data-parallel rank 0 alone writes it
        (PipelineModule.save_state_dict), and it holds E_l of them. Each EP rank writes its own to the layer's
        expert files (model/checkpoint_files.py expert_file)."""
        if not self.split:
            super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        """Takes the whole [E, ...] experts (a layer file written at EP 1, or assembled from expert files:
        model/checkpoint_files.py read_experts) and keeps this rank's [first, first + E_l), or this rank's
        [E_l, ...] as they are; or none (a layer file written at EP > 1): then ``awaiting_files`` until
        restore_experts has read them."""
        names = [prefix + name for name in ("gate_up", "down")]
        if not any(name in state_dict for name in names):
            self.awaiting_files = True
            return
        count = self.gate_up.shape[0]
        mine = {name: state_dict[name][self.first:self.first + count]
                if name in state_dict and state_dict[name].shape[0] == self.num_experts else state_dict.get(name)
                for name in names}
        super()._load_from_state_dict({name: value for name, value in mine.items() if value is not None}, prefix,
                                      local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self.awaiting_files = False

    def runs_grouped(self, rows: torch.Tensor) -> bool:
        """Whether ``forward`` takes torch's grouped GEMM for these rows (``kernel``)."""
        return self.kernel == "grouped" or (self.kernel == "auto" and use_grouped_gemm(rows))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """rows (m, h) grouped by local expert, counts[j] of expert j (E_l,) -> (m, h), partial over TP.

        The grouped GEMM (``runs_grouped``) takes the counts on the rows' device and reads nothing on the host. The
        loop runs one matmul pair per expert on its contiguous slice: exact, and an expert with no rows still gets a
        (zero) gradient; it needs the counts on the host (one read of a device tensor, free on a CPU; a list is used
        as it is). unbind, not self.gate_up[local]: its backward stacks the E_l gradients once, where each
        indexing's backward would write a zero-filled [E_l, ...] gradient and autograd add the E_l of them (the same
        values, bit for bit; benchmarks/bench_moe.py: 1.34 s -> 0.96 s per step at h 1024, F 1024, 8 experts,
        top 2)."""
        if self.awaiting_files:
            raise RuntimeError(f"experts [{self.first}, {self.first + self.gate_up.shape[0]}) were loaded from a "
                               f"layer file written at expert_parallel_size > 1 but not from their expert files: "
                               f"call training/expert_checkpoint.py restore_experts after the load")
        if self.runs_grouped(rows):
            return grouped_swiglu(rows, counts, self.gate_up, self.down, self.alignment)
        sizes = counts if isinstance(counts, list) else counts.tolist()
        experts = zip(rows.split(sizes), self.gate_up.unbind(0), self.down.unbind(0), strict=True)
        outputs = [_swiglu(chunk, gate_up, down) for chunk, gate_up, down in experts]
        return torch.cat(outputs)

    def extra_repr(self) -> str:
        count, rows = self.gate_up.shape[0], self.gate_up.shape[1] // 2
        return (f"experts [{self.first}, {self.first + count}), ffn rows [{self.row_start}, {self.row_start + rows}) "
                f"of {self.ffn} in gate and up")


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert, sigmoid(x w_gate^T) * SwiGLU(x), or DeepSeek-V3's, SwiGLU(x) (``gated`` False),
    inside the block's TP region (partial over TP)."""

    def __init__(self, ffn: int, hidden_size: int, ctx: ParallelContext, *, init_std: float, output_init_std: float,
                 seed: int, layer_number: int, gated: bool = True) -> None:
        super().__init__()
        self.ffn = ffn
        rows = _divide(ffn, ctx.tensor_parallel_size, "model.moe.shared_expert_ffn_hidden_size")
        self.row_start = ctx.tensor_parallel_rank * rows
        self.gate_up = nn.Parameter(torch.empty(2 * rows, hidden_size))
        self.down = nn.Parameter(torch.empty(hidden_size, rows))
        mark_tensor_parallel(self.gate_up, partition_dim=0, partition_stride=2)
        mark_tensor_parallel(self.down, partition_dim=1)
        _init_swiglu_(self.gate_up.data, self.down.data, ffn, self.row_start, init_std=init_std,
                      output_init_std=output_init_std,
                      seed_gate_up=parameter_seed(seed, layer_number, "moe.shared_expert.gate_up"),
                      seed_down=parameter_seed(seed, layer_number, "moe.shared_expert.down"))
        self.gate = nn.Parameter(torch.empty(1, hidden_size)) if gated else None
        if gated:
            mark_partial_over_tensor_parallel(self.gate)
            normal_sharded_(self.gate, init_std, parameter_seed(seed, layer_number, "moe.shared_expert.gate"))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens (T, h), the same on every TP rank; the gate (T, 1) scales this rank's partial output
        output = _swiglu(tokens, self.gate_up, self.down)
        return output if self.gate is None else torch.sigmoid(F.linear(tokens, self.gate)) * output

    def extra_repr(self) -> str:
        rows = self.down.shape[1]
        gate = "no gate" if self.gate is None else "sigmoid gate"
        return f"ffn rows [{self.row_start}, {self.row_start + rows}) of {self.ffn}, {gate}"


# --------------------------------------------------------------------------------------------------- the dispatch


def sort_assignments(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None,
                     routed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept assignments of (T, k) ``experts`` as flat indices into T k, sorted by expert then token (stable),
    their count per expert (E,), and the number dropped (()). ``routed`` (E,): the assignments per expert, the
    router's tokens_per_expert (counted here when not given). With a capacity C, an expert keeps its C assignments
    of highest weight, ties to the earlier one: how many are kept sizes the output, one read on the host."""
    flat = experts.reshape(-1)  # (T k,)
    routed = expert_histogram(flat, num_experts) if routed is None else routed  # (E,)
    if capacity is None:
        return torch.argsort(flat, stable=True), routed, routed.new_zeros(())
    by_priority = torch.argsort(weights.reshape(-1), descending=True, stable=True)
    order = by_priority[torch.argsort(flat[by_priority], stable=True)]  # by expert, then weight
    starts = torch.cumsum(routed, dim=0) - routed
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    order = order[rank_in_expert < capacity].sort().values  # the kept, in token order
    order = order[torch.argsort(flat[order], stable=True)]  # then by expert, as when dropless
    kept = routed.clamp(max=capacity)
    return order, kept, (routed - kept).sum()


def combine(outputs: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """outputs (n, h) of the assignments ``order`` (flat indices into T k) -> (T, h): each token's k outputs
    weighted by weights (T, k) and summed in router order; a dropped assignment counts as zero."""
    tokens, k = weights.shape
    slot = torch.full((tokens * k,), outputs.shape[0], dtype=torch.int64, device=outputs.device)  # n: the zero row
    slot[order] = torch.arange(order.numel(), device=outputs.device)
    padded = torch.cat([outputs, outputs.new_zeros(1, outputs.shape[1])])  # (n + 1, h)
    return (padded[slot].view(tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1)  # (T, h)


@dataclass
class MoEStats:
    """What one forward reports besides its output, for this EP rank's tokens (not attached to anything)."""

    aux_loss: torch.Tensor
    """() fp32, unscaled (Routing.aux_loss); attach aux_loss_coeff x loss_scale x this."""
    z_loss: torch.Tensor
    """() fp32, unscaled (Routing.z_loss); attach router_z_loss_coeff x loss_scale x this."""
    tokens_per_expert: torch.Tensor
    """(E,) int64: routed assignments per expert, for the load imbalance (max / mean) once summed over replicas."""
    dropped: torch.Tensor
    """() int64: assignments dropped by the capacity (0 when dropless)."""
    loss_scale: float
    """1 / TP: the auxiliary losses are whole on every TP rank and their gradients pass a TP all-reduce; 1 under the
    sequence-split dispatch, where they reach each token once (module docstring)."""
    sequence_aux_loss: torch.Tensor
    """() fp32, unscaled (Routing.sequence_aux_loss); attach sequence_aux_loss_coeff x loss_scale x this."""


class MoEBlock(nn.Module):
    """The sparse MLP of one block: (b, s, h), or (b, s/R, h) with sequence parallelism, -> the same shape, plus
    MoEStats (module docstring). ``expert_parallel_group`` None means EP 1."""

    def __init__(self, moe: MoEConfig, hidden_size: int, ctx: ParallelContext, *, seed: int, layer_number: int,
                 init_std: float, output_init_std: float, expert_parallel_group: Group = None) -> None:
        super().__init__()
        self.moe, self.group, self.sequence_parallel = moe, ctx.tensor_parallel_group, ctx.sequence_parallel
        self.expert_group = expert_parallel_group
        self.expert_parallel_size = group_size(expert_parallel_group)
        _require(moe.num_experts % self.expert_parallel_size == 0,
                 f"parallelism.expert_parallel_size ({self.expert_parallel_size}) does not divide "
                 f"model.moe.num_experts ({moe.num_experts})")
        self.local_experts = moe.num_experts // self.expert_parallel_size
        self.loss_scale = 1.0 / ctx.tensor_parallel_size
        self.router = Router(moe, hidden_size, init_std=init_std, seed=parameter_seed(seed, layer_number, "moe.router"))
        self.experts = Experts(moe, hidden_size, ctx, first=group_rank(expert_parallel_group) * self.local_experts,
                               count=self.local_experts, init_std=init_std, output_init_std=output_init_std,
                               seed=seed, layer_number=layer_number)
        if self.expert_parallel_size > 1:  # DeepSpeed reduces them over the expert-data-parallel group, not DP
            for parameter in self.experts.parameters():
                ds_internals.tag_expert_parameter(parameter, self.expert_parallel_size)
        self.shared_expert = None
        if moe.shared_expert_ffn_hidden_size:
            self.shared_expert = SharedExpert(moe.shared_expert_ffn_hidden_size, hidden_size, ctx, init_std=init_std,
                                              output_init_std=output_init_std, seed=seed, layer_number=layer_number,
                                              gated=moe.shared_expert_gate)

    @property
    def splits_the_sequence(self) -> bool:
        """The sequence-split dispatch (module docstring): each TP rank routes and sends its own s/R positions, under
        sequence parallelism at TP > 1 with EP > 1, where it cuts the all-to-all's bytes by TP. At EP 1 there is no
        all-to-all, and gathering the s/R tokens (h wide) costs less than gathering their k rows."""
        return self.sequence_parallel and group_size(self.group) > 1 and self.expert_parallel_size > 1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        if self.splits_the_sequence:
            return self._forward_split(x)
        if self.sequence_parallel:
            tokens = gather_from_sequence_parallel_region(x, self.group)  # (b, s, h) from (b, s/R, h)
        else:
            tokens = copy_to_tensor_parallel_region(x, self.group)  # (b, s, h)
        shape = tokens.shape
        tokens = tokens.reshape(-1, shape[-1])  # (T, h)
        routing = self.router(tokens, sequence_length=shape[1])
        capacity = self.moe.capacity(tokens.shape[0])
        order, counts, dropped = sort_assignments(routing.experts, routing.weights, self.moe.num_experts, capacity,
                                                  routing.tokens_per_expert)
        rows = tokens[order // self.moe.top_k]  # (n, h), by expert
        outputs = combine(self._run_experts(rows, counts), order, routing.weights.to(x.dtype))  # (T, h), partial
        if self.shared_expert is not None:
            outputs = outputs + self.shared_expert(tokens)
        outputs = outputs.view(shape)  # (b, s, h), partial over TP
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(outputs, self.group)  # (b, s/R, h)
        else:
            out = reduce_from_tensor_parallel_region(outputs, self.group)  # (b, s, h)
        return out, MoEStats(routing.aux_loss, routing.z_loss, routing.counts, dropped, self.loss_scale,
                             routing.sequence_aux_loss)

    def _forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        """The sequence-split dispatch: x (b, s/R, h), this TP rank's positions, routed and sent here; the rows each
        rank receives gathered over TP for the sharded experts and reduce-scattered back; the output (b, s/R, h)
        whole, not partial. The auxiliary losses are over the TP group's tokens (Router's statistics_group) and
        reach each token once: MoEStats.loss_scale 1."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (T/R, h): this rank's own
        routing = self.router(tokens, statistics_group=self.group)
        capacity = self.moe.capacity(tokens.shape[0])  # over this rank's tokens
        order, counts, dropped = sort_assignments(routing.experts, routing.weights, self.moe.num_experts, capacity,
                                                  routing.tokens_per_expert)
        rows = tokens[order // self.moe.top_k]  # (n, h), by expert
        outputs = combine(self._run_experts_split(rows, counts), order, routing.weights.to(x.dtype))  # (T/R, h)
        out = outputs.view(shape)
        if self.shared_expert is not None:  # the dense path's gather and reduce-scatter, for the shared expert only
            everyone = gather_from_sequence_parallel_region(x, self.group)  # (b, s, h)
            shared = self.shared_expert(everyone.reshape(-1, shape[-1])).view(everyone.shape)
            out = out + reduce_scatter_to_sequence_parallel_region(shared, self.group)  # (b, s/R, h)
        if capacity is not None:
            dropped = dropped.clone()
            dist.all_reduce(dropped, group=self.group)
        return out, MoEStats(routing.aux_loss, routing.z_loss, routing.counts, dropped, 1.0,
                             routing.sequence_aux_loss)

    def _run_experts_split(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (n, h) of this TP rank's tokens, sorted by global expert, counts (E,) -> their experts' outputs (n, h),
        whole: sent over EP as the TP peers' are, gathered over TP (every TP rank computes its slice of F for every
        row its expert-parallel peers received), reduced back over TP, returned over EP. One host read: the
        all-to-all's split sizes and the TP peers' row counts together."""
        ranks, local, tp = self.expert_parallel_size, self.local_experts, group_size(self.group)
        received = all_to_all(counts, [local] * ranks, [local] * ranks, self.expert_group).view(ranks, local)
        peers = received.new_empty((tp * ranks, local))  # every TP rank's received counts, (TP, P, E_l) below
        all_gather_single(peers, received.contiguous(), group=self.group)
        peers = peers.view(tp, ranks, local)
        host = torch.cat([counts, peers.reshape(-1)]).tolist()  # the block's one read
        sent_host, peers_host = host[:ranks * local], host[ranks * local:]
        per_rank = [sum(sent_host[q * local:(q + 1) * local]) for q in range(ranks)]
        received_by = [peers_host[r * ranks * local:(r + 1) * ranks * local] for r in range(tp)]
        mine = received_by[group_rank(self.group)]
        from_rank = [sum(mine[q * local:(q + 1) * local]) for q in range(ranks)]
        arrived = all_to_all(rows, from_rank, per_rank, self.expert_group)  # (m_r, h): by source, then expert
        sizes = [sum(part) for part in received_by]  # m_r of every TP rank
        gathered = gather_rows_from_tensor_parallel_region(arrived, sizes, self.group)  # (M, h): TP rank, source, expert
        expert_of_row = torch.arange(local, device=rows.device).repeat(tp * ranks).repeat_interleave(
            peers.reshape(-1), output_size=gathered.shape[0])
        by_expert = torch.argsort(expert_of_row, stable=True)  # TP rank, then source, within each expert
        local_counts = peers.sum(dim=(0, 1))  # (E_l,) on the device, for the grouped GEMM
        if not self.experts.runs_grouped(gathered):
            local_counts = [sum(received_by[r][q * local + j] for r in range(tp) for q in range(ranks))
                            for j in range(local)]
        computed = self.experts(gathered[by_expert], local_counts)[torch.argsort(by_expert)]  # (M, h), partial
        back = reduce_scatter_rows_to_tensor_parallel_region(computed, sizes, self.group)  # (m_r, h), whole
        return all_to_all(back, per_rank, from_rank, self.expert_group)  # (n, h)

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (n, h) sorted by global expert, counts (E,) -> the experts' outputs (n, h) in the same order, each
        row computed by the EP rank that owns its expert (steps 4 to 7)."""
        ranks, local = self.expert_parallel_size, self.local_experts
        if ranks == 1:
            return self.experts(rows, counts)  # on the device: the grouped GEMM reads nothing
        received = all_to_all(counts, [local] * ranks, [local] * ranks, self.expert_group).view(ranks, local)
        # The block's one read: the all-to-all's split sizes, per rank and expert (the loop's sizes come with them).
        sent_host, received_host = torch.stack([counts.view(ranks, local), received]).tolist()
        send_splits, receive_splits = [sum(c) for c in sent_host], [sum(c) for c in received_host]
        arrived = all_to_all(rows, receive_splits, send_splits, self.expert_group)  # (m, h): by source, then expert
        expert_of_row = torch.arange(local, device=rows.device).repeat(ranks).repeat_interleave(
            received.reshape(-1), output_size=arrived.shape[0])
        by_expert = torch.argsort(expert_of_row, stable=True)  # sources in rank order within each expert
        local_counts = received.sum(dim=0)  # (E_l,) on the device, for the grouped GEMM
        if not self.experts.runs_grouped(arrived):
            local_counts = [sum(column) for column in zip(*received_host, strict=True)]
        computed = self.experts(arrived[by_expert], local_counts)
        back = computed[torch.argsort(by_expert)]  # (m, h) by source again
        return all_to_all(back, send_splits, receive_splits, self.expert_group)  # (n, h)

    def extra_repr(self) -> str:
        capacity = "dropless" if self.moe.capacity_factor is None else f"capacity factor {self.moe.capacity_factor}"
        return (f"EP {self.expert_parallel_size} ({self.local_experts} local experts), {capacity}, "
                f"sequence_parallel={self.sequence_parallel}")


# ------------------------------------------------------------------------------------- the block in the pipeline


class _AttachLoss(torch.autograd.Function):
    """``out`` unchanged forward; backward, the gradient of ``scale * loss`` joins the graph where ``out``'s does.

    The auxiliary losses of a block on any pipeline stage thus reach its router without a second tensor between the
    stages, and without the last stage's loss knowing them: their gradient is what the objective
    loss + scale * aux would have given."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach_loss(out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    if scale == 0.0 or not loss.requires_grad:
        return out
    return _AttachLoss.apply(out, loss, scale)


@dataclass
class StepStats:
    """What a sparse layer's forwards of one training step counted (detached, on the layer's device)."""

    forwards: int
    aux_loss: torch.Tensor
    """() fp32: the sum over the forwards of the unscaled aux loss."""
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    """(E,) int64: summed over the forwards (this EP rank's tokens)."""
    dropped: torch.Tensor
    sequence_aux_loss: torch.Tensor
    """() fp32: the sum over the forwards of the unscaled sequence-wise balance loss (0 unless its coefficient > 0)."""


class MoEMLP(nn.Module):
    """The MLP of a sparse layer in the pipeline: MoEBlock, its auxiliary losses attached in autograd, and its
    statistics of the step.

    The objective of a micro-batch is its loss plus, for each sparse layer, aux_loss_coeff x aux + router_z_loss_coeff
    x z + sequence_aux_loss_coeff x the sequence-wise loss. DeepSpeed's backward multiplies the loss by
    S / micro-batches (S: fp16's dynamic loss scale, 1 in bf16 and fp32) and the optimizer divides every gradient by
    S, so the attached losses are scaled by ``loss_scale`` / ``micro_batches`` too, and by 1 / TP
    (MoEStats.loss_scale): without S an fp16 run would balance its experts with 1/S of the asked-for weight
    (Megatron-LM's MoEAuxLossAutoScaler.set_loss_scale). The engine sets both before each forward
    (training/engine.py): the batch ramp changes the micro-batches, an fp16 overflow the scale."""

    def __init__(self, block: MoEBlock) -> None:
        super().__init__()
        self.block = block
        self.micro_batches = 1
        self.loss_scale = 1.0
        self._stats: StepStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, stats = self.block(x)
        moe, scale = self.block.moe, stats.loss_scale * self.loss_scale / self.micro_batches
        loss = (moe.aux_loss_coeff * stats.aux_loss + moe.router_z_loss_coeff * stats.z_loss
                + moe.sequence_aux_loss_coeff * stats.sequence_aux_loss)
        if self.training and torch.is_grad_enabled():
            out = attach_loss(out, loss, scale)
            if not recomputing():
                self._count(stats)
        return out

    def _count(self, stats: MoEStats) -> None:
        aux, z, sequence = stats.aux_loss.detach(), stats.z_loss.detach(), stats.sequence_aux_loss.detach()
        if self._stats is None:
            self._stats = StepStats(1, aux, z, stats.tokens_per_expert, stats.dropped, sequence)
            return
        previous = self._stats
        self._stats = StepStats(previous.forwards + 1, previous.aux_loss + aux, previous.z_loss + z,
                                previous.tokens_per_expert + stats.tokens_per_expert, previous.dropped + stats.dropped,
                                previous.sequence_aux_loss + sequence)

    def take_stats(self) -> StepStats | None:
        """The step's statistics (None: no training forward ran), and a fresh count for the next step."""
        stats, self._stats = self._stats, None
        return stats


def sparse_layers(module: nn.Module) -> list[tuple[int, MoEMLP]]:
    """(layer_number, MoEMLP) of every sparse layer in ``module`` (a stage or the whole model), in layer order."""
    found = [(getattr(owner, "layer_number", 0), child) for owner in module.modules()
             for child in owner.children() if isinstance(child, MoEMLP)]
    return sorted(found, key=lambda pair: pair[0])


def set_gradient_scale(layers: list[tuple[int, MoEMLP]], micro_batches: int, loss_scale: float) -> None:
    """What DeepSpeed's backward does to the loss of the coming micro-batch: x loss_scale / micro_batches."""
    for _, layer in layers:
        layer.micro_batches, layer.loss_scale = micro_batches, loss_scale


def keep_router_biases_fp32(layers: list[tuple[int, MoEMLP]]) -> None:
    """The aux-loss-free routers' bias stays fp32 after the engine casts the model to bf16: it moves by
    bias_update_rate (1e-3) a step, below a bf16 ulp once it has grown (model.moe.router "sigmoid_bias")."""
    for _, layer in layers:
        router = layer.block.router
        if hasattr(router, "expert_bias"):
            router.expert_bias = router.expert_bias.float()
