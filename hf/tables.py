"""The map between this project's tensors and Hugging Face's: one literal table per architecture.

Five dense architectures, each the same function as this project's GPT with the matching ModelConfig fields:

    GPT2LMHeadModel      position_embedding "learned", norm "layernorm", mlp "gelu", tied, bias "all", multi-head
    LlamaForCausalLM     position_embedding "rope" (llama3 scaling or none), norm "rmsnorm", mlp "swiglu", grouped KV
                         heads, tied or not, bias "none" (or "all": attention_bias and mlp_bias)
    MistralForCausalLM   as Llama, bias "none"; a sliding window shorter than the context is refused
    Qwen2ForCausalLM     as Llama, bias "qkv" (q, k and v projections only); no sliding window
    Qwen3ForCausalLM     as Llama, bias "none", qk_layernorm (per-head RMSNorm q_norm / k_norm), head_dim free

and three Mixture-of-Experts architectures (``model.moe``, router "softmax"; the sparse blocks' MLP is the
MoE block, model/moe.py, the others keep the dense SwiGLU MLP):

    MixtralForCausalLM   as Mistral; every block sparse, norm_topk_prob true, no shared expert
    Qwen2MoeForCausalLM  as Qwen2 (bias "qkv", or "none": qkv_bias false); a shared expert with its sigmoid gate;
                         dense blocks where decoder_sparse_step / mlp_only_layers (a prefix) say
    Qwen3MoeForCausalLM  as Qwen3; no shared expert; dense blocks as Qwen2-MoE's

and one with multi-head latent attention (model.attention_type "mla", model/mla.py), its MoE DeepSeek's (router
"sigmoid_bias": e_score_correction_bias is the router's expert_bias buffer, kept fp32 both sides, ``FP32_TENSORS``):

    DeepseekV3ForCausalLM  DeepSeek-V3, Kimi-K2 (model_type "kimi_k2"), Moonlight: rope (YaRN with mscale or none),
                           rmsnorm, swiglu; q_lora_rank set (q_a_proj, q_a_layernorm, q_b_proj) or null (q_proj);
                           every MLA tensor copied as it is (the same names and per-head row layout; rope_interleave
                           changes the forward, not the weights); the first first_dense_layers blocks dense, the others
                           sparse with an ungated shared expert (shared_experts); tied or untied head; bias "none", or
                           "all" (attention_bias) where no block is dense. Dense MLA models convert too (every block
                           dense: first_k_dense_replace = num_hidden_layers). Its multi-token prediction layer
                           (model.layers.{num_hidden_layers}) is skipped on import, with a notice (hf/importer.py)

Each architecture is one table below (``ARCHITECTURES``): our (layer, tensor) -> the HF name(s), ``{}`` standing for
the block index and ``{expert}`` for the expert (one HF tensor, or gate and up, per expert), and the name of the
transform (hf/transforms.py) that turns one into the other. The expert names are those transformers (5.x) writes
with save_pretrained and the original checkpoints have; in memory it fuses them into 3-D ``experts.gate_up_proj``
and ``experts.down_proj``, which it also loads but does not write. ``layer_maps`` lists every saved layer of a model
with its tensors, shapes and TP split; the layer index is the XX of layer_XX files: 0 word embedding, 1 positions,
2..L+1 blocks, L+2 final norm, L+3 the untied head.

The layer maps describe every tensor of our layer files, parameters and persistent buffers, for any shape: a shape
no architecture fits (a mixed shape, the "sigmoid_bias" router without MLA) still has them, its tensors without HF
names, so that reading a checkpoint, resharding it and evaluating it work (evaluation/loading.py). What needs HF names
(the export, the import, ``hf_shapes``, ``hf_config``) resolves an architecture first and refuses such a shape in one
line (``resolve_architecture``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from common.dtypes import torch_dtypes
from model.config import ModelConfig, set_option

HF_ARCHITECTURE = "GPT2LMHeadModel"  # the default architecture of this project's default (GPT-2) shape
PRECISION_DTYPES = torch_dtypes()
"""{"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}: common/dtypes.py's table, kept here by name
for the code that imports it from hf."""


# Our tensors, by (layer kind, state_dict key): unsharded dims (symbols of ``_dimensions``) and the dimension split
# over TP ranks (None: replicated). Which of them a model has follows from its config (``_our_keys``), whether or not
# an HF architecture has a name for them (the sigmoid_bias router's expert_bias has one in DeepseekV3 only). The dims
# also say how the shards join (hf/transforms.py merge_shards): a split "padded_vocab" carries padding rows for the TP
# size, a split "2f" / "2fe" / "2fs" holds each rank's [gate_r; up_r], any other split dimension is cut in rank order.
OUR_TENSORS: dict[tuple[str, str], tuple[tuple[str, ...], int | None]] = {
    ("embedding", "weight"): (("padded_vocab", "h"), 0),
    ("positions", "weight"): (("positions", "h"), None),
    ("block", "ln1.weight"): (("h",), None),
    ("block", "ln1.bias"): (("h",), None),
    ("block", "attention.qkv.weight"): (("qkv", "h"), 0),
    ("block", "attention.qkv.bias"): (("qkv",), 0),
    ("block", "attention.q_norm.weight"): (("d",), None),
    ("block", "attention.k_norm.weight"): (("d",), None),
    ("block", "attention.q_proj.weight"): (("q_heads", "h"), 0),  # MLA (model/mla.py): rows whole heads
    ("block", "attention.q_a_proj.weight"): (("q_lora", "h"), None),
    ("block", "attention.q_a_proj.bias"): (("q_lora",), None),
    ("block", "attention.q_a_layernorm.weight"): (("q_lora",), None),
    ("block", "attention.q_b_proj.weight"): (("q_heads", "q_lora"), 0),
    ("block", "attention.kv_a_proj_with_mqa.weight"): (("kv_down", "h"), None),
    ("block", "attention.kv_a_proj_with_mqa.bias"): (("kv_down",), None),
    ("block", "attention.kv_a_layernorm.weight"): (("kv_lora",), None),
    ("block", "attention.kv_b_proj.weight"): (("kv_heads", "kv_lora"), 0),
    ("block", "attention.dense.weight"): (("h", "attention"), 1),
    ("block", "attention.dense.bias"): (("h",), None),
    ("block", "ln2.weight"): (("h",), None),
    ("block", "ln2.bias"): (("h",), None),
    ("block", "mlp.fc1.weight"): (("f", "h"), 0),
    ("block", "mlp.fc1.bias"): (("f",), 0),
    ("block", "mlp.fc2.weight"): (("h", "f"), 1),
    ("block", "mlp.fc2.bias"): (("h",), None),
    ("block", "mlp.gate_up.weight"): (("2f", "h"), 0),
    ("block", "mlp.gate_up.bias"): (("2f",), 0),
    ("block", "mlp.down.weight"): (("h", "f"), 1),
    ("block", "mlp.down.bias"): (("h",), None),
    ("block", "mlp.block.router.weight"): (("experts", "h"), None),
    ("block", "mlp.block.router.expert_bias"): (("experts",), None),  # a persistent buffer ("sigmoid_bias")
    ("block", "mlp.block.experts.gate_up"): (("experts", "2fe", "h"), 1),
    ("block", "mlp.block.experts.down"): (("experts", "h", "fe"), 2),
    ("block", "mlp.block.shared_expert.gate_up"): (("2fs", "h"), 0),
    ("block", "mlp.block.shared_expert.down"): (("h", "fs"), 1),
    ("block", "mlp.block.shared_expert.gate"): (("one", "h"), None),
    ("final_norm", "weight"): (("h",), None),
    ("final_norm", "bias"): (("h",), None),
    ("head", "weight"): (("padded_vocab", "h"), 0),
    # model.mtp's depth (model/mtp.py): its own norms and projection, beside its block (the "block" keys above)
    ("mtp", "enorm.weight"): (("h",), None),
    ("mtp", "enorm.bias"): (("h",), None),
    ("mtp", "hnorm.weight"): (("h",), None),
    ("mtp", "hnorm.bias"): (("h",), None),
    ("mtp", "eh_proj.weight"): (("h", "2h"), None),
    ("mtp", "final_norm.weight"): (("h",), None),
    ("mtp", "final_norm.bias"): (("h",), None),
}

# transform name -> (HF stores the transpose, layout); the layouts are handled by split_from_hf / merge_to_hf
TRANSFORMS = {"copy": (False, "plain"), "vocab": (False, "vocab"), "conv1d": (True, "plain"),
              "conv1d_qkv": (True, "qkv"), "grouped_qkv": (False, "grouped_qkv"), "gate_up": (False, "gate_up"),
              "experts": (False, "experts"), "experts_gate_up": (False, "experts_gate_up")}
# a layout of [E, ...] tensors, one HF tensor (or gate and up) per expert -> the layout of each expert's [...] slice
EXPERT_LAYOUTS = {"experts": "plain", "experts_gate_up": "gate_up"}

GPT2_TENSORS = {
    ("embedding", "weight"): ("transformer.wte.weight", "vocab"),
    ("positions", "weight"): ("transformer.wpe.weight", "copy"),
    ("block", "ln1.weight"): ("transformer.h.{}.ln_1.weight", "copy"),
    ("block", "ln1.bias"): ("transformer.h.{}.ln_1.bias", "copy"),
    ("block", "attention.qkv.weight"): ("transformer.h.{}.attn.c_attn.weight", "conv1d_qkv"),
    ("block", "attention.qkv.bias"): ("transformer.h.{}.attn.c_attn.bias", "conv1d_qkv"),
    ("block", "attention.dense.weight"): ("transformer.h.{}.attn.c_proj.weight", "conv1d"),
    ("block", "attention.dense.bias"): ("transformer.h.{}.attn.c_proj.bias", "copy"),
    ("block", "ln2.weight"): ("transformer.h.{}.ln_2.weight", "copy"),
    ("block", "ln2.bias"): ("transformer.h.{}.ln_2.bias", "copy"),
    ("block", "mlp.fc1.weight"): ("transformer.h.{}.mlp.c_fc.weight", "conv1d"),
    ("block", "mlp.fc1.bias"): ("transformer.h.{}.mlp.c_fc.bias", "copy"),
    ("block", "mlp.fc2.weight"): ("transformer.h.{}.mlp.c_proj.weight", "conv1d"),
    ("block", "mlp.fc2.bias"): ("transformer.h.{}.mlp.c_proj.bias", "copy"),
    ("final_norm", "weight"): ("transformer.ln_f.weight", "copy"),
    ("final_norm", "bias"): ("transformer.ln_f.bias", "copy"),
}

_ATTENTION = "model.layers.{}.self_attn."
LLAMA_TENSORS = {  # LlamaForCausalLM; MistralForCausalLM and Qwen2ForCausalLM name their tensors the same way
    ("embedding", "weight"): ("model.embed_tokens.weight", "vocab"),
    ("block", "ln1.weight"): ("model.layers.{}.input_layernorm.weight", "copy"),
    ("block", "attention.qkv.weight"): ((_ATTENTION + "q_proj.weight", _ATTENTION + "k_proj.weight",
                                         _ATTENTION + "v_proj.weight"), "grouped_qkv"),
    ("block", "attention.qkv.bias"): ((_ATTENTION + "q_proj.bias", _ATTENTION + "k_proj.bias",
                                       _ATTENTION + "v_proj.bias"), "grouped_qkv"),
    ("block", "attention.dense.weight"): (_ATTENTION + "o_proj.weight", "copy"),
    ("block", "attention.dense.bias"): (_ATTENTION + "o_proj.bias", "copy"),
    ("block", "ln2.weight"): ("model.layers.{}.post_attention_layernorm.weight", "copy"),
    ("block", "mlp.gate_up.weight"): (("model.layers.{}.mlp.gate_proj.weight", "model.layers.{}.mlp.up_proj.weight"),
                                      "gate_up"),
    ("block", "mlp.gate_up.bias"): (("model.layers.{}.mlp.gate_proj.bias", "model.layers.{}.mlp.up_proj.bias"),
                                    "gate_up"),
    ("block", "mlp.down.weight"): ("model.layers.{}.mlp.down_proj.weight", "copy"),
    ("block", "mlp.down.bias"): ("model.layers.{}.mlp.down_proj.bias", "copy"),
    ("final_norm", "weight"): ("model.norm.weight", "copy"),
    ("head", "weight"): ("lm_head.weight", "vocab"),
}
QWEN3_TENSORS = {**LLAMA_TENSORS,  # Qwen3ForCausalLM: Llama's names, and a norm on each query and key head
                 ("block", "attention.q_norm.weight"): (_ATTENTION + "q_norm.weight", "copy"),
                 ("block", "attention.k_norm.weight"): (_ATTENTION + "k_norm.weight", "copy")}

_DENSE_MLP = {("block", f"mlp.{linear}.{p}") for linear in ("gate_up", "down") for p in ("weight", "bias")}
_MIXTRAL_MOE = "model.layers.{}.block_sparse_moe."
MIXTRAL_TENSORS = {**{key: value for key, value in LLAMA_TENSORS.items() if key not in _DENSE_MLP},
                   ("block", "mlp.block.router.weight"): (_MIXTRAL_MOE + "gate.weight", "copy"),
                   ("block", "mlp.block.experts.gate_up"): ((_MIXTRAL_MOE + "experts.{expert}.w1.weight",
                                                            _MIXTRAL_MOE + "experts.{expert}.w3.weight"),
                                                           "experts_gate_up"),
                   ("block", "mlp.block.experts.down"): (_MIXTRAL_MOE + "experts.{expert}.w2.weight", "experts")}
_QWEN_MOE = "model.layers.{}.mlp."
_QWEN_EXPERTS = {
    ("block", "mlp.block.router.weight"): (_QWEN_MOE + "gate.weight", "copy"),
    ("block", "mlp.block.experts.gate_up"): ((_QWEN_MOE + "experts.{expert}.gate_proj.weight",
                                             _QWEN_MOE + "experts.{expert}.up_proj.weight"), "experts_gate_up"),
    ("block", "mlp.block.experts.down"): (_QWEN_MOE + "experts.{expert}.down_proj.weight", "experts"),
}
QWEN2_MOE_TENSORS = {**LLAMA_TENSORS, **_QWEN_EXPERTS,  # the dense blocks' MLP keeps Llama's names
                     ("block", "mlp.block.shared_expert.gate_up"): ((_QWEN_MOE + "shared_expert.gate_proj.weight",
                                                                    _QWEN_MOE + "shared_expert.up_proj.weight"),
                                                                   "gate_up"),
                     ("block", "mlp.block.shared_expert.down"): (_QWEN_MOE + "shared_expert.down_proj.weight", "copy"),
                     ("block", "mlp.block.shared_expert.gate"): (_QWEN_MOE + "shared_expert_gate.weight", "copy")}
QWEN3_MOE_TENSORS = {**QWEN3_TENSORS, **_QWEN_EXPERTS}
_LATENT_ATTENTION = {  # model/mla.py names its projections as DeepseekV3Attention does; rows whole heads in both
    ("block", f"attention.{name}"): (_ATTENTION + name, "copy") for name in (
        "q_proj.weight", "q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight", "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight", "kv_b_proj.weight")}
DEEPSEEK_V3_TENSORS = {  # Llama's embedding, norms, o_proj, dense MLP and head; Qwen-MoE's router and experts
    **{key: value for key, value in LLAMA_TENSORS.items()
       if key[1] not in ("attention.qkv.weight", "attention.qkv.bias", "mlp.gate_up.bias", "mlp.down.bias")},
    **_LATENT_ATTENTION, **_QWEN_EXPERTS,
    ("block", "mlp.block.router.expert_bias"): (_QWEN_MOE + "gate.e_score_correction_bias", "copy"),
    ("block", "mlp.block.shared_expert.gate_up"): ((_QWEN_MOE + "shared_experts.gate_proj.weight",
                                                   _QWEN_MOE + "shared_experts.up_proj.weight"), "gate_up"),
    ("block", "mlp.block.shared_expert.down"): (_QWEN_MOE + "shared_experts.down_proj.weight", "copy"),
    # the multi-token prediction module as the official checkpoint stores it, model.layers.{L + k - 1}: its block's
    # tensors under that index as any block's, and these
    ("mtp", "enorm.weight"): ("model.layers.{}.enorm.weight", "copy"),
    ("mtp", "hnorm.weight"): ("model.layers.{}.hnorm.weight", "copy"),
    ("mtp", "eh_proj.weight"): ("model.layers.{}.eh_proj.weight", "copy"),
    ("mtp", "final_norm.weight"): ("model.layers.{}.shared_head.norm.weight", "copy")}
MTP_COPIES = {"model.embed_tokens.weight": "model.layers.{}.embed_tokens.weight",
              "lm_head.weight": "model.layers.{}.shared_head.head.weight"}
"""DeepseekV3's multi-token prediction layers also store copies of the embedding and the head (``hf_copies``): an
export writes them beside the originals, an import reads the originals (model/mtp.py shares the trunk's)."""
FP32_TENSORS = frozenset({"mlp.block.router.expert_bias"})
"""Our tensors that stay fp32 whatever model.precision (model/moe.py keep_router_biases_fp32): an import writes them
fp32 and an export too (transformers keeps e_score_correction_bias fp32 as well). ``keeps_fp32`` reads it."""


def keeps_fp32(key: str) -> bool:
    """Whether our tensor ``key`` (a block's, or a model.mtp depth's block's: depths.{k}.block.<key>) stays fp32."""
    return any(key == kept or key.endswith("." + kept) for kept in FP32_TENSORS)


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture: its names and its tensor table."""

    name: str
    """config.json's ``architectures`` entry (the transformers class)."""
    model_type: str
    base_prefix: str
    """Prefix of the base model's weights: a directory saved from the base model (GPT2Model) lacks it."""
    tensors: dict[tuple[str, str], tuple[str | tuple[str, ...], str]]
    """(our layer kind, our key) -> (HF name or names, ``{}`` for the block index, ``{expert}`` for the expert;
    transform name)."""
    model_type_aliases: tuple[str, ...] = ()
    """Other config.json model_type values of checkpoints of this architecture, read with its config class (Kimi-K2:
    "kimi_k2", a DeepseekV3ForCausalLM)."""


ARCHITECTURES = {arch.name: arch for arch in (
    Architecture("GPT2LMHeadModel", "gpt2", "transformer.", GPT2_TENSORS),
    Architecture("LlamaForCausalLM", "llama", "model.", LLAMA_TENSORS),
    Architecture("MistralForCausalLM", "mistral", "model.", LLAMA_TENSORS),
    Architecture("Qwen2ForCausalLM", "qwen2", "model.", LLAMA_TENSORS),
    Architecture("Qwen3ForCausalLM", "qwen3", "model.", QWEN3_TENSORS),
    Architecture("MixtralForCausalLM", "mixtral", "model.", MIXTRAL_TENSORS),
    Architecture("Qwen2MoeForCausalLM", "qwen2_moe", "model.", QWEN2_MOE_TENSORS),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "model.", QWEN3_MOE_TENSORS),
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3", "model.", DEEPSEEK_V3_TENSORS, ("kimi_k2",)),
)}


def compatible_architectures(config: ModelConfig) -> list[Architecture]:
    """The HF architectures that compute this model's function, preferred first (none for a mixed shape).

    GPT-2 and Qwen2 have no head_dim of their own (hidden_size / heads); only Qwen3 has the q/k norms; only
    DeepseekV3 has multi-head latent attention."""
    if config.attention_type == "mla":
        return [ARCHITECTURES["DeepseekV3ForCausalLM"]] if _fits_deepseek_v3(config) else []
    default_head_dim = config.head_dim * config.num_attention_heads == config.hidden_size
    if (config.position_embedding, config.norm, config.mlp, config.tie_word_embeddings, config.bias,
            config.qk_layernorm) == ("learned", "layernorm", "gelu", True, "all", False) and (
            config.num_key_value_heads == config.num_attention_heads and default_head_dim):
        return [ARCHITECTURES["GPT2LMHeadModel"]]
    if (config.position_embedding, config.norm, config.mlp) != ("rope", "rmsnorm", "swiglu"):
        return []
    if config.moe is not None:
        return _moe_architectures(config, default_head_dim)
    if config.qk_layernorm:
        return [ARCHITECTURES["Qwen3ForCausalLM"]] if config.bias == "none" else []
    names = {"none": ["LlamaForCausalLM", "MistralForCausalLM"], "all": ["LlamaForCausalLM"],
             "qkv": ["Qwen2ForCausalLM"] if default_head_dim else []}[config.bias]
    return [ARCHITECTURES[name] for name in names]


def _moe_architectures(config: ModelConfig, default_head_dim: bool) -> list[Architecture]:
    """The one MoE architecture of a rope/rmsnorm/swiglu model with experts, if any: Qwen3-MoE has the q/k norms,
    Qwen2-MoE the shared expert, Mixtral neither (and every block sparse, the top k renormalised)."""
    moe = config.moe
    shared = moe.shared_expert_ffn_hidden_size > 0
    if moe.router != "softmax" or moe.routed_scaling_factor != 1.0 or (shared and not moe.shared_expert_gate):
        return []
    if config.qk_layernorm:
        fits = config.bias == "none" and not shared
        name = "Qwen3MoeForCausalLM"
    elif shared:
        fits = config.bias in ("qkv", "none") and default_head_dim
        name = "Qwen2MoeForCausalLM"
    else:
        fits = (config.bias == "none" and moe.norm_topk_prob and moe.sparse_every == 1
                and moe.first_dense_layers == 0)
        name = "MixtralForCausalLM"
    return [ARCHITECTURES[name]] if fits else []


def _fits_deepseek_v3(config: ModelConfig) -> bool:
    """An MLA model is a DeepseekV3ForCausalLM with RoPE, RMSNorm and SwiGLU, and, when it has experts, DeepSeek's:
    the "sigmoid_bias" router, an ungated shared expert n_shared_experts x moe_ffn_hidden_size wide, every block
    sparse after the first first_dense_layers (first_k_dense_replace). Biases "none", or "all" (attention_bias: q_a,
    kv_a and o_proj) where no block is dense: DeepseekV3MLP has no bias, our dense MLP would."""
    if (config.position_embedding, config.norm, config.mlp) != ("rope", "rmsnorm", "swiglu"):
        return False
    moe = config.moe
    if moe is None:
        return config.bias == "none"
    shared = moe.shared_expert_ffn_hidden_size
    return (moe.router == "sigmoid_bias" and not moe.shared_expert_gate and shared > 0
            and shared % moe.moe_ffn_hidden_size == 0 and moe.sparse_every == 1
            and (config.bias == "none" or moe.first_dense_layers == 0))


def _no_latent_attention_architecture_message(config: ModelConfig) -> str:
    fields = {key: getattr(config, key) for key in ("position_embedding", "norm", "mlp", "bias")}
    shape = ", ".join(f"model.{k} = {v!r}" for k, v in fields.items())
    if config.moe is not None:
        shape += ", " + ", ".join(f"model.moe.{key} = {getattr(config.moe, key)!r}" for key in (
            "router", "shared_expert_ffn_hidden_size", "moe_ffn_hidden_size", "shared_expert_gate", "sparse_every",
            "first_dense_layers"))
    return (f"this multi-head latent attention model's shape ({shape}) is no DeepseekV3ForCausalLM, the one Hugging "
            f"Face architecture with MLA: it needs rope/rmsnorm/swiglu, bias none (or all with every block sparse), "
            f"and experts (if any) routed by \"sigmoid_bias\" with an ungated shared expert (shared_expert_gate false) "
            f"a multiple of moe_ffn_hidden_size wide in every block after first_dense_layers (sparse_every 1): "
            f"evaluate or generate from the checkpoint itself (tools/evaluate.py, tools/generate.py, any TP x PP)")


def _no_architecture_message(config: ModelConfig) -> str:
    if config.attention_type == "mla":
        return _no_latent_attention_architecture_message(config)
    fields = {key: getattr(config, key) for key in ("position_embedding", "norm", "mlp", "tie_word_embeddings",
                                                    "bias", "num_key_value_heads", "head_dim", "qk_layernorm")}
    shape = ", ".join(f"model.{k} = {v!r}" for k, v in fields.items())
    if config.moe is not None:
        experts = ", ".join(f"model.moe.{key} = {getattr(config.moe, key)!r}" for key in (
            "router", "norm_topk_prob", "shared_expert_ffn_hidden_size", "sparse_every", "first_dense_layers"))
        if config.moe.router != "softmax":  # the one field no architecture has: say so first, with the fix
            return (f"this Mixture-of-Experts model's shape ({shape}, {experts}) is no Hugging Face architecture "
                    f"converted here: model.moe.router {config.moe.router!r} has none without multi-head latent "
                    f"attention (DeepseekV3ForCausalLM's, model.attention_type \"mla\"; Mixtral, Qwen2-MoE and "
                    f"Qwen3-MoE route by softmax): evaluate or generate from the checkpoint itself (tools/evaluate.py, "
                    f"tools/generate.py, any TP x PP), or train with {set_option('model.moe.router', 'softmax')} for a "
                    f"model that exports")
        return (f"this Mixture-of-Experts model's shape ({shape}, {experts}) is no Hugging Face architecture "
                f"converted here: all need router \"softmax\"; Mixtral bias none, no qk_layernorm, no shared expert, "
                f"norm_topk_prob true and every block sparse; Qwen2-MoE a shared expert, bias qkv or none, no "
                f"qk_layernorm, head_dim hidden_size / heads; Qwen3-MoE qk_layernorm, bias none, no shared expert")
    return (f"this model's shape ({shape}) is no Hugging Face architecture converted here: GPT-2's is "
            f"learned/layernorm/gelu/tied/bias all, the Llama family's rope/rmsnorm/swiglu (Qwen3's with qk_layernorm "
            f"and bias none)")


def resolve_architecture(config: ModelConfig, name: str | None = None) -> Architecture:
    """``name`` (checked against the model's shape), or the first architecture that fits the shape."""
    fits = compatible_architectures(config)
    if name is not None and name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r} is not supported: choose one of {sorted(ARCHITECTURES)}")
    if not fits:
        raise ValueError(_no_architecture_message(config))
    if name is None:
        return fits[0]
    if ARCHITECTURES[name] not in fits:
        raise ValueError(f"this model's shape converts only to {' / '.join(a.name for a in fits)}, not {name}")
    return ARCHITECTURES[name]


