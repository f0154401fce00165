"""A Llama-shaped model trains through train.py (tests/launch.py) like the GPT: ds_configs/llama-tiny-cpu.json
(RoPE, RMSNorm, SwiGLU, 8 query heads in 2 KV groups, untied head) at TP 2 x PP 2 on 4 CPU processes, the loss
falls, a stop at step 4 resumed to step 8 is bitwise the uninterrupted run, a resume at another layout continues it
(to 1e-5: fp32, another summation order), and a run can start from a Hugging Face Llama imported in one command."""

from __future__ import annotations

import pytest
import torch

from tests.launch import final_weights, resumable_copy, run_training, same_weights, trajectory
from training.metrics_log import read_metrics

CONFIG = "ds_configs/llama-tiny-cpu.json"
EXTRA = ["training.save_interval=4"]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("straight") / "checkpoints"
    result = run_training(corpus, save, max_steps=8, extra=EXTRA, ds_config=CONFIG)
    return save, result.stdout + result.stderr



@pytest.mark.distributed
def test_llama_tiny_trains_and_resumes_exactly(corpus, straight, tmp_path):
    save, output = straight
    assert "TP 1/2 PP 1/2 DP 0/1" in output
    steps = trajectory(save)
    assert [step for step, *_ in steps] == list(range(1, 9))
    assert steps[-1][1] < steps[0][1] - 0.5  # the loss falls (about 10.9 at the start: ln 50257)

    resumed = resumable_copy(save, tmp_path)
    run_training(corpus, resumed, max_steps=8, extra=EXTRA, ds_config=CONFIG)
    assert trajectory(resumed) == steps[4:]  # losses, learning rates, batches, tokens: bitwise
    assert same_weights(final_weights(resumed), final_weights(save))


@pytest.mark.distributed
def test_llama_tiny_resumes_at_another_layout(corpus, straight, tmp_path):
    """Through DeepSpeed's universal checkpoint, strict: the fused gate/up matrix is merged as two sub-matrices, the
    grouped QKV as whole KV groups, the untied head as a vocabulary tensor. TP 2 x PP 2 -> TP 1 x PP 2 x DP 2."""
    save, _ = straight
    resumed = resumable_copy(save, tmp_path)
    result = run_training(corpus, resumed, max_steps=8, extra=[*EXTRA, "parallelism.tensor_parallel_size=1"],
                          ds_config=CONFIG)
    assert "resumed global_step4 written at TP 2 x PP 2 x DP 1; now TP 1 x PP 2 x DP 2" in result.stdout + result.stderr
    ours, theirs = read_metrics(resumed / "metrics.jsonl"), read_metrics(save / "metrics.jsonl")[4:]
    for key in ("lr", "global_batch", "consumed_samples"):
        assert [r[key] for r in ours] == [r[key] for r in theirs], key
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in theirs], rtol=1e-5, atol=0, msg=key)


@pytest.mark.distributed
def test_train_starts_from_a_one_command_import(corpus, tmp_path):
    """The README's two commands: tools/convert_from_hf.py with model.from_hf imports a random LlamaForCausalLM of
    another shape than llama-tiny (6 layers, h 192, 6 heads over 3 KV groups, SwiGLU 480, llama3 RoPE) at TP 3 x PP 2;
    train.py, with the same model.from_hf and training.init_from, starts on 6 processes from exactly its shards."""
    import subprocess
    import sys

    from tests.launch import OVERRIDES, ROOT
    from tests.test_hf_one_command import END_OF_TEXT_ID, LAYOUT, random_llama

    hf_dir = random_llama(tmp_path / "hf")
    imported = tmp_path / "imported"
    same = [f"model.from_hf={hf_dir}", *LAYOUT]
    subprocess.run([sys.executable, "tools/convert_from_hf.py", "--ds_config", CONFIG, "--set", same[0], "--set",
                    same[1], "--set", same[2], "--output", str(imported), "--no-progress"], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    save = tmp_path / "run" / "checkpoints"
    # max_steps 0: load, then checkpoint at step 0, so the weights the engine started from can be read back;
    # the test runs' model.num_layers=2 is not given: the model is the HF one
    base = [item for item in OVERRIDES if not item.startswith("model.num_layers=")]
    result = run_training(corpus, save, max_steps=0, extra=[*EXTRA, *same, f"training.init_from={imported}"],
                          ds_config=CONFIG, processes=6, base=base)
    output = result.stdout + result.stderr
    assert f"initialised the weights from {imported}" in output and "TP 2/3 PP 1/2 DP 0/1" in output
    started_from = final_weights(save)
    assert started_from.keys() == {path.name for path in (imported / (imported / "latest").read_text()).glob("layer_*")}
    assert len(started_from) == (6 + 4) * 3  # embedding, positions, 6 blocks, final norm, head; 3 TP ranks each
    assert same_weights(started_from, final_weights(imported))  # exactly the imported shards, every TP rank's
    saved = torch.load(save / "global_step0" / "mp_rank_00_model_states.pt", weights_only=False)["run_config"]
    assert saved["data"]["eod_token_id"] == END_OF_TEXT_ID  # from the tokenizer the import carried
