"""DPO through train.py (training.dpo, training/preference_data.py): the pair loader, the reference file, resume.

The model: a small random Llama built by transformers (vocabulary 512, h 64, 4 layers), imported at TP 1 x PP 1 and
at TP 2 x PP 2 (tools/convert_from_hf.py). The pairs: 13 random (prompt, chosen, rejected) token triples written in
tools/preprocess_data.py's preference layout (data/preference.py), twice (one copy per import: a reference file
belongs to one checkpoint). Their reference log-probs: training/preference_data.py's, from each import, on one
process. One run of 10 steps with the batch ramp 4 -> 8 sequences (2 -> 4 pairs; 26 rows an epoch, so epochs turn
mid-batch):

- at 1 process with micro-batches of 4 rows, a checkpoint at step 5; that checkpoint resumed to step 10: bitwise the
  same steps 6-10 and weights;
- at TP 2 x PP 2 x DP 2 with sequence parallelism, micro-batches of 2 rows (two per replica at the full batch), and
  the reference computed in the step (training.dpo.reference "model", the TP 2 x PP 2 import frozen): every step's
  loss, gradient norm and TRL metrics within 1e-5 of the 1-process run on the file (measured: 4e-6 at most, the
  gradient norm's); the first step's rewards 0 (the policy is the reference: the file and the frozen model give what
  the loss computes for the policy). A loader that put a global batch's chosen rows first, so that pairs straddle micro-batches of 2 rows but
  not of 4, fails this (tried once).

Single process, no launch: the loader gives the same pairs to any micro-batch x DP split of a global batch, and a
reference file of another checkpoint or another data set is refused, naming both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from data.indexed_dataset import IndexedDatasetBuilder
from data.loss_mask import loss_mask_prefix, tokens_prefix
from data.preference import data_fingerprint, write_preference_meta
from tests.launch import final_weights, resumable_copy, run_training, same_weights
from tests.test_model_parallel import LR, SEED, deepspeed_config
from training.metrics_log import read_metrics

SEQ, VOCAB, PAIRS, STEPS, RESUME_AT = 32, 512, 13, 10, 5
TOLERANCE = 1e-5
WHOLE = ["train_micro_batch_size_per_gpu=4"]  # 1 process: 1 then 2 micro-batches of 2 pairs; the split run's hold 1
METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
           "logps/rejected", "rewards/accuracies")


def write_pairs(prefix: Path, seed: int = 0, pairs: int = PAIRS) -> Path:
    """Random pairs in data/preference.py's layout: a prompt of 3-10 tokens, completions of 2-12 (mask 1)."""
    generator = np.random.default_rng(seed)
    tokens, masks = tokens_prefix(str(prefix)), loss_mask_prefix(tokens_prefix(str(prefix)))
    with IndexedDatasetBuilder(tokens, np.uint16) as token_file, IndexedDatasetBuilder(masks, np.uint8) as mask_file:
        for _ in range(pairs):
            prompt = generator.integers(1, VOCAB, generator.integers(3, 11))
            for _side in ("chosen", "rejected"):
                completion = generator.integers(1, VOCAB, generator.integers(2, 13))
                token_file.add_item(np.concatenate([prompt, completion]))
                mask_file.add_item(np.r_[np.zeros(len(prompt)), np.ones(len(completion))].astype(np.uint8))
                token_file.end_document()
                mask_file.end_document()
    write_preference_meta(prefix, {"pairs": pairs, "seq_length": SEQ, "truncation": "drop", "tokenizer": None,
                                   "fingerprint": data_fingerprint(prefix), "refused": {}})
    return prefix


