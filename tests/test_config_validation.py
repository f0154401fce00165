"""Every invalid run configuration we can name is refused before any process group or model exists,
with a message that names the field and says what to do."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from runconfig.run import parse_run_config

ROOT = Path(__file__).resolve().parents[1]
BASE = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())  # TP 2 x PP 2, micro 4, batch 8 -> 32 by 8


def changed(path: str, value, base: dict | None = None) -> dict:
    """A copy of the base config with one dotted field set (value DELETE removes it)."""
    raw = copy.deepcopy(base or BASE)
    node = raw
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    if value is DELETE:
        node.pop(leaf)
    else:
        node[leaf] = value
    return raw


DELETE = object()
WORLD = 4  # TP 2 x PP 2 x DP 1

CASES = [
    # parallel sizes
    ("parallelism.tensor_parallel_size", 3, WORLD, "model.num_attention_heads (4) is not divisible by parallelism.tensor_parallel_size (3)"),
    ("parallelism.tensor_parallel_size", 0, WORLD, "parallelism.tensor_parallel_size must be a positive integer"),
    ("parallelism.pipeline_parallel_size", 3, WORLD, "model.num_layers (4) cannot be split evenly over parallelism.pipeline_parallel_size (3)"),
    ("parallelism.pipeline_parallel_size", -1, WORLD, "parallelism.pipeline_parallel_size must be a positive integer"),
    ("parallelism.tensor_parallel_size", 2, 6, "world size 6 is not divisible by tensor_parallel_size (2) x pipeline_parallel_size (2) = 4"),
    ("parallelism.partitions", 2, WORLD, "unknown key(s) ['partitions'] in block \"parallelism\""),
    ("parallelism.pipeline_schedule", "interleaved", WORLD, "parallelism.pipeline_schedule must be one of \"1f1b\", \"dualpipev\", got 'interleaved'"),
    # batch sizes and the ramp
    ("train_micro_batch_size_per_gpu", 3, WORLD, "global batch sizes of the ramp are not multiples of micro-batch x data-parallel size = 3 x 1 = 3: 8, 16, 32"),
    ("train_micro_batch_size_per_gpu", 4, 12, "global batch sizes of the ramp are not multiples of micro-batch x data-parallel size = 4 x 3 = 12: 8, 16, 32"),
    ("train_batch_size", 0, WORLD, "\"train_batch_size\" must be a positive integer"),
    ("train_micro_batch_size_per_gpu", DELETE, WORLD, "\"train_micro_batch_size_per_gpu\" must be a positive integer"),
    ("schedule.batch.start", 64, WORLD, "schedule.batch.start (64) is larger than the full batch train_batch_size (32)"),
    ("schedule.batch.increment", 5, WORLD, "is not a whole number of schedule.batch.increment (5) steps"),
    ("schedule.batch.increment", 0, WORLD, "schedule.batch.increment must be a positive integer"),
    ("schedule.batch.ramp_tokens", -5, WORLD, "schedule.batch.ramp_tokens must be >= 0"),
    ("schedule.batch.type", "exponential", WORLD, "schedule.batch.type 'exponential' is not known"),
    ("schedule.batch.end", 64, WORLD, "unknown key(s) ['end'] in schedule.batch of type 'ramp'"),
    ("gradient_accumulation_steps", 4, WORLD, "DeepSpeed key \"gradient_accumulation_steps\" is not used here"),
    # learning-rate schedule
    ("schedule.warmup_tokens", -1, WORLD, "schedule.warmup_tokens must be >= 0"),
    ("schedule.warmup_tokens", 1e9, WORLD, "schedule.warmup_tokens (1e+09) is longer than schedule.decay_tokens (225000)"),
    ("schedule.decay_tokens", 0, WORLD, "schedule.warmup_tokens (20480) is longer than schedule.decay_tokens (0)"),
    ("schedule.lr", 0, WORLD, "schedule.lr must be positive"),
    ("schedule.lr", -3e-4, WORLD, "schedule.lr must be positive"),
    ("schedule.min_lr_ratio", 1.5, WORLD, "schedule.min_lr_ratio must be in [0, 1]"),
    ("schedule.train_tokens", 0, WORLD, "schedule.train_tokens must be positive"),
    ("schedule.cooldown_tokens", 1e6, WORLD, "unknown key(s) ['cooldown_tokens'] in block \"schedule\""),
    ("scheduler", {"type": "WarmupLR"}, WORLD, "DeepSpeed key \"scheduler\" is not used here"),
    ("optimizer.params.lr", 1e-3, WORLD, "optimizer.params.lr (0.001) differs from schedule.lr (0.003)"),
    # model
    ("model.max_position_embeddings", 32, WORLD, "model.seq_length (64) is longer than model.max_position_embeddings (32)"),
    ("model.hidden_size", 66, WORLD, "model.hidden_size (66) is not divisible by model.num_attention_heads (4)"),
    ("model.num_layers", 0, WORLD, "model.num_layers must be a positive integer"),
    ("model.hidden_dropout", 1.5, WORLD, "model.hidden_dropout must be in [0, 1)"),
    ("model.attention_dropout", -0.1, WORLD, "model.attention_dropout must be in [0, 1)"),
    ("model.precision", "fp8", WORLD, "model.precision must be one of"),
    ("model.activation", "relu", WORLD, "model.activation must be one of"),
    ("model.ffn_hidden_size", 255, WORLD, "model.ffn_hidden_size (255) is not divisible by parallelism.tensor_parallel_size (2)"),
    ("model.vocab_size", 32000, WORLD, "model.vocab_size (32000) is smaller than the tokenizer's"),
    ("model.preset", "7b", WORLD, "unknown model preset '7b'"),
    ("model.num_heads", 8, WORLD, "unknown key(s) ['num_heads'] in block \"model\""),
    ("model.layernorm_epsilon", 0, WORLD, "model.layernorm_epsilon must be positive"),
    ("bf16", {"enabled": True}, WORLD, "model.precision is 'fp32' but the DeepSpeed sections enable bf16"),
    ("fp16", {"enabled": True}, WORLD, "model.precision is 'fp32' but the DeepSpeed sections enable fp16"),
    # data and training
    ("data.blend", [[0, "x"]], WORLD, "data.blend[0] must be [positive weight, \"path/prefix\"]"),
    ("data.blend", [["x", 1.0]], WORLD, "data.blend[0] must be [positive weight, \"path/prefix\"]"),
    ("data.split", "a,b", WORLD, "data.split: split 'a,b': give up to three non-negative numbers"),
    ("data.paths", ["x"], WORLD, "unknown key(s) ['paths'] in block \"data\""),
    ("training.log_interval", 0, WORLD, "training.log_interval must be positive"),
    ("training.save_interval", -1, WORLD, "training.save_interval must be >= 0"),
    ("training.save", None, WORLD, "training.save_interval is set but training.save (the checkpoint directory) is not"),
    ("training.max_consecutive_skips", 0, WORLD, "training.max_consecutive_skips must be >= 1"),
    ("training.fine_tune", True, WORLD, "training.fine_tune starts a new run on the weights of training.init_from, which is not set"),
    ("data.document_boundaries", "eos", WORLD, "data.document_boundaries must be one of ('dataset', 'eod_token'), got 'eos'"),
    ("training.loss_normalization", "sequence", WORLD, "training.loss_normalization must be \"micro_batch\" or \"tokens\", got 'sequence'"),
    ("training.spike_guard", {"enabled": True, "ratio": 1.0}, WORLD, "training.spike_guard.ratio must be > 1"),
    ("training.spike_guard", {"min_increase_nats": -0.1}, WORLD, "training.spike_guard.min_increase_nats must be >= 0"),
    # the window rule's keys (run configs from before it was replaced): the error names the replacements
    ("training.spike_guard", {"enabled": True, "window": 32}, WORLD, "training.spike_guard.window: the window rule is gone; a spike is now a step loss above max(ratio x EWM, EWM + min_increase_nats)"),
    ("training.spike_guard", {"threshold_std": 5.0, "min_increase": 0.1}, WORLD, "Remove threshold_std, min_increase and set ratio (default 1.2) and min_increase_nats (default 0.3)"),
    ("training.spike_guard", {"enabled": True, "typo": 1}, WORLD, "unknown key(s) ['typo'] in block \"training.spike_guard\""),
    ("training.spike_guard", {"enabled": True, "max_rollbacks": 0}, WORLD, "training.spike_guard.max_rollbacks must be >= 1"),
    ("training.checkpoint_dir", "x", WORLD, "unknown key(s) ['checkpoint_dir'] in block \"training\""),
    # types: what --set reads (JSON, else a string) against each field's type
    ("training.save_interval", "abc", WORLD, "training.save_interval = \"abc\" is a string: expected an integer"),
    ("training.save_interval", 1e3, WORLD, "training.save_interval = 1000.0 is a decimal number: expected an integer"),
    ("training.save", 3, WORLD, "training.save = 3 is an integer: expected a string or null (quote it"),
    ("training.spike_guard", {"enabled": 1}, WORLD, "training.spike_guard.enabled = 1 is an integer: expected true or false"),
    ("training.spike_guard", [1], WORLD, "training.spike_guard = [1] is a list: expected an object"),
    ("schedule.lr", True, WORLD, "schedule.lr = true is a boolean: expected a number"),
    ("schedule.warmup_tokens", "1e6x", WORLD, "schedule.warmup_tokens = \"1e6x\" is a string: expected a number"),
    ("model.hidden_dropout", "0.1", WORLD, "model.hidden_dropout = \"0.1\" is a string: expected a number"),
    ("model.recompute", True, WORLD, "model.recompute = true is a boolean: expected a string"),
    ("parallelism.sequence_parallel", "yes", WORLD, "parallelism.sequence_parallel = \"yes\" is a string: expected true or false"),
    ("model.preset", 3, WORLD, "model.preset = 3: expected a string"),
    ("parallelism.tensor_parallel_size", 2.0, WORLD, "parallelism.tensor_parallel_size = 2.0 is a decimal number: expected an integer"),
    ("data.blend", "x", WORLD, "data.blend = \"x\" is a string: expected a list"),
    ("data.cache_dir", False, WORLD, "data.cache_dir = false is a boolean: expected a string or null"),
]


# DualPipeV: 2 PP stages of the layers, at least 2 PP micro-batches per pipeline at the full batch
DUALPIPEV = changed("parallelism.pipeline_schedule", "dualpipev")
DUALPIPEV_CASES = [
    ("parallelism.pipeline_parallel_size", 1, 2, "parallelism.pipeline_schedule \"dualpipev\" needs parallelism.pipeline_parallel_size >= 2"),
    ("model.num_layers", 3, WORLD, "model.num_layers (3) cannot be split evenly over parallelism.pipeline_parallel_size (2) ranks of DualPipeV"),
    ("model.num_layers", 2, WORLD, "model.num_layers (2) gives each of the parallelism.pipeline_parallel_size (2) ranks 1 block, and under DualPipeV a rank holds two stages, one on the way out and one on the way back: use at least 2 blocks per rank"),
    ("training.eval_tasks", ["alice_lastword"], WORLD, "training.eval_tasks runs the live stages in pipeline order (evaluation/pipeline.py), and under parallelism.pipeline_schedule \"dualpipev\" a rank holds two stages of a V"),
    ("train_micro_batch_size_per_gpu", 16, WORLD, "parallelism.pipeline_schedule \"dualpipev\" needs at least 2 x PP = 4 micro-batches per pipeline at the full batch, and train_batch_size 32 / (micro-batch 16 x DP 1) gives 2: raise train_batch_size to 64 or more"),
]


@pytest.mark.parametrize("field, value, world_size, message", DUALPIPEV_CASES,
                         ids=[f"{c[0]}={c[1]!r}" for c in DUALPIPEV_CASES])
def test_dualpipev_layout_is_refused_naming_the_field(field, value, world_size, message):
    parse_run_config(DUALPIPEV).check_world(WORLD)  # the base itself is valid
    # and so is an odd number of blocks per rank: 6 layers cut into stages of 2, 2, 1, 1 (ranks hold 3 each)
    parse_run_config({**DUALPIPEV, "model": {**DUALPIPEV["model"], "num_layers": 6}}).check_world(WORLD)
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_run_config(changed(field, value, DUALPIPEV)).check_world(world_size)


# Mixture-of-Experts: llama-tiny (SwiGLU) with 8 experts, TP 2 x PP 2; the bad input first, each one line
MOE_EXPERTS = {"num_experts": 8, "top_k": 2, "moe_ffn_hidden_size": 64}
MOE = changed("model.moe", MOE_EXPERTS, changed("model.preset", "llama-tiny"))
MOE_CASES = [
    ("parallelism.expert_parallel_size", 3, 12, "parallelism.expert_parallel_size (3) does not divide model.moe.num_experts (8): choose one of [1, 2, 4, 8]"),
    ("parallelism.expert_parallel_size", 2, 12, "parallelism.expert_parallel_size (2) does not divide the data-parallel size (3, world / (TP x PP)): the EP groups are made of data-parallel ranks; choose one of [1, 3], or launch a world whose data-parallel size it divides"),
    ("model.moe.top_k", 9, WORLD, "model.moe.top_k (9) is larger than model.moe.num_experts (8): route each token to at most num_experts experts"),
    ("model.moe.capacity_factor", -1.0, WORLD, "model.moe.capacity_factor must be a positive number, or null for dropless routing, got -1.0"),
    # and the rest of the block
    ("parallelism.expert_parallel_size", 0, WORLD, "parallelism.expert_parallel_size must be a positive integer, got 0"),
    ("model.mlp", "gelu", WORLD, "model.moe needs model.mlp \"swiglu\" (the experts are SwiGLU MLPs), got 'gelu': set model.mlp to \"swiglu\", or remove model.moe"),
    ("model.moe.moe_ffn_hidden_size", 63, WORLD, "model.moe.moe_ffn_hidden_size (63) is not divisible by parallelism.tensor_parallel_size (2): each TP rank holds a slice of every expert"),
    ("model.moe.experts", 8, WORLD, "unknown key(s) ['experts'] in block \"model.moe\": known keys are ['aux_loss_coeff', 'bias_update_rate', 'capacity_factor', 'first_dense_layers', 'moe_ffn_hidden_size', 'n_group', 'norm_topk_prob', 'num_experts', 'routed_scaling_factor', 'router', 'router_z_loss_coeff', 'sequence_aux_loss_coeff', 'shared_expert_ffn_hidden_size', 'shared_expert_gate', 'sparse_every', 'top_k', 'topk_group']"),
    ("model.moe.top_k", "2", WORLD, "model.moe.top_k = \"2\" is a string: expected an integer (e.g. 100)"),
    ("model.moe", {"num_experts": 8}, WORLD, "model.moe lacks ['top_k', 'moe_ffn_hidden_size']: give num_experts, top_k and moe_ffn_hidden_size"),
    ("model.moe", [8, 2], WORLD, "model.moe = [8, 2] is a list: expected an object {...} or null"),
]


@pytest.mark.parametrize("field, value, world_size, message", MOE_CASES, ids=[f"{c[0]}={c[1]!r}" for c in MOE_CASES])
def test_moe_config_is_refused_naming_the_field(field, value, world_size, message):
    with pytest.raises(ValueError) as refused:
        parse_run_config(changed(field, value, MOE)).check_world(world_size)
    assert str(refused.value).split(" (the model's shape comes from")[0] == message  # the whole line, exactly
    assert not dist.is_initialized()


def test_moe_config_is_accepted_at_every_expert_parallel_size_that_divides():
    """EP 1, 2, 4, 8 at DP 8 (32 processes at TP 2 x PP 2, micro-batch 1); EP 2 at DP 2; a partial model.moe
    refines a preset's."""
    for expert_parallel_size in (1, 2, 4, 8):
        raw = changed("train_micro_batch_size_per_gpu", 1, changed("parallelism.expert_parallel_size",
                                                                   expert_parallel_size, MOE))
        config = parse_run_config(raw)
        assert config.check_world(32) == 8 and config.model.moe.num_experts == 8
    parse_run_config(changed("parallelism.expert_parallel_size", 2, MOE)).check_world(8)
    raw = changed("model.moe", {"capacity_factor": 1.25}, changed("model.preset", "mixtral-8x7b", MOE))
    mixtral = parse_run_config(changed("data.eod_token_id", 2, raw))  # Mistral's </s>: a vocabulary of 32000
    assert (mixtral.model.moe.num_experts, mixtral.model.moe.top_k, mixtral.model.moe.capacity_factor) == (8, 2, 1.25)


