"""config.json quantization_config / hf_quant_config.json for each output format, with ignore lists that
both engines read the same way (qtool.engines.decide.ignore_patterns_for on the output's own tensors)."""

from __future__ import annotations

import copy

from qtool.arch.model_map import QUANTIZED_FORMATS, Format, ModelMap
from qtool.engines import Flavour
from qtool.engines.decide import ignore_patterns_for, linear_modules
from qtool.formats.awq import effective_group_size
from qtool.ops.calibrate_kv import CT_KV_SCHEME, MODELOPT_KV_SCHEME
from qtool.ops.quantize.mixed_configs import ct_mixed_groups, modelopt_mixed
from qtool.recipes import OutFormat, Scheme

_NVFP4_ARGS = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}

# What llm-compressor 0.14 / compressed-tensors 0.19 write for preset scheme NVFP4 (checked on the
# tiny_nvfp4_ct fixture's config.json).
_CT_NVFP4_GROUP: dict[str, object] = {
    "format": "nvfp4-pack-quantized",
    "input_activations": {
        "actorder": None,
        "block_structure": None,
        "dynamic": "local",
        "group_size": 16,
        "num_bits": 4,
        "observer": "static_minmax",
        "observer_kwargs": {},
        "scale_dtype": "torch.float8_e4m3fn",
        "strategy": "tensor_group",
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    },
    "output_activations": None,
    "targets": ["Linear"],
    "weights": {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": 16,
        "num_bits": 4,
        "observer": "memoryless_minmax",
        "observer_kwargs": {},
        "scale_dtype": "torch.float8_e4m3fn",
        "strategy": "tensor_group",
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    },
}


def _ct_w4a16_group(group_size: int) -> dict:
    # compressed-tensors preset W4A16 (quantization/quant_scheme.py): int4, symmetric, group strategy.
    return {
        "format": "pack-quantized",
        "input_activations": None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": {
            "actorder": None,
            "block_structure": None,
            "dynamic": False,
            "group_size": group_size,
            "num_bits": 4,
            "observer": "minmax",
            "observer_kwargs": {},
            "scale_dtype": None,
            "strategy": "group",
            "symmetric": True,
            "type": "int",
            "zp_dtype": None,
        },
    }


def awq_not_convert(model_map: ModelMap) -> list[str]:
    """Substrings for AutoAWQ's `modules_to_not_convert` (vLLM awq.py `is_layer_skipped_awq`: a module is
    skipped when any entry is a substring of its name). Group-level entries when they hit no quantized
    module, else the exact module name."""
    mods = linear_modules(model_map)
    q = [m for m, f in mods.items() if f in QUANTIZED_FORMATS]
    unq = sorted(m for m, f in mods.items() if f is Format.BF16)
    cands = (
        "visual.",
        "mtp",
        "lm_head",
        "linear_attn",
        "self_attn",
        "shared_expert_gate",
        "shared_expert.",
        "mlp.gate",
    )
    out: list[str] = []
    for m in unq:
        if any(o in m for o in out):
            continue
        pick = next((c for c in cands if c in m and not any(c in x for x in q)), None)
        if pick is None and ".mlp.experts." in m:
            unit = m.partition(".mlp.experts.")[0] + ".mlp.experts"
            pick = unit if not any(unit in x for x in q) else m
        out.append(pick or m)
    return out


def _ct_w4a16_groups(group_size: int, in_features: dict[str, int]) -> dict:
    """One config group when every expert projection uses `group_size`; else one group per effective
    group size (a projection with in-features < group_size has one group per row, group = in-features),
    targeting those projections by regex, so that compressed-tensors (and transformers' decompression)
    reshape each weight by the group it was really quantized with."""
    by_g: dict[int, list[str]] = {}
    for part, n_in in sorted(in_features.items()):
        by_g.setdefault(effective_group_size(n_in, group_size), []).append(part)
    if len(by_g) <= 1 and all(g == group_size for g in by_g):
        return {"group_0": _ct_w4a16_group(group_size)}
    out = {}
    for k, (g, parts) in enumerate(sorted(by_g.items(), reverse=True)):
        grp = _ct_w4a16_group(g)
        grp["targets"] = [r"re:.*mlp\.experts\.\d+\.(" + "|".join(parts) + r")$"]
        out[f"group_{k}"] = grp
    return out


def quant_configs(
    model_map: ModelMap,
    scheme: Scheme,
    fmt: OutFormat,
    kv_fp8: bool,
    group_size: int,
    versions: dict,
    in_features: dict[str, int] | None = None,
    *,
    mixed: bool = False,
) -> tuple[dict, dict | None]:
    """(config.json quantization_config, hf_quant_config.json or None). `in_features`: routed expert
    projection -> in-features (W4A16: the group actually used per projection). `mixed`: FP8 dense linears
    besides (or instead of) the experts' scheme (qtool.ops.quantize.mixed_configs)."""
    producer = {"name": "qtool", "version": versions.get("qtool")}
    if fmt is OutFormat.AWQ:
        return (
            {
                "quant_method": "awq",
                "bits": 4,
                "group_size": group_size,
                "zero_point": True,
                "version": "gemm",
                "modules_to_not_convert": awq_not_convert(model_map),
            },
            None,
        )
    if mixed and fmt is OutFormat.MODELOPT:
        return modelopt_mixed(model_map, dict(MODELOPT_KV_SCHEME) if kv_fp8 else None, producer)
    if fmt is OutFormat.MODELOPT:
        (globs,) = ignore_patterns_for(model_map, (Flavour.MODELOPT,))
        qc = {
            "config_groups": {
                "group_0": {"input_activations": dict(_NVFP4_ARGS), "weights": dict(_NVFP4_ARGS), "targets": ["Linear"]}
            },
            "ignore": globs,
            "quant_algo": "NVFP4",
            "kv_cache_scheme": dict(MODELOPT_KV_SCHEME) if kv_fp8 else None,
            "producer": producer,
            "quant_method": "modelopt",
        }
        hq = {
            "producer": producer,
            "quantization": {
                "quant_algo": "NVFP4",
                "kv_cache_quant_algo": "FP8" if kv_fp8 else None,
                "group_size": 16,
                "exclude_modules": globs,
            },
        }
        return qc, hq
    (regexes,) = ignore_patterns_for(model_map, (Flavour.COMPRESSED_TENSORS,))
    if mixed:
        groups = ct_mixed_groups(model_map, _CT_NVFP4_GROUP)
    elif scheme is Scheme.NVFP4:
        groups = {"group_0": copy.deepcopy(_CT_NVFP4_GROUP)}
    else:
        groups = _ct_w4a16_groups(group_size, in_features or {})
    formats = {g["format"] for g in groups.values()}
    return (
        {
            "config_groups": groups,
            # one format, or compressed-tensors' CompressionFormat.mixed_precision (each group names its own)
            "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "global_compression_ratio": None,
            "ignore": regexes,
            "kv_cache_scheme": dict(CT_KV_SCHEME) if kv_fp8 else None,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
            "version": versions.get("compressed-tensors"),
        },
        None,
    )
