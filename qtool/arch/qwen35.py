"""Tensor-name knowledge for the Qwen3.5 MoE family (397B-A17B, 122B-A10B, 35B-A3B).

Names (docs/formats.md §2; transformers models/qwen3_5_moe, vLLM models/qwen3_5.py):
  multimodal: model.language_model.{embed_tokens,norm,layers.N.*}, model.visual.*, lm_head.*, mtp.*
  text-only:  model.{embed_tokens,norm,layers.N.*}, lm_head.*, mtp.*
Inside a decoder layer (and inside mtp.layers.0):
  input_layernorm / post_attention_layernorm          -> norm
  linear_attn.*  (Gated DeltaNet)                      -> linear_attn
  self_attn.{q,k,v,o}_proj, q_norm, k_norm             -> attention
  self_attn.k_proj.k_scale / self_attn.k_scale (+ v)   -> kv_scale
  mlp.gate                                             -> router
  mlp.shared_expert_gate                               -> shared_expert_gate
  mlp.shared_expert.{gate,up,down}_proj                -> shared_expert
  mlp.experts.{E}.{gate,up,down}_proj | mlp.experts.{gate_up_proj,down_proj}  -> routed_experts
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class Group(str, Enum):
    EMBED = "embed"
    LM_HEAD = "lm_head"
    FINAL_NORM = "final_norm"
    NORM = "norm"
    LINEAR_ATTN = "linear_attn"
    ATTENTION = "attention"
    ROUTER = "router"
    SHARED_EXPERT = "shared_expert"
    SHARED_EXPERT_GATE = "shared_expert_gate"
    ROUTED_EXPERTS = "routed_experts"
    MTP = "mtp"
    VISION = "vision"
    KV_SCALE = "kv_scale"
    OTHER = "other"


class Naming(str, Enum):
    MULTIMODAL = "multimodal"  # model.language_model.* (Qwen3_5MoeForConditionalGeneration)
    TEXT_ONLY = "text-only"  # model.layers.* (Qwen3_5MoeForCausalLM)


TEXT_PREFIX = {Naming.MULTIMODAL: "model.language_model.", Naming.TEXT_ONLY: "model."}
MTP_PREFIX = "mtp."
VISION_PREFIX = "model.visual."

# Parameter names that end a tensor name; what precedes them is the module.
KV_SCALE_PARAMS = frozenset({"k_scale", "v_scale"})
FUSED_EXPERT_PARAMS = frozenset({"gate_up_proj", "down_proj"})


class TensorRole(NamedTuple):  # a NamedTuple: maps make one per tensor on demand (~370k)
    """What one tensor is. `group` is MTP for every mtp.* tensor; `inner` is then its role inside the
    MTP decoder layer (routed_experts, attention, ...); elsewhere inner == group."""

    group: Group
    inner: Group
    module: str  # tensor name minus its last component (the parameter)
    param: str  # weight, weight_scale, gate_up_proj, k_scale, A_log, ...
    layer: int | None  # decoder layer index (for mtp.layers.K: K)
    expert: int | None  # routed expert index for per-expert tensors


def _in_layer_group(sub: str, param: str) -> Group:
    """Role of a tensor inside a decoder layer, from the name after `layers.N.`."""
    if sub.startswith("mlp."):
        if sub.startswith("mlp.experts."):
            return Group.ROUTED_EXPERTS
        if sub.startswith("mlp.shared_expert_gate."):
            return Group.SHARED_EXPERT_GATE
        if sub.startswith("mlp.shared_expert."):
            return Group.SHARED_EXPERT
        if sub.startswith("mlp.gate."):
            return Group.ROUTER
        return Group.OTHER
    if sub.startswith("self_attn."):
        return Group.KV_SCALE if param in KV_SCALE_PARAMS else Group.ATTENTION
    if sub.startswith("linear_attn."):
        return Group.LINEAR_ATTN
    if sub.startswith("input_layernorm.") or sub.startswith("post_attention_layernorm."):
        return Group.NORM
    return Group.OTHER


def _layer_role(sub_with_index: str, module: str, param: str, outer: Group | None) -> TensorRole:
    """sub_with_index = 'N.rest' (after 'layers.')."""
    idx_text, _, sub = sub_with_index.partition(".")
    layer = int(idx_text) if idx_text.isdigit() else None
    inner = _in_layer_group(sub, param)
    expert = None
    if inner is Group.ROUTED_EXPERTS:
        e = sub[len("mlp.experts.") :].partition(".")[0]
        expert = int(e) if e.isdigit() else None
    return TensorRole(outer or inner, inner, module, param, layer, expert)


def classify(name: str, naming: Naming = Naming.MULTIMODAL) -> TensorRole:
    module, _, param = name.rpartition(".")
    if not module:
        return TensorRole(Group.OTHER, Group.OTHER, "", name, None, None)
    if name.startswith(VISION_PREFIX):
        return TensorRole(Group.VISION, Group.VISION, module, param, None, None)
    if name.startswith(MTP_PREFIX):
        rest = name[len(MTP_PREFIX) :]
        if rest.startswith("layers."):
            return _layer_role(rest[len("layers.") :], module, param, Group.MTP)
        return TensorRole(Group.MTP, Group.MTP, module, param, None, None)
    if name.startswith("lm_head."):
        return TensorRole(Group.LM_HEAD, Group.LM_HEAD, module, param, None, None)
    prefix = TEXT_PREFIX[naming]
    if name.startswith(prefix):
        rest = name[len(prefix) :]
        if rest.startswith("layers."):
            return _layer_role(rest[len("layers.") :], module, param, None)
        if rest.startswith("embed_tokens."):
            return TensorRole(Group.EMBED, Group.EMBED, module, param, None, None)
        if rest.startswith("norm."):
            return TensorRole(Group.FINAL_NORM, Group.FINAL_NORM, module, param, None, None)
    return TensorRole(Group.OTHER, Group.OTHER, module, param, None, None)


def detect_naming(names) -> Naming:
    """Multimodal if any tensor uses model.language_model./model.visual., else text-only when
    model.layers.* exist."""
    text_only = False
    for n in names:
        if n.startswith("model.language_model.") or n.startswith(VISION_PREFIX):
            return Naming.MULTIMODAL
        if n.startswith("model.layers."):
            text_only = True
    return Naming.TEXT_ONLY if text_only else Naming.MULTIMODAL


def layer_types(text_config: dict) -> list[str]:
    """`text_config.layer_types`, or the family rule (every `full_attention_interval`-th layer, default 4,
    is full attention) when the config predates the explicit list."""
    explicit = text_config.get("layer_types")
    n = int(text_config.get("num_hidden_layers", len(explicit or [])))
    if explicit:
        return list(explicit)
    interval = int(text_config.get("full_attention_interval", 4))
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def full_attention_layers(text_config: dict) -> list[int]:
    return [i for i, t in enumerate(layer_types(text_config)) if t == "full_attention"]


def text_prefix(naming: Naming) -> str:
    return TEXT_PREFIX[naming]


def layer_prefix(layer: int, naming: Naming = Naming.MULTIMODAL) -> str:
    return f"{TEXT_PREFIX[naming]}layers.{layer}."


def engine_module(module: str) -> str:
    """The module an engine builds for an HF module: per-expert Linears live in one FusedMoE
    (`...mlp.experts`), the unit on which vLLM and SGLang decide quantized vs excluded."""
    head, sep, tail = module.partition(".mlp.experts.")
    return head + ".mlp.experts" if sep else module
