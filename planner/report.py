"""What tools/plan.py prints: the tables, and the --json documents (their schema below).

JSON (``tools/plan.py --json``): one object
    schema_version: int (SCHEMA_VERSION; docs/planning.md lists what each version changed)
    config: str (the run config's path); gpu: Hardware fields; assumptions: Assumptions fields; storage: Storage
        fields (planner/checkpointing.py);
    deepspeed: DeepSpeedLayout fields; parameters: {stages: [{stage, layers, parameters_per_tp_rank,
        analytic_per_tp_rank, parameters_per_stage}], total, analytic_total}
    compute_optimal: {flops (C = 6 N D), run, chinchilla, twenty_tokens_per_parameter: each {parameters, tokens,
        tokens_per_parameter}, law: {E, A, B, alpha, beta}}
    plans: [one per node count: {nodes, gpus, tensor_parallel_size, pipeline_parallel_size, data_parallel_size
        (null if not whole), micro_batch_size, global_batch_size, micro_batches, errors: [str], warnings: [str],
        ramp: {start, increment, end, ramp_tokens, suggested} | null,
        memory: [per stage: StageMemory fields, bytes, plus total, margin, fits],
        flops: {first_batch, full_batch (hardware FLOPs, the configured recompute counted), first_batch_model,
            full_batch_model (model FLOPs, no recompute)},
        first_batch, full_batch: IterationTime fields (seconds; micro_batch: MicroBatchTime of the slowest stage;
            tflops_per_gpu and hfu from hardware FLOPs, mfu from model FLOPs),
        training: TrainingTime fields, measured: {iteration_seconds, tflops_per_gpu, model_tflops_per_gpu, hfu, mfu,
            predicted_over_measured} | null, checkpoint: CheckpointCost fields | null,
        gpu_hours, gpu_hours_per_trillion_tokens (null if impossible), published: PublishedRun fields
            (planner/published.py) | null, published_mfu | null}]
    --search --json: {schema_version, config, nodes, gpus, gpu, assumptions, ranked_by, layouts_tried, layouts_fitting, best,
        layouts: [Layout fields + peak_memory_bytes, peak_memory_gib, iteration_seconds, tflops_per_gpu, hfu, mfu]}
    Bytes are integers, times seconds, FLOPs floats. An impossible plan has errors and null figures where they
    cannot be computed.
    A Mixture-of-Experts model (model.moe) adds keys, a dense model's documents have none of them (EXPERT_KEYS):
    parameters.stages[] expert_parameters_per_tp_rank, sparse_blocks, local_experts (planner.experts
    .ExpertStageCount); each plan's experts: ExpertFigures fields | null; expert_all_to_all (seconds) in
    first_batch, full_batch and their micro_batch; with --search, each layout's expert_parallel_size and
    expert_all_to_all (seconds of the full batch). mfu then counts the active parameters' FLOPs.
    Ulysses context parallelism (CP > 1) adds, where it is in force (CONTEXT_KEYS): the plan's
    context_parallel_size, context_all_to_all (seconds) in first_batch, full_batch and their micro_batch; each
    searched layout's context_parallel_size and context_all_to_all. data_parallel_size counts the replicas (DP).
"""

from __future__ import annotations

import dataclasses
import itertools
import textwrap
from typing import Any

from model.config import ModelConfig, set_option
from model.summary import StageCount, analytic_active_parameters, analytic_total_parameters, mtp_parameters
from planner.checkpointing import CheckpointCost, Storage
from planner.hardware import GIB, Assumptions, Hardware, deepspeed_layout
from planner.memory import ParameterCounts, StageMemory
from planner.plan import Plan
from planner.scaling import ComputeOptimal, compute_optimal
from planner.search import Layout, LayoutResult
from runconfig.run import RunConfig

SCHEMA_VERSION = 3
"""Of both --json documents. A key renamed or removed, or a value whose meaning changes, bumps it and gets a line in
docs/planning.md ("The --json schema"); a new key does not."""


EXPERT_KEYS = ("experts", "expert_all_to_all", "expert_parallel_size")
"""Keys only a Mixture-of-Experts model's documents carry: a dense model's --json stays as it was."""


CONTEXT_KEYS = ("context_parallel_size", "context_all_to_all")
"""Keys only a context-parallel (CP > 1) plan or layout carries."""


