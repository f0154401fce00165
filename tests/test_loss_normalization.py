"""training.loss_normalization "tokens" (training/loss_normalization.py, model/loss.py): the step's loss is the sum
over the global batch's target tokens divided by their count, whatever the split into micro-batches, accumulation
steps and data-parallel replicas.

A global batch of 8 samples whose loss masks hold very different numbers of targets (1 to 15 of 16 positions: a
short answer beside a long one) trains 3 steps through DeepSpeed's engine in one 2-process launch at four splits,
(micro-batch x accumulation x DP) = 1 x 4 x 2, 4 x 1 x 2 (PP 1, DP 2) and 2 x 4 x 1, 8 x 1 x 1 (PP 2, DP 1). Every
split's losses and gradient norms equal the unsplit model's sum / count (plain PyTorch, one process) within 1e-6.
The default, "micro_batch" (each micro-batch's mean, averaged), equals it only with one micro-batch of the whole
batch (8 x 1 x 1); with these masks its 1 x 4 x 2 split is 1% away by step 3 (the test can fail).
"""

from __future__ import annotations

import pytest
import torch

from model.config import ParallelConfig
from tests.distributed import run_distributed
from tests.test_model_parallel import SEED, deepspeed_config, model_config, train_reference
from training.engine import build_engine
from training.loss_normalization import clear_step_tokens, set_step_tokens, take_micro_batches

GLOBAL_BATCH, STEPS, TOLERANCE = 8, 3, 1e-6
SPLITS = {  # (pipeline_parallel_size): [(micro-batch, accumulation steps)]; DP = 2 / PP
    1: [(1, 4), (4, 1)],
    2: [(2, 4), (8, 1)],
}


def global_batch(step: int, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples from a skewed 200-token distribution; sample r's mask keeps (2 r + 1) mod 16 positions at its end."""
    generator = torch.Generator().manual_seed(2000 + step)
    weights = torch.arange(200, 0, -1, dtype=torch.float) ** 2
    samples = torch.multinomial(weights, GLOBAL_BATCH * (seq_length + 1), replacement=True, generator=generator)
    loss_mask = torch.zeros(GLOBAL_BATCH, seq_length)
    for row in range(GLOBAL_BATCH):
        loss_mask[row, seq_length - (2 * row + 1) % seq_length:] = 1.0
    return samples.view(GLOBAL_BATCH, seq_length + 1), loss_mask


def replica_micro_batches(step: int, seq_length: int, micro: int, rank: int, size: int):
    """Megatron's order: micro-step k takes samples [k micro size, (k + 1) micro size); replica r its micro of them."""
    samples, loss_mask = global_batch(step, seq_length)
    positions = torch.arange(seq_length).expand(micro, seq_length)
    for start in range(0, GLOBAL_BATCH, micro * size):
        rows = slice(start + rank * micro, start + (rank + 1) * micro)
        yield (samples[rows, :-1], positions), (samples[rows, 1:], loss_mask[rows])


def reference() -> dict:
    """The unsplit model, the whole batch at once: sum of the masked token losses / their count."""

    def step_loss(model, objective, step):
        samples, loss_mask = global_batch(step, model_config().seq_length)
        positions = torch.arange(samples.shape[1] - 1).expand(GLOBAL_BATCH, -1)
        objective.step_tokens = loss_mask.sum()  # one micro-batch, one replica: the sum over all targets / count
        return objective(model(samples[:, :-1], positions), (samples[:, 1:], loss_mask))

    return train_reference(step_loss=step_loss, steps=STEPS)


def _train_splits(normalizations: list[str]) -> dict:
    world = torch.distributed.get_world_size()
    results = {}
    for pipeline_parallel_size, splits in SPLITS.items():
        for micro, accumulation in splits:
            data_parallel_size = world // pipeline_parallel_size
            for normalization in normalizations:
                if normalization == "micro_batch" and (micro, data_parallel_size) not in ((1, 2), (8, 1)):
                    continue  # the default at two splits is enough to tell it apart
                config = model_config()
                ds_config = {**deepspeed_config("fp32"), "train_micro_batch_size_per_gpu": micro,
                             "train_batch_size": GLOBAL_BATCH}
                engine, ctx = build_engine(config, ParallelConfig(pipeline_parallel_size=pipeline_parallel_size),
                                           ds_config, SEED)
                assert engine.gradient_accumulation_steps() == accumulation
                losses, norms = [], []
                for step in range(STEPS):
                    loader = replica_micro_batches(step, config.seq_length, micro, ctx.data_parallel_rank,
                                                   data_parallel_size)
                    batches = take_micro_batches(loader, accumulation)
                    if normalization == "tokens":
                        set_step_tokens(engine.module.objective, batches, engine.grid.get_data_parallel_group(),
                                        data_parallel_size)
                    losses.append(engine.train_batch(data_iter=iter(batches)).item())
                    clear_step_tokens(engine.module.objective)
                    norms.append(float(engine.get_global_grad_norm()))
                results[f"{micro} x {accumulation} x {data_parallel_size} {normalization}"] = {
                    "losses": losses, "norms": norms}
                del engine
    return results


@pytest.mark.distributed
def test_token_normalisation_is_the_same_whatever_the_split():
    expected = reference()
    ranks = run_distributed(2, _train_splits, ["tokens", "micro_batch"])
    for results in ranks:  # every rank reports the replica-averaged loss and the global norm
        for split, result in results.items():
            if split.endswith("tokens"):
                for key in ("losses", "norms"):
                    torch.testing.assert_close(result[key], expected[key], rtol=TOLERANCE, atol=0,
                                               msg=f"{split}: {key}")
        # "micro_batch": one micro-batch of the whole batch is the same thing; four replicas' means are not
        whole, split = results["8 x 1 x 1 micro_batch"]["losses"], results["1 x 4 x 2 micro_batch"]["losses"]
        torch.testing.assert_close(whole, expected["losses"], rtol=TOLERANCE, atol=0)
        # (at step 1 every token's loss is near ln V, so the means agree to 6e-4; the gradients weigh tokens otherwise)
        assert abs(split[-1] - expected["losses"][-1]) > 1e-3 * expected["losses"][-1], (split, expected)
