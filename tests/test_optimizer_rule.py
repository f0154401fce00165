"""The GPU configs' optimizer applies the same update as the one they asked for before, and needs no compiler.

125m.json, 1.3b.json and 530b.json used to ask for DeepSpeed's "Adam" alone, which is DeepSpeed's FusedAdam op
(deepspeed/ops/adam/fused_adam.py): JIT-compiled with nvcc and ninja at the first start on CUDA (and, on the CPU
accelerator, a C++ kernel compiled with the host compiler, about 45 s the first time, then cached in
~/.cache/torch_extensions). They now add ``"torch_adam": true, "fused": true``: DeepSpeed's
``get_optimizer_configuration`` (runtime/engine.py) then returns ``torch.optim.AdamW`` (adam_w_mode defaults to true
for "Adam") and passes every remaining param, ``fused`` included, to its constructor: torch's single-kernel AdamW,
shipped prebuilt for CUDA and CPU.

The rule both apply, per element, with g the (clipped) gradient, t the step, wd the group's weight decay:
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p = p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) - lr wd p          (decoupled weight decay, AdamW)
FusedAdam's CUDA kernel (csrc/adam/multi_tensor_adam.cu, ADAM_MODE_1) computes exactly this in fp32; torch's fused
AdamW computes p (1 - lr wd) - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps), the same expression in another
order. The tests compare, on CPU:
- the three on the same tensors: torch's fused AdamW, DeepSpeed's FusedAdam op (its CPU kernel), and the CUDA
  kernel's arithmetic written out in fp32 (the op the GPUs ran is not available here);
- both through deepspeed.initialize with each shipped config's optimizer block, gradient clipping and ZeRO-1, in fp32
  (DeepSpeedZeroOptimizer) and bf16 with fp32 accumulation (BF16_Optimizer, what the shipped configs select), with
  the project's weight-decay groups (training/engine.py: 0.1 on matrices, 0 on biases and LayerNorms).

Tolerance. Every step of either implementation rounds each element a bounded number of times: about 8 fp32 roundings
(two moment updates, the square root, the division, the bias corrections, the decay and the update), each at most
half an ulp (2^-24 relative) of the value it produces, and the two orders of operations round differently. So after
t steps a parameter may differ by t x 8 x 2^-24 relative to the sizes involved: |p| for the decay term and lr x
|m / sqrt(v)| (at most a few lr) for the update. ``ROUNDING`` below is that bound with 16 roundings per step
(5.7e-6 after 6 steps); measured, and printed by the tests: at most 1.5e-6 for the parameters, 3.5e-7 for the
moments (relative to the largest moment of their tensor: a first moment near 0 is a cancellation of gradients). Every step moves a decayed parameter by lr x wd x |p|
plus about lr, orders of magnitude more than the tolerance, and the L2-regularised variant (decay added to the
gradient instead) is checked to fall outside it: the comparison can tell the rules apart.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from model.config import preset
from model.gpt import GPT
from runconfig.run import load_run_config
from tests.distributed import run_distributed
from training.engine import weight_decay_groups

ROOT = Path(__file__).resolve().parents[1]
GPU_CONFIGS = ["125m.json", "1.3b.json", "530b.json"]
STEPS = 6
UNIT_ROUNDOFF = 2.0**-24  # half an ulp of 1.0 in fp32
ROUNDING = STEPS * 16 * UNIT_ROUNDOFF  # 5.7e-6: the bound of the module docstring
SEED = 1234


def shipped_optimizer(name: str) -> tuple[dict, float]:
    """The optimizer block DeepSpeed receives for a shipped config (schedule.lr inserted), and its gradient clip."""
    config = load_run_config(ROOT / "ds_configs" / name)
    return copy.deepcopy(config.deepspeed["optimizer"]), config.deepspeed["gradient_clipping"]


def previous_optimizer(block: dict) -> dict:
    """The same block as it was before: DeepSpeed's "Adam" without torch_adam, i.e. its FusedAdam op."""
    params = {k: v for k, v in block["params"].items() if k not in ("torch_adam", "fused")}
    return {**block, "params": params}


def small_gpt() -> GPT:
    """Embedding, LayerNorms, biases and matrices: every kind of parameter the weight-decay groups split."""
    return GPT(preset("tiny", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=200),
               seed=SEED)