def _without_keys(value: Any, keys: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        return {key: _without_keys(v, keys) for key, v in value.items() if key not in keys}
    if isinstance(value, list):
        return [_without_keys(v, keys) for v in value]
    return value


def _without_expert_keys(value: Any) -> Any:
    return _without_keys(value, EXPERT_KEYS)


def plan_to_dict(plan: Plan, experts: bool | None = None) -> dict[str, Any]:
    """The plan's fields; the MoE ones (EXPERT_KEYS) only for a Mixture-of-Experts model (``experts``; default:
    whether the plan has expert figures), the context-parallel ones (CONTEXT_KEYS) only at CP > 1."""
    document = dataclasses.asdict(plan)
    if plan.context_parallel_size == 1:
        document = _without_keys(document, CONTEXT_KEYS)
    return document if (plan.experts is not None if experts is None else experts) else _without_expert_keys(document)


def report_to_dict(config: RunConfig, hardware: Hardware, assumptions: Assumptions, parameters: ParameterCounts,
                   plans: list[Plan], storage: Storage | None = None) -> dict[str, Any]:
    """The --json document (schema in the module docstring)."""
    return {"schema_version": SCHEMA_VERSION, "config": config.source, "gpu": dataclasses.asdict(hardware),
            "assumptions": dataclasses.asdict(assumptions), "storage": dataclasses.asdict(storage or Storage()),
            "deepspeed": dataclasses.asdict(deepspeed_layout(config)),
            "parameters": dataclasses.asdict(parameters),
            "compute_optimal": dataclasses.asdict(compute_optimal(config, parameters)),
            "plans": [plan_to_dict(p, config.model.moe is not None) for p in plans]}


def layout_result_to_dict(result: LayoutResult, experts: bool = False) -> dict[str, Any]:
    """One searched layout; ``experts`` (a Mixture-of-Experts model) adds its EP and the all-to-all's seconds."""
    t = result.full_batch
    document = {**dataclasses.asdict(result.layout), "peak_memory_bytes": result.peak_memory_bytes,
                "peak_memory_gib": result.peak_memory_bytes / GIB, "iteration_seconds": t.seconds,
                "tflops_per_gpu": t.tflops_per_gpu, "hfu": t.hfu, "mfu": t.mfu}
    if result.layout.context_parallel_size > 1:
        document["context_all_to_all"] = t.context_all_to_all
    else:
        document = _without_keys(document, CONTEXT_KEYS)
    if experts:
        return {**document, "expert_all_to_all": t.expert_all_to_all}
    return _without_expert_keys(document)


def search_to_dict(config: RunConfig, nodes: int, hardware: Hardware, assumptions: Assumptions, tried: int,
                   results: list[LayoutResult], top: int) -> dict[str, Any]:
    """The --search --json document: the best ``top`` layouts that fit, fastest full-batch iteration first."""
    return {"schema_version": SCHEMA_VERSION, "config": config.source, "nodes": nodes, "gpus": nodes * hardware.gpus_per_node,
            "gpu": dataclasses.asdict(hardware), "assumptions": dataclasses.asdict(assumptions),
            "ranked_by": "full-batch iteration seconds", "layouts_tried": tried, "layouts_fitting": len(results),
            "best": layout_result_to_dict(results[0], config.model.moe is not None) if results else None,
            "layouts": [layout_result_to_dict(r, config.model.moe is not None) for r in results[:top]]}


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, width=118, initial_indent=indent, subsequent_indent=indent + "    ")


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def _stage_runs(stages: list[StageCount]) -> list[tuple[int, int, StageCount]]:
    """Consecutive stages with identical layers and counts, as (first, last, count)."""
    runs: list[tuple[int, int, StageCount]] = []
    for c in stages:
        if runs and runs[-1][2].layers == c.layers and runs[-1][2].parameters_per_tp_rank == c.parameters_per_tp_rank:
            runs[-1] = (runs[-1][0], c.stage, runs[-1][2])
        else:
            runs.append((c.stage, c.stage, c))
    return runs


def _layer_names(names: list[str]) -> str:
    """['TransformerLayer', 'TransformerLayer', 'FinalLayerNorm'] -> 'TransformerLayer x2, FinalLayerNorm'."""
    groups = [(name, len(list(run))) for name, run in itertools.groupby(names)]
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in groups)


