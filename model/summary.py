"""Exact parameter counts of any rank of any model, built on the meta device (no memory), beside the formula.

    python -m model.summary --preset 530b --tp 8 --pp 35

Each stage is built from the same LayerSpec list and the same partitioning as the DeepSpeed PipelineModule of a
real run, with the tensor shapes of one tensor-parallel rank, on ``torch.device("meta")``. A Mixture-of-Experts
model (model.moe) is built the same way with every expert on the rank (expert-parallel size 1: planner/experts.py
splits the experts over EP from the config), and counted total and active (what one token uses):

    python -m model.summary --preset mixtral-8x7b --tp 8 --pp 4

Multi-token prediction (model.mtp, model/mtp.py) adds one layer on the last stage, MultiTokenPrediction, of D depths:

    depth k = 1 .. D    eh_proj 2h x h (no bias, replicated over TP) + enorm, hnorm, final_norm (3 norms, replicated)
                        + block L + k (dense, or sparse with its experts: model.moe.is_sparse(L + k))

plus, untied, the last stage's copy of the word embedding (tied to the first stage's: counted once). The total and
active counts are transformers' (DeepseekV3ForCausalLM ignores the MTP layer): without it; the MTP module's count is
printed beside them, and the official DeepSeek-V3 checkpoint's size, whose layer 61 (the MTP layer) also stores its
own copies of the embedding and of the head (``official_checkpoint_parameters``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass

import torch

from common import deepspeed_internals as ds_internals
from model.config import PRESETS, ModelConfig, preset, stages_per_rank
from model.config.checks import require
from model.flops import attention_weights, shared_expert_weights
from model.parallel import ParallelContext


@dataclass(frozen=True)
class StageCount:
    stage: int
    layers: list[str]
    """Class names of the stage's layers, in order."""
    parameters_per_tp_rank: int
    """Counted from the modules built on the meta device (one TP rank; every TP rank holds the same number)."""
    analytic_per_tp_rank: int
    """The same from the closed-form count."""
    parameters_per_stage: int
    """All TP ranks of the stage together, replicated parameters (LayerNorms, row-parallel biases, positions) once."""
    blocks: tuple[int, ...] = ()
    """The numbers of its transformer blocks: 1 .. L, and on the last stage model.mtp's L + 1 .. L + D (each built
    as block L + k: its recompute mode, dense or sparse), which the planner's activations, recompute and
    communication counts read."""
    phases: tuple[StageCount, ...] = ()
    """Under DualPipeV (a count per pipeline rank): the rank's two stages, r (phase 0, on the way out) and 2 PP - 1 - r
    (phase 1, on the way back); empty under 1F1B, where the rank is its stage."""


def stage_boundaries(config: ModelConfig, pipeline_parallel_size: int) -> list[int]:
    """What the pipeline cuts under the 'type:TransformerLayer' method: DeepSpeed's partition_balanced over the
    blocks (model/gpt.py partition_weights; model.mtp's layer weighing D blocks, then pinned with everything after
    the last block to the last stage: mtp_partition)."""
    from model.gpt import mtp_partition, partition_weights

    parts = ds_internals.partition_balanced(partition_weights(config), pipeline_parallel_size)
    return mtp_partition(config, parts, "type:TransformerLayer") if config.mtp is not None else parts


def dense_block_parameters(config: ModelConfig, tensor_parallel_size: int) -> int:
    """One dense transformer block on one TP rank: h hidden, f ffn, q query and g key/value heads of d, R = TP.

    norms 2 x (2h LayerNorm | h RMSNorm); QKV h (q + 2g) d / R (+ (q + 2g) d / R bias unless bias "none");
    attention output h q d / R (+ h bias with "all"); MLP gelu (h f + f h) / R (+ f / R + h), swiglu (2 h f + f h) / R
    (+ 2 f / R + h), biases with "all" only; qk_layernorm: 2 x (2d LayerNorm | d RMSNorm), replicated.
    GPT-2 (q = g, q d = h, bias "all", gelu): 4h + (12 h^2 + 7h) / R + 2h.
    """
    h, f, tp = config.hidden_size, config.ffn_hidden_size, tensor_parallel_size
    inner = 2 * f if config.mlp == "swiglu" else f  # the column-parallel MLP matrix's rows
    bias = config.other_linears_have_bias
    mlp = (h * inner + (inner if bias else 0)) // tp + f * h // tp + (h if bias else 0)
    return attention_and_norm_parameters(config, tp) + mlp


