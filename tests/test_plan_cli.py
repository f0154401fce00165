"""tools/plan.py as a user runs it: the tables, exit status and errors, --search, and --json as an interface.

--json is read by other programs, so its keys and values are pinned: tools/plan.py --json on 530b (280, 350, 420
and 560 nodes), 1.3b (1, 2 and 8 H100 nodes), llama3-70b (64 H100 nodes) and 530b --search must give every key and
value of the golden documents in tests/golden/ (written before the planner became a package), at schema_version 1.
A key may be added; a key renamed or removed, or a value changed, fails here: bump planner.report.SCHEMA_VERSION,
regenerate the golden file deliberately and say what changed in docs/planning.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from planner.hardware import GPU_PRESETS, Assumptions
from planner.plan import plan_cluster
from planner.report import SCHEMA_VERSION
from planner.search import candidate_layouts, search_layouts
from runconfig.run import load_run_config
from tests.test_planner import LAYER_NONE, LAYER_STORED, SELECTIVE_SP
from tools.plan import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "ds_configs" / "530b.json"
GOLDEN = Path(__file__).resolve().parent / "golden"
A100, DEFAULTS = GPU_PRESETS["a100-80gb"], Assumptions()
LLAMA3_70B = ['model.preset="llama3-70b"', "parallelism.tensor_parallel_size=8", "parallelism.pipeline_parallel_size=8",
              "train_micro_batch_size_per_gpu=1", "train_batch_size=1024", "schedule.batch={}", 'model.recompute="full"']


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    status = plan_main(["--ds_config", str(RECIPE), *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_plans_the_recipe(capsys):
    status, out, err = run_cli(capsys, "--nodes", "280,350")
    assert status == 0 and err == ""
    assert "529,600,819,200 from the modules, 529,600,819,200 analytic (equal)" in out
    assert "verdict: fits" in out and "warning: ramp batch sizes not divisible by micro-batch x DP = 10" in out
    assert "280   2240    8   240   0.142" in out  # the comparison table: nodes, GPUs, DP, m, bubble


def test_cli_prints_tokens_per_parameter_and_compute_optimal_sizes(capsys):
    status, out, _ = run_cli(capsys, "--nodes", "280")
    assert status == 0
    assert "compute-optimal size for the run's C = 6 N D = 8.58e+23 FLOPs" in out
    assert "this run                                             529.6B         270B                   0.51" in out
    assert "Hoffmann et al. 2022, approach-3 fit                 38.54B" in out
    assert "rule of thumb: 20 tokens per parameter               84.56B" in out


def test_cli_attention_scores_option(capsys):
    def stage0_peak(*args: str) -> int:
        status, out, _ = run_cli(capsys, "--nodes", "280", "--json", *args)
        assert status == 0
        return json.loads(out)["plans"][0]["memory"][0]["total"]

    default = stage0_peak()
    assert stage0_peak("--flash-attention") == stage0_peak("--attention-scores", "recomputed") == default
    # with full recompute only the recomputed block's working set holds the scores: 8 s b h more, less the logsumexp
    assert stage0_peak("--attention-scores", "stored") - default == LAYER_STORED - LAYER_NONE
    with pytest.raises(SystemExit):  # contradictory: refused by argparse
        run_cli(capsys, "--nodes", "280", "--flash-attention", "--attention-scores", "stored")


def test_cli_json_has_the_documented_schema(capsys):
    status, out, _ = run_cli(capsys, "--nodes", "560", "--gpu", "h100-80gb", "--matmul-efficiency", "0.5",
                             "--iteration-seconds", "30", "--json")
    report = json.loads(out)
    assert status == 0 and set(report) == {"schema_version", "config", "gpu", "assumptions", "storage", "deepspeed",
                                           "parameters", "compute_optimal", "plans"}
    assert report["gpu"]["peak_tflops"] == 989 and report["assumptions"]["matmul_efficiency"] == 0.5
    assert report["assumptions"]["attention_scores"] == "recomputed"
    optimal = report["compute_optimal"]
    assert set(optimal) == {"flops", "run", "chinchilla", "twenty_tokens_per_parameter", "law"}
    assert optimal["run"] == {"parameters": 529_600_819_200, "tokens": 270e9,
                              "tokens_per_parameter": pytest.approx(270e9 / 529_600_819_200)}
    assert set(optimal["chinchilla"]) == {"parameters", "tokens", "tokens_per_parameter"}
    assert optimal["law"] == {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
    plan = report["plans"][0]
    assert (plan["data_parallel_size"], plan["micro_batches"], plan["errors"]) == (16, 120, [])
    assert len(plan["memory"]) == 35 and plan["memory"][0]["micro_batches_held"] == 35
    assert plan["full_batch"]["micro_batch"]["stage"] == 34 and plan["training"]["steps"] > 0
    assert plan["measured"]["tflops_per_gpu"] == pytest.approx(plan["flops"]["full_batch"] / (30 * 4480) / 1e12)


@pytest.mark.parametrize("args, reason", [
    (["--nodes", "100"], "data parallelism is not a whole number: 100 nodes x 8 GPUs = world size 800 is not "
                         "divisible by tensor_parallel_size (8) x pipeline_parallel_size (35) = 280"),
    (["--nodes", "280", "--set", "train_micro_batch_size_per_gpu=7"],
     "the full batch train_batch_size=1920 is not divisible by micro-batch x DP = 7 x 8 = 56"),
    (["--nodes", "280", "--set", "model.recompute=\"none\"", "--attention-scores", "stored"],
     "memory exceeded: stage 0 needs 101.1 GiB of the a100-80gb's 80 GiB"),
    # 8 N + 12 N / 8 + 35 x 4 x 2 s b h + (11 s b h + 80 s b) + 2 x 2 s b h + 2 GiB = 31.8 GiB
    (["--nodes", "280", "--gpu", "a100-40gb", "--memory-gib", "30"], "memory exceeded: stage 0 needs 31.8 GiB"),
    (["--nodes", "280,x"], "--nodes '280,x': expected positive numbers"),
    (["--nodes", "280,350", "--iteration-seconds", "60.1"], "--iteration-seconds has 1 values for 2 node counts"),
    (["--nodes", "280", "--matmul-efficiency", "1.5"], "matmul_efficiency must be in (0, 1]"),
    (["--nodes", "280", "--set", "zero_optimization.stage=2"], "the planner models ZeRO stage 1"),
])
def test_cli_impossible_plans_exit_1_with_the_reason(capsys, args, reason):
    status, _, err = run_cli(capsys, *args)
    assert status == 1 and reason in err


def test_cli_search_finds_a_layout_at_least_as_fast_as_the_papers(capsys, parameters):
    """530B at 280 nodes: the best layout fits and is no slower than the paper's TP 8 x PP 35 with SP + selective."""
    status, out, err = run_cli(capsys, "--nodes", "280", "--search")
    assert status == 0 and err == ""
    # at CP 1: 576 under 1F1B (46 fit), 144 under DualPipeV (67 fit in all); 840 at CP 2, 4 and 8 (TP x CP <= 8)
    assert "1560 layouts tried, 95 fit in 80 GiB" in out
    best = next(line for line in out.splitlines() if line.startswith("   1 "))
    assert best.split()[1:4] == ["8", "35", "8"]
    status, out, _ = run_cli(capsys, "--nodes", "280", "--search", "--json", "--top", "5")
    report = json.loads(out)
    assert status == 0 and len(report["layouts"]) == 5 and report["best"] == report["layouts"][0]
    assert report["layouts_tried"] == 1560 and 0 < report["layouts_fitting"] < 1560
    papers = plan_cluster(load_run_config(RECIPE, SELECTIVE_SP), 280, A100, DEFAULTS, parameters)
    assert report["best"]["peak_memory_bytes"] <= 80 * 2**30
    assert report["best"]["iteration_seconds"] <= papers.full_batch.seconds
    seconds = [layout["iteration_seconds"] for layout in report["layouts"]]
    assert seconds == sorted(seconds)
    assert {"recompute", "recompute_num_layers", "sequence_parallel", "pipeline_schedule", "mfu", "hfu"} <= \
        set(report["best"])


