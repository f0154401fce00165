"""scripts/gpu_smoke.sh, the first run on a GPU, checked without one: its help, and its dry run against the real code.

The dry run prints every command it would run. Each training command is parsed by train.py's own parser, its
config loaded with its --set overrides by runconfig/run.py and checked against a world of 1 process, as train.py
does before anything is built; each planner command is run for real (tools/plan.py needs no GPU) and must say the
run fits on the GPU and takes a few seconds a step.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import train
from runconfig.run import load_run_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_smoke.sh"
CONFIGS = ["125m", "1.3b"]


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def printed_commands(stdout: str) -> list[list[str]]:
    """The "+ command" lines, split as the shell splits them (a trailing "> file" redirect dropped)."""
    commands = []
    for line in stdout.splitlines():
        if line.startswith("+ "):
            words = shlex.split(line[2:])
            commands.append(words[:words.index(">")] if ">" in words else words)
    return commands


@pytest.fixture(scope="module")
def dry_run() -> list[list[str]]:
    before = sorted((ROOT / "runs" / "gpu_smoke").rglob("*")) if (ROOT / "runs" / "gpu_smoke").exists() else None
    result = run_script("--dry-run")
    assert result.returncode == 0, result.stderr
    after = sorted((ROOT / "runs" / "gpu_smoke").rglob("*")) if (ROOT / "runs" / "gpu_smoke").exists() else None
    assert before == after  # it ran nothing
    return printed_commands(result.stdout)


def test_help():
    result = run_script("--help")
    assert result.returncode == 0
    for word in ("--dry-run", "--skip-install", "--steps", "--allow-cpu", "--build-wheels", "125m.json", "1.3b.json",
                 "30 steps", "TP 1 x PP 1", "bf16", "under 8"):
        assert word in result.stdout, word
    assert run_script("--no-such-option").returncode == 2


def train_commands(commands: list[list[str]]) -> list[list[str]]:
    """The arguments train.py receives (everything after the launched script) of each training command."""
    found = []
    for words in commands:
        if "scripts/gpu_smoke_train.py" in words:
            launcher = words[:words.index("scripts/gpu_smoke_train.py")]
            assert launcher[launcher.index("-m") + 1:launcher.index("--num_gpus") + 2] == [
                "deepspeed.launcher.runner", "--num_gpus", "1"]
            found.append(words[words.index("scripts/gpu_smoke_train.py") + 1:])
    return found


def test_dry_run_trains_both_configs_30_steps_bf16_tp1_pp1_on_one_gpu(dry_run):
    preprocess = [w for w in dry_run if "tools/preprocess_data.py" in w]
    assert len(preprocess) == 1 and "data/corpus/botchan.jsonl" in preprocess[0]
    prefix = preprocess[0][preprocess[0].index("--output-prefix") + 1]
    runs = train_commands(dry_run)
    assert len(runs) == 5  # both configs, 125m compiled, then the 125m run stopped at step 20 and resumed
    for name, argv in zip(CONFIGS, runs[:2], strict=True):
        args = train.parse_args(argv)
        assert args.ds_config == f"ds_configs/{name}.json" and args.data_path == [f"{prefix}_text_document"]
        config = load_run_config(ROOT / args.ds_config, args.set)  # the real config code, as train.py runs it
        assert config.check_world(1) == 1  # DP 1: every batch size divides, as train.py checks before starting
        assert (config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size) == (1, 1)
        assert config.model.precision == "bf16" and config.deepspeed["bf16"]["enabled"] is True
        assert config.training.max_steps == 30 and config.training.log_interval == 1
        assert config.training.save == f"runs/gpu_smoke/{name}" and config.training.checkpoint_mode == "async"
        assert config.training.save_interval == (10 if name == "125m" else 0)  # the stall check reads 125m's saves
        assert config.batch_schedule()(0) == config.global_batch_size == 64  # a fixed batch from the first step
        assert config.deepspeed["optimizer"]["params"]["torch_adam"] is True  # nothing to compile on the GPU
        assert config.training.plan_hardware == "h200"  # measured / planned at every step, on tools/plan.py's preset
        snapshot = config.training.memory_snapshot  # 125m: a CUDA memory snapshot after step 3, Python stacks
        assert snapshot == ({"step": 3, "on_oom": False, "stacks": "python"} if name == "125m" else None)


def test_dry_run_plans_the_same_runs_and_they_fit(dry_run):
    plans = [w for w in dry_run if "tools/plan.py" in w]
    assert len(plans) == 2
    total_seconds = 0.0
    for name, plan, run in zip(CONFIGS, plans, train_commands(dry_run)[:2], strict=True):
        assert plan[plan.index("--ds_config") + 1] == f"ds_configs/{name}.json"
        assert plan[plan.index("--nodes") + 1] == "1" and plan[plan.index("--gpus-per-node") + 1] == "1"
        run_sets = train.parse_args(run).set
        plan_sets = [plan[i + 1] for i, word in enumerate(plan) if word == "--set"]
        assert plan_sets == [s for s in run_sets if not s.startswith("training.")]  # the same run, planned
        result = subprocess.run([sys.executable, *plan[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        planned = json.loads(result.stdout)["plans"][0]
        assert (planned["gpus"], planned["tensor_parallel_size"], planned["pipeline_parallel_size"]) == (1, 1, 1)
        assert planned["global_batch_size"] == 64 and not planned["errors"]
        assert all(stage["fits"] for stage in planned["memory"])
        total_seconds += 30 * planned["full_batch"]["seconds"]
    assert total_seconds < 150  # predicted training time of both runs on the H200: well inside the 8 minutes


def test_dry_run_installs_deepspeed_then_the_project_without_dependencies(dry_run):
    pip = [w for w in dry_run if w[1:4] == ["-m", "pip", "install"]]
    assert pip[-1][4:] == ["--no-deps", "--no-build-isolation", "-e", "."]
    assert any("deepspeed==0.19.8" in w or "--find-links" in w for w in pip[:-1])
    assert [w[1:3] for w in dry_run if "scripts/gpu_smoke.py" in w] == [["scripts/gpu_smoke.py", "check"],
                                                                        ["scripts/gpu_smoke.py", "report"]]


def test_site_option_installs_the_wheels_into_a_folder_on_pythonpath(dry_run):
    """--site DIR: the wheels go into DIR without dependencies (pip resolves nothing against the GPU image), and the
    repository and DIR go on PYTHONPATH in place of the editable install; the run itself is the same."""
    result = run_script("--dry-run", "--site", "/tmp/site")
    assert result.returncode == 0, result.stderr
    commands = printed_commands(result.stdout)
    pip = [w for w in commands if w[1:4] == ["-m", "pip", "install"]]
    assert len(pip) == 1 and "-e" not in pip[0]
    target = pip[0][4:]
    assert {"--no-index", "--no-deps"} <= set(target) and target[target.index("--target") + 1] == "/tmp/site"
    exports = [w[1] for w in commands if w[0] == "export"]
    assert len(exports) == 1 and exports[0].split("=", 1)[1].split(":")[:2] == [str(ROOT), "/tmp/site"]
    assert train_commands(commands) == train_commands(dry_run)
    skipped = printed_commands(run_script("--dry-run", "--skip-install", "--site", "/tmp/site").stdout)
    assert not [w for w in skipped if w[1:4] == ["-m", "pip", "install"]]
    assert any(w[0] == "export" and w[1].startswith("PYTHONPATH=") for w in skipped)


def test_steps_option_reaches_both_runs():
    result = run_script("--dry-run", "--steps", "5", "--set", "model.num_layers=2")
    assert result.returncode == 0, result.stderr
    runs = [load_run_config(ROOT / train.parse_args(argv).ds_config, train.parse_args(argv).set)
            for argv in train_commands(printed_commands(result.stdout))]
    assert [config.training.max_steps for config in runs] == [5, 5, 5, 2, 5]  # the stop at 2 x (5 // 3)
    assert all(config.model.num_layers == 2 for config in runs)


def test_dry_run_trains_125m_again_compiled_and_reports_it_against_eager(dry_run):
    """training.compile, off by default until measured on a GPU: the third run is 125m's, compiled, as many steps."""
    eager, compiled = (load_run_config(ROOT / train.parse_args(argv).ds_config, train.parse_args(argv).set)
                       for argv in (train_commands(dry_run)[0], train_commands(dry_run)[2]))
    assert (eager.training.compile, compiled.training.compile) == (False, True)
    assert compiled.training.save == "runs/gpu_smoke/125m-compiled" and compiled.training.save_interval == 0
    assert compiled.training.max_steps == eager.training.max_steps and compiled.model == eager.model
    assert compiled.global_batch_size == eager.global_batch_size and compiled.training.log_interval == 1
    report = next(w for w in dry_run if w[1:3] == ["scripts/gpu_smoke.py", "report"])
    assert report[report.index("--compiled") + 1] == "125m:125m-compiled"