class TensorMap(NamedTuple):
    """One tensor of one layer, here and in Hugging Face."""

    ours: str
    """Key in the layer's state_dict (one layer_XX file)."""
    hf: str | tuple[str, ...] | None
    """Key in the HF state_dict; several for a tensor fused here ("grouped_qkv": q, k, v; "gate_up": gate, up;
    "experts": one per expert; "experts_gate_up": gate and up of expert 0, of expert 1, ...). None: the layer map of
    a shape no HF architecture fits (the tensor is ours only; ``transposed`` and ``layout`` are then the defaults)."""
    dims: tuple[str, ...]
    """Unsharded shape here, in the symbols of ``_dimensions`` (h, qkv, f, 2f, d, attention, positions,
    padded_vocab; experts, fe, 2fe, fs, 2fs, one)."""
    partition_dim: int | None = None
    """Dimension split over TP ranks here; None: replicated on every TP rank."""
    transposed: bool = False
    """HF's Conv1D stores [in, out], the transpose of our Linear's [out, in]."""
    layout: str = "plain"
    """"qkv": GPT-2's rows per head [heads, 3, d] here, [3, heads, d] in HF; "grouped_qkv": rows per KV group here,
    HF's q, k, v apart; "gate_up": [gate_r; up_r] per TP rank here, HF's gate and up apart; "vocab": padding rows
    here only; "experts" / "experts_gate_up": [E, ...] here, each expert's slice "plain" / "gate_up" (its own HF
    tensors)."""

    @property
    def hf_names(self) -> tuple[str, ...]:
        return () if self.hf is None else (self.hf,) if isinstance(self.hf, str) else self.hf


