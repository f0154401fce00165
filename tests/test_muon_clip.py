"""MuonClip (training/muon.py QKClip): the row factors and the refusals here, MLA's rows against transformers'
DeepseekV3Attention; the distributed checks run in tests/test_muon.py's launch (``watched``, ``check_clipping``),
against a one-process reference built from transformers' own q_proj, k_proj and rotary embedding (``head_maxima``,
``clip_reference``).

Measured: 5 steps at TP 2 x PP 2 x DP 2 with SP, tau 1.15 amid the heads' first maxima (1.07 to 1.36): each step's
per-head maxima (reduced over DP) and the losses within 1e-5 of the reference, every weight within 7.7e-7; without the
DP reduction of the maxima they are 0.26 off. At lr 0 the monitor sees each block's largest logit at tau after
clipping (above it without), and the log's qk_clip_max_logit and qk_clipped_heads are the ranks' own. At lr 1.0 for
8 steps the monitor's largest logit is 71.6 clipped, 6,072 unclipped: Kimi-K2's clip uses the step's own forward,
before its update, and one update at lr 1.0 moves the logits by tens on its own. With qk_clip_passes (forwards of the
step's batch through the updated weights, each attention clipping itself) the monitor sees 1.068 to 1.150 at every
step of the same 8, 3 passes a step; without the DP reduction inside the passes the replicas' weights part. MLA
(q_lora and q_proj): maxima equal transformers' within 1e-5, rows after the clip equal Kimi-K2's rule on
transformers' tensors within 1e-6; scaling the rotated query rows by sqrt(gamma) instead fails both cases.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.config import preset
from runconfig.optimizer import MuonConfig
from tests.test_muon import (
    CLIP_PASSES,
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
    check_qk_clip(options, preset("kimi-k2"), 1)  # MLA: Kimi-K2's rule (test_mla_clip_is_kimi_k2s_rule)
    for model, cp, reason in [(dataclasses.replace(model_config(), qk_layernorm=True), 1, "model.qk_layernorm"),
                              (model_config(), 2, "context parallelism")]:
        with pytest.raises(ValueError, match=f"optimizer.params.qk_clip 100.0: .*{reason}"):
            check_qk_clip(options, model, cp)
    with pytest.raises(ValueError, match="optimizer.params.qk_clip_passes 2 without qk_clip"):
        MuonConfig(qk_clip_passes=2)
    with pytest.raises(ValueError, match="optimizer.params.qk_clip_passes -1 must be an integer >= 0"):
        MuonConfig(qk_clip=1.0, qk_clip_passes=-1)


@pytest.mark.parametrize("queries_per_group", [1, 3])
def test_qk_row_factors_scale_each_heads_logits_by_its_gamma(queries_per_group):
    """A fused qkv shard with a bias ([g, q + 2, d] rows), MHA and GQA: after the rows' factors, head j's logits are
    gamma_j times its logits before, exactly (fp64), heads under tau untouched; the values' rows too."""
    from model.attention import qk_row_factors

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


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None, "rope_scaling": None}], ids=["q_lora", "q_proj"])
def test_mla_clip_is_kimi_k2s_rule(monkeypatch, overrides):
    """MLA (DeepSeek-V3, Kimi-K2): our attention's maxima, and its rows after the clip, against transformers'
    DeepseekV3Attention with Kimi-K2's rule written on its own tensors: each head's q.k scaling from its own eager
    attention; q_b_proj's (q_proj's) rows of head j times sqrt(gamma_j) on the unrotated features and gamma_j on the
    rotated ones, kv_b_proj's key rows sqrt(gamma_j), the shared rope key (kv_a_proj_with_mqa) untouched. Afterwards
    the clipped heads' largest logit is tau and the others' unchanged."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as deepseek

    from model.mla import MultiHeadLatentAttention
    from model.parallel import ParallelContext
    from model.random import RNGStream
    from tests.test_mla import YARN_MSCALE, B, H, S, _hf_attention, _inputs, mla_config
    from training.muon import QKClip

    config = mla_config(**{"rope_scaling": YARN_MSCALE, **overrides})
    ours = MultiHeadLatentAttention(config, ParallelContext(), seed=1, layer_number=1, rng=RNGStream(0))
    theirs, rotary = _hf_attention(config)
    theirs.load_state_dict({name.replace("dense.", "o_proj."): t for name, t in ours.state_dict().items()})
    x = _inputs(B, S, H, seed=2) * 4
    cos, sin = rotary(x, torch.arange(S).expand(B, S))
    causal = torch.full((S, S), float("-inf")).triu(1).expand(B, 1, S, S)
    eager = deepseek.eager_attention_forward

    def hf_maxima() -> torch.Tensor:
        seen = {}

        def keep(module, query, key, value, mask, scaling, **kwargs):
            seen["logits"] = (query @ key.transpose(-1, -2) * scaling + mask).detach()
            return eager(module, query, key, value, mask, scaling=scaling, **kwargs)

        monkeypatch.setattr(deepseek, "eager_attention_forward", keep)
        with torch.no_grad():
            theirs(x, (cos, sin), causal)
        return seen["logits"].amax(dim=(0, 2, 3))  # (nh,)

    expected = hf_maxima()
    tau = float(expected.median())  # half the heads above it
    clip = QKClip(tau, ours)
    ours(x).sum().backward()  # a training forward records the step's maxima
    clip.before_step()
    torch.testing.assert_close(clip.largest, expected, rtol=1e-5, atol=1e-5)
    gamma = torch.where(expected > tau, tau / expected, torch.ones_like(expected))
    assert 0 < int((gamma < 1).sum()) < len(gamma)
    d_n, d_r, d_v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    with torch.no_grad():
        projection = theirs.q_b_proj if theirs.q_lora_rank is not None else theirs.q_proj
        query = projection.weight.view(len(gamma), d_n + d_r, -1)
        query[:, :d_n] *= gamma.sqrt()[:, None, None]
        query[:, d_n:] *= gamma[:, None, None]
        theirs.kv_b_proj.weight.view(len(gamma), d_n + d_v, -1)[:, :d_n] *= gamma.sqrt()[:, None, None]
    rope_key = ours.kv_a_proj_with_mqa.weight.clone()
    clip.scale_model_rows()
    assert torch.equal(ours.kv_a_proj_with_mqa.weight, rope_key)
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, theirs.state_dict()[name.replace("dense.", "o_proj.")], rtol=1e-6, atol=0,
                                   msg=name)
    torch.testing.assert_close(hf_maxima(), torch.minimum(expected, torch.tensor(tau)), rtol=1e-5, atol=0)


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
    """Steps at the learning rates ``lrs``, the stability monitor measuring the largest attention logit of each block
    after each step on one sample (step 0's first; its probe). Every micro-batch is that sample, but with
    qk_clip_passes, where each DP rank's batch is the sample and 3 of its own (the step's micro_batches), so that the
    passes' maxima differ between the replicas."""
    from training.muon import clip_after_step
    from training.stability import StabilityMonitor

    sample = next(micro_batches(0, 0, 1))
    monitor = StabilityMonitor(engine, ctx, num_layers, 1, 0.0, lambda: sample)
    clip, after, before, over, logged, passes = engine.optimizer.optimizer.clip, [], [], [], [], []
    for step, lr in enumerate(lrs, start=1):
        monitor.before_step(step)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        batches = [sample] * (GLOBAL_BATCH // ctx.data_parallel_size)
        if clip is not None and clip.passes:
            batches[1:] = list(micro_batches(step, ctx.data_parallel_rank, ctx.data_parallel_size))[1:]
        engine.train_batch(data_iter=iter(batches))
        if clip is not None and clip.passes:  # what the trainer runs after train_batch
            passes.append(clip_after_step(engine, batches, clip))
        monitor.after_step(step)
        fields = monitor.take()
        after.append(fields["attention_logit_per_layer"])
        before.append(float(clip.largest.max()) if clip is not None else None)
        over.append(int((clip.largest > TAU).sum()) if clip is not None else None)
        logged.append((fields.get("qk_clip_max_logit"), fields.get("qk_clipped_heads")))
    weights = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])  # this rank's, after the passes
    return {"after": after, "before": before, "over": over, "logged": logged, "passes": passes, "weights": weights,
            "stage": ctx.pipeline_parallel_rank, "tp": ctx.tensor_parallel_rank}


