"""A Hugging Face model in with one command: model.from_hf fills the model block from config.json.

The model is the one a new user tried: a random LlamaForCausalLM of 6 layers, hidden 192, 6 query heads over 3
key/value groups, SwiGLU 480, an untied head and llama3 RoPE scaling, with a GPT-2 tokenizer whose end-of-text token
is not GPT-2's (so that data.eod_token_id can only come from it). ds_configs/llama-tiny-cpu.json's own model (preset
llama-tiny: 8 heads in 2 groups) is another model:

- with --set model.from_hf=DIR and no other model field, tools/convert_from_hf.py imports it at TP 3 x PP 2 (3
  divides 6 heads and 3 groups, not llama-tiny's 8 and 2); the export gives back every tensor, torch.equal; the run
  config takes data.eod_token_id from the carried tokenizer; tools/plan.py plans it;
- without model.from_hf the same command at TP 3 names the field mismatch (6 heads against 8) before the split, and
  each printed fix, fed back through shlex.split, works;
- a field set beside model.from_hf must agree with it; a split the HF model cannot take names its numbers and their
  origin.

train.py starting from the import (the same options, 6 processes) is tests/test_llama_training.py's.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from runconfig.run import load_run_config
from tools import convert_from_hf, convert_to_hf
from tools.plan import main as plan_main

CONFIG = "ds_configs/llama-tiny-cpu.json"
ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ["parallelism.tensor_parallel_size=3", "parallelism.pipeline_parallel_size=2"]
SPLIT = [word for setting in LAYOUT for word in ("--set", setting)]
END_OF_TEXT = "Ċ"  # GPT-2's newline token, id 198: the tokenizer's end-of-text here, to tell it from GPT-2's 50256
END_OF_TEXT_ID = 198


def random_llama(directory: Path) -> Path:
    """The issue's LlamaForCausalLM, random (seeded), saved as safetensors with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf.tokenizer import gpt2_tokenizer

    config = AutoConfig.for_model(
        "llama", vocab_size=50257, hidden_size=192, intermediate_size=480, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=128, tie_word_embeddings=False,
        rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)  # norms too, so that a misplaced one shows
    model.save_pretrained(str(directory))
    tokenizer = gpt2_tokenizer(128)
    tokenizer.eos_token = END_OF_TEXT
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return random_llama(tmp_path_factory.mktemp("hf") / "llama")


def convert(*arguments: str) -> int:
    return convert_from_hf.main([*arguments, "--no-progress"])


def test_import_with_from_hf_alone_at_tp3_pp2_and_back(hf_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    assert convert("--ds_config", CONFIG, "--set", f"model.from_hf={hf_dir}", *SPLIT, "--output",
                   str(tmp_path / "ck")) == 0
    assert "wrote" in capsys.readouterr().out
    tag = tmp_path / "ck" / "global_step0"
    assert len(list(tag.glob("mp_rank_*_model_states.pt"))) == 6
    assert convert_to_hf.main(["--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "back"),
                               "--no-progress"]) == 0
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (exported["num_key_value_heads"], exported["rope_parameters"]["rope_type"]) == (3, "llama3")

    # train.py's run config, as the README's second command gives it: the shape from config.json, the end-of-text
    # id from the tokenizer the import carried
    config = load_run_config(CONFIG, [f"model.from_hf={hf_dir}", *LAYOUT, f"training.init_from={tmp_path / 'ck'}"])
    model = config.model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.num_key_value_heads,
            model.ffn_hidden_size, model.tie_word_embeddings) == (6, 192, 6, 3, 480, False)
    assert model.rope_scaling["factor"] == 8.0 and model.seq_length == 64  # the preset gives what HF does not fix
    assert config.data.eod_token_id == END_OF_TEXT_ID
    assert config.to_dict()["data"]["eod_token_id"] == END_OF_TEXT_ID  # saved resolved in every checkpoint


def test_end_of_text_comes_from_the_tokenizer_the_run_starts_from(hf_dir):
    assert load_run_config(CONFIG, [f"model.from_hf={hf_dir}", *LAYOUT]).data.eod_token_id == END_OF_TEXT_ID
    assert load_run_config(CONFIG).data.eod_token_id == 50256  # no HF tokenizer: GPT-2's
    assert load_run_config(CONFIG, [f"model.from_hf={hf_dir}", *LAYOUT, "data.eod_token_id=7"]).data.eod_token_id == 7