class LayerMap(NamedTuple):
    index: int
    """Position in gpt_layer_specs, the XX of layer_XX files."""
    name: str
    tensors: tuple[TensorMap, ...]


def _our_keys(config: ModelConfig, kind: str, block: int = 0) -> list[str]:
    """The state_dict keys of one layer of this model (layer kinds as in OUR_TENSORS; ``block`` 0-based)."""
    norm = ["weight", "bias"] if config.norm == "layernorm" else ["weight"]
    if kind == "embedding":
        return ["weight"]
    if kind == "positions":
        return ["weight"] if config.position_embedding == "learned" else []
    if kind == "final_norm":
        return norm
    if kind == "head":
        return [] if config.tie_word_embeddings else ["weight"]
    if kind == "mtp":
        return [f"{which}.{p}" for which in ("enorm", "hnorm") for p in norm] + ["eh_proj.weight"] + [
            f"final_norm.{p}" for p in norm]
    first, second = ("fc1", "fc2") if config.mlp == "gelu" else ("gate_up", "down")
    keys = [f"ln1.{p}" for p in norm]
    if config.attention_type == "mla":
        keys += _latent_attention_keys(config)
    else:
        keys += ["attention.qkv.weight"] + (["attention.qkv.bias"] if config.qkv_has_bias else [])
    keys += [f"attention.{which}_norm.{p}" for which in "qk" for p in norm] if config.qk_layernorm else []
    keys += ["attention.dense.weight"] + (["attention.dense.bias"] if config.other_linears_have_bias else [])
    keys += [f"ln2.{p}" for p in norm]
    if config.moe is not None and config.moe.is_sparse(block + 1):
        return keys + _moe_keys(config)
    for linear in (first, second):
        keys += [f"mlp.{linear}.weight"] + ([f"mlp.{linear}.bias"] if config.other_linears_have_bias else [])
    return keys


