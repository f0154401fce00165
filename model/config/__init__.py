"""Model and parallelism configuration: typed, validated, and free of heavy imports (no torch, no DeepSpeed), so
that tools and the planner read configs cheaply. Every derived value (padded vocabulary, FFN size, init std,
data-parallel size) is computed in one place; every invalid combination raises ``ValueError`` naming the field and
the fix, before any process group or tensor exists.

    module                      holds
    model/config/model.py       ModelConfig (``model``): the shape, the block's pieces, precision, recompute; its
                                derived sizes; preset() and the renamed fields of earlier versions
    model/config/attention.py   the attention's fields: which attention (multi-head or latent: MLA's ranks and head
                                widths), heads, key/value groups, head_dim, the document-mask kernel, q/k norms
    model/config/positions.py   learned positions or RoPE: rope_theta, rope_scaling (llama3, YaRN)
    model/config/moe.py         MoEConfig (``model.moe``) and the expert-parallel checks
    model/config/mtp.py         MTPConfig (``model.mtp``): multi-token prediction's depth and loss weight
    model/config/parallel.py    ParallelConfig (``parallelism``), the pipeline schedules, the model against a layout
    model/config/checks.py      require(), set_option(): how every check names the field and the fix

A new architecture adds its fields' checks beside the others (or a block of its own, as ``model.moe``), and its
names here.
"""

from common.dtypes import PRECISIONS
from model.config.attention import ATTENTION_BACKENDS, ATTENTION_TYPES
from model.config.checks import set_option
from model.config.model import (
    ACTIVATIONS,
    BIASES,
    GPT2_VOCAB_SIZE,
    MLPS,
    NORMS,
    RECOMPUTE,
    ModelConfig,
    preset,
    upgrade_model_fields,
)
from model.config.moe import ROUTERS, MoEConfig, check_expert_parallel
from model.config.mtp import MTPConfig
from model.config.parallel import PIPELINE_SCHEDULES, ParallelConfig, stages_per_rank
from model.config.positions import (
    LLAMA3_SCALING_KEYS,
    POSITION_EMBEDDINGS,
    ROPE_SCALING_TYPES,
    SCALING_KEYS,
    YARN_OPTIONAL_KEYS,
)
from model.presets import PRESETS

__all__ = ["ACTIVATIONS", "ATTENTION_BACKENDS", "ATTENTION_TYPES", "BIASES", "GPT2_VOCAB_SIZE",
           "LLAMA3_SCALING_KEYS", "MLPS", "NORMS", "PIPELINE_SCHEDULES", "POSITION_EMBEDDINGS", "PRECISIONS", "PRESETS",
           "RECOMPUTE", "ROPE_SCALING_TYPES", "ROUTERS", "SCALING_KEYS", "YARN_OPTIONAL_KEYS", "ModelConfig",
           "MoEConfig", "MTPConfig", "ParallelConfig", "check_expert_parallel", "preset", "set_option", "stages_per_rank",
           "upgrade_model_fields"]
