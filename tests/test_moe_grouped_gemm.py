"""The experts' grouped GEMM with its groups padded (model/grouped_gemm.py), forced on CPU: what CUDA runs.

On CUDA every group must be 16 bytes long along the rows (8 bf16 rows, 4 fp32 ones); the CPU kernel takes any
counts, so the padded path is run here by asking for the alignment. Against the unpadded grouped GEMM and the
per-expert loop, forward and backward (outputs, the rows' gradient, both weights' gradients), for every expert
empty (an EP rank that receives no row), a single row, all rows to one expert, and counts that are no multiple of
the alignment: the same values (``BOUND``), the same zero gradient for an expert without rows.
"""

from __future__ import annotations

import pytest
import torch

from model.config import MoEConfig
from model.grouped_gemm import grouped_swiglu, pad_groups
from model.moe import Experts
from model.parallel import ParallelContext

HIDDEN, FFN, LOCAL_EXPERTS = 32, 16, 4
BOUND = {torch.float32: 1e-6, torch.bfloat16: 2.0**-8}
"""Padded against unpadded, relative to the largest value: a padded group is a matrix product of another row count,
which the CPU's BLAS blocks (or, under 4 rows, sums) in another order. Measured here: fp32 up to 3.9e-7 (an ulp or
two), bf16 0 (bitwise); the bf16 bound is one bf16 ulp, for CPUs whose bf16 kernels block otherwise."""
COUNTS = {"every expert empty": [0, 0, 0, 0], "a single row": [0, 1, 0, 0], "all rows to one expert": [0, 0, 11, 0],
          "unaligned": [5, 0, 9, 3], "aligned": [8, 0, 16, 4]}


def _experts(dtype: torch.dtype) -> Experts:
    moe = MoEConfig(num_experts=LOCAL_EXPERTS, top_k=2, moe_ffn_hidden_size=FFN)
    return Experts(moe, HIDDEN, ParallelContext(), first=0, count=LOCAL_EXPERTS, init_std=0.1, output_init_std=0.05,
                   seed=3, layer_number=1).to(dtype)


def _run(experts: Experts, rows: torch.Tensor, counts: list[int], kernel: str, alignment: int | None):
    """Output and gradients of one forward and backward, with the counts on the device as the block passes them."""
    experts.zero_grad(set_to_none=False)
    experts.kernel, experts.alignment = kernel, alignment
    x = rows.clone().requires_grad_()
    out = experts(x, torch.tensor(counts, dtype=torch.int64, device=x.device))
    (out.float() * torch.linspace(-1, 1, out.numel(), device=x.device).view_as(out)).sum().backward()
    return [out.detach(), x.grad, experts.gate_up.grad.clone(), experts.down.grad.clone()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(COUNTS))
def test_padded_groups_give_the_unpadded_results(case, dtype):
    counts = COUNTS[case]
    experts = _experts(dtype)
    rows = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype)
    alignment = 16 // rows.element_size()  # what CUDA needs: 4 fp32 rows, 8 bf16 ones
    unpadded = _run(experts, rows, counts, "grouped", 1)
    loop = _run(experts, rows, counts, "loop", None)
    padded = _run(experts, rows, counts, "grouped", alignment)
    worst = 0.0
    for name, a, b, c in zip(("out", "grad rows", "grad gate_up", "grad down"), padded, unpadded, loop, strict=True):
        assert torch.equal(b, c), name  # the unpadded grouped GEMM is the loop, bit for bit (tests/test_moe.py)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if b.numel():
            relative = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()
            assert relative <= BOUND[dtype], f"{name}: {relative:.3g}"
            worst = max(worst, relative)
    print(f"\n{case}, {dtype}: padded against unpadded, largest difference {worst:.3g} of the largest value")
    touched = [j for j, count in enumerate(counts) if count]
    grad_down = padded[3]
    assert grad_down.shape == (LOCAL_EXPERTS, HIDDEN, FFN)
    assert all(grad_down[j].abs().max() == 0 for j in range(LOCAL_EXPERTS) if j not in touched)  # no rows, zero
    if touched:
        assert all(grad_down[j].abs().max() > 0 for j in touched)


def test_pad_groups_moves_each_group_to_an_aligned_start():
    counts = torch.tensor([5, 0, 9, 3])
    rows = torch.arange(17.0).unsqueeze(1).expand(17, 2).contiguous() + 1  # row i holds i + 1
    padded, ends, slots = pad_groups(rows, counts, 8)
    assert padded.shape == (48, 2)  # 8 x ceil((17 + 4 x 7) / 8): the bound, known without reading the counts
    assert ends.dtype == torch.int32 and ends.tolist() == [8, 8, 24, 48]  # the last group ends at the buffer's end
    assert slots.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 25, 26]
    assert torch.equal(padded[slots], rows)
    assert padded.sum() == rows.sum()  # every other row is zero
    empty, empty_ends, empty_slots = pad_groups(rows[:0], torch.zeros(4, dtype=torch.int64), 8)
    assert empty.shape == (32, 2) and empty.abs().max() == 0 and empty_ends.tolist() == [0, 0, 0, 32]
    assert empty_slots.numel() == 0


def test_a_host_list_of_counts_is_copied_to_the_rows_device():
    """Callers with counts on the host (benchmarks) get the same results as with counts on the device."""
    experts = _experts(torch.float32)
    rows = torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(8))
    counts = [5, 0, 9, 3]
    on_device = grouped_swiglu(rows, torch.tensor(counts), experts.gate_up, experts.down, 4)
    assert torch.equal(grouped_swiglu(rows, counts, experts.gate_up, experts.down, 4), on_device)
