"""The Llama-family pieces: each at TP 2 and TP 4 against the same piece unsharded, and against transformers.

Parity cases (as tests/test_parallel_layers.py): RMSNorm, grouped-query attention with RoPE (16 query heads in 4
key/value groups: 4 query heads per group, so TP 4 holds one group per rank), the SwiGLU MLP, a whole Llama block,
and the untied output head with its padded vocabulary. Each rank returns named tensors with their sharding:
"replicated", a dimension, or ("stacked", n) for a weight that stacks rank r's slice of n sub-matrices (SwiGLU's
gate_up: [gate rows r; up rows r]). The test reassembles the full tensor and compares it with the unsharded layer.

Exact comparisons (torch.equal), and why they are exact:
- initial weights: each index along the sharded dimension draws from its own generator (model/init.py), the
  stacked gate_up included (its rows are indexed in the full [gate; up]);
- RMSNorm: no communication and no matmul, the same operations on the same values;
- replicated results agree bitwise across ranks: gloo's all-reduce hands every rank the same sum.
Tolerant comparisons (rtol 1e-5, atol 1e-6 in fp32), and why:
- results of an all-reduce (row-parallel outputs, the input gradients of column-parallel layers, the loss): R
  partial sums are added in another order than one long sum, which changes the last bits of an fp32 result;
- column-parallel outputs and weight gradients: BLAS may block a matmul differently for N/R rows than for N.

Against transformers (single process): the RoPE frequencies (plain and llama3-scaled) and the rotation are bitwise
transformers', RMSNorm is bitwise LlamaRMSNorm, and a tiny Llama built by gpt.py gives the logits of
LlamaForCausalLM holding the same weights (the fused grouped QKV and gate_up split back into HF's matrices).
"""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import SelfAttention
from model.config import ModelConfig, ParallelConfig, preset
from model.gpt import GPT, OutputHead, SwiGLUMLP, TransformerLayer
from model.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    rope_attention_scaling,
    rope_cos_sin,
    rope_inverse_frequencies,
    vocab_parallel_cross_entropy,
)
from model.parallel import ParallelContext, build_parallel_context
from model.random import RNGStream
from tests.distributed import run_distributed

B, S = 2, 6
VOCAB = 100
REPLICATED = "replicated"
# YaRN as Qwen2.5 ships it for 128k (factor 4 over 32k), and with DeepSeek's mscale pair (attention factor != 1)
YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
YARN_MSCALE = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 1024, "beta_fast": 16,
               "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def layer_config(**overrides) -> ModelConfig:
    """16 query heads of 4 in 4 key/value groups (4 per group), RoPE, RMSNorm, SwiGLU, untied, Qwen2's QKV bias
    (so a bias gradient is compared too); every size divides by TP 4."""
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=16, num_key_value_heads=4, seq_length=S,
                  ffn_hidden_size=96, vocab_size=VOCAB, make_vocab_size_divisible_by=8, position_embedding="rope",
                  norm="rmsnorm", mlp="swiglu", tie_word_embeddings=False, bias="qkv")
    return ModelConfig(**{**fields, **overrides})


def _inputs(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rng() -> RNGStream:
    return RNGStream(0)


def _rms_norm(ctx: ParallelContext) -> dict:
    config = layer_config()
    norm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * _inputs(config.hidden_size, seed=1))  # a non-trivial weight
    x = _inputs(B, S, config.hidden_size, seed=2).requires_grad_()
    out = norm(x)
    (out * _inputs(B, S, config.hidden_size, seed=3)).sum().backward()
    return {"out": (out.detach(), REPLICATED, "exact"), "grad_x": (x.grad, REPLICATED, "exact"),
            "grad_weight": (norm.weight.grad, REPLICATED, "exact")}


def _attention(ctx: ParallelContext) -> dict:
    config = layer_config(rope_scaling=LLAMA3_SCALING)
    attention = SelfAttention(config, ctx, seed=5, layer_number=1, rng=_rng())
    with torch.no_grad():
        attention.qkv.bias.copy_(_inputs(config.qkv_size, seed=4).chunk(ctx.tensor_parallel_size)[
            ctx.tensor_parallel_rank])  # a non-zero bias, sliced as its rows
    x = _inputs(B, S, config.hidden_size, seed=6).requires_grad_()
    out = attention(x)
    (out * _inputs(B, S, config.hidden_size, seed=7)).sum().backward()
    return {"qkv_weight": (attention.qkv.weight.detach(), 0, "exact"),
            "dense_weight": (attention.dense.weight.detach(), 1, "exact"),
            "out": (out.detach(), REPLICATED, "close"), "grad_x": (x.grad, REPLICATED, "close"),
            "grad_qkv_weight": (attention.qkv.weight.grad, 0, "close"),
            "grad_qkv_bias": (attention.qkv.bias.grad, 0, "close"),
            "grad_dense_weight": (attention.dense.weight.grad, 1, "close")}


