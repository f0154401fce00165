"""Plan a TP x PP x DP run before booking the cluster: does it fit in memory, how fast will it run, where the time goes.

    python tools/plan.py --ds_config ds_configs/530b.json --nodes 280,350,420,560 --gpu a100-80gb

One module per concern, each with its own formulas in its docstring (the whole derivation: docs/planning.md):

    module      what                                                       reads
    hardware    GPU presets, the stated assumptions, what DeepSpeed         the run config's DeepSpeed keys
                allocates for the config (BF16_Optimizer or ZeRO-1)
    memory      parameters per stage (meta device) and the bytes of one     hardware, model/summary.py
                stage: weights, gradients, optimizer states, activations
    timing      one iteration: compute, TP and p2p communication, bubble,   hardware, memory, model/flops.py
                the DP reduction, the optimizer step
    experts     Mixture-of-Experts models (model.moe): a rank's experts at   hardware, model/summary.py
                EP, their ZeRO shard over DP / EP, the dispatch all-to-all
    ramp        the batch ramp's sizes against DP, the whole training time   runconfig/schedules.py
    scaling     tokens per parameter, the compute-optimal size (Chinchilla)  memory
    checkpointing  a checkpoint's size, its write at a storage bandwidth,  memory
                the share of the run a save stops it, sync and async
    pipeline_schedule  the bubble by replaying each rank's DeepSpeed      deepspeed.runtime.pipe.schedule
                instruction stream (1F1B, DualPipeV) with F and B costs
    published   published runs (DeepSeek-V3's GPU-hours) and the shapes    model/presets.py
                they match
    plan        one cluster size: errors, warnings, memory, time,          all of the above
                GPU-hours (beside a published run's)
    search      every layout of one cluster size, ranked                    hardware, memory, timing
    report      the text tables and the --json documents (schema_version)   plan, search, scaling

The planner reads the run configuration (runconfig/, a layer below it) and nothing of training/; the training loop
plans its own layout once, at start-up, to log measured against planned (training/plan_check.py).
"""

from planner.checkpointing import Storage
from planner.hardware import ATTENTION_SCORES, GPU_PRESETS, Assumptions, Hardware
from planner.memory import count_parameters
from planner.pipeline_schedule import ScheduleSimulation, simulate
from planner.plan import Plan, check_run_layout, plan_cluster
from planner.report import (
    SCHEMA_VERSION,
    format_comparison,
    format_header,
    format_plan,
    format_search,
    report_to_dict,
    search_to_dict,
)
from planner.search import search_layouts

__all__ = ["ATTENTION_SCORES", "GPU_PRESETS", "SCHEMA_VERSION", "Assumptions", "Hardware", "Plan", "Storage",
           "check_run_layout", "count_parameters",
           "format_comparison", "format_header", "format_plan", "format_search", "plan_cluster", "report_to_dict",
           "search_layouts", "search_to_dict", "ScheduleSimulation", "simulate"]
