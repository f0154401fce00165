"""train.py end to end, launched as users launch it: 4 CPU processes, TP 2 x PP 2, the launcher's environment
(tests/launch.py).

One straight run of 12 steps (the ramp changes the number of micro-batches mid-run; the loss falls), and one run
stopped after 6 steps and resumed to 12: the per-step losses, learning rates and batch sizes are identical (bitwise,
fp32 on CPU), and so are the final weights. The same again with sequence parallelism and selective recomputation,
whose losses are also those of the plain run to fp32 rounding; those two runs also measure the stability monitors
every 3 steps (training/stability.py), which must change no bit of the training and resume with it. Faults (SIGTERM,
SIGKILL, crashes) are in tests/test_faults.py.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.launch import STEPS, final_weights, run_training, same_weights, trajectory
from training.metrics_log import read_metrics

RAMP = [4, 4, 4, 4, 8, 8, 12, 12, 16, 16, 16, 16]  # 3 increments over 1536 tokens: one per 512 tokens of 32-token samples


@pytest.mark.distributed
def test_ramp_changes_micro_batches_and_loss_falls(straight_run):
    steps = trajectory(straight_run)
    assert [s[0] for s in steps] == list(range(1, STEPS + 1))
    assert [s[3] for s in steps] == RAMP
    assert [s[4] for s in steps] == [batch // 2 for batch in RAMP]  # the engine followed: micro-batch 2, DP 1
    losses = [s[1] for s in steps]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5
    lrs = [s[2] for s in steps]
    # step 6 ends at 1024 tokens, the end of warmup: it trains at the peak; the first step at 128/1024 of it
    assert lrs[0] == pytest.approx(3e-3 * 128 / 1024) and lrs[5] == pytest.approx(3e-3) and lrs[-1] < lrs[5]
    # the log's progress, against schedule.train_tokens (1e6 in tests/launch.py): the share done, the rate in total
    # and per GPU (4 processes), and the ETA: the ramp's future batches, each step at (its micro-batches + PP - 1)
    # times the seconds of one such slot in this step (log_interval 1: the window is the step)
    from runconfig.schedules import BatchRamp, future_batches

    ramp = BatchRamp(start=4, increment=4, end=16, ramp_tokens=1536)
    for record in read_metrics(straight_run / "metrics.jsonl"):
        assert record["fraction_done"] == record["consumed_tokens"] / 1e6
        assert record["tokens_per_second_per_gpu"] == pytest.approx(record["tokens_per_second"] / 4, rel=1e-12)
        seconds = record["global_batch"] * 32 / record["tokens_per_second"]
        per_slot = seconds / (record["micro_batches"] + 1)  # PP 2
        slots = sum(steps * (batch // 2 + 1) for batch, steps in future_batches(ramp, record["consumed_tokens"], 1e6, 32))
        assert record["eta_seconds"] == pytest.approx(per_slot * slots, rel=1e-9)


@pytest.mark.distributed
def test_the_chosen_ranks_trace_the_chosen_steps_with_the_pipeline_instructions(straight_run):
    """training.profile {"steps": [5, 6], "ranks": [0, 3]} (tests/conftest.py): one trace per chosen rank, in the
    profiler's Chrome/TensorBoard format, whose ranges are the instructions each stage ran (the first stage loads
    micro-batches and sends activations, the last receives them and computes the loss), once per micro-batch of the
    two steps (steps 5 and 6 of RAMP: 8 sequences, 4 micro-batches each). Nothing else moved: the fault and resume
    tests compare their runs with this one, bitwise."""
    from tests.conftest import PROFILE

    traces = sorted((straight_run / "profile").glob("*.pt.trace.json"))
    assert [path.name.split(".")[0] for path in traces] == [f"rank{rank}" for rank in PROFILE["ranks"]]
    output = (straight_run.parent / "output.txt").read_text()
    assert f"[profile] rank 0: steps 5-6 traced in {straight_run / 'profile'}" in output
    counts = []
    for path in traces:
        events = json.loads(path.read_text())["traceEvents"]
        names = [event.get("name") for event in events if event.get("ph") == "X"]
        counts.append({name: names.count(name) for name in ("LoadMicroBatch", "ForwardPass", "BackwardPass",
                                                            "SendActivation", "RecvActivation", "ReduceGrads",
                                                            "OptimizerStep")})
    micro_batches = (RAMP[4] + RAMP[5]) // 2
    assert counts[0] == {"LoadMicroBatch": micro_batches, "ForwardPass": micro_batches, "BackwardPass": micro_batches,
                         "SendActivation": micro_batches, "RecvActivation": 0, "ReduceGrads": 2, "OptimizerStep": 2}
    assert counts[1] == {"LoadMicroBatch": micro_batches, "ForwardPass": micro_batches, "BackwardPass": micro_batches,
                         "SendActivation": 0, "RecvActivation": micro_batches, "ReduceGrads": 2, "OptimizerStep": 2}


@pytest.mark.distributed
def test_stop_and_resume_is_exact(corpus, straight_run, tmp_path):
    """The resumed half runs with training.loss_normalization "tokens" (training/loss_normalization.py): with every
    position a target each micro-batch's divisor, the step's count over micro-batches x DP, is its own count, so the
    bits are the default's; that it differs where masks are uneven is tests/test_loss_normalization.py's."""
    save = tmp_path / "checkpoints"
    run_training(corpus, save, max_steps=6)
    assert (save / "latest").read_text() == "global_step6"
    result = run_training(corpus, save, extra=["training.loss_normalization=\"tokens\""])
    assert "resumed from" in result.stdout and "at step 6" in result.stdout
    assert trajectory(save) == trajectory(straight_run)
    assert same_weights(final_weights(save), final_weights(straight_run))


def assert_log_z_at_initialisation(record: dict) -> None:
    """Step 1 runs the initial weights: logits ~ N(0, sigma^2) with sigma ~ 0.6 (final-norm output of RMS 1 times the
    tied embedding's std), so log Z = logsumexp over the V = 50,257 GPT-2 logits ~ ln V + sigma^2 / 2 = 10.83 + 0.2,
    the step's loss about the same (target logits average ~0). A log Z reduced over one TP shard only would read
    ln(V / 2) = 10.1: outside the 0.3 band, as is a log Z in base 2 (15.6)."""
    assert abs(record["log_z_mean"] - (math.log(50257) + 0.2)) < 0.3, record
    assert abs(record["log_z_mean"] - record["loss"]) < 0.3, record


SEQUENCE_PARALLEL_SELECTIVE = ["parallelism.sequence_parallel=true", "model.recompute=selective",
                               "training.stability_interval=3"]
MONITORS = ("max_attention_logit", "attention_logit_per_layer", "update_rms_ratio")


@pytest.mark.distributed
def test_sequence_parallel_with_selective_recompute_resumes_exactly(corpus, straight_run, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_training(corpus, straight, extra=SEQUENCE_PARALLEL_SELECTIVE)
    run_training(corpus, stopped, max_steps=6, extra=SEQUENCE_PARALLEL_SELECTIVE)
    result = run_training(corpus, stopped, extra=SEQUENCE_PARALLEL_SELECTIVE)
    assert "at step 6" in result.stdout and "TP 1/2 PP 1/2 DP 0/1, sequence parallel" in result.stdout
    assert trajectory(stopped) == trajectory(straight)  # bitwise: losses, learning rates, batches, tokens
    assert same_weights(final_weights(stopped), final_weights(straight))
    # The monitors: on steps 3, 6, 9, 12 only; the same numbers after the resume; sane values.
    records = {r["step"]: r for r in read_metrics(straight / "metrics.jsonl")}
    resumed = {r["step"]: r for r in read_metrics(stopped / "metrics.jsonl")}
    assert [step for step, r in records.items() if "max_attention_logit" in r] == [3, 6, 9, 12]
    for step in (9, 12):
        assert {k: resumed[step][k] for k in MONITORS} == {k: records[step][k] for k in MONITORS}
    assert_log_z_at_initialisation(records[1])
    for step, r in records.items():
        # log Z from every step; the tokens' contexts differ, so their log Z do: the minimum is below the mean
        assert r["log_z_min"] < r["log_z_mean"] and r["spikes"] == 0
        if step % 3 == 0:
            assert len(r["attention_logit_per_layer"]) == 2 and r["max_attention_logit"] == max(
                r["attention_logit_per_layer"]) > 0
            # Adam's first steps move each weight by about lr: about lr / (init std 0.072) of the matrices' RMS
            assert 0 < r["update_rms_ratio"]["matrices"] < 0.2 and 0 < r["update_rms_ratio"]["vectors"] < 0.2
    # The plain run's numbers: the same schedule, and losses that differ only by fp32 reduction order (the sums over
    # the TP ranks are reduce-scatters instead of all-reduces). Measured: none, the 12 losses are bitwise equal here.
    plain = trajectory(straight_run)
    assert [s[:1] + s[2:] for s in trajectory(straight)] == [s[:1] + s[2:] for s in plain]
    for ours, theirs in zip(trajectory(straight), plain, strict=True):
        assert abs(ours[1] - theirs[1]) <= 1e-5 * abs(theirs[1]), (ours, theirs)


@pytest.mark.distributed
def test_fine_tuning_starts_the_schedules_afresh_on_the_pretrained_weights(corpus, straight_run, tmp_path):
    """training.init_from the 12-step run with training.fine_tune: the learning rate (warmup included), the batch
    ramp and the data start at 0 tokens again, with the 12-step weights (a lower loss on the same first batch)."""
    save = tmp_path / "sft" / "checkpoints"
    result = run_training(corpus, save, max_steps=3,
                          extra=[f"training.init_from={straight_run}", "training.fine_tune=true",
                                 "data.packing=\"concat\""])  # the pretraining samples (fine-tuning packs "bfd")
    assert f"fine-tuning from the weights of {straight_run}" in result.stdout + result.stderr
    assert ("data: packing concat, each sample one stream (no document masks, positions 0 .. s-1); loss over the "
            "step's target tokens (training.loss_normalization \"tokens\", the default of training.fine_tune)"
            in result.stdout)  # the start-up line
    ours, pretraining = read_metrics(save / "metrics.jsonl"), read_metrics(straight_run / "metrics.jsonl")
    for key in ("step", "lr", "global_batch", "consumed_samples", "consumed_tokens"):
        assert [r[key] for r in ours] == [r[key] for r in pretraining[:3]], key
    assert ours[0]["loss"] < pretraining[0]["loss"] - 0.3  # the same batch, the trained weights
