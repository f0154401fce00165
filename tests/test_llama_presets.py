"""The Llama-family presets have exactly the parameters of the transformers model of the same published config.

Both sides are built on the meta device (nothing allocated): ours through model/summary.py's count of the pipeline
stages at TP 1, PP 1 (the same LayerSpecs a run builds) and its closed form; transformers' through
AutoModelForCausalLM.from_config. Our embedding is padded to a multiple of make_vocab_size_divisible_by x TP; the
published count is the unpadded one, so ours is taken with make_vocab_size_divisible_by=1 (at TP 1: no padding).

The Mixture-of-Experts presets (model.moe) are counted from the config (model/summary.py also builds their stages,
tests/test_model_config.py): the total against transformers' Mixtral, Qwen2-MoE and Qwen3-MoE models, and the active count
(what one token uses) against transformers' total less the unused experts' share of its expert tensors.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from model.config import ModelConfig, MoEConfig, preset
from model.summary import (
    analytic_active_parameters,
    analytic_total_parameters,
    count_stages,
    tokenizer_vocabulary_active,
    tokenizer_vocabulary_total,
    total_from_stages,
)

# The published totals, for the two best-known shapes (LLaMA-2-7B "6.74B", Llama-3-8B "8.03B").
PUBLISHED = {"llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496}
HEAD_DIM_APART = {"qwen3-0.6b"}  # head_dim is not hidden_size / heads: transformers must be told


def hf_config(name: str, config: ModelConfig):
    """The transformers config of the same numbers (the class of the family each preset comes from)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"mistral-7b": MistralConfig, "qwen2.5-7b": Qwen2Config, "qwen3-0.6b": Qwen3Config}.get(name, LlamaConfig)
    kwargs = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                  intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
                  num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                  max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
                  rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings)
    if name in HEAD_DIM_APART:
        kwargs["head_dim"] = config.head_dim
    return cls(**kwargs)


def hf_parameter_count(name: str, config: ModelConfig) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(name, config))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["llama2-7b", "llama3-8b", "llama3-70b", "mistral-7b", "qwen2.5-7b", "qwen3-0.6b"])
def test_preset_has_the_parameters_of_transformers(name):
    config = preset(name, make_vocab_size_divisible_by=1)  # the tokenizer's vocabulary, unpadded
    counts = count_stages(config, tensor_parallel_size=1, pipeline_parallel_size=1)
    ours = total_from_stages(counts, config, 1)
    assert ours == analytic_total_parameters(config, 1) == counts[0].analytic_per_tp_rank
    assert ours == hf_parameter_count(name, config), name
    if name in PUBLISHED:
        assert ours == PUBLISHED[name]


@pytest.mark.parametrize("name, tp, pp", [("llama3-8b", 4, 2), ("llama3-70b", 8, 8), ("llama2-7b", 2, 2),
                                          ("mistral-7b", 4, 1), ("qwen2.5-7b", 2, 7)])
def test_summary_prints_the_count_transformers_reports(capsys, name, tp, pp):
    """python -m model.summary at a TP x PP that pads the vocabulary prints the unpadded total beside the padded one
    (Llama-3-8B at TP 4: 128,256 rows padded to 128,512, so 8,032,358,400 built, 8,030,261,248 published)."""
    from model.summary import main

    assert main(["--preset", name, "--tp", str(tp), "--pp", str(pp)]) == 0
    out = capsys.readouterr().out
    expected = hf_parameter_count(name, preset(name, make_vocab_size_divisible_by=1))
    vocab = preset(name).vocab_size
    assert f"total with the tokenizer's vocabulary ({vocab:,}; what transformers reports): {expected:,}\n" in out
    assert "12 l h^2" not in out and "l (2 h^2 + 2 h g d + 3 h f)" in out  # the Llama form of the block count
    if name == "llama3-8b":
        assert "vocabulary padded to 128,512 for TP 4" in out and ": 8,032,358,400 from the modules" in out


def test_llama3_8b_preset_is_the_published_shape():
    config = preset("llama3-8b")
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        32, 4096, 32, 8)
    assert (config.ffn_hidden_size, config.vocab_size, config.rope_theta, config.layernorm_epsilon) == (
        14336, 128256, 500000.0, 1e-5)
    assert (config.position_embedding, config.norm, config.mlp, config.bias) == ("rope", "rmsnorm", "swiglu", "none")
    assert not config.tie_word_embeddings and config.qkv_size == (32 + 2 * 8) * 128
    config.check_parallel(8, 4)


