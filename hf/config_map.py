"""The model block <-> a Hugging Face config: the fields an HF config fixes, the options refused, and the config an
export writes.

An HF config.json is read with the transformers config class of its architecture (its defaults for keys an older file
lacks), then checked: an option this project's GPT does not have (a sliding window shorter than the context, a
rope_scaling other than llama3 or yarn, attention biases on some projections only, a quantization other than
DeepSeek's block-scaled fp8, ...) is refused naming the key. ``model_fields_from_hf`` gives the ModelConfig fields it
fixes; ``check_model_matches`` names every field a run config's model block has otherwise.

The experts of Mixtral, Qwen2-MoE and Qwen3-MoE (the model.moe block, MoEConfig):

    HF config.json                                       model.moe
    num_local_experts (Mixtral) / num_experts (Qwen)     num_experts
    num_experts_per_tok                                  top_k
    intermediate_size (Mixtral) / moe_intermediate_size  moe_ffn_hidden_size (Mixtral: ffn_hidden_size too)
    shared_expert_intermediate_size (Qwen2-MoE, > 0)     shared_expert_ffn_hidden_size
    norm_topk_prob (Mixtral: always true)                norm_topk_prob
    decoder_sparse_step (Mixtral: 1)                     sparse_every
    mlp_only_layers [0, ..., k-1] (only such a prefix)   first_dense_layers k
    router_aux_loss_coef c                               aux_loss_coeff c x top_k (MoEConfig's docstring)
    router_jitter_noise (Mixtral): only 0                router "softmax" (the only router of the three)

output_router_logits changes nothing here. The z-loss coefficient and the capacity are no part of an HF config: an
export leaves them out (the exported model routes dropless), an import takes the defaults.

DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2, Moonlight; model.attention_type "mla"):

    HF config.json                                       model
    q_lora_rank (null: q_proj), kv_lora_rank,            the same fields (head_dim is qk_nope + qk_rope, the key/value
      qk_nope_head_dim, qk_rope_head_dim, v_head_dim,      heads the query heads: HF's head_dim, qk_rope_head_dim, is
      rope_interleave                                      not ours)
    rope_parameters (rope_scaling, rope_theta): yarn     rope_theta, rope_scaling {"rope_type": "yarn", factor,
      with factor, mscale, mscale_all_dim, ...             original_max_position_embeddings, mscale, mscale_all_dim,
                                                           beta_fast, beta_slow, ...} as transformers reads them
    attention_bias                                       bias "all" (every block sparse), else "none"
    intermediate_size (the dense blocks')                ffn_hidden_size
    n_routed_experts                                     moe.num_experts
    num_experts_per_tok                                  moe.top_k
    moe_intermediate_size                                moe.moe_ffn_hidden_size
    n_shared_experts x moe_intermediate_size             moe.shared_expert_ffn_hidden_size, shared_expert_gate false
    norm_topk_prob, routed_scaling_factor, n_group,      the same fields of model.moe, router "sigmoid_bias"
      topk_group
    first_k_dense_replace k                              moe.first_dense_layers k (sparse_every 1); k >= layers: no
                                                           model.moe (a dense MLA model)
    num_nextn_predict_layers                             none: model.mtp is the run config's; with it the import
                                                           reads the official MTP layers, without it skips them
                                                           (hf/importer.py); an export writes model.mtp's depth or 0
    quantization_config (fp8, weight_block_size)         none: the weights are dequantised on import; an export
                                                           writes unquantised weights and no quantization_config

Refused by key: scoring_func other than "sigmoid", topk_method other than "noaux_tc", moe_layer_freq other than 1
(the keys of DeepSeek's own config class, which transformers' lacks and ignores), n_group / topk_group null,
n_shared_experts 0, num_key_value_heads other than the heads, attention_bias with dense blocks. No DeepseekV3 key
holds an aux-loss coefficient that transformers reads (aux_loss_alpha, seq_aux belong to DeepSeek's own code): an
import takes model.moe's defaults for the losses.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from hf.tables import ARCHITECTURES, Architecture, compatible_architectures, resolve_architecture
from model.config import SCALING_KEYS, YARN_OPTIONAL_KEYS, ModelConfig, MoEConfig, set_option
from model.config.attention import MLA_FIELDS

ACTIVATION_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
ACTIVATION_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                      "gelu_fast": "gelu_tanh"}  # the three tanh approximations agree to ~1e-7
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
MOE_FUNCTION_FIELDS = ("num_experts", "top_k", "moe_ffn_hidden_size", "router", "norm_topk_prob",
                       "routed_scaling_factor", "n_group", "topk_group", "shared_expert_ffn_hidden_size",
                       "shared_expert_gate", "sparse_every", "first_dense_layers")
"""The model.moe fields that make the model's function (and its tensors): what an import must match. The loss
coefficients, the capacity and the bias update rate are training choices."""


def hf_config(config: ModelConfig, dtype: torch.dtype, end_of_text_id: int | None,
              architecture: Architecture | None = None, begin_of_text_id: int | None = None):
    """The transformers config of this model as ``architecture`` (default: the first that fits; vocabulary
    unpadded). ``begin_of_text_id`` defaults to the end-of-text id (GPT-2's single <|endoftext|>)."""
    architecture = architecture or resolve_architecture(config)
    begin = end_of_text_id if begin_of_text_id is None else begin_of_text_id
    if architecture.model_type == "gpt2":
        from transformers import GPT2Config

        ffn = config.ffn_hidden_size
        return GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
            n_layer=config.num_layers, n_head=config.num_attention_heads,
            n_inner=None if ffn == 4 * config.hidden_size else ffn,
            activation_function=ACTIVATION_TO_HF[config.activation], layer_norm_epsilon=config.layernorm_epsilon,
            resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout,
            initializer_range=config.init_method_std, bos_token_id=begin, eos_token_id=end_of_text_id,
            architectures=[architecture.name], tie_word_embeddings=True, dtype=str(dtype).removeprefix("torch."))
    return _llama_family_config(config, dtype, architecture, begin, end_of_text_id)


