"""`qtool inspect`: what a checkpoint holds and what is inconsistent in it, from headers and configs."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from qtool.arch.layer_grid import layer_grid
from qtool.arch.model_map import QUANTIZED_FORMATS, REQUIRED_PARAMS, Format, ModelMap, build_map
from qtool.arch.qwen35 import Group
from qtool.engines import mixed_precision, parse_version
from qtool.engines.decide import DEFAULT_ENGINES, engine_rules_modelled, rules_not_modelled, unit_decisions
from qtool.findings import Code, Finding, Severity, by_severity
from qtool.hub.headers import fetch_deferred
from qtool.io.checkpoint import Checkpoint
from qtool.io.quant_config import QuantSummary, summarize
from qtool.io.reader import read_scalars
from qtool.io.tensor_table import no_cyclic_gc


def problem(code: Code, message: str, module: str | None = None, engine: str | None = None) -> Finding:
    """An inspect problem: a Finding (qtool.findings) of error severity; consumers set their own policy."""
    return Finding(code, Severity.ERROR, module, message, None, engine)


def inspect_checkpoint(path: str | Path) -> dict:
    ckpt = Checkpoint.open(path)
    mm = build_map(ckpt)
    return report(mm)


def report(mm: ModelMap) -> dict:
    ckpt = mm.ckpt
    summary = summarize(ckpt.config, ckpt.hf_quant_config)
    groups: dict[str, dict] = {}
    counts: dict[Group, list[int]] = defaultdict(lambda: [0, 0])
    dtypes: dict[Group, set[str]] = defaultdict(set)
    for name, role in mm.roles.items():
        c = counts[role.group]
        c[0] += 1
        c[1] += ckpt.tensors[name].nbytes
        dtypes[role.group].add(ckpt.tensors[name].dtype)
    formats = mm.group_formats()
    for group in Group:
        if group in counts:
            groups[group.value] = {
                "format": formats.get(group),  # None for groups of no Linear (norms, KV scales)
                "dtypes": sorted(dtypes[group]),
                "tensors": counts[group][0],
                "bytes": counts[group][1],
            }
    lt = {"linear_attention": 0, "full_attention": 0}
    for t in mm.layer_types:
        lt[t] = lt.get(t, 0) + 1
    archs = (ckpt.config or {}).get("architectures") or [None]
    return {
        "path": str(ckpt.root),
        "architecture": archs[0],
        "model_type": (ckpt.config or {}).get("model_type"),
        "naming": mm.naming.value,
        "num_layers": mm.num_layers,
        "layer_types": lt,
        "full_attention_layers": mm.full_attention,
        "num_tensors": len(ckpt.tensors),
        "num_shards": len(ckpt.headers),
        "total_bytes": ckpt.total_bytes(),
        "groups": groups,
        "expert_layout": mm.expert_layout,
        "mtp_expert_layout": mm.mtp_expert_layout,
        "mtp": Group.MTP.value in groups,
        "vision": Group.VISION.value in groups,
        "kv_scales": {
            "layers": mm.kv.layers,
            "calibrated": mm.kv.calibrated,
            "naming": mm.kv.naming,
            "per_head": mm.kv.per_head,
            # per full-attention layer; empty when the values were not read (a header-only hf: source)
            "values": [{"layer": layer, "k": k, "v": v} for layer, (k, v) in sorted(mm.kv.values.items())],
        },
        "grid": layer_grid(mm),
        "quantization": summary.to_json(),
        **_problems_and_warnings(find_problems(mm, summary)),
    }


def _problems_and_warnings(found: list[Finding]) -> dict:
    """The report's "problems" (errors: the checkpoint is inconsistent) and "warnings" (what qtool did not
    check, such as the engines' rules for an AutoAWQ config)."""
    errors, warnings = by_severity(found)
    return {"problems": [f.to_json() for f in errors], "warnings": [f.to_json() for f in warnings]}


def find_problems(mm: ModelMap, summary: QuantSummary) -> list[Finding]:
    """Errors (`problem`) and warnings (engine rules not modelled); a consumer that decides pass or fail
    counts the errors only (qtool.findings.by_severity)."""
    return structure_problems(mm, summary) + value_problems(mm, summary)


def structure_problems(mm: ModelMap, summary: QuantSummary) -> list[Finding]:
    """find_problems' part that needs headers and configs only (no tensor value is read): a job can find it
    on its output's planned view while the output is written (qtool.ops.checks.PlannedProblems)."""
    return (
        _layout_problems(mm)
        + _incomplete_quant_modules(mm)
        + _config_file_disagreement(summary)
        + _config_vs_tensors(mm, summary)
    )


