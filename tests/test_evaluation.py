"""Evaluation and generation where the model lives (evaluation/, tools/evaluate.py, tools/generate.py).

Two models, fp32, each trained 3 steps at TP 2 x PP 2 and saved by the trainer's save_checkpoint, then exported to
Hugging Face: a tiny GPT (4 layers, h 64, 4 heads, learned positions, 64 of them, tied) and a tiny Llama (2 layers, h
128, 8 query heads in 2 key/value groups, RoPE, untied). On the shipped tasks (alice_lastword, alice_choice,
alice_pages; the first 4 documents of each), 0-shot and 2-shot (alice_pages, rolling, 0-shot only), lm-eval's own HFLM on the export is the reference;
tools/evaluate.py's adapter at (TP, PP, DP) = (1,1,1) (one process), (2,2,1), (1,2,2) and (2,1,2) (one 4-process
world for the three; 2-shot at (1,1,1) and (2,2,1), as few-shot contexts change the requests, not how a layout
scores them) must give:

- every request's log-likelihood within 1e-4 x its token count (the engine sums TP partial products and runs its own
  attention kernel, HF one unsplit matmul and its own: the rounding differs), rolling ones too;
- is_greedy identical, and every discrete metric (acc, acc_norm) identical; the perplexities (exp of mean
  log-likelihoods) within the relative bound those tolerances imply;
- at DP 2, each rank's replica scored about half the requests (counted), and the results equal DP 1's;
- the same log-likelihoods (to 1e-6 relative: fp32 sums over another batch shape) with a batch of 1 and with the
  requests in another order.

Generation: greedy, 16 new tokens on 8 prompts of different lengths, at (2,2,1) and (1,2,2), equals transformers'
generate() on the export token for token; without the KV cache it gives the same tokens; sampling with a seed repeats
exactly. And the errors a user meets: an unknown task lists the available ones, a missing data file is named, a
checkpoint without a tokenizer names the option; none prints a traceback.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runconfig.run import parse_run_config
from tests.distributed import run_distributed
from tests.test_model_parallel import LR, deepspeed_config, micro_batches

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["alice_lastword", "alice_choice", "alice_pages"]
FEWSHOT_TASKS = ["alice_lastword", "alice_choice"]  # a rolling log-likelihood has no few-shot examples
LIMIT = 4
SHOTS = (0, 2)
GENERATING = [(2, 2), (1, 2)]  # the layouts whose greedy generation is compared with transformers'


def tasks_for(shots: int) -> list[str]:
    return TASKS if shots == 0 else FEWSHOT_TASKS


def shots_at(layout: tuple[int, int], layouts: list[tuple[int, int]]) -> tuple[int, ...]:
    """Few-shot contexts change the requests, not how a layout scores them: 2-shot at each launch's first layout
    (one process, and TP 2 x PP 2), 0-shot everywhere."""
    return SHOTS if layout == layouts[0] else SHOTS[:1]
LAYOUTS = [(2, 2), (1, 2), (2, 1)]  # (TP, PP) on 4 processes: DP 1, 2, 2
MODELS = {
    "gpt": {"preset": "tiny", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64},
    "llama": {"preset": "llama-tiny", "num_layers": 2, "seq_length": 64},
}
PROMPTS = ["I", "Alice was", "The Queen said to the", "Down, down, down. Would the fall never come to an end?",
           "It was", "'Curiouser and curiouser!' cried", "She ate a little bit, and said anxiously to herself,",
           "The Mock Turtle"]
NEW_TOKENS = 16


def run_config(fields: dict) -> dict:
    raw = {**deepspeed_config("fp32"), "model": {**fields, "precision": "fp32"},
           "parallelism": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
           "schedule": {"lr": LR, "warmup_tokens": 0, "decay_tokens": 1e6, "train_tokens": 1e6},
           "training": {"seed": 1234}}
    return parse_run_config(raw).to_dict()


def _train_and_save(directories: dict[str, str]) -> None:
    """Each model 3 steps at TP 2 x PP 2 (4 processes), saved as the trainer saves."""
    from training.checkpoint import save_checkpoint
    from training.engine import build_engine

    for name, directory in directories.items():
        config = parse_run_config(run_config(MODELS[name]))
        engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, 1234)
        for step in range(3):
            engine.train_batch(data_iter=micro_batches(step, config.model.seq_length, ctx.data_parallel_rank,
                                                       ctx.data_parallel_size))
        save_checkpoint(engine, directory, 3, {"run_config": config.to_dict(),
                                               "train_state": {"step": 3, "consumed_samples": 24,
                                                               "consumed_tokens": 24 * 64, "global_batch": 8}})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, dict[str, Path]]:
    from hf.export import export_to_hf

    root = tmp_path_factory.mktemp("models")
    checkpoints = {name: str(root / name / "checkpoints") for name in MODELS}
    run_distributed(4, _train_and_save, checkpoints)
    out = {}
    for name, directory in checkpoints.items():
        export_to_hf(directory, root / name / "hf", progress=False)
        out[name] = {"checkpoint": Path(directory), "hf": root / name / "hf"}
    return out


# -- what each side computes -----------------------------------------------------------------------------------------

def responses(results: dict) -> dict[str, list]:
    """{task: [(arguments, [response, ...]) per document, in document order]}."""
    return {task: [(sample["arguments"], sample["resps"]) for sample in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def summary(results: dict) -> dict:
    from evaluation.harness import metric_values

    return {"metrics": metric_values(results), "responses": responses(results)}


@pytest.fixture(scope="module")
def reference(models) -> dict:
    """lm-eval's HFLM on each export, 0- and 2-shot; transformers' greedy generate() on the prompts."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evaluation.harness import SHIPPED_TASKS, offline, resolved_task_folders, task_manager

    offline()
    out = {}
    for name, paths in models.items():
        hf = HFLM(pretrained=str(paths["hf"]), batch_size=4, device="cpu")
        with resolved_task_folders([SHIPPED_TASKS]) as folders:
            out[name] = {shots: summary(simple_evaluate(model=hf, tasks=tasks_for(shots), num_fewshot=shots,
                                                        limit=LIMIT, log_samples=True, bootstrap_iters=0,
                                                        task_manager=task_manager(TASKS, folders)))
                         for shots in SHOTS}
        model = AutoModelForCausalLM.from_pretrained(str(paths["hf"])).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(paths["hf"]))
        generated = []
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            with torch.no_grad():
                tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                        pad_token_id=tokenizer.eos_token_id)
            generated.append(tokens[0, ids.shape[1]:].tolist())
        out[name]["generated"] = generated
    return out


