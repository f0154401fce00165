"""Parameters and memory of one pipeline stage on one GPU: weights, gradients, optimizer states, activations.

Parameters are counted on the meta device (model/summary.py). The bytes per parameter come from
``planner.hardware.DeepSpeedLayout``; the activations from what THIS implementation keeps for its backward, one row
per tensor (``layer_stored_tensors``).

Everything below is per GPU and per optimizer step unless named otherwise. t, p, d: tensor-, pipeline-, data-parallel
sizes; s sequence length, b micro-batch, h hidden, a heads, V padded vocabulary; N_i the parameters of one TP rank of
pipeline stage i (counted on the meta device by model/summary.py); m = global batch / (b d) micro-batches per pipeline.

Memory of stage i
    weights + grads + accumulation buffer + master + Adam       as above
    A Mixture-of-Experts model (model.moe): N_i holds the rank's E / EP experts of each sparse block, and the
        experts' master, Adam and ZeRO gradient partition are split over the expert-data-parallel group, d / EP
        ranks, not d (planner/experts.py); a sparse block's activations are sparse_mlp_stored_tensors' rows.
    activations = held x per_micro_batch + working_set, held = min(p - i, m) (a 1F1B stage keeps the micro-batches
        whose backward has not run: DeepSpeed's ``TrainSchedule.num_pipe_buffers``).
        Per block and micro-batch: what THIS implementation keeps for the backward (``layer_stored_tensors``, one row
        per tensor, each with the recompute modes that keep it), in the model dtype (e bytes: 2 bf16, 4 fp32), per
        token, with u = 1/t with SP (outside the TP matmuls a rank holds s/t positions) and 1 without, f the FFN,
        q the QKV rows (3h multi-head):
          "none": 4 h u (the block output, ln1 output, attention residual sum = ln2 input, ln2 output) + q/t (the
            QKV output; q, k, v are views of it) + h/t (the attention output, the dense layer's input) + 2 f/t (fc1
            output and GeLU output); fp32 extras: LayerNorm mean and rstd, 2 norms x 2 x 4 u bytes, and the fused
            SDPA's logsumexp, 4 a/t bytes. GPT: 16 h at t = 1, 16 h / t with SP. The fused kernels (flash, memory-
            efficient; CPU's flash too) write their output in (b, s, a, d) layout, so with q a view of the QKV output
            the dense layer's input, transpose(1, 2).reshape, is a view of the SDPA output, not a copy (measured with
            saved-tensor hooks on the tiny GPT, CPU fp32: 15.125 h per token besides the block's input).
          "selective" (the attention core checkpointed, model/attention.py SelfAttention.core): the same minus the SDPA
            logsumexp, and the SDPA output where the dense input is a copy of it (below); with the GPT shape that is
            all it saves: the dense layer still keeps the core's output, of which its input is a view. With the scores stored
            (below) it drops the s x s terms too: that is where selective matters (Korthikanti et al.'s 5 a s^2 b).
          "full": the block output only, e h u (its input is the previous block's output), and while one block is
            recomputed its whole "none" set is alive once (the working set; "selective": the recomputed core).
        Derived from the code, not measured, for the Llama shapes: RMSNorm keeps its normalised x (e h u), its
        rsqrt (4 u bytes) and, in 16-bit, the fp32 copy of its input (4 h u bytes), per norm; SwiGLU 4 f/t (gate_up
        output 2 f/t, silu output, the product); with GQA (flatten copies the query) or RoPE (rotates it) SDPA keeps
        a query of its own, h/t. The SDPA output takes the query's layout: (b, s, a, d) when the query is a view of
        the QKV output, and then the dense input is a view of it, as for GPT; but when a rank holds more than one
        key/value group of more than one query head, GQA's flatten copies the query to (b, a, s, d), the output is
        laid out so too and the dense input is a transposed copy: h/t more, which selective drops (both cases are
        measured in tests/test_activation_memory.py: the Llama block at TP 1, 2 groups, and TP 2, 1 group); RoPE keeps the rotated keys, g d/t, and cos and sin, 2 s d per block
        (x cos + rotate_half(x) sin keeps only those, the factors without a gradient). With hidden_dropout > 0:
        two bool masks (CUDA's native_dropout), 2 h u bytes, and the embedding's, h u, on the first stage. The
        fused CUDA kernels take the attention dropout without a mask (they regenerate it from the RNG state), so
        attention_dropout adds nothing unless the scores are stored.
        Korthikanti et al. 2022 (arXiv:2205.05198, eq. 2-4) for reference: s b h (34 + 5 a s / h) bytes at t = 1,
        16-bit, with dropout masks; s b h (10 + 24 / t + 5 a s / (h t)) with TP; (34 + 5 a s / h) / t with SP. Their
        5 a s / h term (softmax output, dropout mask and output, 5 a s^2 b / t bytes) is what Assumptions
        .attention_scores "stored" adds in place of the logsumexp and SDPA output, the unfused math kernel (an
        explicit mask, or a head dimension neither fused kernel takes); "recomputed" (default) leaves it out.
        Multi-head latent attention (model.attention_type "mla", DeepSeek-V3's) keeps other tensors in place of
        the QKV rows: its two latents and their norms, kv_b_proj's output (v is a view of it), the core's q and k
        of d_n + d_r each, the dense input and, without recompute, the kernel's output and logsumexp
        (latent_attention_stored_tensors); selective recompute drops the last two, as for multi-head attention.
        recompute_num_layers n: the first n blocks of each stage in the mode, the others "none".
        One block's backward peaks above its kept set by ``layer_backward_transient_bytes`` (the gradient of the
        MLP's up-projection output), counted apart: not in the stage totals below.
        Each held micro-batch also keeps the stage's input (e s b h u: the received tensor, or the embedding output);
        the last stage adds its head once: the final norm's output (the head's input) and statistics, and the
        logits and their gradient, 2 e s b V / t. With model.mtp (D depths, model/mtp.py) the last stage's blocks
        L + 1 .. L + D keep what a trunk block of that number keeps (its recompute mode, dense or sparse), and each
        depth adds to the head (mtp_stored_tensors, per token) the embedding of its tokens e h u, the enorm, hnorm
        and norm_k rows, eh_proj's input 2 e h u, norm_k's output e h u and its logits e V / t, and its logits'
        gradient e V / t to the working set (the tokens carried, 8 bytes a position, left out).
    Under DualPipeV (parallelism.pipeline_schedule "dualpipev") a pipeline rank holds two stages, r and 2p - 1 - r,
        and what it keeps at each instruction boundary is counted from its instruction stream
        (planner.pipeline_schedule.activations_in_flight): each stage's micro-batches in flight times that stage's
        per-micro-batch bytes (the loss stage, rank 0's phase 1, keeps its head's norm output and logits per micro-batch,
        since its backward need not follow its forward), plus the received and to-be-sent (b, s, h) buffers; the
        largest sum is the rank's activations (the buffers at that moment its pipeline buffers), with the largest
        working set (a recomputed block, the logits' gradient) on top. Measured at PP 4 in
        tests/test_activation_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig
from model.gpt import FINAL_NORMS
from model.summary import StageCount, analytic_built_parameters, count_stages, total_from_stages
from planner.experts import (
    count_expert_stages,
    expert_parameters_of,
    kept_assignments_per_token,
    recompute_groups,
    splits_the_sequence,
)
from planner.hardware import DTYPE_BYTES, GIB, Assumptions, DeepSpeedLayout, Hardware
from planner.muon import optimizer_states
from planner.pipeline_schedule import activations_in_flight
from runconfig.run import RunConfig


@dataclass(frozen=True)
class ParameterCounts:
    stages: list[StageCount]
    """Every stage of one TP rank, built on the meta device, with the closed-form count beside it."""
    total: int
    """One replica from the modules, the tied embedding once, model.mtp's module included."""
    analytic_total: int
    """model.summary.analytic_built_parameters: transformers' count and model.mtp's module."""