def check_clipping(ranks: list, tmp_path: Path) -> None:
    """MuonClip against the one-process reference, and against the stability monitor."""
    clipped, watched, unclipped, passed = len(MODES) + 2, len(MODES) + 3, len(MODES) + 4, len(MODES) + 5
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
    # lr 1.0 with the passes: forwards of the step's batch through the updated weights, each attention clipping
    # itself, until none passes tau; the monitor (a forward of the same sample) then sees every block at tau or under
    with_passes = ranks[0][passed]
    print(f"lr 1.0 with qk_clip_passes {CLIP_PASSES}: passes per step {with_passes['passes']}; largest logit seen by "
          f"the stability monitor per step {[round(max(a), 6) for a in with_passes['after']]}")
    for step, blocks in enumerate(with_passes["after"]):
        assert max(blocks) <= TAU * (1 + 1e-5), (step, blocks)
    assert all(1 < passes < CLIP_PASSES for passes in with_passes["passes"][1:])  # the first step is at lr 0
    replicas = {}  # the DP replicas clipped alike: each (stage, TP rank)'s two hold the same weights
    for rank in ranks:
        replicas.setdefault((rank[passed]["stage"], rank[passed]["tp"]), []).append(rank[passed]["weights"])
    for pair in replicas.values():
        assert len(pair) == 2 and torch.equal(*pair)


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


