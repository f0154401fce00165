"""model.moe: the experts of a Mixture-of-Experts model's sparse blocks, and the expert-parallel size's checks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from model.config.checks import is_positive_int, require, require_block

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
    """Divide the k selected scores by their sum (Mixtral always; Qwen's and DeepSeek-V3's norm_topk_prob)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the k gate weights, after norm_topk_prob's normalisation (DeepSeek-V3's routed_scaling_factor,
    2.5 in V3)."""
    n_group: int = 1
    """"sigmoid_bias" only: the experts fall into n_group groups of E / n_group consecutive ones, and each token
    chooses its top_k among the topk_group groups of highest score, a group's score the sum of its two best
    bias-corrected scores (DeepSeek-V3's n_group, 8 in V3; model/router.py group_limited_top_k). 1: no groups."""
    topk_group: int = 1
    """The groups each token keeps (DeepSeek-V3's topk_group, 4 in V3); at most n_group, and n_group keeps every
    group: plain top-k."""
    shared_expert_ffn_hidden_size: int = 0
    """Inner width of a dense SwiGLU expert every token passes through (Qwen2-MoE's
    shared_expert_intermediate_size; DeepSeek-V3's moe_intermediate_size x n_shared_experts, its shared experts being
    one SwiGLU of that width); 0: none."""
    shared_expert_gate: bool = True
    """Scale the shared expert's output by sigmoid(x w_gate^T) (Qwen2-MoE's shared_expert_gate); false: add it as it
    is (DeepSeek-V3's shared_experts)."""
    aux_loss_coeff: float = 1e-3
    """Weight of the Switch/GShard load-balancing loss E sum_e f_e P_e (f_e: fraction of the assignments routed to
    e, P_e: mean router probability of e). transformers' load_balancing_loss_func is k times this loss, so its
    router_aux_loss_coef c is aux_loss_coeff = c k here."""
    router_z_loss_coeff: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); 0: off."""
    sequence_aux_loss_coeff: float = 0.0
    """Weight alpha of DeepSeek-V3's sequence-wise balance loss (its paper's eqs. 17-20; no transformers config key,
    the paper's 1e-4): per sequence of s tokens, alpha sum_e f_e P_e, f_e = E / (k s) x its tokens routed to e, P_e
    the mean over them of e's score divided by the sum of the token's E scores; the mean over the micro-batch's
    sequences (a row of the batch, packed documents and all). 0: off. Refused where a rank holds part of a sequence
    (context parallelism, the sequence-split dispatch: model/config/parallel.py)."""
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
        for name in ("num_experts", "top_k", "moe_ffn_hidden_size", "sparse_every", "n_group", "topk_group"):
            value = getattr(self, name)
            require(is_positive_int(value), f"model.moe.{name} must be a positive integer, got {value!r}")
        require(self.top_k <= self.num_experts,
                f"model.moe.top_k ({self.top_k}) is larger than model.moe.num_experts ({self.num_experts}): "
                f"route each token to at most num_experts experts")
        require(self.router in ROUTERS, f"model.moe.router must be one of {ROUTERS}, got {self.router!r}")
        for name in ("norm_topk_prob", "shared_expert_gate"):
            require(isinstance(getattr(self, name), bool),
                    f"model.moe.{name} must be true or false, got {getattr(self, name)!r}")
        require(isinstance(self.routed_scaling_factor, (int, float)) and not isinstance(self.routed_scaling_factor,
                                                                                        bool)
                and self.routed_scaling_factor > 0,
                f"model.moe.routed_scaling_factor must be a positive number (1: unscaled), got "
                f"{self.routed_scaling_factor!r}")
        self._check_groups()
        for name in ("shared_expert_ffn_hidden_size", "first_dense_layers"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                    f"model.moe.{name} must be a non-negative integer (0: none), got {value!r}")
        for name in ("aux_loss_coeff", "router_z_loss_coeff", "sequence_aux_loss_coeff", "bias_update_rate"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and value >= 0,
                    f"model.moe.{name} must be a non-negative number (0: off), got {value!r}")
        if self.capacity_factor is not None:
            require(isinstance(self.capacity_factor, (int, float)) and self.capacity_factor > 0,
                    f"model.moe.capacity_factor must be a positive number, or null for dropless routing, got "
                    f"{self.capacity_factor!r}")

    def _check_groups(self) -> None:
        """DeepSeek-V3's group-limited routing: whole groups, a top 2 in each, enough experts in the kept groups."""
        groups, kept = self.n_group, self.topk_group
        if groups == 1 and kept == 1:
            return
        require(self.router == "sigmoid_bias",
                f"model.moe.n_group ({groups}) groups the experts as DeepSeek-V3 does, by the sum of each group's "
                f"two best bias-corrected sigmoid scores: it needs model.moe.router \"sigmoid_bias\", got "
                f"{self.router!r}; set the router, or n_group and topk_group to 1")
        require(self.num_experts % groups == 0,
                f"model.moe.num_experts ({self.num_experts}) is not divisible by model.moe.n_group ({groups}): "
                f"choose n_group among {[d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]}")
        per_group = self.num_experts // groups
        require(groups == 1 or per_group >= 2,
                f"model.moe.n_group ({groups}) leaves {per_group} expert per group, and a group's score is the sum "
                f"of its two best: use at most {self.num_experts // 2} groups")
        require(kept <= groups, f"model.moe.topk_group ({kept}) is more than model.moe.n_group ({groups}): keep at "
                                f"most n_group groups (n_group: no limit)")
        require(self.top_k <= kept * per_group,
                f"model.moe.top_k ({self.top_k}) is more than the {kept * per_group} experts of the "
                f"model.moe.topk_group ({kept}) groups kept ({per_group} experts each): raise topk_group to at least "
                f"{math.ceil(self.top_k / per_group)}, or lower top_k")

    @classmethod
    def from_dict(cls, values: Any) -> MoEConfig:
        """model.moe from its JSON object (a run config, or the run config saved in a checkpoint), or as given."""
        if isinstance(values, MoEConfig):
            return values
        fields = dataclasses.fields(cls)
        require_block(values, "model.moe", [f.name for f in fields],
                      "the experts' fields (num_experts, top_k, moe_ffn_hidden_size, ...)")
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