def value_problems(mm: ModelMap, summary: QuantSummary) -> list[Finding]:
    """find_problems' part that reads scale values (gate/up global scales; the KV scales the map read)."""
    with no_cyclic_gc():  # a 397B's 61k gate/up scales
        return _gate_up_scale_mismatch(mm) + _kv_problems(mm, summary)


def _layout_problems(mm: ModelMap) -> list[Finding]:
    out = []
    if mm.expert_layout == "mixed":
        fused = [layer for layer, k in mm.layer_expert_layout.items() if k == "fused"]
        per = [layer for layer, k in mm.layer_expert_layout.items() if k == "per_expert"]
        both = [layer for layer, k in mm.layer_expert_layout.items() if k == "mixed"]
        out.append(
            problem(
                Code.MIXED_EXPERT_LAYOUT,
                f"routed experts mix the fused 3-D layout (layers {_short(fused + both)}) and the per-expert "
                f"layout (layers {_short(per + both)}); SGLang 0.5.23's loader silently drops the per-expert "
                "keys that come after the first fused one in its load order (vLLM 0.33 maps each tensor by "
                "its own layout and loads both)",
            )
        )
    if mm.mtp_expert_layout == "mixed":
        out.append(problem(Code.MIXED_EXPERT_LAYOUT, "the MTP layer mixes fused and per-expert routed experts"))
    return out


def _incomplete_quant_modules(mm: ModelMap) -> list[Finding]:
    missing: dict[tuple[str, str], list[str]] = defaultdict(list)
    for mod in mm.modules.values():
        if mod.format in REQUIRED_PARAMS:
            for p in REQUIRED_PARAMS[mod.format]:
                if p not in mod.params:
                    missing[(mod.format.value, p)].append(mod.name)
    return [
        problem(Code.MISSING_QUANT_TENSOR, f"{len(mods)} {fmt} module(s) lack `{param}`, e.g. {mods[0]}", mods[0])
        for (fmt, param), mods in missing.items()
    ]


def _gate_up_scale_mismatch(mm: ModelMap) -> list[Finding]:
    """vLLM fuses gate_proj and up_proj into w13 with ONE global scale and warns or mis-scales when
    the two differ (vllm/model_executor/layers/quantization/modelopt.py, ModelOptNvFp4FusedMoE)."""
    pairs = []
    for mod in mm.modules.values():
        if mod.expert is None or not mod.name.endswith(".gate_proj"):
            continue
        up = mm.modules.get(mod.name[: -len("gate_proj")] + "up_proj")
        if up is None or mod.format is not up.format:
            continue
        key = {Format.NVFP4: "weight_scale_2", Format.NVFP4_CT: "weight_global_scale"}.get(mod.format)
        if key and key in mod.params and key in up.params:
            pairs.append((mod.name, mod.params[key], up.params[key]))
    if not pairs:
        return []
    infos = [p[1] for p in pairs] + [p[2] for p in pairs]
    fetch_deferred(infos)  # a header-only stand-in of a Hub repo fetches them now, and only them
    values = read_scalars(infos)
    n = len(pairs)
    bad = [pairs[i][0] for i in range(n) if values[i] != values[n + i]]
    if not bad:
        return []
    return [
        problem(
            Code.SCALE_MISMATCH,
            f"{len(bad)} expert(s) have different global scales for gate_proj and up_proj, e.g. {bad[0]}; "
            "vLLM fuses them into w13 with one scale",
            bad[0],
        )
    ]


def kv_scheme_strategy(mm: ModelMap, summary: QuantSummary) -> str | None:
    """The compressed-tensors kv_cache_scheme `strategy` the KV-scale tensors call for ("attn_head" for
    [num_kv_heads] scales, "tensor" for scalars), or None when the config already says it (or has no
    compressed-tensors KV scheme to correct)."""
    scheme = summary.kv_cache_scheme
    if summary.quant_method != "compressed-tensors" or not isinstance(scheme, dict) or not mm.kv.layers:
        return None
    want = "attn_head" if mm.kv.per_head else "tensor"
    return None if scheme.get("strategy") == want else want