SCHEDULE_LABELS = {"1f1b": "1F1B", "dualpipev": "DualPipeV", "vshape": "V-shaped 1F1B"}

FLOPS_CONVENTION = ("TFLOP/s per GPU and HFU count hardware FLOPs (the recomputed forwards included); MFU counts model "
                    "FLOPs, 3 forwards' worth without recompute (PaLM's definition, what the trainer logs as mfu)")


def recompute_label(model: ModelConfig) -> str:
    """'full', 'selective, first 2 blocks of each stage', 'none'."""
    if model.recompute == "none" or model.recompute_num_layers is None:
        return model.recompute
    return f"{model.recompute}, first {model.recompute_num_layers} blocks of each stage"


def format_header(config: RunConfig, hardware: Hardware, assumptions: Assumptions, parameters: ParameterCounts
                  ) -> str:
    model, layout = config.model, deepspeed_layout(config)
    tp = config.parallelism.tensor_parallel_size
    prose = [
        f"{config.source}: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
        f"seq {model.seq_length}, vocab {model.padded_vocab_size(tp):,} (padded); {model.precision}, recompute "
        f"{recompute_label(model)}; TP {tp} x PP {config.parallelism.pipeline_parallel_size}, sequence parallelism "
        f"{'on' if config.parallelism.sequence_parallel else 'off'}, micro-batch {config.micro_batch_size}, pipeline "
        f"schedule {SCHEDULE_LABELS[config.parallelism.pipeline_schedule]}"
        + (" (rank r holds stages r and 2 PP - 1 - r)" if config.parallelism.pipeline_schedule == "dualpipev" else ""),
        f"DeepSpeed: {layout.optimizer} (ZeRO-1), DP gradient reduction in {8 * layout.communication_bytes}-bit, "
        f"pipe_partitioned {layout.pipe_partitioned}",
        f"GPU {hardware.name}: {hardware.peak_tflops:g} TFLOP/s, {hardware.memory_gib:g} GiB, HBM "
        f"{hardware.hbm_gbytes_per_s:g} GB/s, NVLink {hardware.nvlink_gbytes_per_s:g} GB/s, InfiniBand "
        f"{hardware.ib_gbits_per_s:g} Gb/s per GPU, {hardware.gpus_per_node} per node",
        f"assumed: matmul efficiency {assumptions.matmul_efficiency:g}, link efficiency "
        f"{assumptions.comm_efficiency:g}, HBM efficiency {assumptions.hbm_efficiency:g}, framework allowance "
        f"{assumptions.framework_gib:g} GiB, attention scores {assumptions.attention_scores} "
        f"({'Korthikanti et al.' if assumptions.attention_scores_stored else 'fused SDPA kernel'})",
        FLOPS_CONVENTION,
    ]
    # a Mixture-of-Experts model is counted from its config at the run's EP (planner/experts.py): a GPU's parameters
    # and, of them, its experts
    experts = model.moe is not None
    columns = ("one EP rank", "its experts") if experts else ("meta device", "analytic")
    lines = [_wrap(line) for line in prose] + [
        "",
        f"{'parameters per TP rank':<24} {'layers':<54} {columns[0]:>15} {columns[1]:>15}",
    ]
    for first, last, c in _stage_runs(parameters.stages):
        name = f"stage {first}" if first == last else f"stages {first}-{last}"
        second = c.expert_parameters_per_tp_rank if experts else c.analytic_per_tp_rank
        lines.append(f"  {name:<22} {_layer_names(c.layers):<54} {c.parameters_per_tp_rank:>15,} {second:>15,}")
    if experts:
        lines += [_wrap(line, "  ") for line in format_experts_header(config)]
        return "\n".join(lines + ["", format_compute_optimal(compute_optimal(config, parameters))])
    same = "equal" if parameters.total == parameters.analytic_total else "DIFFERENT"
    lines.append(f"  total, tied embedding once: {parameters.total:,} from the modules, {parameters.analytic_total:,} "
                 f"analytic ({same})")
    return "\n".join(lines + ["", format_compute_optimal(compute_optimal(config, parameters))])


