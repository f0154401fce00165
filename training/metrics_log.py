"""Metrics to the console, to TensorBoard and to ``<save>/metrics.jsonl`` (one JSON object per line), rank 0 only;
with training.wandb, the TensorBoard scalars to Weights & Biases as well (training/wandb_sink.py).

The JSONL file is what tools/plot_schedule.py and the tests read back. After a resume, steps after the checkpoint
may appear twice (once from the run that stopped, once from the resumed run): readers keep the last record of a step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from runconfig.run import RunConfig

CONSOLE_FIELDS = [
    ("step", "step {}"), ("consumed_tokens", "tokens {:,}"), ("consumed_samples", "samples {:,}"),
    ("global_batch", "batch {}"), ("micro_batches", "micro-batches {}"),
    ("pipeline_schedule", "{}"), ("lr", "lr {:.3e}"), ("loss", "loss {:.4f}"),
    ("perplexity", "ppl {:.2f}"), ("grad_norm", "grad norm {:.3f}"), ("noise_scale", "noise scale {:.1f}"),
    ("skipped_steps", "skipped {}"), ("spikes", "spikes {}"), ("z_loss", "z-loss {:.2e}"),
    ("max_attention_logit", "max logit {:.1f}"), ("log_z_mean", "log Z {:.2f}"),
    ("qk_clip_max_logit", "QK-clip max logit {:.1f}"), ("qk_clipped_heads", "heads clipped {}"),
    ("qk_clip_passes", "clip passes {}"),
    ("moe_aux_loss", "MoE aux {:.3f}"), ("moe_sequence_aux_loss", "MoE sequence aux {:.3f}"),
    ("moe_load_imbalance", "expert load max/mean {:.2f}"),
    ("samples_per_second", "{:.1f} samples/s"), ("tokens_per_second", "{:,.0f} tokens/s"),
    ("tokens_per_second_per_gpu", "{:,.0f} tokens/s/GPU"), ("fraction_done", "{:.1%} done"),
    ("eta_seconds", "ETA {}"), ("iteration_seconds", "{:.4g} s/step"),
    ("tflops_per_gpu", "{:.3f} TFLOP/s/GPU"), ("mfu", "MFU {:.1%}"), ("hfu", "HFU {:.1%}"),
    ("peak_memory_gib", "peak {:.1f} GiB"), ("peak_memory_allocated_gib", "window peak {:.2f} GiB allocated"),
    ("peak_memory_reserved_gib", "{:.2f} GiB reserved"),
    # measured / planned (training/plan_check.py): > 1 slower (time), < 1 slower (tokens/s)
    ("plan_iteration_ratio", "time/plan {:.3f}"), ("plan_tokens_per_second_ratio", "tokens/s / plan {:.3f}"),
    ("plan_memory_ratio", "reserved/plan {:.3f}"),
]


def duration(seconds: float) -> str:
    """3d 4h, 2h 05m, 7m 30s, 42s: the two largest units.

    >>> [duration(s) for s in (42.4, 450, 7500, 273600)]
    ['42s', '7m 30s', '2h 05m', '3d 04h']
    """
    seconds = int(round(seconds))
    days, hours, minutes = seconds // 86400, seconds // 3600 % 24, seconds // 60 % 60
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {seconds % 60:02d}s" if minutes else f"{seconds}s"


def format_record(kind: str, record: dict[str, Any]) -> str:
    shown = {**record, "eta_seconds": duration(record["eta_seconds"])} if record.get("eta_seconds") is not None \
        else record
    parts = [fmt.format(shown[key]) for key, fmt in CONSOLE_FIELDS if shown.get(key) is not None]
    if record.get("mtp_loss") is not None:  # model.mtp: each depth's cross-entropy beside the next token's
        depths = ", ".join(f"{value:.4f}" for value in record["mtp_loss"])
        parts.insert(parts.index(f"loss {record['loss']:.4f}") + 1, f"MTP {depths} (weight {record['mtp_weight']:g})")
    if kind == "train" and record.get("mfu") is None:
        parts.append("MFU n/a (no GPU peak known)")
    if kind == "tasks":  # lm-eval metrics, "<task>/<metric>"
        parts += [f"{key} {value:.4g}" for key, value in record.items() if "/" in key]
    return f"[{kind}] " + " | ".join(parts)


def read_metrics(path: str | Path, kind: str = "train") -> list[dict[str, Any]]:
    """The records of one kind, the last one of each step (see the module note on resumes)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if record.pop("kind") == kind:
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def _scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """The record's numbers, with a dict's as key/name (update_rms_ratio/matrices) and a list's as key/1 .. n
    (attention_logit_per_layer/1 is the first block)."""
    out = []
    for key, value in record.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out.append((key, value))
        elif isinstance(value, dict):
            out += [(f"{key}/{name}", v) for name, v in value.items() if isinstance(v, (int, float))]
        elif isinstance(value, list):
            out += [(f"{key}/{i}", v) for i, v in enumerate(value, 1) if isinstance(v, (int, float))]
    return out