def _latent_attention_keys(config: ModelConfig) -> list[str]:
    """MLA's tensors but its output projection (``dense``, as SelfAttention's), in model/mla.py's order."""
    bias = ["bias"] if config.other_linears_have_bias else []
    if config.q_lora_rank is None:
        keys = ["attention.q_proj.weight"]
    else:
        keys = [f"attention.q_a_proj.{p}" for p in ["weight", *bias]]
        keys += ["attention.q_a_layernorm.weight", "attention.q_b_proj.weight"]
    keys += [f"attention.kv_a_proj_with_mqa.{p}" for p in ["weight", *bias]]
    return keys + ["attention.kv_a_layernorm.weight", "attention.kv_b_proj.weight"]


def _moe_keys(config: ModelConfig) -> list[str]:
    """The MLP keys of a sparse block (MoEMLP(MoEBlock): model/moe.py), its persistent buffers included."""
    keys = ["mlp.block.router.weight"]
    keys += ["mlp.block.router.expert_bias"] if config.moe.router == "sigmoid_bias" else []
    keys += ["mlp.block.experts.gate_up", "mlp.block.experts.down"]
    if config.moe.shared_expert_ffn_hidden_size:
        keys += ["mlp.block.shared_expert.gate_up", "mlp.block.shared_expert.down"]
        keys += ["mlp.block.shared_expert.gate"] if config.moe.shared_expert_gate else []
    return keys