def count_parameters(config: RunConfig, uneven_stages: bool = False) -> ParameterCounts:
    """One count per pipeline rank (under DualPipeV with its two stages in ``phases``). A Mixture-of-Experts model is
    counted from its config at the run's EP (planner.experts.count_expert_stages: a rank holds E / EP experts of
    each sparse block), its total with every expert. ``uneven_stages``: a PP that does not divide the layers, split
    as DeepSpeed's partition_balanced would (model/summary.py check_split)."""
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    if config.model.moe is not None:
        stages = count_expert_stages(config.model, tp, pp, config.parallelism.expert_parallel_size,
                                     config.parallelism.pipeline_schedule, uneven_stages)
        total = analytic_built_parameters(config.model, tp)
        return ParameterCounts(stages, total, total)
    stages = count_stages(config.model, tp, pp, pipeline_schedule=config.parallelism.pipeline_schedule,
                          uneven_stages=uneven_stages)
    return ParameterCounts(stages, total_from_stages(stages, config.model, tp),
                           analytic_built_parameters(config.model, tp))


def transformer_layers(count: StageCount) -> int:
    """The stage's trunk blocks (1 .. L); model.mtp's are mtp_blocks'."""
    return sum(name == "TransformerLayer" for name in count.layers)


def mtp_blocks(model: ModelConfig, count: StageCount) -> int:
    """model.mtp's blocks on this stage (L + 1 .. L + D: the last stage's), 0 elsewhere or without model.mtp."""
    return sum(number > model.num_layers for number in count.blocks)


def hidden_tensor_bytes(model: ModelConfig, micro_batch: int, context_parallel_size: int = 1) -> int:
    """One (b, s, h) activation in the model dtype: what a layer takes in and what a stage sends (2 s b h in bf16);
    under context parallelism a rank's s / CP positions of it."""
    return model.seq_length // context_parallel_size * micro_batch * model.hidden_size * DTYPE_BYTES[model.precision]


FINAL_NORM_LAYERS = {norm.__name__ for norm in FINAL_NORMS.values()}


def holds_head(count: StageCount) -> bool:
    """The last stage: it holds the final norm (and computes the logits and the loss)."""
    return any(name in FINAL_NORM_LAYERS for name in count.layers)


ALL_MODES = ("none", "selective", "full")
STORING_MODES = ("none", "selective")


@dataclass(frozen=True)
class StoredTensor:
    """One row of what a block keeps for its backward: bytes per token of the micro-batch, and the recompute modes
    that keep it."""

    name: str
    bytes_per_token: float
    modes: tuple[str, ...]


