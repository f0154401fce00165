"""training.compile (training/compile.py): the blocks compiled by inductor on CPU give the eager numbers within fp32
rounding, dropout and full recomputation included; a train.py run at PP 2 logs its compile time once and follows the
eager run's losses and gradient norms.

Both compile the same block (the tiny preset at h 64, micro-batch 2 x 32 tokens, dropout 0.1 in the block and its
attention, full recompute), so that the training run's two ranks find inductor's kernels in its on-disk cache, made
by the first test: the cold compile (tens of seconds on 2 cores) is paid once.

Why a tolerance and not bitwise: inductor fuses each block's elementwise chains and reduces the norms in its own
order, so a value differs from eager by a few fp32 ulps (2^-23 = 1.2e-7 relative). Measured: the 2-block model's
loss equal to eager's, each parameter's gradient within 8e-7 of its largest element (the bound: 64 ulps, 7.6e-6);
the training run's losses within 1 ulp (8.7e-8 relative at step 1, equal after) and its gradient norms equal (the
bounds: 8 and 64 ulps). The dropout masks are eager's own (``fallback_random``), bit for bit: with inductor's own
random numbers a block's output differs by about 0.8, which these bounds would catch.
"""

from __future__ import annotations

import re

import pytest
import torch

from model.config import preset
from model.gpt import GPT
from tests.launch import run_training
from training.compile import CompileClock, compile_blocks
from training.metrics_log import read_metrics

BLOCK = {"num_layers": 2, "seq_length": 32, "hidden_dropout": 0.1, "attention_dropout": 0.1, "recompute": "full"}
RUN = ["model.num_layers=2", "model.seq_length=32", "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
       "model.recompute=\"full\"", "training.save_interval=0"]  # BLOCK, as train.py's overrides
STEPS = 3
FP32_ULP = 2.0**-23


def _loss_and_gradients(model: GPT, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(7)  # the same dropout masks in both models: the default stream, and each model's own TP stream
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss = model.loss(inputs, torch.arange(inputs.shape[1]).expand_as(inputs), labels, torch.ones(labels.shape))
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_compiled_blocks_give_the_eager_loss_and_gradients_with_dropout_and_full_recompute():
    config = preset("tiny", **BLOCK)
    eager, compiled = GPT(config), GPT(config)
    assert compile_blocks(compiled) == 2
    tokens = torch.randint(0, 50257, (2, 33), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second call runs the cached kernels
        expected, expected_grads = _loss_and_gradients(eager, tokens)
        loss, grads = _loss_and_gradients(compiled, tokens)
        assert loss.item() == pytest.approx(expected.item(), rel=8 * FP32_ULP, abs=0)
        for name, grad in grads.items():
            scale = expected_grads[name].abs().max().item()
            assert (grad - expected_grads[name]).abs().max().item() <= 64 * FP32_ULP * scale, name
        eager.zero_grad()
        compiled.zero_grad()


def test_the_clock_logs_once_after_the_second_step(monkeypatch):
    """The first step (2 micro-batches) took 10 s, the second (4) 1 s: the compilation took about 10 - 2 x 1 / 4 s."""
    clock_times = iter([0.0, 10.0, 10.0, 11.0, 11.0, 12.0])
    monkeypatch.setattr("training.compile.time.perf_counter", lambda: next(clock_times))
    said = []
    clock = CompileClock(3, said.append)
    for micro_batches in (2, 4, 4):
        clock.start()
        clock.stop(micro_batches)
    assert said == ["[compile] 3 block(s) of this stage compiled with torch.compile (training.compile) in about 9.5 s: "
                    "the first step took 10.0 s, the second 1.00 s"]
    quiet = CompileClock(0, said.append)  # a stage without compiled blocks
    for _ in range(2):
        quiet.start()
        quiet.stop(2)
    assert len(said) == 1


@pytest.mark.distributed
def test_a_compiled_run_follows_the_eager_run_at_pp2(corpus, tmp_path):
    """2 processes, PP 2 (one block per stage), 3 steps of the ramp: the eager run's losses and gradient norms within
    fp32 rounding, through Adam's updates, the pipeline's sends and the tied embedding's all-reduce."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["training.compile=true"])):
        save = tmp_path / name / "checkpoints"
        result = run_training(corpus, save, max_steps=STEPS, processes=2, extra=[*RUN, *extra])
        runs[name] = (read_metrics(save / "metrics.jsonl"), result.stdout)
    (eager, eager_out), (compiled, out) = runs["eager"], runs["compiled"]
    assert [r["step"] for r in compiled] == [1, 2, 3]
    for a, b in zip(eager, compiled, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=8 * FP32_ULP, abs=0), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=64 * FP32_ULP, abs=0), (a["step"], a["grad_norm"],
                                                                                          b["grad_norm"])
    lines = re.findall(r"\[compile\] .*", out)
    assert len(lines) == 1 and lines[0].startswith("[compile] 1 block(s) of this stage compiled"), lines
    assert "[compile]" not in eager_out
