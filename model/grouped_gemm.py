"""torch's grouped GEMM for the experts of model/moe.py: one kernel for all of a rank's experts, their rows jagged
by group ends, where the alternative is one matmul pair per expert (Experts' loop).

    kernel                               where it runs                          counts it needs
    grouped GEMM (torch.nn.functional    CUDA, bf16 (SM 80 and newer);          the groups' ends on the device
    .grouped_mm), ``grouped_swiglu``     CPU in fp32 and bf16 (slower there     (int32, a cumsum): nothing read on
                                         than the loop)                         the host
    one matmul pair per expert           anywhere (model/moe.py Experts)        the counts on the host (one read)

On CUDA every group must be a multiple of 16 bytes along the rows (8 bf16 rows, ``grouped_alignment``): the weight
gradient contracts over a group's rows, and torchtitan pads the groups for it. ``pad_groups`` moves each group to a
multiple of that alignment, zero rows after its own, in a buffer whose size is known on the host (a bound, so that
nothing is read); the outputs are taken back from the rows' slots. Padding changes no real row's value: a zero row
adds nothing to a weight gradient and its output is never read. On CPU the kernel takes any counts, so nothing is
padded unless asked for (tests/test_moe_grouped_gemm.py compares the padded and unpadded paths).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def use_grouped_gemm(rows: torch.Tensor) -> bool:
    """torch's grouped GEMM where it has kernels for it: CUDA, bf16 (SM 80 and newer)."""
    return rows.is_cuda and rows.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


GROUPED_GEMM_ALIGNMENT_BYTES = 16
"""torch's grouped GEMM on CUDA wants every group of rows a multiple of 16 bytes long along the rows (8 bf16 rows:
the weight gradient contracts over them), as torchtitan pads them; its CPU kernel takes any counts."""


def grouped_alignment(rows: torch.Tensor) -> int:
    """Rows per group the grouped GEMM needs on the rows' device: 16 bytes' worth on CUDA, 1 elsewhere."""
    return GROUPED_GEMM_ALIGNMENT_BYTES // rows.element_size() if rows.is_cuda else 1


def grouped_swiglu(rows: torch.Tensor, counts: torch.Tensor | list[int], gate_up: torch.Tensor, down: torch.Tensor,
                   alignment: int | None = None) -> torch.Tensor:
    """The experts' SwiGLU over their contiguous rows in two grouped matmuls: rows (m, h) in expert order, counts[j]
    of expert j (E_l,) on the rows' device (a host list is copied there), gate_up [E_l, 2 F/R, h], down
    [E_l, h, F/R] -> (m, h). With ``alignment`` a > 1 rows (None: grouped_alignment) each group is padded with zero
    rows to a multiple of a first (``pad_groups``); nothing is read on the host either way."""
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(counts, dtype=torch.int64, device=rows.device)
    alignment = alignment or grouped_alignment(rows)
    if alignment == 1:
        return _grouped_swiglu(rows, counts.cumsum(0, dtype=torch.int32), gate_up, down)
    padded, ends, slots = pad_groups(rows, counts, alignment)
    return _grouped_swiglu(padded, ends, gate_up, down).index_select(0, slots)  # (m, h): each row from its slot


def _grouped_swiglu(rows: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.grouped_mm(rows, gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)  # each (rows, F/R)
    return F.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)


def pad_groups(rows: torch.Tensor, counts: torch.Tensor, alignment: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """rows (m, h) in groups of ``counts`` (E_l,) -> (padded (M, h), ends (E_l,) int32, slots (m,)): every group
    starts at a multiple of ``alignment`` with zero rows after its own, and row i sits at padded[slots[i]].

    M = alignment x ceil((m + E_l (alignment - 1)) / alignment) bounds every padding of m rows and is known on the
    host (the data's own total would have to be read); the last group ends at M, so that every row of the buffer is
    in a group (the kernel leaves rows outside the groups unwritten) and every group's length is a multiple of
    ``alignment``. An expert without rows is an empty group; with m = 0 the buffer is the last group's zero rows."""
    m, groups = rows.shape[0], counts.shape[0]
    size = -(-(m + groups * (alignment - 1)) // alignment) * alignment
    padded_counts = (counts + alignment - 1) // alignment * alignment  # (E_l,)
    moved = (padded_counts.cumsum(0) - padded_counts) - (counts.cumsum(0) - counts)  # how far each group moves
    group_of_row = torch.repeat_interleave(torch.arange(groups, device=rows.device), counts, output_size=m)
    slots = torch.arange(m, device=rows.device) + moved[group_of_row]  # (m,)
    ends = padded_counts.cumsum(0, dtype=torch.int32)
    ends[-1] = size
    return rows.new_zeros(size, rows.shape[1]).index_copy(0, slots, rows), ends, slots
