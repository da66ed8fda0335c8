"""Bridge from a checkpoint's architecture map to the engine models: per runtime unit, what the
tensors say (format) and what each engine decides (excluded or quantized) from the config."""

from __future__ import annotations

from qtool.arch.model_map import QUANTIZED_FORMATS, Format, ModelMap
from qtool.arch.qwen35 import Group
from qtool.engines import sglang, vllm
from qtool.engines.base import Engine, EngineVersion, Flavour, PartialFusedExclusion, parse_version, unit_of
from qtool.engines.patterns import compact_ignore_patterns
from qtool.findings import Code, Finding, warning
from qtool.io.quant_config import QuantSummary

# Groups whose matrices are never quantization candidates for the engines (the embedding is an
# nn.Embedding-like VocabParallelEmbedding without quant_config in both engines' qwen3_5.py).
NOT_LINEAR = {Group.EMBED, Group.NORM, Group.FINAL_NORM, Group.KV_SCALE, Group.OTHER}

DEFAULT_ENGINES = ("vllm", "sglang")

# 2-D weights that are embeddings, not Linears: the vision tower's position embedding is an
# nn.Embedding in both engines (vLLM/SGLang qwen3_vl.py `pos_embed`).
_EMBEDDINGS = ("pos_embed", "embed_tokens")


def linear_modules(mm: ModelMap) -> dict[str, Format]:
    """HF module name -> storage format, for every module an engine builds as a (possibly quantized)
    Linear or FusedMoE."""
    return {
        m.name: m.format
        for m in mm.modules.values()
        if m.format is not None
        and m.group not in NOT_LINEAR
        and m.inner not in NOT_LINEAR
        and not m.name.endswith(_EMBEDDINGS)
    }


# The quant methods whose ignore-list semantics qtool/engines models (ModelOpt's modelopt.py and the
# compressed-tensors config in both engines). Others (fp8 `modules_to_not_convert`/`ignored_layers`, AutoAWQ,
# GPTQ) have their own matching code in the engines that is not modelled: no verdict rather than a wrong one.
MODELLED_QUANT_METHODS = frozenset({"modelopt", "compressed-tensors"})


def engine_rules_modelled(summary: QuantSummary) -> bool:
    method = summary.quant_method
    if method is None:  # only hf_quant_config.json: the ModelOpt native schema
        return summary.hf_quant_algo is not None
    return method in MODELLED_QUANT_METHODS


def rules_not_modelled(summary: QuantSummary) -> Finding:
    """The finding for a quantized config of a method outside MODELLED_QUANT_METHODS: a warning, since it says
    what qtool did not check, not that the checkpoint is wrong (inspect, verify and the writers' checks)."""
    return warning(
        Code.ENGINE_RULES_NOT_MODELLED,
        None,
        f"quant_method {summary.quant_method!r}: qtool models the engines' ignore-list matching for ModelOpt and "
        "compressed-tensors checkpoints only; which modules the engines load quantized and which BF16 was NOT "
        "checked",
        "load it once in the engine to confirm; qtool checks the ModelOpt and compressed-tensors forms",
    )


def flavour_of(summary: QuantSummary) -> Flavour:
    return Flavour.COMPRESSED_TENSORS if summary.quant_method == "compressed-tensors" else Flavour.MODELOPT


def unit_formats(mm: ModelMap) -> dict[str, tuple[str, Format | str]]:
    """runtime unit -> (a representative HF module, its format or "mixed")."""
    out: dict[str, tuple[str, Format | str]] = {}
    for name, fmt in linear_modules(mm).items():
        # Per-expert Linears (~120k in a 397B checkpoint) all belong to their layer's FusedMoE unit;
        # a string split is enough for them, unit_of's regexes are for the rest.
        head, sep, _ = name.partition(".mlp.experts.")
        unit = head + ".mlp.experts" if sep else unit_of(name).name
        if unit not in out:
            out[unit] = (name, fmt)
        elif out[unit][1] != fmt:
            out[unit] = (out[unit][0], "mixed")
    return out


def decide(
    mm: ModelMap, ignore: list[str], flavour: Flavour, version: str | EngineVersion
) -> dict[str, tuple[bool | None, Format | str]]:
    """unit -> (excluded? None when the engine refuses the list for it, storage format)."""
    v = parse_version(version)
    engine = vllm if v.engine is Engine.VLLM else sglang
    out = {}
    for unit, (rep, fmt) in unit_formats(mm).items():
        try:
            excluded: bool | None = engine.is_excluded(rep, ignore, version=v, quant_method=flavour)
        except PartialFusedExclusion:
            excluded = None
        out[unit] = (excluded, fmt)
    return out


def unit_decisions(
    mm: ModelMap, summary: QuantSummary, versions: tuple[str, ...] = DEFAULT_ENGINES
) -> dict[str, dict[str, tuple[bool | None, Format | str]]]:
    """{engine version: {unit: (excluded, format)}} with the ignore list the engines really read."""
    ignore = summary.effective_ignore or []
    fl = flavour_of(summary)
    return {str(parse_version(v)): decide(mm, ignore, fl, v) for v in versions}


def ignore_patterns_for(
    mm: ModelMap, flavours: tuple[Flavour, ...] = (Flavour.MODELOPT, Flavour.COMPRESSED_TENSORS)
) -> tuple[list[str], ...]:
    """For each of `flavours`, the ignore list (globs for ModelOpt, `re:` patterns for compressed-tensors)
    that makes both engines, in every modelled release, exclude exactly the modules whose tensors are BF16.
    Ask only for the flavours a caller writes: each list is verified against every engine release on every
    unit (~2-4 s each for the 397B's 372k output tensors on one core)."""
    mods = linear_modules(mm)
    unq = [m for m, f in mods.items() if f is Format.BF16]
    q = [m for m, f in mods.items() if f in QUANTIZED_FORMATS]
    return tuple(compact_ignore_patterns(unq, q, fl) for fl in flavours)
