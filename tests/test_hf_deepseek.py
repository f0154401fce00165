"""DeepseekV3ForCausalLM beyond its place among tests/test_hf_moe.py's families (q latent, YaRN, experts after two
dense blocks, through its one 8-process launch at EP 2 to transformers' logits): other shapes, DeepSeek's block-scaled
fp8 weights, its multi-token prediction layer and what has no equivalent here. Single-process; each random model has
4 blocks of hidden 64 (test_hf_moe's shape) and GPT-2's vocabulary, so that the shipped tokenizer fits.

    check                                  what is asserted
    q_proj (q_lora_rank null), attention   HF -> TP 2 x PP 2 -> HF: every tensor bit for bit under the same names,
      bias, tied head, rotate_half, every    model.from_hf's fields, and transformers' logits of the export equal
      block sparse; and a dense MLA model    (torch.equal) to those of the original; greedy decoding from the
      (first_k_dense_replace = layers)       checkpoint (MLA's latent cache) equals transformers' generate(), its
                                             logits within 1e-4 of transformers' (q_proj)
    fp8, weight_block_size [16, 24]        each fp8 weight imported in a bf16 run equals fp8.float() x its block's
      (partial blocks in both dimensions,    scale, cast to bf16, bitwise, in the layer files and in the export; the
      a [40, 64] weight has both at once)    others equal the original cast; e_score_correction_bias stays fp32 in
                                             both; the export has no scale and no quantization_config
    the multi-token prediction layer       model.layers.4.* skipped with a logged notice, listed in hf_import.json;
                                             with model.mtp read into its depth and written back bit for bit (the
                                             official layout: its block, norms, eh_proj, embedding and head copies)
    config.json keys                       each refused by name (scoring_func, topk_method, moe_layer_freq, ...);
                                             Kimi-K2's model_type "kimi_k2" read as DeepseekV3
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from hf.config_map import model_fields_from_hf, read_hf_config
from hf.export import export_to_hf
from hf.importer import dequantize_fp8_blocks, import_from_hf
from model.checkpoint_files import layer_file
from model.config import ModelConfig, ParallelConfig
from runconfig.run import parse_run_config
from tests.distributed import run_distributed
from tests.test_hf_moe import (
    GENERATION_PROMPTS,
    LATENT,
    NEW_TOKENS,
    VOCAB,
    hf_config,
    hf_model,
    load_all,
    random_hf_model,
    run_config,
)

DEEPSEEK = "DeepseekV3ForCausalLM"
FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # the largest float8_e4m3fn
BLOCK = (16, 24)


# -- other shapes: HF -> TP 2 x PP 2 -> HF ---------------------------------------------------------------------------

VARIANTS = {  # (HF config overrides, the model fields read, whether greedy decoding is compared)
    "q_proj, bias, tied, rotate_half, every block sparse": (
        dict(q_lora_rank=None, attention_bias=True, first_k_dense_replace=0, tie_word_embeddings=True,
             rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        dict(q_lora_rank=None, bias="all", tie_word_embeddings=True, rope_interleave=False, rope_scaling=None),
        False),  # a random tied model repeats its last token: its greedy tokens would test nothing
    "q_proj, YaRN, dense (first_k_dense_replace = layers)": (
        dict(first_k_dense_replace=4, q_lora_rank=None), dict(q_lora_rank=None, moe=None, rope_interleave=True),
        True),
}


@pytest.mark.parametrize("overrides, expected, generates", VARIANTS.values(), ids=VARIANTS.keys())
def test_variants_round_trip_bit_for_bit(overrides, expected, generates, tmp_path):
    hf_dir = random_hf_model(DEEPSEEK, tmp_path / "hf", **overrides)
    config = run_config(hf_dir)
    model = parse_run_config(config).model
    assert model.attention_type == "mla" and {key: getattr(model, key) for key in expected} == expected
    if model.moe is not None:
        assert [model.moe.is_sparse(n) for n in range(1, 5)] == [True] * 4
    import_from_hf(hf_dir, model, ParallelConfig(2, 2), tmp_path / "checkpoint", run_config=config, progress=False)
    out = export_to_hf(tmp_path / "checkpoint", tmp_path / "back", progress=False)
    original, back = load_all(hf_dir), load_all(out)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())
    prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf_model(out)(prompt).logits, hf_model(hf_dir)(prompt).logits)
    if not generates:
        return
    # greedy decoding from the checkpoint (one process; MLA's latent cache) is transformers' generate()
    generated, logits = run_distributed(1, _generate, str(tmp_path / "checkpoint"))[0]
    model, expected = hf_model(hf_dir), []
    with torch.no_grad():  # and the logits of the checkpoint, as tests/test_hf_moe.py checks the q latent's
        theirs = model(torch.tensor([GENERATION_PROMPTS[1]])).logits
    torch.testing.assert_close(logits[..., :VOCAB], theirs, rtol=0, atol=1e-4)
    for prompt in GENERATION_PROMPTS:
        with torch.no_grad():
            expected.append(model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                           pad_token_id=0)[0, len(prompt):].tolist())
    assert len({token for tokens in expected for token in tokens}) > 3  # not one token repeated
    assert generated == expected


def _generate(checkpoint: str) -> tuple[list[list[int]], torch.Tensor]:
    from evaluation.generation import Generator
    from evaluation.loading import load_pipeline

    pipeline, _ = load_pipeline(checkpoint, parallel=ParallelConfig(1, 1))
    prompt = torch.tensor([GENERATION_PROMPTS[1]])
    with torch.no_grad():
        logits = pipeline.logits(prompt, torch.arange(prompt.shape[1]).view(1, -1))
    return Generator(pipeline, None).generate_all(GENERATION_PROMPTS, NEW_TOKENS), logits


# -- fp8 block-scaled weights ----------------------------------------------------------------------------------------

def _fp8_works() -> bool:
    try:
        return FP8 is not None and torch.ones(2).to(FP8).float().sum().item() == 2.0
    except (RuntimeError, TypeError):
        return False


def quantize_by_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek's quantisation, block by block: scale_inv = the block's max |w| / 448, fp8 = w / scale_inv. Returns
    the fp8 weight, the scales and, written out block by block, what the import must make of them (fp32)."""
    rows, columns = weight.shape
    scale_inv = torch.empty(math.ceil(rows / BLOCK[0]), math.ceil(columns / BLOCK[1]))
    quantized, expected = torch.empty(rows, columns, dtype=FP8), torch.empty(rows, columns)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
            scale_inv[i, j] = weight[block].abs().max() / FP8_MAX
            quantized[block] = (weight[block] / scale_inv[i, j]).to(FP8)
            expected[block] = quantized[block].float() * scale_inv[i, j]
    return quantized, scale_inv, expected