def test_padded_vocabulary_is_counted_at_every_split():
    """The same preset at TP 8 x PP 4: the stages' modules equal the closed form; both hold the padded vocabulary
    twice (input embedding on the first stage, untied head on the last), 129024 rows at TP 8."""
    config = preset("llama3-8b")
    counts = count_stages(config, tensor_parallel_size=8, pipeline_parallel_size=4)
    assert all(c.parameters_per_tp_rank == c.analytic_per_tp_rank for c in counts)
    assert counts[0].layers == ["WordEmbedding", "EmbeddingDropout"] + ["TransformerLayer"] * 8
    assert counts[-1].layers == ["TransformerLayer"] * 8 + ["FinalRMSNorm", "OutputHead"]
    padded = config.padded_vocab_size(8)
    assert padded == 129024
    total = total_from_stages(counts, config, 8)
    assert total == analytic_total_parameters(config, 8) == PUBLISHED["llama3-8b"] + 2 * (padded - 128256) * 4096


def test_llama_tiny_preset_fits_the_cpu_splits():
    config = preset("llama-tiny")
    assert config.queries_per_key_value_head == 4 and config.num_key_value_heads == 2
    for tensor_parallel_size, pipeline_parallel_size in ((1, 1), (2, 1), (1, 2), (2, 2)):
        config.check_parallel(tensor_parallel_size, pipeline_parallel_size)


def test_hugging_face_conversion_maps_the_presets_and_refuses_a_mixed_shape():
    from hf.tables import layer_maps, resolve_architecture

    assert len(layer_maps(preset("tiny"))) == 4 + 3  # embeddings, blocks, final norm
    assert len(layer_maps(preset("llama-tiny"))) == 4 + 4  # embedding, empty positions, blocks, norm, untied head
    with pytest.raises(ValueError, match="is no Hugging Face architecture"):
        resolve_architecture(preset("llama-tiny", norm="layernorm"))  # rope with LayerNorm: neither GPT-2 nor Llama


def test_planner_plans_llama3_70b_on_64_h100_nodes():
    """tools/plan.py on a Llama shape: the FLOPs are the real block's, the untied head has no tied-embedding
    all-reduce, and the plan fits (TP 8 x PP 8 x DP 8, full recomputation, micro-batch 1)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from model.flops import flops_per_iteration
    from runconfig.run import load_run_config

    sets = ['model.preset="llama3-70b"', "parallelism.tensor_parallel_size=8", "parallelism.pipeline_parallel_size=8",
            "train_micro_batch_size_per_gpu=1", "train_batch_size=1024", "schedule.batch={}",
            "model.recompute=\"full\""]
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "tools/plan.py", "--ds_config", "ds_configs/1.3b.json", "--nodes", "64", "--gpu",
               "h100-80gb", "--json"]
    for item in sets:
        command += ["--set", item]
    plan = json.loads(subprocess.run(command, cwd=root, capture_output=True, text=True, check=True).stdout)["plans"][0]
    assert (plan["gpus"], plan["data_parallel_size"], plan["errors"]) == (512, 8, [])
    config = load_run_config(root / "ds_configs/1.3b.json", sets)
    assert plan["full_batch"]["flops"] == pytest.approx(flops_per_iteration(config.model, 1024, 8), rel=1e-12)
    assert plan["full_batch"]["tied_embedding_reduce"] == 0.0


# ------------------------------------------------------------------------------------------------ Mixture-of-Experts


def hf_moe_config(family: str, config: ModelConfig):
    """transformers' config of the same numbers: Mixtral (every block sparse, no shared expert), Qwen2-MoE (QKV bias,
    a shared expert with its sigmoid gate), Qwen3-MoE (q and k norms, a free head_dim); both Qwens with dense blocks
    where model.moe says (decoder_sparse_step = sparse_every, mlp_only_layers = the first_dense_layers)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    moe = config.moe
    if family == "deepseek_v3":
        return hf_deepseek_v3_config(config)
    common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                  num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                  max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
                  tie_word_embeddings=config.tie_word_embeddings, num_experts_per_tok=moe.top_k)
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=moe.moe_ffn_hidden_size, num_local_experts=moe.num_experts)
    sparsity = dict(num_experts=moe.num_experts, moe_intermediate_size=moe.moe_ffn_hidden_size,
                    intermediate_size=config.ffn_hidden_size, decoder_sparse_step=moe.sparse_every,
                    mlp_only_layers=list(range(moe.first_dense_layers)), norm_topk_prob=moe.norm_topk_prob)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**common, **sparsity, shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size)
    return Qwen3MoeConfig(**common, **sparsity, head_dim=config.head_dim)