def format_experts_header(config: RunConfig) -> list[str]:
    """A Mixture-of-Experts model's experts, its EP, and its total and active parameters."""
    model, ep = config.model, config.parallelism.expert_parallel_size
    moe, tp = model.moe, config.parallelism.tensor_parallel_size
    sparse = sum(moe.is_sparse(n) for n in range(1, model.num_layers + 1))
    total, active = analytic_total_parameters(model, tp), analytic_active_parameters(model, tp)
    shared = f", a shared expert of ffn {moe.shared_expert_ffn_hidden_size:,}" if moe.shared_expert_ffn_hidden_size \
        else ""
    capacity = "dropless" if moe.capacity_factor is None else f"capacity factor {moe.capacity_factor:g}"
    return [
        f"experts: {sparse} of {model.num_layers} blocks sparse, {moe.num_experts} experts of ffn "
        f"{moe.moe_ffn_hidden_size:,}, top {moe.top_k}{shared}, {capacity}, router {moe.router}; EP {ep}: "
        f"{moe.num_experts // ep} expert{'s' if moe.num_experts // ep > 1 else ''} per GPU in each sparse block "
        f"(counted from the config at this EP: a GPU "
        f"holds only its own experts)",
        f"parameters: {total:,} total ({_count(total)}, every expert once, the vocabulary padded for TP {tp}), "
        f"{active:,} active per token ({_count(active)}, {active / total:.1%}); FLOPs, TFLOP/s and MFU count the "
        f"active parameters (model/flops.py, as Megatron-LM does)",
        *_mtp_header(model),
    ]


def _mtp_header(model: ModelConfig) -> list[str]:
    """model.mtp's module, beside the counts above that leave it out (as transformers' do)."""
    if model.mtp is None:
        return []
    numbers = [model.num_layers + k for k in range(1, model.mtp.depth + 1)]
    sparse = sum(model.moe is not None and model.moe.is_sparse(n) for n in numbers)
    return [f"multi-token prediction (model.mtp, depth {model.mtp.depth}): {mtp_parameters(model):,} more parameters "
            f"({_count(mtp_parameters(model))}) on the last stage, block{'s' if len(numbers) > 1 else ''} "
            f"{', '.join(map(str, numbers))}{' sparse' if sparse else ''}; its memory, time and FLOPs counted"]


