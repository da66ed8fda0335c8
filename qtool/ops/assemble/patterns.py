"""Exclusion patterns for the modules a hybrid assembly turns into BF16, and the patched configs.

The source's own ignore list is kept as is; patterns are appended for exactly the units this assembly
made BF16 (shared experts, chosen layers' routed experts, a grafted MTP head). Each candidate is checked
with the engine models of qtool.engines (every modelled vLLM and SGLang release, both prefix schemes):
the new list must exclude every new BF16 unit and must not exclude any still-quantized unit that the
source list did not already exclude. Broad patterns are tried first (`*.mlp.shared_expert.*` keeps its
trailing dot so it never reaches `shared_expert_gate`, docs/formats.md §7), then narrower ones that
spare the MTP head (engines name `mtp.layers.0` like decoder layer 0).
"""

from __future__ import annotations

import copy
import re

from qtool.arch.model_map import QUANTIZED_FORMATS, extend_signature, signature_format
from qtool.arch.qwen35 import Group, classify, detect_naming
from qtool.engines import Flavour, unit_of
from qtool.engines.decide import NOT_LINEAR
from qtool.engines.patterns import UnitDecider
from qtool.errors import PlanError
from qtool.io.quant_config import config_ignore, hf_quant_exclude, set_config_ignore, set_hf_quant_exclude

_LM = "model.language_model."
_SHARED = re.compile(r"layers\.(\d+)\.mlp\.shared_expert\.")
_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts$")


def _unit(module: str) -> str:
    return unit_of(module).name


def _groups(bf16_units: list[str], regex: bool) -> list[tuple[set[str], list[list[str]]]]:
    """(units, alternative pattern lists, broadest first) per group of new BF16 units."""
    shared = [u for u in bf16_units if _SHARED.search(u) and not u.startswith("mtp.")]
    experts = [u for u in bf16_units if _EXPERTS.search(u) and not u.startswith("mtp.")]
    mtp = [u for u in bf16_units if u.startswith("mtp.")]
    rest = [u for u in bf16_units if u not in shared and u not in experts and u not in mtp]
    groups: list[tuple[set[str], list[list[str]]]] = []
    if shared:
        alts = [[r"re:.*\.mlp\.shared_expert\."]] if regex else [["*.mlp.shared_expert.*"]]
        groups.append((set(shared), alts))
        for n in sorted({int(_SHARED.search(u).group(1)) for u in shared}):
            us = {u for u in shared if int(_SHARED.search(u).group(1)) == n}
            groups.append((us, _layer_alts(n, "shared_expert", regex)))
    for u in experts:
        groups.append(({u}, _layer_alts(int(_EXPERTS.search(u).group(1)), "experts", regex)))
    if mtp:
        groups.append((set(mtp), [[r"re:^mtp\."], [r"re:^mtp.*"]] if regex else [["mtp*"], ["mtp.*"]]))
    for u in rest:
        groups.append(({u}, [[f"re:.*{re.escape(u.removeprefix(_LM))}$"]] if regex else [[u]]))
    return groups


def _layer_alts(n: int, comp: str, regex: bool) -> list[list[str]]:
    if regex:
        tail = r"mlp\.shared_expert\." if comp == "shared_expert" else r"mlp\.experts"
        return [[rf"re:.*\.layers\.{n}\.{tail}"], [rf"re:(?!mtp\.).*\.layers\.{n}\.{tail}"]]
    tail = "mlp.shared_expert.*" if comp == "shared_expert" else "mlp.experts*"
    return [[f"*.layers.{n}.{tail}"], [f"{_LM}layers.{n}.{tail}", f"model.layers.{n}.{tail}"]]