def _swiglu(ctx: ParallelContext) -> dict:
    config = layer_config()
    mlp = SwiGLUMLP(config, ctx, seed=8, layer_number=1)
    x = _inputs(B, S, config.hidden_size, seed=9).requires_grad_()
    out = mlp(x)
    (out * _inputs(B, S, config.hidden_size, seed=10)).sum().backward()
    stacked = ("stacked", 2)
    return {"gate_up_weight": (mlp.gate_up.weight.detach(), stacked, "exact"),
            "down_weight": (mlp.down.weight.detach(), 1, "exact"),
            "out": (out.detach(), REPLICATED, "close"), "grad_x": (x.grad, REPLICATED, "close"),
            "grad_gate_up_weight": (mlp.gate_up.weight.grad, stacked, "close"),
            "grad_down_weight": (mlp.down.weight.grad, 1, "close")}


def _block(ctx: ParallelContext) -> dict:
    config = layer_config(bias="none")
    block = TransformerLayer(config, ctx, seed=11, layer_number=2, rng=_rng())
    x = _inputs(B, S, config.hidden_size, seed=12).requires_grad_()
    out = block(x)
    (out * _inputs(B, S, config.hidden_size, seed=13)).sum().backward()
    return {"out": (out.detach(), REPLICATED, "close"), "grad_x": (x.grad, REPLICATED, "close"),
            "grad_ln1": (block.ln1.weight.grad, REPLICATED, "close"),
            "grad_qkv_weight": (block.attention.qkv.weight.grad, 0, "close"),
            "grad_gate_up_weight": (block.mlp.gate_up.weight.grad, ("stacked", 2), "close")}


def _head(ctx: ParallelContext) -> dict:
    """The untied head through the vocab-parallel loss (labels real ids). The padding grows with TP (8 x TP rows),
    so only the real vocabulary is compared; the padded logits are -inf and their rows get no gradient."""
    config = layer_config()
    head = OutputHead(config, ctx, seed=14)
    hidden = _inputs(B, S, config.hidden_size, seed=15).requires_grad_()
    logits = head(hidden)  # (b, s, V/R)
    labels = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(16))
    vocab_start = ctx.tensor_parallel_rank * logits.shape[-1]
    loss = vocab_parallel_cross_entropy(logits, labels, ctx.tensor_parallel_group, vocab_start)
    (loss * _inputs(B, S, seed=17)).sum().backward()
    return {"weight": (head.weight.detach(), 0, "exact"), "logits": (logits.detach(), -1, "close"),
            "loss": (loss.detach(), REPLICATED, "close"), "grad_hidden": (hidden.grad, REPLICATED, "close"),
            "grad_weight": (head.weight.grad, 0, "close")}


CASES = {"rms_norm": _rms_norm, "attention": _attention, "swiglu": _swiglu, "block": _block, "head": _head}
VOCAB_SIZED = {("head", "weight"): 0, ("head", "logits"): -1, ("head", "grad_weight"): 0}


def _all_cases(tensor_parallel_size: int) -> dict:
    ctx = build_parallel_context(ParallelConfig(tensor_parallel_size=tensor_parallel_size))
    return {name: case(ctx) for name, case in CASES.items()}


def assemble(shards: list[torch.Tensor], sharding) -> torch.Tensor:
    """The full tensor from the TP shards: replicated (all equal: the first), a dimension, or ("stacked", n)."""
    if sharding == REPLICATED:
        for other in shards[1:]:
            assert torch.equal(shards[0], other), "a replicated tensor differs across TP ranks"
        return shards[0]
    if isinstance(sharding, tuple):  # rank r holds [A_1 rows r; ...; A_n rows r]
        n = sharding[1]
        pieces = [shard.chunk(n, dim=0) for shard in shards]
        return torch.cat([torch.cat([p[i] for p in pieces], dim=0) for i in range(n)], dim=0)
    return torch.cat(shards, dim=sharding)


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: {k: v[0] for k, v in case(ParallelContext()).items()} for name, case in CASES.items()}


