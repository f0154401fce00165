"""One JSON per run: DeepSpeed's own keys, plus this project's blocks, parsed into typed, validated objects.

    {
      "train_batch_size": 1920, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, ...,
      "model":       {"preset": "530b", ...ModelConfig fields override the preset...},
      "parallelism": {"tensor_parallel_size": 8, "pipeline_parallel_size": 35},
      "schedule":    {"lr": 5e-5, "min_lr_ratio": 0.1, "warmup_tokens": 1e9, "decay_tokens": 340e9,
                      "train_tokens": 270e9, "batch": {"start": 32, "increment": 32, "ramp_tokens": 12e9}},
      "data":        {"blend": [[1.0, "path/prefix_text_document"]], "split": "969,30,1", ...},
      "training":    {"seed": 1234, "log_interval": 1, "save": "checkpoints/530b", ...}
    }

DeepSpeed receives only its own keys (``RunConfig.deepspeed``). Any field can be overridden from the command line
with ``--set block.field=value`` (the value is read as JSON when it parses, e.g. 1e6, true, [1, 2]; else as a
string). The full batch is DeepSpeed's train_batch_size; the ramp ends there. All validation that needs no process
group happens here, before anything is built.
"""


from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.config import (
    ModelConfig,
    ParallelConfig,
    check_expert_parallel,
    preset,
    stages_per_rank,
    upgrade_model_fields,
)
from runconfig.blocks import DataConfig, ScheduleConfig, TrainingConfig
from runconfig.fields import apply_overrides, build_block, check_field_types
from runconfig.optimizer import check_qk_clip, muon_config
from runconfig.schedules import BatchRamp, LearningRateSchedule, NoiseScaleBatchSchedule

PROJECT_BLOCKS = ("model", "parallelism", "schedule", "data", "training")
GPT2_END_OF_TEXT = 50256
# DeepSpeed keys this project sets itself, or that would fight its schedules.
FORBIDDEN_DEEPSPEED_KEYS = {
    "scheduler": "the learning rate follows schedule.* in tokens; remove the DeepSpeed scheduler block",
    "gradient_accumulation_steps": "it follows from the global batch; set train_batch_size and "
                                   "train_micro_batch_size_per_gpu only",
}