def attention_and_norm_parameters(config: ModelConfig, tensor_parallel_size: int) -> int:
    """What every block has, dense or sparse: its two norms, the attention and its qk norms (dense_block_parameters)."""
    h, tp, d = config.hidden_size, tensor_parallel_size, config.head_dim
    norms = 2 * _norm_parameters(config)
    if config.attention_type == "mla":
        return norms + _latent_attention_parameters(config, tp)
    if config.qk_layernorm:
        norms += 2 * (2 * d if config.norm == "layernorm" else d)
    qkv = (h * config.qkv_size + (config.qkv_size if config.qkv_has_bias else 0)) // tp
    attention_out = h * config.num_attention_heads * d // tp + (h if config.other_linears_have_bias else 0)
    return norms + qkv + attention_out


def _latent_attention_parameters(config: ModelConfig, tensor_parallel_size: int) -> int:
    """MLA's tensors (model/mla.py) on one TP rank, nh heads, d_qk = d_n + d_r: replicated q_a_proj h r_q, its norm r_q,
    kv_a_proj_with_mqa h (r_kv + d_r), its norm r_kv (+ the two projections' biases with bias "all"); split over TP
    q_b_proj r_q nh d_qk (or q_proj h nh d_qk), kv_b_proj r_kv nh (d_n + d_v), the output nh d_v h (+ h bias)."""
    h, tp, heads = config.hidden_size, tensor_parallel_size, config.num_attention_heads
    bias, q_lora, kv_lora = config.other_linears_have_bias, config.q_lora_rank, config.kv_lora_rank
    q_width = heads * config.head_dim
    if q_lora is None:
        queries = h * q_width // tp
    else:
        queries = h * q_lora + (q_lora if bias else 0) + q_lora + q_lora * q_width // tp
    kv_down = kv_lora + config.qk_rope_head_dim
    keys_values = h * kv_down + (kv_down if bias else 0) + kv_lora
    keys_values += kv_lora * heads * (config.qk_nope_head_dim + config.v_head_dim) // tp
    return queries + keys_values + config.attention_size * h // tp + (h if bias else 0)


def sparse_block_parameters(config: ModelConfig, tensor_parallel_size: int, routed_experts: int) -> int:
    """One sparse block on one TP rank holding ``routed_experts`` of its E routed experts (E: the block; top_k: what
    one token uses; E / EP: an expert-parallel rank's), F = moe_ffn_hidden_size, t = TP (model/moe.py's tensors, no
    biases):

        attention and norms (/ t) + router E h + routed x 3 h F / t + shared expert (3 h F_s / t + its gate h when
        shared_expert_gate: model/flops.py shared_expert_weights)

    the router and the gate replicated over TP. Mixtral-8x7B (h 4096, 8 KV heads of 128, F 14336, E 8, t 1):
    41,951,232 + 32,768 + 8 x 176,160,768; DeepSeek-V3's sparse blocks (MLA 187,121,664 with its 2 norms, E 256,
    F 2048, a shared expert of 2048 without gate): 187,121,664 + 1,835,008 + 256 x 44,040,192 + 44,040,192.
    """
    h, moe, t = config.hidden_size, config.moe, tensor_parallel_size
    routed = routed_experts * 3 * h * moe.moe_ffn_hidden_size // t
    return attention_and_norm_parameters(config, t) + moe.num_experts * h + routed + shared_expert_weights(config, t)


def _norm_parameters(config: ModelConfig) -> int:
    return 2 * config.hidden_size if config.norm == "layernorm" else config.hidden_size


def mtp_parameters(config: ModelConfig, tensor_parallel_size: int = 1, routed_experts: int | None = None) -> int:
    """model.mtp's MultiTokenPrediction layer on one TP rank (module docstring): sum over k = 1 .. D of 2 h^2
    (eh_proj) + 3 norms + block L + k, dense or sparse holding ``routed_experts`` of its experts (default: all);
    0 without model.mtp. DeepSeek-V3 (D 1, block 62 sparse): 102,760,448 + 3 x 7,168 + 11,507,286,016."""
    from model.flops import mtp_block_numbers

    h, tp, moe = config.hidden_size, tensor_parallel_size, config.moe

    def block(number: int) -> int:
        if moe is not None and moe.is_sparse(number):
            return sparse_block_parameters(config, tp, moe.num_experts if routed_experts is None else routed_experts)
        return dense_block_parameters(config, tp)

    return sum(2 * h * h + 3 * _norm_parameters(config) + block(n) for n in mtp_block_numbers(config))