TRAIN_PY_TAU, TRAIN_PY_PASSES = 0.5, 4
NAN_GUARD = 'training.spike_guard={"enabled": true, "ratio": 100, "min_increase_nats": 100}'
"""The spike guard skips a non-finite loss; at lr 1.0 the loss climbs by tens a step, which it must not judge."""


@pytest.mark.distributed
def test_train_py_runs_the_passes_and_the_first_step_holds_on_its_batch(corpus, tmp_path):
    """train.py at TP 2 x PP 2 (4 ranks), Muon at lr 1.0 with qk_clip and qk_clip_passes: the trainer takes each step's
    micro-batches again after it and the log says how many passes it ran. The stability monitor's probe is the run's
    first micro-batch, part of step 1's batch: after step 1 it sees every block at tau or under (far above it with
    Kimi-K2's clip alone), and the step's own record (loss, log Z, the clip's maxima) is the same with or without the
    passes. Step 2's loss is NaN (a poisoned loss mask) and the spike guard skips its update: no passes run, and the
    probe reads what it read after step 1."""
    from tests.launch import run_training
    from training.metrics_log import read_metrics

    runs = {}
    for passes in (TRAIN_PY_PASSES, 0):
        save = tmp_path / f"passes-{passes}"
        result = run_training(corpus, save, max_steps=4 if passes else 1, extra=[
            'optimizer.type="Muon"', f"optimizer.params.qk_clip={TRAIN_PY_TAU}",
            f"optimizer.params.qk_clip_passes={passes}", "schedule.lr=1.0", "schedule.warmup_tokens=0",
            "training.stability_interval=1", "training.save_interval=0", NAN_GUARD],
            faults={"poison_steps": [2]} if passes else None)
        runs[passes] = read_metrics(save / "metrics.jsonl"), result
    (records, result), ((kimi, *_), _) = runs[TRAIN_PY_PASSES], runs[0]
    print([(r["step"], r["qk_clip_max_logit"], r["qk_clipped_heads"], r["qk_clip_passes"], r["max_attention_logit"])
           for r in records])
    assert [r["step"] for r in records] == [1, 2, 3, 4] and [r["skipped_steps"] for r in records] == [0, 1, 1, 1]
    assert [r["qk_clip_passes"] == 0 for r in records] == [False, True, False, False]
    assert all(r["qk_clip_passes"] <= TRAIN_PY_PASSES for r in records)
    assert max(r["qk_clip_passes"] for r in records) > 1 and max(r["qk_clipped_heads"] for r in records) > 0
    assert records[0]["max_attention_logit"] <= TRAIN_PY_TAU * (1 + 1e-5)
    assert records[1]["max_attention_logit"] == records[0]["max_attention_logit"]  # the skipped step clipped nothing
    assert kimi["max_attention_logit"] > 10 * TRAIN_PY_TAU  # Kimi-K2's clip alone, the same step 1
    assert "qk_clip_passes" not in kimi and "clip passes" in result.stdout
    # the passes' forwards are not the step's: its loss, log Z and clip record are the same without them
    for field in ("loss", "log_z_mean", "log_z_min", "qk_clip_max_logit", "qk_clipped_heads", "grad_norm"):
        assert records[0][field] == pytest.approx(kimi[field], rel=1e-6), field


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_passes_stop_at_the_rounding_of_their_dtype(dtype):
    """One process, the passes' loop (clip_after_step's, the forwards eager here): a bf16 model's clipped heads come
    back from a pass up to bf16's rounding above tau (rows scaled by gamma near 1 round back to themselves), so the
    stop must allow that rounding, or every step runs every pass. tau a third of the largest logit."""
    from model.attention import attention_logit_probe
    from model.gpt import GPT
    from training.muon import QKClip, pass_tolerance

    model = GPT(model_config(), seed=1).to(dtype)
    tokens, positions = next(micro_batches(0, 0, 1))[0]
    with torch.no_grad(), attention_logit_probe(model) as probe:
        model(tokens, positions)
    clip = QKClip(float(max(probe.values())) / 3, model)
    clip.apply = clip.scale_model_rows  # no optimizer here: the model's weights are the only copy
    assert clip.pass_tolerance == pass_tolerance(dtype) and (clip.pass_tolerance > 1e-3) == (dtype == torch.bfloat16)
    found = []
    while len(found) < 6 and (not found or found[-1] > 1 + clip.pass_tolerance):
        clip.start_pass()
        with torch.no_grad():
            model(tokens, positions)
        found.append(float(clip.end_pass()) / clip.tau)
    print(f"{dtype}: each pass's largest logit over tau {found}")
    assert len(found) <= 3 and found[0] > 2.9