def _hf_names(hf: str | tuple[str, ...], block: int, layout: str, config: ModelConfig) -> str | tuple[str, ...]:
    """The table's name(s) with the block index filled in; per-expert names for each expert, expert-major."""
    patterns = (hf,) if isinstance(hf, str) else hf
    if layout in EXPERT_LAYOUTS:
        return tuple(p.format(block, expert=e) for e in range(config.moe.num_experts) for p in patterns)
    return hf.format(block) if isinstance(hf, str) else tuple(p.format(block) for p in patterns)


def _layer_tensors(config: ModelConfig, architecture: Architecture | None, kind: str, block: int = 0
                   ) -> tuple[TensorMap, ...]:
    """Every tensor of one layer; with the architecture's HF names, or none (``architecture`` None)."""
    tensors = []
    for key in _our_keys(config, kind, block):
        dims, partition_dim = OUR_TENSORS[kind, key]
        if architecture is None:
            tensors.append(TensorMap(key, None, dims, partition_dim))
            continue
        if (kind, key) not in architecture.tensors:
            raise ValueError(f"{architecture.name} has no tensor for this model's {kind} {key}: the model's shape "
                             f"is not a {architecture.name}")
        hf, transform = architecture.tensors[kind, key]
        transposed, layout = TRANSFORMS[transform]
        names = _hf_names(hf, block, layout, config)
        tensors.append(TensorMap(key, names, dims, partition_dim, transposed, layout))
    return tuple(tensors)