def test_search_enumerates_the_documented_layouts(recipe):
    layouts = candidate_layouts(recipe, 2240, 8)
    # PP divides 105 and TP x PP 2240: 1, 5, 7, 35; only PP 7 and 35 leave a DP that splits the batch of 1920
    assert {(x.tensor_parallel_size, x.pipeline_parallel_size) for x in layouts} == \
        {(t, p) for t in (1, 2, 4, 8) for p in (7, 35)}
    assert all(1920 % (x.micro_batch_size * x.data_parallel_size) == 0 for x in layouts)
    # Ulysses: CP dividing a TP rank's 128 / TP heads, its groups within a node, 1F1B only
    ulysses = [x for x in layouts if x.context_parallel_size > 1]
    assert {(x.tensor_parallel_size, x.context_parallel_size) for x in ulysses} == \
        {(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)}
    assert all(x.pipeline_schedule == "1f1b" and x.tensor_parallel_size * x.pipeline_parallel_size
               * x.context_parallel_size * x.data_parallel_size == 2240 for x in ulysses)
    assert not any(x.sequence_parallel for x in layouts if x.tensor_parallel_size == 1)
    at_paper = {(x.recompute, x.recompute_num_layers) for x in layouts
                if (x.tensor_parallel_size, x.pipeline_parallel_size, x.micro_batch_size) == (8, 35, 1)}
    assert at_paper == {("none", None)} | {(m, n) for m in ("selective", "full") for n in (None, 1, 2)}
    # DualPipeV where the full batch gives 2 PP micro-batches per pipeline: at TP 8 x PP 35 (DP 8) micro-batch 1 and
    # 2 (240 and 120 per pipeline, against 70), not 4 (60)
    dual = {(x.pipeline_parallel_size, x.micro_batch_size) for x in layouts if x.pipeline_schedule == "dualpipev"
            and x.tensor_parallel_size == 8}
    assert (35, 1) in dual and (35, 2) in dual and (35, 4) not in dual
    assert all(1920 // (x.micro_batch_size * x.data_parallel_size) >= 2 * x.pipeline_parallel_size
               for x in layouts if x.pipeline_schedule == "dualpipev")
    layouts = [x for x in layouts if x.pipeline_schedule == "1f1b"]
    spread = {x.recompute_num_layers for x in layouts if x.pipeline_parallel_size == 7 and x.recompute == "full"}
    assert spread == {None, 2, 4, 6, 8, 9, 11, 13}  # 15 blocks a stage: 7 counts spread over them, and all


