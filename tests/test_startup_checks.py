"""Bad data is refused at start-up, before any process group or model exists; nothing is unpickled blindly."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.indexed_dataset import IndexedDatasetBuilder
from runconfig.run import parse_run_config
from training.data import check_datasets, samples_needed

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("model", "data", "hf", "planner", "training", "tools") for p in (ROOT / folder).rglob("*.py")] + [
    ROOT / "train.py"]


def config_with(prefix: Path):
    raw = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())
    raw["data"]["blend"] = [[1.0, str(prefix)]]
    return parse_run_config(raw)


@pytest.fixture
def dataset(corpus, tmp_path) -> Path:
    """A private copy of the tokenised corpus, to damage."""
    for suffix in (".bin", ".idx"):
        shutil.copy(str(corpus) + suffix, str(tmp_path / "copy") + suffix)
    return tmp_path / "copy"


def test_a_good_dataset_passes(dataset):
    check_datasets(config_with(dataset))


def test_a_missing_dataset_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"dataset file {tmp_path / 'nowhere'}.idx does not exist: preprocess"):
        check_datasets(config_with(tmp_path / "nowhere"))


def test_a_truncated_bin_is_named(dataset):
    bin_file = Path(str(dataset) + ".bin")
    bin_file.write_bytes(bin_file.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=str(bin_file)):
        check_datasets(config_with(dataset))


def test_a_corrupted_idx_is_named(dataset):
    idx_file = Path(str(dataset) + ".idx")
    idx_file.write_bytes(b"NOTMMIDX" + idx_file.read_bytes()[8:])
    with pytest.raises(ValueError, match=str(idx_file)):
        check_datasets(config_with(dataset))


def test_a_dataset_with_a_larger_vocabulary_is_refused(tmp_path):
    prefix = tmp_path / "big_vocab"
    with IndexedDatasetBuilder(prefix, dtype=np.int32) as builder:
        for document in ([1, 2, 3], [60_000, 5, 50_257]):
            builder.add_item(document)
            builder.end_document()
    with pytest.raises(ValueError, match=r"token id 60000 does not fit the model's vocabulary of 50257"):
        check_datasets(config_with(prefix))


def test_enough_samples_are_built_for_the_run_and_its_rollbacks():
    raw = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())  # 262144 tokens of 64, batch 32
    assert samples_needed(parse_run_config(raw)) == (4096 + 32, 2 * 32, 0)
    raw["training"]["spike_guard"] = {"enabled": True, "rollback": True, "max_rollbacks": 3}  # save_interval 50
    assert samples_needed(parse_run_config(raw)) == (4096 + 32 + 3 * 50 * 32, 2 * 32, 0)


def test_train_py_stops_at_start_up_on_bad_data(tmp_path):
    result = subprocess.run([sys.executable, "train.py", "--ds_config", "ds_configs/tiny-cpu.json", "--data-path",
                             str(tmp_path / "missing_text_document"), "--set", f"training.save={tmp_path / 'ck'}",
                             "--set", "parallelism.tensor_parallel_size=1", "--set", "parallelism.pipeline_parallel_size=1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"dataset file {tmp_path / 'missing_text_document'}.idx does not exist" in result.stderr
    assert not (tmp_path / "ck").exists()  # nothing was started


def test_expert_parallelism_refuses_only_what_it_does_not_support_yet():
    """EP > 1 trains on ZeRO-1 / BF16_Optimizer (tests/test_model_parallel.py); it stops in run()'s first check,
    before data is read or a process group starts, only for what it does not support yet, one line each: a
    noise-scale batch schedule, another ZeRO stage than 1. Checkpoints are saved (tests/test_moe_training.py)."""
    from training.run import check_buildable

    raw = json.loads((ROOT / "ds_configs" / "llama-tiny-cpu.json").read_text())
    raw["model"]["moe"] = {"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 64}
    raw["parallelism"] = {**raw.get("parallelism", {}), "expert_parallel_size": 2}
    raw["zero_optimization"] = {**raw.get("zero_optimization", {}), "stage": 1}
    assert raw["training"]["save"]
    check_buildable(parse_run_config(raw))  # allowed, saving checkpoints too
    noise = {**raw, "schedule": {**raw["schedule"], "batch": {"type": "noise_scale", "start": 8, "factor": 1.0,
                                                              "interval_steps": 10}}}
    with pytest.raises(ValueError, match="cannot drive schedule.batch by the noise scale"):
        check_buildable(parse_run_config(noise))
    with pytest.raises(ValueError, match="needs zero_optimization.stage 1"):
        check_buildable(parse_run_config({**raw, "zero_optimization": {"stage": 0}}))


def _calls(name: str):
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == name:
                yield path, node


# The one loader of DeepSpeed's own files (they hold Python objects: its optimizer states, its bookkeeping): the
# checkpoint engine's load, which DeepSpeed's load_checkpoint calls. Everything else the project reads itself.
DEEPSPEED_FORMAT_LOADERS = {("training/checkpoint_engine.py", "load")}


def test_every_torch_load_is_weights_only():
    """Every file this project reads itself is loaded weights_only=True; DeepSpeed's own checkpoint files are read,
    as DeepSpeed reads them, by the checkpoint engine's load alone (weights_only=False)."""
    calls = list(_calls("torch.load"))
    assert calls
    for path, node in calls:
        keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
        function = _enclosing_function(path, node)
        if (str(path.relative_to(ROOT)), function) in DEEPSPEED_FORMAT_LOADERS:
            assert keywords.get("weights_only") == "False", f"{path}:{node.lineno}"
            continue
        assert keywords.get("weights_only") == "True", f"{path}:{node.lineno}"


def _enclosing_function(path: Path, call: ast.Call) -> str | None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.lineno <= call.lineno <= node.end_lineno:
            return node.name
    return None


PIPE_PICKLER = ROOT / "training" / "checkpoint_writer.py"
"""The one module that imports pickle: it pickles each snapshot's structure to the writer process it spawned, over
their own pipe (as multiprocessing's Connection does), and never reads a pickle from a file."""


def test_numpy_never_unpickles_and_no_remote_code():
    for path, node in _calls("np.load"):
        assert {k.arg: ast.unparse(k.value) for k in node.keywords}.get("allow_pickle") == "False", f"{path}:{node.lineno}"
    for path in SOURCES:
        text = path.read_text()
        assert "trust_remote_code=True" not in text, path
        if path == PIPE_PICKLER:
            assert "pickle.load(" not in text and "torch.load" not in text, path  # bytes from the pipe only
        else:
            assert "import pickle" not in text and "pickle.load" not in text, path

