"""Multi-token prediction (model.mtp, model/mtp.py) against a reference written from DeepSeek-V3's equations.

The reference (``reference_objective``) reads the one-process GPT's parameters and computes, with plain torch:
the trunk's next-token cross-entropy, then for each depth k the paper's eqs. 21-24: h'^k = M_k [RMSNorm(Emb(t_{i+k}));
RMSNorm(h^{k-1}_i)], h^k = TRM_k(h'^k), P^k = OutHead(RMSNorm_k(h^k)), CE_k over the positions whose target t_{i+k+1}
exists (i <= s - 1 - k), divided by the micro-batch's target count T; the objective CE + lambda / D sum_k CE_k.
The blocks are the GPT's own modules (their parity with the unsplit block is tests/test_model_parallel.py's); the
rolls, masks, norms, concatenation order and shared head are the reference's.

- One process: the GPT's objective (model/loss.py on model/mtp.py's logits) equals the reference at D 1 and 2, tied
  and untied heads, and adding MTP changes no logit of the trunk.
- 8 gloo processes, one launch: a Llama-style model with MTP 1 (untied head, GQA, SwiGLU) trains 10 steps through a
  batch ramp (4 then 8 sequences) and a lambda change (0.3 then 0.1) at TP 2 x PP 2 x DP 2 (sequence parallelism
  on) and TP 1 x PP 4 x DP 2; each step's next-token and MTP losses and the gradient norm equal the reference's
  (AdamW, clipping at 1.0) within 1e-5. The TP 2 x PP 2 run saves after step 7 and a new engine resumes from it:
  steps 8-10 repeat bit for bit. The depths sit on the last stage with the head. (PP 1 is the one-process tests'.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model.config import MTPConfig, ParallelConfig, preset
from model.gpt import GPT, mtp_partition, partition_weights
from model.loss import GPTLoss
from tests.distributed import run_distributed
from tests.test_model_parallel import BETAS, CLIP, EPS, WEIGHT_DECAY, clip_by_global_norm, deepspeed_config

SEED = 1234
SEQ = 16
STEPS, SAVED_AFTER = 10, 7
RAMP = [4] * 5 + [8] * 5  # the global batch of each step: a ramp's increment after step 5
LAMBDA = {"depth": 1, "loss_weight": 0.3, "loss_weight_changes": [[5 * 4 * SEQ + 8 * SEQ, 0.1]]}  # from step 7 on
LAYOUTS = [dict(tp=2, pp=2, sequence_parallel=True), dict(tp=1, pp=4)]  # PP 1: the one-process tests
LR = 1e-3
TOLERANCE = 1e-5  # fp32; the splits sum in other orders (tests/test_model_parallel.py)


def model_config(**overrides):
    fields = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128,
                  seq_length=SEQ, mtp=LAMBDA)
    return preset("llama-tiny", **{**fields, **overrides})


def reference_objective(model: GPT, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                        weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(objective, CE, [CE_1 .. CE_D]) of one micro-batch from the paper's equations (module docstring)."""
    vocab, eps = model.word_embeddings.vocab_size, model.final_norm.eps
    head = (model.word_embeddings if model.output_head is None else model.output_head).weight[:vocab]

    def rms(x, norm):
        return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)

    def cross_entropy(hidden, targets, kept):
        losses = F.cross_entropy(F.linear(hidden, head).flatten(0, 1), targets.flatten(), reduction="none")
        return (losses * kept.flatten()).sum() / mask.sum()

    hidden = F.embedding(tokens, model.word_embeddings.weight)
    for layer in model.layers:
        hidden = layer(hidden)
    main = cross_entropy(rms(hidden, model.final_norm), labels, mask)
    depths, positions = [], tokens.shape[1]
    for k, depth in enumerate(model.mtp.depths, start=1):
        embedded = F.embedding(tokens.roll(-k, dims=1), model.word_embeddings.weight)  # Emb(t_{i+k})
        combined = torch.cat([rms(embedded, depth.enorm), rms(hidden, depth.hnorm)], dim=-1)
        hidden = depth.block(F.linear(combined, depth.eh_proj.weight))
        valid = positions - k  # positions i with a target t_{i+k+1} = labels[i + k]
        depths.append(cross_entropy(rms(hidden, depth.final_norm)[:, :valid], labels[:, k:], mask[:, k:]))
    depths = torch.stack(depths)
    return main + weight / len(depths) * depths.sum(), main, depths


