"""Hugging Face interop for the Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.

Each architecture as a random HF model of a non-trivial shape (4 layers, hidden 128, 8 query heads in 2 key/value
groups of 4, head_dim 16, ffn 256, GPT-2's 50,257-token vocabulary so that the shipped tokenizer fits), every tensor
random (norm weights and Qwen2's q/k/v biases too, so that a misplaced one shows), saved as safetensors with a
tokenizer beside it:

    Llama   grouped KV heads, untied head, llama3 RoPE scaling (theta 5e5, original context 64: with head_dim 16 the
            wavelengths 6 .. 6e5 fall in all three bands of the rule)
    Mistral grouped KV heads, untied head, no sliding window, theta 1e6
    Qwen2   grouped KV heads, q/k/v biases, tied head, rms eps 1e-6
    Qwen3   grouped KV heads, per-head RMSNorm q_norm / k_norm (model.qk_layernorm), head_dim 24 while
            hidden_size / heads is 16 (a free head_dim: QKV 128 -> 12 x 24, o_proj 192 -> 128), untied head

- Imported by tools/convert_from_hf.py at TP 2 x PP 2 (the run config's model block is model_fields_from_hf of the
  HF config), loaded by the DeepSpeed pipeline engine on 4 gloo processes (a fresh init with another seed first):
  its logits on real text (botchan through the GPT-2 tokenizer) equal the HF model's, max abs difference <= 1e-4 in
  fp32 (the engine sums TP partial products of the row-parallel layers, HF runs one unsplit matmul, so the rounding
  differs; the measured differences are printed).
- HF -> here (TP 2 x PP 2) -> HF gives back every tensor bit for bit (the conversion only copies, slices and
  permutes), in fp32 and in bf16; the export loads with AutoModelForCausalLM.from_pretrained offline with no missing
  or unexpected key, keeps its architecture and config, ships the carried tokenizer, and generate() runs.
- The split/merge of the grouped QKV and gate_up on arange tensors at TP 1, 2; the layer indices against
  gpt_layer_specs (the untied head is layer L + 3).
- A sliding window shorter than the context, and a rope_scaling other than llama3 or yarn, are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf.config_map import model_fields_from_hf, read_hf_config
from hf.export import export_to_hf
from hf.importer import import_from_hf, read_import_record
from hf.tables import ARCHITECTURES, full_shape, hf_tensor_shapes, layer_maps
from hf.tokenizer import TOKENIZER_DIRECTORY, gpt2_tokenizer
from hf.transforms import merge_to_hf, split_from_hf
from model.config import ModelConfig, ParallelConfig
from model.parallel import ParallelContext
from runconfig.run import parse_run_config
from tests.distributed import run_distributed
from tests.test_model_parallel import LR, MICRO_BATCH, deepspeed_config
from tools import convert_from_hf, convert_to_hf

SEED = 1234
TP, PP = 2, 2
SEQ = 32
VOCAB = 50257
LOGITS_TOLERANCE = 1e-4
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "LlamaForCausalLM": dict(tie_word_embeddings=False, rms_norm_eps=1e-5, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "MistralForCausalLM": dict(tie_word_embeddings=False, sliding_window=None, rms_norm_eps=1e-5,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=True, rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "Qwen3ForCausalLM": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, head_dim=24, attention_bias=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


def hf_config(name: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(ARCHITECTURES[name].model_type, architectures=[name],
                                **{**SHAPE, **FAMILIES[name], **overrides})


def random_hf_model(name: str, directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Every tensor random: matrices N(0, 0.05^2) (so that 4 blocks neither vanish nor blow up), norm weights
    1 + N(0, 0.1^2), biases N(0, 0.1^2). Saved as safetensors, with GPT-2's tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(sorted(FAMILIES).index(name))
    model = AutoModelForCausalLM.from_config(hf_config(name))
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter.ndim == 2:
                parameter.normal_(0.0, 0.05)
            elif "norm" in parameter_name:
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(str(directory))
    gpt2_tokenizer(SHAPE["max_position_embeddings"]).save_pretrained(str(directory))
    return directory


def run_config(hf_dir: Path, precision: str = "fp32") -> dict:
    """The run config the trainer would store: the model block is what the HF config fixes, plus seq_length."""
    model = {**model_fields_from_hf(read_hf_config(hf_dir)), "seq_length": SEQ, "precision": precision}
    raw = {**deepspeed_config(precision), "model": model,
           "parallelism": {"tensor_parallel_size": TP, "pipeline_parallel_size": PP},
           "schedule": {"lr": LR, "warmup_tokens": 0, "decay_tokens": 1e6, "train_tokens": 1e6},
           "training": {"seed": SEED}}
    return parse_run_config(raw).to_dict()


def text_tokens() -> torch.Tensor:
    """(MICRO_BATCH, SEQ) tokens of real text: the start of botchan through the GPT-2 tokenizer."""
    line = Path("data/corpus/botchan.jsonl").read_text(encoding="utf-8").splitlines()[0]
    ids = gpt2_tokenizer(10**6)(json.loads(line)["text"]).input_ids[: MICRO_BATCH * SEQ]
    return torch.tensor(ids).view(MICRO_BATCH, SEQ)


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, dict]:
    """Each architecture: the HF directory, its import (the command-line tool), and the run config."""
    root = tmp_path_factory.mktemp("llama_family")
    cases = {}
    for name in FAMILIES:
        hf_dir = random_hf_model(name, root / name / "hf")
        config = run_config(hf_dir)
        config_file = root / name / "run.json"
        config_file.write_text(json.dumps(config))
        assert convert_from_hf.main(["--model", str(hf_dir), "--ds_config", str(config_file), "--output",
                                     str(root / name / "checkpoint"), "--no-progress"]) == 0
        cases[name] = {"hf": hf_dir, "checkpoint": root / name / "checkpoint", "config": config}
    return cases


def hf_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True, local_files_only=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(hf_dir)(tokens).logits


# -- the DeepSpeed engine on the imported checkpoints ----------------------------------------------------------------

def _engine_logits(cases: list[tuple[str, dict]], tokens: torch.Tensor) -> list[torch.Tensor | None]:
    """Each checkpoint loaded by the pipeline engine (TP 2 x PP 2): this rank's vocabulary slice of the logits on
    the text (last stage only)."""
    from training.engine import build_engine

    results = []
    for directory, raw_config in cases:
        config = parse_run_config(raw_config)
        engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, SEED + 1)  # init != import
        load_path, client_state = engine.load_checkpoint(directory, tag=None, load_module_only=True,
                                                         load_optimizer_states=False, load_lr_scheduler_states=False)
        assert load_path is not None and client_state["hf_import"]["architecture"] in FAMILIES
        positions = torch.arange(SEQ).expand(MICRO_BATCH, -1)
        batch = ((tokens, positions), (tokens, torch.ones(MICRO_BATCH, SEQ)))
        _, logits = engine.eval_batch(iter([batch]), return_logits=True, num_micro_batches=1)
        results.append(logits.detach().clone() if ctx.is_last_stage else None)
        del engine
    return results


@pytest.mark.distributed
def test_engine_on_imported_checkpoints_gives_the_hf_logits(imported):
    tokens = text_tokens()
    cases = [(str(case["checkpoint"]), case["config"]) for case in imported.values()]
    ranks = run_distributed(TP * PP, _engine_logits, cases, tokens)
    differences = {}
    for index, (name, case) in enumerate(imported.items()):
        # global-rank order: the last stage's TP ranks come last, in TP order
        ours = torch.cat([r[index] for r in ranks if r[index] is not None], dim=-1)
        assert ours.shape[-1] == 50432 and torch.isneginf(ours[..., VOCAB:]).all()
        theirs = hf_logits(case["hf"], tokens)
        assert theirs.abs().max() > 0.5  # the random weights give logits of a real spread, not ~0
        differences[name] = (theirs - ours[..., :VOCAB]).abs().max().item()
    print(f"max |logits - HF logits| (fp32, TP {TP} x PP {PP}): {differences}")
    assert all(difference <= LOGITS_TOLERANCE for difference in differences.values()), differences


# -- round trip ------------------------------------------------------------------------------------------------------

def load_all(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    return {name: tensor for file in files for name, tensor in load_file(hf_dir / file).items()}


CONFIG_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "rope_parameters", "hidden_act")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_to_ours_to_hf_is_bit_identical_and_generates(imported, name, tmp_path):
    from transformers import AutoTokenizer

    case = imported[name]
    assert read_import_record(case["checkpoint"])["architecture"] == name
    assert (case["checkpoint"] / TOKENIZER_DIRECTORY / "tokenizer.json").is_file()  # carried in
    out = export_to_hf(case["checkpoint"], tmp_path / "hf", max_shard_size="1MB", progress=False)
    assert len(list(out.glob("*.safetensors"))) > 2 and (out / "model.safetensors.index.json").is_file()  # sharded
    original, back = load_all(case["hf"]), load_all(out)
    assert back.keys() == original.keys()
    assert ("lm_head.weight" in back) == (not FAMILIES[name]["tie_word_embeddings"])
    for tensor_name, tensor in original.items():
        assert back[tensor_name].dtype == tensor.dtype and torch.equal(back[tensor_name], tensor), tensor_name
    before, after = (json.loads((d / "config.json").read_text()) for d in (case["hf"], out))
    for key in CONFIG_KEYS:
        assert after.get(key) == before.get(key), key

    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)  # the carried tokenizer, shipped
    source = AutoTokenizer.from_pretrained(str(case["hf"]), local_files_only=True)
    assert tokenizer("Botchan was born in Tokyo.").input_ids == source("Botchan was born in Tokyo.").input_ids
    model = hf_model(out)
    prompt = text_tokens()[:1, :8]
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, hf_model(case["hf"])(prompt).logits)
        generated = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                   pad_token_id=tokenizer.eos_token_id)
        first = model(prompt).logits[0, -1].argmax().item()
    assert generated.shape == (1, 12) and generated[0, 8].item() == first


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_round_trip_is_bit_identical(name, tmp_path):
    hf_dir = random_hf_model(name, tmp_path / "hf", torch.bfloat16)
    model = parse_run_config(run_config(hf_dir, "bf16")).model
    import_from_hf(hf_dir, model, ParallelConfig(TP, PP), tmp_path / "checkpoint", progress=False)
    state = torch.load(tmp_path / "checkpoint" / "global_step0" / "layer_02-model_01-model_states.pt",
                       weights_only=True)
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    out = export_to_hf(tmp_path / "checkpoint", tmp_path / "back", progress=False)
    original, back = load_all(hf_dir), load_all(out)
    assert back.keys() == original.keys()
    for tensor_name, tensor in original.items():
        assert back[tensor_name].dtype == torch.bfloat16 and torch.equal(back[tensor_name], tensor), tensor_name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_as_another_architecture_that_fits(imported, tmp_path):
    """Mistral without a sliding window is Llama's function: exported as LlamaForCausalLM it gives the same logits;
    Qwen2ForCausalLM (q/k/v biases) does not fit a model without biases."""
    case = imported["MistralForCausalLM"]
    assert convert_to_hf.main(["--checkpoint", str(case["checkpoint"]), "--output", str(tmp_path / "llama"),
                               "--architecture", "LlamaForCausalLM", "--no-progress"]) == 0
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tokens = text_tokens()
    torch.testing.assert_close(hf_logits(tmp_path / "llama", tokens), hf_logits(case["hf"], tokens), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="only to LlamaForCausalLM / MistralForCausalLM, not Qwen2ForCausalLM"):
        export_to_hf(case["checkpoint"], tmp_path / "qwen2", architecture="Qwen2ForCausalLM", progress=False)
    assert not (tmp_path / "qwen2").exists()


# -- the map, single-process -----------------------------------------------------------------------------------------

def llama_config(**overrides) -> ModelConfig:
    """llama-tiny with Qwen2's QKV bias (so the bias split is covered) and a 1000-token vocabulary."""
    fields = dict(num_layers=2, hidden_size=128, num_attention_heads=8, num_key_value_heads=2, ffn_hidden_size=256,
                  seq_length=16, vocab_size=1000, position_embedding="rope", norm="rmsnorm", mlp="swiglu",
                  tie_word_embeddings=False, bias="qkv")
    return ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_split_then_merge_is_exact_for_every_llama_tensor(tensor_parallel_size):
    for config in (llama_config(), llama_config(bias="all", tie_word_embeddings=True)):
        for layer in layer_maps(config):
            for tensor in layer.tensors:
                values = [torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1e6 * i
                          for i, shape in enumerate(hf_tensor_shapes(tensor, config).values())]
                shards = split_from_hf(tensor, values[0] if len(values) == 1 else values, config,
                                       tensor_parallel_size)
                assert all(s.shape == shards[0].shape for s in shards)
                merged = merge_to_hf(tensor, shards, config)
                merged = [merged] if torch.is_tensor(merged) else list(merged)
                assert len(merged) == len(values) and all(map(torch.equal, merged, values)), tensor.hf


