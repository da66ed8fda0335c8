"""Configs of a mixed output (NVFP4 routed experts + FP8 dense linears), in both formats.

ModelOpt (what `export_hf_checkpoint` of a mixed mtq config writes, modelopt/torch/export/quant_utils.py
`process_layer_quant_config` and convert_hf_config.py; checked against ModelOpt 0.47 on the tiny model):
hf_quant_config.json `quantization = {quant_algo: MIXED_PRECISION, kv_cache_quant_algo, quantized_layers}`
with one entry per quantized module (`{quant_algo: FP8}` per linear, `{quant_algo: NVFP4, group_size: 16}`
per routed-experts module `...mlp.experts`); config.json's quantization_config has the same
`quantized_layers`, one config group per distinct entry (targets: the sorted module names, groups numbered in
module order), `ignore: []` and `quant_method: modelopt`. ModelOpt writes no exclusion list here: vLLM's and
SGLang's ModelOptMixedPrecisionConfig build a module missing from `quantized_layers` unquantized (vLLM
modelopt.py, vllm PR 35047; SGLang modelopt_quant.py), and no glob list could say it as well: GDN's
in_proj_a/b stay BF16 while in_proj_qkv/z are FP8.

compressed-tensors (llm-compressor 0.14 with a recipe of two config groups): one NVFP4 group targeting the
routed expert projections, one FP8 group (W8A8, strategy tensor, static input) targeting the FP8 linears by
regex, `format: mixed-precision` at the top, each group its own format, every BF16 linear in `ignore` (as
qtool's other compressed-tensors outputs: both engines then agree whatever their target matching).
"""

from __future__ import annotations

import copy
import re

from qtool.arch.model_map import Format, ModelMap
from qtool.arch.qwen35 import engine_module
from qtool.engines.decide import linear_modules

MIXED = "MIXED_PRECISION"
_FP8_ENTRY = {"quant_algo": "FP8"}
_NVFP4_ENTRY = {"quant_algo": "NVFP4", "group_size": 16}
_MO_GROUP = {  # convert_hf_config.py _quant_algo_to_group_config
    "FP8": {
        "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
        "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
    },
    "NVFP4": {
        "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
    },
}
_FP8_ARGS: dict[
    str, object
] = {  # compressed-tensors preset FP8 (quantization/quant_scheme.py), model_dump() as 0.19 writes it
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": None,
    "num_bits": 8,
    "observer": "minmax",
    "observer_kwargs": {},
    "scale_dtype": None,
    "strategy": "tensor",
    "symmetric": True,
    "type": "float",
    "zp_dtype": None,
}
_CT_FP8_GROUP = {
    "format": "float-quantized",
    "input_activations": {**_FP8_ARGS, "observer": "static_minmax"},
    "output_activations": None,
    "weights": dict(_FP8_ARGS),
}


def _order(name: str) -> tuple:
    """Module order inside the model (transformers' definition order: attention or GDN, then the MLP's
    routed experts, then the shared expert), which numbers ModelOpt's config groups."""
    m = re.search(r"layers\.(\d+)\.", name)
    layer = int(m.group(1)) if m else -1
    part = 1 if ".mlp.experts" in name else 2 if ".mlp." in name else 0
    return (layer, part, name)


def quantized_layers(model_map: ModelMap) -> dict[str, dict]:
    """module -> its ModelOpt entry, for every quantized module of the output (MTP and vision are BF16)."""
    out: dict[str, dict] = {}
    for name, fmt in linear_modules(model_map).items():
        if fmt is Format.FP8:
            out[name] = dict(_FP8_ENTRY)
        elif fmt is Format.NVFP4:
            out[engine_module(name)] = dict(_NVFP4_ENTRY)
    return {k: out[k] for k in sorted(out, key=_order)}


def _modelopt_groups(layers: dict[str, dict]) -> dict:
    by_entry: dict[str, list[str]] = {}
    for name, entry in layers.items():
        by_entry.setdefault(entry["quant_algo"], []).append(name)
    return {
        f"group_{k}": {**copy.deepcopy(_MO_GROUP[algo]), "targets": sorted(names)}
        for k, (algo, names) in enumerate(by_entry.items())
    }


def modelopt_mixed(model_map: ModelMap, kv_scheme: dict | None, producer: dict) -> tuple[dict, dict]:
    """(config.json quantization_config, hf_quant_config.json) of a ModelOpt MIXED_PRECISION output."""
    layers = quantized_layers(model_map)
    qc: dict[str, object] = {
        "config_groups": _modelopt_groups(layers),
        "quantized_layers": layers,
        "ignore": [],
        "quant_algo": MIXED,
        "kv_cache_scheme": kv_scheme,
        "producer": producer,
        "quant_method": "modelopt",
    }
    hq = {
        "producer": producer,
        "quantization": {
            "quant_algo": MIXED,
            "kv_cache_quant_algo": "FP8" if kv_scheme else None,
            "quantized_layers": layers,
        },
    }
    return qc, hq


# the FP8 linears by kind, as compressed-tensors targets (`re:` patterns match the module's full name)
_CT_FP8_TARGETS = (
    ("self_attn.", r"re:.*self_attn\.(q|k|v|o)_proj$"),
    ("mlp.shared_expert.", r"re:.*mlp\.shared_expert\.(gate|up|down)_proj$"),
    ("linear_attn.", r"re:.*linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$"),
)
_CT_EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"


def ct_mixed_groups(model_map: ModelMap, nvfp4_group: dict) -> dict:
    """compressed-tensors config_groups of a mixed output: NVFP4 experts (group_0), FP8 linears (group_1)."""
    fp8 = [n for n, f in linear_modules(model_map).items() if f is Format.FP8]
    targets = [pattern for kind, pattern in _CT_FP8_TARGETS if any(kind in n for n in fp8)]
    groups = {}
    if any(f is Format.NVFP4_CT for f in linear_modules(model_map).values()):
        groups["group_0"] = {**copy.deepcopy(nvfp4_group), "targets": [_CT_EXPERT_TARGET]}
    groups[f"group_{len(groups)}"] = {**copy.deepcopy(_CT_FP8_GROUP), "targets": targets}
    return groups