def _norm_rows(model: ModelConfig, replicated: float, what: str) -> list[StoredTensor]:
    """What one norm keeps besides its input and output. ``replicated`` is h u, the norm's width on this rank."""
    dtype = DTYPE_BYTES[model.precision]
    if model.norm == "layernorm":  # native_layer_norm: the mean and 1/std of each position, fp32
        return [StoredTensor(f"{what}: mean and rstd (fp32)", 2 * 4 * replicated / model.hidden_size, STORING_MODES)]
    rows = [StoredTensor(f"{what}: rsqrt (fp32) and the normalised x (model dtype)",
                         4 * replicated / model.hidden_size + dtype * replicated, STORING_MODES)]
    if dtype != 4:  # RMSNorm computes in fp32: x.float() is a new tensor, kept by pow and by the mul
        rows.append(StoredTensor(f"{what}: the fp32 copy of its input", 4 * replicated, STORING_MODES))
    return rows


def sparse_mlp_stored_tensors(model: ModelConfig, tensor_parallel_size: int, *, micro_batch: int = 1,
                              expert_parallel_size: int = 1, sequence_parallel: bool = False) -> list[StoredTensor]:
    """What the MoE block of a sparse layer (model/moe.py, MoEBlock) keeps for its backward, per token of the
    micro-batch (T = s b), in place of the dense MLP's rows and of the ln2 output. Derived from the code, each row the
    tensor an autograd node saves; k the top_k, k' the assignments kept (k' = k when dropless, planner.experts), e the
    model dtype. Every TP rank routes all T tokens (with SP, step 1 gathers the sequence), except under the
    sequence-split dispatch (SP, t > 1, EP > 1), where a rank routes its own T / t: the rows marked (/ u) are then
    divided by t.

        the router's input tokens, e h (/ u): the ln2 output (with SP at EP 1 its gathered sequence), which the router
            keeps in the model dtype (model/moe.py fp32_linear: no fp32 copy) and the shared expert too
        router logits (the z-loss's logsumexp input) and softmax (or sigmoid) scores, fp32: 8 E (sigmoid_bias: + 4,
            the scores' sum); the logsumexp, 4; the stable sort's indices, int64, 8 E: the selected experts (T, k)
            are a view of them, which gather keeps; norm_topk_prob: the k selected scores and their sum, 4 k + 4 (/ u)
        the dispatch's row index 8 k' and the combine's slot index 8 k (int64, / u); at EP > 1 the regrouping by
            local expert and back, 16 k' more (of every row the rank computes: not / u)
        the experts' input rows, e k' h (at EP > 1 the rows received, under the split dispatch gathered over TP:
            balanced routing assumed); per row the SwiGLU's gate_up output, silu output and product, e k' 4 F / t
        the combine's gathered outputs (T, k, h) and gate weights, e k (h + 1) (/ u)
        the shared expert (F_s > 0): its SwiGLU 4 F_s / t and, with shared_expert_gate, its output h and the
            sigmoid gate, e (4 F_s / t + h + 1); without the gate (DeepSeek-V3's) the output is added as it is and
            kept by nothing, e 4 F_s / t; under the split dispatch also its own gathered input, e h
    The aux loss's per-expert terms (E floats a block) are left out. Checked against the tensors the block saves
    (saved-tensor hooks, CPU, fp32 and bf16, EP 1 and TP 1, the per-expert matmul loop: tests/test_planner_moe.py;
    TP 2 x EP 2 with sequence parallelism, the split dispatch: tests/test_moe_dispatch.py); CUDA's grouped GEMM keeps
    the same inputs (rows, gate_up output, silu output, product), derived, not measured. Per token fp32 at k 2, E 8,
    h 256, F 128, t 1: 9,400 bytes, of which the experts' SwiGLU 4,096 and the rows 2 x 2,048 (dispatched and
    gathered back)."""
    moe, h, t = model.moe, model.hidden_size, tensor_parallel_size
    dtype = DTYPE_BYTES[model.precision]
    experts, k, kept = moe.num_experts, moe.top_k, kept_assignments_per_token(model)
    split = splits_the_sequence(t, sequence_parallel, expert_parallel_size)
    u = 1 / t if split else 1
    rows = [
        StoredTensor("MoE input tokens (the ln2 output; the router's and the shared expert's input)", dtype * h * u,
                     STORING_MODES),
        StoredTensor("router logits and scores (fp32)", (8 * experts + 4 * (moe.router == "sigmoid_bias")) * u,
                     STORING_MODES),
        StoredTensor("router z-loss logsumexp (fp32)", 4 * u, STORING_MODES),
        StoredTensor("top-k: the sort's indices (int64, all E)", 8 * experts * u, STORING_MODES),
    ]
    if moe.norm_topk_prob:
        rows.append(StoredTensor("norm_topk_prob: selected scores and their sum (fp32)", (4 * k + 4) * u,
                                 STORING_MODES))
    rows += [
        StoredTensor("dispatch and combine indices (int64)", (8 * kept + 8 * k) * u
                     + 16 * kept * (expert_parallel_size > 1), STORING_MODES),
        StoredTensor("experts' input rows", dtype * kept * h, STORING_MODES),
        StoredTensor("experts: gate_up output, silu output, their product", dtype * kept * 4 * moe.moe_ffn_hidden_size
                     / t, STORING_MODES),
        StoredTensor("combine: gathered expert outputs and gate weights", dtype * k * (h + 1) * u, STORING_MODES),
    ]
    if moe.shared_expert_ffn_hidden_size:
        gate = h + 1 if moe.shared_expert_gate else 0  # the gate's product keeps the output and the sigmoid
        rows.append(StoredTensor("shared expert: SwiGLU (gated: its output and sigmoid gate; split: its input)",
                                 dtype * (4 * moe.shared_expert_ffn_hidden_size / t + gate + h * split),
                                 STORING_MODES))
    return rows