def test_grouped_qkv_and_gate_up_shards_hold_their_groups():
    """Rank r of TP 2 holds KV group r: its 4 query heads (q_proj rows of heads 4r .. 4r+3), then k_proj and
    v_proj rows of head r; and gate rows then up rows of its half of the ffn."""
    config = llama_config()
    block = layer_maps(config)[2]
    qkv = next(t for t in block.tensors if t.ours == "attention.qkv.weight")
    d, h = config.head_dim, config.hidden_size
    q, k, v = (torch.arange(shape[0], dtype=torch.float32).unsqueeze(1).expand(shape) + 1000 * i
               for i, shape in enumerate(hf_tensor_shapes(qkv, config).values()))
    shards = split_from_hf(qkv, (q, k, v), config, 2)
    for rank, shard in enumerate(shards):
        rows = shard[:, 0].view(6, d)  # [4 query heads, k, v] of this rank's group
        assert torch.equal(rows[:4].flatten(), torch.arange(4 * rank * d, 4 * (rank + 1) * d, dtype=torch.float32))
        assert torch.equal(rows[4], 1000 + torch.arange(rank * d, (rank + 1) * d, dtype=torch.float32))
        assert torch.equal(rows[5], 2000 + torch.arange(rank * d, (rank + 1) * d, dtype=torch.float32))
    gate_up = next(t for t in block.tensors if t.ours == "mlp.gate_up.weight")
    f = config.ffn_hidden_size
    gate = torch.arange(f, dtype=torch.float32).unsqueeze(1).expand(f, h)
    up = 1000 + gate
    for rank, shard in enumerate(split_from_hf(gate_up, (gate, up), config, 2)):
        half = torch.arange(rank * f // 2, (rank + 1) * f // 2, dtype=torch.float32)
        assert torch.equal(shard[:, 0], torch.cat([half, 1000 + half]))


def test_layer_indices_and_names_match_the_llama_model():
    from model.gpt import EmbeddingDropout, FinalRMSNorm, OutputHead, TransformerLayer, WordEmbedding, gpt_layer_specs

    config, ctx = llama_config(), ParallelContext()
    specs = gpt_layer_specs(config, ctx, SEED)
    maps = layer_maps(config)
    last = config.num_layers + 2
    modules = {0: WordEmbedding(config, ctx, SEED), 1: EmbeddingDropout(config, ctx, SEED),
               last: FinalRMSNorm(config, ctx, SEED), last + 1: OutputHead(config, ctx, SEED)}
    block = TransformerLayer(config, ctx, SEED, 1)
    assert [m.index for m in maps] == list(range(len(specs)))  # the untied head has its own layer file
    for layer in maps:
        module = modules.get(layer.index, block)
        assert specs[layer.index].typename is type(module)
        assert {t.ours: full_shape(t, config, 1) for t in layer.tensors} == {
            k: tuple(v.shape) for k, v in module.state_dict().items()}


# -- refusals --------------------------------------------------------------------------------------------------------

def _config_only(directory: Path, config) -> Path:
    directory.mkdir()
    config.save_pretrained(str(directory))
    return directory


@pytest.mark.parametrize("name, overrides, message", [
    ("MistralForCausalLM", dict(sliding_window=64), r"sliding_window = 64 is shorter than max_position_embeddings"),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0),
     r"sliding_window = 64 is shorter"),
    ("LlamaForCausalLM", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     r"rope_scaling of type 'linear' is not supported: only \"llama3\" scaling \(Llama 3.1\+\), \"yarn\""),
    ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=False), r"attention_bias = True .* mlp_bias = False"),
])
def test_unsupported_options_are_refused_by_name(name, overrides, message, tmp_path):
    hf_dir = _config_only(tmp_path / "hf", hf_config(name, **overrides))
    with pytest.raises(ValueError, match=message):
        read_hf_config(hf_dir)
    model = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=8, seq_length=SEQ)
    with pytest.raises(ValueError, match=message):
        import_from_hf(hf_dir, model, ParallelConfig(TP, PP), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_legacy_rope_scaling_key_is_refused_by_name(tmp_path):
    """An older config.json spells the scaling as rope_scaling {"type": ...}."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE, "rope_theta": 1e4,
        "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    with pytest.raises(ValueError, match="rope_scaling of type 'dynamic'"):
        read_hf_config(hf_dir)


def test_mismatched_run_config_is_named(imported, tmp_path):
    case = imported["LlamaForCausalLM"]
    model = parse_run_config(case["config"]).model
    wrong = ModelConfig(**{**model.to_dict(), "num_key_value_heads": 8, "rope_scaling": None})
    with pytest.raises(ValueError, match=r"model.num_key_value_heads is 8 .* has 2(.|\n)*model.rope_scaling is None"):
        import_from_hf(case["hf"], wrong, ParallelConfig(TP, PP), tmp_path / "out", progress=False)
    gpt2 = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=8, seq_length=SEQ)
    with pytest.raises(ValueError, match="is a LlamaForCausalLM, but the model of .* fits only GPT2LMHeadModel"):
        import_from_hf(case["hf"], gpt2, ParallelConfig(TP, PP), tmp_path / "out", progress=False)
