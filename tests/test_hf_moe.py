"""Hugging Face interop for Mixture-of-Experts: MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM,
DeepseekV3ForCausalLM.

Each architecture as a random HF model (4 layers, hidden 64, 4 query heads in 2 key/value groups, GPT-2's
vocabulary so that the shipped tokenizer fits), every tensor random (norm weights, biases and routers too, so that a
misplaced one shows), saved by transformers' save_pretrained (its per-expert tensor names) with a tokenizer beside it:

    Mixtral    4 experts of width 32, top 2 (renormalised), every block sparse, untied head
    Qwen2-MoE  4 experts of width 32, top 2 not renormalised, a shared expert of width 48 with its sigmoid gate,
               q/k/v biases, decoder_sparse_step 2 (blocks 2 and 4 sparse, 1 and 3 dense of width 96), tied head
    Qwen3-MoE  8 experts of width 32, top 4 renormalised, q/k norms, head_dim 24 (not hidden / heads),
               mlp_only_layers [0] (block 1 dense), untied head
    DeepSeek-V3  multi-head latent attention (q latent 32, kv latent 32, q/k 16 + 8 rope, v 16, rope interleaved),
               YaRN (factor 4 over 32 positions, mscale 1, mscale_all_dim 0.707); 8 experts of width 32 in 4 groups,
               top 2 of the best 2 groups, renormalised x 2.5, a random e_score_correction_bias, an ungated shared
               expert of width 32; first_k_dense_replace 2 (blocks 1, 2 dense of width 96); untied head

- HF -> here (hf/importer.py, TP 2 x PP 2) -> HF (hf/export.py) gives back every tensor bit for bit, under the same
  names (the conversion only copies, slices and stacks), and the export loads in transformers with no missing or
  unexpected key.
- The imported checkpoints, loaded into the training engine at TP 2 x PP 2 x DP 2 with EP 2 and saved there (8 gloo
  processes, one launch for the four), export bit for bit again, and read at TP 2 x PP 2 by the evaluation code
  (evaluation/loading.py) give transformers' logits (its eager experts) within 1e-4 in fp32: the row-parallel
  layers sum TP partial products, so the rounding differs; the measured differences are printed.
- model.from_hf reads each config.json into the expected model.moe (MoEConfig), DeepSeek-V3's into the MLA fields and
  YaRN's scaling too. Its other shapes, fp8 weights and refused keys: tests/test_hf_deepseek.py.
- Single-process: the expert tensors' split/merge on arange tensors at TP 1, 2, 4; the layer maps against the sparse
  and dense blocks' state_dicts; the options with no equivalent refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf.config_map import model_fields_from_hf, read_hf_config
from hf.export import export_to_hf
from hf.importer import import_from_hf
from hf.tables import (
    ARCHITECTURES,
    compatible_architectures,
    full_shape,
    hf_tensor_shapes,
    layer_maps,
    resolve_architecture,
)
from hf.tokenizer import gpt2_tokenizer
from hf.transforms import merge_to_hf, split_from_hf
from model.config import ModelConfig, MoEConfig, ParallelConfig
from model.parallel import ParallelContext
from runconfig.run import parse_run_config
from tests.distributed import run_distributed
from tests.test_model_parallel import LR, deepspeed_config

TP, PP = 2, 2
SEQ, BATCH = 32, 2
VOCAB = 50257
LOGITS_TOLERANCE = 1e-4
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
        "mscale_all_dim": 0.707}
LATENT = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
FAMILIES = {
    "MixtralForCausalLM": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                               router_aux_loss_coef=0.02, tie_word_embeddings=False, sliding_window=None),
    "Qwen2MoeForCausalLM": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2,
                                tie_word_embeddings=True, rms_norm_eps=1e-6),
    "Qwen3MoeForCausalLM": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=4,
                                norm_topk_prob=True, mlp_only_layers=[0], head_dim=24, router_aux_loss_coef=0.005,
                                tie_word_embeddings=False, rms_norm_eps=1e-6),
    "DeepseekV3ForCausalLM": dict(num_key_value_heads=4, rope_parameters=YARN, **LATENT, intermediate_size=96,
                                  moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2,
                                  num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
                                  first_k_dense_replace=2, tie_word_embeddings=False),
}
EXPECTED_MOE = {  # what model.from_hf must read from each config.json
    "MixtralForCausalLM": MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=32, norm_topk_prob=True,
                                    aux_loss_coeff=0.04),
    "Qwen2MoeForCausalLM": MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=32, norm_topk_prob=False,
                                     shared_expert_ffn_hidden_size=48, sparse_every=2, aux_loss_coeff=0.002),
    "Qwen3MoeForCausalLM": MoEConfig(num_experts=8, top_k=4, moe_ffn_hidden_size=32, norm_topk_prob=True,
                                     first_dense_layers=1, aux_loss_coeff=0.02),
    "DeepseekV3ForCausalLM": MoEConfig(num_experts=8, top_k=2, moe_ffn_hidden_size=32, router="sigmoid_bias",
                                       routed_scaling_factor=2.5, n_group=4, topk_group=2,
                                       shared_expert_ffn_hidden_size=32, shared_expert_gate=False,
                                       first_dense_layers=2),  # no aux-loss key in its config: the defaults
}


def hf_config(name: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(ARCHITECTURES[name].model_type, architectures=[name],
                                **{**SHAPE, **FAMILIES[name], **overrides})


def random_hf_model(name: str, directory: Path, **overrides) -> Path:
    """Matrices and expert stacks N(0, 0.05^2), norm weights 1 + N(0, 0.1^2), biases and DeepSeek's
    e_score_correction_bias (a buffer, zeros in a fresh model) N(0, 0.1^2)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(list(FAMILIES).index(name))
    model = AutoModelForCausalLM.from_config(hf_config(name, **overrides))
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter.ndim >= 2:
                parameter.normal_(0.0, 0.05)
            elif "norm" in parameter_name:
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.1)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(str(directory))
    gpt2_tokenizer(SHAPE["max_position_embeddings"]).save_pretrained(str(directory))
    return directory


