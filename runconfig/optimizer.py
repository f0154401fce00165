"""The ``optimizer`` block when its type is Muon: Muon's options beside the AdamW ones, each field checked by name.

    "optimizer": {"type": "Muon", "params": {"lr": 3e-3, "momentum": 0.95, "nesterov": true, "ns_steps": 5,
                                            "adjust_lr": "match_rms_adamw", "weight_decay": 0.1,
                                            "betas": [0.9, 0.95], "eps": 1e-8}}

    field          who reads it                        default           as torch.optim.Muon / AdamW call it
    lr             both (the schedule sets it)         schedule.lr       lr
    weight_decay   both, decoupled                     0.0               weight_decay (norms and biases: 0)
    momentum       Muon                                0.95              momentum
    nesterov       Muon                                true              nesterov
    ns_steps       Muon                                5                 ns_steps
    adjust_lr      Muon                                "match_rms_adamw" adjust_lr_fn ("original": Keller Jordan's)
    betas, eps     AdamW (embeddings, head, norms,     [0.9, 0.999],     betas, eps
                   biases, routers)                    1e-8
    qk_clip        MuonClip's threshold tau on each    null (off)        (Kimi-K2; not in torch)
                   head's largest attention logit
                   (training/muon.py QKClip)
    qk_clip_passes MuonClip's forwards of the step's    0 (Kimi-K2's      (not in Kimi-K2)
                   batch after its update, each          clip alone)
                   attention clipping itself, until
                   none passes tau (training/muon.py
                   clip_after_step)
    torch_adam     ignored (the AdamW groups are torch's functional AdamW already)

Muon's Newton-Schulz coefficients (3.4445, -4.775, 2.0315) and its eps 1e-7 are torch's, fixed. The optimizer itself
is training/muon.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ADJUST_LR = ("match_rms_adamw", "original")
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
NS_EPS = 1e-7
IGNORED_FIELDS = ("torch_adam",)


@dataclass(frozen=True)
class MuonConfig:
    lr: float = 1e-3
    """Muon's and AdamW's learning rate before the schedule (which sets every group's lr at each step)."""
    weight_decay: float = 0.0
    """Decoupled: each step multiplies a matrix by 1 - lr weight_decay (norms and biases are not decayed)."""
    momentum: float = 0.95
    """Muon's momentum mu: B = mu B + (1 - mu) g (torch's lerp form)."""
    nesterov: bool = True
    """Newton-Schulz runs on g + mu (B - g) (torch's lerp form) instead of B."""
    ns_steps: int = 5
    """Newton-Schulz iterations (torch's quintic, its coefficients)."""
    adjust_lr: str = "match_rms_adamw"
    """The per-matrix learning-rate scale of an [A, B] matrix: "match_rms_adamw" 0.2 sqrt(max(A, B)) (Moonlight),
    "original" sqrt(max(1, A / B)) (Keller Jordan)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas, for the parameters that are not block matrices."""
    eps: float = 1e-8
    """AdamW's eps."""
    qk_clip: float | None = None
    """MuonClip's threshold tau on the largest pre-softmax attention logit of each head; null: off. Refused where
    a head's logits cannot be scaled through its query and key rows (``check_qk_clip``)."""
    qk_clip_passes: int = 0
    """After Kimi-K2's clip, up to this many forwards of the step's micro-batches through the updated weights, each
    attention clipping its own rows before its output goes on, until a pass finds no head above tau: the clip then
    holds on the step's batch, which Kimi-K2's alone does not where one update moves the logits far (a large lr).
    Each pass costs a forward of the batch (no backward) and holds its outputs; 0: Kimi-K2's clip alone."""

    def __post_init__(self) -> None:
        if self.adjust_lr not in ADJUST_LR:
            raise ValueError(f"optimizer.params.adjust_lr {self.adjust_lr!r} is not one of {list(ADJUST_LR)}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"optimizer.params.momentum {self.momentum} must be in [0, 1)")
        if not isinstance(self.ns_steps, int) or isinstance(self.ns_steps, bool) or not 1 <= self.ns_steps < 100:
            raise ValueError(f"optimizer.params.ns_steps {self.ns_steps!r} must be an integer in [1, 100)")
        if self.weight_decay < 0 or self.lr < 0:
            raise ValueError(f"optimizer.params.lr ({self.lr}) and weight_decay ({self.weight_decay}) must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"optimizer.params.betas {list(self.betas)} must be two numbers in [0, 1)")
        if self.qk_clip is not None and not (isinstance(self.qk_clip, (int, float)) and self.qk_clip > 0):
            raise ValueError(f"optimizer.params.qk_clip {self.qk_clip!r} must be a logit threshold > 0 (Kimi-K2: 100), "
                             f"or null for no clipping")

        if not isinstance(self.qk_clip_passes, int) or isinstance(self.qk_clip_passes, bool) \
                or self.qk_clip_passes < 0:
            raise ValueError(f"optimizer.params.qk_clip_passes {self.qk_clip_passes!r} must be an integer >= 0")
        if self.qk_clip is None and self.qk_clip_passes:
            raise ValueError(f"optimizer.params.qk_clip_passes {self.qk_clip_passes} without qk_clip: set the "
                             f"threshold optimizer.params.qk_clip, or remove qk_clip_passes")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> MuonConfig:
        """The ``optimizer.params`` of a Muon block; a field Muon does not take is refused by name."""
        known = set(cls.__dataclass_fields__) | set(IGNORED_FIELDS)
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"optimizer.params: Muon does not take {unknown}; it takes "
                             f"{sorted(cls.__dataclass_fields__)} (runconfig/optimizer.py)")
        fields = {key: value for key, value in params.items() if key not in IGNORED_FIELDS}
        if "betas" in fields:
            fields["betas"] = tuple(fields["betas"])
        return cls(**fields)


def is_muon(deepspeed: dict[str, Any]) -> bool:
    """Whether the run's optimizer block asks for Muon (any capitalisation, as DeepSpeed reads its types)."""
    return str(deepspeed.get("optimizer", {}).get("type", "")).lower() == "muon"


def muon_config(deepspeed: dict[str, Any]) -> MuonConfig | None:
    """The Muon options of a run's DeepSpeed keys, checked; None when the optimizer is not Muon."""
    if not is_muon(deepspeed):
        return None
    block = deepspeed["optimizer"]
    unknown = sorted(set(block) - {"type", "params"})
    if unknown:
        raise ValueError(f"optimizer: unknown key(s) {unknown} beside \"type\" and \"params\"")
    return MuonConfig.from_params(block.get("params", {}))


def check_qk_clip(options: MuonConfig | None, model: Any, context_parallel_size: int) -> None:
    """MuonClip scales a head's logits through its query and key rows, from the maxima its attention reports:
    refused, naming the field, where that does not hold."""
    if options is None or options.qk_clip is None:
        return
    field = f"optimizer.params.qk_clip {options.qk_clip}"
    if model.qk_layernorm:
        raise ValueError(f"{field}: model.qk_layernorm normalises the queries and keys after their projections, so "
                         f"scaling the projections' rows cannot clip the logits; remove one of the two")
    if context_parallel_size > 1:
        raise ValueError(f"{field}: under context parallelism (Ulysses) each rank's attention holds other heads than "
                         f"its query and key rows; MuonClip is not built there (parallelism.context_parallel_size "
                         f"{context_parallel_size})")
