"""Ignore-pattern generation and cross-engine decisions for Qwen3.5-MoE checkpoints.

``compact_ignore_patterns`` writes the shortest list it can find such that every modelled release of
both engines (vllm.BEHAVIOUR_RELEASES, sglang.BEHAVIOUR_RELEASES) loads exactly the unquantized
modules as BF16; every candidate is verified with the two engine models, never assumed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from qtool.engines import sglang, vllm
from qtool.engines.base import Engine, EngineVersion, Flavour, PartialFusedExclusion, parse_flavour, unit_of
from qtool.errors import QtoolError

Decider = Callable[[str, list[str]], bool]


def all_versions() -> list[EngineVersion]:
    return [EngineVersion(Engine.VLLM.value, r) for r in vllm.BEHAVIOUR_RELEASES] + [
        EngineVersion(Engine.SGLANG.value, r) for r in sglang.BEHAVIOUR_RELEASES
    ]


def decider(v: EngineVersion, fl: Flavour) -> Decider:
    mod = vllm if v.engine is Engine.VLLM else sglang
    return lambda m, ign: mod.is_excluded(m, ign, version=v, quant_method=fl)


class UnitDecider:
    """Which of a set of units every modelled engine release excludes, for candidate ignore lists: what a
    pattern search asks again and again. Each unit is found once (`reps`: unit -> a representative HF
    module) and each list made a tuple once per question, not per unit and release (the 397B's ~600 units,
    6 releases and ~20 candidates: 60k answers)."""

    def __init__(self, fl: Flavour, reps: dict[str, str]) -> None:
        self.fl = fl
        self.units = {u: unit_of(m) for u, m in reps.items()}
        self.engines = [(vllm if v.engine is Engine.VLLM else sglang, v) for v in all_versions()]

    def excluded(self, patterns: list[str], units: Iterable[str] | None = None) -> list[set[str]] | None:
        """Per release, the units (of `units`, default all) it excludes; None where a release refuses the
        list (some but not all shards of a fused module excluded)."""
        ign, fl = tuple(patterns), self.fl
        pick = [(u, self.units[u]) for u in (self.units if units is None else units)]
        out = []
        for mod, v in self.engines:
            try:
                out.append({u for u, unit in pick if mod.unit_excluded(unit, ign, v, fl)})
            except PartialFusedExclusion:
                return None
        return out


def engine_decisions(
    modules: Iterable[str],
    ignore: list[str],
    flavour: str | Flavour = "modelopt",
    versions: Iterable[str | EngineVersion] | None = None,
) -> dict[str, dict[str, bool | None]]:
    """{"vllm@0.33.0": {module: excluded}} for reports. ``None`` means that engine refuses the list
    for this module (some but not all shards of its fused module are excluded)."""
    from qtool.engines.base import parse_version

    fl = parse_flavour(flavour)
    vs = [parse_version(v) for v in versions] if versions is not None else all_versions()
    mods = list(modules)
    out: dict[str, dict[str, bool | None]] = {}
    for v in vs:
        d = decider(v, fl)
        row: dict[str, bool | None] = {}
        for m in mods:
            try:
                row[m] = d(m, ignore)
            except PartialFusedExclusion:
                row[m] = None
        out[str(v)] = row
    return out


# --- candidate patterns --------------------------------------------------------------------------

_LM = "model.language_model."
_LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.(.*)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")

# component of a unit inside a decoder layer -> (glob suffix, regex suffix). The shared-expert glob
# keeps its dot so it never reaches `shared_expert_gate` (docs/formats.md §7).
_COMPONENTS = {
    "self_attn": ("self_attn*", r"self_attn\."),
    "linear_attn": ("linear_attn*", r"linear_attn\."),
    "mlp.shared_expert": ("mlp.shared_expert.*", r"mlp\.shared_expert\."),
    "mlp.experts": ("mlp.experts*", r"mlp\.experts"),
    "mlp.gate": ("mlp.gate", r"mlp\.gate$"),
    "mlp.shared_expert_gate": ("mlp.shared_expert_gate", r"mlp\.shared_expert_gate$"),
}


def _component(rest: str) -> str:
    for c in ("mlp.shared_expert_gate", "mlp.shared_expert", "mlp.experts", "mlp.gate", "self_attn", "linear_attn"):
        if rest == c or rest.startswith(c + "."):
            return c
    return rest


def _scoped(layer: str, comp: str | None, fl: Flavour) -> list[list[str]]:
    """Alternatives (each a pattern list) for layer `layer` ("*" = all) and component (None = whole layer).
    First: one leading-wildcard pattern (also reaches mtp.layers.*); then forms that spare the MTP head."""
    if fl is Flavour.MODELOPT:
        tail = "*" if comp is None else _COMPONENTS[comp][0]
        return ([[f"*.{tail}"]] if layer == "*" and comp else []) + [
            [f"*.layers.{layer}.{tail}"],
            [f"{_LM}layers.{layer}.{tail}", f"model.layers.{layer}.{tail}"],
        ]
    n = r"\d+" if layer == "*" else layer
    tail = "" if comp is None else _COMPONENTS[comp][1]
    alts = [[f"re:.*\\.layers\\.{n}\\.{tail}"], [f"re:(?!mtp\\.).*\\.layers\\.{n}\\.{tail}"]]
    return ([[f"re:.*{tail}"]] if layer == "*" and comp else []) + alts


def _globals(fl: Flavour) -> dict[str, list[list[str]]]:
    if fl is Flavour.MODELOPT:
        return {"lm_head": [["lm_head"]], "visual": [["model.visual*"]], "mtp": [["mtp*"]]}
    return {
        "lm_head": [["lm_head"], ["re:.*lm_head$"]],
        "visual": [["re:.*visual\\."]],
        "mtp": [["re:^mtp\\."]],
    }


def _exact(unit_modules: list[str], fl: Flavour) -> list[list[str]]:
    """Last resort for one unit: its HF module names, then (compressed-tensors) suffix regexes that
    also reach the old SGLang prefix."""
    alts = [sorted(unit_modules)]
    if fl is Flavour.COMPRESSED_TENSORS:
        alts.append([f"re:.*\\.{re.escape(m.removeprefix(_LM))}$" for m in sorted(unit_modules)])
    return alts


def compact_ignore_patterns(
    unquantized_modules: list[str],
    quantized_modules: list[str],
    flavour: str | Flavour = "modelopt",
) -> list[str]:
    """Shortest verified ignore list: every engine release excludes exactly ``unquantized_modules``.

    Modules are HF checkpoint module names (Linear weights without ``.weight``). Raises QtoolError when a
    fused module / FusedMoE mixes quantized and unquantized parts, or when no pattern list can express
    the split for some engine."""
    fl = parse_flavour(flavour)
    units: dict[str, list[str]] = {}
    state: dict[str, bool] = {}
    for mods, unq in ((unquantized_modules, True), (quantized_modules, False)):
        for m in mods:
            u = unit_of(m).name
            if state.setdefault(u, unq) != unq:
                raise QtoolError(
                    f"{u} mixes quantized and unquantized parts; no engine can load that",
                    tensor=m,
                    hint="fused q/k/v, gate/up, in_proj pairs and all experts of a layer must share one precision",
                )
            units.setdefault(u, []).append(m)
    excluded = UnitDecider(fl, {u: ms[0] for u, ms in units.items()}).excluded
    U = {u for u, s in state.items() if s}
    Q = set(state) - U

    base = excluded([])
    assert base is not None
    forced_q = set().union(*base) & Q
    if forced_q:
        u = sorted(forced_q)[0]
        raise QtoolError(
            f"{len(forced_q)} quantized module group(s) are always loaded as BF16 by some engine release",
            tensor=u,
            got=sorted(forced_q)[:5],
            hint="e.g. SGLang builds the whole MTP head BF16 for modelopt_fp4, vLLM >= 0.19 forces mtp.fc BF16, "
            "routers are never quantized: store these modules in BF16",
        )
    chosen: list[str] = []
    covered = set.intersection(*base) & U

    def try_add(alternatives: list[list[str]], intended: set[str]) -> bool:
        nonlocal covered
        if intended <= covered:
            return True
        for alt in alternatives:
            if all(p in chosen for p in alt):
                continue
            res = excluded(chosen + [p for p in alt if p not in chosen])
            if res is None or any((r & Q) - forced_q for r in res):
                continue
            inter = set.intersection(*res)
            if intended <= inter:
                chosen.extend(p for p in alt if p not in chosen)
                covered = inter & U
                return True
        return False

    # group units: globals, per (layer, component), per layer
    groups: dict[str, set[str]] = {"lm_head": set(), "visual": set(), "mtp": set()}
    by_lc: dict[tuple[str, str], set[str]] = {}
    for u in state:
        if u == "lm_head":
            groups["lm_head"].add(u)
        elif u.startswith("model.visual."):
            groups["visual"].add(u)
        elif u.startswith("mtp."):
            groups["mtp"].add(u)
        m = _LAYER.match(u)
        if m:
            by_lc.setdefault((m.group(1), _component(m.group(2))), set()).add(u)

    gl = _globals(fl)
    for g, us in groups.items():
        if us and us <= U:
            try_add(gl[g], us)
    comps = {c for _, c in by_lc}
    for c in sorted(comps):
        us = set().union(*(s for (_, cc), s in by_lc.items() if cc == c))
        if us <= U and c in _COMPONENTS:
            try_add(_scoped("*", c, fl), us)
    layers = sorted({n for n, _ in by_lc}, key=int)
    for n in layers:
        us = set().union(*(s for (nn, _), s in by_lc.items() if nn == n))
        if us <= U and not us <= covered:
            try_add(_scoped(n, None, fl), us)
    for (n, c), us in sorted(by_lc.items(), key=lambda kv: (int(kv[0][0]), kv[0][1])):
        if us <= U and c in _COMPONENTS and not us <= covered:
            try_add(_scoped(n, c, fl), us)
    for u in sorted(U - covered):
        if not try_add(_exact(units[u], fl), {u}):
            raise QtoolError(
                f"no ignore list makes every engine load {u} unquantized",
                tensor=u,
                hint="check the engine model notes (e.g. SGLang matches FusedMoE only by glob, not by expert name)",
            )

    # drop patterns made redundant by later, broader ones
    for p in list(chosen):
        trial = [q for q in chosen if q != p]
        res = excluded(trial)
        if res is not None and not any((r & Q) - forced_q for r in res) and set.intersection(*res) >= U:
            chosen = trial
    return chosen