# -- the checks on the checkpoint (scripts/gpu_smoke_checks.py): their commands, and each judge on known inputs ------

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_smoke_checks as checks  # noqa: E402


def test_dry_run_stops_and_resumes_the_125m_run_in_one_checkpoint_directory(dry_run):
    stopped, resumed = (load_run_config(ROOT / train.parse_args(argv).ds_config, train.parse_args(argv).set)
                        for argv in train_commands(dry_run)[3:])
    assert stopped.training.save == resumed.training.save == "runs/gpu_smoke/125m-resume"
    assert (stopped.training.max_steps, resumed.training.max_steps) == (20, 30)
    assert (stopped.training.checkpoint_mode, resumed.training.checkpoint_mode) == ("sync", "async")
    assert stopped.training.save_interval == resumed.training.save_interval == 10
    commands = [w for w in dry_run if any(Path(word).name == "gpu_smoke_checks.py" for word in w)]
    names = [words[2] for words in commands]
    assert names == ["flash", "hflm", "compare-eval", "hf-generate", "compare-generate", "resume", "stall",
                     "memory-snapshot", "document-masks", "host-syncs", "flex-memory", "skip", "summary"]
    parsed = [checks.build_parser().parse_args(words[2:]) for words in commands]  # each parses as the script runs it
    orders = sorted(int(args.order) for args in parsed if hasattr(args, "order"))
    assert orders == list(range(1, 11)) and parsed[-1].expected == "10"  # the summary expects every record
    syncs = parsed[names.index("host-syncs")]  # the 125m run's log, where gpu_smoke_train.py prints each step's
    assert syncs.train_log == Path("runs/gpu_smoke/125m.log") and syncs.ds_config == "ds_configs/125m.json"
    snapshot = parsed[names.index("memory-snapshot")].snapshot  # where the 125m run's trainer dumps it
    assert snapshot == "runs/gpu_smoke/125m/memory/snapshot_step3_rank0.pickle"
    assert [config.training.memory_snapshot for config in (stopped, resumed)] == [None, None]
    from tools.evaluate import build_parser as evaluate_parser
    from tools.generate import build_parser as generate_parser

    evaluation = evaluate_parser().parse_args(next(w for w in dry_run if "tools/evaluate.py" in w)[2:])
    generation = generate_parser().parse_args(next(w for w in dry_run if "tools/generate.py" in w)[2:])
    assert evaluation.dtype == generation.dtype == "fp32" and evaluation.log_samples  # what HFLM runs in, per request
    assert parsed[1].tasks == evaluation.tasks and parsed[1].limit == evaluation.limit


