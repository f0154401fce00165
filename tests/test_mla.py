"""Multi-head latent attention (model/mla.py): against transformers, split against unsplit, and what it refuses.

    check                                  reference                                   tolerance (fp32)
    MLA at TP 1, q_lora_rank set and       transformers' DeepseekV3Attention holding    1e-5 max abs: output and
      null, YaRN with mscale_all_dim or      the same random weights (no missing or       input gradient (the same
      none, rope_interleave true and         unexpected key)                              maths in another order)
      false, bias none and all
    an MLA block (TransformerLayer) at     the unsharded block, same seed               1e-6 max abs: output, input
      TP 2 and 4, sequence parallelism                                                    gradient, every weight
      off and on                                                                          gradient after the per-step
                                                                                          reduction over TP
    the document-mask kernels (blockwise,  SDPA with the (b, 1, s, s) mask               1e-5 max abs
      flex) with v narrower than q, k
    the attention-logit probe              q.k x the softmax scale, by hand              rtol 1e-6
    the latent KV cache: greedy            the same without the cache (each step the     the same tokens; logits
      generation, a prefill then steps       whole sequence), q_lora_rank set and null,    within 32 ulps of the
      then an extend                         rope_interleave both ways, YaRN               largest (CACHE_CASES)
    the cache at TP 2 (fake ranks, one     each rank without its cache; the sum of the   1e-6 max abs
      process)                               ranks' partial outputs, the whole attention
    the cache's bytes per token            DeepSeek-V3's shape: 576 values against       exact
                                             40,960 for keys and values

The split runs gloo on CPU (tests/distributed.py), one launch per world size for every variant. Weight gradients are
compared after what GPTPipelineModule has DeepSpeed do once per step: partial_gradient_parameters all-reduced over
TP (model/layers.py); replicated tensors must then agree bitwise across the ranks (gloo hands every rank the same
sum). Not 0 because the split sums in another order: row-parallel outputs add R partial products, the replicated
projections' input gradients are all-reduced, and BLAS blocks a matmul of N/R rows differently from one of N.
"""

from __future__ import annotations

import dataclasses
import re
import zlib

import pytest
import torch
import torch.distributed as dist

from model.attention import KVCache, attention_logit_probe, kv_caches
from model.config import ModelConfig, ParallelConfig
from model.flops import layer_forward_flops_per_token
from model.gpt import GPT, TransformerLayer
from model.layers import partial_gradient_parameters
from model.mla import LatentKVCache, MultiHeadLatentAttention
from model.parallel import ParallelContext, build_parallel_context
from model.random import RNGStream
from model.summary import analytic_total_parameters, dense_block_parameters
from tests.distributed import run_distributed
from tests.test_llama_layers import REPLICATED, assemble

B, S, H, HEADS = 2, 16, 64, 4  # S divides by TP 4 (sequence parallelism), the heads too
# YaRN in DeepSeek's form: mscale_all_dim scales the softmax (mscale^2) and, with mscale, the attention factor on cos
# and sin (mscale(1) / mscale(0.707)); factor 4 over 8 original positions reaches max_position_embeddings 32
YARN_MSCALE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0,
               "mscale_all_dim": 0.707}


def mla_config(**overrides) -> ModelConfig:
    """4 heads of q/k 16 + 8 rope and v 12 (v narrower than q and k), a q latent of 24 and a kv latent of 32."""
    fields = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S, max_position_embeddings=32,
                  ffn_hidden_size=96, vocab_size=100, make_vocab_size_divisible_by=8, position_embedding="rope",
                  norm="rmsnorm", mlp="swiglu", tie_word_embeddings=False, bias="none", attention_type="mla",
                  q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    return ModelConfig(**{**fields, **overrides})