def test_stacked_shards_assemble_to_gate_then_up():
    """Slicing logic with arange weights: rank r's gate_up rows are gate rows r then up rows r."""
    full = torch.arange(8 * 3).view(8, 3)  # [gate (4 rows); up (4 rows)]
    shards = [torch.cat([full[r * 2:(r + 1) * 2], full[4 + r * 2:4 + (r + 1) * 2]]) for r in range(2)]
    assert torch.equal(assemble(shards, ("stacked", 2)), full)


@pytest.mark.distributed
@pytest.mark.parametrize("tensor_parallel_size", [2, 4])
def test_llama_layers_match_unsharded(tensor_parallel_size, references):
    per_rank = run_distributed(tensor_parallel_size, _all_cases, tensor_parallel_size)
    for case in CASES:
        for name, (_, sharding, comparison) in per_rank[0][case].items():
            where = f"{case}.{name} at TP {tensor_parallel_size}"
            assembled = assemble([rank_result[case][name][0] for rank_result in per_rank], sharding)
            expected = references[case][name]
            if (case, name) in VOCAB_SIZED:
                dim = VOCAB_SIZED[case, name]
                if name == "logits":
                    assert torch.all(assembled.narrow(dim, VOCAB, assembled.shape[dim] - VOCAB) == float("-inf"))
                assembled, expected = assembled.narrow(dim, 0, VOCAB), expected.narrow(dim, 0, VOCAB)
            if comparison == "exact":
                assert torch.equal(assembled, expected), where
            else:
                torch.testing.assert_close(assembled, expected, rtol=1e-5, atol=1e-6, msg=where)