def _ours(checkpoints: dict[str, str], layouts: list[tuple[int, int]]) -> dict:
    """On every rank: each model at each layout, 0- and 2-shot; at the first layout also a batch of 1, the requests
    in another order, and generation (greedy with and without the cache, sampled twice)."""
    from evaluation.generation import Generator, Sampling
    from evaluation.harness import evaluate
    from evaluation.lm import ParallelLM
    from evaluation.loading import checkpoint_tokenizer, load_pipeline
    from model.config import ParallelConfig

    out = {}
    for name, directory in checkpoints.items():
        for tp, pp in layouts:
            pipeline, checkpoint = load_pipeline(directory, parallel=ParallelConfig(tp, pp))
            tokenizer = checkpoint_tokenizer(checkpoint)
            lm = ParallelLM(pipeline, tokenizer, batch_size=4)
            key = (name, tp, pp)
            out[key], scored = {}, 0
            for shots in shots_at((tp, pp), layouts):
                results = evaluate(lm, tasks_for(shots), num_fewshot=shots, limit=LIMIT, log_samples=True)
                out[key][shots] = summary(results) if results else None
                out[key][("scored", shots)] = lm.requests_scored - scored  # the requests this replica scored
                scored = lm.requests_scored
            out[key]["dp"] = pipeline.ctx.data_parallel_size
            if (tp, pp) not in GENERATING:
                continue
            prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]
            generator = Generator(pipeline, tokenizer.eos_token_id)
            out[key]["generated"] = generator.generate_all(prompts, NEW_TOKENS)
            if (tp, pp) != layouts[0]:
                continue
            requests = [(None, context, continuation) for context, continuation in
                        [(tokenizer.encode(p), tokenizer.encode(" the end")) for p in PROMPTS]
                        + [([tokenizer.eos_token_id], tokenizer.encode(p)) for p in PROMPTS]]
            shuffled = list(range(len(requests)))
            random.Random(0).shuffle(shuffled)
            out[key]["batched"] = lm._loglikelihood_tokens(requests)
            lm.batch_size = 1
            out[key]["one_by_one"] = lm._loglikelihood_tokens(requests)
            reordered = lm._loglikelihood_tokens([requests[i] for i in shuffled])
            out[key]["reordered"] = [reordered[shuffled.index(i)] for i in range(len(requests))]
            out[key]["uncached"] = generator.generate_all(prompts, NEW_TOKENS, use_cache=False)
            sampling = Sampling(temperature=1.0, top_k=50, top_p=0.9, seed=5)
            out[key]["sampled"] = [generator.generate_all(prompts[:3], 12, sampling) for _ in range(2)]
    return out