def run_config(hf_dir: Path) -> dict:
    """The run config the trainer would store, its model block read by model.from_hf."""
    raw = {**deepspeed_config("fp32"), "model": {"from_hf": str(hf_dir), "seq_length": SEQ, "precision": "fp32"},
           "parallelism": {"tensor_parallel_size": TP, "pipeline_parallel_size": PP},
           "schedule": {"lr": LR, "warmup_tokens": 0, "decay_tokens": 1e6, "train_tokens": 1e6}}
    return parse_run_config(raw).to_dict()


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, dict]:
    """Each architecture: the HF directory, its run config and its import at TP 2 x PP 2."""
    root = tmp_path_factory.mktemp("moe_family")
    cases = {}
    for name in FAMILIES:
        hf_dir = random_hf_model(name, root / name / "hf")
        config = run_config(hf_dir)
        model = parse_run_config(config).model
        import_from_hf(hf_dir, model, ParallelConfig(TP, PP), root / name / "checkpoint", run_config=config,
                       progress=False)
        cases[name] = {"hf": hf_dir, "checkpoint": root / name / "checkpoint", "config": config, "model": model}
    return cases


def hf_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True, local_files_only=True,
                                                       experts_implementation="eager")
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def load_all(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: tensor for file in sorted(hf_dir.glob("*.safetensors")) for name, tensor in load_file(file).items()}


# -- model.from_hf ---------------------------------------------------------------------------------------------------

def test_from_hf_reads_the_experts(imported):
    for name, case in imported.items():
        model = case["model"]
        assert model.moe == EXPECTED_MOE[name], name
        assert compatible_architectures(model) == [ARCHITECTURES[name]]
        assert model.ffn_hidden_size == (32 if name == "MixtralForCausalLM" else 96)  # Mixtral: the experts' width
        assert (model.bias, model.qk_layernorm) == {"MixtralForCausalLM": ("none", False),
                                                    "Qwen2MoeForCausalLM": ("qkv", False),
                                                    "Qwen3MoeForCausalLM": ("none", True),
                                                    "DeepseekV3ForCausalLM": ("none", False)}[name]
        sparse = [model.moe.is_sparse(n) for n in range(1, 5)]
        assert sparse == {"MixtralForCausalLM": [True] * 4, "Qwen2MoeForCausalLM": [False, True, False, True],
                          "Qwen3MoeForCausalLM": [False, True, True, True],
                          "DeepseekV3ForCausalLM": [False, False, True, True]}[name]
        if name == "DeepseekV3ForCausalLM":  # head_dim q/k's 16 + 8 (HF's head_dim is the rope part), kv heads 4
            latent = {key: getattr(model, key) for key in (*LATENT, "rope_interleave", "head_dim",
                                                           "num_key_value_heads")}
            assert (model.attention_type, latent) == ("mla", {**LATENT, "rope_interleave": True, "head_dim": 24,
                                                              "num_key_value_heads": 4})
            assert (model.rope_theta, model.rope_scaling) == (1e4, {k: v for k, v in YARN.items() if k != "rope_theta"})
        else:
            assert model.attention_type == "mha" and model.q_lora_rank is None and model.rope_interleave is None