def fp8_checkpoint(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Rewrite a random DeepseekV3 directory as DeepSeek-V3's release is: every projection float8_e4m3fn with its
    weight_scale_inv (embedding, head, norms, router and bias as they were), and a multi-token prediction layer
    model.layers.4 (two of its tensors). Returns the weights the import must give, fp32, by HF name."""
    from safetensors.torch import save_file

    original = load_all(hf_dir)
    written, expected = {}, {}
    for name, tensor in original.items():
        if tensor.ndim == 2 and "_proj" in name:  # q_a_proj .. kv_a_proj_with_mqa .. o_proj, the MLPs' and experts'
            written[name], written[f"{name}_scale_inv"], expected[name] = quantize_by_blocks(tensor)
        else:
            written[name] = expected[name] = tensor
    written.update({"model.layers.4.eh_proj.weight": torch.zeros(64, 128),
                    "model.layers.4.enorm.weight": torch.ones(64)})
    for file in hf_dir.glob("model*.safetensors*"):
        file.unlink()
    save_file(written, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(num_nextn_predict_layers=1, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)})
    (hf_dir / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.skipif(not _fp8_works(), reason="this torch has no float8_e4m3fn (or no cast to it) on this CPU")
def test_fp8_weights_are_dequantized_block_by_block(tmp_path, caplog):
    hf_dir = random_hf_model(DEEPSEEK, tmp_path / "hf")
    expected = fp8_checkpoint(hf_dir)
    quantized = [name for name, tensor in load_all(hf_dir).items() if tensor.dtype == FP8]
    assert len(quantized) == 4 * 5 + 2 * 3 + 2 * (8 * 3 + 3)  # attention 5, dense MLP 3, experts and shared expert
    assert "model.layers.2.self_attn.kv_a_proj_with_mqa.weight" in quantized
    model = ModelConfig(**model_fields_from_hf(read_hf_config(hf_dir)), seq_length=32, precision="bf16")
    with caplog.at_level(logging.WARNING, logger="hf.importer"):
        import_from_hf(hf_dir, model, ParallelConfig(1, 1), tmp_path / "checkpoint", progress=False)
    assert "skipping 2 tensors of model.layers.4, DeepSeek's multi-token prediction module" in caplog.text
    assert json.loads((tmp_path / "checkpoint" / "hf_import.json").read_text())["skipped_hf_layers"] == [4]

    block = torch.load(layer_file(tmp_path / "checkpoint" / "global_step0", 2 + 2, 0), weights_only=True)  # sparse
    kv_down = expected["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"]  # [40, 64]: both edges partial
    assert torch.equal(block["attention.kv_a_proj_with_mqa.weight"], kv_down.to(torch.bfloat16))
    assert block["mlp.block.router.expert_bias"].dtype == torch.float32
    bias = expected["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0 and torch.equal(block["mlp.block.router.expert_bias"], bias)

    out = export_to_hf(tmp_path / "checkpoint", tmp_path / "back", progress=False)
    back = load_all(out)
    assert back.keys() == {name for name in expected if not name.startswith("model.layers.4.")}
    for name, tensor in back.items():
        want = expected[name] if name.endswith("e_score_correction_bias") else expected[name].to(torch.bfloat16)
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), name
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


# -- the multi-token prediction layer in the official layout ---------------------------------------------------------

def with_mtp_layer(hf_dir: Path, model: ModelConfig) -> dict[str, torch.Tensor]:
    """Add to a random DeepseekV3 directory what DeepSeek-V3's release stores as model.layers.4 (num_nextn_predict_
    layers 1; transformers' own save has none): enorm, hnorm, eh_proj, shared_head.norm, a sparse block, and copies of
    the embedding and the head. Returns every tensor of the directory by HF name."""
    from safetensors.torch import save_file

    from hf.tables import hf_shapes

    tensors, generator = load_all(hf_dir), torch.Generator().manual_seed(7)
    for name, shape in hf_shapes(model).items():
        if name not in tensors:
            norm = "norm" in name or name.endswith("e_score_correction_bias")
            tensors[name] = (1.0 if "norm" in name else 0.0) + (0.1 if norm else 0.05) * torch.randn(
                shape, generator=generator)
    tensors["model.layers.4.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.4.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for file in hf_dir.glob("model*.safetensors*"):
        file.unlink()
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return tensors


def test_the_official_mtp_layer_round_trips_bit_for_bit(tmp_path):
    """With model.mtp in the run config, the import reads model.layers.4 into the depth (layer file L + 5) and the
    export writes it back under the same names, the embedding's and head's copies included, bit for bit."""
    hf_dir = random_hf_model(DEEPSEEK, tmp_path / "hf")
    config = run_config(hf_dir)
    config["model"]["mtp"] = {"depth": 1}
    model = parse_run_config(config).model
    original = with_mtp_layer(hf_dir, model)
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.mlp.experts.7.down_proj.weight",
            "model.layers.4.mlp.gate.e_score_correction_bias"} <= original.keys()
    import_from_hf(hf_dir, model, ParallelConfig(2, 2), tmp_path / "checkpoint", run_config=config, progress=False)
    assert json.loads((tmp_path / "checkpoint" / "hf_import.json").read_text())["skipped_hf_layers"] == []
    depth = torch.load(layer_file(tmp_path / "checkpoint" / "global_step0", 4 + 5, 1), weights_only=True)
    assert torch.equal(depth["depths.0.eh_proj.weight"], original["model.layers.4.eh_proj.weight"])
    assert depth["depths.0.block.mlp.block.router.expert_bias"].dtype == torch.float32
    out = export_to_hf(tmp_path / "checkpoint", tmp_path / "back", progress=False)
    back = load_all(out)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_a_scale_of_the_wrong_shape_is_refused():
    weight = torch.zeros(40, 64)
    with pytest.raises(ValueError, match=r"scale_inv has shape \(2, 3\), but a \[40, 64\] weight in blocks of "
                                         r"\[16, 24\] .* needs \(3, 3\)"):
        dequantize_fp8_blocks(weight, torch.ones(2, 3), BLOCK)  # the partial row of blocks dropped


# -- config.json ------------------------------------------------------------------------------------------------------

def _write_config(directory: Path, **keys) -> Path:
    hf_config(DEEPSEEK).save_pretrained(str(directory))
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, **keys}))
    return directory


@pytest.mark.parametrize("keys, message", [
    (dict(scoring_func="softmax"), r"scoring_func = 'softmax' has no equivalent .* scores by sigmoid"),
    (dict(topk_method="greedy"), r"topk_method = 'greedy' .*\(noaux_tc"),
    (dict(moe_layer_freq=2), r"moe_layer_freq = 2 .* only 1"),
    (dict(num_key_value_heads=2), r"num_key_value_heads = 2 .* only num_attention_heads \(4\)"),
    (dict(attention_bias=True), r"attention_bias = True .* only with first_k_dense_replace 0"),
    (dict(n_shared_experts=0), r"n_shared_experts = 0 .* only >= 1"),
    (dict(n_group=None), r"n_group = None"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), r"quantization_config.quant_method = 'gptq'"),
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3"}), r"quantization_config.weight_block_size = "
                                                                       r"None"),
])
def test_keys_without_an_equivalent_are_refused_by_name(keys, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        read_hf_config(_write_config(tmp_path, **keys))


def test_kimi_k2s_model_type_reads_as_deepseek_v3(tmp_path):
    """Kimi-K2's config.json: architectures DeepseekV3ForCausalLM, model_type "kimi_k2" (DeepSeek's keys beside)."""
    hf_dir = _write_config(tmp_path, model_type="kimi_k2", scoring_func="sigmoid", topk_method="noaux_tc",
                           moe_layer_freq=1, num_nextn_predict_layers=0)
    fields = model_fields_from_hf(read_hf_config(hf_dir))
    assert (fields["attention_type"], fields["moe"]["router"], fields["q_lora_rank"]) == ("mla", "sigmoid_bias", 32)
    assert {key: fields[key] for key in LATENT} == LATENT