def _llama_family_config(config: ModelConfig, dtype: torch.dtype, architecture: Architecture, begin: int | None,
                         end: int | None):
    from transformers import AutoConfig

    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    rope.pop("type", None)  # the legacy spelling of rope_type
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
        initializer_range=config.init_method_std, attention_dropout=config.attention_dropout,
        tie_word_embeddings=config.tie_word_embeddings, rope_parameters=rope, bos_token_id=begin,
        eos_token_id=end, architectures=[architecture.name], dtype=str(dtype).removeprefix("torch."))
    if architecture.model_type == "llama":
        fields.update(attention_bias=config.bias == "all", mlp_bias=config.bias == "all")
    elif architecture.model_type == "mistral":
        fields.update(sliding_window=None)
    elif architecture.model_type == "qwen3":  # q_norm / k_norm always there, no bias
        fields.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    elif architecture.model_type == "mixtral":
        fields.update(sliding_window=None, router_jitter_noise=0.0, **_moe_hf_fields(config, "mixtral"))
    elif architecture.model_type == "qwen2_moe":  # q, k, v biases or none
        fields.update(use_sliding_window=False, sliding_window=None, qkv_bias=config.bias == "qkv",
                      **_moe_hf_fields(config, "qwen2_moe"))
    elif architecture.model_type == "qwen3_moe":
        fields.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                      **_moe_hf_fields(config, "qwen3_moe"))
    elif architecture.model_type == "deepseek_v3":  # its head_dim is qk_rope_head_dim, set by DeepseekV3Config
        del fields["head_dim"]
        fields.update(_deepseek_v3_hf_fields(config))
    else:  # qwen2: the q, k, v biases are always there; no sliding window
        fields.update(use_sliding_window=False, sliding_window=None)
    return AutoConfig.for_model(architecture.model_type, **fields)