def test_search_counts_each_parallel_split_once(recipe):
    calls = []

    def counting(tp: int, pp: int, schedule: str):
        from model.summary import count_stages

        calls.append((tp, pp, schedule))
        return count_stages(recipe.model, tp, pp, pipeline_schedule=schedule)

    tried, results = search_layouts(recipe, 280, A100, DEFAULTS, counting)
    # (TP, PP) under 1F1B, and DualPipeV's: the same counts serve every CP
    assert len(calls) == len(set(calls)) == 8 + 4 and tried == 1560
    assert results and all(r.fits for r in results)


# ------------------------------------------------------------------------------------------ --json as an interface


def sets(settings: list[str]) -> list[str]:
    return [word for setting in settings for word in ("--set", setting)]


JSON_RUNS = {  # golden file -> the tools/plan.py arguments that wrote it
    "plan_530b.json": ["--ds_config", "ds_configs/530b.json", "--nodes", "280,350,420,560"],
    "plan_1.3b.json": ["--ds_config", "ds_configs/1.3b.json", "--nodes", "1,2,8", "--gpu", "h100-80gb"],
    "plan_llama3-70b.json": ["--ds_config", "ds_configs/1.3b.json", "--nodes", "64", "--gpu", "h100-80gb",
                             *sets(LLAMA3_70B)],
    "plan_search_530b.json": ["--ds_config", "ds_configs/530b.json", "--nodes", "280", "--search"],
}


