"""MuonClip (training/muon.py QKClip): the row factors and the refusals here; the distributed checks run in
tests/test_muon.py's launch (``watched``, ``check_clipping``), against a one-process reference built from
transformers' own q_proj, k_proj and rotary embedding (``head_maxima``, ``clip_reference``).

Measured: 5 steps at TP 2 x PP 2 x DP 2 with SP, tau 1.15 amid the heads' first maxima (1.07 to 1.36): each step's
per-head maxima (reduced over DP) and the losses within 1e-5 of the reference, every weight within 7.7e-7; without the
DP reduction of the maxima they are 0.26 off. At lr 0 the monitor sees each block's largest logit at tau after
clipping (above it without), and the log's qk_clip_max_logit and qk_clipped_heads are the ranks' own. At lr 1.0 for 8 steps the monitor's largest logit is 71.6 clipped, 6,072 unclipped: the
clip uses the step's own forward, before its update, and one update at lr 1.0 moves the logits by tens on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.config import preset
from runconfig.optimizer import MuonConfig
from tests.test_muon import (
    CLIP_STEPS,
    FIELDS,
    GLOBAL_BATCH,
    MODES,
    TAU,
    TOLERANCE,
    WILD_STEPS,
    exported,
    initial_weights,
    micro_batches,
    model_config,
    train_reference,
)


def test_qk_clip_is_refused_where_rows_cannot_clip_the_logits():
    import dataclasses

    from runconfig.optimizer import check_qk_clip

    options = MuonConfig(qk_clip=100.0)
    check_qk_clip(options, model_config(), 1)
    check_qk_clip(MuonConfig(), model_config(), 2)  # no clip: nothing to refuse
    for model, cp, reason in [(dataclasses.replace(model_config(), qk_layernorm=True), 1, "model.qk_layernorm"),
                              (model_config(), 2, "context parallelism"),
                              (preset("moonlight-16b-a3b"), 1, "multi-head latent attention")]:
        with pytest.raises(ValueError, match=f"optimizer.params.qk_clip 100.0: .*{reason}"):
            check_qk_clip(options, model, cp)


@pytest.mark.parametrize("queries_per_group", [1, 3])
def test_qk_row_factors_scale_each_heads_logits_by_its_gamma(queries_per_group):
    """A fused qkv shard with a bias ([g, q + 2, d] rows), MHA and GQA: after the rows' factors, head j's logits are
    gamma_j times its logits before, exactly (fp64), heads under tau untouched; the values' rows too."""
    from training.muon import qk_row_factors

    groups, d, hidden, length = 2, 8, 16, 5
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(groups * (queries_per_group + 2) * d, hidden, generator=generator, dtype=torch.float64)
    bias = torch.randn(weight.shape[0], generator=generator, dtype=torch.float64)
    x = torch.randn(length, hidden, generator=generator, dtype=torch.float64)

    def logits(w, b):
        rows = (x @ w.T + b).view(length, groups, queries_per_group + 2, d)
        q, k, v = rows[:, :, :-2], rows[:, :, -2:-1], rows[:, :, -1:]
        return torch.einsum("igjd,tgkd->gjit", q, k).flatten(0, 1), v  # (heads, s, s)

    gamma = torch.rand(groups * queries_per_group, generator=generator, dtype=torch.float64).clamp(min=0.1)
    gamma[0] = 1.0  # a head under tau, in a group whose other heads may pass it
    rows = qk_row_factors(gamma, groups, queries_per_group, d)
    before, values = logits(weight, bias)
    after, values_after = logits(weight * rows[:, None], bias * rows)
    torch.testing.assert_close(after, before * gamma[:, None, None], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(values_after, values, rtol=0, atol=0)


def head_maxima(model) -> tuple[list, list]:
    """Forward hooks on every LlamaAttention of ``model``: each head's largest logit q.k / sqrt(d) (causal), from
    transformers' own q_proj, k_proj and rotary embedding, recomputed here; the list of per-layer maxima grows with
    each forward."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers = model.model.layers
    maxima = [torch.full((model.config.num_attention_heads,), float("-inf")) for _ in layers]

    def hook(index: int):
        def record(attention, args, kwargs, output):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            b, s, d = hidden.shape[0], hidden.shape[1], attention.head_dim
            q = attention.q_proj(hidden).view(b, s, -1, d).transpose(1, 2)
            k = attention.k_proj(hidden).view(b, s, -1, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scores = (q @ k.transpose(-1, -2)).detach() / d ** 0.5
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            maxima[index] = torch.maximum(maxima[index], scores.amax(dim=(0, 2, 3)))
        return record

    handles = [layer.self_attn.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    return maxima, handles


def clip_reference(model, maxima: list[torch.Tensor], tau: float) -> None:
    """MuonClip on the HF matrices, head by head: head j of key group g, gamma_j = min(1, tau / max_j); q_proj's rows
    of head j times gamma_j / sqrt(min over g's heads of gamma), k_proj's rows of g times that sqrt."""
    config = model.config
    d, per_group = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    with torch.no_grad():
        for layer, largest in zip(model.model.layers, maxima, strict=True):
            gamma = torch.where(largest > tau, tau / largest, torch.ones_like(largest))
            for group in range(config.num_key_value_heads):
                heads = range(group * per_group, (group + 1) * per_group)
                key = min(gamma[j] for j in heads).sqrt()
                layer.self_attn.k_proj.weight[group * d:(group + 1) * d] *= key
                for j in heads:
                    layer.self_attn.q_proj.weight[j * d:(j + 1) * d] *= gamma[j] / key


def watched(engine, ctx, num_layers: int, lrs: list[float]) -> dict:
    """Steps at the learning rates ``lrs``, every micro-batch of every one the same sample (step 0's first), the
    stability monitor measuring the largest attention logit of each block after each step on it (its probe)."""
    from training.stability import StabilityMonitor

    sample = next(micro_batches(0, 0, 1))
    monitor = StabilityMonitor(engine, ctx, num_layers, 1, 0.0, lambda: sample)
    clip, after, before, over, logged = engine.optimizer.optimizer.clip, [], [], [], []
    for step, lr in enumerate(lrs, start=1):
        monitor.before_step(step)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        engine.train_batch(data_iter=iter([sample] * (GLOBAL_BATCH // ctx.data_parallel_size)))
        monitor.after_step(step)
        fields = monitor.take()
        after.append(fields["attention_logit_per_layer"])
        before.append(float(clip.largest.max()) if clip is not None else None)
        over.append(int((clip.largest > TAU).sum()) if clip is not None else None)
        logged.append((fields.get("qk_clip_max_logit"), fields.get("qk_clipped_heads")))
    return {"after": after, "before": before, "over": over, "logged": logged}


def check_clipping(ranks: list, tmp_path: Path) -> None:
    """MuonClip against the one-process reference, and against the stability monitor."""
    clipped, watched, unclipped = len(MODES) + 2, len(MODES) + 3, len(MODES) + 4
    expected = train_reference(initial_weights(), MODES[0], CLIP_STEPS, qk_clip=TAU)
    heads = FIELDS["num_attention_heads"] // 2  # each TP rank's
    assert (expected["maxima"][0] > TAU).any() and (expected["maxima"][0] < TAU).any()  # some heads clipped, not all
    for rank in ranks:  # the step's own per-head maxima, reduced over DP, equal transformers' q.k of the same step
        run = rank[clipped]
        mine = torch.stack(run["maxima"])  # (steps, heads of this rank)
        theirs = torch.stack(expected["maxima"])[:, run["stage"], run["tp"] * heads:(run["tp"] + 1) * heads]
        torch.testing.assert_close(mine, theirs, rtol=TOLERANCE, atol=TOLERANCE)
        torch.testing.assert_close(run["losses"], expected["losses"], rtol=TOLERANCE, atol=TOLERANCE)
    final = exported(tmp_path / "clipped" / "final")
    worst = max((final[name] - expected["weights"][name]).abs().max().item() for name in final)
    print(f"MuonClip tau {TAU}: step maxima {[round(float(m.max()), 3) for m in expected['maxima']]}; largest weight "
          f"difference from the one-process reference {worst:.2e}")
    for name, value in final.items():
        torch.testing.assert_close(value, expected["weights"][name], rtol=TOLERANCE, atol=TOLERANCE, msg=f"clip {name}")
    watched_run, free_run = ranks[0][watched], ranks[0][unclipped]
    # lr 0: the update leaves the weights as the step's forward saw them, so the clipped heads' logits are tau
    assert watched_run["before"][0] == pytest.approx(max(free_run["after"][0]), rel=1e-6)
    assert max(free_run["after"][0]) > TAU  # the monitor sees the unclipped logits above tau ...
    for layer, largest in enumerate(watched_run["after"][0]):  # ... and each block's clipped at it, or below
        assert largest <= TAU * (1 + 1e-6) and (largest >= TAU * (1 - 1e-6) or free_run["after"][0][layer] <= TAU)
    # the log's fields: the largest pre-clip logit of all ranks' heads, and the heads clipped (each counted once)
    for step in range(1 + WILD_STEPS):
        largest = max(rank[watched]["before"][step] for rank in ranks)
        clipped = sum(rank[watched]["over"][step] for rank in ranks) // 2  # DP 2 replicas hold the same heads
        assert watched_run["logged"][step] == (pytest.approx(largest, rel=1e-6), clipped)
    assert free_run["logged"][0] == (None, None)
    # lr 1.0: each step's update alone moves the logits by ~25 (clipping uses the step's own forward, before it)
    largest_clipped = max(max(after) for after in watched_run["after"])
    largest_free = max(max(after) for after in free_run["after"])
    print(f"lr 1.0, {WILD_STEPS} steps: largest logit seen by the stability monitor {largest_clipped:.1f} clipped at "
          f"tau {TAU}, {largest_free:.1f} unclipped; per step {[round(max(a), 1) for a in watched_run['after']]} vs "
          f"{[round(max(a), 1) for a in free_run['after']]}")
    assert largest_clipped < largest_free / 10


def test_a_step_without_the_steps_reduction_fails_instead_of_clipping_by_stale_factors():
    """The clip's factors belong to one step: before_step sets them (hooked before DeepSpeed's OptimizerStep), the
    next forward retires them (hooked before ForwardPass). A schedule that skipped the first hook would otherwise
    clip every later step by the first step's factors, silently."""
    from model.gpt import GPT
    from model.parallel import ParallelContext
    from training.muon import QKClip, as_pipeline_layers, build_muon

    config = model_config()
    model = GPT(config, seed=1)
    optimizer = build_muon(as_pipeline_layers(model), config, ParallelContext(), MuonConfig(qk_clip=TAU))
    optimizer.clip = QKClip(TAU, model)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    with pytest.raises(RuntimeError, match="MuonClip: the optimizer stepped without this step's per-head maxima"):
        optimizer.step()
    optimizer.clip.before_step()
    optimizer.step()  # this step's factors
    optimizer.clip.forward_started()
    with pytest.raises(RuntimeError, match="the clip would use the previous step's factors"):
        optimizer.step()
