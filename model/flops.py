"""FLOPs of the model: per block and token, and per iteration (model FLOPs and hardware FLOPs), TFLOP/s per GPU.

Two counts of one iteration's FLOPs (B global batch in sequences, s sequence length, l layers, h hidden, V padded
vocabulary; GPT shape, Narayanan et al. 2021, eq. 3):
    model FLOPs, 3 forwards' worth (forward + backward), no recompute: what the model needs, PaLM's (Chowdhery et al.
        2022, appendix B) definition of MFU:       F_model = 72 B s l h^2 (1 + s / (6 h) + V / (12 l h))
    hardware FLOPs, what the GPUs compute: the model FLOPs plus the recomputed forwards of model.recompute, per block
        (its first recompute_num_layers blocks of each pipeline stage, or all):
        "full"      one more forward of the block: 24 h^2 + 4 s h per token (all blocks: 96 and V / (16 l h))
        "selective" the attention core's forward only, softmax(Q K^T) V: 4 s h per token
        "none"      nothing
The logits (2 h V per token forward) are never recomputed. The trainer (training/metrics.py) and the planner
(planner/) both count with these functions.

Multi-token prediction (model.mtp, D depths: model/mtp.py) adds, per token and forward, for each depth k = 1 .. D

    F_mtp,k = F_block(L + k) + 2 x 2h^2 + 2 h V      its block (layer number L + k: dense, or sparse with top_k of its
                                                     experts, model.moe.is_sparse), eh_proj (2h -> h) and its logits
                                                     through the shared head

so F_model = 3 B s (l F_layer + sum_k F_mtp,k) + 6 B s h V. Recompute reruns a depth's block as it would a trunk
block of that number (ModelConfig.recomputes_block(L + k)): its whole forward ("full") or its attention core
("selective"); eh_proj and the logits are never rerun. The norms and the embedding lookup are not counted.
"""

from __future__ import annotations

from model.config import ModelConfig


def layer_forward_flops_per_token(config: ModelConfig) -> float:
    """Forward FLOPs of one transformer block per token: 2 x its matmul weights, plus the attention core.

    Weights: the attention's (attention_weights), the MLP (2 matrices of h x ffn for GeLU, 3 for SwiGLU). The core,
    QK^T and the weighted sum of V, is 4 s a per token with a = heads x head_dim (h unless model.head_dim is set
    apart), for every query head (grouped-query attention repeats K and V; causality is not discounted, as in
    Narayanan et al.); under MLA 2 s heads (d_qk + d_v) (attention_core_flops_per_token). The per-head q/k norms
    (model.qk_layernorm) are elementwise, not counted. For the GPT shape this is 24 h^2 + 4 s h, so the total below
    is eq. 3 of Narayanan et al. 2021. With model.moe the MLP is the mean over the blocks of what a token meets
    (mean_mlp_active_weights), so that l x this is the model's; "full" recompute of some blocks only counts this mean
    block for each.
    """
    weights = attention_weights(config) + mean_mlp_active_weights(config)
    return 2.0 * weights + attention_core_flops_per_token(config)


def block_forward_flops_per_token(config: ModelConfig, layer_number: int) -> float:
    """Forward FLOPs per token of block ``layer_number`` itself (not the mean block): 2 x (the attention's weights +
    its MLP's active weights: dense, or sparse by model.moe.is_sparse) + the attention core. Numbers past L are
    model.mtp's blocks (L + k)."""
    return 2.0 * (attention_weights(config) + mlp_active_weights(config, layer_number)) \
        + attention_core_flops_per_token(config)


def mtp_forward_flops_per_token(config: ModelConfig, tensor_parallel_size: int = 1) -> float:
    """Forward FLOPs per token of model.mtp's D depths: sum_k F_block(L + k) + 4 h^2 (eh_proj) + 2 h V (its logits,
    V padded for ``tensor_parallel_size``); 0 without model.mtp (module docstring)."""
    if config.mtp is None:
        return 0.0
    h, vocabulary = config.hidden_size, config.padded_vocab_size(tensor_parallel_size)
    return sum(block_forward_flops_per_token(config, number) + 2.0 * 2 * h * h + 2.0 * h * vocabulary
               for number in mtp_block_numbers(config))


def mtp_block_numbers(config: ModelConfig) -> range:
    """The layer numbers of model.mtp's blocks, L + 1 .. L + D (empty without model.mtp)."""
    depth = 0 if config.mtp is None else config.mtp.depth
    return range(config.num_layers + 1, config.num_layers + depth + 1)


