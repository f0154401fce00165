"""The attention-logit probe (model/attention.py largest_logit) holds about 256 MiB at any sequence length.

It forms the scores the fused kernel never forms, a chunk at a time: whole heads while they fit, else query rows of
one head. Measured in a fresh process (this file run as a script): the rise of its resident memory during one call,
VmHWM after against VmRSS before, with glibc's mmap threshold at 1 MiB so that every tensor of more than 1 MiB is a
mapping of its own, resident once written and returned when freed (benchmarks/bench_head_memory.py's method).

    S = 16384, b 1, 2 query heads on 1 key/value head, d 64, bf16    peak
    before (one head's (S, S) scores, their quotient, the (S, S)     3,334 MiB
      causal mask)
    after (3,215 query rows at a time)                               259 MiB

The chunked maximum is bitwise the unchunked one (``test_row_chunks_give_the_maximum_of_the_whole_scores``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BUDGET_MIB = 256
SLACK_MIB = 16  # q and k's fp32 copies of a chunk, the query positions, the allocator's own


def _resident(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(length: int, heads: int, key_heads: int, dim: int) -> dict:
    """In this process: the peak rise of resident memory over one largest_logit call on random bf16 q and k."""
    from model.attention import largest_logit

    generator = torch.Generator().manual_seed(0)
    largest_logit(torch.randn(1, 1, 64, 8, generator=generator), torch.randn(1, 1, 64, 8, generator=generator))
    q = torch.randn(1, heads, length, dim, generator=generator).to(torch.bfloat16)
    k = torch.randn(1, key_heads, length, dim, generator=generator).to(torch.bfloat16)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from the current RSS
    before = _resident("VmRSS")
    value = largest_logit(q, k)
    return {"peak_mib": (_resident("VmHWM") - before) / 2**20, "value": float(value)}


def test_the_probe_holds_about_256_mib_at_sequence_16384():
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    command = [sys.executable, __file__, "16384", "1", "1", "16"]
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"\nlargest_logit at S = 16384 (one head, d 16, bf16): peak {found['peak_mib']:.0f} MiB, "
          f"logit {found['value']:.4f}")
    assert found["peak_mib"] <= BUDGET_MIB + SLACK_MIB  # one head's (S, S) fp32 scores alone would be 1,024 MiB
    assert found["peak_mib"] > BUDGET_MIB / 2  # the chunks use the budget: the measurement sees them
    assert 3.0 < found["value"] < 8.0  # the largest of 134M scores of unit-variance q.k / 4: a tail value


def test_row_chunks_give_the_maximum_of_the_whole_scores():
    """A budget small enough to cut one head into 64-row chunks (PROBE_MIN_ROWS): the same maximum, bitwise, with
    grouped heads and with packed documents."""
    from model.attention import PROBE_MIN_ROWS, largest_logit

    generator = torch.Generator().manual_seed(3)
    length, dim = 300, 8
    q, k = torch.randn(2, 4, length, dim, generator=generator), torch.randn(2, 2, length, dim, generator=generator)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(dim)  # (b, nh, s, s)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    segment_ids = (torch.arange(length) >= 120).long().expand(2, length).clone()
    segment_ids[1] = (torch.arange(length) >= 250).long()
    same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None] & causal
    for documents, allowed in ((None, causal), (segment_ids, same)):
        whole = scores.masked_fill(~allowed, float("-inf")).max()
        assert largest_logit(q, k, documents) == whole  # the default budget: all 4 heads at once
        assert largest_logit(q, k, documents, max_scores=1) == whole  # one head, 64 rows at a time
        assert largest_logit(q, k, documents, max_scores=length * 4 * 100) == whole  # 5 rows by the budget: 64
    assert PROBE_MIN_ROWS == 64 and length % PROBE_MIN_ROWS != 0  # the last chunk is a short one


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(measure(*(int(arg) for arg in sys.argv[1:5]))))
