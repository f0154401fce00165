"""DualPipeV (parallelism.pipeline_schedule "dualpipev") computes what 1F1B computes, from the ramp's first step.

The same tiny GPT is trained twice in one launch, under 1F1B and under DualPipeV, through a batch ramp whose first
steps have fewer than 2p micro-batches per pipeline (the V-shaped schedule, model/pipe_schedules.py) and whose
later steps have 2p and more (DeepSpeed's DualPipeVSchedule). fp32, dropout 0: the same layers compute the same
numbers, only where they run and when differs, so losses and gradient norms agree to 1e-5 (measured: equal to the
last bit here, or one fp32 rounding of the norm).

- (TP, PP, DP) = (1, 2, 1), (1, 4, 1) and (2, 2, 2) with sequence parallelism, 6 steps each; (2, 2, 1) runs through
  the launcher and the trainer below. At (1, 2, 1) a Mixture-of-Experts model too, its aux losses attached where its
  sparse blocks run, scaled by the micro-batch count of each step of the ramp.
- bf16 (BF16_Optimizer) under DualPipeV at (2, 2, 2) stays within the bounds tests/test_model_parallel.py derives
  from bf16's precision for bf16 against fp32.
- Through ``train.py`` (tests/launch.py) at TP 2 x PP 2: a DualPipeV run equals the 1F1B reference of
  tests/test_reshape.py step for step (its first 4 steps run the V-shaped schedule, the log says which and why);
  resumed under DualPipeV it continues bit for bit; its checkpoint resumes under 1F1B, and the 1F1B reference's
  under DualPipeV (another layout: through DeepSpeed's universal checkpoint), both within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from model.config import ParallelConfig
from tests.distributed import run_distributed
from tests.launch import run_training
from tests.test_model_parallel import MOE, SEED, deepspeed_config, model_config
from tests.test_reshape import BASE, RESUME_AT, STEPS, resumable_copy, steps
from tests.test_train import assert_log_z_at_initialisation
from training.engine import build_engine, pipeline_schedule_of

MICRO_BATCH = 1
# the stability monitors too: their probe is a one-micro-batch eval_batch (the V-shaped schedule, forward only), and
# they must not move the numbers
DUALPIPEV = ["parallelism.pipeline_schedule=\"dualpipev\"", "training.stability_interval=5"]


def ramp(stages: int) -> list[int]:
    """Micro-batches per pipeline at each of 6 steps: three below DualPipeV's 2p, three at or above it."""
    return [1, stages, 2 * stages - 1, 2 * stages, 2 * stages, 3 * stages]


def micro_batches(step: int, count: int, seq_length: int, data_parallel_rank: int, data_parallel_size: int):
    """``count`` micro-batches of this DP rank at ``step``: tokens from a skewed 200-token distribution, a loss mask
    with zeros (the last position, and a random tenth)."""
    generator = torch.Generator().manual_seed(1000 + step)
    rows = count * MICRO_BATCH * data_parallel_size
    weights = torch.arange(200, 0, -1, dtype=torch.float) ** 2
    samples = torch.multinomial(weights, rows * (seq_length + 1), replacement=True, generator=generator)
    samples = samples.view(rows, seq_length + 1)
    loss_mask = (torch.rand(rows, seq_length, generator=generator) > 0.1).float()
    loss_mask[:, -1] = 0.0
    positions = torch.arange(seq_length).expand(MICRO_BATCH, seq_length)
    for k in range(count):
        start = (k * data_parallel_size + data_parallel_rank) * MICRO_BATCH
        tokens = samples[start:start + MICRO_BATCH]
        yield (tokens[:, :-1], positions), (tokens[:, 1:], loss_mask[start:start + MICRO_BATCH])


