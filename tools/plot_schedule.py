#!/usr/bin/env python
"""Draw a run's learning rate and global batch size against tokens, or print them at chosen token counts.

    python tools/plot_schedule.py --ds_config ds_configs/530b.json --output schedule.png
    python tools/plot_schedule.py --ds_config ds_configs/530b.json --at 0,1e9,12e9,341e9
        -> one line per token count: tokens, learning rate, global batch in force

With --metrics RUN/metrics.jsonl it also draws what a run actually used (batch and learning rate per step) and,
when the run measured it (DP >= 2), the gradient noise scale B_simple against tokens, beside the batch in force.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from runconfig.run import RunConfig, load_run_config


def schedule_table(config: RunConfig, tokens: list[float]) -> list[tuple[int, float, int]]:
    lr, batch = config.learning_rate_schedule(), config.batch_schedule()
    return [(int(t), lr(t), batch(t)) for t in tokens]


def plot(config: RunConfig, output: str, metrics: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = config.schedule
    end = max(s.train_tokens, s.warmup_tokens + s.decay_tokens) * 1.05
    tokens = np.linspace(0, end, 4000)
    lr, batch = config.learning_rate_schedule(), config.batch_schedule()
    records = []
    if metrics:
        from training.metrics_log import read_metrics

        records = read_metrics(metrics)
    measured = [r for r in records if r.get("noise_scale") is not None]
    panels = 3 if measured else 2
    figure, axes = plt.subplots(panels, 1, figsize=(9, 3.2 * panels + 0.5), sharex=True)
    top, bottom = axes[0], axes[1]
    top.plot(tokens, [lr(t) for t in tokens], label="schedule")
    bottom.step(tokens, [batch(t) for t in tokens], where="post", label="schedule")
    if records:
        before = [r["consumed_tokens"] - r["global_batch"] * config.model.seq_length for r in records]
        top.plot([r["consumed_tokens"] for r in records], [r["lr"] for r in records], ".", ms=3, label="run")
        bottom.plot(before, [r["global_batch"] for r in records], ".", ms=3, label="run")
        top.legend(), bottom.legend()
    for marker, name in ((s.warmup_tokens, "warmup end"), (s.warmup_tokens + s.decay_tokens, "decay end"),
                         (s.train_tokens, "training end")):
        for axis in (top, bottom):
            axis.axvline(marker, color="grey", lw=0.8, ls="--")
        top.annotate(name, (marker, s.lr), rotation=90, fontsize=8, va="top", ha="right")
    if measured:
        noise = axes[2]
        tokens_at = [r["consumed_tokens"] for r in measured]
        noise.plot(tokens_at, [r["noise_scale"] for r in measured], label="measured noise scale B_simple")
        noise.step([r["consumed_tokens"] for r in records], [r["global_batch"] for r in records], where="pre",
                   label="global batch used")
        noise.set_yscale("log")
        noise.set_ylabel("sequences")
        noise.legend()
        noise.set_xlabel("tokens")
    top.set_ylabel("learning rate")
    bottom.set_ylabel("global batch (sequences)")
    axes[-1].set_xlabel("tokens")
    top.set_title(f"{config.source}: lr peak {s.lr:g}, warmup {s.warmup_tokens:.3g} tokens, cosine to "
                  f"{s.min_lr_ratio:g} x peak over {s.decay_tokens:.3g}\nglobal batch {batch.start} -> {batch.end} "
                  f"by {batch.increment} over {batch.ramp_tokens:.3g} tokens", fontsize=10)
    figure.tight_layout()
    figure.savefig(output, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ds_config", required=True, help="the run's JSON config")
    parser.add_argument("--set", action="append", default=[], metavar="BLOCK.FIELD=VALUE", help="override a field")
    parser.add_argument("--at", help="comma-separated token counts: print tokens, lr, global batch at each")
    parser.add_argument("--output", help="PNG to draw (default: schedule.png unless --at is given)")
    parser.add_argument("--metrics", help="a run's metrics.jsonl, to draw what the run actually used")
    args = parser.parse_args(argv)
    try:
        config = load_run_config(args.ds_config, args.set)
        tokens = [float(t) for t in args.at.split(",")] if args.at else []
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if tokens:
        print(f"{'tokens':>15} {'lr':>13} {'global_batch':>12}")
        for t, lr, batch in schedule_table(config, tokens):
            print(f"{t:>15d} {lr:>13.6e} {batch:>12d}")
    output = args.output or (None if tokens else "schedule.png")
    if output:
        plot(config, output, args.metrics)
        print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