@dataclass
class RunConfig:
    model: ModelConfig
    parallelism: ParallelConfig
    schedule: ScheduleConfig
    data: DataConfig
    training: TrainingConfig
    deepspeed: dict[str, Any]
    """DeepSpeed's own keys, exactly as passed to deepspeed.initialize."""
    source: str = "<dict>"
    from_hf: str | None = None
    """model.from_hf: the Hugging Face model directory whose config.json gave the model's shape, if one did."""
    model_origin: str = "the model block"
    """Where the model's shape came from (the config file, a preset, model.from_hf's config.json): errors say it."""
    eod_origin: str = "data.eod_token_id"
    """Where data.eod_token_id came from."""
    loss_normalization_origin: str = "as set"
    """Where training.loss_normalization came from (the start-up line says it)."""

    @property
    def micro_batch_size(self) -> int:
        return int(self.deepspeed["train_micro_batch_size_per_gpu"])

    @property
    def global_batch_size(self) -> int:
        return int(self.deepspeed["train_batch_size"])

    def learning_rate_schedule(self) -> LearningRateSchedule:
        s = self.schedule
        return LearningRateSchedule(peak=s.lr, warmup_tokens=s.warmup_tokens, decay_tokens=s.decay_tokens,
                                    min_lr_ratio=s.min_lr_ratio)

    def batch_schedule(self) -> BatchRamp:
        """The fixed ramp in tokens; with type "noise_scale" none (the full batch): see noise_scale_schedule."""
        b = self.schedule.batch
        end = self.global_batch_size
        if b.get("type") == "noise_scale":
            return BatchRamp(start=end, increment=end, end=end, ramp_tokens=0.0)
        return BatchRamp(start=int(b.get("start", end)), increment=int(b.get("increment", end)), end=end,
                         ramp_tokens=float(b.get("ramp_tokens", 0)))

    def noise_scale_schedule(self, data_parallel_size: int) -> NoiseScaleBatchSchedule | None:
        """The batch schedule driven by the measured noise scale, or None with a "ramp" type."""
        b = self.schedule.batch
        if b.get("type") != "noise_scale":
            return None
        return NoiseScaleBatchSchedule(start=int(b["start"]), end=self.global_batch_size,
                                       micro_batch_size=self.micro_batch_size, data_parallel_size=data_parallel_size,
                                       factor=float(b.get("factor", 1.0)),
                                       interval_steps=int(b.get("interval_steps", 1)))

    def check_layout(self) -> None:
        """The model against its TP x PP split (and SP): a ValueError names the model's numbers and their origin."""
        try:
            self.model.check_parallel(self.parallelism.tensor_parallel_size,
                                      self.parallelism.pipeline_parallel_size, self.parallelism.sequence_parallel,
                                      stages_per_rank(self.parallelism.pipeline_schedule),
                                      self.parallelism.expert_parallel_size, self.parallelism.context_parallel_size)
        except ValueError as error:
            raise ValueError(f"{error} (the model's shape comes from {self.model_origin})") from None
        cp = self.parallelism.context_parallel_size
        if cp > 1 and self.training.eval_tasks:
            raise ValueError(f"training.eval_tasks scores whole sequences on the live stages, and parallelism."
                             f"context_parallel_size {cp} splits them: evaluate the checkpoints with tools/evaluate.py "
                             f"(it loads them at CP 1), or remove training.eval_tasks")
        if cp > 1 and self.schedule.batch.get("type") == "noise_scale":
            raise ValueError(f"schedule.batch.type \"noise_scale\" measures one replica's gradient, and under "
                             f"parallelism.context_parallel_size {cp} a rank holds the gradient of its slices of the "
                             f"sequence only: use the \"ramp\" type")
        if self.parallelism.pipeline_schedule == "dualpipev" and self.training.eval_tasks:
            raise ValueError("training.eval_tasks runs the live stages in pipeline order (evaluation/pipeline.py), and "
                             "under parallelism.pipeline_schedule \"dualpipev\" a rank holds two stages of a V: "
                             "evaluate the checkpoints with tools/evaluate.py (any layout), or train with \"1f1b\"")

    def check_world(self, world_size: int) -> int:
        """Validate against the launched world; return the data-parallel size."""
        dp = self.parallelism.data_parallel_size(world_size)
        check_expert_parallel(self.model.moe, self.parallelism.expert_parallel_size, dp)
        pp = self.parallelism.pipeline_parallel_size
        micro_batches = self.global_batch_size // (self.micro_batch_size * dp)
        if self.parallelism.pipeline_schedule == "dualpipev" and micro_batches < 2 * pp:
            raise ValueError(f"parallelism.pipeline_schedule \"dualpipev\" needs at least 2 x PP = {2 * pp} "
                             f"micro-batches per pipeline at the full batch, and train_batch_size "
                             f"{self.global_batch_size} / (micro-batch {self.micro_batch_size} x DP {dp}) gives "
                             f"{micro_batches}: raise train_batch_size to {2 * pp * self.micro_batch_size * dp} or more, "
                             f"or use \"1f1b\" (the ramp's smaller batches run the V-shaped schedule either way)")
        if self.schedule.batch.get("type") != "noise_scale":
            self.batch_schedule().check_divisible(self.micro_batch_size, dp)
            return dp
        if dp < 2:
            raise ValueError(f"schedule.batch.type \"noise_scale\" needs data parallelism >= 2 (the noise scale "
                             f"compares one replica's gradient with the DP mean); this world gives DP = {dp}: "
                             f"launch more processes or use the \"ramp\" type")
        self.noise_scale_schedule(dp)  # start and train_batch_size must be multiples of micro-batch x DP
        return dp

    def to_dict(self) -> dict[str, Any]:
        blocks = {name: dataclasses.asdict(getattr(self, name)) for name in PROJECT_BLOCKS}
        return {**copy.deepcopy(self.deepspeed), **blocks}


