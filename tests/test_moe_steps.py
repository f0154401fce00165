"""What a training step does to the Mixture-of-Experts' own pieces (model/moe.py, training/moe_monitor.py), through
the real pipeline engine at PP 2 on 2 CPU processes (the second stage holds the sparse block):

- The aux and z losses under a loss scale. DeepSpeed multiplies the loss by the scale S before the backward and
  divides every gradient by S after it; the attached auxiliary losses follow S (training/engine.py loss_scale_of), so
  the unscaled gradient is the same at any S. fp16's dynamic scale cannot run on every CPU, so the test sets S with
  ZeRO's own ``override_loss_scale`` in fp32 (S = 1 and 2^10, exact in fp32): the same gradient norm and the same
  weights after the step, bitwise (gradient norm 7.423132 at both). Before, the aux gradient shrank to 1/S: at
  S = 2^10 the norm was 4.838346, next to the 4.837409 of the same step without the auxiliary losses.
- The aux-loss-free router's bias moves only on applied steps. A step whose gradients are NaN (its loss masks
  poisoned, as training/faults.py poisons them) is skipped by DeepSpeed's overflow path; the bias stays bitwise what
  it was, and the next step moves it again.
- What the monitor logs of those three steps (training/moe_monitor.py): moe_sequence_aux_loss is the mean of the
  sequence-wise balance loss the router itself returned at each of its 12 forwards (4 micro-batches a step, the
  skipped step's too), read by a hook on the router; 1e-6 relative (the layer sums its forwards in fp32, the test in
  fp64), the same on both stages (one all-reduce), and apart from moe_aux_loss, the batch-wide loss.
"""

from __future__ import annotations

import pytest
import torch

from model.config import ParallelConfig
from tests.distributed import run_distributed
from tests.test_model_parallel import SEED, deepspeed_config, micro_batches, model_config

MOE = {"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 32, "first_dense_layers": 3, "aux_loss_coeff": 1.0,
       "router_z_loss_coeff": 0.1}
SCALES = (1.0, 2.0**10)


def _engine(moe: dict):
    from training.engine import build_engine

    config = model_config(mlp="swiglu", moe=moe)
    return build_engine(config, ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=2),
                        deepspeed_config("fp32"), SEED), config


def _step_under_scales() -> dict:
    """One step from the same weights at each loss scale, and one without the auxiliary losses: the gradient norm
    and the sparse block's weights after the step."""
    from model.moe import sparse_layers

    results = {}
    for name, moe, scale in [*((f"scale {s:g}", MOE, s) for s in SCALES),
                             ("no aux", {**MOE, "aux_loss_coeff": 0.0, "router_z_loss_coeff": 0.0}, 1.0)]:
        (engine, ctx), config = _engine(moe)
        engine.optimizer.override_loss_scale(scale)
        engine.train_batch(data_iter=micro_batches(0, config.seq_length, ctx.data_parallel_rank,
                                                   ctx.data_parallel_size))
        weights = {key: value.clone() for _, layer in sparse_layers(engine.module)
                   for key, value in layer.state_dict().items()}
        results[name] = {"norm": float(engine.get_global_grad_norm()), "weights": weights}
        del engine
    return results


def _bias_across_a_skipped_step() -> tuple[list[torch.Tensor], int, dict, list[float]]:
    """The router's bias after each of three steps, the second one's loss masks NaN; what the monitor logs of the
    three, and the sequence-wise balance loss of each of the router's forwards."""
    from model.moe import sparse_layers
    from training.moe_monitor import MoEMonitor

    (engine, ctx), config = _engine({**MOE, "router": "sigmoid_bias", "bias_update_rate": 0.01,
                                     "sequence_aux_loss_coeff": 0.01})
    monitor, biases, routed = MoEMonitor(engine.module, config, ctx), [], []
    for _, layer in sparse_layers(engine.module):
        layer.block.router.register_forward_hook(
            lambda router, inputs, routing: routed.append(float(routing.sequence_aux_loss.detach())))
    for step in range(3):
        data = list(micro_batches(step, config.seq_length, ctx.data_parallel_rank, ctx.data_parallel_size))
        if step == 1:
            data = [(inputs, (labels, torch.full_like(mask, float("nan")))) for inputs, (labels, mask) in data]
        skipped_before = engine.skipped_steps
        engine.train_batch(data_iter=iter(data))
        monitor.after_step(applied=engine.skipped_steps == skipped_before)
        biases += [layer.block.router.expert_bias.clone() for _, layer in sparse_layers(engine.module)]
    return biases, int(engine.skipped_steps), monitor.take(), routed


def _steps() -> dict:
    return {"scales": _step_under_scales(), "bias": _bias_across_a_skipped_step()}


@pytest.mark.distributed
def test_aux_gradients_follow_the_loss_scale_and_the_bias_skips_skipped_steps():
    ranks = run_distributed(2, _steps)
    print({name: result["norm"] for name, result in ranks[1]["scales"].items()})
    for rank in ranks:  # the same norm on both stages; the sparse block is on the second
        scales = rank["scales"]
        unscaled, scaled, without = (scales[name] for name in ("scale 1", "scale 1024", "no aux"))
        assert scaled["norm"] == unscaled["norm"]  # bitwise: S = 2^10 is exact in fp32
        assert abs(without["norm"] - unscaled["norm"]) > 1e-3 * unscaled["norm"]  # the aux losses matter here
        assert scaled["weights"].keys() == unscaled["weights"].keys()
        assert all(torch.equal(scaled["weights"][key], unscaled["weights"][key]) for key in unscaled["weights"])
    biases, skipped, logged, routed = ranks[1]["bias"]
    assert skipped == 1 and len(biases) == 3  # one sparse block: its bias after each step
    assert biases[0].abs().max() > 0  # the first step moved it
    assert torch.equal(biases[1], biases[0])  # the skipped step left it, bitwise
    assert not torch.equal(biases[2], biases[1])  # the next applied step moves it again
    assert ranks[0]["bias"] == ([], 1, logged, [])  # the first stage: no sparse block, the same skip and log
    expected = sum(routed) / len(routed)
    print(f"moe_sequence_aux_loss {logged['moe_sequence_aux_loss']:.7f}, the router's mean {expected:.7f}, "
          f"moe_aux_loss {logged['moe_aux_loss']:.7f}")
    assert len(routed) == 12 and expected > 0.5  # 4 micro-batches x 3 steps; 1.0 when even
    assert abs(logged["moe_sequence_aux_loss"] - expected) <= 1e-6 * expected
    assert abs(logged["moe_aux_loss"] - expected) > 1e-4 * expected  # another loss: a mix-up would show