def layer_maps(config: ModelConfig, architecture: Architecture | None = None) -> list[LayerMap]:
    """Every saved layer, in pipeline order (the tied output head is the embedding, layer 0: not saved again), with
    every tensor of its files (parameters and persistent buffers), for any shape.

    ``architecture`` (checked: its table must name every tensor) gives the HF names; it defaults to the first that
    fits the model's shape (the tensor names of Llama, Mistral and Qwen2 are the same), and where none fits the
    tensors have no HF names (``TensorMap.hf`` None): what needs them resolves the architecture first."""
    if architecture is None:
        fits = compatible_architectures(config)
        architecture = fits[0] if fits else None
    last = config.num_layers + 2
    maps = [LayerMap(0, "word embedding", _layer_tensors(config, architecture, "embedding")),
            LayerMap(1, "position embedding" if config.position_embedding == "learned" else "embedding dropout",
                     _layer_tensors(config, architecture, "positions")),
            *[LayerMap(2 + i, f"transformer block {i}", _layer_tensors(config, architecture, "block", i))
              for i in range(config.num_layers)],
            LayerMap(last, "final norm", _layer_tensors(config, architecture, "final_norm"))]
    if not config.tie_word_embeddings:
        maps.append(LayerMap(last + 1, "output head", _layer_tensors(config, architecture, "head")))
    if config.mtp is not None:  # model/gpt.py: layer L + 5 (L + 4 and L + 6 use the tied embedding and head)
        maps.append(LayerMap(last + 3, "multi-token prediction", _mtp_tensors(config, architecture)))
    return maps