def hf_deepseek_v3_config(config: ModelConfig):
    """transformers' DeepseekV3Config of the same numbers: MLA (q_lora_rank null gives its q_proj), the first
    first_k_dense_replace blocks dense, n_shared_experts shared experts of moe_intermediate_size as one SwiGLU of
    their sum (ours: shared_expert_ffn_hidden_size, no gate), the router's groups. No multi-token prediction layer
    is built by DeepseekV3ForCausalLM, whatever num_nextn_predict_layers says."""
    from transformers import DeepseekV3Config

    moe = config.moe
    assert moe.shared_expert_ffn_hidden_size % moe.moe_ffn_hidden_size == 0 and not moe.shared_expert_gate
    assert moe.sparse_every == 1  # DeepSeek's blocks are sparse from first_k_dense_replace on
    return DeepseekV3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        moe_intermediate_size=moe.moe_ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        n_shared_experts=moe.shared_expert_ffn_hidden_size // moe.moe_ffn_hidden_size, n_routed_experts=moe.num_experts,
        routed_scaling_factor=moe.routed_scaling_factor, kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        qk_nope_head_dim=config.qk_nope_head_dim, n_group=moe.n_group, topk_group=moe.topk_group,
        num_experts_per_tok=moe.top_k, first_k_dense_replace=moe.first_dense_layers,
        norm_topk_prob=moe.norm_topk_prob, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layernorm_epsilon, tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.bias == "all")


def hf_moe_counts(family: str, config: ModelConfig) -> tuple[int, int]:
    """transformers' (total, active): active = total less (E - k) / E of every sparse block's expert tensors."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_moe_config(family, config))
    total = sum(p.numel() for p in model.parameters())
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert len(experts) == sum(config.moe.is_sparse(n) for n in range(1, config.num_layers + 1))
    moe = config.moe
    unused = sum(p.numel() for m in experts for p in m.parameters()) * (moe.num_experts - moe.top_k) // moe.num_experts
    return total, total - unused


def random_moe_config(family: str, seed: int) -> ModelConfig:
    """A tiny model of ``family``'s shape, unpadded vocabulary, its sizes drawn from ``seed``."""
    draw = random.Random(f"{family}-{seed}")
    heads = draw.choice([2, 4, 8])
    experts = draw.choice([2, 4, 6, 8])
    qwen = family != "mixtral"
    moe = MoEConfig(num_experts=experts, top_k=draw.randint(1, experts), moe_ffn_hidden_size=draw.choice([8, 12, 16]),
                    shared_expert_ffn_hidden_size=draw.choice([8, 24]) if family == "qwen2_moe" else 0,
                    sparse_every=draw.choice([1, 2]) if qwen else 1,
                    first_dense_layers=draw.choice([0, 1]) if qwen else 0)
    key_value_heads = draw.choice([k for k in (1, 2, heads) if heads % k == 0])
    return ModelConfig(num_layers=draw.randint(1, 4), hidden_size=8 * heads * draw.choice([1, 2]),
                       num_attention_heads=heads, num_key_value_heads=key_value_heads,
                       head_dim=draw.choice([4, 8, 16]) if family == "qwen3_moe" else None,
                       qk_layernorm=family == "qwen3_moe", bias="qkv" if family == "qwen2_moe" else "none",
                       ffn_hidden_size=draw.choice([24, 40]), vocab_size=draw.randint(100, 300), seq_length=16,
                       tie_word_embeddings=draw.random() < 0.3, make_vocab_size_divisible_by=1, moe=moe,
                       **{"position_embedding": "rope", "norm": "rmsnorm", "mlp": "swiglu"})


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_counts_from_the_config_equal_transformers(family, seed):
    config = random_moe_config(family, seed)
    assert (analytic_total_parameters(config), analytic_active_parameters(config)) == hf_moe_counts(family, config)
    if family != "mixtral":  # and with only the first block dense (Qwen's mlp_only_layers = [0])
        first_dense = dataclasses.replace(config, moe=dataclasses.replace(config.moe, sparse_every=1,
                                                                          first_dense_layers=1))
        assert (analytic_total_parameters(first_dense), analytic_active_parameters(first_dense)) == hf_moe_counts(
            family, first_dense)