def _train_both(tensor_parallel_size: int, pipeline_parallel_size: int, num_layers: int, sequence_parallel: bool,
                runs: list[tuple[str, str]]) -> list[dict]:
    """Each (schedule, precision) of ``runs`` from scratch through the ramp, one after the other in these processes."""
    results = []
    counts = ramp(pipeline_parallel_size)
    for schedule, precision, fields in runs:
        fields = dict(fields)
        expert_parallel_size = fields.pop("expert_parallel_size", 1)
        optimizer = fields.pop("optimizer", None)
        config = model_config(precision=precision, num_layers=num_layers, **fields)
        parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                  pipeline_parallel_size=pipeline_parallel_size, sequence_parallel=sequence_parallel,
                                  pipeline_schedule=schedule, expert_parallel_size=expert_parallel_size)
        data_parallel = torch.distributed.get_world_size() // (tensor_parallel_size * pipeline_parallel_size)
        ds_config = {**deepspeed_config(precision), "train_micro_batch_size_per_gpu": MICRO_BATCH,
                     "train_batch_size": max(counts) * MICRO_BATCH * data_parallel,
                     **({"optimizer": optimizer} if optimizer else {})}
        engine, ctx = build_engine(config, parallel, ds_config, SEED)
        record = {"losses": [], "norms": [], "schedules": [], "class": type(engine).__name__}
        for step, count in enumerate(counts):
            engine.set_train_batch_size(count * MICRO_BATCH * data_parallel)
            data = micro_batches(step, count, config.seq_length, ctx.data_parallel_rank, ctx.data_parallel_size)
            record["losses"].append(engine.train_batch(data_iter=data).item())
            record["norms"].append(float(engine.get_global_grad_norm()))
            record["schedules"].append(pipeline_schedule_of(engine))
            clip = getattr(engine.module, "qk_clip", None)  # MuonClip: this rank's heads' maxima, before clipping
            if clip is not None:
                record.setdefault("clip", []).append(clip.largest.clone())
        results.append(record)
        del engine
    return results


FP32_BOTH = [("1f1b", "fp32", {}), ("dualpipev", "fp32", {})]
# Mixture-of-Experts (tests/test_model_parallel.py's MOE): the aux losses attached where the blocks run follow the
# ramp's micro-batch count under both schedules (the engine sets it before each forward)
MOE_BOTH = [("1f1b", "fp32", MOE), ("dualpipev", "fp32", MOE)]
# ... and at EP 2 (DP 2): the experts split over the data-parallel ranks, each rank holding two stages of which the
# last ones hold the sparse blocks (the first two blocks dense)
MOE_EP2 = {**MOE, "moe": {**MOE["moe"], "first_dense_layers": 2}, "expert_parallel_size": 2}
MOE_EP2_BOTH = [("1f1b", "fp32", MOE_EP2), ("dualpipev", "fp32", MOE_EP2)]


# Muon (training/muon.py) with MuonClip at a tau the first steps pass: the clip's maxima, reduced before each step,
# are the same heads' under both schedules (each rank holds two stages of the V). A stage without the embedding or
# the head has no "decay" group under Muon, one param group fewer (training/engine.py pads its norm's all-reduces)
MUON_CLIP = {"optimizer": {"type": "Muon", "params": {"weight_decay": 0.1, "qk_clip": 1.0}}}
MUON_BOTH = [("1f1b", "fp32", MUON_CLIP), ("dualpipev", "fp32", MUON_CLIP)]


