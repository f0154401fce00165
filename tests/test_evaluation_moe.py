"""Evaluation and generation of a Mixture-of-Experts checkpoint no Hugging Face architecture fits, at other layouts.

The model: llama-tiny cut to 2 blocks, both sparse, 4 experts of width 32, top 2, a shared expert, and the
aux-loss-free router ``model.moe.router = "sigmoid_bias"`` (model/moe.py Router: its persistent, TP-replicated
``expert_bias`` buffer is in the layer files and has no HF tensor). Built at TP 2 x PP 2 by the trainer's engine
(training/engine.py build_engine), each router's bias set to non-zero values (random, 0.5 std: they decide the
routing, so a missed load would change the experts chosen) and saved by the trainer's save_checkpoint, fp32.

One 4-process launch writes it and loads it (evaluation/loading.py) at (TP, PP) = (2, 2) (as written), (2, 1) and
(1, 1) (DP 2 and 4), and checks:

- the full logits (TP shards gathered, padding cut) and the log-likelihoods of a few requests at (2, 1) and (1, 1)
  equal the written layout's within 1e-5 (fp32; the row-parallel layers sum TP partial products in another order);
  the measured differences are printed;
- greedy generation gives the same tokens at every layout, and tools/generate.py in one process (TP 1 x PP 1)
  the same as the launch's TP 2 x PP 2;
- every sparse layer's loaded expert_bias equals the saved one bit for bit (the file's and the values set), fp32.

And the export refuses the shape in one line naming model.moe.router and the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_evaluation import run_config

ROOT = Path(__file__).resolve().parents[1]
MOE = {"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 32, "shared_expert_ffn_hidden_size": 32,
       "router": "sigmoid_bias", "bias_update_rate": 0.01}
MODEL = {"preset": "llama-tiny", "num_layers": 2, "seq_length": 32, "moe": MOE}
WRITTEN = (2, 2)
LAYOUTS = [WRITTEN, (2, 1), (1, 1)]  # (TP, PP) on 4 processes: DP 1, 2, 4
TOLERANCE = 1e-5
PROMPTS = ["Alice was", "The Queen said to the", "Down, down, down. Would the fall never come to an end?", "I"]
NEW_TOKENS = 8


def bias_values(layer_number: int) -> torch.Tensor:
    """The bias written for sparse layer ``layer_number`` (1-based), the same on every TP rank."""
    return torch.randn(MOE["num_experts"], generator=torch.Generator().manual_seed(100 + layer_number)) * 0.5


def _whole_logits(pipeline, tokens: torch.Tensor) -> torch.Tensor | None:
    """The replica's logits (b, s, vocab) with the TP shards gathered, on the last stage; None elsewhere."""
    import torch.distributed as dist

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    shard = pipeline.logits(tokens, positions)
    if shard is None:
        return None
    ctx, shards = pipeline.ctx, [shard]
    if ctx.tensor_parallel_size > 1:
        shards = [torch.empty_like(shard) for _ in range(ctx.tensor_parallel_size)]
        dist.all_gather(shards, shard.contiguous(), group=ctx.tensor_parallel_group)
    return torch.cat(shards, dim=-1)[..., :pipeline.config.vocab_size].clone()