def _mtp_tensors(config: ModelConfig, architecture: Architecture | None) -> tuple[TensorMap, ...]:
    """model.mtp's depths, ``depths.{k}.`` + the depth's own keys, ``depths.{k}.block.`` + its block's; HF names
    where the architecture has them (DeepseekV3: model.layers.{L + k}), none otherwise (the export then leaves the
    depths out: ``exports_mtp``)."""
    named = architecture if exports_mtp(architecture) else None
    tensors = []
    for depth in range(config.mtp.depth):
        block = config.num_layers + depth  # 0-based, as the blocks': HF's layer index and is_sparse(block + 1)
        for kind, prefix in (("mtp", f"depths.{depth}."), ("block", f"depths.{depth}.block.")):
            tensors += [TensorMap(prefix + t.ours, *t[1:]) for t in _layer_tensors(config, named, kind, block)]
    return tuple(tensors)


def exports_mtp(architecture: Architecture | None) -> bool:
    """Whether the architecture stores model.mtp's depths (DeepseekV3's num_nextn_predict_layers)."""
    return architecture is not None and ("mtp", "eh_proj.weight") in architecture.tensors


def hf_copies(config: ModelConfig, architecture: Architecture) -> dict[str, tuple[str, ...]]:
    """HF name -> the names of its copies the architecture stores too (``MTP_COPIES``; the head's are the
    embedding's when tied)."""
    if config.mtp is None or not exports_mtp(architecture):
        return {}
    layers = range(config.num_layers, config.num_layers + config.mtp.depth)
    copies = {source: tuple(name.format(i) for i in layers) for source, name in MTP_COPIES.items()}
    if config.tie_word_embeddings:
        copies["model.embed_tokens.weight"] += copies.pop("lm_head.weight")
    return copies