def latent_attention_stored_tensors(model: ModelConfig, tensor_parallel_size: int, *, sequence_parallel: bool,
                                    attention_scores_stored: bool = False, micro_batch: int = 1) -> list[StoredTensor]:
    """What multi-head latent attention (model/mla.py) keeps for its backward, per token of the micro-batch on one TP
    rank, in place of the QKV rows of layer_stored_tensors (the ln1 output, its input, is the block's row). nh heads,
    r_q, r_kv the latents, d_qk = d_n + d_r the q and k heads, d_v the v heads, e the model dtype, u = 1/t with SP
    (the latents are replicated sequence shards there, like the block's input), else 1. Derived from the code, each
    row the tensor an autograd node saves:

        query latent (q_lora_rank set): RMSNorm's fp32 input (q_a_proj's output itself in fp32, its fp32 copy in
            16-bit), 4 r_q u; its rsqrt, 4 u; the normalised x, e r_q u; the norm's output, q_b_proj's input,
            e r_q u. With q_proj instead (r_q null) nothing: its input is the ln1 output.
        key/value latent: the same for kv_a_layernorm, 4 r_kv u + 4 u + 2 e r_kv u; in fp32 the norm's input is a
            view of kv_a_proj_with_mqa's output, whose k_rope columns it keeps too, 4 d_r u more
        kv_b_proj's output, e nh (d_n + d_v) / t: v, which the core keeps, is a view of it (k_nope is copied into k)
        the core's q and k, e nh d_qk / t each: the concatenations [q_nope, rope(q_rope)], [k_nope, rope(k_rope)]
        RoPE's cos and sin, (s, d_r) each per block, 2 e d_r / b; the rotation keeps nothing else (x cos: the
            factor without a gradient), so neither q_b_proj's output nor the rope key is kept
        the fused kernel's output e nh d_v / t and logsumexp 4 nh / t ("none"; "selective" recomputes them from the
            kept q, k and v); its output is laid out as the contiguous q (b, nh, s, d), so the dense layer's input,
            transpose(1, 2).reshape, is a copy, e nh d_v / t, kept in both storing modes

    With the scores stored (Assumptions.attention_scores "stored") Korthikanti et al.'s 5 nh s / t scores replace the
    kernel's output and logsumexp, as for multi-head attention. DeepSeek-V3 per token at t = 1, bf16 (r_q 1536, r_kv
    512, 128 heads of 192 and v 128): 12,292 + 4,100 + 65,536 + 2 x 49,152 + 32,768 + 32,768 + 512 bytes and the
    cos and sin, against the QKV output's 2 x 128 x (2 x 192 + 128) = 131,072 of a multi-head block of these widths.
    The rows are the tensors the block saves (saved-tensor hooks, CPU, fp32, exact; tests/test_deepseek_plan.py),
    with a fused kernel's saved set (q, k, v, output, logsumexp) standing in for the kernel: on CPU MLA's unequal
    q and v widths select the math kernel, which keeps the s x s scores."""
    t, e = tensor_parallel_size, DTYPE_BYTES[model.precision]
    u = 1.0 / t if sequence_parallel else 1.0
    heads = model.num_attention_heads / t
    rows = []
    if model.q_lora_rank is not None:
        rows.append(StoredTensor("query latent: the norm's fp32 input, rsqrt, normalised x, output",
                                 (4 * model.q_lora_rank + 4 + 2 * e * model.q_lora_rank) * u, STORING_MODES))
    rope_columns = model.qk_rope_head_dim if e == 4 else 0  # kept through the fp32 norm's view of the projection
    rows += [
        StoredTensor("key/value latent: the norm's fp32 input, rsqrt, normalised x, output",
                     (4 * (model.kv_lora_rank + rope_columns) + 4 + 2 * e * model.kv_lora_rank) * u, STORING_MODES),
        StoredTensor("kv_b_proj output (v is a view of it)",
                     e * heads * (model.qk_nope_head_dim + model.v_head_dim), STORING_MODES),
        StoredTensor("q and k of the core, nope and rope concatenated", 2 * e * heads * model.head_dim, STORING_MODES),
        StoredTensor("RoPE cos and sin, (s, d_r) each per block", 2 * e * model.qk_rope_head_dim / micro_batch,
                     STORING_MODES),
        StoredTensor("attention output, the dense layer's input (a copy)", e * model.attention_size / t,
                     STORING_MODES),
    ]
    if attention_scores_stored:
        rows.append(StoredTensor("s x s scores (Korthikanti et al.)", 5 * heads * model.seq_length * e / 2,
                                 ("none",)))
    else:
        rows += [StoredTensor("SDPA logsumexp (fp32)", 4 * heads, ("none",)),
                 StoredTensor("SDPA output", e * model.attention_size / t, ("none",))]
    return rows


