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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.config import (
    ModelConfig,
    ParallelConfig,
    check_expert_parallel,
    preset,
    stages_per_rank,
    upgrade_model_fields,
)
from training.config_fields import apply_overrides, build_block, check_field_types
from training.schedules import BatchRamp, LearningRateSchedule

if TYPE_CHECKING:
    from training.noise_scale import NoiseScaleBatchSchedule

PROJECT_BLOCKS = ("model", "parallelism", "schedule", "data", "training")
GPT2_END_OF_TEXT = 50256
BATCH_SCHEDULE_KEYS = {"ramp": {"start", "increment", "ramp_tokens"},
                       "noise_scale": {"start", "factor", "interval_steps"}}
# DeepSpeed keys this project sets itself, or that would fight its schedules.
FORBIDDEN_DEEPSPEED_KEYS = {
    "scheduler": "the learning rate follows schedule.* in tokens; remove the DeepSpeed scheduler block",
    "gradient_accumulation_steps": "it follows from the global batch; set train_batch_size and "
                                   "train_micro_batch_size_per_gpu only",
}


@dataclass
class ScheduleConfig:
    lr: float
    """Peak learning rate."""
    warmup_tokens: float
    """Linear warmup, in tokens."""
    decay_tokens: float
    """Cosine decay after warmup, in tokens, to min_lr_ratio x lr; constant afterwards."""
    train_tokens: float
    """Train until this many tokens are consumed."""
    min_lr_ratio: float = 0.1
    """The minimum learning rate as a fraction of the peak."""
    batch: dict[str, Any] = field(default_factory=dict)
    """The global batch: {"type": "ramp", start, increment, ramp_tokens} (the recipe's fixed ramp in tokens; empty:
    no ramp), or {"type": "noise_scale", start, factor, interval_steps} (factor x the measured gradient noise scale,
    training/noise_scale.py; needs DP >= 2). Either ends at train_batch_size."""

    def __post_init__(self) -> None:
        if self.train_tokens <= 0:
            raise ValueError(f"schedule.train_tokens must be positive, got {self.train_tokens}")
        kind = self.batch.get("type", "ramp")
        if kind not in BATCH_SCHEDULE_KEYS:
            raise ValueError(f"schedule.batch.type {kind!r} is not known: use \"ramp\" or \"noise_scale\"")
        unknown = set(self.batch) - BATCH_SCHEDULE_KEYS[kind] - {"type"}
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)} in schedule.batch of type {kind!r}: use "
                             f"{', '.join(sorted(BATCH_SCHEDULE_KEYS[kind]))}")
        if kind == "noise_scale" and "start" not in self.batch:
            raise ValueError("schedule.batch.start is required with type \"noise_scale\": the batch of the first "
                             "steps, before the noise scale is measured")
        if self.warmup_tokens > self.decay_tokens:
            raise ValueError(f"schedule.warmup_tokens ({self.warmup_tokens:g}) is longer than schedule.decay_tokens "
                             f"({self.decay_tokens:g}): warmup should be a small part of the run (the recipe: 1e9 "
                             f"then 340e9); check the units, both are tokens")