def official_checkpoint_parameters(config: ModelConfig) -> int:
    """The parameters of a Hugging Face checkpoint that stores model.mtp as DeepSeek-V3's does: transformers' count
    (tokenizer_vocabulary_total) + each MTP layer (model.layers.{L + k - 1}: the MTP module, and its own copies of
    the embedding, embed_tokens, and of the head, shared_head.head, V h each). DeepSeek-V3: 671,026,404,352 +
    11,610,067,968 + 2 x 926,679,040 = 684,489,830,400 (published: 685B, "671B of the main model and 14B of the MTP
    module"; the difference is the fp8 release's block scales: fp8_checkpoint_extras)."""
    unpadded = dataclasses.replace(config, make_vocab_size_divisible_by=1)
    depth = 0 if config.mtp is None else config.mtp.depth
    copies = depth * 2 * config.vocab_size * config.hidden_size
    return tokenizer_vocabulary_total(config) + mtp_parameters(unpadded) + copies


def fp8_checkpoint_extras(config: ModelConfig, block: int = 128) -> int:
    """What DeepSeek-V3's fp8 release stores beside the weights and which its published parameter count includes:
    one fp32 weight_scale_inv per block x block tile of each fp8 matrix (the blocks' attention and MLP matrices,
    every expert's; not the embedding, head, norms, routers or eh_proj, which are bf16), and each sparse block's
    router score bias (E fp32, a buffer here), the MTP layer's block included. An MLA model's (DeepSeek-V3's
    layout); DeepSeek-V3: 41,540,496 + 15,104. Counted from that layout as remembered, not read from the release."""
    from model.flops import mtp_block_numbers

    h, moe = config.hidden_size, config.moe

    def tiles(rows: int, columns: int) -> int:
        return math.ceil(rows / block) * math.ceil(columns / block)

    heads, q_width = config.num_attention_heads, config.num_attention_heads * config.head_dim
    attention = tiles(config.q_lora_rank, h) + tiles(q_width, config.q_lora_rank) if config.q_lora_rank \
        else tiles(q_width, h)
    attention += tiles(config.kv_lora_rank + config.qk_rope_head_dim, h) + tiles(h, config.attention_size)
    attention += tiles(heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank)

    def swiglu(ffn: int) -> int:
        return 2 * tiles(ffn, h) + tiles(h, ffn)

    total = 0
    for number in [*range(1, config.num_layers + 1), *mtp_block_numbers(config)]:
        total += attention
        if moe is not None and moe.is_sparse(number):
            total += moe.num_experts * swiglu(moe.moe_ffn_hidden_size) + moe.num_experts  # the scales, the bias
            total += swiglu(moe.shared_expert_ffn_hidden_size) if moe.shared_expert_ffn_hidden_size else 0
        else:
            total += swiglu(config.ffn_hidden_size)
    return total


def analytic_layer_parameters(config: ModelConfig, name: str, tensor_parallel_size: int,
                              blocks: tuple[int, ...] = ()) -> int:
    """Parameters of one layer on one TP rank, from the formula (h hidden, V padded vocab, P positions); a
    TransformerLayer's ``blocks`` (its block number) says whether it is sparse (model.moe.is_sparse), every expert
    on the rank."""
    h, tp = config.hidden_size, tensor_parallel_size
    if name in ("WordEmbedding", "OutputHead"):
        return config.padded_vocab_size(tp) // tp * h
    if name == "PositionEmbedding":
        return config.max_position_embeddings * h
    if name == "EmbeddingDropout":
        return 0
    if name in ("FinalLayerNorm", "FinalRMSNorm"):
        return _norm_parameters(config)
    if name == "TransformerLayer":
        moe = config.moe
        if moe is not None and any(moe.is_sparse(number) for number in blocks):
            return sparse_block_parameters(config, tp, moe.num_experts)
        return dense_block_parameters(config, tp)
    if name == "MultiTokenPrediction":
        return mtp_parameters(config, tp)
    raise ValueError(f"no formula for layer {name}")