def test_active_parameters_by_hand():
    """Qwen2-MoE-shaped, 2 blocks (h 32, 4 heads of 8, 2 KV heads, QKV bias, vocabulary 100, untied): block 1 dense
    (SwiGLU of 48), block 2 sparse (4 experts of 16, top 2, a shared expert of 24 and its gate)."""
    moe = MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16, shared_expert_ffn_hidden_size=24, sparse_every=2)
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, seq_length=16,
                         vocab_size=100, make_vocab_size_divisible_by=1, ffn_hidden_size=48, bias="qkv", moe=moe,
                         position_embedding="rope", norm="rmsnorm", mlp="swiglu", tie_word_embeddings=False)
    embeddings, final_norm = 2 * 100 * 32, 32
    attention = 32 * 64 + 64 + 32 * 32 + 2 * 32  # QKV (4 + 2 x 2) x 8 = 64 rows and its bias, output, the 2 norms
    dense = attention + 3 * 32 * 48
    expert, shared = 3 * 32 * 16, 3 * 32 * 24 + 32  # one routed expert; the shared one with its gate
    sparse_active = attention + 4 * 32 + 2 * expert + shared  # the router, top 2 of 4
    assert (attention, dense, sparse_active) == (3200, 7808, 8736)
    assert analytic_active_parameters(config) == embeddings + final_norm + dense + sparse_active == 22_976
    assert analytic_total_parameters(config) == 22_976 + 2 * expert == 26_048
    assert hf_moe_counts("qwen2_moe", config) == (26_048, 22_976)


def test_moe_presets_have_the_parameters_of_transformers():
    """Mixtral-8x7B: the issue's 46,702,792,704 total and 12,879,925,248 active (both embeddings); Qwen3-30B-A3B:
    30.5B total, 3.3B active (its model card's), active = total less 48 blocks x 120 unused experts of 3 h F."""
    mixtral = preset("mixtral-8x7b")
    assert (tokenizer_vocabulary_total(mixtral), tokenizer_vocabulary_active(mixtral)) == (
        46_702_792_704, 12_879_925_248)
    assert hf_moe_counts("mixtral", preset("mixtral-8x7b", make_vocab_size_divisible_by=1)) == (
        46_702_792_704, 12_879_925_248)
    qwen = preset("qwen3-30b-a3b")
    assert (qwen.head_dim, qwen.attention_size, qwen.qk_layernorm, qwen.tie_word_embeddings) == (128, 4096, True, False)
    assert tokenizer_vocabulary_total(qwen) == 30_532_122_624
    assert tokenizer_vocabulary_active(qwen) == 30_532_122_624 - 48 * 120 * 3 * 2048 * 768 == 3_353_032_704
    assert hf_moe_counts("qwen3_moe", preset("qwen3-30b-a3b", make_vocab_size_divisible_by=1)) == (
        30_532_122_624, 3_353_032_704)


def test_moe_flops_count_the_active_matmuls():
    """model/flops.py counts what a token meets (MFU on active FLOPs, as Megatron-LM counts it): for Mixtral-8x7B a
    block's forward is 2 x (QKV 4096 x (4096 + 2 x 1024) + output 4096 x 4096 + router 4096 x 8 + top 2 experts of
    3 x 4096 x 14336) + 4 s a. Those matmul weights over 32 blocks are the active count less both embeddings and the
    65 norms (tokenizer_vocabulary_active)."""
    from model.flops import layer_forward_flops_per_token

    mixtral = preset("mixtral-8x7b")
    per_block = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 4096 * 8 + 2 * 3 * 4096 * 14336
    assert layer_forward_flops_per_token(mixtral) == 2 * per_block + 4 * mixtral.seq_length * 4096
    assert 32 * per_block == tokenizer_vocabulary_active(mixtral) - 2 * 32000 * 4096 - 65 * 4096
    dense = preset("mixtral-8x7b", moe=None)  # the same shape with the dense SwiGLU of ffn 14336 in every block
    assert layer_forward_flops_per_token(dense) - layer_forward_flops_per_token(mixtral) == 2 * (
        3 * 4096 * 14336 - 4096 * 8 - 2 * 3 * 4096 * 14336)


