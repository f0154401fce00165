"""Any checkpoint resumes at any TP x PP x DP, through DeepSpeed's universal checkpoint; old checkpoints are pruned;
a damaged one is never loaded.

One uninterrupted run at (TP, PP, DP) = (2, 2, 1), 4 layers, ZeRO-1, fp32, dropout 0, checkpoints at steps 6 and 10,
is the reference. Its step-6 checkpoint is resumed at (1, 2, 2), (2, 1, 2), (1, 1, 4) and (1, 4, 1) with the real
launcher:
- DeepSpeed's converter runs strict (no --inject_missing_state, no --no_strict) on the (2, 2, 1) checkpoint, and on
  the checkpoints the resumed runs write at (1, 2, 2) and (2, 1, 2);
- after the load, every parameter's fp32 master weight, Adam exp_avg and exp_avg_sq and the step count, gathered back
  to full tensors by the converter, equal the original's bit for bit;
- steps 7-10 have the uninterrupted run's learning rates, batches and consumed samples exactly, and its losses and
  gradient norms to 1e-5 (the new split sums in another order; fp32);
- the Hugging Face export of the reshaped checkpoint is the original's, bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import run_distributed
from tests.launch import ROOT, run_overrides, run_training
from training.metrics_log import read_metrics

STEPS, RESUME_AT = 10, 6
BASE = ["model.num_layers=4", f"training.save_interval={RESUME_AT}"]
LAYOUTS = {  # (TP, PP, DP) -> the overrides that launch it on 4 processes
    (1, 2, 2): ["parallelism.tensor_parallel_size=1"],
    (2, 1, 2): ["parallelism.pipeline_parallel_size=1"],
    # micro-batch 1: the ramp's 4, 8, 12, 16 must split into micro-batch x DP
    (1, 1, 4): ["parallelism.tensor_parallel_size=1", "parallelism.pipeline_parallel_size=1",
                "train_micro_batch_size_per_gpu=1"],
    (1, 4, 1): ["parallelism.tensor_parallel_size=1", "parallelism.pipeline_parallel_size=4"],
}
BF16 = ["model.precision=\"bf16\"", "bf16={\"enabled\": true}", "data_types={\"grad_accum_dtype\": \"fp32\"}"]


def steps(save: Path) -> list[dict]:
    return read_metrics(save / "metrics.jsonl")


def resumable_copy(reference: Path, destination: Path, tag: str = f"global_step{RESUME_AT}") -> Path:
    """The reference's checkpoint directory as it was at ``tag``: later checkpoints and the log removed."""
    save = destination / "checkpoints"
    shutil.copytree(reference, save, ignore=shutil.ignore_patterns("tensorboard", "metrics.jsonl"))
    for later in save.glob("global_step*"):
        if int(later.name.removeprefix("global_step")) > int(tag.removeprefix("global_step")):
            shutil.rmtree(later)
    (save / "latest").write_text(tag)
    return save


def convert_strict(directory: Path, tag: str) -> Path:
    from training.checkpoint import convert_to_universal

    return convert_to_universal(directory, tag)  # DeepSpeed's converter, strict: it fails on any unmatched pattern


def universal_states(folder: Path) -> dict[str, torch.Tensor]:
    """{"<param>/<state>": tensor} of a universal checkpoint: fp32 master weight, exp_avg, exp_avg_sq, step."""
    states = {}
    for path in sorted((folder / "zero").glob("*/*.pt")):
        value = torch.load(path, weights_only=False)
        states[f"{path.parent.name}/{path.stem}"] = value["param"] if isinstance(value, dict) else value
    return states


@pytest.fixture(scope="module")
def reference(reshape_reference) -> Path:
    return reshape_reference  # tests/conftest.py: shared with tests/test_dualpipev.py


@pytest.fixture(scope="module")
def resumed(corpus, reference, tmp_path_factory) -> dict[tuple, tuple[Path, str]]:
    """Each layout, resumed from the reference's step 6 and trained to step 10: (checkpoint directory, output)."""
    runs = {}
    for layout, overrides in LAYOUTS.items():
        save = resumable_copy(reference, tmp_path_factory.mktemp("x".join(map(str, layout))))
        result = run_training(corpus, save, STEPS, [*BASE, *overrides])
        runs[layout] = (save, result.stdout + result.stderr)
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda layout: "TP{}xPP{}xDP{}".format(*layout))
def test_resumed_run_continues_the_reference(layout, reference, resumed):
    save, output = resumed[layout]
    tp, pp, dp = layout
    assert (f"resumed global_step6 written at TP 2 x PP 2 x DP 1; now TP {tp} x PP {pp} x DP {dp}") in output
    assert (save / "universal" / "global_step6" / "zero").is_dir()
    ours, theirs = steps(save), steps(reference)[RESUME_AT:]
    assert [r["step"] for r in ours] == list(range(RESUME_AT + 1, STEPS + 1))
    for key in ("lr", "global_batch", "consumed_samples", "consumed_tokens"):
        assert [r[key] for r in ours] == [r[key] for r in theirs], key
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in theirs], rtol=1e-5, atol=0, msg=key)