def schedule_pairs(runs: list[tuple[str, str, dict]]) -> list[tuple[int, int]]:
    """(1F1B run, DualPipeV run) of the same precision and model, by index in ``runs``."""
    return [(i, j) for i, plain in enumerate(runs) for j, dual in enumerate(runs)
            if plain[0] == "1f1b" and dual[0] == "dualpipev" and plain[1:] == dual[1:]]


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp, dp, num_layers, sequence_parallel, runs", [
    # stages of 2, 2, 1, 1 blocks: 3 a rank, as 530B's 105 / PP 35
    (1, 2, 1, 6, False, [*FP32_BOTH, *MOE_BOTH, *MUON_BOTH]),
    (1, 4, 1, 8, False, [*FP32_BOTH, *MUON_BOTH]),  # Muon: the 1F1B middle stages lack a "decay" group too
    (2, 2, 2, 4, True, [*FP32_BOTH, ("dualpipev", "bf16", {}), *MOE_EP2_BOTH]),
], ids=["1-2-1-moe", "1-4-1", "2-2-2-sp"])
def test_dualpipev_equals_1f1b_through_the_ramp(tp, pp, dp, num_layers, sequence_parallel, runs):
    ranks = run_distributed(tp * pp * dp, _train_both, tp, pp, num_layers, sequence_parallel, runs)
    expected_schedules = ["vshape"] * 3 + ["dualpipev"] * 3
    for rank_results in ranks:  # every rank reports the same DP-averaged loss and global norm
        for plain, dual in [(rank_results[i], rank_results[j]) for i, j in schedule_pairs(runs)]:
            assert plain["schedules"] == ["1f1b"] * 6
            assert dual["schedules"] == expected_schedules
            assert plain["class"] == "PipelineEngine" and dual["class"] == "DualPipeVEngineWithShortBatches"
            assert plain["losses"][-1] < plain["losses"][0] - 0.3
            torch.testing.assert_close(dual["losses"], plain["losses"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dual["norms"], plain["norms"], rtol=1e-5, atol=1e-5)
    for i, j in schedule_pairs(runs):  # MuonClip: every head's maxima at each step, whichever rank holds its block
        if "clip" in ranks[0][i]:
            plain, dual = ([torch.cat([rank[k]["clip"][step] for rank in ranks]).sort().values for step in range(6)]
                           for k in (i, j))
            # the schedules sum the micro-batches' gradients in other orders; 5 Muon steps later a head's largest
            # logit (over s^2 products) is 3.1e-5 apart (relative) at most, measured; the losses stay within 1e-5
            torch.testing.assert_close(dual, plain, rtol=1e-4, atol=1e-5)
            assert max(m.max() for m in plain) > MUON_CLIP["optimizer"]["params"]["qk_clip"]  # it clipped
    for rank_results in ranks:
        plain = rank_results[0]
        if runs[2:3] == [("dualpipev", "bf16", {})]:
            # bf16 against fp32, bounds from bf16's 8 significant bits (tests/test_model_parallel.py says how):
            # losses within 0.05 (one bf16 spacing of a loss near 10 is 2^-4); the first step's gradient norm within
            # 1% (only the bf16 forward and backward differ); later ones within 5% (the weights drift by Adam steps).
            bf16 = rank_results[2]
            assert bf16["schedules"] == expected_schedules
            torch.testing.assert_close(bf16["losses"], plain["losses"], rtol=0, atol=0.05)
            assert abs(bf16["norms"][0] - plain["norms"][0]) < 0.01 * plain["norms"][0]
            torch.testing.assert_close(bf16["norms"], plain["norms"], rtol=0.05, atol=0.05)


# -- through train.py and the launcher: parity, resume, and checkpoints across the schedules -------------------------
@pytest.fixture(scope="module")
def dualpipev_run(corpus, reshape_reference, tmp_path_factory):
    """The reshape reference's run (TP 2 x PP 2, 10 steps, checkpoints at 6 and 10) under DualPipeV."""
    save = tmp_path_factory.mktemp("dualpipev") / "checkpoints"
    result = run_training(corpus, save, STEPS, [*BASE, *DUALPIPEV])
    return save, result.stdout + result.stderr


@pytest.mark.distributed
def test_dualpipev_run_equals_the_1f1b_run(dualpipev_run, reshape_reference):
    save, output = dualpipev_run
    ours, theirs = steps(save), steps(reshape_reference)
    assert [r["micro_batches"] for r in ours] == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8]  # the ramp 4 -> 16, micro-batch 2
    assert [r["pipeline_schedule"] for r in ours] == ["vshape"] * 4 + ["dualpipev"] * 6
    assert [r["pipeline_schedule"] for r in theirs] == ["1f1b"] * 10
    assert ("[pipeline] from step 1: the V-shaped 1F1B on DualPipeV's stages (2 micro-batches per pipeline < "
            "2 x PP = 4, which DualPipeV needs)") in output
    assert "[pipeline] from step 5: DualPipeV (4 micro-batches per pipeline >= 2 x PP = 4)" in output
    for key in ("lr", "global_batch", "consumed_samples", "consumed_tokens"):
        assert [r[key] for r in ours] == [r[key] for r in theirs], key
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in theirs], rtol=1e-5, atol=0, msg=key)
    assert_log_z_at_initialisation(ours[0])
    for r in ours:  # the monitors: log Z from every step, the probe and the update ratio on steps 5 and 10
        assert r["log_z_min"] < r["log_z_mean"]  # the tokens' contexts differ, so do their log Z
        assert ("max_attention_logit" in r) == (r["step"] % 5 == 0)
        if r["step"] % 5 == 0:
            assert len(r["attention_logit_per_layer"]) == 4
            assert r["max_attention_logit"] == max(r["attention_logit_per_layer"]) > 0
            assert 0 < r["update_rms_ratio"]["matrices"] < 0.2 and 0 < r["update_rms_ratio"]["vectors"] < 0.2


@pytest.mark.distributed
@pytest.mark.parametrize("source, schedule", [("dualpipev", "dualpipev"), ("dualpipev", "1f1b"),
                                              ("1f1b", "dualpipev")])