# -- round trip ------------------------------------------------------------------------------------------------------

MOE_CONFIG_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads", "tie_word_embeddings", "num_local_experts", "num_experts",
                   "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                   "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "qkv_bias", "rope_parameters",
                   "rms_norm_eps", "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "n_group",
                   "topk_group", "first_k_dense_replace", "attention_bias", "rope_interleave", *LATENT)
EXPERT_NAMES = {  # what transformers 5 writes for layer 1's expert 0 (and the original checkpoints hold)
    "MixtralForCausalLM": ["model.layers.1.block_sparse_moe.gate.weight",
                           "model.layers.1.block_sparse_moe.experts.0.w1.weight",
                           "model.layers.1.block_sparse_moe.experts.0.w2.weight",
                           "model.layers.1.block_sparse_moe.experts.0.w3.weight"],
    "Qwen2MoeForCausalLM": ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.0.gate_proj.weight",
                            "model.layers.1.mlp.experts.0.up_proj.weight",
                            "model.layers.1.mlp.experts.0.down_proj.weight",
                            "model.layers.1.mlp.shared_expert.gate_proj.weight",
                            "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate_proj.weight"],
    "Qwen3MoeForCausalLM": ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.7.gate_proj.weight",
                            "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_norm.weight"],
    "DeepseekV3ForCausalLM": ["model.layers.2.mlp.gate.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
                              "model.layers.2.mlp.experts.7.up_proj.weight",
                              "model.layers.2.mlp.shared_experts.gate_proj.weight",
                              "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_a_layernorm.weight",
                              "model.layers.0.self_attn.q_b_proj.weight",
                              "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"],
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_to_ours_to_hf_is_bit_identical(imported, name, tmp_path):
    case = imported[name]
    out = export_to_hf(case["checkpoint"], tmp_path / "hf", max_shard_size="1MB", progress=False)
    original, back = load_all(case["hf"]), load_all(out)
    assert set(EXPERT_NAMES[name]) <= original.keys()
    assert back.keys() == original.keys()
    for tensor_name, tensor in original.items():
        assert back[tensor_name].dtype == tensor.dtype and torch.equal(back[tensor_name], tensor), tensor_name
    before, after = (json.loads((d / "config.json").read_text()) for d in (case["hf"], out))
    for key in MOE_CONFIG_KEYS:
        assert after.get(key) == before.get(key), key
    default_head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]  # a null head_dim means this
    assert (after.get("head_dim") or default_head_dim) == (before.get("head_dim") or default_head_dim)
    model, theirs = hf_model(out), hf_model(case["hf"])
    prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, theirs(prompt).logits)


# -- through the training engine at TP 2 x PP 2 x DP 2 with EP 2, then logits at TP 2 x PP 2 ----------------------

EP = 2
GENERATION_PROMPTS = [[464, 2068, 7586, 21831], [40, 373, 257, 1310, 290, 11, 198]]  # GPT-2 ids of two prompts
NEW_TOKENS = 8