def samples(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` samples of SEQ + 1 tokens from a skewed 200-token distribution, and a loss mask with zeros."""
    generator = torch.Generator().manual_seed(500 + step)
    weights = torch.arange(200, 0, -1, dtype=torch.float) ** 2
    tokens = torch.multinomial(weights, batch * (SEQ + 1), replacement=True, generator=generator)
    mask = (torch.rand(batch, SEQ, generator=generator) > 0.1).float()
    return tokens.view(batch, SEQ + 1), mask


def micro_batches(step: int, data_parallel_rank: int, data_parallel_size: int):
    """Micro-batches of one sequence: micro-step j takes sample j DP + r on DP rank r."""
    tokens, mask = samples(step, RAMP[step])
    positions = torch.arange(SEQ).view(1, SEQ)
    for row in range(data_parallel_rank, RAMP[step], data_parallel_size):
        sample = tokens[row:row + 1]
        yield (sample[:, :-1], positions), (sample[:, 1:], mask[row:row + 1])


def weight_of(step: int) -> float:
    """lambda at ``step`` (0-based), from the tokens consumed before it: the trainer's rule."""
    return MTPConfig.from_dict(LAMBDA).weight_at(sum(RAMP[:step]) * SEQ)


# -- one process -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("depth, tied", [(1, False), (2, True), (2, False)])
def test_objective_equals_the_papers_equations(depth, tied):
    config = model_config(mtp={"depth": depth}, tie_word_embeddings=tied)
    model = GPT(config, seed=SEED)
    (tokens, mask), positions = samples(0, 2), torch.arange(SEQ).expand(2, SEQ)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    objective = GPTLoss(model.ctx, mtp=config.mtp)
    objective.mtp_weight = 0.25
    ours = objective(model(inputs, positions), (labels, mask))
    recorded = objective.take_mtp()
    expected, main, depths = reference_objective(model, inputs, labels, mask, 0.25)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(recorded, torch.cat([main.view(1), depths, torch.ones(1)]).detach(), rtol=1e-6,
                               atol=1e-6)
    trunk = GPT(dataclasses.replace(config, mtp=None), seed=SEED)  # the same seeds: MTP adds, it changes nothing
    assert torch.equal(trunk(inputs, positions), model(inputs, positions)[0])
    with torch.no_grad():  # validation reads the next-token loss alone
        torch.testing.assert_close(objective(model(inputs, positions), (labels, mask)), main, rtol=1e-6, atol=1e-6)


def test_the_lambda_schedule_and_the_refusals():
    mtp = MTPConfig.from_dict({"depth": 1, "loss_weight": 0.3, "loss_weight_changes": [[1e13, 0.1]]})
    assert [mtp.weight_at(t) for t in (0, 1e13 - 1, 1e13, 1.48e13)] == [0.3, 0.3, 0.1, 0.1]
    with pytest.raises(ValueError, match=r"model.mtp.loss_weight_changes: the token counts must be"):
        MTPConfig.from_dict({"loss_weight_changes": [[2e12, 0.1], [1e12, 0.2]]})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lambda'\] in block \"model.mtp\""):
        MTPConfig.from_dict({"lambda": 0.3})
    config = model_config()
    with pytest.raises(ValueError, match="model.mtp under parallelism.pipeline_schedule \"dualpipev\""):
        config.check_parallel(1, 2, stages_per_rank=2)
    with pytest.raises(ValueError, match="model.mtp with parallelism.context_parallel_size 2"):
        config.check_parallel(1, 1, context_parallel_size=2)


@pytest.mark.parametrize("pipeline_parallel_size", [2, 4])
def test_the_depths_weigh_as_blocks_and_share_the_last_stage(pipeline_parallel_size):
    config = model_config(mtp={"depth": 2})  # 4 blocks and 2 depths: 6 block-costs
    weights = partition_weights(config)
    assert weights == [0, 0, 1, 1, 1, 1, 0, 0, 0, 2, 0]
    parts = mtp_partition(config, [0] * (pipeline_parallel_size + 1), "type:TransformerLayer")
    costs = [sum(weights[a:b]) for a, b in zip(parts, parts[1:])]
    assert sum(costs) == 6 and max(costs) == {2: 3, 4: 2}[pipeline_parallel_size]
    assert parts[-2] <= config.num_layers + 2 and parts[-1] == len(weights)  # the final norm on, the last stage


# -- through the pipeline engine -------------------------------------------------------------------------------------

def _train(directory: str) -> list[dict]:
    """Each layout of LAYOUTS in these 8 processes, then the TP 2 x PP 2 run resumed from its step-5 checkpoint."""
    from training.checkpoint import load_checkpoint, save_checkpoint
    from training.engine import build_engine, set_global_batch

    config = model_config()
    ds_config = {**deepspeed_config("fp32"), "train_batch_size": RAMP[-1], "train_micro_batch_size_per_gpu": 1}
    ds_config["optimizer"]["params"] = {**ds_config["optimizer"]["params"], "lr": LR}

    def run(layout: dict, steps: range, engine=None, ctx=None) -> dict:
        if engine is None:
            parallel = ParallelConfig(tensor_parallel_size=layout["tp"], pipeline_parallel_size=layout["pp"],
                                      sequence_parallel=layout.get("sequence_parallel", False))
            engine, ctx = build_engine(config, parallel, ds_config, SEED)
        objective, result = engine.module.objective, {"main": [], "mtp": [], "norms": [], "objective": []}
        for step in steps:
            if step == SAVED_AFTER and layout.get("save"):
                save_checkpoint(engine, directory, step, client_state={})
            set_global_batch(engine, ctx, RAMP[step])
            objective.mtp_weight = weight_of(step)
            data = micro_batches(step, ctx.data_parallel_rank, ctx.data_parallel_size)
            result["objective"].append(engine.train_batch(data_iter=data).item())
            result["norms"].append(float(engine.get_global_grad_norm()))
            losses = objective.mtp_losses(torch.device("cpu"))  # collective: the step's mean over every replica
            result["main"].append(losses["loss"])
            result["mtp"].append(losses["mtp_loss"][0])
        result["last_stage"] = ctx.pipeline_parallel_rank == ctx.pipeline_parallel_size - 1
        result["depths_here"] = sum(type(m).__name__ == "MultiTokenPrediction" for m in engine.module.modules())
        result["engine"] = (engine, ctx)
        return result

    results = []
    for layout in LAYOUTS:
        result = run({**layout, "save": layout["pp"] == 2}, range(STEPS))
        engine, ctx = result.pop("engine")
        if layout["pp"] == 2:  # a new engine, the step-5 checkpoint loaded, steps 6-10 again
            del engine
            engine, ctx = build_engine(config, ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                                                              sequence_parallel=True), ds_config, SEED)
            load_checkpoint(engine, directory)
            resumed = run(layout, range(SAVED_AFTER, STEPS), engine, ctx)
            resumed.pop("engine")
            result["resumed"] = resumed
        del engine
        results.append(result)
    return results


def train_reference() -> dict:
    torch.manual_seed(SEED)
    config = model_config()
    model = GPT(config, seed=SEED)
    from training.engine import weight_decay_groups

    optimizer = torch.optim.AdamW(weight_decay_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS)
    result = {"main": [], "mtp": [], "norms": [], "objective": []}
    for step in range(STEPS):
        optimizer.zero_grad()
        terms = [reference_objective(model, inputs[0], labels[0], labels[1], weight_of(step))
                 for inputs, labels in micro_batches(step, 0, 1)]
        total = sum(term[0] for term in terms) / len(terms)
        total.backward()
        result["norms"].append(clip_by_global_norm(model, CLIP))
        optimizer.step()
        result["objective"].append(total.item())
        result["main"].append((sum(term[1] for term in terms) / len(terms)).item())
        result["mtp"].append((sum(term[2][0] for term in terms) / len(terms)).item())
    return result


@pytest.mark.distributed
def test_mtp_trains_as_the_reference_at_every_layout_and_resumes_bitwise(tmp_path):
    ranks = run_distributed(8, _train, str(tmp_path))
    expected = train_reference()
    # both losses fall (measured: next-token 10.93 -> 10.53, MTP 10.25 -> 10.13): the comparison is of training
    assert expected["main"][-1] < expected["main"][0] - 0.2 and expected["mtp"][-1] < expected["mtp"][0] - 0.05
    for index, layout in enumerate(LAYOUTS):
        for rank in ranks:
            result = rank[index]
            for key in ("objective", "norms"):  # every rank reports the step's DP mean and the global norm
                torch.testing.assert_close(result[key], expected[key], rtol=TOLERANCE, atol=TOLERANCE,
                                           msg=f"{layout} {key}")
            assert result["depths_here"] == int(result["last_stage"]), layout
            for key in ("main", "mtp"):
                torch.testing.assert_close(result[key], expected[key], rtol=TOLERANCE, atol=TOLERANCE,
                                           msg=f"{layout} {key}")
            if "resumed" in result:
                for key in ("objective", "norms", "main", "mtp"):
                    assert result["resumed"][key] == result[key][SAVED_AFTER:], f"{layout} resumed {key}"
