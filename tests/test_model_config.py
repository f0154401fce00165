"""Model configuration, initialisation and the meta-device parameter count (single process, no DeepSpeed engine)."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import psutil
import pytest
import torch

from model.config import ModelConfig, ParallelConfig, preset
from model.gpt import GPT
from model.parallel import ParallelContext
from model.summary import analytic_total_parameters, count_stages, total_from_stages


def test_530b_preset_is_the_recipe():
    config = preset("530b")
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (105, 20480, 128)
    assert (config.seq_length, config.head_dim, config.ffn_hidden_size) == (2048, 160, 81920)
    assert config.padded_vocab_size(8) == 51200 and config.padded_vocab_size(1) == 50304
    assert config.init_method_std == pytest.approx(math.sqrt(1 / (3 * 20480))) and round(config.init_method_std, 4) == 0.004
    assert config.output_layer_init_std == pytest.approx(config.init_method_std / math.sqrt(210))
    config.check_parallel(8, 35)


@pytest.mark.parametrize("fields, parallel, message", [
    (dict(num_attention_heads=2), (4, 1), "num_attention_heads (2) is not divisible by parallelism.tensor_parallel_size (4)"),
    (dict(num_layers=5), (1, 2), "model.num_layers (5) cannot be split evenly over parallelism.pipeline_parallel_size (2)"),
    (dict(hidden_size=66), None, "model.hidden_size (66) is not divisible by model.num_attention_heads (4)"),
    (dict(seq_length=128, max_position_embeddings=64), None, "longer than model.max_position_embeddings"),
    (dict(num_layers=0), None, "model.num_layers must be a positive integer"),
    (dict(hidden_dropout=1.0), None, "model.hidden_dropout must be in [0, 1)"),
    (dict(precision="fp8"), None, "model.precision must be one of"),
    (dict(activation="relu"), None, "model.activation must be one of"),
    (dict(ffn_hidden_size=130), (4, 1), "model.ffn_hidden_size (130) is not divisible"),
    (dict(init_method_std=-0.02), None, "model.init_method_std must be positive"),
    (dict(recompute="some"), None, "model.recompute must be one of ('none', 'selective', 'full')"),
    (dict(recompute_num_layers=2), None, "model.recompute_num_layers is 2 but model.recompute is \"none\""),
    (dict(recompute="full", recompute_num_layers=0), None, "model.recompute_num_layers must be a positive integer"),
    (dict(recompute="full", recompute_num_layers=3), (1, 2), "model.recompute_num_layers (3) is more than the 2 "
                                                             "blocks of each of the 2 pipeline stages"),
    (dict(seq_length=30), (4, 1, True), "model.seq_length (30) is not divisible by parallelism.tensor_parallel_size "
                                        "(4): with parallelism.sequence_parallel"),
])
def test_invalid_model_configs_name_the_field(fields, parallel, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config = preset("tiny", **fields)
        if parallel:
            config.check_parallel(*parallel)


def test_the_old_activation_checkpointing_key_reads_as_recompute():
    from model.config import upgrade_model_fields

    block = {"preset": "tiny", "activation_checkpointing": True}
    assert upgrade_model_fields(block) == {"preset": "tiny", "recompute": "full"}
    assert block == {"preset": "tiny", "activation_checkpointing": True}  # the caller's block is left as it was
    assert upgrade_model_fields({"activation_checkpointing": False})["recompute"] == "none"
    with pytest.raises(ValueError, match="model.activation_checkpointing \\(true\\) and model.recompute "
                                         "\\('selective'\\) disagree"):
        upgrade_model_fields({"activation_checkpointing": True, "recompute": "selective"})


def test_recompute_num_layers_takes_the_first_blocks_of_each_stage():
    config = preset("tiny", num_layers=8, recompute="selective", recompute_num_layers=2)
    assert [config.recompute_at(n, 2) for n in range(1, 9)] == ["selective"] * 2 + ["none"] * 2 + \
        ["selective"] * 2 + ["none"] * 2
    assert [preset("tiny", recompute="full").recompute_at(n, 4) for n in range(1, 5)] == ["full"] * 4


def test_sequence_parallelism_turns_off_deepspeeds_partitioned_transfers():
    from training.engine import _unpartitioned_pipe_transfers

    assert _unpartitioned_pipe_transfers({"train_batch_size": 8})["pipeline"] == {"pipe_partitioned": False,
                                                                                   "grad_partitioned": False}
    with pytest.raises(ValueError, match="DeepSpeed's pipeline.pipe_partitioned is true"):
        _unpartitioned_pipe_transfers({"pipeline": {"pipe_partitioned": True}})


def test_world_size_must_divide():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tensor_parallel_size \(2\) x pipeline_parallel_size \(2\) = 4"):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2).data_parallel_size(6)
    assert ParallelConfig(tensor_parallel_size=8, pipeline_parallel_size=35).data_parallel_size(4480) == 16


@pytest.mark.parametrize("tensor_parallel_size", [2, 4])
def test_shards_are_slices_of_the_unsharded_init(tensor_parallel_size):
    """Same seed, any TP: each rank's tensors are exactly its slice of the TP 1 model (QKV stays per head)."""
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=300)
    full = dict(GPT(config, seed=7).named_parameters())
    shards = [dict(GPT(config, ParallelContext(tensor_parallel_size=tensor_parallel_size, tensor_parallel_rank=r),
                       seed=7).named_parameters()) for r in range(tensor_parallel_size)]
    for name, reference in full.items():
        parts = [shard[name].detach() for shard in shards]
        sharded = getattr(shards[0][name], "tensor_model_parallel", False)
        if not sharded:
            assert all(torch.equal(p, reference) for p in parts), name
            continue
        assembled = torch.cat(parts, dim=shards[0][name].partition_dim)
        if name == "word_embeddings.weight":  # the padding grows with TP (128 x TP); the real rows are identical
            assembled, reference = assembled[:config.vocab_size], reference[:config.vocab_size]
        assert torch.equal(assembled, reference), name