def attention_weights(config: ModelConfig) -> int:
    """The attention's matmul weights one token meets: QKV (h x (query + 2 key/value heads) x head_dim) and the output
    projection (heads x head_dim x h); under MLA (model/mla.py) the query path (h r_q + r_q nh d_qk, or h nh d_qk
    without q_lora_rank), the key/value path (h (r_kv + d_r) + r_kv nh (d_n + d_v)) and the output (nh d_v h).
    DeepSeek-V3: 7168 x 1536 + 1536 x 128 x 192 + 7168 x 576 + 512 x 128 x 256 + 128 x 128 x 7168 = 187,105,280
    (tests/test_deepseek_plan.py). Under TP the down-projections (h r_q, h (r_kv + d_r)) are replicated: every TP
    rank computes them whole, which the per-GPU time divides by t as the rest (planner/timing.py; 8% of the
    attention's weights at DeepSeek-V3's shape, none of it at TP 1)."""
    h, heads = config.hidden_size, config.num_attention_heads
    if config.attention_type != "mla":
        return h * config.qkv_size + config.attention_size * h
    q_width = heads * config.head_dim  # d_qk = d_n + d_r
    queries = h * q_width if config.q_lora_rank is None else config.q_lora_rank * (h + q_width)
    keys_values = h * (config.kv_lora_rank + config.qk_rope_head_dim)
    keys_values += config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
    return queries + keys_values + config.attention_size * h


def attention_core_flops_per_token(config: ModelConfig) -> float:
    """QK^T and the weighted sum of V per token, 2 s heads (d_qk + d_v): 4 s a with a = heads x head_dim where q, k and
    v are as wide (not under MLA, whose v is d_v wide: attention_size is heads x d_v there). DeepSeek-V3 at s 4096:
    2 x 4096 x 128 x (192 + 128)."""
    return 2.0 * config.seq_length * (config.num_attention_heads * config.head_dim + config.attention_size)


def mean_mlp_active_weights(config: ModelConfig) -> float:
    """The MLP matmul weights one token meets in a block, averaged over the blocks: the dense MLP's (2 or 3 h ffn); in
    a sparse block of a Mixture-of-Experts model (model.moe), the router (h E), top_k SwiGLU experts (3 h F each) and
    the shared expert (shared_expert_weights): the active FLOPs, as Megatron-LM counts MFU for MoE."""
    blocks = range(1, config.num_layers + 1)
    return sum(mlp_active_weights(config, number) for number in blocks) / config.num_layers


def mlp_active_weights(config: ModelConfig, layer_number: int) -> int:
    """The MLP matmul weights one token meets in block ``layer_number``: 2 or 3 h ffn dense; sparse (model.moe
    .is_sparse) h E + top_k x 3 h F + the shared expert."""
    h, moe = config.hidden_size, config.moe
    if moe is None or not moe.is_sparse(layer_number):
        return (3 if config.mlp == "swiglu" else 2) * h * config.ffn_hidden_size
    return h * moe.num_experts + moe.top_k * 3 * h * moe.moe_ffn_hidden_size + shared_expert_weights(config, 1)


def shared_expert_weights(config: ModelConfig, tensor_parallel_size: int) -> int:
    """A sparse block's shared expert on one TP rank: its SwiGLU 3 h F_s / t (column- and row-parallel) and, with
    model.moe.shared_expert_gate (Qwen2-MoE's), the gate's h, replicated; 0 without a shared expert (F_s = 0).
    DeepSeek-V3's has no gate: 3 x 7168 x 2048 = 44,040,192."""
    moe, h = config.moe, config.hidden_size
    if moe is None or not moe.shared_expert_ffn_hidden_size:
        return 0
    return 3 * h * moe.shared_expert_ffn_hidden_size // tensor_parallel_size + (h if moe.shared_expert_gate else 0)


RECOMPUTE_MODES = ("none", "selective", "full")


