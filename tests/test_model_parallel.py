"""The whole GPT split TP x PP x DP through the real DeepSpeed pipeline engine equals the unsplit model.

Every run trains the same tiny GPT (same seed, same batches) for a few optimizer steps with the recipe's optimizer:
ZeRO-1, Adam (0.9, 0.95, 1e-8) in AdamW mode, weight decay 0.1 on matrices only, clipping at global norm 1.0. The
reference is a single-process plain-PyTorch loop (torch.optim.AdamW, clip_grad_norm_) over the same micro-batches.
Step 1's loss and gradient norm are the forward/backward parity; later steps add the optimizer and clipping.
fp32 agrees to ~1e-5 (reduction order differs between splits); bf16 is checked against fp32 more loosely.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from model.config import ParallelConfig, preset
from model.gpt import GPT
from tests.distributed import requires_fp16, run_distributed
from training.engine import build_engine, weight_decay_groups

SEED = 1234
STEPS = 5
GLOBAL_BATCH, MICRO_BATCH = 8, 2
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16)


def model_config(**overrides):
    return preset("tiny", **{**MODEL, **overrides})


def deepspeed_config(precision: str) -> dict:
    config = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                 "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def global_batch(step: int, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of seq_length + 1 tokens from a skewed 200-token distribution (learnable in a few steps), and a
    loss mask with zeros (the last two positions, and a random tenth)."""
    generator = torch.Generator().manual_seed(1000 + step)
    weights = torch.arange(200, 0, -1, dtype=torch.float) ** 2
    samples = torch.multinomial(weights, GLOBAL_BATCH * (seq_length + 1), replacement=True, generator=generator)
    loss_mask = (torch.rand(GLOBAL_BATCH, seq_length, generator=generator) > 0.1).float()
    loss_mask[:, -2:] = 0.0
    return samples.view(GLOBAL_BATCH, seq_length + 1), loss_mask


def micro_batches(step: int, seq_length: int, data_parallel_rank: int, data_parallel_size: int):
    """Megatron's order: micro-step k takes samples [k mb dp, (k+1) mb dp); DP rank r keeps its mb of them."""
    samples, loss_mask = global_batch(step, seq_length)
    per_micro_step = MICRO_BATCH * data_parallel_size
    positions = torch.arange(seq_length).expand(MICRO_BATCH, seq_length)
    for start in range(0, GLOBAL_BATCH, per_micro_step):
        rows = slice(start + data_parallel_rank * MICRO_BATCH, start + (data_parallel_rank + 1) * MICRO_BATCH)
        tokens = samples[rows]
        yield (tokens[:, :-1], positions), (tokens[:, 1:], loss_mask[rows])


def _train_pipeline(tensor_parallel_size: int, pipeline_parallel_size: int, precision: str,
                    variants: list[dict]) -> list[dict]:
    """Train each variant (model fields, plus "sequence_parallel") from scratch in these processes, one after the
    other: one launch serves several layouts of the same world."""
    from model.gpt import TransformerLayer
    from model.moe import sparse_layers

    results = []
    for variant in variants:
        fields = dict(variant)
        sequence_parallel = fields.pop("sequence_parallel", False)
        z_loss = fields.pop("z_loss", 0.0)
        expert_parallel_size = fields.pop("expert_parallel_size", 1)
        config = model_config(precision=precision, **fields)
        parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                  pipeline_parallel_size=pipeline_parallel_size, sequence_parallel=sequence_parallel,
                                  expert_parallel_size=expert_parallel_size)
        engine, ctx = build_engine(config, parallel, deepspeed_config(precision), SEED, z_loss)
        blocks = [module for module in engine.module.modules() if isinstance(module, TransformerLayer)]
        sent = []  # the shape of what this stage's last block outputs: on stage 0, the tensor sent to stage 1
        blocks[-1].register_forward_hook(lambda module, inputs, output, sent=sent: sent.append(tuple(output.shape)))
        losses, norms = [], []
        for step in range(STEPS):
            data = micro_batches(step, config.seq_length, ctx.data_parallel_rank, ctx.data_parallel_size)
            losses.append(engine.train_batch(data_iter=data).item())
            norms.append(float(engine.get_global_grad_norm()))
        results.append({"losses": losses, "norms": norms, "micro_batches": engine.gradient_accumulation_steps(),
                        "stage": ctx.pipeline_parallel_rank, "stage_output": sent[0],
                        "recompute": [block.recompute for block in blocks],
                        "local_experts": [layer.block.local_experts for _, layer in sparse_layers(engine.module)],
                        "has_moe_layers": bool(engine.has_moe_layers)})
        del engine
    return results