def _hf_llama_config(config: ModelConfig, family: str = "llama"):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    rope = {"rope_theta": config.rope_theta, **(config.rope_scaling or {})}
    return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
               num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
               num_key_value_heads=config.num_key_value_heads, rms_norm_eps=config.layernorm_epsilon,
               max_position_embeddings=16384, tie_word_embeddings=config.tie_word_embeddings,
               rope_parameters={**rope, "rope_type": rope.get("rope_type", "default")})


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING, YARN_SCALING, YARN_MSCALE])
def test_rope_frequencies_are_transformers(scaling):
    """head_dim 16, theta 5e5: wavelengths 6 .. 6e5 tokens, so the llama3 rule keeps the 4 shortest, interpolates
    the 5th (4461, between 8192 / 4 and 8192) and divides the 3 longest by 8. YaRN: the frequencies and the attention
    factor on cos and sin bitwise transformers' (1 + 0.1 ln 4, or the mscale ratio)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = layer_config(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
                          rope_scaling=scaling)
    hf_config = _hf_llama_config(config)
    if scaling is None:
        expected, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config)
    ours = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    assert ours.dtype == torch.float32 and torch.equal(ours, expected)
    assert rope_attention_scaling(config.rope_scaling) == factor
    if scaling is not None and scaling["rope_type"] == "yarn":
        plain = rope_inverse_frequencies(config.head_dim, config.rope_theta)
        assert factor > 1 and not torch.equal(ours, plain)
        # the fastest dimension kept, the slowest interpolated (1 / (factor p): not bitwise (1 / p) / factor)
        assert torch.equal(ours[0], plain[0]) and math.isclose(ours[-1], plain[-1] / scaling["factor"], rel_tol=1e-6)
    if scaling is LLAMA3_SCALING:
        plain = rope_inverse_frequencies(config.head_dim, config.rope_theta)
        wavelengths = 2 * math.pi / plain
        assert torch.equal(ours[wavelengths < 2048], plain[wavelengths < 2048])
        assert torch.equal(ours[wavelengths > 8192], plain[wavelengths > 8192] / 8)
        assert ((wavelengths >= 2048) & (wavelengths <= 8192)).sum() == 1


@pytest.mark.parametrize(("dtype", "scaling"), [(torch.float32, LLAMA3_SCALING), (torch.bfloat16, LLAMA3_SCALING),
                                               (torch.float32, YARN_MSCALE), (torch.bfloat16, YARN_SCALING)])
def test_rope_rotation_and_rms_norm_are_transformers(dtype, scaling):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = layer_config(rope_scaling=scaling)
    hf_config = _hf_llama_config(config)
    q = _inputs(B, config.num_attention_heads, S, config.head_dim, seed=20).to(dtype)
    k = _inputs(B, config.num_key_value_heads, S, config.head_dim, seed=21).to(dtype)
    cos, sin = LlamaRotaryEmbedding(hf_config)(q, torch.arange(S).expand(B, S))  # (b, s, d)
    ours_cos, ours_sin = rope_cos_sin(rope_inverse_frequencies(config.head_dim, config.rope_theta, scaling),
                                      S, dtype, q.device, scale=rope_attention_scaling(scaling))
    assert torch.equal(ours_cos, cos[0]) and torch.equal(ours_sin, sin[0])
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours_q, ours_k = RotaryEmbedding(config.head_dim, config.rope_theta, scaling)(q, k)
    assert torch.equal(ours_q, expected_q) and torch.equal(ours_k, expected_k)
    assert torch.equal(apply_rope(q, ours_cos, ours_sin), expected_q)

    norm, hf_norm = RMSNorm(config.hidden_size, 1e-6).to(dtype), LlamaRMSNorm(config.hidden_size, 1e-6).to(dtype)
    with torch.no_grad():
        weight = 1.0 + 0.1 * _inputs(config.hidden_size, seed=22)
        norm.weight.copy_(weight)
        hf_norm.weight.copy_(weight)
    x = (_inputs(B, S, config.hidden_size, seed=23) * 3).to(dtype)
    assert torch.equal(norm(x), hf_norm(x))


def to_hf_state_dict(model: GPT, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our unsharded Llama as transformers' tensors: the grouped QKV split into q, k, v; gate_up into gate, up."""
    groups, per_group, d, h = (config.num_key_value_heads, config.queries_per_key_value_head, config.head_dim,
                               config.hidden_size)
    vocab = config.vocab_size
    state = {"model.embed_tokens.weight": model.word_embeddings.weight[:vocab],
             "model.norm.weight": model.final_norm.weight, "lm_head.weight": model.output_head.weight[:vocab]}
    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}."
        qkv = layer.attention.qkv.weight.view(groups, per_group + 2, d, h)  # [g, q + 2, d, h]: q heads, k, v
        state[prefix + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, h)
        state[prefix + "self_attn.k_proj.weight"] = qkv[:, per_group].reshape(-1, h)
        state[prefix + "self_attn.v_proj.weight"] = qkv[:, per_group + 1].reshape(-1, h)
        if layer.attention.qkv.bias is not None:
            bias = layer.attention.qkv.bias.view(groups, per_group + 2, d)
            state[prefix + "self_attn.q_proj.bias"] = bias[:, :per_group].reshape(-1)
            state[prefix + "self_attn.k_proj.bias"] = bias[:, per_group].reshape(-1)
            state[prefix + "self_attn.v_proj.bias"] = bias[:, per_group + 1].reshape(-1)
        state[prefix + "self_attn.o_proj.weight"] = layer.attention.dense.weight
        gate, up = layer.mlp.gate_up.weight.chunk(2, dim=0)
        state[prefix + "mlp.gate_proj.weight"], state[prefix + "mlp.up_proj.weight"] = gate, up
        state[prefix + "mlp.down_proj.weight"] = layer.mlp.down.weight
        state[prefix + "input_layernorm.weight"] = layer.ln1.weight
        state[prefix + "post_attention_layernorm.weight"] = layer.ln2.weight
    return {name: tensor.detach().clone() for name, tensor in state.items()}