def analytic_total_parameters(config: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """The whole model, a tied embedding counted once: V h (x 2 untied) + P h (learned positions) + the L blocks
    (dense, or sparse with all their experts: model.moe) + norm, from the config alone; transformers' count, without
    model.mtp's module (mtp_parameters; analytic_built_parameters adds it).

    GPT-2: V h + P h + L (4h^2 + 2hf + f + 9h) + 2h. V is the padded vocabulary: for the tokenizer's own count (the
    one Hugging Face reports), pass a config with make_vocab_size_divisible_by=1 and TP 1."""
    return _model_parameters(config, tensor_parallel_size, active=False)


def analytic_active_parameters(config: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """What one token uses: the total with only top_k of each sparse block's routed experts (its router and shared
    expert included), every dense parameter and both embeddings when untied; the total for a dense model.
    Mixtral-8x7B: 12,879,925,248 of 46,702,792,704."""
    return _model_parameters(config, tensor_parallel_size, active=True)


def analytic_built_parameters(config: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """What the pipeline builds, one replica: analytic_total_parameters + model.mtp's module (its word embedding
    copy tied: counted once)."""
    return analytic_total_parameters(config, tensor_parallel_size) + mtp_parameters(config, tensor_parallel_size)


def _model_parameters(config: ModelConfig, tensor_parallel_size: int, active: bool) -> int:
    h = config.hidden_size
    embeddings = config.padded_vocab_size(tensor_parallel_size) * h * (1 if config.tie_word_embeddings else 2)
    positions = config.max_position_embeddings * h if config.position_embedding == "learned" else 0
    dense_block = dense_block_parameters(config, 1)
    if config.moe is None:
        blocks = config.num_layers * dense_block
    else:
        sparse_block = sparse_block_parameters(config, 1, config.moe.top_k if active else config.moe.num_experts)
        blocks = sum(sparse_block if config.moe.is_sparse(n) else dense_block for n in range(1, config.num_layers + 1))
    return embeddings + positions + blocks + _norm_parameters(config)


def check_split(config: ModelConfig, tensor_parallel_size: int, pipeline_parallel_size: int, *,
                sequence_parallel: bool = False, stages_per_rank: int = 1, expert_parallel_size: int = 1,
                context_parallel_size: int = 1, uneven_stages: bool = False) -> None:
    """ModelConfig.check_parallel, or with ``uneven_stages`` a pipeline-parallel size that does not divide the
    layers as well, split as DeepSpeed's partition_balanced splits it (stages of ceil(L / PP) and floor(L / PP)
    blocks: 61 over 16 gives 13 of 4 and 3 of 3), which the trainer refuses (model/config/parallel.py) and the
    planner can still plan (tools/plan.py --uneven-stages). Such a split needs at least one block per stage, 1F1B
    (DualPipeV pairs equal stages) and recompute_num_layers null (it counts the blocks of equal stages); every other
    check is the even split's, run on the model with its layers rounded up to a multiple of PP."""
    layers, pp = config.num_layers, pipeline_parallel_size
    if uneven_stages and isinstance(pp, int) and pp > 0 and layers % pp:
        require(pp <= layers, f"parallelism.pipeline_parallel_size ({pp}) is more than model.num_layers ({layers}): "
                              f"a stage needs at least one block")
        require(stages_per_rank == 1, f"model.num_layers ({layers}) does not divide over parallelism."
                                      f"pipeline_parallel_size ({pp}), and DualPipeV pairs equal stages: use \"1f1b\"")
        require(config.recompute_num_layers is None,
                f"model.recompute_num_layers ({config.recompute_num_layers}) counts the blocks of equal stages, and "
                f"model.num_layers ({layers}) does not divide over parallelism.pipeline_parallel_size ({pp}): set it "
                f"to null")
        config = whole_stages(config, pp)
    config.check_parallel(tensor_parallel_size, pp, sequence_parallel, stages_per_rank, expert_parallel_size,
                          context_parallel_size)


def whole_stages(config: ModelConfig, pipeline_parallel_size: int) -> ModelConfig:
    """The model with its layers rounded up to a multiple of PP: what check_split checks an uneven split's other
    constraints on."""
    layers = pipeline_parallel_size * math.ceil(config.num_layers / pipeline_parallel_size)
    return dataclasses.replace(config, num_layers=layers)


def count_stages(config: ModelConfig, tensor_parallel_size: int, pipeline_parallel_size: int,
                 tensor_parallel_rank: int = 0, pipeline_schedule: str = "1f1b",
                 uneven_stages: bool = False) -> list[StageCount]:
    """Build every stage of one TP rank on the meta device and count its parameters: one count per pipeline rank.
    Under "dualpipev" the layers are cut into 2 PP stages (DualPipeVModule) and each rank's count holds its two
    stages in ``phases``, the word embedding built once on rank 0, which holds both of its ends. ``uneven_stages``:
    a PP that does not divide the layers is split as DeepSpeed would (check_split). A sparse block holds every expert
    (expert-parallel size 1; planner/experts.py counts an EP rank's share)."""
    from model.gpt import gpt_layer_specs

    per_rank = stages_per_rank(pipeline_schedule)
    check_split(config, tensor_parallel_size, pipeline_parallel_size, stages_per_rank=per_rank,
                uneven_stages=uneven_stages)
    stages = pipeline_parallel_size * per_rank
    bounds = stage_boundaries(config, stages)
    ctx = ParallelContext(tensor_parallel_size=tensor_parallel_size, tensor_parallel_rank=tensor_parallel_rank,
                          pipeline_parallel_size=pipeline_parallel_size)
    specs = gpt_layer_specs(config, ctx, seed=0)
    block_numbers = layer_block_numbers(config, [spec.typename.__name__ for spec in specs])
    with torch.device("meta"):
        built = [(i, getattr(spec, "key", None), spec.build()) for i, spec in enumerate(specs)]

    def count(stage: int, stage_ids: list[int], phases: tuple = ()) -> StageCount:
        layers = [layer for s in stage_ids for layer in built[bounds[s]:bounds[s + 1]]]
        seen, kept = set(), []
        for i, key, module in layers:  # a rank holding both ends of a tied layer builds it once, as DeepSpeed does
            if key is None or key not in seen:
                kept.append((i, module))
            seen.add(key)
        modules = [module for _, module in kept]
        assert all(p.is_meta for m in modules for p in m.parameters())
        names = [type(m).__name__ for m in modules]
        parameters = [p for m in modules for p in m.parameters()]
        return StageCount(
            stage=stage, layers=names,
            parameters_per_tp_rank=sum(p.numel() for p in parameters),
            analytic_per_tp_rank=sum(analytic_layer_parameters(config, type(module).__name__, tensor_parallel_size,
                                                               block_numbers[i]) for i, module in kept),
            parameters_per_stage=sum(p.numel() * (tensor_parallel_size if getattr(p, "tensor_model_parallel", False)
                                                  else 1) for p in parameters),
            blocks=tuple(n for i, _, _ in layers for n in block_numbers[i]), phases=phases)

    if per_rank == 1:
        return [count(stage, [stage]) for stage in range(stages)]
    return [count(rank, [rank, stages - 1 - rank], (count(rank, [rank]), count(stages - 1 - rank, [stages - 1 - rank])))
            for rank in range(pipeline_parallel_size)]


def layer_block_numbers(config: ModelConfig, names: list[str]) -> list[tuple[int, ...]]:
    """The block numbers each layer of gpt_layer_specs (by class name) holds: (n,) for block n, L + 1 .. L + D for
    model.mtp's MultiTokenPrediction, () for the others."""
    from model.flops import mtp_block_numbers

    numbers, block = [], 0
    for name in names:
        block += name == "TransformerLayer"
        numbers.append((block,) if name == "TransformerLayer" else
                       tuple(mtp_block_numbers(config)) if name == "MultiTokenPrediction" else ())
    return numbers


def total_from_stages(counts: list[StageCount], config: ModelConfig, tensor_parallel_size: int) -> int:
    """The model's parameters from the stages' modules: the word embedding held by the first and the last stage
    (tied to the head, or model.mtp's copy for its depths) counted once."""
    total = sum(c.parameters_per_stage for c in counts)
    if sum("WordEmbedding" in c.layers for c in counts) > 1:
        total -= config.padded_vocab_size(tensor_parallel_size) * config.hidden_size
    return total


def tokenizer_vocabulary_total(config: ModelConfig) -> int:
    """The model's parameters with the tokenizer's vocabulary, unpadded: what transformers reports for the same model
    (Llama-3-8B: 8,030,261,248, where the padded embedding and head of TP 8 hold 8,032,358,400)."""
    return analytic_total_parameters(dataclasses.replace(config, make_vocab_size_divisible_by=1), 1)


def tokenizer_vocabulary_active(config: ModelConfig) -> int:
    """analytic_active_parameters with the tokenizer's vocabulary, unpadded (tokenizer_vocabulary_total)."""
    return analytic_active_parameters(dataclasses.replace(config, make_vocab_size_divisible_by=1), 1)


def block_matrices_line(config: ModelConfig) -> str:
    """The blocks' matrix weights in closed form: 12 l h^2 for the GPT shape (multi-head, GeLU MLP of 4h), else the
    Llama form l (2 h^2 + 2 h g d + 3 h f) (query and output h^2 each, key and value h g d each, SwiGLU 3 h f); MLA's
    attention as model/flops.py attention_weights counts it."""
    h, layers, f = config.hidden_size, config.num_layers, config.ffn_hidden_size
    if config.attention_type == "mla":
        mlp = (3 if config.mlp == "swiglu" else 2) * h * f
        return (f"transformer blocks' matrices l (MLA's latent projections + {'3' if config.mlp == 'swiglu' else '2'}"
                f" h f) = {layers * (attention_weights(config) + mlp):,}")
    gpt_shape = config.mlp == "gelu" and f == 4 * h and config.num_key_value_heads == config.num_attention_heads
    if gpt_shape and config.attention_size == h:
        return f"transformer blocks' matrices 12 l h^2 = {12 * layers * h * h:,}"
    kv = config.num_key_value_heads * config.head_dim
    mlp = (3 if config.mlp == "swiglu" else 2) * h * f
    mlp_form = "3 h f" if config.mlp == "swiglu" else "2 h f"
    if config.attention_size == h:
        return f"transformer blocks' matrices l (2 h^2 + 2 h g d + {mlp_form}) = {layers * (2 * h * h + 2 * h * kv + mlp):,}"
    attention = config.attention_size  # a free head_dim: query and output h x (heads x d) each
    return (f"transformer blocks' matrices l (2 h a d + 2 h g d + {mlp_form}), a = {config.num_attention_heads} heads "
            f"= {layers * (2 * h * attention + 2 * h * kv + mlp):,}")


def format_summary(config: ModelConfig, counts: list[StageCount], tensor_parallel_size: int) -> str:
    lines = [f"{'stage':>5}  {'layers':<46} {'params / TP rank':>18} {'analytic':>18}  match"]
    for c in counts:
        layers = _compress(c.layers)
        ok = "yes" if c.parameters_per_tp_rank == c.analytic_per_tp_rank else "NO"
        lines.append(f"{c.stage:>5}  {layers:<46} {c.parameters_per_tp_rank:>18,} {c.analytic_per_tp_rank:>18,}  {ok}")
    total = total_from_stages(counts, config, tensor_parallel_size)
    analytic = analytic_built_parameters(config, tensor_parallel_size)
    padded = config.padded_vocab_size(tensor_parallel_size)
    embedding = "tied embedding once" if config.tie_word_embeddings else "untied head"
    lines += [
        "",
        f"total with the tokenizer's vocabulary ({config.vocab_size:,}; what transformers reports): "
        f"{tokenizer_vocabulary_total(config):,}",
        f"total as built here, vocabulary padded to {padded:,} for TP {tensor_parallel_size} (one replica, "
        f"{embedding}{', the MTP module' if config.mtp else ''}): {total:,} from the modules, {analytic:,} analytic "
        f"({'equal' if total == analytic else 'DIFFERENT'})",
        *mtp_lines(config),
        block_matrices_line(config),
        f"largest rank: {max(c.parameters_per_tp_rank for c in counts):,} parameters",
    ]
    return "\n".join(lines)


def format_moe_summary(config: ModelConfig, tensor_parallel_size: int) -> str:
    """A Mixture-of-Experts model's total and active counts from its config (count_stages builds its stages at
    expert-parallel size 1, printed beside them by ``main``)."""
    moe, tp = config.moe, tensor_parallel_size
    sparse = sum(moe.is_sparse(n) for n in range(1, config.num_layers + 1))
    shared_ffn = moe.shared_expert_ffn_hidden_size
    shared = f", a shared expert of ffn {shared_ffn}" + ("" if moe.shared_expert_gate else " (no gate)") \
        if shared_ffn else ""
    embedding = "the tied embedding once" if config.tie_word_embeddings else "both embeddings"
    return "\n".join([
        f"{sparse} of {config.num_layers} blocks sparse: {moe.num_experts} experts of ffn {moe.moe_ffn_hidden_size}, "
        f"top {moe.top_k}{shared}",
        "",
        f"total with the tokenizer's vocabulary ({config.vocab_size:,}; what transformers reports): "
        f"{tokenizer_vocabulary_total(config):,}",
        f"active per token with the tokenizer's vocabulary (top {moe.top_k} of {moe.num_experts} routed experts, the "
        f"router{' and the shared expert' if shared else ''}, every dense parameter, {embedding}): "
        f"{tokenizer_vocabulary_active(config):,}",
        f"total and active, vocabulary padded to {config.padded_vocab_size(tp):,} for TP {tp}: "
        f"{analytic_total_parameters(config, tp):,} and {analytic_active_parameters(config, tp):,}",
        *mtp_lines(config),
    ])


def mtp_lines(config: ModelConfig) -> list[str]:
    """model.mtp's module beside transformers' counts, and a checkpoint's size that stores it as DeepSeek-V3's
    does (module docstring); nothing without model.mtp."""
    if config.mtp is None:
        return []
    unpadded = dataclasses.replace(config, make_vocab_size_divisible_by=1)
    module, depth = mtp_parameters(unpadded), config.mtp.depth
    official = official_checkpoint_parameters(config)
    lines = [
        f"multi-token prediction (model.mtp, depth {depth}; not in the counts above, as transformers ignores it): "
        f"{module:,} parameters (eh_proj 2 h^2, 3 norms and block{'s' if depth > 1 else ''} "
        f"{', '.join(str(config.num_layers + k) for k in range(1, depth + 1))})",
        f"a checkpoint with it, each MTP layer also storing its own copies of the embedding and the head (DeepSeek-V3's"
        f" layer {config.num_layers}): {official:,} = {tokenizer_vocabulary_total(config):,} + "
        f"{official - tokenizer_vocabulary_total(config):,}",
    ]
    if config.attention_type == "mla" and config.moe is not None:
        extras = fp8_checkpoint_extras(config)
        lines.append(f"with the fp8 release's block scales and the routers' score biases ({extras:,}): "
                     f"{official + extras:,} ({(official + extras) / 1e9:,.2f}B; DeepSeek-V3's published 685B = 671B "
                     f"+ 14B of MTP)")
    return lines


def _compress(names: list[str]) -> str:
    """['TransformerLayer', 'TransformerLayer', 'FinalLayerNorm'] -> 'TransformerLayer x2, FinalLayerNorm'."""
    groups: list[list] = []
    for name in names:
        if groups and groups[-1][0] == name:
            groups[-1][1] += 1
        else:
            groups.append([name, 1])
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in groups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="530b", help="model shape (default 530b)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default 8, the recipe's, where it divides the "
                        "heads; else 1)")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size (default 35, the recipe's, where it divides the "
                        "layers; else 1)")
    args = parser.parse_args(argv)
    config = preset(args.preset)
    tp = args.tp or (8 if config.num_key_value_heads % 8 == 0 and config.ffn_hidden_size % 8 == 0 else 1)
    pp = args.pp or (35 if config.num_layers % 35 == 0 else 1)
    try:
        counts = count_stages(config, tp, pp)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    experts = ", every expert on each rank (EP 1)" if config.moe is not None else ""
    print(f"{args.preset}: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads, "
          f"TP {tp} x PP {pp} (built on the meta device{experts})\n")
    if config.moe is not None:
        print(format_moe_summary(config, tp) + "\n")
    print(format_summary(config, counts, tp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