def recompute_flops_per_token(config: ModelConfig, recompute: str) -> float:
    """Forward FLOPs one block recomputes in its backward, per token: all of them ("full"), the attention core's 4 s a
    ("selective": QK^T and the weighted sum of V, the s-dependent term of layer_forward_flops_per_token), or none."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if recompute == "full":
        return layer_forward_flops_per_token(config)
    return attention_core_flops_per_token(config) if recompute == "selective" else 0.0


def recomputed_blocks(config: ModelConfig, pipeline_parallel_size: int | None, recompute: str | None = None) -> int:
    """Blocks of the whole model that recompute: model.recompute_num_layers of each of the pipeline stages (every
    block when it is None), or none with recompute "none"."""
    recompute = config.recompute if recompute is None else recompute
    if recompute == "none":
        return 0
    if config.recompute_num_layers is None:
        return config.num_layers
    if pipeline_parallel_size is None:
        raise ValueError("model.recompute_num_layers counts blocks per pipeline stage: pass pipeline_parallel_size")
    per_stage = config.num_layers // pipeline_parallel_size
    return min(config.recompute_num_layers, per_stage) * pipeline_parallel_size


def mtp_recompute_flops_per_token(config: ModelConfig, pipeline_parallel_size: int | None,
                                  recompute: str | None = None) -> float:
    """Forward FLOPs per token that model.mtp's blocks rerun in the backward: for each block L + k that recomputes
    (ModelConfig.recomputes_block, as the pipeline builds it), its whole forward ("full") or its core
    ("selective"); 0 without model.mtp or with "none"."""
    recompute = config.recompute if recompute is None else recompute
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if recompute == "none" or config.mtp is None:
        return 0.0
    if config.recompute_num_layers is None:
        numbers = list(mtp_block_numbers(config))
    elif pipeline_parallel_size is None:
        raise ValueError("model.recompute_num_layers counts blocks per pipeline stage: pass pipeline_parallel_size")
    else:
        numbers = [n for n in mtp_block_numbers(config) if config.recomputes_block(n, pipeline_parallel_size)]
    return sum(block_recompute_flops_per_token(config, n, recompute) for n in numbers)


def block_recompute_flops_per_token(config: ModelConfig, layer_number: int, recompute: str) -> float:
    """What block ``layer_number`` itself reruns per token: its forward ("full"), its core ("selective") or 0."""
    if recompute == "full":
        return block_forward_flops_per_token(config, layer_number)
    return attention_core_flops_per_token(config) if recompute == "selective" else 0.0


def _recompute_mode(config: ModelConfig, recompute: str | bool | None) -> str:
    """None: the config's mode; a string: that mode; the old booleans: True "full", False "none"."""
    if recompute is None:
        return config.recompute
    if isinstance(recompute, bool):
        return "full" if recompute else "none"
    return recompute


def flops_per_iteration(config: ModelConfig, global_batch: int, tensor_parallel_size: int,
                        recompute: str | bool | None = None, pipeline_parallel_size: int | None = None) -> float:
    """Hardware FLOPs of one optimizer step of ``global_batch`` sequences: the model FLOPs (3 forwards' worth) plus
    the forwards that ``recompute`` reruns (default: the config's mode; True / False mean "full" / "none"). With
    model.recompute_num_layers set, ``pipeline_parallel_size`` says how many blocks that is.

    GPT shape: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with every block fully recomputed, 72 B s l h^2 (1 + s/(6h) +
    V/(12 l h)) with none (model_flops_per_iteration).
    """
    mode = _recompute_mode(config, recompute)
    tokens = global_batch * config.seq_length
    recomputed = recomputed_blocks(config, pipeline_parallel_size, mode) * recompute_flops_per_token(config, mode)
    recomputed += mtp_recompute_flops_per_token(config, pipeline_parallel_size, mode)
    return model_flops_per_iteration(config, global_batch, tensor_parallel_size) + tokens * recomputed


def model_flops_per_iteration(config: ModelConfig, global_batch: int, tensor_parallel_size: int) -> float:
    """Model FLOPs of one optimizer step: forward + backward, 3 forwards' worth, no recompute (PaLM's MFU); with
    model.mtp its D depths too (mtp_forward_flops_per_token)."""
    tokens = global_batch * config.seq_length
    logits = 3.0 * 2.0 * config.hidden_size * config.padded_vocab_size(tensor_parallel_size)
    mtp = 3.0 * mtp_forward_flops_per_token(config, tensor_parallel_size)
    return tokens * (3.0 * config.num_layers * layer_forward_flops_per_token(config) + mtp + logits)


def tflops_per_gpu(flops: float, iteration_seconds: float, num_gpus: int) -> float:
    return flops / (iteration_seconds * num_gpus * 1e12)
