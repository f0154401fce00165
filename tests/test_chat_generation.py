"""Chatting with a checkpoint: tools/generate.py --chat, and the chat template kept from import to export.

The model is a random GPT2LMHeadModel (2 layers, hidden 64) whose tokenizer is GPT-2's plus <|im_start|> and
<|im_end|> with tests/data/chat_templates/qwen_style.jinja as its chat template. Its final LayerNorm is set to put
out one fixed vector, a large multiple of <|im_end|>'s (tied) embedding, so that every next token is <|im_end|>:

- imported with tools/convert_from_hf.py, the checkpoint carries the template; the HF export gives it back;
- tools/generate.py --chat renders the user's turn (after --system) with the assistant's generation prompt, as
  transformers' apply_chat_template does, and stops at the template's end-of-turn token, <|im_end|>, found by
  rendering a one-turn conversation: one token, an empty completion. Without --chat the same prompt runs to
  --max-new-tokens (<|im_end|> is not the end-of-text token).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tests" / "data" / "chat_templates" / "qwen_style.jinja"
SPECIAL = ["<|im_start|>", "<|im_end|>"]


def chat_tokenizer():
    from hf.tokenizer import gpt2_tokenizer

    tokenizer = gpt2_tokenizer(128)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("chat")
    tokenizer = chat_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=64, n_layer=2, n_head=4))
    with torch.no_grad():
        direction = torch.nn.functional.normalize(torch.randn(64), dim=0)
        model.transformer.wte.weight[end] = 10.0 * direction
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(direction)  # every position's output: direction, so <|im_end|> wins
    model.save_pretrained(str(root / "hf"))
    tokenizer.save_pretrained(str(root / "hf"))
    subprocess.run([sys.executable, "tools/convert_from_hf.py", "--ds_config", "ds_configs/tiny-cpu.json", "--set",
                    f"model.from_hf={root / 'hf'}", "--set", "parallelism.tensor_parallel_size=1", "--set",
                    "parallelism.pipeline_parallel_size=1", "--output", str(root / "checkpoint"), "--no-progress"],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    return {"root": root, "checkpoint": root / "checkpoint", "tokenizer": tokenizer, "end": end}


def generate(checkpoint: Path, *arguments: str) -> dict:
    result = subprocess.run([sys.executable, "tools/generate.py", "--checkpoint", str(checkpoint), *arguments],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_chat_template_goes_in_and_out(checkpoint, tmp_path):
    from transformers import AutoTokenizer

    from tools import convert_to_hf

    carried = AutoTokenizer.from_pretrained(str(checkpoint["checkpoint"] / "hf_tokenizer"))
    assert carried.chat_template == TEMPLATE.read_text()
    assert convert_to_hf.main(["--checkpoint", str(checkpoint["checkpoint"]), "--output", str(tmp_path / "hf"),
                               "--no-progress"]) == 0
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).chat_template == TEMPLATE.read_text()


def test_generate_chat_renders_the_turn_and_stops_at_its_end(checkpoint):
    from tools.generate import chat_messages, end_of_turn, render

    tokenizer = checkpoint["tokenizer"]
    messages = chat_messages("Where do bees live?", "Answer briefly.")
    assert render(tokenizer, TEMPLATE.read_text(), messages) == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert end_of_turn(tokenizer, TEMPLATE.read_text()) == checkpoint["end"]

    answer = generate(checkpoint["checkpoint"], "--chat", "--system", "Answer briefly.", "--prompt",
                      "Where do bees live?", "--max-new-tokens", "8")
    assert answer["prompt"] == messages and answer["tokens"] == [checkpoint["end"]] and answer["completion"] == ""
    plain = generate(checkpoint["checkpoint"], "--prompt", "Where do bees live?", "--max-new-tokens", "8")
    assert plain["tokens"] == [checkpoint["end"]] * 8