def clip_by_global_norm(model: torch.nn.Module, max_norm: float) -> float:
    """torch's clip_grad_norm_ rule (coefficient max_norm / (norm + 1e-6), at most 1), with the norm summed in fp64.

    torch.nn.utils.clip_grad_norm_ sums the 3.2M squares of the embedding gradient in fp32 on CPU and comes out
    1.4e-5 (relative) below the fp64 value; DeepSpeed's ZeRO-1 norm agrees with fp64 to 1e-7.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt().item()
    coefficient = min(1.0, max_norm / (norm + 1e-6))
    for grad in grads:
        grad.mul_(coefficient)
    return norm


def train_reference(config=None, z_loss: float = 0.0, step_loss=None, steps: int = STEPS) -> dict:
    """Plain PyTorch, one process, the unsplit model (model_config() unless another is given): the ground truth.
    ``z_loss``: the objective's z-loss coefficient (model/loss.py). ``step_loss(model, objective, step)``: the loss
    of a step, by default the mean of the micro-batches of ``micro_batches``."""
    from model.loss import GPTLoss
    from model.moe import set_gradient_scale, sparse_layers

    torch.manual_seed(SEED)
    config = config or model_config()
    model = GPT(config, seed=SEED)
    objective = GPTLoss(model.ctx, z_loss)
    set_gradient_scale(sparse_layers(model), GLOBAL_BATCH // MICRO_BATCH, 1.0)  # the aux losses averaged as the loss
    optimizer = torch.optim.AdamW(weight_decay_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS)
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad()
        if step_loss is not None:
            total = step_loss(model, objective, step)
        else:  # as the pipeline engine takes it: the mean of the micro-batches' losses
            batches = list(micro_batches(step, config.seq_length, 0, 1))
            total = sum(objective(model(*inputs), labels) for inputs, labels in batches) / len(batches)
        total.backward()
        norms.append(clip_by_global_norm(model, CLIP))
        optimizer.step()
        losses.append(total.item())
    return {"losses": losses, "norms": norms}


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_reference()


def test_reference_learns_and_clips(reference):
    assert reference["losses"][-1] < reference["losses"][0] - 0.5
    assert reference["norms"][0] > CLIP  # the first steps are really clipped, so clipping is under test


SEQUENCE_PARALLEL = {"sequence_parallel": True}
# (2, 2, 2) with sequence parallelism and each recompute mode ("full" on the first block of each 2-block stage; on
# every block in the MoE variant below): recomputation and sequence parallelism must not change the numbers.
# The stability options: per-head q/k norms (their gradients summed over TP with and without SP) and the z-loss on
# vocabulary shards, against a reference with the same options.
STABILITY = {"qk_layernorm": True, "z_loss": 1e-2}
# Mixture-of-Experts (model/moe.py) at EP 1: the first block dense (a stage of PP 2 with one sparse block), 4 experts
# top 2 with a shared expert, the aux and z losses attached in autograd on whichever stage holds the block.
MOE = {"mlp": "swiglu", "moe": {"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 32, "aux_loss_coeff": 0.05,
                                "router_z_loss_coeff": 0.01, "shared_expert_ffn_hidden_size": 32,
                                "first_dense_layers": 1}}
# Expert parallelism: EP 2 splits the 4 experts over DP 2 (an all-to-all dispatch, the expert gradients reduced over
# the expert-data-parallel group by DeepSpeed's optimizer); the first two blocks dense, so stage 0 of PP 2 has no
# expert and runs the expert norm's cross-stage collectives with zeros. It equals the unsplit model (EP 1).
MOE_EP2 = {**MOE, "moe": {**MOE["moe"], "first_dense_layers": 2}, "expert_parallel_size": 2}
LAYOUTS_3D = [{}, SEQUENCE_PARALLEL, {**SEQUENCE_PARALLEL, "recompute": "selective"},
              {**SEQUENCE_PARALLEL, "recompute": "full", "recompute_num_layers": 1},  # every block: MoE's variant
              STABILITY, {**SEQUENCE_PARALLEL, **STABILITY, "recompute": "selective"},
              MOE, {**SEQUENCE_PARALLEL, **MOE, "recompute": "full"}, MOE_EP2]
STABILITY_FIELDS = ("qk_layernorm", "z_loss", "mlp", "moe")


def expected_for(variant: dict, reference: dict, references: dict) -> dict:
    """The reference a variant must equal: the plain model's, or (stability or MoE options) one with the same
    options."""
    options = {key: variant[key] for key in STABILITY_FIELDS if key in variant}
    if not options:
        return reference
    key = json.dumps(options, sort_keys=True)
    if key not in references:
        z_loss = options.pop("z_loss", 0.0)
        references[key] = train_reference(model_config(**options), z_loss)
    return references[key]


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp, dp, variants", [
    (1, 1, 1, [{}]),
    (2, 1, 1, [{}]),
    (1, 2, 1, [{"recompute": "full"}]),
    (2, 2, 2, LAYOUTS_3D),  # 8 processes: the full 3D split
], ids=["1-1-1", "2-1-1", "1-2-1-full", "2-2-2-sp-recompute"])
def test_fp32_split_equals_unsplit(tp, pp, dp, variants, reference):
    ranks = run_distributed(tp * pp * dp, _train_pipeline, tp, pp, "fp32", variants)
    references = {}
    for variant_index, variant in enumerate(variants):
        expected = expected_for(variant, reference, references)
        for rank_results in ranks:  # every rank reports the same DP-averaged loss and global norm
            result = rank_results[variant_index]
            torch.testing.assert_close(result["losses"], expected["losses"], rtol=1e-5, atol=1e-5, msg=str(variant))
            torch.testing.assert_close(result["norms"], expected["norms"], rtol=1e-5, atol=1e-5, msg=str(variant))
            assert result["micro_batches"] == GLOBAL_BATCH // (MICRO_BATCH * dp)
            recompute = variant.get("recompute", "none")
            layers = variant.get("recompute_num_layers")
            assert result["recompute"] == [recompute if layers is None or i < layers else "none"
                                           for i in range(MODEL["num_layers"] // pp)]
            if variant.get("expert_parallel_size", 1) > 1:  # stage 0 dense; stage 1 holds E / EP experts per block
                experts = variant["moe"]["num_experts"] // variant["expert_parallel_size"]
                assert result["local_experts"] == ([] if result["stage"] == 0 else [experts, experts])
                assert result["has_moe_layers"] == (result["stage"] == 1)  # DeepSpeed's EDP reduction, EP norm
            if result["stage"] == 0:  # the tensor sent to the next stage: this TP rank's sequence shard with SP
                sequence = MODEL["seq_length"] // (tp if variant.get("sequence_parallel") else 1)
                assert result["stage_output"] == (MICRO_BATCH, sequence, MODEL["hidden_size"])


@pytest.mark.distributed
def test_bf16_trains_near_fp32(reference):
    """The GPT, and the Mixture-of-Experts model of MOE (its router in fp32 on bf16 activations), each against its
    fp32 reference. The MoE run measured: losses within 3.6e-3, gradient norms within 0.22% (step 1) and 0.14%.
    The MoE model at EP 2 (MOE_EP2: BF16_Optimizer's expert groups, a stage without experts) against its EP 1 fp32
    reference."""
    variants = [{"recompute": "full", **SEQUENCE_PARALLEL}, {"recompute": "full", **SEQUENCE_PARALLEL, **MOE},
                MOE_EP2]
    per_rank = run_distributed(8, _train_pipeline, 2, 2, "bf16", variants)
    moe_ep2 = {key: value for key, value in MOE_EP2.items() if key != "expert_parallel_size"}
    references = [reference, train_reference(model_config(**MOE)), train_reference(model_config(**moe_ep2))]
    for index, expected in enumerate(references):
        _check_bf16([rank[index] for rank in per_rank], expected)


def _check_bf16(ranks: list[dict], reference: dict) -> None:
    losses = ranks[0]["losses"]
    assert losses[-1] < losses[0] - 0.5
    # Tolerances from bf16's precision (8 significant bits: a relative rounding of up to 2^-9, spacing 2^-8):
    # - losses: about 10-11 here, where bf16 values are 2^-4 apart; 0.05 is under one bf16 spacing of the loss
    #   (the loss is computed in fp32 from bf16 logits). Measured: at most 1.4e-3 over the 5 steps.
    # - step 1 shares the fp32 weights, so only the bf16 forward and backward separate the gradient norms: each
    #   gradient element carries a few 2^-9 roundings, random across 3.4M elements, which the norm averages; 1%
    #   (2.5 x 2^-8) bounds even a rounding bias shared by all elements. Measured: 2.0e-3.
    # - later steps follow weights updated from those gradients, which drift apart by Adam's lr-sized steps: 5%.
    #   Measured: at most 3.3e-3.
    # bf16 with fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer (not the ZeRO one): its global norm must
    # also count TP shards on every rank, replicated parameters and the tied embedding once.
    torch.testing.assert_close(losses, reference["losses"], rtol=0, atol=0.05)
    assert abs(ranks[0]["norms"][0] - reference["norms"][0]) < 0.01 * reference["norms"][0]
    torch.testing.assert_close(ranks[0]["norms"], reference["norms"], rtol=0.05, atol=0.05)


def _train_fp16(initial_scale_power: int, steps: int):
    config = model_config(precision="fp16")
    ds_config = deepspeed_config("fp32")
    ds_config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": initial_scale_power,
                         "loss_scale_window": 1000, "hysteresis": 1}
    engine, ctx = build_engine(config, ParallelConfig(), ds_config, SEED)
    trace = []
    for step in range(steps):
        loss = engine.train_batch(data_iter=micro_batches(step, config.seq_length, 0, 1)).item()
        trace.append((loss, int(engine.skipped_steps), float(engine.optimizer.cur_scale)))
    return trace


@requires_fp16
@pytest.mark.distributed
def test_fp16_loss_scale_overflows_are_skipped_and_counted():
    """A loss scale of 2^24 overflows fp16: DeepSpeed skips those steps, counts them and halves the scale until the
    gradients fit; the trainer reads the same engine.skipped_steps for its log."""
    trace = run_distributed(1, _train_fp16, 24, 10)[0]
    skipped = [count for _, count, _ in trace]
    overflows = skipped[-1]
    assert 0 < overflows < len(trace)
    assert skipped == [min(step + 1, overflows) for step in range(len(trace))]  # the first steps, one each
    assert [scale for _, _, scale in trace[:overflows]] == [2.0 ** (23 - i) for i in range(overflows)]
    assert trace[-1][0] < trace[overflows][0]  # then it trains


INJECTED_STEPS = (1, 2)


def _train_with_injected_inf(precision: str, steps: int):
    """Steps in INJECTED_STEPS get an inf in one micro-batch's loss mask: a non-finite loss whose gradients are
    non-finite on every stage, the same condition an fp16 overflow raises. Returns, per step, the loss, DeepSpeed's
    skipped-step count and whether any weight changed."""
    config = model_config(precision=precision)
    engine, ctx = build_engine(config, ParallelConfig(), deepspeed_config(precision), SEED)
    trace = []
    for step in range(steps):
        batches = list(micro_batches(step, config.seq_length, 0, 1))
        if step in INJECTED_STEPS:
            (tokens, labels), (targets, loss_mask) = batches[-1]
            loss_mask = loss_mask.clone()
            loss_mask[0, 0] = float("inf")
            batches[-1] = ((tokens, labels), (targets, loss_mask))
        before = [p.detach().clone() for p in engine.module.parameters()]
        loss = engine.train_batch(data_iter=iter(batches)).item()
        changed = any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters(), strict=True))
        trace.append((loss, int(engine.skipped_steps), changed))
    return trace


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_non_finite_gradients_are_skipped_and_counted(precision):
    """DeepSpeed's overflow path (the one fp16 loss scaling uses) in the precisions every CPU runs: a step whose
    gradients are not finite leaves every weight untouched and is counted in engine.skipped_steps, which the trainer
    logs; the steps around it train."""
    trace = run_distributed(1, _train_with_injected_inf, precision, 5)[0]
    assert [skipped for _, skipped, _ in trace] == [0, 1, 2, 2, 2]
    assert [changed for _, _, changed in trace] == [True, False, False, True, True]
    assert [math.isfinite(loss) for loss, _, _ in trace] == [True, False, False, True, True]
    assert trace[-1][0] < trace[0][0]  # then it trains