def test_summary_prints_the_total_and_active_counts_of_a_moe_preset(capsys):
    from model.summary import main

    assert main(["--preset", "mixtral-8x7b", "--tp", "8", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "total with the tokenizer's vocabulary (32,000; what transformers reports): 46,702,792,704\n" in out
    assert ("active per token with the tokenizer's vocabulary (top 2 of 8 routed experts, the router, every dense "
            "parameter, both embeddings): 12,879,925,248\n") in out
    padded = 2 * (32768 - 32000) * 4096  # the embedding and the head, 32000 rows padded to 32768 at TP 8
    assert (f"vocabulary padded to 32,768 for TP 8: {46_702_792_704 + padded:,} and {12_879_925_248 + padded:,}"
            in out)


# ---------------------------------------------------------------------------------- DeepSeek-V3, Kimi-K2, Moonlight


def test_deepseek_v3_preset_is_transformers_defaults():
    """transformers' DeepseekV3Config defaults are DeepSeek-V3's numbers: the preset has each of them (the YaRN
    rope_scaling and 163,840 positions, the released checkpoint's, are not among the defaults)."""
    from transformers import DeepseekV3Config

    hf, ours = DeepseekV3Config().to_dict(), hf_deepseek_v3_config(preset("deepseek-v3")).to_dict()
    shape = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
             "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
             "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
             "norm_topk_prob", "rms_norm_eps", "tie_word_embeddings", "attention_bias"]
    assert {key: ours[key] for key in shape} == {key: hf[key] for key in shape}
    config = preset("deepseek-v3")
    assert (config.rope_theta, config.rope_interleave, config.moe.router) == (
        hf["rope_parameters"]["rope_theta"], hf["rope_interleave"], "sigmoid_bias")
    assert config.rope_scaling["factor"] * config.rope_scaling["original_max_position_embeddings"] == \
        config.max_position_embeddings == 163_840


@pytest.mark.parametrize("name, total, active", [
    ("deepseek-v3", 671_026_404_352, 37_552_282_624),  # the issue's: both embeddings, no MTP module (the preset's
                                                        # model.mtp, which transformers ignores: model/summary.py)
    ("kimi-k2", 1_026_408_209_408, 32_861_477_888),  # "1T total, 32B activated" (its model card)
    ("moonlight-16b-a3b", 15_960_108_544, 2_914_774_528),  # q_proj (no query latent), 2 shared experts
    ("deepseek-tiny", None, None),
])
def test_deepseek_presets_have_the_parameters_of_transformers(name, total, active):
    """transformers' DeepseekV3ForCausalLM of the same numbers on the meta device: its total, and its active count
    (the total less (E - k) / E of its routed experts' tensors) equal ours; active as model/summary.py defines it
    (top_k of the routed experts, the router, the shared expert, every dense parameter, both embeddings)."""
    config = preset(name)
    ours = tokenizer_vocabulary_total(config), tokenizer_vocabulary_active(config)
    assert ours == hf_moe_counts("deepseek_v3", preset(name, make_vocab_size_divisible_by=1))
    if total is not None:
        assert ours == (total, active)


def test_summary_prints_the_deepseek_v3_counts(capsys):
    from model.summary import main

    assert main(["--preset", "deepseek-v3", "--tp", "1"]) == 0
    out = capsys.readouterr().out
    assert "58 of 61 blocks sparse: 256 experts of ffn 2048, top 8, a shared expert of ffn 2048 (no gate)" in out
    assert "total with the tokenizer's vocabulary (129,280; what transformers reports): 671,026,404,352\n" in out
    assert ("active per token with the tokenizer's vocabulary (top 8 of 256 routed experts, the router and the shared "
            "expert, every dense parameter, both embeddings): 37,552,282,624\n") in out
    # the preset's model.mtp (depth 1) beside them: transformers' counts above leave it out
    assert ("multi-token prediction (model.mtp, depth 1; not in the counts above, as transformers ignores it): "
            "11,610,067,968 parameters (eh_proj 2 h^2, 3 norms and block 62)\n") in out
    assert "layer 61): 684,489,830,400 = 671,026,404,352 + 13,463,426,048\n" in out
    assert "684,531,386,000 (684.53B; DeepSeek-V3's published 685B = 671B + 14B of MTP)" in out


def test_deepseek_v3_active_count_by_hand():
    """37,552,282,624 = both embeddings + the final norm + 3 dense blocks + 58 sparse blocks of 9 experts (8 routed
    and the shared one, no gate) and the router, each block MLA's 187,121,664 with its two norms."""
    h, vocab = 7168, 129_280
    attention = (h * 1536 + 1536 + 1536 * 128 * 192  # q_a_proj, q_a_layernorm, q_b_proj
                 + h * (512 + 64) + 512 + 512 * 128 * (128 + 128)  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
                 + 128 * 128 * h + 2 * h)  # o_proj, the block's two norms
    expert = 3 * h * 2048
    dense, sparse_active = attention + 3 * h * 18432, attention + 256 * h + 9 * expert
    assert attention == 187_121_664
    assert 2 * vocab * h + h + 3 * dense + 58 * sparse_active == 37_552_282_624
    assert 2 * vocab * h + h + 3 * dense + 58 * (sparse_active + 248 * expert) == 671_026_404_352
