"""Runs inside QTOOL_ENGINES_PYTHON (vllm==0.33.0, sglang==0.5.23): the engines' REAL matching functions.

stdin: JSON list of {"engine", "flavour", "prefix", "kind", "mtp", "ignore"}; stdout: JSON list of
true / false / "partial" (the engine raised ValueError for mixed fused shards).
Kept free of qtool imports: it runs in the other interpreter.
"""

import contextlib
import io
import json
import logging
import sys
import warnings

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def _vllm_modelopt(ignore, mtp):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
    from vllm.model_executor.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration as M

    cfg = ModelOptNvFp4Config.from_config(
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": list(ignore)}
    )
    if not mtp:  # the drafter class has no hf_to_vllm_mapper
        cfg.apply_vllm_mapper(M.hf_to_vllm_mapper.get_rename_mapper())
    cfg.packed_modules_mapping = M.packed_modules_mapping
    return lambda prefix, kind: cfg.is_layer_excluded(prefix)


def _vllm_ct(ignore, mtp):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration as M

    w = {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "group_size": 16,
        "symmetric": True,
        "dynamic": False,
    }
    cfg = CompressedTensorsConfig.from_config(
        {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": w, "input_activations": dict(w, dynamic="local")}
            },
            "ignore": list(ignore),
        }
    )
    if not mtp:
        cfg.apply_vllm_mapper(M.hf_to_vllm_mapper.get_rename_mapper())
    cfg.packed_modules_mapping = M.packed_modules_mapping
    return lambda prefix, kind: should_ignore_layer(prefix, ignore=cfg.ignore, fused_mapping=cfg.packed_modules_mapping)


def _sglang_modelopt(ignore, mtp):
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config
    from sglang.srt.layers.quantization.utils import is_layer_skipped
    from sglang.srt.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration as S

    packed = S.packed_modules_mapping
    cfg = ModelOptFp4Config.from_config(
        {"quant_algo": "NVFP4", "group_size": 16, "ignore": list(ignore), "packed_modules_mapping": packed}
    )

    def decide(prefix, kind):
        if kind == "moe":  # _get_quant_method: FusedMoE -> is_layer_excluded only
            return cfg.is_layer_excluded(prefix)
        return is_layer_skipped(prefix, cfg.exclude_modules, cfg.packed_modules_mapping) or cfg.is_layer_excluded(
            prefix
        )

    return decide


def _sglang_ct(ignore, mtp):
    from sglang.srt.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from sglang.srt.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration as S

    return lambda prefix, kind: should_ignore_layer(prefix, ignore=list(ignore), fused_mapping=S.packed_modules_mapping)


BUILD = {
    ("vllm", "modelopt"): _vllm_modelopt,
    ("vllm", "compressed-tensors"): _vllm_ct,
    ("sglang", "modelopt"): _sglang_modelopt,
    ("sglang", "compressed-tensors"): _sglang_ct,
}


def main():
    cases = json.load(sys.stdin)
    cache = {}
    out = []
    with contextlib.redirect_stdout(io.StringIO()):
        for c in cases:
            key = (c["engine"], c["flavour"], tuple(c["ignore"]), c["mtp"])
            if key not in cache:
                cache[key] = BUILD[(c["engine"], c["flavour"])](c["ignore"], c["mtp"])
            try:
                out.append(bool(cache[key](c["prefix"], c["kind"])))
            except ValueError:
                out.append("partial")
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main()