def gradients(step: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Fixed per step, independent of the weights: both optimizers see the same gradients at every step. Odd steps
    are small enough to pass the clip of 1.0 untouched, even steps are clipped."""
    generator = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    scale = (0.5 if step % 2 else 3.0) / total
    return [g * scale for g in grads]


def test_gpu_configs_use_torch_fused_adamw_with_the_recipe_hyperparameters():
    for name in GPU_CONFIGS:
        block, clip = shipped_optimizer(name)
        params = block["params"]
        assert block["type"] == "Adam" and params["torch_adam"] is True and params["fused"] is True, name
        assert "adam_w_mode" not in params  # "Adam" defaults to decoupled weight decay (AdamW)
        assert (params["betas"], params["eps"], params["weight_decay"], clip) == ([0.9, 0.95], 1e-8, 0.1, 1.0), name
    assert json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())["optimizer"]["params"]["torch_adam"]


# -- the three implementations on the same tensors --------------------------------------------------------------------

def fused_adam_cuda_rule(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    """multi_tensor_adam.cu, AdamFunctor, ADAM_MODE_1, in fp32 (MATH_T = float), in place."""
    beta1, beta2 = betas
    f32 = torch.float32
    beta1_t, beta2_t = torch.tensor(beta1, dtype=f32), torch.tensor(beta2, dtype=f32)
    correction1 = torch.tensor(1 - beta1**step, dtype=f32)  # float = 1 - std::pow(beta1, step), in double
    correction2 = torch.tensor(1 - beta2**step, dtype=f32)
    exp_avg.copy_(beta1_t * exp_avg + (1 - beta1_t) * grad)
    exp_avg_sq.copy_(beta2_t * exp_avg_sq + (1 - beta2_t) * grad * grad)
    denom = torch.sqrt(exp_avg_sq / correction2) + torch.tensor(eps, dtype=f32)
    update = (exp_avg / correction1) / denom + torch.tensor(weight_decay, dtype=f32) * param
    param.sub_(torch.tensor(lr, dtype=f32) * update)


def _run_on_tensors(make_optimizer, lr: float, weight_decay: float, betas, eps) -> list[torch.Tensor]:
    """STEPS steps on the small GPT's parameters in the two weight-decay groups; returns the final parameters."""
    model = small_gpt()
    params = [p for p in model.parameters()]
    optimizer = make_optimizer(weight_decay_groups(model, weight_decay))
    for step in range(STEPS):
        for p, g in zip(params, gradients(step, [p.shape for p in params]), strict=True):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach().clone() for p in params]


def _cuda_rule_on_tensors(lr: float, weight_decay: float, betas, eps) -> list[torch.Tensor]:
    model = small_gpt()
    params = [p.detach().clone() for p in model.parameters()]
    decays = [weight_decay if p.ndim >= 2 else 0.0 for p in params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for step in range(STEPS):
        grads = gradients(step, [p.shape for p in params])
        for p, g, (m, v), wd in zip(params, grads, moments, decays, strict=True):
            fused_adam_cuda_rule(p, g, m, v, step + 1, lr, betas, eps, wd)
    return params


def _max_relative_difference(a: list[torch.Tensor], b: list[torch.Tensor], lr: float) -> float:
    """max |a - b| / (|b| + lr): the decay term scales with |p|, the Adam update with lr (see the docstring)."""
    return max(((x - y).abs() / (y.abs() + lr)).max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_torch_fused_adamw_equals_fused_adam_on_tensors(name):
    from deepspeed.ops.adam import FusedAdam  # compiles its CPU kernel on first use (~45 s), then cached

    block, _ = shipped_optimizer(name)
    params = block["params"]
    lr, betas, eps, wd = params["lr"], tuple(params["betas"]), params["eps"], params["weight_decay"]
    initial = [p.detach().clone() for p in small_gpt().parameters()]
    torch_adamw = _run_on_tensors(lambda groups: torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True),
                                  lr, wd, betas, eps)
    deepspeed_op = _run_on_tensors(lambda groups: FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True),
                                   lr, wd, betas, eps)
    cuda_rule = _cuda_rule_on_tensors(lr, wd, betas, eps)
    l2_variant = _run_on_tensors(lambda groups: torch.optim.Adam(groups, lr=lr, betas=betas, eps=eps), lr, wd, betas,
                                 eps)

    differences = {"torch fused AdamW vs DeepSpeed FusedAdam (CPU op)": _max_relative_difference(torch_adamw,
                                                                                                 deepspeed_op, lr),
                   "torch fused AdamW vs FusedAdam's CUDA arithmetic": _max_relative_difference(torch_adamw,
                                                                                               cuda_rule, lr)}
    print(f"{name}: lr {lr:g}: " + ", ".join(f"{k} {v:.2e}" for k, v in differences.items())
          + f" (tolerance {ROUNDING:.2e})")
    for what, difference in differences.items():
        assert difference <= ROUNDING, what
    moved = _max_relative_difference(torch_adamw, initial, lr)
    assert moved > 100 * ROUNDING  # the parameters did move, by far more than the tolerance
    assert _max_relative_difference(l2_variant, deepspeed_op, lr) > 10 * ROUNDING  # another rule is told apart
    # The decoupled decay reached the matrices only: a 1-D parameter (no decay) moved exactly as with wd = 0.
    no_decay = _run_on_tensors(lambda groups: torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True),
                               lr, 0.0, betas, eps)
    for p, q, start in zip(torch_adamw, no_decay, initial, strict=True):
        assert torch.equal(p, q) == (start.ndim < 2)