def _metrics(path: Path, losses: dict[int, float]) -> Path:
    path.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": v}) + "\n" for s, v in losses.items()))
    return path


def test_resume_check_passes_bitwise_and_fails_on_a_difference(tmp_path):
    straight = _metrics(tmp_path / "straight.jsonl", {s: 10.0 - s / 7 for s in range(1, 31)})
    stopped = _metrics(tmp_path / "stopped.jsonl", {s: 10.0 - s / 7 for s in range(1, 21)})
    resumed = _metrics(tmp_path / "resumed.jsonl", {s: 10.0 - s / 7 for s in range(1, 31)})
    status, figure = checks.resume(straight, stopped, resumed)
    assert status == "pass" and "steps 21-30" in figure and figure.endswith("(bitwise)")
    _metrics(resumed, {**{s: 10.0 - s / 7 for s in range(1, 31)}, 25: 10.0 - 25 / 7 + 1e-7})
    assert checks.resume(straight, stopped, resumed)[0] == "fail"
    _metrics(stopped, {**{s: 10.0 - s / 7 for s in range(1, 21)}, 3: 10.0 - 3 / 7 + 1e-6})  # a noisy GPU
    status, figure = checks.resume(straight, stopped, resumed)
    assert status == "pass" and "not bitwise repeatable" in figure