def differences(golden, new, path: str = "") -> list[str]:
    """Every key of ``golden`` missing from ``new`` or holding another value (floats to 1e-12 relative: the same
    arithmetic may be reassociated); keys only ``new`` has are allowed."""
    if isinstance(golden, dict):
        if not isinstance(new, dict):
            return [f"{path}: {type(new).__name__} instead of an object"]
        return [d for key, value in golden.items()
                for d in (differences(value, new[key], f"{path}.{key}") if key in new else [f"{path}.{key}: removed"])]
    if isinstance(golden, list):
        if not isinstance(new, list) or len(new) != len(golden):
            return [f"{path}: a list of {len(golden)} became {new!r:.80}"]
        return [d for i, (a, b) in enumerate(zip(golden, new, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(golden, float) and isinstance(new, (int, float)) and math.isclose(golden, new, rel_tol=1e-12):
        return []
    return [] if golden == new else [f"{path}: {golden!r} became {new!r}"]


def test_differences_catches_a_renamed_key_and_a_changed_value():
    assert differences({"a": {"seconds": 1.0}, "b": [1, 2]}, {"a": {"seconds": 1.0, "new": 3}, "b": [1, 2]}) == []
    assert differences({"a": {"seconds": 1.0}}, {"a": {"iteration_seconds": 1.0}}) == [".a.seconds: removed"]
    assert differences({"b": [1, 2.0]}, {"b": [1, 2.5]}) == [".b[1]: 2.0 became 2.5"]


@pytest.mark.parametrize("name", sorted(JSON_RUNS))
def test_json_keeps_every_key_and_value(capsys, monkeypatch, name):
    monkeypatch.chdir(ROOT)
    status = plan_main([*JSON_RUNS[name], "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["schema_version"] == SCHEMA_VERSION == 3
    assert differences(json.loads((GOLDEN / name).read_text()), report) == []


# ------------------------------------------------------------------------------- long context: --context-parallel
LLAMA3_8B_128K = ["model.preset=\"llama3-8b\"", "data.eod_token_id=128001", "model.seq_length=131072",
                  "train_micro_batch_size_per_gpu=1", "train_batch_size=16", "schedule.batch={}",
                  "parallelism.tensor_parallel_size=2", "parallelism.sequence_parallel=true",
                  "parallelism.pipeline_parallel_size=1", "model.recompute=\"full\""]


def test_context_parallel_table_finds_the_longest_sequence_each_cp_fits(capsys):
    """Llama-3-8B at 128k on 4 H100 nodes: CP 1 does not fit, CP 2 and 4 do; the longest sequence that fits doubles
    with CP (the weights' share is the same at every CP) and is the last multiple of the unit that fits."""
    from planner.context import context_parallel_rows, with_sequence
    from planner.memory import count_parameters

    status, out, err = run_cli(capsys, "--ds_config", "ds_configs/1.3b.json", "--gpu", "h100-80gb", "--nodes", "4",
                               *sets(LLAMA3_8B_128K), "--context-parallel", "1,2,4")
    assert status == 0 and "error: CP 1: memory exceeded" in err
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(row[0], row[1], row[3]) for row in rows] == [("1", "16", "no"), ("2", "8", "yes"), ("4", "4", "yes")]
    config = load_run_config(ROOT / "ds_configs" / "1.3b.json", LLAMA3_8B_128K)
    h100 = GPU_PRESETS["h100-80gb"]
    found = context_parallel_rows(config, 4, h100, DEFAULTS, [1, 2])
    assert [row.longest_sequence for row in found] == [92160, 184320]
    assert [int(row[-4].replace(",", "")) for row in rows[:2]] == [92160, 184320]
    parameters = count_parameters(config)  # RoPE: the same at every length
    for row in found:
        unit = 1024 * row.context_parallel_size * 2  # x TP with sequence parallelism
        beyond = with_sequence(config, row.longest_sequence + unit, row.context_parallel_size)
        assert row.longest_plan.ok and not plan_cluster(beyond, 4, h100, DEFAULTS, parameters).ok