def _through_expert_parallelism(cases: list[tuple[str, str, dict]], tokens: torch.Tensor) -> list:
    """Each import (its layer files hold all the experts) loaded into the training engine at TP 2 x PP 2 x DP 2 with
    EP 2, each rank keeping its E / 2 (training/checkpoint.py load_weights), saved there (each EP rank's experts in
    files of their own), and that checkpoint read by the evaluation code at TP 2 x PP 2: this rank's vocabulary
    slice of the logits where it is a last stage of the first replica, else None. DeepseekV3 also generates greedily
    (its multi-head latent attention with its latent cache): (logits, tokens)."""
    from evaluation.generation import Generator
    from evaluation.loading import load_pipeline
    from training.checkpoint import load_weights, save_checkpoint
    from training.engine import build_engine

    results = []
    for source, target, config in cases:
        run = parse_run_config({**config, "parallelism": {**config["parallelism"], "expert_parallel_size": EP}})
        engine, _ = build_engine(run.model, run.parallelism, run.deepspeed, seed=0)
        load_weights(engine, source)
        save_checkpoint(engine, target, 1, {"run_config": run.to_dict()})
        pipeline, _ = load_pipeline(target)
        with torch.no_grad():
            logits = pipeline.logits(tokens, torch.arange(SEQ).expand(BATCH, -1))
        first_replica = pipeline.stage.ctx.data_parallel_rank == 0
        results.append(logits.clone() if logits is not None and first_replica else None)
        if run.model.attention_type == "mla":
            results[-1] = (results[-1], Generator(pipeline, None).generate_all(GENERATION_PROMPTS, NEW_TOKENS))
    return results


@pytest.fixture(scope="module")
def expert_parallel(imported, tmp_path_factory) -> dict[str, dict]:
    """Each architecture: its checkpoint written at EP 2, and its logits read from it (one 8-process launch)."""
    root = tmp_path_factory.mktemp("moe_expert_parallel")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    cases = [(str(case["checkpoint"]), str(root / name), case["config"]) for name, case in imported.items()]
    ranks = run_distributed(TP * PP * EP, _through_expert_parallelism, cases, tokens)
    out = {}
    for index, name in enumerate(imported):
        results = [rank[index] for rank in ranks]
        generated = None
        if isinstance(results[0], tuple):  # (logits, the greedy tokens every rank returns)
            generated = [tokens for _, tokens in results]
            results = [logits for logits, _ in results]
        out[name] = {"checkpoint": root / name, "tokens": tokens, "generated": generated,
                     "logits": torch.cat([r for r in results if r is not None], dim=-1)}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(FAMILIES))
def test_written_at_expert_parallel_size_2_exports_bit_identical(imported, expert_parallel, name, tmp_path):
    """The EP 2 checkpoint keeps its experts out of its layer files, one file per EP rank, and exports (read_layer
    joins them) to the original HF tensors bit for bit."""
    checkpoint = expert_parallel[name]["checkpoint"]
    sparse_layers = [n + 1 for n in range(4) if imported[name]["model"].moe.is_sparse(n + 1)]  # block n: layer n + 1
    assert sorted(p.name for p in (checkpoint / "global_step1").glob("experts_*")) == sorted(
        f"experts_{layer + 1:02d}-model_{t:02d}-ep_{e:02d}.pt" for layer in sparse_layers for t in range(TP)
        for e in range(EP))
    out = export_to_hf(checkpoint, tmp_path / "hf", max_shard_size="1MB", progress=False)
    original, back = load_all(imported[name]["hf"]), load_all(out)
    assert back.keys() == original.keys()
    for tensor_name, tensor in original.items():
        assert torch.equal(back[tensor_name], tensor), tensor_name


@pytest.mark.distributed
def test_deepseek_v3_generates_as_transformers_generate(imported, expert_parallel):
    """Greedy decoding at TP 2 x PP 2 (MLA's latent cache, the experts at EP 2 written) equals transformers'
    generate() on the HF model, token for token, on every rank; and the latent cache's size beside a plain one's."""
    from model.attention import KVCache
    from model.mla import LatentKVCache

    model = hf_model(imported["DeepseekV3ForCausalLM"]["hf"])
    expected = []
    for prompt in GENERATION_PROMPTS:
        with torch.no_grad():
            tokens = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=0)
        expected.append(tokens[0, len(prompt):].tolist())
    assert len({token for tokens in expected for token in tokens}) > 3  # not one token repeated
    assert all(generated == expected for generated in expert_parallel["DeepseekV3ForCausalLM"]["generated"])
    config = imported["DeepseekV3ForCausalLM"]["model"]
    latent = LatentKVCache(config.kv_lora_rank, config.qk_rope_head_dim).bytes_per_token(torch.float32)
    plain = KVCache(config.num_attention_heads, config.head_dim, config.v_head_dim).bytes_per_token(torch.float32)
    print(f"\nKV cache per token and layer, fp32: latent {latent} bytes, plain keys and values {plain} bytes")
    assert (latent, plain) == (4 * (32 + 8), 4 * 4 * (24 + 16))