def test_stall_check_reads_the_trainers_lines_and_holds_the_bound(tmp_path):
    line = "[train] checkpoint global_step{}: training stopped for {} s ({}: ...)\n"
    sync = tmp_path / "sync.log"
    sync.write_text(line.format(10, "2.000", "sync") + line.format(20, "2.400", "sync"))
    fast = tmp_path / "async.log"
    fast.write_text(line.format(10, "0.900", "async") + line.format(20, "0.150", "async")
                    + line.format(30, "0.170", "async"))
    status, figure = checks.stall([sync], [fast])
    assert status == "pass" and "async 0.160 s (first save" in figure and "0.900 s" in figure  # the median of 2
    assert "ratio 0.073" in figure  # 0.160 / 2.200
    fast.write_text(line.format(10, "0.9", "async") + line.format(20, "0.5", "async"))
    assert checks.stall([sync], [fast])[0] == "fail"
    assert checks.stall([sync], [sync])[0] == "fail"  # no async save found


def test_generate_check_needs_every_token(tmp_path):
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl"
    theirs.write_text('{"prompt": "a", "tokens": [1, 2, 3]}\n{"prompt": "b", "tokens": [4, 5]}\n')
    ours.write_text('{"prompt": "a", "completion": "x", "tokens": [1, 2, 3]}\n{"prompt": "b", "tokens": [4, 5]}\n')
    assert checks.compare_generate(ours, theirs) == ("pass", "2 of 2 prompts' greedy tokens equal (5 tokens from "
                                                             "transformers)")
    ours.write_text('{"prompt": "a", "tokens": [1, 2, 3]}\n{"prompt": "b", "tokens": [4, 6]}\n')
    assert checks.compare_generate(ours, theirs)[0] == "fail"


def test_summary_counts_a_missing_record_as_a_failure(tmp_path, capsys):
    checks.write_record(tmp_path, 1, "flash attention (SDPA)", "skip", "no CUDA device")
    checks.write_record(tmp_path, 2, "resume", "pass", "bitwise")
    assert checks.summary(tmp_path, [], expected=2) == 0
    assert checks.summary(tmp_path, [], expected=3) == 1
    out = capsys.readouterr().out
    assert "all passed" in out and re.search(r"\n1 check\(s\) +fail +did not write a record", out)
    checks.write_record(tmp_path, 3, "stall", "fail", "ratio 0.5")
    assert checks.summary(tmp_path, [], expected=3) == 1


def test_the_report_prints_the_trainers_measured_over_planned(tmp_path, capsys):
    import gpu_smoke

    (tmp_path / "125m").mkdir()
    records = [{"kind": "train", "step": s, "global_batch": 64, "samples_per_second": 64.0, "tokens_per_second": 1e5,
                "tflops_per_gpu": 100.0, "mfu": 0.1, "plan_iteration_ratio": 1.0 + s / 100,
                "plan_tokens_per_second_ratio": 1 / (1.0 + s / 100), "plan_memory_ratio": None} for s in range(1, 31)]
    (tmp_path / "125m" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plan = {"plans": [{"full_batch": {"seconds": 1.0, "tflops_per_gpu": 90.0, "mfu": 0.09}, "memory": [{"total": 2**30}]}]}
    (tmp_path / "125m.plan.json").write_text(json.dumps(plan))
    got = gpu_smoke.measured(tmp_path, "125m")
    assert got["plan_iteration_ratio"] == pytest.approx(1.205) and got["plan_memory_ratio"] is None  # steps 11-30
    assert gpu_smoke.report(tmp_path, ["125m"]) == 0
    assert "measured / planned (training/plan_check.py, median): iteration time 1.205, tokens/s 0.830" in \
        capsys.readouterr().out
    (tmp_path / "125m-compiled").mkdir()
    faster = [{**r, "tokens_per_second": 1.25e5, "mfu": 0.125} for r in records]
    (tmp_path / "125m-compiled" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in faster))
    (tmp_path / "125m-compiled.log").write_text("[compile] 12 block(s) of this stage compiled with torch.compile "
                                                "(training.compile) in about 41.5 s: the first step took 43.0 s\n")
    assert gpu_smoke.compiled_against_eager(tmp_path, "125m", "125m-compiled") == (
        "125m-compiled (training.compile) against 125m: tokens/s 125,000 / 100,000 (1.250x), MFU 12.5% / 10.0%; "
        "compiled in about 41.5 s")


def test_the_snapshot_check_fails_without_the_snapshot(tmp_path):
    status, figure = checks.memory_snapshot(tmp_path / "memory" / "snapshot_step3_rank0.pickle")
    assert status == "fail" and figure.startswith("no snapshot at")


