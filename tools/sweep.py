#!/usr/bin/env python
"""Sweep short training runs over a grid of config overrides, stop the ones that diverge, and report.

Each run is train.py launched through DeepSpeed's per-node launcher (TP x PP x DP processes, default TP x PP), with
its own directory DIR/runs/<name>. The whole grid is checked before anything runs. Rerun the same command to resume
an interrupted sweep: finished runs are skipped, unfinished ones start again. The grid file: lab/grid.py; the output
layout, the divergence rule and resuming: lab/sweep.py; the report: lab/report.py; docs/stability.md.
"""

from __future__ import annotations

import argparse
import sys

EPILOG = """example (a few minutes on a 2-core laptop, from the repository root):
  export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
  python tools/sweep.py --grid ds_configs/sweeps/lr-qk-layernorm.yaml --output runs/sweeps/lr-qk-layernorm \\
      --parallel 2

  grid file (paths relative to the directory you run from):
    base: ds_configs/tiny-cpu.json
    set: {training.max_steps: 300, parallelism.tensor_parallel_size: 1, parallelism.pipeline_parallel_size: 1}
    grid:
      schedule.lr: [1.0e-3, 1.0e-2, 1.0e-1]
      model.num_layers: [2, 4]
    data: runs/demo/data/botchan_text_document      # optional: the runs' data.blend

  writes DIR/results.csv, DIR/report.md and its plots, DIR/runs/<name>/ (metrics.jsonl, train.log, result.json)

exit status: 0, 1 when a run failed (its log's end is in the report), 2 for a grid that cannot run, 130 on Ctrl-C
(rerun the same command to resume)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", required=True, help="the grid file (YAML): base, set, grid, data")
    parser.add_argument("--output", required=True, metavar="DIR", help="the sweep's directory (reused to resume)")
    parser.add_argument("--parallel", type=int, default=1, metavar="K", help="runs at a time (default 1)")
    parser.add_argument("--patience", type=int, default=20,
                        help="stop a run whose loss stays above loss_0 + margin for this many logged steps "
                             "(default 20)")
    parser.add_argument("--margin", type=float, default=0.5, help="see --patience (default 0.5)")
    parser.add_argument("--processes-per-run", type=int, default=None, metavar="P",
                        help="processes per run, a multiple of TP x PP (default TP x PP: data parallelism 1)")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each run's checkpoints (default: deleted once the run has its result)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from lab.grid import GridError
    from lab.report import write_report, write_results_csv
    from lab.sweep import DivergenceRule, run_sweep

    try:
        outcome = run_sweep(args.grid, args.output, parallel=args.parallel,
                            rule=DivergenceRule(args.patience, args.margin),
                            processes_per_run=args.processes_per_run, keep_checkpoints=args.keep_checkpoints,
                            progress=not args.no_progress, on_result=write_results_csv)
    except GridError as error:  # the grid or a run's config: nothing ran
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the running runs were stopped; rerun the same command to resume {args.output}",
              file=sys.stderr)
        return 130
    report = write_report(outcome)
    statuses = [r.status for r in outcome.results]
    print(f"{len(statuses)} runs: {statuses.count('finished')} finished, {statuses.count('diverged')} diverged, "
          f"{statuses.count('failed')} failed ({len(outcome.launched)} launched now); report: {report}")
    return 1 if "failed" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