def test_the_model_is_compared_before_the_split(hf_dir, tmp_path, capsys):
    """llama-tiny's 8 heads do not divide by 3; the HF model's 6 do. The error is the mismatch, not the split."""
    assert convert("--model", str(hf_dir), "--ds_config", CONFIG, *SPLIT, "--output", str(tmp_path / "ck")) == 2
    err = capsys.readouterr().err
    assert f"model.num_attention_heads is 8 in {CONFIG}, the HF model has 6" in err
    assert "not divisible" not in err and not (tmp_path / "ck").exists()


def suggestions(error: str) -> tuple[list[str], list[str]]:
    """The two fixes an error offers: model.from_hf alone, and every field."""
    line = error.strip().splitlines()[-1]
    whole, fields = re.match(r"take the model block from the HF config with (.*?) \(or set these fields: (.*)\)$",
                             line).groups()
    return shlex.split(whole), shlex.split(fields)


def test_every_printed_fix_pastes(hf_dir, tmp_path, capsys):
    assert convert("--model", str(hf_dir), "--ds_config", CONFIG, *SPLIT, "--output", str(tmp_path / "x")) == 2
    whole, fields = suggestions(capsys.readouterr().err)
    assert whole == ["--set", f'model.from_hf="{hf_dir}"']
    assert "--set" in fields and any(word.startswith("model.rope_scaling={") for word in fields)
    for name, fix in (("whole", whole), ("fields", fields)):
        assert convert("--model", str(hf_dir), "--ds_config", CONFIG, *SPLIT, *fix, "--output",
                       str(tmp_path / name)) == 0, capsys.readouterr().err


def test_a_field_beside_from_hf_must_agree(hf_dir, tmp_path, capsys):
    assert convert("--ds_config", CONFIG, "--set", f"model.from_hf={hf_dir}", "--set", "model.num_attention_heads=8",
                   *SPLIT, "--output", str(tmp_path / "ck")) == 2
    err = capsys.readouterr().err
    assert f"model.num_attention_heads is 8 in {CONFIG}, the HF model ({hf_dir}/config.json) has 6" in err
    assert convert("--ds_config", CONFIG, "--set", f"model.from_hf={hf_dir}", "--set", "model.num_attention_heads=6",
                   *SPLIT, "--output", str(tmp_path / "ok")) == 0  # agreeing is allowed


def test_a_split_the_hf_model_cannot_take_names_its_origin(hf_dir, tmp_path, capsys):
    assert convert("--ds_config", CONFIG, "--set", f"model.from_hf={hf_dir}", "--set",
                   "parallelism.tensor_parallel_size=2", "--output", str(tmp_path / "ck")) == 2
    err = capsys.readouterr().err
    assert "model.num_key_value_heads (3) is not divisible by parallelism.tensor_parallel_size (2)" in err
    assert f"(the model's shape comes from {hf_dir}/config.json (model.from_hf) and preset 'llama-tiny')" in err


def test_from_hf_and_model_must_name_one_model(hf_dir, tmp_path, capsys):
    assert convert("--model", str(tmp_path), "--ds_config", CONFIG, "--set", f"model.from_hf={hf_dir}", *SPLIT,
                   "--output", str(tmp_path / "ck")) == 2
    assert "name different models" in capsys.readouterr().err
    assert convert("--ds_config", CONFIG, *SPLIT, "--output", str(tmp_path / "ck")) == 2
    assert "pass --model DIR, or --set model.from_hf=DIR" in capsys.readouterr().err


def test_plan_takes_from_hf(hf_dir, capsys):
    assert plan_main(["--ds_config", CONFIG, "--set", f"model.from_hf={hf_dir}", "--nodes", "1", "--gpu", "h100-80gb",
                      "--set", "parallelism.tensor_parallel_size=3", "--set", "parallelism.pipeline_parallel_size=2",
                      "--gpus-per-node", "6", "--set", "train_batch_size=8", "--set", "train_micro_batch_size_per_gpu=8",
                      "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parameters"]["total"] > 0 and plan["plans"][0]["errors"] == []
    assert plan["parameters"]["stages"][0]["layers"].count("TransformerLayer") == 3  # 6 layers over 2 stages
