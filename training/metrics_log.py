"""Metrics to the console, to TensorBoard and to ``<save>/metrics.jsonl`` (one JSON object per line), rank 0 only.

The JSONL file is what tools/plot_schedule.py and the tests read back. After a resume, steps after the checkpoint
may appear twice (once from the run that stopped, once from the resumed run): readers keep the last record of a step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from training.config import RunConfig

CONSOLE_FIELDS = [
    ("step", "step {}"), ("consumed_tokens", "tokens {:,}"), ("consumed_samples", "samples {:,}"),
    ("global_batch", "batch {}"), ("micro_batches", "micro-batches {}"),
    ("pipeline_schedule", "{}"), ("lr", "lr {:.3e}"), ("loss", "loss {:.4f}"),
    ("perplexity", "ppl {:.2f}"), ("grad_norm", "grad norm {:.3f}"), ("noise_scale", "noise scale {:.1f}"),
    ("skipped_steps", "skipped {}"), ("spikes", "spikes {}"), ("z_loss", "z-loss {:.2e}"),
    ("max_attention_logit", "max logit {:.1f}"), ("log_z_mean", "log Z {:.2f}"),
    ("moe_aux_loss", "MoE aux {:.3f}"), ("moe_load_imbalance", "expert load max/mean {:.2f}"),
    ("samples_per_second", "{:.1f} samples/s"), ("tokens_per_second", "{:,.0f} tokens/s"),
    ("tokens_per_second_per_gpu", "{:,.0f} tokens/s/GPU"), ("fraction_done", "{:.1%} done"),
    ("eta_seconds", "ETA {}"),
    ("tflops_per_gpu", "{:.3f} TFLOP/s/GPU"), ("mfu", "MFU {:.1%}"), ("hfu", "HFU {:.1%}"),
    ("peak_memory_gib", "peak {:.1f} GiB"),
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


class MetricsLogger:
    def __init__(self, config: RunConfig, is_writer: bool) -> None:
        self.is_writer = is_writer
        self.jsonl = None
        self.tensorboard = None
        if not is_writer:
            return
        save = config.training.save
        if save:
            Path(save).mkdir(parents=True, exist_ok=True)
            self.jsonl = open(Path(save) / "metrics.jsonl", "a")
        tensorboard_dir = config.training.tensorboard_dir or (str(Path(save) / "tensorboard") if save else None)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=tensorboard_dir)

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
        if self.tensorboard:
            for key, value in _scalars(record):
                if key != "step":
                    self.tensorboard.add_scalar(f"{kind}/{key}", value, record["step"])
            if "loss" in record:
                self.tensorboard.add_scalar(f"{kind}/loss_vs_tokens", record["loss"], record["consumed_tokens"])

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
            self.jsonl = None
        if self.tensorboard:
            self.tensorboard.close()
            self.tensorboard = None