def _model_config(values: dict[str, Any], source: str) -> tuple[ModelConfig, str]:
    """The model block -> (ModelConfig, where its shape came from, for error messages).

    ``from_hf: DIR`` fills the block from a Hugging Face config.json (hf/config_map.py: the architecture, every shape
    field, RoPE and its scaling, the norm and its epsilon, tying, biases); a preset beside it gives the rest (the
    sequence length, precision, dropout, recompute), and a field set explicitly beside it must agree with the HF one.
    """
    values = upgrade_model_fields(values)
    hf_dir = values.pop("from_hf", None)
    name = values.pop("preset", None)
    if name is not None and not isinstance(name, str):
        raise ValueError(f"model.preset = {name!r}: expected a string, one of the preset names")
    if hf_dir is not None and not isinstance(hf_dir, str):
        raise ValueError(f"model.from_hf = {hf_dir!r}: expected a string, a Hugging Face model directory")
    check_field_types(ModelConfig, "model", values)
    origin = f"the model block of {source}" + (f" (preset {name!r})" if name else "")
    if hf_dir is not None:
        fields = hf_model_fields(hf_dir)
        conflicts = [f"model.{key} is {values[key]!r} in {source}, the HF model ({hf_dir}/config.json) has "
                     f"{value!r}" for key, value in fields.items() if key in values and values[key] != value]
        if conflicts:
            raise ValueError("model.from_hf and fields set beside it disagree:\n  " + "\n  ".join(conflicts) +
                             "\nremove those fields: model.from_hf sets them")
        values = {**values, **fields}
        origin = f"{hf_dir}/config.json (model.from_hf)" + (f" and preset {name!r}" if name else "")
    elif name is None:
        missing = [f.name for f in dataclasses.fields(ModelConfig)
                   if f.default is dataclasses.MISSING and f.name not in values]
        if missing:
            raise ValueError(f"{source}: the model block lacks {missing}: give a preset (model.preset), the fields, "
                             f"or a Hugging Face model (model.from_hf)")
    return (preset(name, **values) if name else ModelConfig(**values)), origin


def hf_model_fields(hf_dir: str) -> dict[str, Any]:
    """The ModelConfig fields a Hugging Face model directory's config.json fixes (transformers imported only here)."""
    from hf.config_map import model_fields_from_hf, read_hf_config

    return model_fields_from_hf(read_hf_config(hf_dir))


def parse_run_config(raw: dict[str, Any], source: str = "<dict>", *, check_layout: bool = True) -> RunConfig:
    """Validate everything that can be validated without a process group. ``check_layout=False`` leaves the TP x PP
    split unchecked, for a caller that first compares the model with something else (RunConfig.check_layout)."""
    missing = [name for name in ("model", "schedule") if name not in raw]
    if missing:
        raise ValueError(f"{source}: missing block(s) {missing}")
    deepspeed = {k: v for k, v in raw.items() if k not in PROJECT_BLOCKS}
    for key, why in FORBIDDEN_DEEPSPEED_KEYS.items():
        if key in deepspeed:
            raise ValueError(f"{source}: DeepSpeed key \"{key}\" is not used here: {why}")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        if not isinstance(deepspeed.get(key), int) or deepspeed[key] <= 0:
            raise ValueError(f"{source}: \"{key}\" must be a positive integer, got {deepspeed.get(key)!r}")
    optimizer_params = deepspeed.get("optimizer", {}).get("params", {})
    schedule_lr = raw["schedule"].get("lr")
    if "lr" in optimizer_params and optimizer_params["lr"] != schedule_lr:
        raise ValueError(f"{source}: optimizer.params.lr ({optimizer_params['lr']}) differs from schedule.lr "
                         f"({schedule_lr}): the schedule sets the learning rate; remove optimizer.params.lr")
    if "optimizer" in deepspeed and schedule_lr is not None:
        deepspeed = {**deepspeed, "optimizer": {**deepspeed["optimizer"], "params": {**optimizer_params,
                                                                                    "lr": schedule_lr}}}
    model, model_origin = _model_config(raw["model"], source)
    config = RunConfig(model=model,
                       parallelism=build_block(ParallelConfig, "parallelism", raw.get("parallelism", {})),
                       schedule=build_block(ScheduleConfig, "schedule", raw["schedule"]),
                       data=build_block(DataConfig, "data", raw.get("data", {})),
                       training=build_block(TrainingConfig, "training", raw.get("training", {})),
                       deepspeed=deepspeed, source=source, from_hf=raw["model"].get("from_hf"),
                       model_origin=model_origin)
    if check_layout:
        config.check_layout()
    _resolve_end_of_document(config)
    _resolve_loss_normalization(config)
    config.learning_rate_schedule()
    config.batch_schedule()
    config.noise_scale_schedule(data_parallel_size=1)  # bounds, factor, interval; the DP multiple in check_world
    _check_precision(config)
    _check_dpo(config)
    # Muon's fields, each checked by name; MuonClip against the model (runconfig/optimizer.py)
    check_qk_clip(muon_config(config.deepspeed), config.model, config.parallelism.context_parallel_size)
    return config