def test_init_statistics():
    config = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=8, vocab_size=1000)
    model = GPT(config, seed=3)
    qkv = model.layers[0].attention.qkv.weight
    assert qkv.std().item() == pytest.approx(math.sqrt(1 / (3 * 256)), rel=0.02)
    dense = model.layers[0].attention.dense.weight
    assert dense.std().item() == pytest.approx(math.sqrt(1 / (3 * 256)) / math.sqrt(8), rel=0.03)
    assert torch.all(model.layers[0].attention.qkv.bias == 0) and torch.all(model.layers[0].ln1.weight == 1)
    assert not torch.equal(model.layers[0].mlp.fc1.weight, model.layers[1].mlp.fc1.weight)


def test_padded_vocabulary_gets_no_probability():
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=4, vocab_size=100)
    logits = GPT(config, seed=1)(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None])
    assert logits.shape[-1] == 128 and torch.all(logits[..., 100:] == float("-inf"))
    assert torch.all(torch.isfinite(logits[..., :100]))


def test_530b_meta_count_equals_analytic():
    config = preset("530b")
    rss_before = psutil.Process().memory_info().rss
    counts = count_stages(config, tensor_parallel_size=8, pipeline_parallel_size=35)
    assert psutil.Process().memory_info().rss - rss_before < 300 * 2**20  # 2 GB per rank would show
    assert len(counts) == 35 and all(c.parameters_per_tp_rank == c.analytic_per_tp_rank for c in counts)
    assert counts[0].layers == ["WordEmbedding", "PositionEmbedding"] + ["TransformerLayer"] * 3
    assert counts[-1].layers == ["TransformerLayer"] * 3 + ["FinalLayerNorm", "WordEmbedding"]
    # by hand: V h + P h + L (12 h^2 + 13 h) + 2 h with V = 51200, P = 2048, L = 105, h = 20480
    expected = 51200 * 20480 + 2048 * 20480 + 105 * (12 * 20480**2 + 13 * 20480) + 2 * 20480
    assert expected == 529_600_819_200
    assert analytic_total_parameters(config, 8) == expected == total_from_stages(counts, config, 8)
    # one TP rank of a middle stage: 3 blocks of (12 h^2 + 7 h)/8 sharded + 6 h replicated
    assert counts[1].parameters_per_tp_rank == 3 * ((12 * 20480**2 + 7 * 20480) // 8 + 6 * 20480) == 1_887_859_200


def test_summary_command_prints_counts():
    out = subprocess.run([sys.executable, "-m", "model.summary", "--preset", "530b", "--tp", "8", "--pp", "35"],
                         capture_output=True, text=True, check=True).stdout
    assert "529,600,819,200 from the modules, 529,600,819,200 analytic (equal)" in out
    assert "total with the tokenizer's vocabulary (50,257; what transformers reports): 529,581,506,560" in out
    assert "transformer blocks' matrices 12 l h^2 = 528,482,304,000" in out  # the GPT shape's closed form
    assert out.count(" yes") == 35


def test_single_stage_counts_the_tied_embedding_once():
    """At PP 1 the only stage holds both ends of the tied embedding, and PipelineModule builds it once."""
    config = preset("1.3b")
    counts = count_stages(config, tensor_parallel_size=1, pipeline_parallel_size=1)
    assert counts[0].layers == ["WordEmbedding", "PositionEmbedding"] + ["TransformerLayer"] * 24 + ["FinalLayerNorm"]
    # by hand: V h + P h + L (12 h^2 + 13 h) + 2 h with V = 50304, P = 2048, L = 24, h = 2048
    expected = 50304 * 2048 + 2048 * 2048 + 24 * (12 * 2048**2 + 13 * 2048) + 2 * 2048
    assert counts[0].parameters_per_tp_rank == expected == total_from_stages(counts, config, 1) == 1_315_819_520


LLAMA_FIELDS = dict(position_embedding="rope", norm="rmsnorm", mlp="swiglu", tie_word_embeddings=False)


@pytest.mark.parametrize("fields, parallel, message", [
    (dict(position_embedding="alibi"), None, "model.position_embedding must be one of ('learned', 'rope'), got 'alibi'"),
    (dict(norm="batchnorm"), None, "model.norm must be one of ('layernorm', 'rmsnorm')"),
    (dict(mlp="geglu"), None, "model.mlp must be one of ('gelu', 'swiglu')"),
    (dict(bias="some"), None, "model.bias must be one of ('all', 'none', 'qkv')"),
    (dict(num_key_value_heads=3), None,
     "model.num_key_value_heads (3) does not divide model.num_attention_heads (4): choose key/value heads"),
    (dict(num_key_value_heads=0), None, "model.num_key_value_heads must be a positive integer"),
    (dict(num_key_value_heads=2), (4, 1),
     "model.num_key_value_heads (2) is not divisible by parallelism.tensor_parallel_size (4): each TP rank holds "
     "whole key/value groups"),
    (dict(num_key_value_heads=1), (2, 1), "model.num_key_value_heads (1) is not divisible by"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}), None,
     "model.rope_scaling is set but model.position_embedding is 'learned'"),
    (dict(position_embedding="rope", rope_scaling={"rope_type": "yarn", "factor": 4.0}), None,
     "model.rope_scaling of type \"yarn\" lacks ['original_max_position_embeddings']"),
    (dict(position_embedding="rope", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 4096, "beta_fast": -1}), None,
     "model.rope_scaling.beta_fast must be a positive number, got -1"),
    (dict(position_embedding="rope", rope_scaling={"type": "linear", "factor": 4.0}), None,
     "model.rope_scaling type 'linear' is not supported"),
    (dict(position_embedding="rope", rope_scaling={"rope_type": "llama3", "factor": 8.0}), None,
     "model.rope_scaling of type \"llama3\" lacks ['low_freq_factor', 'high_freq_factor', "
     "'original_max_position_embeddings']"),
    (dict(position_embedding="rope", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                   "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
     None, "model.rope_scaling.high_freq_factor (1.0) must be greater than low_freq_factor (4.0)"),
    (dict(position_embedding="rope", hidden_size=60, num_attention_heads=4), None,
     "model.position_embedding \"rope\" needs an even head dimension, got model.head_dim = 15"),
    (dict(rope_theta=0.0), None, "model.rope_theta must be positive"),
    (dict(tie_word_embeddings="no"), None, "model.tie_word_embeddings must be true or false"),
    (dict(hidden_size=60, num_attention_heads=8), None,
     "model.hidden_size (60) is not divisible by model.num_attention_heads (8): choose heads that divide the hidden "
     "size, or set model.head_dim"),
    (dict(head_dim=0), None, "model.head_dim must be a positive integer"),
    (dict(qk_layernorm="yes"), None, "model.qk_layernorm must be true or false"),
    (dict(init_std_multiple=0), None, "model.init_std_multiple must be a positive number"),
    (dict(init_std_multiple=3.0, init_method_std=0.02), None,
     "model.init_method_std (0.02) and model.init_std_multiple (3.0) disagree: 3.0 x sqrt(1/(3 x 64)) is 0.216506"),
])
def test_invalid_llama_options_name_the_field(fields, parallel, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config = preset("tiny", **fields)
        if parallel:
            config.check_parallel(*parallel)


def test_gpt2_shape_is_the_default():
    config = preset("tiny")
    assert (config.position_embedding, config.norm, config.mlp, config.bias) == ("learned", "layernorm", "gelu", "all")
    assert config.tie_word_embeddings and config.num_key_value_heads == config.num_attention_heads == 4
    assert config.qkv_size == 3 * config.hidden_size and config.rope_scaling is None


def _assembled(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor from TP shards that each stack their slice of ``stride`` sub-matrices along ``dim``."""
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([torch.cat([p[i] for p in pieces], dim=dim) for i in range(stride)], dim=dim)


@pytest.mark.parametrize("tensor_parallel_size", [2, 4])
def test_llama_shards_are_slices_of_the_unsharded_init(tensor_parallel_size):
    """The same for a Llama shape: grouped QKV (8 heads in 4 groups), QKV bias, SwiGLU's stacked [gate r; up r]
    (partition_stride 2), RMSNorm and the untied head."""
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=8, num_key_value_heads=4, seq_length=8,
                         vocab_size=300, ffn_hidden_size=48, bias="qkv", **LLAMA_FIELDS)
    full = dict(GPT(config, seed=7).named_parameters())
    assert {"output_head.weight", "layers.0.mlp.gate_up.weight", "layers.0.attention.qkv.bias"} <= set(full)
    assert "position_embedding.weight" not in full and "layers.0.ln1.bias" not in full
    shards = [dict(GPT(config, ParallelContext(tensor_parallel_size=tensor_parallel_size, tensor_parallel_rank=r),
                       seed=7).named_parameters()) for r in range(tensor_parallel_size)]
    for name, reference in full.items():
        parts = [shard[name].detach() for shard in shards]
        if not getattr(shards[0][name], "tensor_model_parallel", False):
            assert all(torch.equal(p, reference) for p in parts), name
            continue
        assembled = _assembled(parts, shards[0][name].partition_dim, shards[0][name].partition_stride)
        if name in ("word_embeddings.weight", "output_head.weight"):  # the padding grows with TP
            assembled, reference = assembled[:config.vocab_size], reference[:config.vocab_size]
        assert torch.equal(assembled, reference), name
    gate_up = full["layers.0.mlp.gate_up.weight"]
    assert gate_up.shape == (96, 32) and not torch.equal(gate_up[:48], gate_up[48:])
    assert not torch.equal(full["word_embeddings.weight"], full["output_head.weight"])


def test_init_std_multiple_scales_the_recipe_rule_and_survives_a_saved_config():
    config = preset("tiny", init_std_multiple=3.0)  # h 64
    assert config.init_method_std == 3.0 * math.sqrt(1 / (3 * 64))
    assert ModelConfig(**config.to_dict()).init_method_std == config.init_method_std  # a checkpoint's run config
    assert preset("tiny").init_method_std == math.sqrt(1 / (3 * 64))


MOE_FIELDS = dict(num_experts=8, top_k=2, moe_ffn_hidden_size=64)


def test_moe_block_reads_from_json_and_survives_a_saved_config():
    """model.moe: a JSON object becomes a MoEConfig; a checkpoint's run config (to_dict) gives the same model back; a
    partial block over a preset changes only its fields."""
    from model.config import MoEConfig

    config = preset("llama-tiny", moe={**MOE_FIELDS, "sparse_every": 2})
    assert config.moe == MoEConfig(**MOE_FIELDS, sparse_every=2) and config.to_dict()["moe"]["sparse_every"] == 2
    assert ModelConfig(**config.to_dict()) == config and preset("llama-tiny").moe is None
    refined = preset("qwen3-30b-a3b", moe={"capacity_factor": 1.25, "top_k": 4})
    assert (refined.moe.num_experts, refined.moe.top_k, refined.moe.capacity_factor) == (128, 4, 1.25)


@pytest.mark.parametrize("fields, parallel, message", [
    (dict(mlp="gelu"), None, "model.moe needs model.mlp \"swiglu\" (the experts are SwiGLU MLPs), got 'gelu': set "
                             "model.mlp to \"swiglu\", or remove model.moe"),
    (dict(moe={**MOE_FIELDS, "top_k": 9}), None, "model.moe.top_k (9) is larger than model.moe.num_experts (8): "
                                                 "route each token to at most num_experts experts"),
    (dict(moe={**MOE_FIELDS, "capacity_factor": -0.5}), None, "model.moe.capacity_factor must be a positive number, "
                                                              "or null for dropless routing, got -0.5"),
    (dict(moe={**MOE_FIELDS, "gate": "top"}), None, "unknown key(s) ['gate'] in block \"model.moe\""),
    (dict(moe=8), None, "model.moe must be an object of the experts' fields (num_experts, top_k, moe_ffn_hidden_size, "
                        "...) or null, got 8"),
    (dict(), (2, 1, False, 1, 3), "parallelism.expert_parallel_size (3) does not divide model.moe.num_experts (8): "
                                  "choose one of [1, 2, 4, 8]"),
    (dict(moe={**MOE_FIELDS, "shared_expert_ffn_hidden_size": 33}), (2, 1),
     "model.moe.shared_expert_ffn_hidden_size (33) is not divisible by parallelism.tensor_parallel_size (2): each TP "
     "rank holds a slice of every expert"),
    (dict(moe=None), (1, 1, False, 1, 2), "parallelism.expert_parallel_size is 2 but model.moe is not set"),
])
def test_invalid_moe_options_name_the_field(fields, parallel, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config = preset("llama-tiny", **{"moe": MOE_FIELDS, **fields})
        if parallel:
            config.check_parallel(*parallel)


def test_moe_presets_split_and_their_stages_are_built_with_every_expert():
    """count_stages builds the sparse blocks (EP 1) on the meta device: each stage equals its formula, and the
    stages of one replica the closed-form total (sparse and dense blocks apart: qwen3-30b-a3b's are all sparse,
    deepseek-v3's first three dense)."""
    from model.summary import analytic_built_parameters

    preset("mixtral-8x7b").check_parallel(8, 4, expert_parallel_size=8)
    preset("qwen3-30b-a3b").check_parallel(4, 4, expert_parallel_size=16)
    for name, tp, pp in (("mixtral-8x7b", 8, 4), ("qwen3-30b-a3b", 4, 4), ("moonlight-16b-a3b", 2, 1)):
        config = preset(name)
        stages = count_stages(config, tp, pp)
        assert all(stage.parameters_per_tp_rank == stage.analytic_per_tp_rank for stage in stages), name
        assert sum(stage.parameters_per_stage for stage in stages) == analytic_built_parameters(config, tp), name