@pytest.mark.distributed
def test_converter_runs_strict_on_checkpoints_of_other_layouts(resumed):
    """The (2, 2, 1) checkpoint was converted by the resumes; these were written at (1, 2, 2) and (2, 1, 2)."""
    for layout in ((1, 2, 2), (2, 1, 2)):
        save, _ = resumed[layout]
        folder = convert_strict(save, f"global_step{STEPS}")
        names = {path.name for path in (folder / "zero").iterdir() if path.is_dir()}
        assert {"tied_modules.word_embeddings.weight", "1.weight", "2.attention.qkv.weight", "6.weight"} <= names
        states = universal_states(folder)
        assert states["tied_modules.word_embeddings.weight/fp32"].shape == (50257, 64)  # padding cut off
        assert states["2.attention.dense.weight/fp32"].shape == (64, 64)  # row-parallel: merged on dim 1
        assert states["2.mlp.fc1.weight/fp32"].shape == (256, 64)  # column-parallel: merged on dim 0
        assert states["2.ln1.weight/fp32"].shape == (64,)  # replicated: one copy


def _load_and_save(data_prefix: str, source: str, out: str, overrides: list[str]) -> None:
    """The run's own resume path (checked, converted, loaded with load_universal), then a save at the new layout."""
    import torch.distributed as dist

    from runconfig.run import load_run_config
    from training import checkpoint
    from training.engine import build_engine
    from training.run import resume_point

    config = load_run_config(ROOT / "ds_configs/tiny-cpu.json",
                             run_overrides(Path(data_prefix), Path(source), STEPS, [*BASE, *overrides]))
    point = resume_point(config)
    deepspeed_config = {**config.deepspeed, "checkpoint": {"load_universal": point.reshaped}}
    engine, _ = build_engine(config.model, config.parallelism, deepspeed_config, config.training.seed)
    client_state, _ = checkpoint.load_checkpoint(engine, source, point)
    ours = {key: client_state[key] for key in ("train_state", "universal_checkpoint_info")}
    checkpoint.save_checkpoint(engine, out, RESUME_AT, {**ours, "run_config": config.to_dict()})
    dist.barrier()


@pytest.fixture(scope="module")
def reloaded(corpus, reference, tmp_path_factory) -> dict[tuple, Path]:
    """Each layout's engine right after the load, saved again (at its own layout) before any step."""
    source = resumable_copy(reference, tmp_path_factory.mktemp("source"))
    saves = {}
    for layout, overrides in LAYOUTS.items():
        out = tmp_path_factory.mktemp("reloaded") / "checkpoints"
        run_distributed(4, _load_and_save, str(corpus), str(source), str(out), overrides)
        saves[layout] = out
    saves["source"] = source
    return saves


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda layout: "TP{}xPP{}xDP{}".format(*layout))
def test_optimizer_state_survives_the_reshape_bit_for_bit(layout, reloaded):
    original = universal_states(reloaded["source"] / "universal" / f"global_step{RESUME_AT}")
    ours = universal_states(convert_strict(reloaded[layout], f"global_step{RESUME_AT}"))
    assert ours.keys() == original.keys()
    assert {key.split("/")[1] for key in ours} == {"fp32", "exp_avg", "exp_avg_sq", "step"}
    for key in original:
        assert torch.equal(ours[key], original[key]), key


@pytest.mark.distributed
def test_hf_export_of_a_reshaped_checkpoint_is_the_originals(reloaded, tmp_path):
    from hf.export import export_to_hf

    def export(directory: Path, name: str) -> dict[str, torch.Tensor]:
        out = export_to_hf(directory, tmp_path / name, tag=f"global_step{RESUME_AT}", progress=False)
        return {k: v for path in sorted(out.glob("*.safetensors")) for k, v in load_file(path).items()}

    original = export(reloaded["source"], "original")
    for layout in LAYOUTS:
        reshaped = export(reloaded[layout], "x".join(map(str, layout)))
        assert reshaped.keys() == original.keys()
        assert all(torch.equal(reshaped[k], original[k]) for k in original), layout


@pytest.mark.distributed
def test_bf16_resumes_at_another_layout(corpus, tmp_path):
    """bf16 with fp32 gradient accumulation (BF16_Optimizer) from (2, 2, 1) to (1, 2, 2).

    Losses of about 10 are 2^-4 apart in bf16; the new split rounds its bf16 matmuls and reductions in another order,
    so the resumed losses may move by a few bf16 roundings of the activations (2^-9 relative each), not by a
    spacing of the loss: 0.05 absolute, as tests/test_model_parallel.py allows bf16 against fp32."""
    reference = tmp_path / "reference" / "checkpoints"
    run_training(corpus, reference, STEPS, [*BASE, *BF16])
    save = resumable_copy(reference, tmp_path / "resumed")
    result = run_training(corpus, save, STEPS, [*BASE, *BF16, *LAYOUTS[(1, 2, 2)]])
    assert "resumed global_step6 written at TP 2 x PP 2 x DP 1; now TP 1 x PP 2 x DP 2" in result.stdout + result.stderr
    ours, theirs = steps(save), steps(reference)[RESUME_AT:]
    for key in ("lr", "global_batch", "consumed_samples"):
        assert [r[key] for r in ours] == [r[key] for r in theirs], key
    torch.testing.assert_close([r["loss"] for r in ours], [r["loss"] for r in theirs], rtol=0, atol=0.05)