@pytest.mark.parametrize("family, overrides", [
    ("llama", dict(bias="none", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)),  # Llama 3.1: GQA, scaled RoPE
    ("qwen2", dict(bias="qkv", rope_theta=1e6, layernorm_epsilon=1e-6)),  # Qwen2: biases on q, k and v
    ("qwen2", dict(bias="qkv", rope_theta=1e6, rope_scaling=YARN_SCALING)),  # Qwen2.5's long-context YaRN
])
def test_tiny_llama_gives_the_logits_of_transformers(family, overrides):
    """llama-tiny's shape (8 query heads in 2 groups of 4, head_dim 16): the layouts of the fused QKV (per group)
    and gate_up ([gate; up]) and the RoPE convention are transformers', so the split-back weights give its logits.
    Norm weights and QKV biases are randomised so that a misplaced one would show."""
    from transformers import AutoModelForCausalLM

    config = preset("llama-tiny", num_layers=2, vocab_size=VOCAB, seq_length=S, **overrides)
    model = GPT(config, seed=3).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                parameter.copy_(1.0 + 0.1 * _inputs(*parameter.shape, seed=len(name)) if "ln" in name or
                                "norm" in name else 0.1 * _inputs(*parameter.shape, seed=len(name)))
    hf_model = AutoModelForCausalLM.from_config(_hf_llama_config(config, family)).eval()
    missing, unexpected = hf_model.load_state_dict(to_hf_state_dict(model, config), strict=False)
    assert not missing and not unexpected
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(24))
    with torch.no_grad():
        ours = model(tokens, torch.arange(S).expand(B, S))
        expected = hf_model(tokens).logits
    assert torch.all(ours[..., VOCAB:] == float("-inf"))
    torch.testing.assert_close(ours[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)


# The whole Llama-shaped model through the real pipeline engine (TP x PP x DP) against one plain-PyTorch process:
# tests/test_model_parallel.py's recipe (ZeRO-1, AdamW, weight decay on matrices, clipping at 1.0) and batches.
LLAMA_MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=2, ffn_hidden_size=128,
                   seq_length=16, rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)


def llama_model_config(**overrides) -> ModelConfig:
    return preset("llama-tiny", **{**LLAMA_MODEL, **overrides})


def _train_llama_pipeline(tensor_parallel_size: int, pipeline_parallel_size: int, checkpointing: bool) -> dict:
    from tests.test_model_parallel import SEED, STEPS, deepspeed_config, micro_batches
    from training.engine import build_engine

    config = llama_model_config(recompute="full" if checkpointing else "none")
    parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size)
    engine, ctx = build_engine(config, parallel, deepspeed_config("fp32"), SEED)
    losses, norms = [], []
    for step in range(STEPS):
        data = micro_batches(step, config.seq_length, ctx.data_parallel_rank, ctx.data_parallel_size)
        losses.append(engine.train_batch(data_iter=data).item())
        norms.append(float(engine.get_global_grad_norm()))
    return {"losses": losses, "norms": norms}


def train_llama_reference() -> dict:
    from tests.test_model_parallel import train_reference

    return train_reference(llama_model_config())


