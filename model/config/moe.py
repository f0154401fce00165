"""model.moe: the experts of a Mixture-of-Experts model's sparse blocks, and the expert-parallel size's checks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from model.config.checks import is_positive_int, require

ROUTERS = ("softmax", "sigmoid_bias")  # model.moe.router


@dataclass(frozen=True)
class MoEConfig:
    """The experts of the sparse layers (``model.moe``); model/moe.py's docstring says what the block does with them."""

    num_experts: int
    """Routed experts E of each sparse layer. Must divide by parallelism.expert_parallel_size."""
    top_k: int
    """Experts each token is routed to (Mixtral 2, Qwen3-MoE 8); at most num_experts."""
    moe_ffn_hidden_size: int
    """Inner width F of each routed SwiGLU expert. Must divide by the tensor-parallel size."""
    router: str = "softmax"
    """"softmax" (Mixtral, Qwen: softmax scores select and weight) or "sigmoid_bias" (DeepSeek-V3's aux-loss-free
    router: sigmoid scores weight, scores plus a per-expert bias select, the bias moved by update_bias each step)."""
    norm_topk_prob: bool = True
    """Divide the k selected scores by their sum (Mixtral always; Qwen's norm_topk_prob)."""
    shared_expert_ffn_hidden_size: int = 0
    """Inner width of a dense SwiGLU expert every token passes through, its output scaled by sigmoid(x w_gate^T)
    (Qwen2-MoE); 0: none."""
    aux_loss_coeff: float = 1e-3
    """Weight of the Switch/GShard load-balancing loss E sum_e f_e P_e (f_e: fraction of the assignments routed to
    e, P_e: mean router probability of e). transformers' load_balancing_loss_func is k times this loss, so its
    router_aux_loss_coef c is aux_loss_coeff = c k here."""
    router_z_loss_coeff: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); 0: off."""
    capacity_factor: float | None = None
    """None: dropless (every assignment is computed). A positive number: each expert takes at most
    ceil(capacity_factor T k / E) of the T tokens of an EP rank, the rest are dropped (model/moe.py's docstring)."""
    sparse_every: int = 1
    """Layer n (1-based, model/gpt.py's layer_number) is sparse when n % sparse_every == 0 (transformers'
    decoder_sparse_step); 1: every layer."""
    first_dense_layers: int = 0
    """The first this many layers are dense whatever sparse_every says (DeepSeek's first_k_dense_replace; Qwen's
    mlp_only_layers = [0 .. k-1])."""
    bias_update_rate: float = 1e-3
    """"sigmoid_bias" only: each step moves every expert's bias by this much towards balance (DeepSeek-V3's gamma)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "moe_ffn_hidden_size", "sparse_every"):
            value = getattr(self, name)
            require(is_positive_int(value), f"model.moe.{name} must be a positive integer, got {value!r}")
        require(self.top_k <= self.num_experts,
                f"model.moe.top_k ({self.top_k}) is larger than model.moe.num_experts ({self.num_experts}): "
                f"route each token to at most num_experts experts")
        require(self.router in ROUTERS, f"model.moe.router must be one of {ROUTERS}, got {self.router!r}")
        require(isinstance(self.norm_topk_prob, bool),
                f"model.moe.norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        for name in ("shared_expert_ffn_hidden_size", "first_dense_layers"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                    f"model.moe.{name} must be a non-negative integer (0: none), got {value!r}")
        for name in ("aux_loss_coeff", "router_z_loss_coeff", "bias_update_rate"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and value >= 0,
                    f"model.moe.{name} must be a non-negative number (0: off), got {value!r}")
        if self.capacity_factor is not None:
            require(isinstance(self.capacity_factor, (int, float)) and self.capacity_factor > 0,
                    f"model.moe.capacity_factor must be a positive number, or null for dropless routing, got "
                    f"{self.capacity_factor!r}")

    @classmethod
    def from_dict(cls, values: Any) -> MoEConfig:
        """model.moe from its JSON object (a run config, or the run config saved in a checkpoint), or as given."""
        if isinstance(values, MoEConfig):
            return values
        require(isinstance(values, dict), f"model.moe must be an object of the experts' fields (num_experts, top_k, "
                                          f"moe_ffn_hidden_size, ...) or null, got {values!r}")
        fields = dataclasses.fields(cls)
        unknown = sorted(set(values) - {f.name for f in fields})
        require(not unknown, f"unknown key(s) {unknown} in block \"model.moe\": known keys are "
                             f"{sorted(f.name for f in fields)}")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in values]
        require(not missing, f"model.moe lacks {missing}: give num_experts, top_k and moe_ffn_hidden_size")
        return cls(**values)

    def is_sparse(self, layer_number: int) -> bool:
        """Whether block ``layer_number`` (1-based) has experts instead of the dense MLP."""
        return layer_number > self.first_dense_layers and layer_number % self.sparse_every == 0

    def capacity(self, tokens: int) -> int | None:
        """Assignments each expert takes from ``tokens`` tokens of one EP rank; None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)


def check_expert_parallel(moe: MoEConfig | None, expert_parallel_size: int,
                          data_parallel_size: int | None = None) -> None:
    """The expert-parallel size against the experts and the data-parallel size, before any process group exists.
    ``data_parallel_size`` None (the world not known yet: ModelConfig.check_parallel): the experts only."""
    ep = expert_parallel_size
    require(is_positive_int(ep), f"parallelism.expert_parallel_size must be a positive integer, got {ep!r}")
    if moe is None:
        require(ep == 1, f"parallelism.expert_parallel_size is {ep} but model.moe is not set: expert parallelism "
                         f"splits the experts of a Mixture-of-Experts model; set it to 1, or give the experts in "
                         f"model.moe")
        return
    require(moe.num_experts % ep == 0,
            f"parallelism.expert_parallel_size ({ep}) does not divide model.moe.num_experts ({moe.num_experts}): "
            f"choose one of {[d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0]}")
    if data_parallel_size is None:
        return
    require(data_parallel_size % ep == 0,
            f"parallelism.expert_parallel_size ({ep}) does not divide the data-parallel size ({data_parallel_size}, "
            f"world / (TP x PP)): the EP groups are made of data-parallel ranks; choose one of "
            f"{[d for d in range(1, data_parallel_size + 1) if data_parallel_size % d == 0]}, or launch a world "
            f"whose data-parallel size it divides")