@dataclass
class DataConfig:
    blend: list[list[Any]] = field(default_factory=list)
    """[[weight, prefix], ...]: indexed datasets (prefix.bin / prefix.idx) and their sampling weights."""
    split: str = "969,30,1"
    """Train/valid/test proportions of the documents."""
    cache_dir: str | None = None
    """Where the sample index arrays are cached. Default: an ``index-cache`` folder beside each dataset, or, when the
    dataset's folder is not writable, ``<training.save>/index-cache`` (``~/.cache/mtnlg-ds/index-cache`` without a
    save directory); the choice is printed at start-up. One process per node (LOCAL_RANK 0) builds the arrays, the
    others memory-map them (data/index_cache.py)."""
    cache_timeout_s: float = 1800.0
    """How long the other processes of a node wait for its first process to build the index arrays."""
    eod_mask_loss: bool = False
    """Do not train on the prediction that follows an end-of-document token (the first token of the next document,
    which the previous one cannot predict), as Megatron-LM's --eod-mask-loss. Before, this masked where the label was
    the end-of-document token, so that a model never learnt to end a document."""
    packing: str | None = None
    """How documents become samples of seq_length + 1 tokens (data/packing.py): "concat" (Megatron's pretraining
    samples, documents laid end to end and cut at sample boundaries), or whole documents, end-token padded: "bfd"
    (best-fit decreasing, TRL's), "greedy" (in order until the next does not fit) or "none" (one per sample).
    Default: "bfd" when training.fine_tune is set, else "concat". Under whole-document packing reset_attention_mask
    and reset_position_ids default to true: the documents of a sample do not see each other."""
    packing_overflow: str = "truncate"
    """A document longer than a sample, under whole-document packing: "truncate" it (TRL's default), "drop" it, or
    "split" it into pieces of seq_length + 1 tokens packed as documents of their own. The run's log counts them."""
    reset_attention_mask: bool | None = None
    """Documents packed in one sample never attend to each other (a block-diagonal causal mask, as Megatron-LM's
    --reset-attention-mask, which Llama 3 pretrained with); where documents are: document_boundaries. Default:
    true under whole-document packing (data.packing "bfd", "greedy", "none"), false under "concat"."""
    reset_position_ids: bool | None = None
    """Positions restart at 0 where each document starts (Megatron-LM's --reset-position-ids), for RoPE and
    learned positions alike. Default as reset_attention_mask. Alone it still runs attention through the masked
    kernel (a mask of one document), not SDPA's causal one."""
    document_boundaries: str = "dataset"
    """Where a sample's documents are, for reset_attention_mask and reset_position_ids (data/loader.py): "dataset",
    where the data says documents start (the pieces of a packed sample, the document index's cut of a concat one),
    whatever their tokens; or "eod_token", Megatron-LM's rule: a document ends at each eod_token_id, for corpora
    tokenised elsewhere, refused at start-up on a dataset whose end token also occurs inside its documents. The two
    agree on a corpus preprocessed with --append-eod. A chat template whose end-of-turn token is the tokenizer's eos
    (Qwen's <|im_end|>, Llama 3's <|eot_id|>) needs "dataset": the token rule would cut every turn apart."""
    eod_token_id: int | None = None
    """The tokenizer's end-of-document id: it ends documents for eod_mask_loss, reset_attention_mask,
    reset_position_ids and whole-document packing (which also pads with it). Default: the end-of-text token of the
    Hugging Face tokenizer the run starts from (carried by training.init_from's checkpoint, else in model.from_hf's
    directory), else GPT-2's <|endoftext|>, 50256."""

    def __post_init__(self) -> None:
        from data.gpt_dataset import parse_split

        try:
            parse_split(self.split)
        except ValueError as error:
            raise ValueError(f"data.split: {error}") from None
        from data.packing import OVERFLOWS, PACKINGS

        if self.packing is not None and self.packing not in PACKINGS:
            raise ValueError(f"data.packing must be one of {PACKINGS} (or null: \"bfd\" when fine-tuning, else "
                             f"\"concat\"), got {self.packing!r}")
        if self.packing_overflow not in OVERFLOWS:
            raise ValueError(f"data.packing_overflow must be one of {OVERFLOWS}, got {self.packing_overflow!r}")
        from data.loader import DOCUMENT_BOUNDARIES

        if self.document_boundaries not in DOCUMENT_BOUNDARIES:
            raise ValueError(f"data.document_boundaries must be one of {DOCUMENT_BOUNDARIES}, got "
                             f"{self.document_boundaries!r}")
        if self.cache_timeout_s <= 0:
            raise ValueError(f"data.cache_timeout_s must be positive, got {self.cache_timeout_s}")
        for i, entry in enumerate(self.blend):
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], (int, float))
                    and entry[0] > 0 and isinstance(entry[1], str)):
                raise ValueError(f"data.blend[{i}] must be [positive weight, \"path/prefix\"], got {entry!r}")