# -- both through deepspeed.initialize, with the shipped configs ----------------------------------------------------

def _train_with_deepspeed(optimizer_blocks: list[dict], clip: float, precision: str) -> list[dict]:
    """One process: for each optimizer block, an engine around the small GPT with the project's weight-decay groups,
    STEPS steps with the fixed gradients; returns each run's fp32 master weights and Adam moments after every step."""
    import deepspeed

    runs = []
    for block in optimizer_blocks:
        config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": clip,
                  "optimizer": copy.deepcopy(block), "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        model = small_gpt()
        weight_decay = block["params"]["weight_decay"]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=weight_decay_groups(model, weight_decay),
                                               config=config)
        params = [p for p in engine.module.parameters()]
        trace = []
        for step in range(STEPS):
            # sum(p * G): its gradient is G exactly, whatever the weights (in bf16, G rounded to bf16 the same way
            # in both runs).
            grads = gradients(step, [p.shape for p in params])
            loss = sum((p.float() * g).sum() for p, g in zip(params, grads, strict=True))
            engine.backward(loss)
            engine.step()
            trace.append(_optimizer_state(engine))
        runs.append({"optimizer": type(engine.optimizer.optimizer).__name__,
                     "wrapper": type(engine.optimizer).__name__, "trace": trace})
    return runs


def _optimizer_state(engine) -> dict[str, list[torch.Tensor]]:
    """The fp32 master weights the base optimizer updates (a flat partition per weight-decay group) and its moments."""
    wrapper = engine.optimizer
    master = (wrapper.fp32_groups_flat_partition if type(wrapper).__name__ == "BF16_Optimizer"
              else wrapper.single_partition_of_fp32_groups)
    state = wrapper.optimizer.state
    return {"params": [p.detach().clone() for p in master],
            "exp_avg": [state[p]["exp_avg"].clone() for p in master],
            "exp_avg_sq": [state[p]["exp_avg_sq"].clone() for p in master]}


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_shipped_optimizer_equals_the_previous_one_through_deepspeed(precision):
    blocks, clips = zip(*(shipped_optimizer(name) for name in GPU_CONFIGS), strict=True)
    assert len(set(clips)) == 1
    pairs = [(block, previous_optimizer(block)) for block in blocks]
    runs = run_distributed(1, _train_with_deepspeed, [b for pair in pairs for b in pair], clips[0], precision)[0]
    wrapper = "BF16_Optimizer" if precision == "bf16" else "DeepSpeedZeroOptimizer"
    for (block, _), new, old in zip(pairs, runs[0::2], runs[1::2], strict=True):
        lr = block["params"]["lr"]
        assert (new["optimizer"], old["optimizer"]) == ("AdamW", "FusedAdam")
        assert new["wrapper"] == old["wrapper"] == wrapper
        worst = {key: 0.0 for key in ("params", "exp_avg", "exp_avg_sq")}
        for a, b in zip(new["trace"], old["trace"], strict=True):
            worst["params"] = max(worst["params"], _max_relative_difference(a["params"], b["params"], lr))
            # The moments depend on the gradients only, which are the same: they differ by rounding, relative to
            # the moments' size (a first moment near 0 is a cancellation of gradients; its rounding is theirs).
            for key in ("exp_avg", "exp_avg_sq"):
                worst[key] = max(worst[key], max(((x - y).abs().max() / y.abs().max()).item()
                                                 for x, y in zip(a[key], b[key], strict=True)))
        print(f"lr {lr:g}, {precision}: largest differences over {STEPS} steps "
              + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f" (tolerance {ROUNDING:.2e})")
        assert all(value <= ROUNDING for value in worst.values()), worst
