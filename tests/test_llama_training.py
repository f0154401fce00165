"""A Llama-shaped model trains through train.py and the deepspeed launcher like the GPT: ds_configs/llama-tiny-cpu.json
(RoPE, RMSNorm, SwiGLU, 8 query heads in 2 KV groups, untied head) at TP 2 x PP 2 on 4 CPU processes, the loss
falls, and a stop at step 4 resumed to step 8 is bitwise the uninterrupted run."""

from __future__ import annotations

import shutil

import pytest

from tests.launch import final_weights, run_training, same_weights, trajectory

CONFIG = "ds_configs/llama-tiny-cpu.json"
EXTRA = ["training.save_interval=4"]


@pytest.mark.distributed
def test_llama_tiny_trains_and_resumes_exactly(corpus, tmp_path):
    straight = tmp_path / "straight" / "checkpoints"
    output = run_training(corpus, straight, max_steps=8, extra=EXTRA, ds_config=CONFIG)
    assert "TP 1/2 PP 1/2 DP 0/1" in output.stdout + output.stderr
    steps = trajectory(straight)
    assert [step for step, *_ in steps] == list(range(1, 9))
    assert steps[-1][1] < steps[0][1] - 0.5  # the loss falls (about 10.9 at the start: ln 50257)

    resumed = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("tensorboard", "metrics.jsonl", "global_step8"))
    (resumed / "latest").write_text("global_step4")
    run_training(corpus, resumed, max_steps=8, extra=EXTRA, ds_config=CONFIG)
    assert trajectory(resumed) == steps[4:]  # losses, learning rates, batches, tokens: bitwise
    assert same_weights(final_weights(resumed), final_weights(straight))


@pytest.mark.distributed
def test_llama_tiny_trains_from_an_imported_hugging_face_model(corpus, tmp_path):
    """training.init_from a random LlamaForCausalLM of llama-tiny's shape (2 layers, as the test runs use),
    imported at TP 2 x PP 2 by tools/convert_from_hf.py: the engine starts from exactly its weights (the HF logits of
    such an import are tests/test_hf_llama.py's)."""
    import subprocess
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.launch import ROOT

    torch.manual_seed(0)
    hf_config = LlamaConfig(vocab_size=50257, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                            architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(hf_config).save_pretrained(str(tmp_path / "hf"))
    imported = tmp_path / "imported"
    subprocess.run([sys.executable, "tools/convert_from_hf.py", "--model", str(tmp_path / "hf"), "--ds_config", CONFIG,
                    "--set", "model.num_layers=2", "--output", str(imported)], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    save = tmp_path / "run" / "checkpoints"
    # max_steps 0: load, then checkpoint at step 0, so the weights the engine started from can be read back
    result = run_training(corpus, save, max_steps=0, extra=[*EXTRA, f"training.init_from={imported}"],
                          ds_config=CONFIG)
    assert f"initialised the weights from {imported}" in result.stdout + result.stderr
    started_from = final_weights(save)
    assert started_from.keys() == {path.name for path in (imported / (imported / "latest").read_text()).glob("layer_*")}
    assert same_weights(started_from, final_weights(imported))  # exactly the imported shards, every TP rank's