def _inputs(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------------------------- against transformers


HF_CASES = {
    "q_lora": dict(),
    "q_proj, yarn": dict(q_lora_rank=None, rope_scaling=YARN_MSCALE),
    "q_lora, yarn, rotate_half, bias": dict(rope_scaling=YARN_MSCALE, rope_interleave=False, bias="all"),
    "q_proj, rotate_half": dict(q_lora_rank=None, rope_interleave=False),
}


def _hf_attention(config: ModelConfig):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = {"rope_theta": config.rope_theta, **(config.rope_scaling or {})}
    hf_config = DeepseekV3Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rope_interleave=config.rope_interleave,
        attention_bias=config.bias == "all", max_position_embeddings=config.max_position_embeddings,
        rope_parameters={**rope, "rope_type": rope.get("rope_type", "default")})
    hf_config._attn_implementation = "eager"  # softmax(q k^T scaling + mask) v, written out
    return DeepseekV3Attention(hf_config, layer_idx=0).eval(), DeepseekV3RotaryEmbedding(hf_config)


@pytest.mark.parametrize("overrides", HF_CASES.values(), ids=HF_CASES.keys())
def test_mla_is_transformers_deepseek_v3_attention(overrides):
    config = mla_config(**overrides)
    ours = MultiHeadLatentAttention(config, ParallelContext(), seed=1, layer_number=1, rng=RNGStream(0)).eval()
    theirs, rotary = _hf_attention(config)
    weights = {name: (1.0 + 0.1 * _inputs(*t.shape, seed=zlib.crc32(name.encode())) if "layernorm" in name
                      else 0.2 * _inputs(*t.shape, seed=zlib.crc32(name.encode())))
               for name, t in ours.state_dict().items()}
    ours.load_state_dict(weights, strict=True)
    theirs.load_state_dict({name.replace("dense.", "o_proj."): t for name, t in weights.items()}, strict=True)
    x = _inputs(B, S, H, seed=2)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    cos, sin = rotary(x, torch.arange(S).expand(B, S))
    causal = torch.full((S, S), float("-inf")).triu(1).expand(B, 1, S, S)
    expected, _ = theirs(x_theirs, (cos, sin), causal)
    out = ours(x_ours)
    weight = _inputs(B, S, H, seed=3)
    (expected * weight).sum().backward()
    (out * weight).sum().backward()
    errors = {"out": _max_abs(out, expected), "grad_x": _max_abs(x_ours.grad, x_theirs.grad)}
    print(f"\nMLA vs DeepseekV3Attention {overrides}: max abs {errors} (|out| max {expected.abs().max():.3g})")
    assert max(errors.values()) <= 1e-5, errors
    assert ours.softmax_scale == theirs.scaling
    if config.rope_scaling is not None:  # the case tests the mscale^2: without it the scale is 1 / sqrt(24)
        assert abs(ours.softmax_scale * config.head_dim ** 0.5 - 1) > 0.1


# ------------------------------------------------------------------------------------------- split against unsplit


# Every replicated piece in each variant: the q latent and its norm, or q_proj; biases on the down-projections and
# the output ("all"); YaRN's mscale; selective recomputation of the core.
VARIANTS = {"q_lora, bias all, yarn": dict(bias="all", rope_scaling=YARN_MSCALE),
            "q_proj, selective recompute": dict(q_lora_rank=None, recompute="selective")}


def _sharding(name: str):
    """How the block's parameter ``name`` is split over TP, written out (not read from the markers the model sets on
    its parameters, which test_mla_marks_its_split_tensors checks against this)."""
    if re.search(r"attention\.(q_proj|q_b_proj|kv_b_proj)\.weight$", name):
        return 0  # whole heads per rank
    if re.search(r"gate_up\.(weight|bias)$", name):
        return ("stacked", 2)  # [gate rows r; up rows r]
    if re.search(r"(dense|down)\.weight$", name):
        return 1
    return REPLICATED