def _multi_head_attention_rows(model: ModelConfig, tensor_parallel_size: int, *, attention_scores_stored: bool,
                               micro_batch: int, context_parallel_size: int) -> list[StoredTensor]:
    """Multi-head (and grouped-query) attention's rows of layer_stored_tensors. Under context parallelism (CP > 1)
    per token of the rank's slice: the core keeps the all-to-all's copies of q, k and v (all S positions of heads /
    CP heads: the QKV output's bytes per slice token) and its own output, which the all-to-all back copies into the
    dense input; the QKV output, the rotated query and keys are freed once sent."""
    t, dtype = tensor_parallel_size, DTYPE_BYTES[model.precision]
    heads, attention = model.num_attention_heads / t, model.attention_size / t
    kv = model.num_key_value_heads * model.head_dim / t
    query_copied = model.queries_per_key_value_head > 1 or model.position_embedding == "rope"
    # The SDPA output takes the query's memory layout. The query is a view of the QKV output, laid out (b, s, a, d),
    # unless a rank holds several key/value groups of several query heads: flatten then copies it to (b, a, s, d)
    # (RoPE's rotation keeps whichever layout it gets).
    query_contiguous = model.queries_per_key_value_head > 1 and model.num_key_value_heads // t > 1
    ulysses = context_parallel_size > 1
    rows = [StoredTensor("q, k, v after Ulysses' all-to-all" if ulysses else "QKV output (q, k, v are views of it)",
                         dtype * model.qkv_size / t, STORING_MODES)]
    if query_copied and not ulysses:  # SDPA keeps a query of its own: GQA's flatten copies it, RoPE rotates it
        rows.append(StoredTensor("query copy (GQA) or rotated query (RoPE)", dtype * attention, STORING_MODES))
    if model.position_embedding == "rope":  # the rotated keys; x cos and rotate_half(x) sin keep cos and sin only
        rows += [StoredTensor("rotated keys", dtype * kv, STORING_MODES)] if not ulysses else []
        rows += [StoredTensor("RoPE cos and sin, (s, d) each per block", 2 * dtype * model.head_dim / micro_batch,
                              STORING_MODES)]
    if model.qk_layernorm:  # the normalised q and k, and each head's statistics (fp32), like a norm's rows
        stats = (2 if model.norm == "layernorm" else 1) * 4 * (heads + model.num_key_value_heads / t)
        rows.append(StoredTensor("q/k norms (qk_layernorm): outputs and per-head statistics", dtype * (attention + kv)
                                 + stats, STORING_MODES))
    rows.append(StoredTensor("attention output, the dense layer's input", dtype * attention, STORING_MODES))
    if attention_scores_stored:  # Korthikanti et al.: softmax output, dropout mask, dropout output (5 a s^2 b / t)
        rows.append(StoredTensor("s x s scores (Korthikanti et al.)", 5 * heads * model.seq_length * dtype / 2,
                                 ("none",)))
    else:  # the fused kernel keeps its output and one fp32 statistic per row and head; so do the document-mask
        # kernels (model/document_attention.py: blockwise, FlexAttention), whose block masks are the stage's, not a row
        rows.append(StoredTensor("SDPA logsumexp (fp32)", 4 * heads, ("none",)))
        if query_contiguous or ulysses:  # (b, a, s, d) too, or sent back: the dense input is a copy
            rows.append(StoredTensor("SDPA output", dtype * attention, ("none",)))
    return rows


def layer_stored_tensors(model: ModelConfig, tensor_parallel_size: int, *, sequence_parallel: bool,
                         attention_scores_stored: bool = False, micro_batch: int = 1, sparse: bool = False,
                         expert_parallel_size: int = 1, context_parallel_size: int = 1) -> list[StoredTensor]:
    """What one block of this implementation (model/gpt.py, TransformerLayer) keeps for its backward, per token of a
    micro-batch of ``micro_batch`` sequences on one TP rank, by recompute mode: the table behind
    layer_activation_bytes (module docstring). ``sparse``: a block of a Mixture-of-Experts model with experts (its
    MLP's rows and the ln2 output are sparse_mlp_stored_tensors'). The attention's rows: multi-head attention's
    (_multi_head_attention_rows), or MLA's (latent_attention_stored_tensors)."""
    h, t, f = model.hidden_size, tensor_parallel_size, model.ffn_hidden_size
    dtype = DTYPE_BYTES[model.precision]
    u = 1.0 / t if sequence_parallel else 1.0  # outside the TP matmuls a rank holds s/t positions with SP
    replicated = h * u
    rows = [
        StoredTensor("block output (the next block's input)", dtype * replicated, ALL_MODES),
        StoredTensor("ln1 output, residual sum (ln2 input), ln2 output", 3 * dtype * replicated, STORING_MODES)
        if not sparse else StoredTensor("ln1 output, residual sum (ln2 input)", 2 * dtype * replicated, STORING_MODES),
        *_norm_rows(model, replicated, "ln1"), *_norm_rows(model, replicated, "ln2"),
    ]
    if model.attention_type == "mla":
        rows += latent_attention_stored_tensors(model, t, sequence_parallel=sequence_parallel,
                                                attention_scores_stored=attention_scores_stored,
                                                micro_batch=micro_batch)
    else:
        rows += _multi_head_attention_rows(model, t, attention_scores_stored=attention_scores_stored,
                                           micro_batch=micro_batch, context_parallel_size=context_parallel_size)
    if sparse:
        rows += sparse_mlp_stored_tensors(model, t, micro_batch=micro_batch, expert_parallel_size=expert_parallel_size,
                                          sequence_parallel=sequence_parallel)
    elif model.mlp == "swiglu":
        rows.append(StoredTensor("gate_up output, silu output, their product", dtype * 4 * f / t, STORING_MODES))
    else:
        rows.append(StoredTensor("fc1 output (GeLU input), GeLU output", dtype * 2 * f / t, STORING_MODES))
    if model.hidden_dropout > 0:  # CUDA's native_dropout keeps a bool mask
        rows.append(StoredTensor("hidden dropout masks (bool)", 2 * replicated, STORING_MODES))
    return rows


