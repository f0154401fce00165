"""``training.dpo``: direct preference optimisation (training/dpo.py computes it), as a typed block read without
torch.

    field            TRL 1.16 DPOConfig                      what it does
    beta             beta                                    the KL strength; rewards are beta x (logp - ref logp)
    loss_type        loss_type ["sigmoid"] / ["ipo"]         sigmoid: -log sigma(beta delta); ipo: (delta_avg -
                                                             1/(2 beta))^2 on the length-averaged log-ratios
    rpo_alpha        loss_type [.., "sft"], loss_weights     adds alpha x the NLL of the chosen completions (mean
                     [1, alpha] (rpo_alpha before 0.20)      over the global batch's chosen tokens)
    label_smoothing  the sigmoid's label_smoothing before     cDPO: -(1 - eps) log sigma(beta delta)
                     0.20 (now "robust" / "exo" only)         - eps log sigma(-beta delta), sigmoid only
    reference        precompute_ref_log_probs True / False   "file": each sequence's reference log-prob read from
                                                             {data prefix}_reference_logps.npy (tools/
                                                             reference_logps.py); "model": a frozen reference on the
                                                             same ranks, run forward in each step

What the pipeline needs besides (training/dpo.py): pairs as rows 2i (chosen) and 2i + 1 (rejected) of every
micro-batch, so an even micro-batch, and each row's summed reference log-prob in the last stage's batch.
"""

from __future__ import annotations

from dataclasses import dataclass

DPO_LOSS_TYPES = ("sigmoid", "ipo")
DPO_REFERENCES = ("file", "model")


@dataclass(frozen=True)
class DPOConfig:
    beta: float = 0.1
    """The reward scale and KL strength (TRL's default 0.1); for ipo, tau of the IPO paper (the target margin of the
    length-averaged log-ratios is 1 / (2 beta))."""
    loss_type: str = "sigmoid"
    """"sigmoid" (DPO, Rafailov et al. 2023) or "ipo" (Azar et al. 2023, on TRL's per-token averaged log-ratios)."""
    rpo_alpha: float | None = None
    """The weight of an SFT term on the chosen completions (RPO, Pang et al. 2024): the NLL of their tokens, mean
    over the global batch's chosen tokens, as TRL's "sft" loss over one batch. None: no SFT term."""
    label_smoothing: float = 0.0
    """cDPO (Mitchell 2023): the probability that a pair's preference is flipped, in [0, 0.5); sigmoid only."""
    reference: str = "file"
    """Where the reference log-probs come from: "file", precomputed once by tools/reference_logps.py from the
    checkpoint the run starts from (training.init_from) and checked against it and the data at start-up; "model",
    that checkpoint frozen on the same ranks, run forward over each step's micro-batches (training/preference_data.py
    ReferenceModel: one more forward per micro-batch and one more copy of the weights, TRL's default)."""

    def __post_init__(self) -> None:
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"training.dpo.loss_type must be one of {DPO_LOSS_TYPES}, got {self.loss_type!r}")
        if not self.beta > 0:
            raise ValueError(f"training.dpo.beta must be positive (TRL's default is 0.1), got {self.beta}")
        if self.rpo_alpha is not None and self.rpo_alpha < 0:
            raise ValueError(f"training.dpo.rpo_alpha must be >= 0 (or null: no SFT term), got {self.rpo_alpha}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"training.dpo.label_smoothing must be in [0, 0.5) (a flip probability), got "
                             f"{self.label_smoothing}")
        if self.reference not in DPO_REFERENCES:
            raise ValueError(f"training.dpo.reference must be one of {DPO_REFERENCES}, got {self.reference!r}")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"training.dpo.label_smoothing (cDPO) smooths the sigmoid loss only: set loss_type "
                             f"\"sigmoid\" or label_smoothing 0 (loss_type is {self.loss_type!r})")