@pytest.fixture(scope="module")
def ours(models) -> dict:
    checkpoints = {name: str(paths["checkpoint"]) for name, paths in models.items()}
    ranks = run_distributed(4, _ours, checkpoints, LAYOUTS)
    merged = dict(ranks[0])
    for key in ranks[0]:  # the scores each rank's replica computed
        merged[key]["scored_by_rank"] = [rank[key][("scored", 0)] for rank in ranks]  # 0-shot, at every layout
    single = run_distributed(1, _ours, checkpoints, [(1, 1)])[0]
    merged.update(single)
    return merged


# -- parity ------------------------------------------------------------------------------------------------------------

def tokens_in(arguments, tokenizer) -> int:
    """The token count a request's tolerance scales with: its continuation's (the whole text for rolling ones)."""
    return len(tokenizer.encode(arguments[-1])) + 1


def assert_same_scores(ours: dict, theirs: dict, tokenizer, where: str) -> None:
    for task, documents in theirs["responses"].items():
        mine = ours["responses"][task]
        assert len(mine) == len(documents), (where, task)
        for (arguments, their_requests), (my_arguments, my_requests) in zip(documents, mine, strict=True):
            assert my_arguments == arguments, (where, task)
            for request, their_responses, my_responses in zip(arguments, their_requests, my_requests, strict=True):
                for theirs_response, my_response in zip(their_responses, my_responses, strict=True):
                    if isinstance(theirs_response, (list, tuple)):  # (log-likelihood, is_greedy)
                        assert my_response[1] == theirs_response[1], (where, task, request[-1][:40])
                        their_value, my_value = theirs_response[0], my_response[0]
                    else:  # a rolling log-likelihood
                        their_value, my_value = theirs_response, my_response
                    bound = 1e-4 * tokens_in(request, tokenizer)
                    assert abs(my_value - their_value) <= bound, (where, task, my_value, their_value, bound)
    for metric, value in theirs["metrics"].items():
        if metric.endswith(("/acc", "/acc_norm")):
            assert ours["metrics"][metric] == value, (where, metric)
        else:  # perplexities: exp of a mean log-likelihood, each within the bound above
            assert math.isclose(ours["metrics"][metric], value, rel_tol=1e-3), (where, metric)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_scores_equal_lm_evals_own_hf_backend_at_every_layout(name, models, reference, ours):
    from hf.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(models[name]["hf"])
    for tp, pp in [(1, 1), *LAYOUTS]:
        for shots in shots_at((tp, pp), [(1, 1)] if (tp, pp) == (1, 1) else LAYOUTS):
            where = f"{name} TP {tp} x PP {pp}, {shots}-shot"
            assert_same_scores(ours[(name, tp, pp)][shots], reference[name][shots], tokenizer, where)
    assert {"alice_lastword/acc", "alice_choice/acc_norm", "alice_pages/word_perplexity"} <= set(
        reference[name][0]["metrics"])