def test_resume_across_schedules(source, schedule, dualpipev_run, reshape_reference, corpus, tmp_path):
    """A checkpoint of either schedule resumes under either: bit for bit under its own schedule; under the other
    within 1e-5, through DeepSpeed's universal checkpoint (the ZeRO files hold another rank's layers)."""
    written = dualpipev_run[0] if source == "dualpipev" else reshape_reference
    save = resumable_copy(written, tmp_path)
    result = run_training(corpus, save, STEPS, [*BASE, *(DUALPIPEV if schedule == "dualpipev" else [])])
    output = result.stdout + result.stderr
    ours, theirs = steps(save), steps(written)[RESUME_AT:]
    assert [r["step"] for r in ours] == list(range(RESUME_AT + 1, STEPS + 1))
    assert [r["pipeline_schedule"] for r in ours] == [schedule] * (STEPS - RESUME_AT)
    for key in ("lr", "global_batch", "consumed_samples", "consumed_tokens"):
        assert [r[key] for r in ours] == [r[key] for r in theirs], key
    if source == schedule:
        assert "written at" not in output  # the same layout: loaded directly
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in ours] == [r[key] for r in theirs], key
        return
    suffix = {"dualpipev": " (DualPipeV)", "1f1b": ""}
    assert (f"resumed global_step{RESUME_AT} written at TP 2 x PP 2 x DP 1{suffix[source]}; "
            f"now TP 2 x PP 2 x DP 1{suffix[schedule]}:") in output
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in theirs], rtol=1e-5, atol=0, msg=key)


@pytest.mark.distributed
def test_a_dualpipev_checkpoint_exports_and_evaluates_as_the_1f1b_one(dualpipev_run, reshape_reference, tmp_path):
    """The layer files are the same under both schedules: the Hugging Face export of the DualPipeV run's last
    checkpoint holds the 1F1B run's tensors (the runs agree to 1e-5), transformers loads it, and tools/evaluate.py
    scores both checkpoints alike (here in one process, through the reshape)."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.test_evaluation import ONE_PROCESS, run_tool
    from tools.convert_to_hf import main as convert_to_hf

    exports, scores = {}, {}
    for name, checkpoint in (("dualpipev", dualpipev_run[0]), ("1f1b", reshape_reference)):
        assert convert_to_hf(["--checkpoint", str(checkpoint), "--output", str(tmp_path / name)]) == 0
        exports[name] = {k: v for f in sorted((tmp_path / name).glob("*.safetensors")) for k, v in load_file(f).items()}
        result = run_tool("evaluate.py", "--checkpoint", str(checkpoint), "--tasks", "alice_lastword", "--limit", "8",
                          "--output", str(tmp_path / f"{name}.json"), *ONE_PROCESS)
        assert result.returncode == 0, result.stderr[-3000:]
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())["results"]["alice_lastword"]
    assert exports["dualpipev"].keys() == exports["1f1b"].keys()
    for key, tensor in exports["dualpipev"].items():
        theirs = exports["1f1b"][key]
        if key.endswith("attn.c_attn.bias"):  # [q; k; v]: the key bias shifts every score of a query alike, so its
            # true gradient is 0 and Adam turns the rounding noise into lr-sized steps (measured: 1e-4 apart, the
            # rest of the tensors at most 6e-8); the query and value biases are compared
            h = tensor.numel() // 3
            tensor, theirs = torch.cat([tensor[:h], tensor[2 * h:]]), torch.cat([theirs[:h], theirs[2 * h:]])
        torch.testing.assert_close(tensor, theirs, rtol=1e-4, atol=1e-6, msg=key)
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "dualpipev"))
    assert scores["dualpipev"]["acc,none"] == scores["1f1b"]["acc,none"]
    assert scores["dualpipev"]["perplexity,none"] == pytest.approx(scores["1f1b"]["perplexity,none"], rel=1e-4)


@pytest.mark.parametrize("stages", [2, 3, 5, 8, 35])
def test_deepspeeds_partition_gives_every_rank_its_share_of_the_blocks(stages):
    """What the layout check relies on (model/config/parallel.py): DeepSpeed's partition of L = k PP blocks into 2 PP stages,
    the larger first, gives rank r (stages r and 2 PP - 1 - r) k blocks for every k >= 2, odd k included (530B: 105
    over PP 35, stages of 2 and 1)."""
    from model.summary import count_stages
    from tests.test_model_parallel import model_config

    for blocks_per_rank in (2, 3, 4, 5):
        config = model_config(num_layers=blocks_per_rank * stages)
        counts = count_stages(config, 1, stages, pipeline_schedule="dualpipev")
        assert [len(c.blocks) for c in counts] == [blocks_per_rank] * stages
        assert sorted(n for c in counts for n in c.blocks) == list(range(1, config.num_layers + 1))
