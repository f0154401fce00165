"""The Llama-family presets have exactly the parameters of the transformers model of the same published config.

Both sides are built on the meta device (nothing allocated): ours through model/summary.py's count of the pipeline
stages at TP 1, PP 1 (the same LayerSpecs a run builds) and its closed form; transformers' through
AutoModelForCausalLM.from_config. Our embedding is padded to a multiple of make_vocab_size_divisible_by x TP; the
published count is the unpadded one, so ours is taken with make_vocab_size_divisible_by=1 (at TP 1: no padding).
"""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig, preset
from model.summary import analytic_total_parameters, count_stages, total_from_stages

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
    from hf.tables import layer_maps

    assert len(layer_maps(preset("tiny"))) == 4 + 3  # embeddings, blocks, final norm
    assert len(layer_maps(preset("llama-tiny"))) == 4 + 4  # embedding, empty positions, blocks, norm, untied head
    with pytest.raises(ValueError, match="is no Hugging Face architecture"):
        layer_maps(preset("llama-tiny", norm="layernorm"))  # rope with LayerNorm: neither GPT-2 nor Llama


def test_planner_plans_llama3_70b_on_64_h100_nodes():
    """tools/plan.py on a Llama shape: the FLOPs are the real block's, the untied head has no tied-embedding
    all-reduce, and the plan fits (TP 8 x PP 8 x DP 8, full recomputation, micro-batch 1)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from model.flops import flops_per_iteration
    from training.config import load_run_config

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
