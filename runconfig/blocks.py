"""The project's blocks of a run config besides the model's (model/config/): ``schedule``, ``data`` and ``training``,
typed and checked field by field (runconfig/run.py assembles them into a RunConfig; runconfig/monitors.py holds the
blocks inside ``training`` that configure a monitor or a guard)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runconfig.dpo import DPOConfig
from runconfig.fields import build_block
from runconfig.monitors import ProfileConfig, SpikeGuardConfig, WandbConfig, snapshot_config

BATCH_SCHEDULE_KEYS = {"ramp": {"start", "increment", "ramp_tokens"},
                       "noise_scale": {"start", "factor", "interval_steps"}}


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
        from data.gpt_dataset import parse_split  # data/ imports numpy: only when a data block is checked

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
    compile: bool = False
    """Compile each transformer block with torch.compile (inductor), regionally: the blocks, not the model
    (training/compile.py says what runs compiled and what stays eager). Equal to the eager run within fp32 rounding,
    dropout included; the compilation, during the first step, is logged once after the second. Off by default until
    scripts/gpu_smoke.sh has measured it on a GPU."""
    dpo: dict[str, Any] | None = None
    """Direct preference optimisation instead of the next-token loss (runconfig/dpo.py, training/dpo.py):
    {"beta", "loss_type": "sigmoid" | "ipo", "rpo_alpha", "label_smoothing"}, on batches of (chosen, rejected)
    pairs with their reference log-probs. None: off."""

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
        snapshot_config(self)  # training.plan_hardware names planner presets: checked where training starts
        self._check_dpo()
        guard = self.spike_guard_config()
        if guard.rollback and not self.save:
            raise ValueError("training.spike_guard.rollback needs a checkpoint to roll back to: set training.save")

    def profile_config(self) -> ProfileConfig | None:
        """training.profile as a ProfileConfig (None: off)."""
        return None if self.profile is None else build_block(ProfileConfig, "training.profile", self.profile)

    def wandb_config(self) -> WandbConfig | None:
        """training.wandb as a WandbConfig (None: off). wandb itself is imported only when the run starts."""
        return None if self.wandb is None else build_block(WandbConfig, "training.wandb", self.wandb)

    def dpo_config(self) -> DPOConfig | None:
        """training.dpo as a DPOConfig (None: the next-token loss)."""
        return None if self.dpo is None else build_block(DPOConfig, "training.dpo", self.dpo)

    def _check_dpo(self) -> None:
        if self.dpo_config() is None:
            return
        for name, why in (("z_loss", "a term of the next-token loss"),
                          ("stability_interval", "its log Z record reads the next-token loss")):
            if getattr(self, name):
                raise ValueError(f"training.{name} is {why}, which training.dpo replaces: set training.{name} to 0")

    def spike_guard_config(self) -> SpikeGuardConfig:
        SpikeGuardConfig.refuse_retired_keys(self.spike_guard)
        return build_block(SpikeGuardConfig, "training.spike_guard", self.spike_guard)
