"""Published training runs, set beside the planner's figures for a model of the same shape: what a team reported for
the whole training, and what that run did that the planner does not model.

    preset        source                                             GPUs          GPU-hours per   tokens   GPU-hours
                                                                                   1e12 tokens
    deepseek-v3   DeepSeek-V3 technical report (arXiv:2412.19437),   2,048 H800    180,000         14.8e12  2,664,000
                  section 1 and table 1: pre-training only (context
                  extension 119K and post-training 5K more)

The report's 180K is per trillion tokens of pre-training ("3.7 days on our cluster with 2048 H800 GPUs"), and its
2,664K the 14.8T tokens of pre-training: 180K x 14.8 = 2,664K. A model matches a run when its shape (the fields of
SHAPE_FIELDS and its experts) is the preset's; the sequence length, precision and layout may differ (the plan says
its own).
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig, preset

SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "attention_type", "q_lora_rank", "kv_lora_rank",
                "ffn_hidden_size", "vocab_size")
EXPERT_FIELDS = ("num_experts", "top_k", "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size", "first_dense_layers")


@dataclass(frozen=True)
class PublishedRun:
    preset: str
    source: str
    gpus: str
    """The cluster, as the source gives it."""
    gpu_hours_per_trillion_tokens: float
    tokens: float
    gpu_hours: float
    """The whole run's (tokens of them)."""
    differences: str
    """What the run did that the planner does not model."""


PUBLISHED_RUNS: dict[str, PublishedRun] = {
    "deepseek-v3": PublishedRun(
        preset="deepseek-v3", source="DeepSeek-V3 technical report, table 1 (pre-training)", gpus="2,048 H800",
        gpu_hours_per_trillion_tokens=180e3, tokens=14.8e12, gpu_hours=2.664e6,
        differences="FP8 GEMMs, DualPipe overlapping the all-to-alls with compute, node-limited dispatch (each token "
                    "to at most 4 nodes, sent once per node)"),
}


def published_run(model: ModelConfig) -> PublishedRun | None:
    """The published run of a preset of ``model``'s shape, or None."""
    for run in PUBLISHED_RUNS.values():
        reference = preset(run.preset)
        if any(getattr(model, name) != getattr(reference, name) for name in SHAPE_FIELDS):
            continue
        if (model.moe is None) != (reference.moe is None):
            continue
        if model.moe is None or all(getattr(model.moe, name) == getattr(reference.moe, name) for name in EXPERT_FIELDS):
            return run
    return None