@pytest.mark.distributed
def test_expert_parallel_checkpoints_give_the_hf_logits(imported, expert_parallel):
    differences = {}
    for name, case in imported.items():
        ours, tokens = expert_parallel[name]["logits"], expert_parallel[name]["tokens"]
        assert torch.isneginf(ours[..., VOCAB:]).all()
        with torch.no_grad():
            theirs = hf_model(case["hf"])(tokens).logits
        assert theirs.abs().max() > 0.5  # a real spread, not ~0
        differences[name] = (theirs - ours[..., :VOCAB]).abs().max().item()
    print(f"max |logits - HF logits| (fp32, written at TP {TP} x PP {PP} x DP 2 with EP {EP}, read at TP {TP} x "
          f"PP {PP}): {differences}")
    assert all(difference <= LOGITS_TOLERANCE for difference in differences.values()), differences


# -- the map, single-process -----------------------------------------------------------------------------------------

def moe_model(name: str) -> ModelConfig:
    fields = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=96,
                  seq_length=16, vocab_size=1000, position_embedding="rope", norm="rmsnorm", mlp="swiglu",
                  tie_word_embeddings=False, bias="none", moe=EXPECTED_MOE[name])
    if name == "MixtralForCausalLM":
        fields["ffn_hidden_size"] = 32
    elif name == "Qwen2MoeForCausalLM":
        fields["bias"] = "qkv"
    elif name == "DeepseekV3ForCausalLM":
        fields.update(num_key_value_heads=None, attention_type="mla", **LATENT)
    else:
        fields.update(qk_layernorm=True, head_dim=24)
    return ModelConfig(**fields)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2, 4])
def test_split_then_merge_is_exact_for_the_expert_tensors(tensor_parallel_size):
    for name in FAMILIES:
        config = moe_model(name)
        for tensor in layer_maps(config, ARCHITECTURES[name])[5].tensors:  # block 4: sparse in all four
            values = [torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1e6 * i
                      for i, shape in enumerate(hf_tensor_shapes(tensor, config).values())]
            shards = split_from_hf(tensor, values[0] if isinstance(tensor.hf, str) else values, config,
                                   tensor_parallel_size)
            merged = merge_to_hf(tensor, shards, config)
            merged = [merged] if torch.is_tensor(merged) else list(merged)
            assert len(merged) == len(values) and all(map(torch.equal, merged, values)), tensor.hf


def test_expert_shards_hold_each_experts_rows():
    """TP rank r of 2 holds, for every expert e, rows r of its gate then of its up (experts.gate_up [E, 2F/2, h]),
    and columns r of its down (experts.down [E, h, F/2])."""
    config = moe_model("MixtralForCausalLM")
    tensors = {t.ours: t for t in layer_maps(config)[2].tensors}
    gate_up, down = tensors["mlp.block.experts.gate_up"], tensors["mlp.block.experts.down"]
    assert gate_up.hf_names[:4] == tuple(f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"
                                         for e in (0, 1) for w in ("w1", "w3"))
    f, h, experts = 32, 64, 4
    rows = torch.arange(f, dtype=torch.float32).unsqueeze(1).expand(f, h)
    values = [rows + 1000 * e + 100 * part for e in range(experts) for part in (0, 1)]  # gate: +0, up: +100
    for rank, shard in enumerate(split_from_hf(gate_up, values, config, 2)):
        assert shard.shape == (experts, f, h)
        half = torch.arange(rank * f // 2, (rank + 1) * f // 2, dtype=torch.float32)
        for e in range(experts):
            assert torch.equal(shard[e, :, 0], torch.cat([half, 100 + half]) + 1000 * e)
    columns = [torch.arange(f, dtype=torch.float32).expand(h, f) + 1000 * e for e in range(experts)]
    for rank, shard in enumerate(split_from_hf(down, columns, config, 2)):
        assert shard.shape == (experts, h, f // 2)
        assert torch.equal(shard[:, 0, 0], torch.arange(experts, dtype=torch.float32) * 1000 + rank * f // 2)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_layer_maps_match_the_sparse_and_dense_blocks(name):
    from model.gpt import TransformerLayer

    config, ctx = moe_model(name), ParallelContext()
    maps = layer_maps(config, ARCHITECTURES[name])
    for block in range(config.num_layers):
        module = TransformerLayer(config, ctx, 0, block + 1)
        layer = maps[2 + block]
        assert {t.ours: full_shape(t, config, 1) for t in layer.tensors} == {
            k: tuple(v.shape) for k, v in module.state_dict().items()}, block


# -- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, overrides, message", [
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[1]), r"mlp_only_layers = \[1\] .* only the first k blocks"),
    ("Qwen2MoeForCausalLM", dict(mlp_only_layers=[0, 2]), r"mlp_only_layers = \[0, 2\]"),
    ("MixtralForCausalLM", dict(router_jitter_noise=0.1), r"router_jitter_noise = 0.1 .* no noise"),
    ("Qwen2MoeForCausalLM", dict(shared_expert_intermediate_size=0), r"shared_expert_intermediate_size = 0"),
])
def test_unsupported_moe_options_are_refused_by_name(name, overrides, message, tmp_path):
    hf_config(name, **overrides).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=message):
        read_hf_config(tmp_path)


