"""vLLM's decision "is this module of a Qwen3.5-MoE checkpoint quantized?" as pure functions.

Read from the vLLM 0.33.0 wheel (vllm/model_executor/...) and the PRs named per rule. Runtime names
built by vLLM for Qwen3_5MoeForConditionalGeneration (models/qwen3_5.py, prefix ""):
``language_model.model.layers.N.{self_attn.qkv_proj, self_attn.o_proj, linear_attn.in_proj_qkvz,
linear_attn.in_proj_ba, linear_attn.out_proj, mlp.gate, mlp.shared_expert.gate_up_proj,
mlp.shared_expert.down_proj, mlp.shared_expert_gate, mlp.experts}``, ``language_model.lm_head``,
``visual.*``. The MTP drafter (models/qwen3_5_mtp.py, Qwen3_5MTP) builds its modules under
``mtp.`` (maybe_prefix(prefix, "mtp")): ``mtp.fc``, ``mtp.layers.0.*``; its weights are renamed
``mtp.`` -> ``model.`` only for parameter loading, and the drafter has no hf_to_vllm_mapper, so its
quant config keeps the checkpoint's names.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fnmatch import fnmatch
from functools import lru_cache

from qtool.engines.base import (
    Engine,
    EngineVersion,
    Flavour,
    PartialFusedExclusion,
    Unit,
    is_mtp,
    parse_flavour,
    parse_version,
    unit_of,
)

# --- version breakpoints ------------------------------------------------------------------------
# PR 30164 "Nvidia ModelOpt workaround for issue 28072" (merged 2025-12): apply_vllm_mapper splits a
# trailing-glob `path*` into `path` + `path.*` before mapping. Older than every release modelled here.
# PR 35156: the Qwen3.5/Qwen3-Next router `mlp.gate` (GateLinear, no quant_config) and
# `shared_expert_gate` (ReplicatedLinear quant_config=None, models/qwen3_next.py) are never quantized.
# Merged late Feb 2026 -> first release 0.17 (approximate: inferred from merge date).
ROUTER_UNQUANTIZED_SINCE = (0, 17, 0)
# PRs 35675 + 38832 (ref 38650, NVIDIA/Model-Optimizer#1124): qwen3_5_mtp.py builds `mtp.fc` with
# quant_config=None when the quant method is modelopt_fp4. 38832 merged 2026-04-02, v0.19.0 cut
# 2026-04-03 -> first release 0.19 (approximate: inferred from merge date).
MTP_FC_UNQUANTIZED_SINCE = (0, 19, 0)

# HF -> vLLM rename mapper of Qwen3_5MoeForConditionalGeneration = Qwen3VLForConditionalGeneration's
# (models/qwen3_vl.py hf_to_vllm_mapper.orig_to_new_prefix) | {"mtp.": None}; the quant config gets
# mapper.get_rename_mapper() (model_loader/utils.py configure_quant_config), which drops the None
# entries, so `mtp.` names stay as they are.
HF_TO_VLLM_PREFIX = (
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
    ("model.language_model.", "language_model.model."),
)

# models/qwen3_5.py packed_modules_mapping (Qwen3VL's + in_proj_qkvz/in_proj_ba); "qkv" is the
# vision tower's already-packed attn.qkv.
VLLM_PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
    "qkv": ("qkv",),
}


def map_name(name: str) -> str:
    """WeightsMapper.map_name with the rename mapper above (first matching prefix, replaced once)."""
    for old, new in HF_TO_VLLM_PREFIX:
        if name.startswith(old):
            return name.replace(old, new, 1)
    return name


def runtime_name(hf_module: str) -> str:
    """Name vLLM gives the runtime module that holds ``hf_module`` (the ``prefix`` its quant config sees)."""
    return _runtime_of_unit(unit_of(hf_module).name)


def _runtime_of_unit(unit_name: str) -> str:
    if is_mtp(unit_name):
        return unit_name
    if unit_name == "lm_head":
        return "language_model.lm_head"  # maybe_prefix("language_model", "lm_head")
    return map_name(unit_name)


def mapped_ignore(ignore: list[str], flavour: Flavour, *, mtp: bool = False) -> list[str]:
    """The ignore list as the quant config holds it after ``apply_vllm_mapper``."""
    if mtp:
        # the drafter class has no hf_to_vllm_mapper: the list is used as written
        return list(ignore)
    if flavour is Flavour.MODELOPT:
        # layers/quantization/modelopt.py ModelOptQuantConfigBase.apply_vllm_mapper (PR 30164):
        # `x*` (char before * not ".") -> `x`, `x.*`; then every entry goes through the mapper.
        split: list[str] = []
        for e in ignore:
            if len(e) >= 2 and e[-1] == "*" and e[-2] != ".":
                split += [e[:-1], e[:-1] + ".*"]
            else:
                split.append(e)
        return [map_name(e) for e in split]
    # compressed_tensors.py apply_vllm_mapper: only layer paths ("." in it, no "re:") are mapped;
    # regexes and class names are kept verbatim (so `re:model\.language_model\...` never matches).
    return [map_name(e) if ("." in e and not e.startswith("re:")) else e for e in ignore]


# --- modelopt ------------------------------------------------------------------------------------


def _is_layer_skipped_exact(prefix: str, ignore: Sequence[str]) -> bool:
    """layers/quantization/utils/quant_utils.py is_layer_skipped(match_mode="exact")."""
    proj = prefix.split(".")[-1]
    if proj in VLLM_PACKED and prefix in ignore:  # fused name listed directly
        return True
    if proj in VLLM_PACKED:
        shards = [prefix.replace(proj, s) for s in VLLM_PACKED[proj]]
        hits = [s in ignore for s in shards]
        if any(hits) and not all(hits):
            raise PartialFusedExclusion(
                f"vLLM: some but not all shards of {prefix} are excluded",
                tensor=prefix,
                expected="all or none of " + ", ".join(shards),
                got=[s for s, h in zip(shards, hits, strict=True) if h],
                hint="list every shard (q/k/v_proj, gate/up_proj, in_proj_qkv/z, in_proj_b/a) or none",
            )
        return all(hits)
    if "experts" in prefix:
        # an exact per-expert entry ("...mlp.experts.0.gate_proj") excludes the whole FusedMoE
        return any(prefix in e for e in ignore if "experts" in e)
    return prefix in ignore


def modelopt_is_layer_excluded(prefix: str, exclude: Sequence[str]) -> bool:
    """modelopt.py ModelOptQuantConfigBase.is_layer_excluded on an already-mapped list."""
    if not exclude:
        return False
    if _is_layer_skipped_exact(prefix, exclude):
        return True
    # substring rule, also with a leading "language_model." removed (kept for ModelOpt < 0.39 exports)
    stripped = prefix.removeprefix("language_model.") if prefix.startswith("language_model.") else None
    for e in exclude:
        if e != prefix and (e in prefix or (stripped is not None and e in stripped)):
            return True
    return any(fnmatch(prefix, p) for p in exclude)


# --- compressed-tensors --------------------------------------------------------------------------


def _ct_match(name: str, target: str) -> bool:
    # compressed_tensors.utils.match_name / vLLM check_equal_or_regex_match: "re:" -> re.match
    # (anchored at the start only); otherwise exact equality.
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def ct_should_ignore_layer(prefix: str, ignore: Sequence[str]) -> bool:
    """compressed_tensors/utils.py should_ignore_layer(fused_mapping=packed_modules_mapping)."""
    proj = prefix.split(".")[-1]
    names = [prefix.replace(proj, s) for s in VLLM_PACKED[proj]] if proj in VLLM_PACKED else [prefix]
    hits = [any(_ct_match(n, t) for t in ignore) for n in names]
    if any(hits) and not all(hits):
        raise PartialFusedExclusion(
            f"vLLM: different quantization schemes for the shards of {prefix}",
            tensor=prefix,
            expected="all or none of " + ", ".join(names),
        )
    return all(hits)


# --- public --------------------------------------------------------------------------------------


def hardcoded_unquantized(hf_module: str, version: EngineVersion, flavour: Flavour) -> str | None:
    """Why vLLM never quantizes this module whatever the ignore list says, or None."""
    return _hardcoded(unit_of(hf_module).kind, version, flavour)


def _hardcoded(kind: str, version: EngineVersion, flavour: Flavour) -> str | None:
    if kind in ("router", "shared_expert_gate") and version.at_least(ROUTER_UNQUANTIZED_SINCE):
        return "router/shared_expert_gate built without quant_config (PR 35156)"
    if kind == "lm_head" and flavour is Flavour.COMPRESSED_TENSORS:
        # CompressedTensorsConfig.get_quant_method quantizes LinearBase only; ParallelLMHead is not one
        # (ModelOpt's get_quant_method does include ParallelLMHead). compressed_tensors.py, vLLM 0.33.0.
        return "lm_head (ParallelLMHead) is never quantized by vLLM's compressed-tensors path"
    if kind == "mtp_fc" and flavour is Flavour.MODELOPT and version.at_least(MTP_FC_UNQUANTIZED_SINCE):
        return "mtp.fc forced unquantized for modelopt_fp4 (PRs 35675, 38832)"
    return None


@lru_cache(maxsize=1024)
def _mapped(ignore: tuple[str, ...], fl: Flavour, mtp: bool) -> tuple[str, ...]:
    # one mapping per list, not per unit: a pattern search asks every unit of the 397B under each list
    return tuple(mapped_ignore(list(ignore), fl, mtp=mtp))


@lru_cache(maxsize=65536)
def _decide(unit_name: str, kind: str, ignore: tuple[str, ...], version: EngineVersion, fl: Flavour) -> bool:
    if _hardcoded(kind, version, fl):
        return True
    mtp = is_mtp(unit_name)
    prefix = _runtime_of_unit(unit_name)
    lst = _mapped(ignore, fl, mtp)
    if fl is Flavour.MODELOPT:
        return modelopt_is_layer_excluded(prefix, lst)
    return ct_should_ignore_layer(prefix, lst)


def is_excluded(
    hf_module_name: str,
    ignore: list[str],
    *,
    version: str | EngineVersion = "vllm",
    quant_method: str | Flavour = "modelopt",
) -> bool:
    """True when vLLM ``version`` loads ``hf_module_name`` unquantized (BF16) given ``ignore``.

    Raises PartialFusedExclusion where vLLM would refuse the list (mixed fused shards).
    """
    return unit_excluded(
        unit_of(hf_module_name), tuple(ignore), parse_version(version, Engine.VLLM), parse_flavour(quant_method)
    )


def unit_excluded(unit: Unit, ignore: tuple[str, ...], version: EngineVersion, fl: Flavour) -> bool:
    """is_excluded for a unit already found (unit_of) and parsed arguments: what a caller that asks for the
    same units under many candidate lists calls (qtool.engines.patterns.UnitDecider)."""
    return _decide(unit.name, unit.kind, ignore, version, fl)


# Releases where the modelled behaviour changes; checking these covers every supported release.
BEHAVIOUR_RELEASES = ((0, 16, 0), ROUTER_UNQUANTIZED_SINCE, MTP_FC_UNQUANTIZED_SINCE, (0, 33, 0))