def _count(number: float) -> str:
    """529.6e9 -> '529.6B', 3.7106e12 -> '3.711T': counts of parameters and tokens as people say them."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if number >= scale:
            return f"{number / scale:.4g}{suffix}"
    return f"{number:,.0f}"


def format_compute_optimal(optimal: ComputeOptimal) -> str:
    law = optimal.law
    rows = (("this run", optimal.run),
            ("Hoffmann et al. 2022, approach-3 fit", optimal.chinchilla),
            ("rule of thumb: 20 tokens per parameter", optimal.twenty_tokens_per_parameter))
    lines = [f"tokens per parameter, and the compute-optimal size for the run's C = 6 N D = {optimal.flops:.3g} FLOPs",
             f"  {'':<44} {'parameters N':>14} {'tokens D':>12} {'tokens per parameter':>22}"]
    lines += [f"  {name:<44} {_count(row.parameters):>14} {_count(row.tokens):>12} {row.tokens_per_parameter:>22.3g}"
              for name, row in rows]
    lines += [f"  the fit: L(N, D) = {law.E:g} + {law.A:g} / N^{law.alpha:g} + {law.B:g} / D^{law.beta:g}, minimised "
              f"along 6 N D = C", "  the rule: D = 20 N, so C = 120 N^2 and N = sqrt(C / 120)"]
    return "\n".join(lines)


def _memory_columns(plan: Plan) -> list[StageMemory]:
    """First, a middle and the last stage (the others repeat the middle one), and the peak if it is none of them."""
    stages = plan.memory
    picked = [stages[0]] + ([stages[len(stages) // 2]] if len(stages) > 2 else []) + \
        ([stages[-1]] if len(stages) > 1 else [])
    worst = plan.peak_memory()
    return picked if worst in picked else picked + [worst]


MEMORY_ROWS = (
    ("weights", "weights"), ("gradients (.grad)", "gradients"),
    ("fp32 gradient accumulation", "gradient_accumulation"), ("fp32 gradient partition", "gradient_partition"),
    ("fp32 master weights / DP", "master_weights"), ("Adam m + v (Muon's matrices: momentum) / DP", "adam_states"),
    ("activations per micro-batch", "activations_per_micro_batch"),
    ("activations working set (recompute, head)", "activations_working_set"),
    ("activations, all held + working set", "activations"),
    ("  ..., if recompute none", "activations_none"),
    ("  ..., if recompute selective", "activations_selective"),
    ("  ..., if recompute full", "activations_full"),
    ("pipeline p2p buffers", "pipeline_buffers"), ("DP reduce buffer", "reduce_buffer"),
    ("Muon's step buffers (after the activations)", "optimizer_workspace"),
    ("framework allowance", "framework_allowance"), ("peak", "total"), ("margin", "margin"),
)


def format_memory(plan: Plan) -> str:
    columns = _memory_columns(plan)
    dualpipev = plan.schedule == "dualpipev"
    unit, held = ("rank ", "micro-batches held, both stages") if dualpipev else ("stage ", "micro-batches held (1F1B)")
    lines = [f"  {'memory per GPU, GiB':<48}" + "".join(f"{unit + str(m.stage):>11}" for m in columns)]
    lines.append(f"  {held:<48}" + "".join(f"{m.micro_batches_held:>11}" for m in columns))
    for label, name in MEMORY_ROWS:
        if not any(getattr(m, name) for m in columns):
            continue  # a part this optimizer does not have
        if name == "reduce_buffer":
            label = ("ZeRO reduce bucket (with the activations)" if columns[0].reduce_buffer_in_backward
                     else "DP reduce buffer (after the backward)")
        lines.append(f"  {label:<48}" + "".join(f"{_gib(getattr(m, name)):>11}" for m in columns))
    worst = plan.peak_memory()
    verdict = "fits" if worst.fits else "DOES NOT FIT"
    lines.append(_wrap(f"verdict: {verdict}: the peak stage ({worst.stage}) uses {_gib(worst.total)} of "
                       f"{_gib(worst.capacity)} GiB, margin {_gib(worst.margin)} GiB", "  "))
    return "\n".join(lines)


TIME_ROWS = ("compute", "tensor_parallel", "pipeline_p2p", "gradient_accumulation", "bubble",
             "tied_embedding_reduce", "sequence_parallel_reduce", "data_parallel_reduce", "optimizer_step",
             "zero_allgather")


def format_time(plan: Plan) -> str:
    columns = [plan.first_batch, plan.full_batch] if plan.first_batch.global_batch != plan.full_batch.global_batch \
        else [plan.full_batch]
    lines = [f"  {'iteration, seconds (share)':<30}" + "".join(f"{f'batch {t.global_batch}':>20}" for t in columns),
             f"  {'micro-batches per pipeline':<30}" + "".join(f"{t.micro_batches:>20}" for t in columns),
             f"  {'pipeline schedule':<30}" + "".join(f"{SCHEDULE_LABELS[t.schedule]:>20}"
                                                      for t in columns),
             f"  {'bubble / compute':<30}" + "".join(f"{t.bubble_fraction:>20.3f}" for t in columns)]
    experts = plan.experts is not None
    ulysses = plan.context_parallel_size > 1
    for name in TIME_ROWS + (("expert_all_to_all",) if experts else ()) + (("context_all_to_all",) if ulysses else ()):
        lines.append(f"  {name.replace('_', ' '):<30}" + "".join(
            f"{getattr(t, name):>11.3f} ({getattr(t, name) / t.seconds:>5.1%})" for t in columns))
    lines.append(f"  {'total':<30}" + "".join(f"{t.seconds:>20.3f}" for t in columns))
    lines.append(f"  {'TFLOP/s per GPU (HFU)':<30}" + "".join(
        f"{t.tflops_per_gpu:>11.1f} ({t.hfu:>5.1%})" for t in columns))
    mfu = "MFU (active FLOPs)" if experts else "MFU (model FLOPs)"
    lines.append(f"  {mfu:<30}" + "".join(f"{t.mfu:>20.1%}" for t in columns))
    slot = plan.full_batch.micro_batch
    all_to_all = f", all-to-all {slot.expert_all_to_all * 1e3:.1f}" if experts else ""
    all_to_all += f", Ulysses all-to-all {slot.context_all_to_all * 1e3:.1f}" if ulysses else ""
    lines.append(f"  slowest {'rank' if plan.schedule == 'dualpipev' else 'stage'} {slot.stage}: "
                 f"{slot.total * 1e3:.1f} ms per micro-batch slot (compute "
                 f"{slot.compute * 1e3:.1f}, TP {slot.tensor_parallel * 1e3:.1f}, p2p {slot.pipeline_p2p * 1e3:.1f}, "
                 f"fp32 accumulation {slot.gradient_accumulation * 1e3:.1f}{all_to_all})")
    return "\n".join(lines)


def format_experts(plan: Plan) -> str:
    """A Mixture-of-Experts plan's expert figures (planner/experts.py)."""
    x = plan.experts
    link = "InfiniBand: an EP group spans nodes" if x.all_to_all_spans_nodes else "NVLink: every EP group in a node"
    return _wrap(
        f"experts: EP {x.expert_parallel_size}, {x.experts_per_gpu} of {x.num_experts} experts per GPU in each of the "
        f"{x.sparse_blocks} sparse blocks (top {x.top_k}); {x.expert_parameters_per_gpu:,} expert parameters on a GPU "
        f"of the peak stage, their optimizer states sharded over {x.expert_data_parallel_size} expert-data-parallel "
        f"ranks (DP / EP); all-to-all {x.all_to_all_bytes / 2**20:.1f} MiB per GPU per dispatch or combine, "
        f"{x.all_to_all_seconds:.3f} s per iteration ({x.all_to_all_share:.1%}) over {link}; parameters "
        f"{_count(x.active_parameters)} active of {_count(x.total_parameters)} total; MFU on active FLOPs "
        f"{x.mfu_active:.1%}", "  ")