def test_expert_parallelism_without_experts_is_refused():
    with pytest.raises(ValueError, match=re.escape(
            "parallelism.expert_parallel_size is 2 but model.moe is not set: expert parallelism splits the experts "
            "of a Mixture-of-Experts model; set it to 1, or give the experts in model.moe")):
        parse_run_config(changed("parallelism.expert_parallel_size", 2)).check_world(8)


@pytest.mark.parametrize(("fine_tune", "explicit", "expected"), [
    (True, None, ("tokens", "the default of training.fine_tune")),
    (False, None, ("micro_batch", "the default without training.fine_tune")),
    (True, "micro_batch", ("micro_batch", "as set")),
])
def test_fine_tuning_defaults_to_the_step_token_mean(fine_tune, explicit, expected):
    """training.fine_tune defaults training.loss_normalization to "tokens" (TRL's num_items_in_batch); an explicit value
    wins; the start-up line (training/data.py describe_layout) says which and why."""
    from training.data import describe_layout

    raw = changed("training.fine_tune", fine_tune, changed("training.init_from", "runs/pretrained"))
    if explicit is not None:
        raw["training"]["loss_normalization"] = explicit
    config = parse_run_config(raw)
    assert (config.training.loss_normalization, config.loss_normalization_origin) == expected
    over = "the step's target tokens" if expected[0] == "tokens" else "each micro-batch's target tokens"
    packing = "bfd" if fine_tune else "concat"
    assert describe_layout(config).endswith(f"loss over {over} (training.loss_normalization \"{expected[0]}\", "
                                            f"{expected[1]})")
    assert describe_layout(config).startswith(f"data: packing {packing}, ")


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("field, value, world_size, message", CASES, ids=[f"{c[0]}={c[1]!r}" for c in CASES])
def test_invalid_config_is_refused_naming_the_field(field, value, world_size, message):
    raw = changed(field, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_run_config(raw).check_world(world_size)
    assert not dist.is_initialized()  # refused before any process group (or model) exists


def test_the_shipped_configs_are_valid():
    """Each at the cluster sizes it is meant for: 530B at DP 8 and 16, the GPT-3 shapes on 1 to 8 GPUs."""
    data_parallel_sizes = {"530b": (8, 16), "125m": (1, 2, 4, 8), "1.3b": (1, 2, 4, 8), "tiny-cpu": (1, 2),
                           "llama-tiny-cpu": (1, 2)}
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        config = parse_run_config(json.loads(path.read_text()), source=str(path))
        for data_parallel_size in data_parallel_sizes[path.stem]:
            config.check_world(config.parallelism.model_parallel_size * data_parallel_size)


@pytest.mark.parametrize("override, message", [
    ("parallelism.tensor_parallel_size=3",
     "model.num_attention_heads (4) is not divisible by parallelism.tensor_parallel_size (3)"),
    ("training.save_interval=abc", "training.save_interval = \"abc\" is a string: expected an integer (e.g. 100)"),
    ("training.no_such_field=1", "unknown key(s) ['no_such_field'] in block \"training\""),
    ("parallelism.expert_parallel_size=2", "parallelism.expert_parallel_size is 2 but model.moe is not set"),
])
def test_train_py_refuses_before_starting_processes(override, message):
    result = subprocess.run([sys.executable, "train.py", "--ds_config", "ds_configs/tiny-cpu.json", "--set", override],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "deepspeed" not in result.stderr.lower()  # nothing was initialised