@dataclass
class TrainingConfig:
    seed: int = 1234
    """Seeds the model init (identical for every TP/PP split) and the data order."""
    log_interval: int = 10
    """Log every N steps (console and TensorBoard)."""
    eval_interval: int = 0
    """Evaluate on the validation split every N steps (0: never, except at the end if eval_iters > 0)."""
    eval_iters: int = 10
    """Validation batches per evaluation."""
    save: str | None = None
    """Checkpoint directory; the run resumes from its latest complete checkpoint by itself."""
    save_interval: int = 0
    """Checkpoint every N steps (0: only at the end and on SIGTERM/SIGINT)."""
    checkpoint_mode: str = "async"
    """"async": a checkpoint stops training only while the state is copied to host memory, a background writer
    writes it, and ``latest`` moves once every rank's files are on disk (training/checkpoint.py); it needs host
    memory for one copy of what the rank writes. "sync": the same files, written before training continues."""
    keep_last: int | None = None
    """Keep only the newest N complete checkpoints (older ones are deleted by rank 0 once the new ``latest`` is
    committed). None: delete nothing."""
    keep_every: int | None = None
    """With keep_last: also keep, for good, the checkpoints of every M-th step."""
    fallback_on_corrupt_checkpoint: bool = False
    """When the latest checkpoint fails its integrity check on resume, load the previous complete one (and say so)
    instead of stopping."""
    reshape_timeout_s: float = 7200.0
    """How long ranks wait for rank 0 to convert a checkpoint written at another TP x PP x DP (DeepSpeed's universal
    checkpoint), before they stop with an error."""
    tensorboard_dir: str | None = None
    """TensorBoard event files (default: <save>/tensorboard when save is set)."""
    wandb: dict[str, Any] | None = None
    """Weights & Biases (training/wandb_sink.py): {"project", "name", "group", "mode": "online" | "offline" |
    "disabled", "dir"}, the TensorBoard scalars logged by rank 0; a resume continues the same W&B run. Needs the
    wandb extra (pip install .[wandb]). None: off."""
    peak_tflops_per_gpu: float | None = None
    """For MFU: the GPU's dense peak (bf16/fp16), TFLOP/s. Default: detected from the GPU name, none on CPU."""
    plan_hardware: str | dict[str, Any] | None = None
    """Log measured against planned (training/plan_check.py) on this planner/hardware.py GPU_PRESETS name or dict of
    its fields. Default: the visible GPU's preset, none on CPU."""
    memory_snapshot: dict[str, Any] | None = None
    """CUDA allocator snapshots (training/memory_snapshot.py): {"step", "on_oom", "stacks", "max_entries"}."""
    init_from: str | None = None
    """Initialise the weights from this checkpoint (e.g. one made by tools/convert_from_hf.py, or a pretraining run's
    checkpoint directory) with a fresh optimizer, when the save directory holds no checkpoint yet. The schedules
    continue at its consumed tokens (an import's hf_import.json start_tokens), the data at sample 0."""
    fine_tune: bool = False
    """With init_from: a new run on its weights, as fine-tuning wants: the learning-rate and batch schedules start at
    0 tokens (warmup included) whatever the checkpoint had consumed, with a fresh optimizer and the data at sample
    0. false: the schedules continue at the checkpoint's tokens (continued pretraining)."""
    max_consecutive_skips: int = 20
    """Stop (with the batch positions) when this many steps in a row were skipped (non-finite loss or gradient,
    fp16 overflow, loss spike without rollback)."""
    spike_guard: dict[str, Any] = field(default_factory=dict)
    """The loss-spike rule and guard: {"enabled": false, "ratio": 1.2, "min_increase_nats": 0.3, "rollback": false,
    "max_rollbacks": 10}. ratio and min_increase_nats define a spike (training/spikes.py), counted in the log on
    every run; "enabled" also skips the spike's update (training/guards.py). window, threshold_std and min_increase
    (the earlier window rule) are refused, naming their replacements."""
    rendezvous_timeout_s: float = 600.0
    """How long a rank waits for the master (rank 0, at MASTER_ADDR:MASTER_PORT) to accept connections before it
    stops with an error naming that address; rank 0's node may start later than the others on a large cluster."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in total, even if train_tokens are not reached (for tests)."""
    noise_scale_beta: float = 0.99
    """Moving-average beta of the gradient noise scale's |G|^2 and tr(Sigma) estimates, measured at every step when
    DP >= 2 (training/noise_scale.py)."""
    z_loss: float = 0.0
    """Coefficient of the z-loss, coef x mean(log Z^2) over the tokens, added to the cross-entropy (model/loss.py;
    PaLM: 1e-4). 0: off. Logged apart from the loss as z_loss."""
    loss_normalization: str | None = None
    """What the step's loss divides its summed token losses by (model/loss.py); default "tokens" when fine_tune is
    set, else "micro_batch" (the start-up line says which). "micro_batch": each micro-batch's loss is the mean over
    its target tokens, and the step averages the micro-batches and the data-parallel replicas: equal to "tokens" whenever every micro-batch has as many target tokens (pretraining,
    where every position is a target), and the bits of every earlier run. "tokens": the sum over the whole global
    batch divided by its target-token count, whatever the split into micro-batches, accumulation steps and replicas
    (TRL's num_items_in_batch, Megatron-LM's --calculate-per-token-loss): what fine-tuning on masked data wants, where
    micro-batches hold different numbers of targets and a short answer would otherwise weigh as much as a long one."""
    stability_interval: int = 0
    """Every N steps, measure the stability monitors (training/stability.py): the largest attention logit of each
    block on one fixed micro-batch, the mean and smallest log Z of the step's tokens, and each parameter group's
    update / weight RMS ratio. 0: never."""
    profile: dict[str, Any] | None = None
    """torch profiler traces (training/profiling.py): {"steps": [first, last], "ranks": [0]} (ranks: global ranks
    or "all"), written to <training.save>/profile/, each pipeline instruction a range. None: off."""
    eval_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks run on the live model (training/task_evaluation.py): the shipped ones
    (evaluation/tasks/: alice_lastword, alice_choice, alice_pages), eval_tasks_include_path's, or lm-eval's own with
    their datasets cached. Empty: none."""
    eval_tasks_interval: int = 0
    """Run eval_tasks every N steps (0: only at the end of the run)."""
    eval_tasks_limit: int | None = None
    """At most this many documents per task (None: all)."""
    eval_tasks_num_fewshot: int | None = None
    """Examples before each question (None: each task's own)."""
    eval_tasks_include_path: str | None = None
    """A folder of task YAMLs besides the shipped ones."""
    eval_tasks_tokenizer: str | None = None
    """The Hugging Face tokenizer of the training data (default: the one the run started from, training.init_from's
    or model.from_hf's, else GPT-2's)."""

    def __post_init__(self) -> None:
        for name in ("log_interval",):
            if getattr(self, name) <= 0:
                raise ValueError(f"training.{name} must be positive, got {getattr(self, name)}")
        for name in ("eval_interval", "eval_iters", "save_interval", "stability_interval", "z_loss"):
            if getattr(self, name) < 0:
                raise ValueError(f"training.{name} must be >= 0, got {getattr(self, name)}")
        if self.loss_normalization not in (None, "micro_batch", "tokens"):
            raise ValueError(f"training.loss_normalization must be \"micro_batch\" or \"tokens\", got "
                             f"{self.loss_normalization!r}")
        if self.checkpoint_mode not in ("async", "sync"):
            raise ValueError(f"training.checkpoint_mode must be \"async\" or \"sync\", got {self.checkpoint_mode!r}")
        if self.fine_tune and not self.init_from:
            raise ValueError("training.fine_tune starts a new run on the weights of training.init_from, which is not "
                             "set: give the pretrained checkpoint directory (or a tools/convert_from_hf.py output)")
        if self.save_interval and not self.save:
            raise ValueError("training.save_interval is set but training.save (the checkpoint directory) is not")
        if not 0.0 <= self.noise_scale_beta < 1.0:
            raise ValueError(f"training.noise_scale_beta must be in [0, 1), got {self.noise_scale_beta}")
        for name in ("keep_last", "keep_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be >= 1 (or null to keep everything), got {getattr(self, name)}")
        if self.keep_every is not None and self.keep_last is None:
            raise ValueError("training.keep_every only says what to keep besides training.keep_last: set keep_last "
                             "too (nothing is deleted without it)")
        if self.reshape_timeout_s <= 0:
            raise ValueError(f"training.reshape_timeout_s must be positive, got {self.reshape_timeout_s}")
        if self.rendezvous_timeout_s <= 0:
            raise ValueError(f"training.rendezvous_timeout_s must be positive, got {self.rendezvous_timeout_s}")
        if self.max_consecutive_skips < 1:
            raise ValueError(f"training.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}")
        if self.eval_tasks_interval < 0:
            raise ValueError(f"training.eval_tasks_interval must be >= 0, got {self.eval_tasks_interval}")
        if self.eval_tasks_interval and not self.eval_tasks:
            raise ValueError("training.eval_tasks_interval is set but training.eval_tasks is empty: name the tasks, "
                             "e.g. [\"alice_lastword\", \"alice_choice\"]")
        if self.profile is not None and not self.save:
            raise ValueError("training.profile writes its traces beside the checkpoints: set training.save")
        self.profile_config()
        self.wandb_config()
        from training import memory_snapshot, plan_check  # each names its own bad field
        memory_snapshot.snapshot_config(self), plan_check.hardware_of(self.plan_hardware)
        guard = self.spike_guard_config()
        if guard.rollback and not self.save:
            raise ValueError("training.spike_guard.rollback needs a checkpoint to roll back to: set training.save")

    def profile_config(self):
        """training.profile as a ProfileConfig (None: off)."""
        from training.profiling import ProfileConfig

        return None if self.profile is None else build_block(ProfileConfig, "training.profile", self.profile)

    def wandb_config(self):
        """training.wandb as a WandbConfig (None: off). wandb itself is imported only when the run starts."""
        from training.wandb_sink import WandbConfig

        return None if self.wandb is None else build_block(WandbConfig, "training.wandb", self.wandb)

    def spike_guard_config(self):
        from training.guards import SpikeGuardConfig

        SpikeGuardConfig.refuse_retired_keys(self.spike_guard)
        return build_block(SpikeGuardConfig, "training.spike_guard", self.spike_guard)


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
        from training.noise_scale import NoiseScaleBatchSchedule  # imports torch: only when used

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


def load_run_config(path: str | Path, overrides: list[str] | None = None, *, check_layout: bool = True) -> RunConfig:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    return parse_run_config(apply_overrides(raw, overrides or []), source=str(path), check_layout=check_layout)
