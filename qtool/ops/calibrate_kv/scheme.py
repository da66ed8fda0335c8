"""calibrate-kv: the KV-cache scheme each convention writes into config.json (what the plan decides and the
output plan writes)."""

from __future__ import annotations

from qtool.formats.naming import Flavour

# KV-scale naming: modelopt self_attn.k_proj.k_scale (modelopt/torch/export/unified_export_hf.py),
# compressed-tensors self_attn.k_scale (compressed_tensors kv_cache): the one flavour enum
Convention = Flavour


# config.json quantization_config.kv_cache_scheme per convention.
# ModelOpt: modelopt/torch/export/convert_hf_config.py (kv_cache_quant_algo FP8 -> this dict).
MODELOPT_KV_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}
# compressed-tensors: QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False,
# symmetric=True).model_dump() with compressed-tensors 0.19, as llm-compressor 0.14 writes it.
CT_KV_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "group_size": None,
    "strategy": "tensor",
    "block_structure": None,
    "dynamic": False,
    "actorder": None,
    "scale_dtype": None,
    "zp_dtype": None,
    "observer": "minmax",
    "observer_kwargs": {},
}


def kv_only_quantization_config() -> dict:
    """What llm-compressor 0.14 writes for KV-cache-only quantization of a BF16 model (docs/formats.md §4)."""
    return {
        "config_groups": {},
        "format": "dense",
        "ignore": ["re:^mtp.*"],
        "kv_cache_scheme": dict(CT_KV_SCHEME),
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