def small_llama(directory: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.test_hf_llama import hf_config

    torch.manual_seed(SEED)
    config = hf_config("LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return directory


def run_config(hf_dir: Path, tensor_parallel_size: int, pipeline_parallel_size: int) -> dict:
    from hf.config_map import model_fields_from_hf, read_hf_config
    from runconfig.run import parse_run_config

    model = {**model_fields_from_hf(read_hf_config(hf_dir)), "seq_length": SEQ, "precision": "fp32"}
    raw = {**deepspeed_config("fp32"), "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "model": model,
           "parallelism": {"tensor_parallel_size": tensor_parallel_size,
                           "pipeline_parallel_size": pipeline_parallel_size},
           "schedule": {"lr": LR, "warmup_tokens": 64, "decay_tokens": 2048, "train_tokens": 1e6,
                        "batch": {"start": 4, "increment": 4, "ramp_tokens": 256}},
           "data": {"eod_token_id": 0},
           "training": {"seed": SEED, "dpo": {"beta": 0.1}, "log_interval": 1, "eval_iters": 0}}
    return parse_run_config(raw).to_dict()


def _references(jobs: list[tuple[str, str]]) -> None:
    """On one process: each (checkpoint, prefix)'s reference file, at TP 1 x PP 1 whatever the checkpoint's."""
    from data.preference import PreferencePairs
    from evaluation.loading import load_pipeline
    from model.config import ParallelConfig
    from training.preference_data import checkpoint_identity, compute_reference_logps, write_reference

    for checkpoint, prefix in jobs:
        pipeline, loaded = load_pipeline(checkpoint, None, ParallelConfig(1, 1))
        pairs = PreferencePairs(prefix)
        write_reference(prefix, compute_reference_logps(pipeline, pairs, batch_size=5),
                        checkpoint_identity(loaded.directory, loaded.tag), pairs.fingerprint)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    from tests.distributed import run_distributed
    from tests.test_dpo import imported

    root = tmp_path_factory.mktemp("dpo_training")
    hf_dir = small_llama(root / "hf")
    found = {}
    for name, tp, pp in (("whole", 1, 1), ("split", 2, 2)):
        raw = run_config(hf_dir, tp, pp)
        found[name] = {"checkpoint": imported(hf_dir, raw, root / f"import-{name}"), "config": root / f"{name}.json",
                       "data": write_pairs(root / f"data-{name}" / "pairs")}
        found[name]["config"].write_text(json.dumps(raw))
    run_distributed(1, _references, [(str(found[name]["checkpoint"]), str(found[name]["data"]))
                                     for name in ("whole", "split")])
    found["root"] = root
    return found


def _run(setup: dict, name: str, save: Path, processes: int, extra: list[str] = ()) -> list[dict]:
    run = setup[name]
    run_training(run["data"], save, STEPS, processes=processes, ds_config=str(run["config"]),
                 base=[f"training.init_from={run['checkpoint']}", "training.fine_tune=true",
                       f"training.save_interval={RESUME_AT}", "training.checkpoint_mode=sync", *extra])
    return [record for record in read_metrics(save / "metrics.jsonl") if "loss" in record]


@pytest.mark.distributed
def test_dpo_runs_the_same_at_any_split_and_resumes_bitwise(setup):
    root = setup["root"]
    whole = _run(setup, "whole", root / "whole" / "checkpoints", 1, WHOLE)
    resumed_save = resumable_copy(root / "whole" / "checkpoints", root / "resumed", RESUME_AT)
    resumed = _run(setup, "whole", resumed_save, 1, WHOLE)
    split = _run(setup, "split", root / "split" / "checkpoints", 8,
                 ["parallelism.sequence_parallel=true", "training.dpo={\"beta\": 0.1, \"reference\": \"model\"}"])
    for label, run in (("1 process", whole), ("TP 2 x PP 2 x DP 2, SP, reference model", split),
                       ("resumed at 5", resumed)):
        print(label, json.dumps([{name: r[name] for name in ("step", *METRICS)} for r in run]))
    print("largest |split - whole|:", {name: max(abs(a[name] - b[name]) for a, b in zip(whole[1:], split[1:], strict=True))
                                       for name in METRICS})

    assert [r["step"] for r in whole] == list(range(1, STEPS + 1))
    assert [r["global_batch"] for r in whole][:3] == [4, 4, 8]  # the ramp: 2 pairs, then 4
    assert [r["micro_batches"] for r in split][-1] == 2
    assert abs(whole[0]["rewards/chosen"]) < 1e-6 and abs(split[0]["rewards/margins"]) < 1e-4  # policy = reference
    for one, eight in zip(whole, split, strict=True):
        for name in METRICS[:-1] if one["step"] == 1 else METRICS:  # step 1: rewards 0 +- rounding, accuracy a toss
            assert eight[name] == pytest.approx(one[name], rel=TOLERANCE, abs=1e-6), (one["step"], name)
    assert whole[-1]["rewards/margins"] > 0  # the preference moved

    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in whole[RESUME_AT:]]
    assert same_weights(final_weights(root / "whole" / "checkpoints"), final_weights(resumed_save))


# -- single process ---------------------------------------------------------------------------------------------------

def test_every_split_of_a_global_batch_holds_the_same_whole_pairs(tmp_path):
    """Global batches of 8 rows over 3 steps at (micro-batch, DP) = (2, 1), (2, 2), (4, 2), (8, 1): the same rows,
    pairs at rows 2i / 2i + 1 of every micro-batch; a reshuffled second epoch."""
    from data.preference import PreferencePairs
    from training.preference_data import PairLoader, PreferenceRows

    pairs = PreferencePairs(write_pairs(tmp_path / "pairs", pairs=5))
    reference = -np.arange(10, dtype=np.float32)
    rows = PreferenceRows(pairs, reference, SEQ, seed=3, rows=24, pad_token_id=0)

    def batches(micro: int, dp: int) -> list[list[tuple]]:
        loaders = [PairLoader(rows, micro, rank, dp) for rank in range(dp)]
        steps = []
        for _ in range(3):
            step = []
            for _ in range(8 // (micro * dp)):
                for loader in loaders:
                    (tokens, _), (labels, mask, ref) = next(loader)
                    assert len(ref) % 2 == 0 and all(ref[0::2] % 2 == 0) and all(ref[1::2] == ref[0::2] - 1)
                    step += [(tuple(t.tolist()), tuple(m.tolist()), float(r)) for t, m, r in zip(tokens, mask, ref, strict=True)]
            steps.append(sorted(step))
        return steps

    expected = batches(2, 1)
    for micro, dp in ((2, 2), (4, 2), (8, 1)):
        assert batches(micro, dp) == expected, (micro, dp)
    assert sorted(rows.order(0).tolist()) == list(range(5)) and rows.order(1).tolist() != rows.order(0).tolist()
    pair, side = rows.locate(13)
    chosen_tokens, chosen_mask, _, _ = pairs.pair(pair)
    assert side == 1 and rows.locate(12) == (pair, 0)
    assert rows[12][:len(chosen_tokens)].tolist() == chosen_tokens.tolist()
    assert rows.sample_loss_mask(12).sum() == chosen_mask.sum()  # the padding is no target


def test_a_reference_file_of_another_checkpoint_or_data_set_is_refused(setup, tmp_path):
    from runconfig.run import load_run_config
    from training.preference_data import open_preference_data, reference_paths

    whole, split = setup["whole"], setup["split"]

    def config(data: Path, checkpoint: str):
        return load_run_config(whole["config"], [f"data.blend=[[1.0, \"{data}\"]]", f"training.init_from={checkpoint}",
                                                 "training.fine_tune=true"])

    pairs, reference = open_preference_data(config(whole["data"], whole["checkpoint"]), check_files=True)
    assert reference.shape == (2 * PAIRS,) and reference.dtype == np.float32 and (reference < 0).all()

    with pytest.raises(ValueError, match=r"holds the reference log-probs of checkpoint .*import-whole.* and the run "
                                         r"starts from .*import-split.*tools/reference_logps.py"):
        open_preference_data(config(whole["data"], split["checkpoint"]))

    other = write_pairs(tmp_path / "other", seed=1)
    for source, target in zip(reference_paths(str(whole["data"])), reference_paths(str(other)), strict=True):
        shutil.copy(source, target)
    with pytest.raises(ValueError, match=rf"computed on other data: its data fingerprint is {pairs.fingerprint}, "
                                         rf".*other's is {data_fingerprint(other)}"):
        open_preference_data(config(other, whole["checkpoint"]))


def test_what_dpo_does_not_run_with_is_refused_at_start_up():
    from runconfig.run import load_run_config
    from training.run import check_buildable

    def refused(*overrides: str) -> str:
        with pytest.raises(ValueError) as error:
            check_buildable(load_run_config("ds_configs/tiny-cpu.json", ["training.dpo={}", "training.eval_interval=0",
                                                                         *overrides]))
        return str(error.value)

    assert "model.moe" in refused("model.preset=\"deepseek-tiny\"", "model.mtp=null")
    assert "held-out" in refused("training.eval_interval=5")