def _write_and_evaluate(directory: str) -> dict:
    from evaluation.generation import Generator
    from evaluation.lm import ParallelLM
    from evaluation.loading import checkpoint_tokenizer, load_pipeline
    from model.config import ParallelConfig
    from model.moe import sparse_layers
    from runconfig.run import parse_run_config
    from training.checkpoint import save_checkpoint
    from training.engine import build_engine

    config = parse_run_config(run_config(MODEL))
    engine, _ = build_engine(config.model, config.parallelism, config.deepspeed, 1234)
    with torch.no_grad():
        for number, layer in sparse_layers(engine.module):
            layer.block.router.expert_bias.copy_(bias_values(number))
    save_checkpoint(engine, directory, 1, {"run_config": config.to_dict(), "train_state": {
        "step": 1, "consumed_samples": 8, "consumed_tokens": 8 * 32, "global_batch": 8}})
    del engine

    tokens = torch.randint(0, config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    out = {}
    for tp, pp in LAYOUTS:
        pipeline, checkpoint = load_pipeline(directory, parallel=ParallelConfig(tp, pp))
        tokenizer = checkpoint_tokenizer(checkpoint)
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        requests = [(None, prompt, tokenizer.encode(" the end", add_special_tokens=False)) for prompt in prompts]
        lm = ParallelLM(pipeline, tokenizer, batch_size=2)
        out[(tp, pp)] = {
            "logits": _whole_logits(pipeline, tokens),
            "loglikelihoods": lm._loglikelihood_tokens(requests),
            "generated": Generator(pipeline, tokenizer.eos_token_id).generate_all(prompts, NEW_TOKENS),
            "biases": {number: layer.block.router.expert_bias.clone()
                       for number, layer in sparse_layers(pipeline.stage.module)},
        }
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[dict]]:
    directory = tmp_path_factory.mktemp("moe-eval") / "checkpoints"
    return directory, run_distributed(4, _write_and_evaluate, str(directory))


@pytest.mark.distributed
def test_a_sigmoid_bias_checkpoint_scores_and_generates_alike_at_other_layouts(written):
    _, ranks = written
    reference = ranks[0][WRITTEN]
    expected_logits = next(rank[WRITTEN]["logits"] for rank in ranks if rank[WRITTEN]["logits"] is not None)
    for layout in LAYOUTS[1:]:
        run = ranks[0][layout]
        logits = [rank[layout]["logits"] for rank in ranks if rank[layout]["logits"] is not None]
        assert logits and all(torch.equal(each, logits[0]) for each in logits)  # every replica alike
        logits_difference = (logits[0] - expected_logits).abs().max().item()
        likelihood_difference = max(abs(mine[0] - theirs[0]) for mine, theirs in
                                    zip(run["loglikelihoods"], reference["loglikelihoods"], strict=True))
        print(f"TP {layout[0]} x PP {layout[1]} vs TP 2 x PP 2: max |logit difference| {logits_difference:.3g}, "
              f"max |log-likelihood difference| {likelihood_difference:.3g}")
        assert logits_difference <= TOLERANCE and likelihood_difference <= TOLERANCE, layout
        assert [greedy for _, greedy in run["loglikelihoods"]] == [g for _, g in reference["loglikelihoods"]]
        assert run["generated"] == reference["generated"], layout
    assert all(len(tokens) == NEW_TOKENS for tokens in reference["generated"])


@pytest.mark.distributed
def test_the_routers_bias_is_loaded_exactly(written):
    directory, ranks = written
    tag = directory / (directory / "latest").read_text().strip()
    for layout in LAYOUTS:
        loaded = [(number, bias) for rank in ranks for number, bias in rank[layout]["biases"].items()]
        assert {number for number, _ in loaded} == {1, 2}, layout  # both sparse blocks, on some rank
        for number, bias in loaded:
            saved = torch.load(tag / f"layer_{number + 1:02d}-model_00-model_states.pt", weights_only=True)
            assert bias.dtype == torch.float32 and bias.abs().min() > 0
            assert torch.equal(bias, saved["mlp.block.router.expert_bias"]) and torch.equal(bias, bias_values(number))