class TensorBoardSink:
    """A MetricsLogger sink: each scalar as ``kind/name`` at the record's step; ``kind/loss_vs_tokens`` at its tokens.
    training/wandb_sink.py WandbSink is the other one: the same ``write(kind, step, scalars)`` and ``close``."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(f"{kind}/{key}", value, step)
        if "loss" in scalars and "consumed_tokens" in scalars:
            self.writer.add_scalar(f"{kind}/loss_vs_tokens", scalars["loss"], scalars["consumed_tokens"])

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class MetricsLogger:
    def __init__(self, config: RunConfig, is_writer: bool) -> None:
        self.config, self.is_writer = config, is_writer
        self.jsonl = None
        self.sinks: list = []
        """Where each record's scalars go: TensorBoardSink, and WandbSink once start_wandb opened it."""
        if not is_writer:
            return
        save = config.training.save
        if save:
            Path(save).mkdir(parents=True, exist_ok=True)
            self.jsonl = open(Path(save) / "metrics.jsonl", "a")
        tensorboard_dir = config.training.tensorboard_dir or (str(Path(save) / "tensorboard") if save else None)
        if tensorboard_dir:
            self.sinks.append(TensorBoardSink(tensorboard_dir))

    def start_wandb(self, resumed: bool, layout: dict[str, Any]) -> None:
        """With training.wandb set, on the writer: start the W&B run, or continue it when ``resumed`` from a
        checkpoint (training/wandb_sink.py); its config is the run config and ``layout``."""
        wandb_config = self.config.training.wandb_config()
        if not self.is_writer or wandb_config is None:
            return
        from training.wandb_sink import open_wandb

        sink = open_wandb(wandb_config, self.config.training.save, {**self.config.to_dict(), **layout}, resumed,
                          self.info)
        if sink is not None:
            self.sinks.append(sink)

    def info(self, message: str) -> None:
        if self.is_writer:
            print(message, file=sys.stdout, flush=True)

    def log(self, kind: str, record: dict[str, Any]) -> None:
        if not self.is_writer:
            return
        print(format_record(kind, record), flush=True)
        if self.jsonl:
            self.jsonl.write(json.dumps({"kind": kind, **record}) + "\n")
            self.jsonl.flush()
        self.log_scalars(kind, record["step"], {key: value for key, value in _scalars(record) if key != "step"})

    def log_scalars(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        """To TensorBoard and W&B only (not the console or metrics.jsonl): each record's, and events such as a
        committed checkpoint."""
        for sink in self.sinks if self.is_writer else ():
            sink.write(kind, step, scalars)

    def close(self) -> None:
        """At the end of training; inside an exception's ``finally`` the W&B run is marked failed."""
        failed = sys.exc_info()[0] is not None
        if self.jsonl:
            self.jsonl.close()
            self.jsonl = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(failed)