def format_plan(plan: Plan) -> str:
    d = plan.data_parallel_size
    head = f"== {plan.nodes} nodes: {plan.gpus} GPUs = TP {plan.tensor_parallel_size} x PP " \
           f"{plan.pipeline_parallel_size} x DP {d if d is not None else '?'}" \
           + (f" x CP {plan.context_parallel_size}" if plan.context_parallel_size > 1 else "") + " =="
    lines = [head] + [_wrap(f"warning: {w}", "  ") for w in plan.warnings] + \
        [_wrap(f"ERROR: {e}", "  ") for e in plan.errors]
    if plan.memory:
        lines.append(format_memory(plan))
    if plan.full_batch is not None:
        f = plan.flops
        lines.append(_wrap(f"FLOPs per iteration (hardware, recompute counted / model): batch {plan.first_batch.global_batch}: {f['first_batch']:.4g} / "
                           f"{f['first_batch_model']:.4g}; batch {plan.full_batch.global_batch}: "
                           f"{f['full_batch']:.4g} / {f['full_batch_model']:.4g}", "  "))
        lines.append(format_time(plan))
        if plan.experts is not None:
            lines.append(format_experts(plan))
        lines.append(format_training(plan))
    if plan.checkpoint is not None:
        lines.append(format_checkpoint(plan.checkpoint))
    if plan.measured:
        lines.append(format_measured(plan.measured))
    return "\n".join(lines)


def format_checkpoint(cost: CheckpointCost) -> str:
    every = f"every {cost.save_interval} iterations" if cost.save_interval else "(no save_interval)"
    return _wrap(f"checkpoint: {cost.bytes_per_run / 1e12:.3g} TB per run, {cost.bytes_per_rank / 1e9:.3g} GB from the "
                 f"busiest rank ({cost.bytes_per_node / 1e9:.3g} GB from its node); written in "
                 f"{cost.write_seconds:.1f} s. Saved {every}: sync stops training {cost.write_seconds:.1f} s a save "
                 f"({cost.lost_share_sync:.2%} of the run), async {cost.async_stall_seconds:.2f} s "
                 f"({cost.lost_share_async:.3%}), holding {cost.async_host_bytes_per_rank / 1e9:.3g} GB of host memory "
                 f"per rank (its snapshot buffers, allocated before the first step and reused)", "  ")


def format_training(plan: Plan) -> str:
    t, r = plan.training, plan.ramp
    extra = t.ramp_seconds - t.ramp_seconds_at_full_batch_rate
    ramp = f"ramp {r['start']} -> {r['end']} by {r['increment']}" + (" (suggested)" if r["suggested"] else "")
    lines = [_wrap(f"training {t.tokens:.4g} tokens: {t.steps:,.0f} steps, {t.seconds / 86400:.2f} days; {ramp}: "
                   f"{t.ramp_tokens:.3g} tokens in {t.ramp_steps:,.0f} steps, {t.ramp_seconds / 3600:.1f} h "
                   f"({extra / 3600:.1f} h more than at the full batch's rate)", "  "),
             format_gpu_hours(plan)]
    return "\n".join(lines)