@pytest.mark.distributed
def test_data_parallel_replicas_share_the_requests(ours):
    for name in MODELS:
        for tp, pp in LAYOUTS:
            run = ours[(name, tp, pp)]
            per_rank = run["scored_by_rank"]
            if run["dp"] == 1:
                assert len(set(per_rank)) == 1  # every rank of the one replica walked all of them
                continue
            replica_of = [0, 0, 1, 1] if tp * pp == 2 and tp == 2 else [0, 1, 0, 1]
            counts = {replica: per_rank[rank] for rank, replica in enumerate(replica_of)}
            total = sum(counts.values())
            assert abs(counts[0] - counts[1]) <= 3 * len(TASKS), counts  # about half each
            assert total == ours[(name, 1, 1)][("scored", 0)]  # together, exactly what one replica scores alone
            for shots in shots_at((tp, pp), LAYOUTS):
                assert ours[(name, tp, pp)][shots]["metrics"] == pytest.approx(ours[(name, 1, 1)][shots]["metrics"],
                                                                               rel=1e-6)


@pytest.mark.distributed
def test_batch_size_and_request_order_do_not_change_the_scores(ours):
    for name in MODELS:
        run = ours[(name, *LAYOUTS[0])]
        for other in ("one_by_one", "reordered"):
            for (value, greedy), (expected, expected_greedy) in zip(run[other], run["batched"], strict=True):
                # fp32 sums of another batch shape: the same to 1e-6 relative (measured: 1e-7)
                assert greedy == expected_greedy and math.isclose(value, expected, rel_tol=1e-6), (name, other)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_equals_transformers(name, reference, ours):
    for layout in GENERATING:
        assert ours[(name, *layout)]["generated"] == reference[name]["generated"], layout
    first = ours[(name, *LAYOUTS[0])]
    assert first["uncached"] == first["generated"]  # the KV cache changes no token
    assert first["sampled"][0] == first["sampled"][1]  # a seed repeats exactly
    assert first["sampled"][0] != [tokens[:12] for tokens in first["generated"][:3]]  # and it did sample


# -- the tools and their errors ------------------------------------------------------------------------------------------

def run_tool(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"tools/{tool}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"})


ONE_PROCESS = ["--set", "parallelism.tensor_parallel_size=1", "--set", "parallelism.pipeline_parallel_size=1"]


def test_tools_evaluate_and_generate_in_one_process(models, reference, tmp_path):
    """The command lines, from another directory's point of view (the data files resolve against the YAMLs)."""
    checkpoint = str(models["gpt"]["checkpoint"])
    result = run_tool("evaluate.py", "--checkpoint", checkpoint, "--tasks", "alice_choice", "--limit", str(LIMIT),
                      "--output", str(tmp_path / "results.json"), *ONE_PROCESS)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["results"]["alice_choice"]["acc,none"] == reference["gpt"][0]["metrics"]["alice_choice/acc"]
    assert "PyTorch version" in saved["pretty_env_info"]  # lm-eval's environment, collected once per process
    assert "alice_choice" in result.stdout and "acc_norm" in result.stdout
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    result = run_tool("generate.py", "--checkpoint", checkpoint, "--prompts", str(prompts), "--max-new-tokens",
                      str(NEW_TOKENS), *ONE_PROCESS)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]  # stdout holds the JSONL alone
    assert [r["tokens"] for r in records] == reference["gpt"]["generated"][:2]