def _resolve_end_of_document(config: RunConfig) -> None:
    """data.eod_token_id: as set, else the end-of-text id of the HF tokenizer the run starts from (the one
    training.init_from's checkpoint carries, else model.from_hf's), else GPT-2's; it must fit the vocabulary."""
    if config.data.eod_token_id is None:
        config.data.eod_token_id, config.eod_origin = _tokenizer_end_of_text(config)
    if config.data.eod_token_id >= config.model.vocab_size:
        raise ValueError(f"{config.source}: model.vocab_size ({config.model.vocab_size}) is smaller than the "
                         f"tokenizer's: its end-of-document id data.eod_token_id ({config.data.eod_token_id}, "
                         f"{config.eod_origin}) does not fit; give the model at least the tokenizer's vocabulary "
                         f"(50257 for GPT-2), or set data.eod_token_id")


def _resolve_loss_normalization(config: RunConfig) -> None:
    """training.loss_normalization: as set, else "tokens" when fine-tuning (TRL's num_items_in_batch: a short answer
    weighs by its tokens), else "micro_batch"."""
    if config.training.loss_normalization is None:
        fine_tune = config.training.fine_tune
        config.training.loss_normalization = "tokens" if fine_tune else "micro_batch"
        config.loss_normalization_origin = ("the default of training.fine_tune" if fine_tune
                                            else "the default without training.fine_tune")


def _tokenizer_end_of_text(config: RunConfig) -> tuple[int, str]:
    from hf.tokenizer import TOKENIZER_DIRECTORY, TOKENIZER_FILES

    candidates = []
    if config.training.init_from:
        candidates.append(Path(config.training.init_from) / TOKENIZER_DIRECTORY)
    if config.from_hf:
        candidates.append(Path(config.from_hf))
    for directory in candidates:
        if any((directory / name).is_file() for name in TOKENIZER_FILES):
            from hf.tokenizer import end_of_text_id

            token = end_of_text_id(directory)
            if token is None:
                raise ValueError(f"the tokenizer in {directory} has no end-of-text token: set data.eod_token_id")
            return token, f"the end-of-text token of the tokenizer in {directory}"
    return GPT2_END_OF_TEXT, "GPT-2's <|endoftext|>, the default"


def _check_precision(config: RunConfig) -> None:
    bf16 = config.deepspeed.get("bf16", {}).get("enabled", False)
    fp16 = config.deepspeed.get("fp16", {}).get("enabled", False)
    deepspeed_precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if bf16 and fp16:
        raise ValueError(f"{config.source}: bf16 and fp16 are both enabled: enable one")
    if deepspeed_precision != config.model.precision:
        raise ValueError(f"{config.source}: model.precision is {config.model.precision!r} but the DeepSpeed sections "
                         f"enable {deepspeed_precision}: make them agree")


def _check_dpo(config: RunConfig) -> None:
    """training.dpo: what the preference loss needs of the other blocks, or what it does not run with yet."""
    if config.training.dpo is None:
        return
    refusals = []
    if config.deepspeed["train_micro_batch_size_per_gpu"] % 2:
        refusals.append(f"train_micro_batch_size_per_gpu ({config.deepspeed['train_micro_batch_size_per_gpu']}) "
                        f"must be even: a micro-batch holds whole (chosen, rejected) pairs, rows 2i and 2i + 1")
    if config.model.mtp is not None:
        refusals.append("model.mtp: the multi-token prediction loss is not combined with DPO yet; remove model.mtp")
    if config.parallelism.context_parallel_size > 1:
        refusals.append("parallelism.context_parallel_size > 1: a sequence's log-prob would be split over the CP "
                        "ranks, which DPO does not sum yet; use 1")
    if config.parallelism.pipeline_schedule != "1f1b":
        refusals.append(f"parallelism.pipeline_schedule {config.parallelism.pipeline_schedule!r}: DPO is checked "
                        f"under \"1f1b\" only so far")
    if config.model.moe is not None:
        refusals.append("model.moe: the routers' aux losses and load counts would take the padding of every pair's "
                        "rows as tokens, which DPO does not mask from them yet; train a dense model")
    if config.data.eod_mask_loss:
        refusals.append("data.eod_mask_loss: a pair's targets are its completion mask from the preference data; set "
                        "it to false")
    if config.training.eval_interval:
        refusals.append(f"training.eval_interval ({config.training.eval_interval}): DPO has no held-out evaluation "
                        f"yet (every pair trains); set it to 0")
    if refusals:
        raise ValueError(f"{config.source}: training.dpo: " + "; ".join(refusals))


def load_run_config(path: str | Path, overrides: list[str] | None = None, *, check_layout: bool = True) -> RunConfig:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    return parse_run_config(apply_overrides(raw, overrides or []), source=str(path), check_layout=check_layout)