def layer_activation_bytes(model: ModelConfig, micro_batch: int, tensor_parallel_size: int, *,
                           sequence_parallel: bool, recompute: str, attention_scores_stored: bool = False,
                           sparse: bool = False, expert_parallel_size: int = 1, context_parallel_size: int = 1) -> float:
    """Bytes one block keeps for its backward per micro-batch, its output counted ("full": the output alone, h u
    per token), by default without the s x s scores, which the fused kernel the model runs does not keep;
    ``sparse``: a block with experts (sparse_mlp_stored_tensors)."""
    if recompute not in ALL_MODES:
        raise ValueError(f"recompute must be one of {ALL_MODES}, got {recompute!r}")
    rows = layer_stored_tensors(model, tensor_parallel_size, sequence_parallel=sequence_parallel,
                                attention_scores_stored=attention_scores_stored, micro_batch=micro_batch,
                                sparse=sparse, expert_parallel_size=expert_parallel_size,
                                context_parallel_size=context_parallel_size)
    tokens = model.seq_length // context_parallel_size * micro_batch  # this rank's slice under CP
    return tokens * sum(row.bytes_per_token for row in rows if recompute in row.modes)


def layer_backward_transient_bytes(model: ModelConfig, micro_batch: int, tensor_parallel_size: int, *,
                                   context_parallel_size: int = 1) -> float:
    """Bytes one dense block's backward holds beyond what the block keeps, at its peak: the gradient of the MLP's
    up-projection output (2 f/t per token with SwiGLU's fused gate and up, f/t with GeLU), made while the whole kept set
    is still alive, since the MLP's backward runs first. Later transients come after the MLP's kept rows (4 f/t or
    2 f/t) are freed: the attention kernel's (one block of scores for the blockwise kernel, at most MAX_SCORES fp32
    values; FlexAttention's tiles), which outweighs this term only at short sequences. Measured with
    benchmarks/bench_document_attention.py (an allocation count after every operator): the Llama block at s 4096 and
    8192 peaks at its kept bytes plus 2 f s b e, the GPT block at plus f s b e."""
    width = (2 if model.mlp == "swiglu" else 1) * model.ffn_hidden_size / tensor_parallel_size
    return DTYPE_BYTES[model.precision] * width * model.seq_length // context_parallel_size * micro_batch


def mtp_stored_tensors(model: ModelConfig, tensor_parallel_size: int, replicated_share: float) -> list[StoredTensor]:
    """What one model.mtp depth keeps for its backward besides its block's (model/mtp.py), per token; replicated
    tensors h u wide (``replicated_share`` u: 1/t with SP), its logits V/t. Derived from the code, not measured."""
    dtype, h, u = DTYPE_BYTES[model.precision], model.hidden_size, replicated_share
    return [
        StoredTensor("e^k, the embedding of the rolled tokens (enorm's input)", dtype * h * u, ALL_MODES),
        *_norm_rows(model, h * u, "enorm"), *_norm_rows(model, h * u, "hnorm"),
        StoredTensor("[enorm(e); hnorm(h)], eh_proj's input", dtype * 2 * h * u, ALL_MODES),
        *_norm_rows(model, h * u, "final norm_k"),
        StoredTensor("norm_k's output, the shared head's input", dtype * h * u, ALL_MODES),
        StoredTensor("its logits", dtype * model.padded_vocab_size(tensor_parallel_size) / tensor_parallel_size,
                     ALL_MODES),
    ]