def _sequence_shard(full: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    if not ctx.sequence_parallel:
        return full
    return full.chunk(ctx.tensor_parallel_size, dim=1)[ctx.tensor_parallel_rank].contiguous()


def _block(ctx: ParallelContext, fields: dict) -> dict:
    """One MLA block's output, input gradient and weight gradients (reduced over TP as in training) on this rank."""
    config = mla_config(**fields)
    block = TransformerLayer(config, ctx, seed=11, layer_number=2, rng=RNGStream(0))
    with torch.no_grad():  # non-trivial norms and biases, the same on every rank (they are replicated)
        for name, parameter in block.named_parameters():
            if parameter.ndim == 1 and not getattr(parameter, "tensor_model_parallel", False):
                parameter.add_(0.1 * _inputs(*parameter.shape, seed=zlib.crc32(name.encode())))
    x = _sequence_shard(_inputs(B, S, H, seed=12), ctx).requires_grad_()
    out = block(x)
    # a mean over the tokens, as the training loss: gradients of O(0.1), where 1e-6 is ~100 ulps, not one
    (out * _sequence_shard(_inputs(B, S, H, seed=13), ctx)).sum().div(B * S).backward()
    if ctx.tensor_parallel_group is not None:  # what GPTPipelineModule has DeepSpeed reduce once per step
        for parameter in partial_gradient_parameters(block, ctx.sequence_parallel):
            dist.all_reduce(parameter.grad, group=ctx.tensor_parallel_group)
    activations = 1 if ctx.sequence_parallel else REPLICATED
    results = {"out": (out.detach(), activations), "grad_x": (x.grad, activations)}
    results.update({f"grad {name}": (p.grad, _sharding(name)) for name, p in block.named_parameters()})
    return results


def _split_blocks(tensor_parallel_size: int) -> dict:
    ctx = build_parallel_context(ParallelConfig(tensor_parallel_size=tensor_parallel_size))
    return {(variant, sequence_parallel): _block(dataclasses.replace(ctx, sequence_parallel=sequence_parallel), fields)
            for variant, fields in VARIANTS.items() for sequence_parallel in (False, True)}


@pytest.fixture(scope="module")
def unsplit_blocks() -> dict:
    return {variant: {key: tensor for key, (tensor, _) in _block(ParallelContext(), fields).items()}
            for variant, fields in VARIANTS.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("tensor_parallel_size", [2, 4])
def test_mla_block_split_equals_unsplit(tensor_parallel_size, unsplit_blocks):
    per_rank = run_distributed(tensor_parallel_size, _split_blocks, tensor_parallel_size)
    report, failures = [], []
    for (variant, sequence_parallel), results in per_rank[0].items():
        expected = unsplit_blocks[variant]
        assert set(results) == set(expected)
        assert expected["grad attention.kv_a_layernorm.weight"].abs().max() > 1e-4  # the latent norm learns
        errors = {}
        for key, (_, sharding) in results.items():
            shards = [rank[variant, sequence_parallel][key][0] for rank in per_rank]
            if sharding == REPLICATED and not all(torch.equal(shards[0], shard) for shard in shards[1:]):
                worst = max(_max_abs(shard, expected[key]) for shard in shards)
                failures.append(f"TP {tensor_parallel_size}, sequence_parallel {sequence_parallel}, {variant}: {key} "
                                f"differs across the TP ranks (up to {worst:.3g} from the unsplit block's)")
            errors[key] = _max_abs(assemble(shards[:1] if sharding == REPLICATED else shards, sharding), expected[key])
        weight = max((key for key in errors if key.startswith("grad ")), key=errors.get)
        where = f"TP {tensor_parallel_size}, sequence_parallel {sequence_parallel}, {variant}"
        report.append(f"{where}: max abs out {errors['out']:.2e}, grad_x {errors['grad_x']:.2e}, weight gradients "
                      f"{errors[weight]:.2e} ({weight})")
        failures += [f"{where}: {key} differs by {error:.3g}" for key, error in errors.items() if error > 1e-6]
    print("\n" + "\n".join(report))
    assert failures == []


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_mla_marks_its_split_tensors(overrides):
    """The markers DeepSpeed's gradient norm and the per-step reduction read (model/layers.py): exactly the split
    tensors are tensor_model_parallel; the down-projections and latent norms are replicated, so that under sequence
    parallelism their gradients are reduced over TP."""
    with torch.device("meta"):
        block = TransformerLayer(mla_config(**overrides), ParallelContext(tensor_parallel_size=2), seed=0,
                                 layer_number=1)
    for name, parameter in block.named_parameters():
        assert getattr(parameter, "tensor_model_parallel", False) == (_sharding(name) != REPLICATED), name
    reduced = {id(p) for p in partial_gradient_parameters(block, sequence_parallel=True)}
    latent = [p for name, p in block.named_parameters() if re.search(r"attention\.(q_a|kv_a)", name)]
    assert latent and all(id(p) in reduced for p in latent)


# ----------------------------------------------------------------------------------- kernels, probe, the config


def _attention_pair(**overrides) -> tuple[MultiHeadLatentAttention, MultiHeadLatentAttention]:
    """The same weights under ``overrides``' document-mask kernel and under SDPA's masked reference."""
    layers = [MultiHeadLatentAttention(mla_config(rope_scaling=YARN_MSCALE, **fields), ParallelContext(), seed=5,
                                       layer_number=1, rng=RNGStream(0)) for fields in (overrides, {})]
    layers[0].load_state_dict(layers[1].state_dict())
    return layers[0], layers[1]


@pytest.mark.parametrize("backend", ["blockwise", "flex"])
def test_document_kernels_take_mla_values_and_softmax_scale(backend):
    """Two packed samples (documents of 5 + 11 and 9 + 7 tokens, positions restarting at each): the kernel equals SDPA
    with the (b, 1, s, s) mask, forward and (blockwise; FlexAttention has no CPU backward) backward."""
    ours, reference = _attention_pair(attention_backend=backend)
    reference.backend = "sdpa"
    segments = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    positions = torch.cat([torch.arange(n) for n in (5, 11, 9, 7)]).view(B, S)
    x = _inputs(B, S, H, seed=6)
    x_ours, x_reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.set_grad_enabled(backend == "blockwise"):
        out, expected = ours(x_ours, positions, segments), reference(x_reference, positions, segments)
    assert _max_abs(out, expected) <= 1e-5
    if backend == "blockwise":
        out.square().sum().backward()
        expected.square().sum().backward()
        assert _max_abs(x_ours.grad, x_reference.grad) <= 1e-5


def test_the_probe_reports_the_logits_of_the_softmax_scale():
    attention = MultiHeadLatentAttention(mla_config(rope_scaling=YARN_MSCALE), ParallelContext(), seed=7,
                                         layer_number=3, rng=RNGStream(0))
    seen = {}
    core = attention.core

    def keep_q_and_k(q, k, v, segment_ids=None):
        seen.update(q=q.detach(), k=k.detach())
        return core(q, k, v, segment_ids)

    attention.core = keep_q_and_k
    with torch.no_grad(), attention_logit_probe(attention) as found:
        attention(_inputs(B, S, H, seed=8) * 30)
    logits = seen["q"] @ seen["k"].transpose(-1, -2) * attention.softmax_scale  # (b, nh, s, s)
    expected = logits.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")).amax()
    torch.testing.assert_close(found[3], expected, rtol=1e-6, atol=0)


def test_a_saved_config_reads_back_resolved():
    config = mla_config()
    assert (config.head_dim, config.num_key_value_heads, config.rope_interleave, config.rotary_dim) == (24, 4, True, 8)
    assert (config.attention_size, config.qkv_size) == (4 * 12, 4 * (2 * 24 + 12))
    assert ModelConfig(**config.to_dict()) == config
    plain = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=8)
    assert plain.attention_type == "mha" and plain.rope_interleave is None and plain.rotary_dim == 16


@pytest.mark.parametrize("fields, message", [
    (dict(attention_type="gqa"), "model.attention_type must be one of"),
    (dict(attention_type="mha", q_lora_rank=None), "model.kv_lora_rank (32) is a field of model.attention_type"),
    (dict(kv_lora_rank=None), "model.kv_lora_rank must be a positive integer"),
    (dict(q_lora_rank=0), "model.q_lora_rank must be a positive integer, or null"),
    (dict(qk_rope_head_dim=7), "model.qk_rope_head_dim (7) must be even"),
    (dict(position_embedding="learned"), "set position_embedding to \"rope\""),
    (dict(rope_interleave="yes"), "model.rope_interleave must be true or false"),
    (dict(head_dim=32), "model.head_dim (32) is set"),
    (dict(num_key_value_heads=2), "model.num_key_value_heads (2) is set"),
    (dict(qk_layernorm=True), "model.qk_layernorm with model.attention_type \"mla\" is not built"),
    (dict(bias="qkv"), "model.bias 'qkv'"),
])
def test_invalid_mla_fields_name_the_field(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        overrides = dict(fields)
        if overrides.get("attention_type") == "mha":  # a plain attention given one of MLA's fields
            overrides.update(qk_nope_head_dim=None, qk_rope_head_dim=None, v_head_dim=None)
        mla_config(**overrides)


@pytest.mark.parametrize("split, message", [
    (dict(tensor_parallel_size=3), "model.num_attention_heads (4) is not divisible by parallelism."
                                   "tensor_parallel_size (3)"),
    (dict(context_parallel_size=2), "parallelism.context_parallel_size 2 with model.attention_type \"mla\" is not "
                                    "built"),
])
def test_the_split_refuses_what_mla_does_not_build(split, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mla_config().check_parallel(split.get("tensor_parallel_size", 1), 1,
                                    context_parallel_size=split.get("context_parallel_size", 1))


def test_generation_with_a_cache_and_hf_conversion_are_refused():
    from hf.tables import compatible_architectures, resolve_architecture

    assert [a.name for a in compatible_architectures(mla_config())] == ["DeepseekV3ForCausalLM"]  # test_hf_deepseek
    with pytest.raises(ValueError, match=re.escape("model.norm = 'layernorm', model.mlp = 'swiglu', model.bias = "
                                                   "'none') is no DeepseekV3ForCausalLM")):
        resolve_architecture(mla_config(norm="layernorm"))  # the one MLA architecture has RMSNorm


# ------------------------------------------------------------------------------------------------------ the KV cache


# Both query forms and both rope layouts, under YaRN (positions past its 8 original ones)
CACHE_CASES = {"q_lora, interleaved, yarn": dict(rope_scaling=YARN_MSCALE),
               "q_proj, rotate_half, yarn": dict(q_lora_rank=None, rope_interleave=False, rope_scaling=YARN_MSCALE)}
# The cached forward computes the uncached one's products, summed in another order (a matmul of 1 row is blocked
# otherwise than one of s; SDPA's kernel of one query over past + 1 keys is not its causal kernel over s): rounding
# alone, measured at most 1.5e-6 on logits up to 2.7 (6 ulps of the largest). 32 ulps of the largest logit leaves 5x
# headroom; a rope key at a wrong position moves them by 1e-2 and more (reported with the change).
ULPS = 32


def _tolerance(logits: torch.Tensor) -> float:
    return ULPS * torch.finfo(torch.float32).eps * logits.abs().max().item()


def _recorded_generation(model: GPT, config: ModelConfig, prompt: list[int], new_tokens: int,
                         use_cache: bool) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """Greedy tokens through evaluation/generation.py on one process; each step's window length and the logits of
    its last position (the vocabulary's, not the padding's)."""
    from evaluation.generation import Generator
    from evaluation.pipeline import Pipeline, Stage

    windows, logits = [], []

    def recording_model(inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = model(*inputs)
        windows.append(inputs[0].shape[1])
        logits.append(out[0, -1, :config.vocab_size])
        return out

    pipeline = Pipeline(Stage([recording_model], model, ParallelContext(), config))
    tokens = Generator(pipeline, end_of_text=None).generate(prompt, new_tokens, use_cache=use_cache)
    return tokens, windows, logits


@pytest.mark.parametrize("overrides", CACHE_CASES.values(), ids=CACHE_CASES.keys())
def test_greedy_generation_with_the_latent_cache_equals_without(overrides):
    """A 5-token prompt, 12 greedy tokens (positions to 16): the same tokens, each step's logits within ULPS."""
    config = mla_config(**overrides)
    model = GPT(config).eval()
    prompt = [3, 41, 59, 26, 53]
    cached, windows, cached_logits = _recorded_generation(model, config, prompt, 12, use_cache=True)
    plain, plain_windows, plain_logits = _recorded_generation(model, config, prompt, 12, use_cache=False)
    assert windows == [5] + [1] * 11 and plain_windows == list(range(5, 17))  # the cache's steps are one token
    errors = [_max_abs(ours, theirs) for ours, theirs in zip(cached_logits, plain_logits, strict=True)]
    tolerance = _tolerance(torch.stack(plain_logits))
    print(f"\n{overrides}: tokens {cached}; logits max abs {max(errors):.2e} (tolerance {tolerance:.2e})")
    assert cached == plain and len(set(cached)) > 3  # token for token, and not one token repeated
    assert max(errors) <= tolerance, errors


@pytest.mark.parametrize("overrides", CACHE_CASES.values(), ids=CACHE_CASES.keys())
def test_prefill_steps_and_an_extend_equal_the_whole_sequence(overrides):
    """Two sequences of 20 tokens: a prefill of 6, three single-token steps, then an extend of 11 (queries and keys
    under the bottom-right causal mask), against one forward over the 20 without a cache. The cache holds exactly
    the latent and the rope key of every token, r_kv + d_r values each, and leaves the model when done."""
    config = mla_config(**overrides)
    model = GPT(config).eval()
    tokens = torch.randint(0, config.vocab_size, (B, 20), generator=torch.Generator().manual_seed(14))
    positions = torch.arange(20).expand(B, 20)
    pieces = [slice(0, 6), slice(6, 7), slice(7, 8), slice(8, 9), slice(9, 20)]
    with torch.no_grad():
        expected = model(tokens, positions)[..., :config.vocab_size]
        with kv_caches(model) as caches:
            out = torch.cat([model(tokens[:, piece], positions[:, piece]) for piece in pieces], dim=1)
    assert _max_abs(out[..., :config.vocab_size], expected) <= _tolerance(expected)
    assert len(caches) == config.num_layers and all(isinstance(cache, LatentKVCache) for cache in caches)
    for cache in caches:
        assert cache.latent.shape == (B, 20, config.kv_lora_rank) and cache.rope_keys.shape == (B, 20, 8)
        assert sum(t.numel() for t in cache.tensors) == B * 20 * cache.values_per_token == B * 20 * (32 + 8)
    assert all(layer.attention.kv_cache is None for layer in model.layers)
    with kv_caches(model), pytest.raises(ValueError, match="document masks"):
        model(tokens, positions, torch.zeros_like(tokens))


def test_the_cache_at_tp_2_holds_the_whole_latent_and_gives_each_rank_its_heads():
    """TP 2 in one process (fake ranks, no group: every primitive is the identity): each rank's attention, built from
    the seed of the whole one, holds its half of the heads. Prefill 5, one step, extend 10: with the cache each rank
    computes what it does without (its partial sum of the output projection), the two ranks' caches hold the same
    whole latent, and the partial sums add up to the whole attention's output (fp32: 2 terms in another order)."""
    config = mla_config(rope_scaling=YARN_MSCALE)
    whole = MultiHeadLatentAttention(config, ParallelContext(), seed=9, layer_number=1, rng=RNGStream(0)).eval()
    x = _inputs(B, S, H, seed=15)
    partial_sums, latents = [], []
    with torch.no_grad():
        for rank in range(2):
            attention = MultiHeadLatentAttention(config, ParallelContext(tensor_parallel_size=2,
                                                                         tensor_parallel_rank=rank),
                                                 seed=9, layer_number=1, rng=RNGStream(0)).eval()
            with kv_caches(attention) as (cache,):
                out = torch.cat([attention(x[:, :5]), attention(x[:, 5:6]), attention(x[:, 6:])], dim=1)
            assert _max_abs(out, attention(x)) <= 1e-6
            partial_sums.append(out)
            latents.append(cache.latent)
        assert latents[0].shape == (B, S, config.kv_lora_rank) and torch.equal(latents[0], latents[1])
        assert _max_abs(partial_sums[0] + partial_sums[1], whole(x)) <= 1e-6


def test_the_latent_cache_holds_576_values_a_token_for_deepseek_v3_against_40960():
    """Per token and layer at TP 1, DeepSeek-V3's shape (128 heads, q/k 128 + 64, v 128, kv latent 512): MLA's cache
    holds r_kv + d_r = 576 values, a cache of keys and values for the same heads 128 x (192 + 128) = 40,960."""
    v3 = dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840)
    config = mla_config(**v3)
    with torch.device("meta"):
        attention = MultiHeadLatentAttention(config, ParallelContext(), seed=0, layer_number=1, rng=RNGStream(0))
    latent = attention.new_cache()
    plain = KVCache(attention.heads, config.head_dim, config.v_head_dim)
    ratio = plain.values_per_token / latent.values_per_token
    print(f"\nDeepSeek-V3, per token and layer: latent cache {latent.values_per_token:,} values, "
          f"{latent.bytes_per_token(torch.bfloat16):,} bytes in bf16; keys and values {plain.values_per_token:,} "
          f"values, {plain.bytes_per_token(torch.bfloat16):,} bytes ({ratio:.1f}x)")
    assert (latent.values_per_token, plain.values_per_token) == (576, 40_960)
    assert (latent.bytes_per_token(torch.bfloat16), plain.bytes_per_token(torch.bfloat16)) == (1_152, 81_920)
    assert latent.bytes_per_token(torch.float32) == 2_304


# ------------------------------------------------------------------------ counts, checkpoint layouts, the FLOPs


@pytest.mark.parametrize("overrides", [dict(), dict(q_lora_rank=None, bias="all")], ids=["q_lora", "q_proj, bias"])
def test_counts_and_layouts_follow_the_modules(overrides):
    """The analytic parameter count and FLOPs, the layer maps of checkpoint reading (hf/tables.py) and the universal
    checkpoint's patterns (model/checkpoint_files.py) against the modules themselves."""
    from deepspeed.checkpoint import constants as uc

    from hf.tables import layer_maps, shard_shape
    from model.checkpoint_files import universal_checkpoint_info
    from tests.test_llama_layers import _deepspeed_parameter_names

    config = mla_config(**overrides)
    with torch.device("meta"):
        whole = GPT(config)
        rank = TransformerLayer(config, ParallelContext(tensor_parallel_size=2, tensor_parallel_rank=1), 0, 1)
    assert sum(p.numel() for p in whole.parameters()) == analytic_total_parameters(config, 1)
    assert sum(p.numel() for p in rank.parameters()) == dense_block_parameters(config, 2)
    matrices = sum(p.numel() for p in whole.layers[0].parameters() if p.ndim == 2)
    core = 2 * S * HEADS * (config.head_dim + config.v_head_dim)  # q k^T and the weighted sum of v, per token
    assert layer_forward_flops_per_token(config) == 2 * matrices + core

    block_map = layer_maps(config)[2]
    assert [t.ours for t in block_map.tensors] == list(rank.state_dict())
    assert all(shard_shape(t, config, 2) == tuple(rank.state_dict()[t.ours].shape) for t in block_map.tensors)

    names = _deepspeed_parameter_names(config)
    info = universal_checkpoint_info(config)
    replicated = info[uc.TP_REPLICATED_PARAMETER_PATTERNS]
    assert all(any(re.match(p, n) for n in names) for p in replicated)  # the converter's strict mode
    latent = [n for n in names if re.match(r"2\.attention\.(q_a|kv_a)", n)]
    assert latent and all(any(re.match(p, n) for p in replicated) for n in latent)
    heads = [n for n in names if re.match(r"2\.attention\.(q_proj|q_b_proj|kv_b_proj)", n)]
    assert heads and not any(re.match(p, n) for p in replicated for n in heads)  # whole heads: concatenated
