"""What vLLM and SGLang do with a quantized Qwen3.5-MoE checkpoint: which modules they quantize.

Data + small pure functions, no engine imports. Names in the public API are always HF checkpoint
*module* names (tensor name without ``.weight``), e.g. ``model.language_model.layers.3.self_attn.q_proj``,
``model.language_model.layers.0.mlp.experts.7.up_proj``, ``mtp.fc``, ``lm_head``.

Each engine module (``vllm``, ``sglang``) turns such a name into the runtime module the engine builds
(fused q/k/v -> ``qkv_proj``, per-expert Linears -> one ``mlp.experts`` FusedMoE, ...) and applies that
engine's ignore-list semantics, version by version.
"""

from __future__ import annotations

from qtool.engines import sglang, vllm
from qtool.engines.base import (
    PACKED_MODULES,
    Engine,
    EngineVersion,
    Flavour,
    PartialFusedExclusion,
    Unit,
    parse_flavour,
    parse_version,
    unit_of,
)
from qtool.engines.patterns import compact_ignore_patterns, engine_decisions

__all__ = [
    "Engine",
    "EngineVersion",
    "Flavour",
    "PACKED_MODULES",
    "PartialFusedExclusion",
    "Unit",
    "compact_ignore_patterns",
    "engine_decisions",
    "parse_flavour",
    "parse_version",
    "sglang",
    "unit_of",
    "vllm",
]
