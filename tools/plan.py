#!/usr/bin/env python
"""Plan a run before booking the cluster: memory per GPU by part, iteration time by part, the whole training.

    python tools/plan.py --ds_config ds_configs/530b.json --nodes 280,350,420,560
    python tools/plan.py --ds_config ds_configs/530b.json --nodes 280,420 --iteration-seconds 60.1,44.4  # measured
    python tools/plan.py --ds_config ds_configs/530b.json --nodes 70 --gpu h100-80gb --matmul-efficiency 0.5 --json
    python tools/plan.py --ds_config ds_configs/530b.json --nodes 280 --search          # the fastest layouts that fit

A Mixture-of-Experts preset (model.moe) is planned the same way, its expert-parallel size a setting (Mixtral's
tokenizer ends documents with id 2, which the GPT-2 default data.eod_token_id does not fit):

    python tools/plan.py --ds_config ds_configs/1.3b.json --gpu h100-80gb --nodes 16 --set model.preset='"mixtral-8x7b"' \\
        --set data.eod_token_id=2 --set train_micro_batch_size_per_gpu=1 --set train_batch_size=1024 \\
        --set schedule.batch={} --set parallelism.pipeline_parallel_size=4 --set parallelism.expert_parallel_size=8

Results only on stdout (the tables, or JSON with --json); warnings, DeepSpeed's included, on stderr.
--search enumerates layouts at one node count (TP, PP, micro-batch, sequence parallelism, recompute mode and blocks,
and for a Mixture-of-Experts model every expert-parallel size dividing the experts and DP) and prints the --top
fastest that fit (predicted full-batch iteration time), or them as JSON with --json.
Exit status 0 when every plan is possible (with --search: when a layout fits); 1 with the reason on stderr when one is not (DP not a whole number, a full
batch that does not split into micro-batches x DP, memory exceeded) or the input is invalid. Ramp sizes that do not
split are a warning with a ramp that would. The formulas, constants and the --json schema: planner/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from planner import (
    ATTENTION_SCORES,
    GPU_PRESETS,
    Assumptions,
    Hardware,
    Storage,
    check_run_layout,
    count_parameters,
    format_comparison,
    format_header,
    format_plan,
    format_search,
    plan_cluster,
    report_to_dict,
    search_layouts,
    search_to_dict,
)
from runconfig.run import load_run_config
from tools.streams import deepspeed_logs_to_stderr

HARDWARE_FLAGS = {  # flag -> Hardware field
    "--peak-tflops": "peak_tflops", "--memory-gib": "memory_gib", "--hbm-gbytes-per-s": "hbm_gbytes_per_s",
    "--nvlink-gbytes-per-s": "nvlink_gbytes_per_s", "--ib-gbits-per-gpu": "ib_gbits_per_s",
}
STORAGE_FLAGS = {  # flag -> Storage field
    "--storage-gbps": "node_gbytes_per_s", "--storage-aggregate-gbps": "aggregate_gbytes_per_s",
    "--host-copy-gbps": "host_gbytes_per_s",
}
ASSUMPTION_FLAGS = {  # flag -> Assumptions field
    "--matmul-efficiency": "matmul_efficiency", "--comm-efficiency": "comm_efficiency",
    "--hbm-efficiency": "hbm_efficiency", "--framework-gib": "framework_gib",
}


def _field_help(cls: type, name: str) -> str:
    """The field's docstring is its help: read it from the source once, here."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, after in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and node.target.id == name and isinstance(after, ast.Expr):
            return " ".join(after.value.value.split()).replace("%", "%%")  # argparse formats help with %
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ds_config", required=True, help="the run's JSON config")
    parser.add_argument("--set", action="append", default=[], metavar="BLOCK.FIELD=VALUE", help="override a field")
    parser.add_argument("--nodes", required=True, help="node counts, comma-separated: 280,350,420,560")
    parser.add_argument("--gpu", choices=sorted(GPU_PRESETS), default="a100-80gb", help="GPU preset (a100-80gb)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the preset's, 8)")
    parser.add_argument("--iteration-seconds", help="measured full-batch iteration times, one per node count "
                        "(comma-separated): report their TFLOP/s per GPU and MFU")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (schema: planner/report.py)")
    parser.add_argument("--search", action="store_true", help="at one node count, try every layout (TP, PP, "
                        "micro-batch, sequence parallelism, recompute; EP for a Mixture-of-Experts model) and rank "
                        "those that fit by iteration time")
    parser.add_argument("--top", type=int, default=10, help="with --search: how many layouts to print (10)")
    parser.add_argument("--uneven-stages", action="store_true", help="plan a pipeline-parallel size that does not "
                        "divide the layers (DeepSeek-V3's 61 over PP 16) as DeepSpeed's partition_balanced splits it, "
                        "stages of unequal blocks, under 1F1B without recompute_num_layers; with --search try such "
                        "sizes too. The trainer refuses these splits: a plan to compare, not a run to launch")
    parser.add_argument("--context-parallel", metavar="CP,CP,...", help="at one node count, the config's layout at "
                        "each of these Ulysses context-parallel sizes: its plan at the config's sequence length and "
                        "the longest sequence that fits (planner/context.py), e.g. 1,2,4,8")
    for flag, name in HARDWARE_FLAGS.items():
        parser.add_argument(flag, type=float, dest=name, help=f"override the preset: {_field_help(Hardware, name)}")
    for flag, name in ASSUMPTION_FLAGS.items():
        default = getattr(Assumptions(), name)
        parser.add_argument(flag, type=float, dest=name, default=default,
                            help=f"(default {default:g}) {_field_help(Assumptions, name)}")
    for flag, name in STORAGE_FLAGS.items():
        default = getattr(Storage(), name)
        parser.add_argument(flag, type=float, dest=name, default=default,
                            help=f"(default {default:g}) {_field_help(Storage, name)}")
    attention = parser.add_mutually_exclusive_group()
    attention.add_argument("--attention-scores", choices=ATTENTION_SCORES, default=Assumptions().attention_scores,
                           help=_field_help(Assumptions, "attention_scores"))
    # the old flag: the default it switched on is the default now
    attention.add_argument("--flash-attention", dest="attention_scores", action="store_const", const="recomputed",
                           help="the same as --attention-scores recomputed, the default (kept for old command lines)")
    return parser


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    overrides = {name: getattr(args, name) for name in HARDWARE_FLAGS.values() if getattr(args, name) is not None}
    if args.gpus_per_node is not None:
        overrides["gpus_per_node"] = args.gpus_per_node
    return dataclasses.replace(GPU_PRESETS[args.gpu], **overrides)