def _moe_hf_fields(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """The experts' keys of an HF config (the module docstring's table)."""
    moe = config.moe
    fields = dict(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coeff / moe.top_k,
                  output_router_logits=False)
    if model_type == "mixtral":  # intermediate_size is the experts' width: every block is sparse
        return {**fields, "num_local_experts": moe.num_experts, "intermediate_size": moe.moe_ffn_hidden_size}
    fields.update(num_experts=moe.num_experts, moe_intermediate_size=moe.moe_ffn_hidden_size,
                  norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=moe.sparse_every,
                  mlp_only_layers=list(range(moe.first_dense_layers)))
    if model_type == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = moe.shared_expert_ffn_hidden_size
    return fields


def _deepseek_v3_hf_fields(config: ModelConfig) -> dict[str, Any]:
    """MLA's and DeepSeek's experts' keys (the module docstring's table); a dense model's blocks all dense."""
    fields = {name: getattr(config, name) for name in MLA_FIELDS}
    fields.update(attention_bias=config.bias == "all",
                  num_nextn_predict_layers=config.mtp.depth if config.mtp is not None else 0)
    moe = config.moe
    if moe is None:
        return {**fields, "first_k_dense_replace": config.num_layers}
    return {**fields, "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.moe_ffn_hidden_size,
            "n_shared_experts": moe.shared_expert_ffn_hidden_size // moe.moe_ffn_hidden_size,
            "norm_topk_prob": moe.norm_topk_prob, "routed_scaling_factor": moe.routed_scaling_factor,
            "n_group": moe.n_group, "topk_group": moe.topk_group, "first_k_dense_replace": moe.first_dense_layers}



def _architecture_of_config(path: Path, raw: dict[str, Any]) -> Architecture:
    """From config.json's ``architectures`` (or, without it, ``model_type``)."""
    architectures = raw.get("architectures") or []
    by_type = [a for a in ARCHITECTURES.values() if raw.get("model_type") in (a.model_type, *a.model_type_aliases)]
    if len(architectures) == 1 and architectures[0] in ARCHITECTURES:
        architecture = ARCHITECTURES[architectures[0]]
    elif not architectures and len(by_type) == 1:
        architecture = by_type[0]
    else:
        raise ValueError(f"{path}: architecture {architectures or raw.get('model_type')!r} is not supported: only "
                         f"{', '.join(f'{a.name} (model_type {a.model_type})' for a in ARCHITECTURES.values())} "
                         f"convert to this project's GPT")
    if raw.get("model_type") not in (None, architecture.model_type, *architecture.model_type_aliases):
        raise ValueError(f"{path}: architectures says {architecture.name} but model_type is {raw['model_type']!r}, "
                         f"not {architecture.model_type!r}")
    return architecture


def read_hf_config(hf_dir: str | Path):
    """The transformers config (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, MixtralConfig,
    Qwen2MoeConfig, Qwen3MoeConfig, DeepseekV3Config) of an HF model directory; ValueError for any other architecture
    or an option this project's GPT does not have, naming the key. An alias model_type (Kimi-K2's "kimi_k2") is read
    as its architecture's."""
    path = Path(hf_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: --model must be a Hugging Face model directory") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    architecture = _architecture_of_config(path, raw)
    from transformers import CONFIG_MAPPING

    # its defaults for keys an older file lacks; the model_type its class's (an alias would stick to the instance)
    config = CONFIG_MAPPING[architecture.model_type].from_dict({**raw, "model_type": architecture.model_type})
    fp8_block_size(config, path)  # checks quantization_config
    if architecture.model_type == "gpt2":
        _check_gpt2_options(path, config)
    else:
        _check_llama_family_options(path, config, architecture)
    return config


def _check_gpt2_options(path: Path, config) -> None:
    unsupported = {"activation_function": config.activation_function not in ACTIVATION_FROM_HF,
                   "scale_attn_weights": not config.scale_attn_weights,
                   "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
                   "add_cross_attention": config.add_cross_attention,
                   "tie_word_embeddings": not config.tie_word_embeddings}
    for key, bad in unsupported.items():
        if bad:
            raise ValueError(f"{path}: {key} = {getattr(config, key)!r} has no equivalent in this project's GPT "
                             f"(activations {sorted(ACTIVATION_FROM_HF)}, attention scaled by 1/sqrt(d), no cross "
                             "attention, output head tied to the embedding)")


def _hf_rope(config) -> dict[str, Any]:
    """transformers >= 5 keeps rope_theta and rope_scaling together in rope_parameters; older ones apart."""
    rope = getattr(config, "rope_parameters", None)
    if rope is None:
        rope = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    return dict(rope)


def _sliding_window(config) -> int | None:
    """The window that config attends within, None when it attends to the whole context."""
    qwen = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    if getattr(config, "model_type", None) in qwen and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None)


def _check_llama_family_options(path: Path, config, architecture: Architecture) -> None:
    window = _sliding_window(config)
    if window is not None and window < config.max_position_embeddings:
        raise ValueError(f"{path}: sliding_window = {window} is shorter than max_position_embeddings "
                         f"({config.max_position_embeddings}): this project's attention sees the whole context, so a "
                         f"sliding-window model (as {architecture.name} configs of Mistral 7B v0.1/v0.2 are) does not "
                         f"convert; only sliding_window null, or at least max_position_embeddings, does")
    kind = _hf_rope(config).get("rope_type", _hf_rope(config).get("type", "default"))
    if kind not in ("default", *SCALING_KEYS):
        raise ValueError(f"{path}: rope_scaling of type {kind!r} is not supported: only \"llama3\" scaling (Llama "
                         f"3.1+), \"yarn\" (Qwen's long context) or none")
    missing = [key for key in SCALING_KEYS.get(kind, ()) if key not in _hf_rope(config)]
    head_dim, default_head_dim = getattr(config, "head_dim", None), config.hidden_size // config.num_attention_heads
    attention_bias, mlp_bias = getattr(config, "attention_bias", False), getattr(config, "mlp_bias", False)
    unsupported = {
        "rope_scaling": (bool(missing), f"lacks {missing}"),
        "hidden_act": (config.hidden_act != "silu", "only silu (SwiGLU) exists here"),
        "head_dim": (architecture.model_type in ("qwen2", "qwen2_moe") and head_dim not in (None, default_head_dim),
                     f"a Qwen2 head is hidden_size / num_attention_heads = {default_head_dim} wide here"),
        "attention_bias": (attention_bias != mlp_bias, f"with mlp_bias = {mlp_bias}: biases here are on every "
                                                       f"linear layer, on none, or on q, k and v only (Qwen2)")}
    if architecture.model_type in ("qwen3", "qwen3_moe"):  # attention_bias: a bias on q, k, v and o, the MLP none
        unsupported["attention_bias"] = (attention_bias, "Qwen3 models convert without attention biases only")
    if architecture.model_type in MOE_MODEL_TYPES:
        unsupported.update(_unsupported_moe_options(config))
    if architecture.model_type == "deepseek_v3":
        unsupported.update(_unsupported_deepseek_v3_options(config))
    for key, (bad, why) in unsupported.items():
        if bad:
            raise ValueError(f"{path}: {key} = {getattr(config, key, None)!r} has no equivalent in this project's "
                             f"GPT: {why}")


def _unsupported_moe_options(config) -> dict[str, tuple[bool, str]]:
    dense = sorted(set(getattr(config, "mlp_only_layers", None) or []))
    return {
        "mlp_only_layers": (dense != list(range(len(dense))),
                            "only the first k blocks can be dense here (mlp_only_layers [0, ..., k-1]: "
                            "model.moe.first_dense_layers = k)"),
        "router_jitter_noise": (getattr(config, "router_jitter_noise", 0.0) != 0.0,
                                "the router here multiplies no noise into its input: only 0"),
        "shared_expert_intermediate_size": (config.model_type == "qwen2_moe" and
                                            not getattr(config, "shared_expert_intermediate_size", 0) > 0,
                                            "a Qwen2-MoE block has its shared expert here: only > 0"),
    }


def _unsupported_deepseek_v3_options(config) -> dict[str, tuple[bool, str]]:
    """The keys of a DeepseekV3 config with no equivalent here. scoring_func, topk_method and moe_layer_freq are keys
    of DeepSeek's own config class (its checkpoints carry them), which transformers' lacks and ignores."""
    sparse = config.first_k_dense_replace < config.num_hidden_layers
    heads = config.num_attention_heads
    return {
        "attention_bias": (config.attention_bias and config.first_k_dense_replace > 0,
                           "attention_bias is bias \"all\" here, which gives the dense blocks' MLP biases that "
                           "DeepseekV3MLP has not: only with first_k_dense_replace 0 (every block sparse)"),
        "num_key_value_heads": (config.num_key_value_heads not in (None, heads),
                                f"under multi-head latent attention every query head has its own key and value, "
                                f"expanded from the shared latent: only num_attention_heads ({heads})"),
        "scoring_func": (getattr(config, "scoring_func", "sigmoid") != "sigmoid",
                         "the router here scores by sigmoid, as DeepseekV3TopkRouter does (model.moe.router "
                         "\"sigmoid_bias\"); softmax scoring is DeepSeek-V2's, no DeepseekV3ForCausalLM"),
        "topk_method": (getattr(config, "topk_method", "noaux_tc") != "noaux_tc",
                        "the router here takes the top k of the bias-corrected scores in the best groups (noaux_tc, "
                        "as DeepseekV3TopkRouter); DeepSeek-V2's greedy and group_limited_greedy are not built"),
        "moe_layer_freq": (getattr(config, "moe_layer_freq", 1) != 1,
                           "transformers' DeepseekV3 makes every block after first_k_dense_replace sparse whatever "
                           "this says, DeepSeek's own code every moe_layer_freq-th: only 1, where they agree"),
        "n_group": (sparse and config.n_group is None, "DeepseekV3TopkRouter groups the experts by it: give an "
                                                       "integer (1: no groups)"),
        "topk_group": (sparse and config.topk_group is None, "DeepseekV3TopkRouter keeps this many groups: give an "
                                                             "integer (n_group: every group)"),
        "n_shared_experts": (sparse and not config.n_shared_experts,
                             "a DeepseekV3 MoE block always has its shared experts: only >= 1"),
    }


def fp8_block_size(config, source: str | Path = "config.json") -> tuple[int, int] | None:
    """(rows, columns) of the block each scale of a block-scaled fp8 checkpoint covers (DeepSeek-V3's
    quantization_config: quant_method "fp8", fmt "e4m3", weight_block_size [128, 128]), None for an unquantised one;
    ValueError for any other quantization, naming the key. hf/importer.py dequantises such weights as it reads them."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    if not isinstance(quantization, dict):  # a transformers QuantizationConfig object
        quantization = quantization.to_dict()
    block = quantization.get("weight_block_size")
    checks = {"quant_method": quantization.get("quant_method") == "fp8",
              "fmt": quantization.get("fmt", "e4m3") == "e4m3",
              "weight_block_size": isinstance(block, (list, tuple)) and len(block) == 2
              and all(isinstance(size, int) and size > 0 for size in block)}
    for key, fits in checks.items():
        if not fits:
            raise ValueError(f"{source}: quantization_config.{key} = {quantization.get(key)!r} is not read here: only "
                             f"DeepSeek's block-scaled fp8 converts (quant_method \"fp8\", fmt \"e4m3\", "
                             f"weight_block_size [rows, columns]: each weight float8_e4m3fn, its weight_scale_inv one "
                             f"fp32 scale per block), dequantised on import; dequantise the checkpoint first, or "
                             f"import its unquantised release")
    return int(block[0]), int(block[1])


def architecture_of(config) -> Architecture:
    """The Architecture of a transformers config read by read_hf_config."""
    names = getattr(config, "architectures", None) or []
    if len(names) == 1 and names[0] in ARCHITECTURES:
        return ARCHITECTURES[names[0]]
    return next(a for a in ARCHITECTURES.values() if a.model_type == config.model_type)


def model_fields_from_hf(config) -> dict[str, Any]:
    """The ModelConfig fields an HF config fixes."""
    if config.model_type == "gpt2":
        return {"num_layers": config.n_layer, "hidden_size": config.n_embd, "num_attention_heads": config.n_head,
                "max_position_embeddings": config.n_positions, "vocab_size": config.vocab_size,
                "ffn_hidden_size": config.n_inner or 4 * config.n_embd, "layernorm_epsilon": config.layer_norm_epsilon,
                "activation": ACTIVATION_FROM_HF[config.activation_function], "position_embedding": "learned",
                "norm": "layernorm", "mlp": "gelu", "num_key_value_heads": config.n_head, "tie_word_embeddings": True,
                "bias": "all", "head_dim": config.n_embd // config.n_head, "qk_layernorm": False, "moe": None,
                **_attention_fields(config)}
    rope = _hf_rope(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    kept = SCALING_KEYS.get(kind, ()) + (YARN_OPTIONAL_KEYS if kind == "yarn" else ())
    scaling = None if kind == "default" else {"rope_type": kind, **{k: rope[k] for k in kept if rope.get(k) is not None}}
    if config.model_type == "qwen2":
        bias = "qkv"
    elif config.model_type == "qwen2_moe":
        bias = "qkv" if config.qkv_bias else "none"
    else:
        bias = "all" if getattr(config, "attention_bias", False) else "none"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads or config.num_attention_heads,
            "max_position_embeddings": config.max_position_embeddings, "vocab_size": config.vocab_size,
            "ffn_hidden_size": config.intermediate_size, "layernorm_epsilon": config.rms_norm_eps,
            "position_embedding": "rope", "rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_scaling": scaling,
            "norm": "rmsnorm", "mlp": "swiglu", "tie_word_embeddings": bool(config.tie_word_embeddings), "bias": bias,
            "head_dim": head_dim, "qk_layernorm": config.model_type in ("qwen3", "qwen3_moe"),
            "moe": _moe_fields_from_hf(config), **_attention_fields(config)}


def _attention_fields(config) -> dict[str, Any]:
    """model.attention_type and MLA's fields (null but under MLA). Under MLA head_dim is qk_nope + qk_rope (HF's
    head_dim is the rope part) and the key/value heads are the query heads; transformers' forward takes a null
    rope_interleave as false (rotate_half), and so does this."""
    if config.model_type != "deepseek_v3":
        return {"attention_type": "mha", **dict.fromkeys(MLA_FIELDS)}
    fields = {name: getattr(config, name) for name in MLA_FIELDS}
    return {**fields, "attention_type": "mla", "rope_interleave": bool(config.rope_interleave),
            "head_dim": config.qk_nope_head_dim + config.qk_rope_head_dim,
            "num_key_value_heads": config.num_attention_heads}


def _moe_fields_from_hf(config) -> dict[str, Any] | None:
    """model.moe of an HF config (the module docstring's table); None for a dense model."""
    if config.model_type not in MOE_MODEL_TYPES:
        return None
    if config.model_type == "deepseek_v3":
        return _deepseek_v3_moe_fields(config)
    top_k = config.num_experts_per_tok
    fields = dict(num_experts=config.num_experts, top_k=top_k, router="softmax",
                  aux_loss_coeff=config.router_aux_loss_coef * top_k)
    if config.model_type == "mixtral":  # every block sparse, the top k always renormalised, no shared expert
        return dict(fields, moe_ffn_hidden_size=config.intermediate_size, norm_topk_prob=True,
                    shared_expert_ffn_hidden_size=0, sparse_every=1, first_dense_layers=0)
    shared = config.shared_expert_intermediate_size if config.model_type == "qwen2_moe" else 0
    return dict(fields, moe_ffn_hidden_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                shared_expert_ffn_hidden_size=shared, sparse_every=config.decoder_sparse_step,
                first_dense_layers=len(set(config.mlp_only_layers or [])))


def _deepseek_v3_moe_fields(config) -> dict[str, Any] | None:
    """DeepSeek's experts (the module docstring's table); None when first_k_dense_replace leaves no block sparse. The
    losses' coefficients are no key transformers reads: model.moe's defaults."""
    if config.first_k_dense_replace >= config.num_hidden_layers:
        return None
    return dict(num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                moe_ffn_hidden_size=config.moe_intermediate_size, router="sigmoid_bias",
                norm_topk_prob=bool(config.norm_topk_prob), routed_scaling_factor=float(config.routed_scaling_factor),
                n_group=config.n_group, topk_group=config.topk_group,
                shared_expert_ffn_hidden_size=config.n_shared_experts * config.moe_intermediate_size,
                shared_expert_gate=False, sparse_every=1, first_dense_layers=config.first_k_dense_replace)


def _differences(model: ModelConfig, wanted: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """field -> (the model's value, the HF one) for every field that differs; model.moe field by field, over the
    fields of its function only (MOE_FUNCTION_FIELDS)."""
    different = {}
    for field, value in wanted.items():
        ours = getattr(model, field)
        if field == "moe" and ours is not None and value is not None:
            theirs = MoEConfig.from_dict(value)
            different.update({f"moe.{key}": (getattr(ours, key), getattr(theirs, key)) for key in MOE_FUNCTION_FIELDS
                              if getattr(ours, key) != getattr(theirs, key)})
        elif field == "moe" and (ours is None) != (value is None):
            different[field] = (None if ours is None else dataclasses.asdict(ours), value)
        elif field != "moe" and ours != value:
            different[field] = (ours, value)
    return different


def check_model_matches(model: ModelConfig, hf, config_source: str, hf_dir: str | Path) -> None:
    """ValueError naming every ModelConfig field that differs from the HF model's, and the options that fix it:
    model.from_hf (the whole model block from the HF config), or each field."""
    different = _differences(model, model_fields_from_hf(hf))
    if not different:
        return
    whole = set_option("model.from_hf", str(hf_dir))
    fixes = " ".join(set_option(f"model.{field}", value) for field, (_, value) in different.items())
    hf_source = f"{hf_dir}/config.json"
    architecture, fits = architecture_of(hf), compatible_architectures(model)
    if architecture not in fits:
        target = f"only {' / '.join(a.name for a in fits)}" if fits else "no Hugging Face architecture"
        raise ValueError(f"{hf_source} is a {architecture.name}, but the model of {config_source} fits {target}: "
                         f"take the model block from the HF config with {whole} (or set its fields: {fixes})")
    wrong = [f"model.{field} is {ours!r} in {config_source}, the HF model has {value!r}"
             for field, (ours, value) in different.items()]
    raise ValueError(f"the run config's model does not match {hf_source}:\n  " + "\n  ".join(wrong) +
                     f"\ntake the model block from the HF config with {whole} (or set these fields: {fixes})")