def choose_patterns(
    existing: list[str], bf16_units: list[str], quant_units: list[str], reps: dict[str, str], flavour: str, regex: bool
) -> list[str]:
    """Patterns to append to `existing` so that every engine release excludes every unit of `bf16_units`
    and nothing of `quant_units` that `existing` did not already exclude."""
    if not bf16_units:
        return []

    dec = UnitDecider(Flavour.COMPRESSED_TENSORS if flavour == "compressed-tensors" else Flavour.MODELOPT, reps)
    units = set(bf16_units) | set(quant_units)
    base = dec.excluded(existing, units)
    if base is None:
        raise PlanError(
            "the NVFP4 source's ignore list is refused by an engine (partly excluded fused module)", got=existing
        )
    allowed_q = [b & set(quant_units) for b in base]
    added: list[str] = []
    covered = set.intersection(*base) & set(bf16_units)
    for intended, alternatives in _groups(bf16_units, regex):
        if intended <= covered:
            continue
        for alt in alternatives:
            trial = added + [p for p in alt if p not in added and p not in existing]
            res = dec.excluded(existing + trial, units)
            if res is None or any((r & set(quant_units)) - a for r, a in zip(res, allowed_q, strict=True)):
                continue
            inter = set.intersection(*res)
            if intended <= inter:
                added = trial
                covered = inter & set(bf16_units)
                break
    missing = sorted(set(bf16_units) - covered)
    if missing:
        raise PlanError(
            "no exclusion pattern makes every engine load a now-BF16 module unquantized without also "
            "excluding a still-quantized one",
            tensor=missing[0],
            hint="engines name the MTP layer like decoder layer 0: with quantized MTP experts, use "
            "--mtp from-bf16 or --mtp drop when layer-0 experts are BF16",
        )
    return added


def output_units(shards, known_roles: dict | None = None) -> tuple[list[str], list[str], dict[str, str]]:
    """(BF16 units, quantized units, unit -> representative module) of the planned output.
    `known_roles`: name -> role already classified (the NVFP4 source's map, same naming), so that only
    the added tensors are classified again (~370k names for the 397B)."""
    naming = detect_naming(n for s in shards for n in s.names())
    known = known_roles or {}
    # per module its signature (one shared tuple per distinct one) and groups: no per-module dicts
    mods: dict[str, tuple] = {}
    groups: dict[str, tuple[Group, Group]] = {}
    pairs: dict[tuple, tuple] = {}
    for s in shards:
        for t in s.tensors:
            role = known.get(t.name) or classify(t.name, naming)
            if not role.module:
                continue
            mods[role.module] = extend_signature(mods.get(role.module, ()), role.param, t.dtype, len(t.shape))
            g = (role.group, role.inner)
            groups[role.module] = pairs.setdefault(g, g)
    quant: dict[str, bool] = {}
    reps: dict[str, str] = {}
    for mod, sig in mods.items():
        fmt = signature_format(sig)
        g, inner = groups[mod]
        if fmt is None or g in NOT_LINEAR or inner in NOT_LINEAR:
            continue
        unit = _unit(mod)
        reps.setdefault(unit, mod)
        quant[unit] = quant.get(unit, False) or fmt in QUANTIZED_FORMATS
    return sorted(u for u, v in quant.items() if not v), sorted(u for u, v in quant.items() if v), reps


def updated_configs(nv, flavour: str, shards, bf16_modules: list[str], known_roles: dict | None = None) -> tuple:
    """(config.json, hf_quant_config.json or None, patterns added to config.json)."""
    _, quant_units, reps = output_units(shards, known_roles)
    qset = set(quant_units)
    units = sorted({_unit(m) for m in bf16_modules} - qset)
    units = [u for u in units if u in reps]
    config = copy.deepcopy(nv.config)
    added: list[str] = []
    if config is not None and isinstance(config.get("quantization_config"), dict):
        existing = config_ignore(config) or []
        added = choose_patterns(existing, units, quant_units, reps, flavour, regex=flavour == "compressed-tensors")
        set_config_ignore(config, existing + added)
    hq = copy.deepcopy(nv.hf_quant_config)
    if hq is not None:
        existing = hf_quant_exclude(hq) or []
        set_hf_quant_exclude(
            hq, existing + choose_patterns(existing, units, quant_units, reps, "modelopt", regex=False)
        )
    return config, hq, added