def format_gpu_hours(plan: Plan) -> str:
    """GPU-hours per trillion tokens and for the whole training, and a published run's beside them."""
    line = (f"GPU-hours: {plan.gpu_hours_per_trillion_tokens / 1e3:,.1f}K per trillion tokens, "
            f"{plan.gpu_hours / 1e6:,.3f}M for the {_count(plan.training.tokens)} tokens ({plan.gpus:,} GPUs)")
    run = plan.published
    if run is not None:
        ratio = plan.gpu_hours_per_trillion_tokens / run.gpu_hours_per_trillion_tokens
        line += (f"; {run.source}: {run.gpu_hours_per_trillion_tokens / 1e3:,.0f}K per trillion tokens, "
                 f"{run.gpu_hours / 1e6:,.3f}M for {_count(run.tokens)} on {run.gpus}, an MFU of "
                 f"{plan.published_mfu:.1%} at this plan's model FLOPs per token and peak ({ratio:.2f} x: the "
                 f"planner times this trainer, nothing overlapped; the run had {run.differences})")
    return _wrap(line, "  ")


def format_measured(measured: dict[str, float]) -> str:
    line = (f"measured {measured['iteration_seconds']:g} s per iteration: {measured['tflops_per_gpu']:.1f} TFLOP/s "
            f"per GPU, HFU {measured['hfu']:.1%}; model FLOPs {measured['model_tflops_per_gpu']:.1f} TFLOP/s per GPU, "
            f"MFU {measured['mfu']:.1%}")
    if "predicted_over_measured" in measured:
        line += f"; predicted / measured time {measured['predicted_over_measured']:.3f}"
    return _wrap(line, "  ")


def format_comparison(plans: list[Plan]) -> str:
    """One line per node count: the figures to compare cluster sizes by."""
    lines = [f"{'nodes':>6} {'GPUs':>6} {'DP':>4} {'m':>5} {'bubble':>7} {'iter s':>8} {'TFLOP/s':>8} {'HFU':>6} "
             f"{'MFU':>6} {'days':>6} {'ramp h':>7} {'peak GiB':>9} {'margin':>7}"]
    for p in plans:
        if not p.ok:
            lines.append(_wrap(f"{p.nodes:>6} {p.gpus:>6}  impossible: {p.errors[0]}", ""))
            continue
        t, w = p.full_batch, p.peak_memory()
        lines.append(f"{p.nodes:>6} {p.gpus:>6} {p.data_parallel_size:>4} {t.micro_batches:>5} "
                     f"{t.bubble_fraction:>7.3f} {t.seconds:>8.2f} {t.tflops_per_gpu:>8.1f} {t.hfu:>6.1%} {t.mfu:>6.1%} "
                     f"{p.training.seconds / 86400:>6.2f} {p.training.ramp_seconds / 3600:>7.1f} "
                     f"{w.total / GIB:>9.2f} {w.margin / GIB:>7.2f}")
    return "\n".join(lines)


def _layout_row(rank: int | str, result: LayoutResult, experts: bool = False, ulysses: bool = False) -> str:
    """One ranked layout; ``experts`` (a Mixture-of-Experts model) adds EP and the all-to-all's share, ``ulysses``
    (some layout at CP > 1) CP and the share of its all-to-alls."""
    layout, t = result.layout, result.full_batch
    layers = "-" if layout.recompute == "none" else layout.recompute_num_layers or "all"
    ep = f" {layout.expert_parallel_size:>3}" if experts else ""
    ep += f" {layout.context_parallel_size:>3}" if ulysses else ""
    share = f" {t.expert_all_to_all / t.seconds:>6.1%}" if experts else ""
    share += f" {t.context_all_to_all / t.seconds:>6.1%}" if ulysses else ""
    return (f"{rank:>4} {layout.tensor_parallel_size:>3} {layout.pipeline_parallel_size:>4} "
            f"{layout.data_parallel_size:>5}{ep} {layout.micro_batch_size:>6} "
            f"{'on' if layout.sequence_parallel else 'off':>4} "
            f"{layout.recompute:>10} {layers!s:>9} {SCHEDULE_LABELS[layout.pipeline_schedule]:>10} "
            f"{result.peak_memory_bytes / GIB:>9.2f} {t.seconds:>8.2f} "
            f"{t.tflops_per_gpu:>8.1f} {t.mfu:>6.1%}{share}")