def test_a_prefix_of_dense_layers_is_read(tmp_path):
    hf_config("Qwen3MoeForCausalLM", mlp_only_layers=[1, 0], decoder_sparse_step=2).save_pretrained(str(tmp_path))
    moe = model_fields_from_hf(read_hf_config(tmp_path))["moe"]
    assert (moe["first_dense_layers"], moe["sparse_every"]) == (2, 2)


def test_mismatched_experts_are_named_field_by_field(imported, tmp_path):
    """Only the fields of the function count: another z-loss or capacity imports; another top_k does not."""
    case = imported["MixtralForCausalLM"]
    model = case["model"]
    training_choices = {**model.to_dict()["moe"], "router_z_loss_coeff": 1e-3, "capacity_factor": 1.25}
    import_from_hf(case["hf"], ModelConfig(**{**model.to_dict(), "moe": training_choices}), ParallelConfig(1, 1),
                   tmp_path / "ok", progress=False)
    assert (tmp_path / "ok" / "latest").read_text().strip() == "global_step0"
    wrong = ModelConfig(**{**model.to_dict(), "moe": {**model.to_dict()["moe"], "top_k": 3}})
    with pytest.raises(ValueError, match=r"model.moe.top_k is 3 .* has 2(.|\n)*--set model.moe.top_k=2"):
        import_from_hf(case["hf"], wrong, ParallelConfig(TP, PP), tmp_path / "out", progress=False)
    dense = ModelConfig(**{**model.to_dict(), "moe": None})
    with pytest.raises(ValueError, match="is a MixtralForCausalLM, but the model of .* fits only LlamaForCausalLM"):
        import_from_hf(case["hf"], dense, ParallelConfig(TP, PP), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_shapes_without_an_hf_architecture_are_refused():
    qwen3 = moe_model("Qwen3MoeForCausalLM")
    for moe in (dict(router="sigmoid_bias"), dict(shared_expert_ffn_hidden_size=16)):
        config = ModelConfig(**{**qwen3.to_dict(), "moe": {**qwen3.to_dict()["moe"], **moe}})
        assert compatible_architectures(config) == []
        with pytest.raises(ValueError, match="Mixture-of-Experts model's shape .* is no Hugging Face architecture"):
            resolve_architecture(config)  # what the export asks; evaluation reads it all the same (test_evaluation_moe)
        assert len(layer_maps(config)) == 4 + config.num_layers  # our files are described, with or without HF names
    deepseek = moe_model("DeepseekV3ForCausalLM")
    for fields in (dict(moe={**deepseek.to_dict()["moe"], "shared_expert_gate": True}), dict(bias="all"),
                   dict(moe={**deepseek.to_dict()["moe"], "router": "softmax", "n_group": 1, "topk_group": 1})):
        config = ModelConfig(**{**deepseek.to_dict(), **fields})
        assert compatible_architectures(config) == []
        with pytest.raises(ValueError, match="multi-head latent attention model's shape .* is no DeepseekV3ForCausal"):
            resolve_architecture(config)
    mixtral = moe_model("MixtralForCausalLM")
    every_other = ModelConfig(**{**mixtral.to_dict(), "moe": {**mixtral.to_dict()["moe"], "sparse_every": 2}})
    assert compatible_architectures(every_other) == []  # Mixtral has no dense blocks
    assert ARCHITECTURES["MixtralForCausalLM"] not in compatible_architectures(moe_model("Qwen2MoeForCausalLM"))