def test_the_document_mask_check_runs_its_comparison_forward_on_cpu() -> None:
    """The comparison behind the GPU check 'document-masks', forward only (torch has no FlexAttention backward on
    CPU): the two backends agree, so the check's own code is proven here and only the kernels are left to the GPU."""
    import torch

    from model.config import preset

    found = checks.compare_attention_backends(preset("tiny", seq_length=128), 2, 50256, 1234, torch.device("cpu"),
                                              backward=False)
    assert found["logits_error"] < 1e-6 and found["documents"] > 2 * 4, found


def test_the_flex_memory_check_builds_its_long_blocks_from_the_125m_config() -> None:
    """The check's one-block models at 16k and 32k positions, from 125m's config (learned positions, a table of
    2,048): the first H200 run stopped here, the lengths refused as longer than the table."""
    model = load_run_config(ROOT / "ds_configs" / "125m.json").model
    for length in checks.FLEX_LENGTHS:
        block = checks.flex_block_config(model, length)
        assert (block.seq_length, block.num_layers, block.attention_backend) == (length, 1, "flex")
        assert block.hidden_size == model.hidden_size and block.max_position_embeddings >= length


# -- host synchronisations (scripts/gpu_smoke_syncs.py) ----------------------------------------------------------------

import gpu_smoke_syncs as syncs  # noqa: E402


def test_the_host_sync_check_counts_its_blocks_on_cpu():
    """The check's own code on CPU: its dense and sparse Llama blocks (the tiny preset's shape), counted by
    tests/host_syncs.py's audit where the GPU counts with torch.cuda.set_sync_debug_mode: no sync, forward or
    backward, and the grouped GEMM equal to the loop (bitwise on CPU). Only the kernels are left to the GPU."""
    import torch

    from model.config import preset
    from tests.host_syncs import HostSyncAudit

    found = syncs.block_syncs(preset("tiny", seq_length=16), 2, 0, torch.device("cpu"), torch.float32, HostSyncAudit)
    assert found == {"dense forward": 0, "dense backward": 0, "dense packed forward": 0, "dense packed backward": 0,
                     "sparse forward": 0, "sparse backward": 0, "kernel": "loop", "grouped_vs_loop": 0.0}  # the
    # CPU's own choice is the loop; the audit runs SDPA's masked kernel where CUDA runs FlexAttention


def test_the_host_sync_judge_reads_the_step_lines(tmp_path):
    from tests.host_syncs import Event

    class Counted:  # what HostSyncAudit leaves: events charged to a scope
        events = [Event("read", "tolist", 1, "deepspeed", "engine.py:1 step", None),
                  Event("read", "item", 1, "training", "trainer.py:2 train_step", None)]

    log = tmp_path / "125m.log"
    log.write_text("".join(syncs.step_line(0, step, Counted()) + "\n" for step in (1, 2, 3)) + "[train] step 3 |\n")
    lines = syncs.read_step_lines(log)
    assert lines[1] == {"rank": 0, "step": 2, "syncs": 2, "model": 0, "training": 1, "deepspeed": 1, "other": 0}
    blocks = {"dense forward": 0, "dense backward": 0, "dense packed forward": 0, "dense packed backward": 0,
              "sparse forward": 0, "sparse backward": 0, "kernel": "grouped", "grouped_vs_loop": 4e-3}
    status, figure = syncs.judge(blocks, lines, 8, 2048)
    assert status == "pass" and "steps 2-3: median 2 syncs a step (model 0, training 1, deepspeed 1)" in figure
    assert syncs.judge({**blocks, "sparse forward": 1}, lines, 8, 2048)[0] == "fail"
    assert syncs.judge({**blocks, "dense packed backward": 2}, lines, 8, 2048)[0] == "fail"
    assert syncs.judge({**blocks, "kernel": "loop", "sparse forward": 1}, lines, 8, 2048)[0] == "pass"  # its read
    Counted.events = [*Counted.events, Event("read", "item", 1, "block 2 sparse forward", "moe.py:3 f", None)]
    log.write_text(syncs.step_line(0, 2, Counted()) + "\n")
    status, figure = syncs.judge(blocks, syncs.read_step_lines(log), 8, 2048)
    assert status == "fail" and "the model synchronised in steps [2]" in figure
    assert "model at: moe.py:3 f x1" in log.read_text()
    assert syncs.judge(blocks, [], 8, 2048)[0] == "fail"  # no step line: the run did not count