@pytest.mark.distributed
def test_tools_generate_in_one_process_gives_the_written_layouts_tokens(written, tmp_path):
    directory, ranks = written
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    result = subprocess.run([sys.executable, "tools/generate.py", "--checkpoint", str(directory), "--prompts",
                             str(prompts), "--max-new-tokens", str(NEW_TOKENS), "--set",
                             "parallelism.tensor_parallel_size=1", "--set", "parallelism.pipeline_parallel_size=1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [record["tokens"] for record in records] == ranks[0][WRITTEN]["generated"]


def test_the_layer_maps_describe_every_tensor_and_reshard_exactly():
    """layer_maps of the shape: every tensor of the blocks' state_dicts (the buffer too), no HF names; and
    split_shards then merge_shards gives back each whole tensor at TP 1, 2, 4, each shard of its table's shape,
    a gate_up's rank r holding rows r of gate then of up."""
    from hf.tables import full_shape, layer_maps, shard_shape
    from hf.transforms import merge_shards, split_shards
    from model.gpt import TransformerLayer
    from model.parallel import ParallelContext
    from runconfig.run import parse_run_config

    config = parse_run_config(run_config(MODEL)).model
    maps = layer_maps(config)
    for block in range(config.num_layers):
        module = TransformerLayer(config, ParallelContext(), 0, block + 1)
        assert {t.ours: full_shape(t, config, 1) for t in maps[2 + block].tensors} == {
            key: tuple(value.shape) for key, value in module.state_dict().items()}
    assert "mlp.block.router.expert_bias" in module.state_dict()
    for layer in maps:
        for tensor in layer.tensors:
            assert tensor.hf is None and tensor.hf_names == ()
            shape = list(full_shape(tensor, config, 1))
            if tensor.dims[0] == "padded_vocab":
                shape[0] = config.vocab_size
            whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
            for tp in (1, 2, 4):
                shards = split_shards(tensor, whole, config, tp)
                assert [tuple(s.shape) for s in shards] == [shard_shape(tensor, config, tp)] * tp, tensor.ours
                assert torch.equal(merge_shards(tensor, shards, config), whole), (tensor.ours, tp)
                if tensor.ours == "mlp.block.experts.gate_up":
                    gate, up = whole.chunk(2, dim=1)
                    assert all(torch.equal(shard, torch.cat([g, u], 1)) for shard, g, u in
                               zip(shards, gate.chunk(tp, 1), up.chunk(tp, 1), strict=True))


def test_resharding_equals_the_hugging_face_path_where_there_is_one():
    """For shapes with an HF architecture (GPT-2, Llama with biases, Mixtral, Qwen2-MoE, Qwen3-MoE) the reshard
    without HF (merge_shards, split_shards) gives the shards of merge_to_hf then split_from_hf, bit for bit, from
    every TP to every TP the shape allows."""
    from hf.tables import layer_maps, shard_shape
    from hf.transforms import merge_shards, merge_to_hf, split_from_hf, split_shards
    from model.config import preset
    from tests.test_hf_moe import moe_model

    generator = torch.Generator().manual_seed(0)
    configs = [preset("tiny", num_layers=2, hidden_size=64, num_attention_heads=4),
               preset("llama-tiny", num_layers=2, bias="all"),
               *[moe_model(name) for name in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")]]
    for config in configs:
        sizes = [tp for tp in (1, 2, 4) if config.num_key_value_heads % tp == 0]
        for tensor in (t for layer in layer_maps(config) for t in layer.tensors):
            assert tensor.hf is not None
            for source in sizes:
                split = tensor.partition_dim is not None
                shards = [torch.randn(shard_shape(tensor, config, source), generator=generator)
                          for _ in range(source if split else 1)]
                shards = shards if split else shards * source  # replicated: the same on every rank
                for target in sizes:
                    ours = split_shards(tensor, merge_shards(tensor, shards, config), config, target)
                    theirs = split_from_hf(tensor, merge_to_hf(tensor, shards, config), config, target)
                    assert all(map(torch.equal, ours, theirs)), (tensor.ours, source, target)


def test_the_export_refuses_the_router_in_one_line(written, tmp_path):
    from hf.export import export_to_hf

    directory, _ = written
    with pytest.raises(ValueError) as refused:
        export_to_hf(directory, tmp_path / "hf", progress=False)
    message = str(refused.value)
    assert "\n" not in message and "model.moe.router 'sigmoid_bias' has none" in message
    assert """--set 'model.moe.router="softmax"'""" in message and "tools/evaluate.py" in message
    assert not (tmp_path / "hf").exists()