@pytest.fixture(scope="module")
def llama_reference() -> dict:
    reference = train_llama_reference()
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # it learns
    assert reference["norms"][0] > 1.0  # and the first steps are clipped, so clipping is under test
    return reference


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp, dp, checkpointing", [
    (1, 2, 1, True),  # the untied head on the last stage, activation checkpointing
    (2, 2, 2, False),  # 8 processes: the full 3D split
])
def test_llama_fp32_split_equals_unsplit(tp, pp, dp, checkpointing, llama_reference):
    ranks = run_distributed(tp * pp * dp, _train_llama_pipeline, tp, pp, checkpointing)
    for result in ranks:
        torch.testing.assert_close(result["losses"], llama_reference["losses"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["norms"], llama_reference["norms"], rtol=1e-5, atol=1e-5)


def _deepspeed_parameter_names(config: ModelConfig) -> list[str]:
    """The names DeepSpeed's pipeline checkpoints give this model's parameters: layer index, then module path (the
    tied embedding once, as tied_modules.word_embeddings.weight)."""
    from model.gpt import gpt_layer_specs

    names = []
    for index, spec in enumerate(gpt_layer_specs(config, ParallelContext(), seed=0)):
        with torch.device("meta"):
            module = spec.build()
        key = getattr(spec, "key", None)
        if key is not None:
            if f"tied_modules.{key}.weight" not in names:
                names.append(f"tied_modules.{key}.weight")
            continue
        names += [f"{index}.{name}" for name, _ in module.named_parameters()]
    return names


@pytest.mark.parametrize("name, overrides", [("tiny", {}), ("llama-tiny", {}), ("qwen2.5-7b", dict(num_layers=2)),
                                             ("llama-tiny", dict(bias="all", norm="layernorm")),
                                             ("qwen3-0.6b", dict(num_layers=2)), ("tiny", dict(qk_layernorm=True)),
                                             ("tiny", dict(mtp={"depth": 1})), ("llama-tiny", dict(mtp={"depth": 2}))])
def test_universal_checkpoint_patterns_cover_the_model(name, overrides):
    """Every pattern of universal_checkpoint_info matches a parameter (DeepSpeed's strict mode asserts it), no name
    matches two patterns of a category, and each kind of tensor is merged the way its layout needs."""
    import re

    from deepspeed.checkpoint import constants as uc

    from model.checkpoint_files import universal_checkpoint_info

    config = preset(name, **overrides)
    names = _deepspeed_parameter_names(config)
    info = universal_checkpoint_info(config)
    categories = [uc.VOCABULARY_PARAMETER_PATTERNS, uc.TP_REPLICATED_PARAMETER_PATTERNS,
                  uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, uc.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0]
    for category in categories:
        for pattern in info.get(category, []):
            assert any(re.match(pattern, n) for n in names), f"{category}: {pattern} matches nothing"
        for n in names:
            assert sum(bool(re.match(p, n)) for p in info.get(category, [])) <= 1, n

    def kind(parameter: str) -> str | None:
        found = [c for c in categories if any(re.match(p, parameter) for p in info.get(c, []))]
        return found[0] if found else None  # None: concatenated on dim 0 (column-parallel)

    last = config.num_layers + 3
    assert kind("2.attention.qkv.weight") is None  # whole KV groups per rank: a plain dim-0 concatenation
    assert kind("2.attention.dense.weight") == uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS
    assert kind("2.ln1.weight") == kind(f"{config.num_layers + 2}.weight") == uc.TP_REPLICATED_PARAMETER_PATTERNS
    if config.qk_layernorm:  # the per-head norms are replicated: resliced as they are, never concatenated
        assert kind("2.attention.q_norm.weight") == kind("2.attention.k_norm.weight") == uc.TP_REPLICATED_PARAMETER_PATTERNS
    if config.mlp == "swiglu":
        assert kind("2.mlp.gate_up.weight") == uc.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0
        assert kind("2.mlp.down.weight") == uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS
    if not config.tie_word_embeddings and config.mtp is None:
        assert kind("0.weight") == kind(f"{last}.weight") == uc.VOCABULARY_PARAMETER_PATTERNS
        assert f"{last}.weight" in names and info[uc.PIPELINE_REPLICATED_PARAMETER_PATTERNS] == []
    if config.mtp is not None:  # model/mtp.py's layer L + 5: a block per depth and its replicated pieces
        depth = f"{config.num_layers + 5}.depths.{config.mtp.depth - 1}"
        for replicated in ("enorm", "hnorm", "final_norm", "eh_proj", "block.ln1", "block.ln2"):
            assert kind(f"{depth}.{replicated}.weight") == uc.TP_REPLICATED_PARAMETER_PATTERNS, replicated
        assert kind(f"{depth}.block.attention.dense.weight") == uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS
        assert kind(f"{depth}.block.attention.qkv.weight") is None
        heads = ["tied_modules.word_embeddings.weight"] + ([] if config.tie_word_embeddings
                                                           else ["tied_modules.output_head.weight"])
        assert [kind(head) for head in heads] == [uc.VOCABULARY_PARAMETER_PATTERNS] * len(heads)
        assert info[uc.PIPELINE_REPLICATED_PARAMETER_PATTERNS] == [r"tied_modules\.word_embeddings\.weight$"]


@pytest.mark.parametrize("scaling", [LLAMA3_SCALING, YARN_MSCALE])
def test_rope_scaling_goes_out_to_hugging_face_and_back(tmp_path, scaling):
    """The HF config written for a scaled model holds the scaling transformers reads (its RoPE gives ours), and
    reading that config.json back gives the same model fields."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hf.config_map import hf_config, model_fields_from_hf, read_hf_config

    config = preset("llama-tiny", num_layers=2, rope_theta=1e6, rope_scaling=scaling)
    (tmp_path / "config.json").write_text(hf_config(config, torch.float32, end_of_text_id=2).to_json_string())
    back = read_hf_config(tmp_path)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](back)
    assert torch.equal(inv_freq, rope_inverse_frequencies(config.head_dim, 1e6, scaling))
    assert factor == rope_attention_scaling(scaling)
    fields = model_fields_from_hf(back)
    assert fields["rope_scaling"] == scaling and fields["rope_theta"] == 1e6
