#!/usr/bin/env python
"""Evaluate a checkpoint where it lives, at any TP x PP x DP, with lm-evaluation-harness: no Hugging Face export.

    python tools/evaluate.py --checkpoint runs/demo/checkpoints --tasks alice_lastword,alice_choice,alice_pages
    deepspeed --num_gpus 4 tools/evaluate.py --checkpoint ckpts/x --tasks alice_choice --num-fewshot 2 \\
        --output results.json --log-samples
    torchrun --nproc_per_node 8 tools/evaluate.py --checkpoint ckpts/530b --set parallelism.tensor_parallel_size=8 \\
        --tasks lambada_openai,hellaswag,piqa,winogrande,boolq,race,anli_r2,wic

The model runs at the checkpoint's own TP x PP (or --ds_config / --set's), DP being what the world leaves: the
requests are split over the DP replicas, each a forward-only pipeline (evaluation/pipeline.py), and the scores are
those of lm-eval's own Hugging Face backend on the exported model (evaluation/lm.py says how). The shipped tasks
(evaluation/tasks/: alice_lastword, alice_choice, alice_pages) and --include-path folders run offline from any
directory; lm-eval's standard tasks run when their datasets are in the local cache (docs/evaluation.md). Rank 0
prints the metrics and writes --output (lm-eval's result dictionary as JSON).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.files import write_json_atomically
from tools.inference_options import add_model_options, is_rank_zero, open_pipeline, run_and_clean_up
from tools.streams import deepspeed_logs_to_stderr


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    tasks = parser.add_argument_group("the tasks")
    tasks.add_argument("--tasks", required=True, help="task names, comma-separated")
    tasks.add_argument("--include-path", action="append", default=[], help="a folder of task YAMLs (repeatable); "
                       "their data files may be named relative to each YAML")
    tasks.add_argument("--num-fewshot", type=int, help="examples before each question (default: the task's)")
    tasks.add_argument("--limit", type=float, help="at most this many documents per task (or a fraction if < 1)")
    tasks.add_argument("--batch-size", type=int, default=8, help="requests per forward pass of a replica (8)")
    tasks.add_argument("--bootstrap-iters", type=int, default=0,
                       help="bootstrap samples for the standard errors (default 0: none; lm-eval's own is 100000)")
    tasks.add_argument("--seed", type=int, default=1234, help="seeds lm-eval's few-shot sampling (1234, lm-eval's)")
    out = parser.add_argument_group("the results")
    out.add_argument("--output", help="write lm-eval's result dictionary here as JSON")
    out.add_argument("--log-samples", action="store_true", help="include every request and its response")
    return parser


def format_table(results: dict) -> str:
    from evaluation.harness import metric_values

    lines = [f"{'task':<24} {'metric':<18} {'value':>14}"]
    for name, value in metric_values(results).items():
        task, metric = name.split("/", 1)
        lines.append(f"{task:<24} {metric:<18} {value:>14.6g}")
    return "\n".join(lines)


def write_json(path: Path, results: dict) -> None:
    """Written beside the target and renamed: a crash leaves no half file."""
    from lm_eval.utils import handle_non_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, results, indent=2, default=handle_non_serializable, ensure_ascii=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    deepspeed_logs_to_stderr()  # stdout carries results only

    def work() -> int:
        from evaluation.harness import evaluate, load_tasks
        from evaluation.lm import ParallelLM

        tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
        load_tasks(tasks, args.include_path)  # a task that cannot run fails here, before the model is loaded
        pipeline, tokenizer, checkpoint = open_pipeline(args)
        lm = ParallelLM(pipeline, tokenizer, batch_size=args.batch_size)
        results = evaluate(lm, tasks, args.include_path, args.num_fewshot, args.limit, args.log_samples,
                           args.bootstrap_iters, args.seed)
        if is_rank_zero() and results is not None:
            ctx = pipeline.ctx
            print(f"{checkpoint.directory}/{checkpoint.tag} at TP {ctx.tensor_parallel_size} x PP "
                  f"{ctx.pipeline_parallel_size} x DP {ctx.data_parallel_size}\n{format_table(results)}")
            if args.output:
                write_json(Path(args.output), results)
                print(f"wrote {args.output}")
        return 0

    from evaluation.harness import TaskError

    return run_and_clean_up(work, (ValueError, TaskError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())