def _kv_problems(mm: ModelMap, summary: QuantSummary) -> list[Finding]:
    out = []
    if mm.kv.invalid:
        out.append(
            problem(Code.KV_SCALE_INVALID, f"KV scale(s) not finite and positive: {mm.kv.invalid[0]}", mm.kv.invalid[0])
        )
    missing = [layer for layer in mm.full_attention if layer not in mm.kv.layers]
    if mm.kv.layers and missing:
        out.append(problem(Code.KV_SCALES_MISSING, f"full-attention layers without k/v scales: {_short(missing)}"))
    extra = [layer for layer in mm.kv.layers if layer not in mm.full_attention]
    if extra:
        out.append(problem(Code.KV_SCALES_STALE, f"k/v scales on layers that are not full attention: {_short(extra)}"))
    if mm.kv.per_head:
        heads = mm.ckpt.text_config.get("num_key_value_heads")
        wrong = [n for n in mm.kv_scale_tensors() if mm.ckpt.tensors[n].numel not in (1, heads)]
        if wrong:
            out.append(
                problem(
                    Code.KV_SCALE_INVALID,
                    f"per-head KV scale(s) with {list(mm.ckpt.tensors[wrong[0]].shape)}"
                    f" elements, expected {heads} (num_key_value_heads): {wrong[0]}",
                    wrong[0],
                )
            )
    strategy = kv_scheme_strategy(mm, summary)
    if strategy is not None:
        out.append(
            problem(
                Code.KV_SCHEME_MISMATCH,
                f"KV scales are {'per attention head' if mm.kv.per_head else 'per tensor'}"
                f" but kv_cache_scheme strategy is {summary.kv_cache_scheme.get('strategy')!r} (expected "
                f"{strategy!r})",
            )
        )
    says_fp8 = bool(summary.kv_cache_scheme) or bool(summary.kv_cache_quant_algo)
    if says_fp8 and not mm.kv.layers:
        out.append(problem(Code.KV_SCALES_MISSING, "the config declares an FP8 KV cache but no k/v scales exist"))
    if mm.kv.layers and not says_fp8 and summary.quantized:
        out.append(problem(Code.KV_SCHEME_MISSING, "k/v scales exist but the config declares no FP8 KV cache scheme"))
    return out


def _config_file_disagreement(summary: QuantSummary) -> list[Finding]:
    if summary.ignore is None or summary.hf_exclude is None:
        return []
    a, b = set(summary.ignore), set(summary.hf_exclude)
    if a == b:
        return []
    only_a, only_b = sorted(a - b), sorted(b - a)
    return [
        problem(
            Code.CONFIG_DISAGREEMENT,
            "config.json quantization_config.ignore and hf_quant_config.json exclusions differ "
            f"(only in config.json: {only_a[:5]}, only in hf_quant_config.json: {only_b[:5]}); "
            "the engines read config.json first",
        )
    ]


def _config_vs_tensors(mm: ModelMap, summary: QuantSummary) -> list[Finding]:
    """Modules whose tensors are BF16 but that an engine would treat as quantized, and the reverse."""

    if not summary.weights_quantized:
        return []
    if not engine_rules_modelled(summary):
        return [rules_not_modelled(summary)]  # a warning: what was not checked, not a defect

    if mixed_precision.is_mixed(summary):  # per-module algorithms (quantized_layers), not one ignore list
        found, _, _ = mixed_precision.mixed_findings(mm, summary, [parse_version(v) for v in DEFAULT_ENGINES])
        return [f for f in found if f.is_error]
    out = []
    for engine, decisions in unit_decisions(mm, summary).items():
        refused = [u for u, (excluded, _f) in decisions.items() if excluded is None]
        bf16 = [u for u, (excluded, fmt) in decisions.items() if fmt is Format.BF16 and excluded is False]
        quant = [u for u, (excluded, fmt) in decisions.items() if fmt in QUANTIZED_FORMATS and excluded]
        if refused:
            out.append(
                problem(
                    Code.PARTIAL_FUSED_EXCLUSION,
                    f"{engine}: the ignore list excludes some but not all shards of {len(refused)} fused "
                    f"module(s), e.g. {refused[0]}; the engine refuses to load this",
                    refused[0],
                    str(engine),
                )
            )
        if bf16:
            out.append(
                problem(
                    Code.BF16_BUT_NOT_IGNORED,
                    f"{engine}: {len(bf16)} module(s) are BF16 in the tensors but not excluded in the config, "
                    f"e.g. {bf16[0]}",
                    bf16[0],
                    str(engine),
                )
            )
        if quant:
            out.append(
                problem(
                    Code.QUANTIZED_BUT_IGNORED,
                    f"{engine}: {len(quant)} module(s) are quantized in the tensors but excluded by the config, "
                    f"e.g. {quant[0]}",
                    quant[0],
                    str(engine),
                )
            )
    return out


def _short(layers: list[int]) -> str:
    layers = sorted(set(layers))
    return ", ".join(map(str, layers[:8])) + (f" ... ({len(layers)} in all)" if len(layers) > 8 else "")
