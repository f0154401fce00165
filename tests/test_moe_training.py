"""A Mixture-of-Experts model trains through train.py and the deepspeed launcher: ds_configs/llama-tiny-cpu.json with
``model.moe`` (4 experts, top 2, a shared expert, the first block dense, DeepSeek-V3's aux-loss-free router with its
bias) at TP 2 x PP 2 on 4 CPU processes, EP 1.
Of the 2 blocks (tests/launch.py's overrides) the first stage holds the dense one only: it takes part in the step,
the log's collective and the checkpoints without a sparse layer.

The log carries the routers' aux loss, z-loss and load imbalance at every logged step; the loss falls; a stop at step
4 resumed to step 8 is bitwise the uninterrupted run (losses, learning rates, batches, every expert's weights, the
routers' bias, which moved by the step's counts and is the same on both TP ranks); resumed at TP 1 x PP 2 x DP 2
through DeepSpeed's universal checkpoint (the experts merged and cut on their own dimensions) it continues the run to
1e-5 (fp32, another summation order). That the split
model computes what the unsplit one does, aux losses included, is tests/test_model_parallel.py's (the MoE layouts of
its 3D run); the block against transformers' and across EP, tests/test_moe.py's.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.launch import final_weights, run_training, same_weights, trajectory
from training.metrics_log import read_metrics

CONFIG = "ds_configs/llama-tiny-cpu.json"
MOE = {"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 64, "shared_expert_ffn_hidden_size": 64,
       "first_dense_layers": 1, "aux_loss_coeff": 0.01, "router_z_loss_coeff": 0.001, "router": "sigmoid_bias",
       "bias_update_rate": 0.01}
EXTRA = ["training.save_interval=4", f"model.moe={json.dumps(MOE, separators=(',', ':'))}"]


def resumable_copy(save, destination):
    """The run's checkpoints to step 4 in ``destination``, ``latest`` naming global_step4."""
    copy = destination / "checkpoints"
    shutil.copytree(save, copy, ignore=shutil.ignore_patterns("tensorboard", "metrics.jsonl", "global_step8"))
    (copy / "latest").write_text("global_step4")
    return copy


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("moe") / "checkpoints"
    result = run_training(corpus, save, max_steps=8, extra=EXTRA, ds_config=CONFIG)
    return save, result.stdout + result.stderr


@pytest.mark.distributed
def test_moe_trains_logs_its_routers_and_resumes_exactly(corpus, straight, tmp_path):
    save, output = straight
    steps = trajectory(save)
    assert [step for step, *_ in steps] == list(range(1, 9))
    assert steps[-1][1] < steps[0][1] - 0.5  # the loss falls (about 10.9 at the start: ln 50257)
    records = read_metrics(save / "metrics.jsonl")
    load = f"MoE aux {records[-1]['moe_aux_loss']:.3f} | expert load max/mean {records[-1]['moe_load_imbalance']:.2f}"
    assert "[train] step 8 |" in output and load in output  # the console's line, as the README shows it
    for record in records:
        assert 0.0 < record["moe_aux_loss"] <= MOE["num_experts"]  # E sum_e f_e P_e <= E max_e P_e; 1 when even
        assert record["moe_z_loss"] > 0.0 and record["moe_dropped_fraction"] == 0.0  # dropless
        assert record["moe_load_imbalance"] >= 1.0
        assert list(record["moe_imbalance_per_layer"]) == ["2"]  # of 2 blocks (tests/launch.py), the first dense
        assert record["moe_load_imbalance"] == max(record["moe_imbalance_per_layer"].values())

    resumed = resumable_copy(save, tmp_path / "resumed")
    run_training(corpus, resumed, max_steps=8, extra=EXTRA, ds_config=CONFIG)
    assert trajectory(resumed) == steps[4:]  # losses, learning rates, batches, tokens: bitwise
    ours, theirs = read_metrics(resumed / "metrics.jsonl"), records[4:]
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance"):
        assert [r[key] for r in ours] == [r[key] for r in theirs], key
    weights = final_weights(save)
    assert same_weights(final_weights(resumed), weights)
    biases = [shard[key] for shard in weights.values() for key in shard if key.endswith("router.expert_bias")]
    assert len(biases) == 2 and torch.equal(biases[0], biases[1])  # one sparse block, 2 TP ranks: moved alike
    steps_taken = biases[0] / MOE["bias_update_rate"]  # 8 steps of -1, 0 or +1 each: whole numbers in [-8, 8]
    assert biases[0].dtype == torch.float32 and biases[0].abs().max() > 0
    torch.testing.assert_close(steps_taken, steps_taken.round(), rtol=0, atol=1e-4)
    assert (steps_taken.abs() <= 8.0001).all()

    reshaped = resumable_copy(save, tmp_path / "reshaped")  # TP 2 x PP 2 x DP 1 -> TP 1 x PP 2 x DP 2
    result = run_training(corpus, reshaped, max_steps=8, extra=[*EXTRA, "parallelism.tensor_parallel_size=1"],
                          ds_config=CONFIG)
    assert "resumed global_step4 written at TP 2 x PP 2 x DP 1; now TP 1 x PP 2 x DP 2" in result.stdout + result.stderr
    again = read_metrics(reshaped / "metrics.jsonl")
    for key in ("lr", "global_batch", "consumed_samples"):
        assert [r[key] for r in again] == [r[key] for r in theirs], key
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        torch.testing.assert_close([r[key] for r in again], [r[key] for r in theirs], rtol=1e-5, atol=0, msg=key)