def describe_layout(result: LayoutResult, experts: bool = False) -> str:
    layout, t = result.layout, result.full_batch
    blocks = "all" if layout.recompute_num_layers is None else str(layout.recompute_num_layers)
    recompute = layout.recompute if layout.recompute == "none" else f"{layout.recompute} on {blocks} blocks per stage"
    ep = f" (EP {layout.expert_parallel_size})" if experts else ""
    ep += f" x CP {layout.context_parallel_size}" if layout.context_parallel_size > 1 else ""
    all_to_all = f", all-to-all {t.expert_all_to_all / t.seconds:.1%} of it" if experts else ""
    if layout.context_parallel_size > 1:
        all_to_all += f", Ulysses all-to-all {t.context_all_to_all / t.seconds:.1%} of it"
    mfu = "MFU on active FLOPs" if experts else "MFU"
    return (f"TP {layout.tensor_parallel_size} x PP {layout.pipeline_parallel_size} x DP {layout.data_parallel_size}"
            f"{ep}, micro-batch {layout.micro_batch_size}, sequence parallelism "
            f"{'on' if layout.sequence_parallel else 'off'}, recompute {recompute}, "
            f"{SCHEDULE_LABELS[layout.pipeline_schedule]}: {t.seconds:.2f} s per iteration{all_to_all}, "
            f"{result.peak_memory_bytes / GIB:.2f} GiB peak, {mfu} {t.mfu:.1%}")


def layout_settings(layout: Layout, experts: bool = False) -> str:
    """The --set options that give a run config this layout."""
    settings = {"parallelism.tensor_parallel_size": layout.tensor_parallel_size,
                "parallelism.pipeline_parallel_size": layout.pipeline_parallel_size,
                "train_micro_batch_size_per_gpu": layout.micro_batch_size,
                "parallelism.sequence_parallel": layout.sequence_parallel, "model.recompute": layout.recompute,
                "parallelism.pipeline_schedule": layout.pipeline_schedule}
    if layout.recompute_num_layers is not None:
        settings["model.recompute_num_layers"] = layout.recompute_num_layers
    if experts:
        settings["parallelism.expert_parallel_size"] = layout.expert_parallel_size
    if layout.context_parallel_size > 1:
        settings["parallelism.context_parallel_size"] = layout.context_parallel_size
    return " ".join(set_option(path, value) for path, value in settings.items())


def format_search(config: RunConfig, nodes: int, hardware: Hardware, tried: int, results: list[LayoutResult],
                  top: int) -> str:
    gpus = nodes * hardware.gpus_per_node
    lines = [_wrap(f"{config.source} at {nodes} nodes ({gpus} GPUs, {hardware.name}): {tried} layouts tried, "
                   f"{len(results)} fit in {hardware.memory_gib:g} GiB; ranked by the predicted full-batch "
                   f"(batch {config.global_batch_size}) iteration time. {FLOPS_CONVENTION}"), ""]
    if not results:
        return "\n".join(lines + ["no layout fits"])
    experts = config.model.moe is not None  # EP and the all-to-all's share of the iteration as columns
    ulysses = any(r.layout.context_parallel_size > 1 for r in results[:top])  # CP and its all-to-alls' share
    lines.append(f"{'rank':>4} {'TP':>3} {'PP':>4} {'DP':>5}" + (f" {'EP':>3}" if experts else "")
                 + (f" {'CP':>3}" if ulysses else "")
                 + f" {'micro':>6} {'SP':>4} {'recompute':>10} {'n layers':>9} {'schedule':>10} {'peak GiB':>9} "
                 f"{'iter s':>8} {'TFLOP/s':>8} {'MFU':>6}" + (f" {'a2a':>6}" if experts else "")
                 + (f" {'cp a2a':>6}" if ulysses else ""))
    lines += [_layout_row(rank, r, experts, ulysses) for rank, r in enumerate(results[:top], start=1)]
    lines += ["", _wrap(f"best: {describe_layout(results[0], experts)}. As settings: "
                        f"{layout_settings(results[0].layout, experts)}")]
    return "\n".join(lines)