def parse_list(flag: str, text: str, kind: type) -> list:
    """'280,350' -> [280, 350]: positive numbers, or a ValueError naming the flag."""
    try:
        values = [kind(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} {text!r}: expected positive numbers separated by commas, e.g. 280,350")
    return values


def parse_iteration_seconds(text: str | None, nodes: list[int]) -> list[float | None]:
    if text is None:
        return [None] * len(nodes)
    seconds = parse_list("--iteration-seconds", text, float)
    if len(seconds) != len(nodes):
        raise ValueError(f"--iteration-seconds has {len(seconds)} values for {len(nodes)} node counts: give one "
                         f"measured time per node count")
    return seconds


def search(args: argparse.Namespace, config, nodes: list[int], hardware: Hardware, assumptions: Assumptions) -> int:
    if len(nodes) != 1:
        raise ValueError(f"--search takes one node count, got --nodes {args.nodes}")
    tried, results = search_layouts(config, nodes[0], hardware, assumptions, uneven_stages=args.uneven_stages)
    if args.json:
        print(json.dumps(search_to_dict(config, nodes[0], hardware, assumptions, tried, results, args.top), indent=1))
    else:
        print(format_search(config, nodes[0], hardware, tried, results, args.top))
    if not results:
        print(f"error: no layout of {tried} fits at {nodes[0]} nodes", file=sys.stderr)
    return 0 if results else 1


def context_parallel(args: argparse.Namespace, config, nodes: list[int], hardware: Hardware,
                     assumptions: Assumptions) -> int:
    from planner.context import context_parallel_rows, format_context_parallel

    if len(nodes) != 1:
        raise ValueError(f"--context-parallel takes one node count, got --nodes {args.nodes}")
    rows = context_parallel_rows(config, nodes[0], hardware, assumptions,
                                 parse_list("--context-parallel", args.context_parallel, int))
    print(format_context_parallel(config, nodes[0], hardware, rows))
    for row in rows:
        for error in row.plan.errors[:1]:
            print(f"error: CP {row.context_parallel_size}: {error}", file=sys.stderr)
    return 0 if any(row.longest_sequence for row in rows) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    deepspeed_logs_to_stderr()  # counting the stages imports DeepSpeed, whose logger writes to stdout
    try:
        config = load_run_config(args.ds_config, args.set, check_layout=False)
        check_run_layout(config, args.uneven_stages)
        nodes = parse_list("--nodes", args.nodes, int)
        measured = parse_iteration_seconds(args.iteration_seconds, nodes)
        hardware = hardware_from_args(args)
        assumptions = Assumptions(**{name: getattr(args, name) for name in ASSUMPTION_FLAGS.values()},
                                  attention_scores=args.attention_scores)
        if args.search:
            return search(args, config, nodes, hardware, assumptions)
        if args.context_parallel:
            return context_parallel(args, config, nodes, hardware, assumptions)
        storage = Storage(**{name: getattr(args, name) for name in STORAGE_FLAGS.values()})
        parameters = count_parameters(config, args.uneven_stages)
        plans = [plan_cluster(config, n, hardware, assumptions, parameters, seconds, storage)
                 for n, seconds in zip(nodes, measured, strict=True)]
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report_to_dict(config, hardware, assumptions, parameters, plans, storage), indent=1))
    else:
        print(format_header(config, hardware, assumptions, parameters))
        for plan in plans:
            print("\n" + format_plan(plan))
        print("\n" + format_comparison(plans))
    for plan in plans:
        for error in plan.errors:
            print(f"error: {plan.nodes} nodes: {error}", file=sys.stderr)
    return 0 if all(plan.ok for plan in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