def imported_without_tokenizer(root: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf.config_map import model_fields_from_hf, read_hf_config
    from hf.importer import import_from_hf
    from model.config import ModelConfig, ParallelConfig

    config = AutoConfig.for_model("llama", vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                  architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(str(root / "hf-no-tokenizer"))
    model = ModelConfig(**model_fields_from_hf(read_hf_config(root / "hf-no-tokenizer")), seq_length=32)
    return import_from_hf(root / "hf-no-tokenizer", model, ParallelConfig(1, 1), root / "untokenized", progress=False)


@pytest.mark.parametrize("args, message", [
    (["--tasks", "alice_lastwordz"], "unknown task(s) alice_lastwordz: the tasks in the task folders are "
                                     "alice_choice, alice_lastword, alice_pages"),
    (["--tasks", "broken_task", "--include-path", "{broken}"], "its data file {broken}/missing.jsonl does not exist"),
    (["--tasks", "alice_choice", "--checkpoint", "{untokenized}"], "pass --tokenizer DIR"),
])
def test_errors_name_the_fix_without_a_traceback(models, tmp_path, args, message):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "broken.yaml").write_text("task: broken_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        "    test: missing.jsonl\ntest_split: test\noutput_type: loglikelihood\n"
                                        "doc_to_text: '{{text}}'\ndoc_to_target: '{{text}}'\n")
    if "{untokenized}" in args:  # an imported Llama of a 1,000-token vocabulary, its directory without a tokenizer
        untokenized = str(imported_without_tokenizer(tmp_path))
        args = [a.replace("{untokenized}", untokenized) for a in args]
    args = [a.replace("{broken}", str(broken)) for a in args]
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(models["gpt"]["checkpoint"]), *args]
    result = run_tool("evaluate.py", *args, *ONE_PROCESS)
    assert result.returncode == 2
    assert message.replace("{broken}", str(broken)) in result.stderr
    assert "Traceback" not in result.stderr


# -- during training --------------------------------------------------------------------------------------------------

@pytest.mark.distributed
def test_tasks_during_training_leave_the_run_bitwise_unchanged(corpus, straight_run, tmp_path):
    """The launcher's 12-step TP 2 x PP 2 run (conftest's straight_run) again, with alice_choice and alice_lastword
    every 6 steps on the live engine: the task metrics are logged at steps 6 and 12, and every step's loss,
    learning rate and gradient norm are bitwise the run's without them."""
    from tests.launch import run_training
    from training.metrics_log import read_metrics

    save = tmp_path / "checkpoints"
    run_training(corpus, save, extra=['training.eval_tasks=["alice_choice", "alice_lastword"]',
                                      "training.eval_tasks_interval=6", "training.eval_tasks_limit=4"])
    tasks = read_metrics(save / "metrics.jsonl", kind="tasks")
    assert [record["step"] for record in tasks] == [6, 12]
    assert {"alice_choice/acc", "alice_choice/acc_norm", "alice_lastword/acc", "alice_lastword/perplexity"} <= set(
        tasks[0])
    ours, theirs = read_metrics(save / "metrics.jsonl"), read_metrics(straight_run / "metrics.jsonl")
    for key in ("step", "loss", "lr", "grad_norm", "consumed_samples"):
        assert [r[key] for r in ours] == [r[key] for r in theirs], key


def test_a_standard_task_without_its_dataset_is_one_line_before_any_model(tmp_path):
    """lambada_openai (MT-NLG's headline task) with the Hub unreachable and no cached dataset: the real failure,
    reported in one line naming the task, its dataset and the fix, exit 2, before the (missing) checkpoint is read."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "empty-cache")}
    result = subprocess.run([sys.executable, "tools/evaluate.py", "--checkpoint", str(tmp_path / "none"),
                             "--tasks", "lambada_openai"], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 2 and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: task lambada_openai: dataset EleutherAI/lambada_openai is not in the local datasets cache and the Hub "
        "cannot be reached (ConnectionError): run it once where the Hub is reachable, with HF_DATASETS_OFFLINE and "
        "HF_HUB_OFFLINE unset, to fill ~/.cache/huggingface/datasets (or copy a filled cache here), or write it as a "
        "local json task as evaluation/tasks/ does (docs/evaluation.md)"]
    assert "Traceback" not in result.stderr
