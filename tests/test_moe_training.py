"""A Mixture-of-Experts model trains through train.py (tests/launch.py): ds_configs/llama-tiny-cpu.json with
``model.moe`` (4 experts, top 2, a shared expert, the first block dense, DeepSeek-V3's aux-loss-free router with its
bias) at TP 2 x PP 2 on 4 CPU processes, EP 1.
Of the 2 blocks (tests/launch.py's overrides) the first stage holds the dense one only: it takes part in the step,
the log's collective and the checkpoints without a sparse layer.

The log carries the routers' aux loss, z-loss and load imbalance at every logged step; the loss falls; a stop at step
4 resumed to step 8 is bitwise the uninterrupted run (losses, learning rates, batches, every expert's weights, the
routers' bias, which moved by the step's counts and is the same on both TP ranks); resumed at TP 1 x PP 2 x DP 2
with EP 2 through DeepSpeed's universal checkpoint (the experts merged by training/universal_conversion.py, then cut
by DeepSpeed's loader to the rank's EP share and TP slice) it continues the run to 1e-5 (fp32, another summation
order). At EP 2 (the second test) each EP rank's experts are in files of their own. That the split
model computes what the unsplit one does, aux losses included, is tests/test_model_parallel.py's (the MoE layouts of
its 3D run); the block against transformers' and across EP, tests/test_moe.py's.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.launch import final_weights, resumable_copy, run_training, same_weights, trajectory
from training.metrics_log import read_metrics

CONFIG = "ds_configs/llama-tiny-cpu.json"
MOE = {"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 64, "shared_expert_ffn_hidden_size": 64,
       "first_dense_layers": 1, "aux_loss_coeff": 0.01, "router_z_loss_coeff": 0.001, "router": "sigmoid_bias",
       "bias_update_rate": 0.01}
EXTRA = ["training.save_interval=4", f"model.moe={json.dumps(MOE, separators=(',', ':'))}"]



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

    reshaped = resumable_copy(save, tmp_path / "reshaped")  # TP 2 x PP 2 x DP 1 -> TP 1 x PP 2 x DP 2, EP 2
    result = run_training(corpus, reshaped, max_steps=8, ds_config=CONFIG,
                          extra=[*EXTRA, "parallelism.tensor_parallel_size=1", "parallelism.expert_parallel_size=2"])
    assert ("resumed global_step4 written at TP 2 x PP 2 x DP 1; now TP 1 x PP 2 x DP 2 (EP 2)"
            in result.stdout + result.stderr)
    again = read_metrics(reshaped / "metrics.jsonl")
    for key in ("lr", "global_batch", "consumed_samples"):
        assert [r[key] for r in again] == [r[key] for r in theirs], key
    # The first step shows the weights (every expert at its EP rank), the second the Adam moments. Later steps drift
    # apart by summation order (3.7e-7 at step 6), and the aux-loss-free router turns that into a routing flip
    # (step 8: loss 1.5e-5, aux loss 1.4e-4 apart; the same resume at EP 1 stays within 1e-7): two steps compared.
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        torch.testing.assert_close([r[key] for r in again[:2]], [r[key] for r in theirs[:2]], rtol=1e-5, atol=0,
                                   msg=key)


# TP 1 x PP 1 x DP 4, EP 2 on 4 processes: each EP rank's experts sharded over an expert-data-parallel group of 2
# (data ranks {0, 2} and {1, 3}), the case where their ZeRO fragments are not in data-parallel order (the experts'
# TP slices at EP 2 are the first test's, reshaped into)
EXPERT_PARALLEL = [*EXTRA, "parallelism.tensor_parallel_size=1", "parallelism.pipeline_parallel_size=1",
                   "train_micro_batch_size_per_gpu=1", "parallelism.expert_parallel_size=2"]


@pytest.mark.distributed
def test_expert_parallel_checkpoints_resume_exactly_and_reshape_to_ep_1(corpus, tmp_path):
    """At EP 2 (TP 1 x DP 4, 4 processes) each EP rank's experts are in files of their own, the layer files hold
    none; a stop at step 4 resumed to step 8 is bitwise the uninterrupted run (experts and routers' bias included);
    resumed at EP 1, TP 1 x PP 2 x DP 2 through the universal checkpoint (the experts merged from their
    expert-data-parallel shards by training/universal_conversion.py) it continues the run to 1e-5."""
    save = tmp_path / "ep2" / "checkpoints"
    run_training(corpus, save, max_steps=8, extra=EXPERT_PARALLEL, ds_config=CONFIG, processes=4)
    steps, records = trajectory(save), read_metrics(save / "metrics.jsonl")
    assert [step for step, *_ in steps] == list(range(1, 9))
    weights = final_weights(save)
    experts = sorted(name for name in weights if name.startswith("experts_"))
    # layer 3 (the sparse block: the embedding is 0, the blocks 2 and 3), 2 EP ranks
    assert experts == [f"experts_03-model_00-ep_{e:02d}.pt" for e in range(2)]
    for name in experts:
        assert {key: tuple(value.shape) for key, value in weights[name].items()} == {
            "mlp.block.experts.gate_up": (2, 128, 128), "mlp.block.experts.down": (2, 128, 64)}  # 4 / EP 2
    assert not any("experts." in key for name, shard in weights.items() if name.startswith("layer_") for key in shard)
    assert not torch.equal(weights[experts[0]]["mlp.block.experts.down"], weights[experts[1]]["mlp.block.experts.down"])

    resumed = resumable_copy(save, tmp_path / "resumed")
    run_training(corpus, resumed, max_steps=8, extra=EXPERT_PARALLEL, ds_config=CONFIG, processes=4)
    assert trajectory(resumed) == steps[4:]
    assert same_weights(final_weights(resumed), weights)

    reshaped = resumable_copy(save, tmp_path / "reshaped")  # TP 1 x PP 1 x DP 4, EP 2 -> TP 1 x PP 2 x DP 2, EP 1
    result = run_training(corpus, reshaped, max_steps=8, ds_config=CONFIG,
                          extra=[*EXTRA, "parallelism.tensor_parallel_size=1", "train_micro_batch_size_per_gpu=1"])
    assert "written at TP 1 x PP 1 x DP 4 (EP 2); now TP 1 x PP 2 x DP 2" in result.stdout + result.stderr
    again, theirs = read_metrics(reshaped / "metrics.jsonl"), records[4:]
    for key in ("lr", "global_batch", "consumed_samples"):
        assert [r[key] for r in again] == [r[key] for r in theirs], key
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        torch.testing.assert_close([r[key] for r in again], [r[key] for r in theirs], rtol=1e-5, atol=0, msg=key)