def _dimensions(config: ModelConfig, tensor_parallel_size: int) -> dict[str, int]:
    f = config.ffn_hidden_size
    sizes = {"h": config.hidden_size, "2h": 2 * config.hidden_size, "qkv": config.qkv_size, "f": f, "2f": 2 * f, "d": config.head_dim,
             "attention": config.attention_size, "positions": config.max_position_embeddings,
             "padded_vocab": config.padded_vocab_size(tensor_parallel_size), "one": 1}
    if config.attention_type == "mla":
        heads = config.num_attention_heads
        sizes.update(q_heads=heads * config.head_dim, q_lora=config.q_lora_rank, kv_lora=config.kv_lora_rank,
                     kv_down=config.kv_lora_rank + config.qk_rope_head_dim,
                     kv_heads=heads * (config.qk_nope_head_dim + config.v_head_dim))
    if config.moe is not None:
        expert, shared = config.moe.moe_ffn_hidden_size, config.moe.shared_expert_ffn_hidden_size
        sizes.update(experts=config.moe.num_experts, fe=expert, **{"2fe": 2 * expert}, fs=shared,
                     **{"2fs": 2 * shared})
    return sizes


def full_shape(tensor: TensorMap, config: ModelConfig, tensor_parallel_size: int) -> tuple[int, ...]:
    """The unsharded shape here (the vocabulary padded for this TP size)."""
    sizes = _dimensions(config, tensor_parallel_size)
    return tuple(sizes[d] for d in tensor.dims)


def shard_shape(tensor: TensorMap, config: ModelConfig, tensor_parallel_size: int) -> tuple[int, ...]:
    shape = list(full_shape(tensor, config, tensor_parallel_size))
    if tensor.partition_dim is not None:
        shape[tensor.partition_dim] //= tensor_parallel_size
    return tuple(shape)


def hf_shape(tensor: TensorMap, config: ModelConfig) -> tuple[int, ...]:
    """The HF shape of a tensor that is one tensor in HF too."""
    shape = full_shape(tensor, config, 1)
    if tensor.layout == "vocab":
        shape = (config.vocab_size, *shape[1:])
    return tuple(reversed(shape)) if tensor.transposed else shape


def hf_tensor_shapes(tensor: TensorMap, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each HF tensor of one of ours, by name, in the order of ``tensor.hf_names``."""
    full = full_shape(tensor, config, 1)
    if tensor.layout in EXPERT_LAYOUTS:  # [E, ...]: each expert's [...] slice, or its gate and up halves
        rows, rest = full[1], full[2:]
        each = (rows // 2, *rest) if EXPERT_LAYOUTS[tensor.layout] == "gate_up" else full[1:]
        return {name: each for name in tensor.hf_names}
    rest = full[1:]  # () for a bias, (h,) for a weight
    if tensor.layout == "grouped_qkv":
        d = config.head_dim
        sizes = (config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d)
        return {name: (size, *rest) for name, size in zip(tensor.hf_names, sizes, strict=True)}
    if tensor.layout == "gate_up":  # the dense MLP's [2f, ...] or the shared expert's [2fs, ...]
        return {name: (full[0] // 2, *rest) for name in tensor.hf_names}
    return {tensor.hf: hf_shape(tensor, config)}


def hf_shapes(config: ModelConfig, architecture: Architecture | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor of the exported model, in the order the export writes them (a shape no HF architecture fits is
    refused: ``resolve_architecture``)."""
    architecture = architecture or resolve_architecture(config)
    copies = hf_copies(config, architecture)
    return {each: shape for layer in exported_layers(config, architecture) for t in layer.tensors
            for name, shape in hf_tensor_shapes(t, config).items() for each in (name, *copies.get(name, ()))}


def exported_layers(config: ModelConfig, architecture: Architecture) -> list[LayerMap]:
    """The layer maps an export writes: every one, but model.mtp's where the architecture does not store it."""
    return [layer for layer in layer_maps(config, architecture)
            if not (layer.name == "multi-token prediction" and not exports_mtp(architecture))]