def micro_batches_held(stage: int, pipeline_parallel_size: int, micro_batches: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at once: min(p - stage, m)."""
    return min(pipeline_parallel_size - stage, micro_batches)


def recomputing_blocks(model: ModelConfig, count: StageCount, recompute: str,
                       pipeline_parallel_size: int | None = None) -> int:
    """Blocks of this stage that recompute (ModelConfig.recomputes_block: the first recompute_num_layers of each of
    the PP 1F1B stages, or all of them; 0 with "none"). Without ``pipeline_parallel_size`` the stage is one of
    them."""
    return len(recomputing_block_numbers(model, count, recompute, pipeline_parallel_size))


def recomputing_block_numbers(model: ModelConfig, count: StageCount, recompute: str,
                              pipeline_parallel_size: int | None = None) -> list[int]:
    """The numbers of recomputing_blocks' blocks, model.mtp's L + k included (built with block L + k's mode)."""
    if recompute == "none":
        return []
    groups = recompute_groups(model, count, pipeline_parallel_size)
    return [n for n in count.blocks if model.recomputes_block(n, groups)]


@dataclass(frozen=True)
class StageActivations:
    per_micro_batch: int
    """Held per micro-batch: the stage's input, each block's stored set (its mode's), the embedding dropout mask."""
    working_set: int
    """Alive once: a recomputed block's recomputed part ("full": its whole set) and the head on the last stage."""
    head_held: int = 0
    """The part of the head a loss stage keeps until its backward (the final norm's output and statistics, the
    logits): alive once under 1F1B, per micro-batch in flight under DualPipeV."""


def stage_activations(model: ModelConfig, count: StageCount, micro_batch: int, tensor_parallel_size: int, *,
                      sequence_parallel: bool = False, recompute: str | None = None,
                      attention_scores_stored: bool = False, pipeline_parallel_size: int | None = None,
                      expert_parallel_size: int = 1, context_parallel_size: int = 1) -> StageActivations:
    """One stage's activations in ``recompute`` mode (default: the config's), recompute_num_layers applied over
    the 1F1B stages of ``pipeline_parallel_size`` (default: the stage's own blocks are one such stage). A
    Mixture-of-Experts model's blocks are summed one by one, each sparse or dense (model.moe.is_sparse), the
    working set the largest recomputed one."""
    recompute = model.recompute if recompute is None else recompute
    s, b, h, t = model.seq_length // context_parallel_size, micro_batch, model.hidden_size, tensor_parallel_size
    u = 1.0 / t if sequence_parallel else 1.0
    dtype = DTYPE_BYTES[model.precision]

    def layer(mode: str, sparse: bool = False) -> float:
        return layer_activation_bytes(model, b, t, sequence_parallel=sequence_parallel, recompute=mode,
                                      attention_scores_stored=attention_scores_stored, sparse=sparse,
                                      expert_parallel_size=expert_parallel_size,
                                      context_parallel_size=context_parallel_size)

    if model.moe is None:
        blocks = len(count.blocks)  # model.mtp's blocks (last stage) keep what a trunk block keeps
        recomputing = recomputing_blocks(model, count, recompute, pipeline_parallel_size)
        stored = recomputing * layer(recompute) + (blocks - recomputing) * layer("none")
        recomputed = layer("none") - (0.0 if recompute == "full" else layer(recompute)) if recomputing else 0.0
    else:
        groups = recompute_groups(model, count, pipeline_parallel_size)
        recomputes = {n: recompute != "none" and model.recomputes_block(n, groups) for n in count.blocks}
        stored = sum(layer(recompute if recomputes[n] else "none", model.moe.is_sparse(n)) for n in count.blocks)
        recomputed = max((layer("none", model.moe.is_sparse(n))
                          - (0.0 if recompute == "full" else layer(recompute, model.moe.is_sparse(n)))
                          for n in count.blocks if recomputes[n]), default=0.0)
    stage_input = hidden_tensor_bytes(model, b, context_parallel_size) * u
    first_stage_mask = s * b * h * u if count.stage == 0 and model.hidden_dropout > 0 else 0
    head = head_held = 0.0
    if holds_head(count):  # the final norm's output (the head's input) and stats, the logits and their gradient
        norm = s * b * sum(row.bytes_per_token for row in _norm_rows(model, h * u, "final norm"))
        logits = dtype * s * b * model.padded_vocab_size(t) / t
        depths = mtp_blocks(model, count)  # model.mtp: each depth's rows beside its block, and its logits
        mtp = depths * s * b * sum(row.bytes_per_token for row in mtp_stored_tensors(model, t, u))
        head_held = dtype * s * b * h * u + norm + logits + mtp
        head = head_held + (1 + depths) * logits  # the gradients of the trunk's and each depth's logits
    return StageActivations(per_micro_batch=int(stored + stage_input + first_stage_mask),
                            working_set=int(recomputed + head), head_held=int(head_held))


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of a pipeline stage at the full batch."""

    stage: int
    parameters: int
    """Parameters of this stage's TP rank (N_i)."""
    weights: int
    gradients: int
    """.grad in the model dtype."""
    gradient_accumulation: int
    """BF16_Optimizer's fp32 buffer, full size."""
    gradient_partition: int
    """The ZeRO optimizer's fp32 gradient partition (1/DP; a Mixture-of-Experts model's experts 1/(DP/EP))."""
    master_weights: int
    """fp32, 1/DP (ZeRO-1; the experts 1/(DP/EP): planner.experts)."""
    adam_states: int
    """exp_avg + exp_avg_sq, fp32, 1/DP (ZeRO-1; the experts 1/(DP/EP)); Muon's matrices: one momentum."""
    micro_batches_held: int
    """1F1B: min(p - stage, m). DualPipeV: of both stages together, where the rank's activations peak."""
    activations_per_micro_batch: int
    """Per micro-batch in the configured recompute mode (StageActivations); DualPipeV: through both stages, the loss
    stage's head included."""
    activations_working_set: int
    activations: int
    """held x per micro-batch + working set: the configured mode (model.recompute, recompute_num_layers)."""
    activations_none: int
    """The same without recompute ..."""
    activations_selective: int
    """... with selective recompute (the config's recompute_num_layers) ..."""
    activations_full: int
    """... and with full recompute: the three side by side."""
    pipeline_buffers: int
    reduce_buffer: int
    framework_allowance: int
    capacity: int
    optimizer_workspace: int = 0  # Muon's transient buffers at the step, the activations gone (planner/muon.py)
    reduce_buffer_in_backward: bool = False
    """DeepSpeed's ZeRO optimizer allocates its reduce bucket at the step's first backward and frees it after the
    reduction (DeepSpeedZeroOptimizer.setup_buckets), so it lives beside the activations, at any DP (measured:
    tests/test_activation_memory.py); BF16_Optimizer's bf16 copy of the gradients exists only after the last
    backward."""
    total: int = 0
    """Peak: every part; the reduce buffer beside the activations, or the larger of the two where they are never
    alive together."""
    margin: int = 0
    """capacity - total; negative when it does not fit."""
    fits: bool = True

    def __post_init__(self) -> None:
        static = (self.weights + self.gradients + self.gradient_accumulation + self.gradient_partition
                  + self.master_weights + self.adam_states + self.pipeline_buffers + self.framework_allowance)
        dynamic = self.activations + self.reduce_buffer if self.reduce_buffer_in_backward else \
            max(self.activations, self.reduce_buffer)
        total = static + max(dynamic, self.optimizer_workspace)
        object.__setattr__(self, "total", total)
        object.__setattr__(self, "margin", self.capacity - total)
        object.__setattr__(self, "fits", total <= self.capacity)


def stage_memory(config: RunConfig, layout: DeepSpeedLayout, count: StageCount, data_parallel_size: int,
                 micro_batches: int, hardware: Hardware, assumptions: Assumptions) -> StageMemory:
    """The bytes of one GPU of pipeline rank ``count.stage`` (under DualPipeV its two stages, ``count.phases``)."""
    tp, pp = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    ep, cp = config.parallelism.expert_parallel_size, config.parallelism.context_parallel_size
    # DeepSpeed's data axis, DP x CP, which ZeRO-1 shards over
    model, n, d = config.model, count.parameters_per_tp_rank, data_parallel_size * cp
    # ZeRO-1 shards: the dense parameters over DP, the experts over the expert-data-parallel group (d / EP ranks)
    experts = expert_parameters_of(count)

    def sharded(bytes_per_parameter: int) -> int:
        return bytes_per_parameter * (n - experts) // d + bytes_per_parameter * experts // (d // ep)

    hidden_tensor = hidden_tensor_bytes(model, config.micro_batch_size, cp)
    # the received activation and gradient: the sequence shard with SP, else the whole tensor
    received = hidden_tensor / tp if config.parallelism.sequence_parallel else hidden_tensor

    def activations(c: StageCount, mode: str) -> StageActivations:
        return stage_activations(model, c, config.micro_batch_size, tp,
                                 sequence_parallel=config.parallelism.sequence_parallel, recompute=mode,
                                 attention_scores_stored=assumptions.attention_scores_stored,
                                 pipeline_parallel_size=pp, expert_parallel_size=ep, context_parallel_size=cp)

    if count.phases:  # DualPipeV: what the rank's instruction stream keeps (module docstring)
        totals = {}
        for mode in ALL_MODES:
            acts = [activations(phase, mode) for phase in count.phases]
            flight = activations_in_flight(pp, micro_batches, count.stage,
                                           tuple(a.per_micro_batch + a.head_held for a in acts), received)
            working = max(a.working_set - a.head_held for a in acts)
            totals[mode] = int(flight.peak_bytes - flight.buffers * received) + working
            if mode == model.recompute:
                per_micro_batch, working_set = sum(a.per_micro_batch + a.head_held for a in acts), working
                held, buffers = sum(flight.held), int(flight.buffers * received)
    else:
        held = micro_batches_held(count.stage, pp, micro_batches)
        by_mode = {mode: activations(count, mode) for mode in ALL_MODES}
        totals = {mode: held * act.per_micro_batch + act.working_set for mode, act in by_mode.items()}
        per_micro_batch, working_set = by_mode[model.recompute].per_micro_batch, by_mode[model.recompute].working_set
        buffers = int(2 * received) if pp > 1 else 0
    states, workspace = optimizer_states(config, count, n - experts, experts, d)  # Adam's two moments, Muon's one
    bf16_optimizer = layout.optimizer == "BF16_Optimizer"
    reduce_buffer = layout.communication_bytes * n if bf16_optimizer else layout.reduce_bucket_elements * layout.grad_bytes
    return StageMemory(
        stage=count.stage, parameters=n, weights=layout.weight_bytes * n, gradients=layout.grad_bytes * n,
        gradient_accumulation=layout.accumulation_bytes * n, gradient_partition=sharded(layout.partition_grad_bytes),
        master_weights=sharded(4), adam_states=states, micro_batches_held=held,
        activations_per_micro_batch=per_micro_batch, activations_working_set=working_set,
        activations=totals[model.recompute], activations_none=totals["none"],
        activations_selective=totals["selective"], activations_full=totals["full"],
        pipeline_buffers=buffers, reduce_buffer=reduce_buffer if d > 1 or not bf16_optimizer else 0,
        framework_allowance=int(assumptions.framework_gib * GIB), capacity=int(hardware.memory_gib * GIB),
        optimizer_workspace=workspace, reduce_buffer_in_backward=not bf16_optimizer)
