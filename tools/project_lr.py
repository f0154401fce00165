#!/usr/bin/env python
"""Project the learning rate of a large run from a sweep of small ones: best LR per size, lr = a N^b, the target.

    python tools/project_lr.py --results runs/sweep/results.csv --target ds_configs/530b.json
    python tools/project_lr.py --results a.csv b.csv --by compute --target ds_configs/530b.json --plot lr.png
    python tools/project_lr.py --results runs/sweep/results.csv --where model.init_method_std=0.02

--results: the sweep's results.csv files, one row per run; the columns read (schedule.lr, parameters, tokens,
final_loss, diverged) and what they mean: lab/results.py. Every other column whose name holds a dot
(model.hidden_size, training.seed, ...) is another swept config path.
Rows are grouped by size, the `parameters` column. Within a size every row must differ only in schedule.lr; where
another path varies too, choose one value of it with --where PATH=VALUE (repeatable; numbers compare as numbers).

Per size: the best learning rate, the vertex of a parabola in ln(lr) through the lowest loss and its neighbours,
or the grid's minimum when that is at the edge of the finite runs (then left out of the fit: extend the grid, or
pass --include-edges). Across sizes: lr = a x^b by least squares in logs, x = N (--by parameters) or C = 6 N D
(--by compute), with a bootstrap interval over the sizes. With --target, the projection at the target's x beside
its own schedule.lr, GPT-3's Table 2.1 fit at its N and DeepSeek LLM's law at its C = M D. The formulas and the
references: lab/projection.py; the steps: lab/projection_report.py. Results on stdout; exit status 1 with the reason
on stderr for invalid input.
"""

from __future__ import annotations

import argparse
import sys

from lab.projection_report import BY, project


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", required=True, metavar="CSV", help="the sweep's results.csv files")
    parser.add_argument("--by", choices=BY, default="parameters",
                        help="fit lr against N, the non-embedding parameters (default), or C = 6 N D")
    parser.add_argument("--where", action="append", default=[], metavar="PATH=VALUE",
                        help="keep only the runs with this value of a swept config path (repeatable)")
    parser.add_argument("--include-edges", action="store_true",
                        help="fit the sizes whose best learning rate is at the edge of the grid too")
    parser.add_argument("--target", metavar="CONFIG", help="a run config, e.g. ds_configs/530b.json: project the "
                        "learning rate to its size and compare it with its schedule.lr")
    parser.add_argument("--set", action="append", default=[], metavar="BLOCK.FIELD=VALUE",
                        help="override a field of the --target config")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the sizes, the fit, GPT-3's table and the target")
    parser.add_argument("--samples", type=int, default=1000, help="bootstrap resamples (1000)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(project(args.results, by=args.by, where=args.where, include_edges=args.include_edges,
                      target=args.target, overrides=args.set, plot_path=args.plot, samples=args.samples,
                      seed=args.seed))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
