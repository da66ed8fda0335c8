"""Oracle: qtool.engines.accepts' tables against the engines' own code (vLLM 0.33.0, SGLang 0.5.23).

Runs only when QTOOL_ENGINES_PYTHON names a python with both engines (CONTRIBUTING.md); CI never has it. The
engines' lists are read where they are data (vLLM modelopt.py QUANT_ALGOS / KV_CACHE_QUANT_ALGOS) and probed
where they are code (each candidate value fed to the engine's own config parser, accepted when it does not
raise)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from qtool.engines import Engine
from qtool.engines.accepts import KV_CACHE_SCHEMES, MODELOPT_KV_CACHE_QUANT_ALGOS, MODELOPT_QUANT_ALGOS

pytestmark = pytest.mark.engines
PY = os.environ.get("QTOOL_ENGINES_PYTHON")

CANDIDATE_ALGOS = sorted(MODELOPT_QUANT_ALGOS[Engine.VLLM] | MODELOPT_QUANT_ALGOS[Engine.SGLANG]
                         | {"INT3", "INT4_AWQ", "W4A8_AWQ", "FP4", "MXFP4"})
CANDIDATE_KV_BITS = [("float", 8), ("float", 4), ("int", 8), ("int", 4)]

_VLLM = r"""
import json, sys
from vllm.model_executor.layers.quantization import modelopt
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
kv_ok = []
for t, b in json.loads(sys.argv[1]):
    try:
        CompressedTensorsConfig.from_config({"config_groups": {}, "ignore": [], "format": "dense",
                                             "kv_cache_scheme": {"type": t, "num_bits": b, "strategy": "tensor",
                                                                 "dynamic": False, "symmetric": True}})
        kv_ok.append([t, b])
    except Exception:
        pass
print(json.dumps({"algos": list(modelopt.QUANT_ALGOS), "kv_algos": list(modelopt.KV_CACHE_QUANT_ALGOS),
                  "kv_schemes": kv_ok}))
"""

_SGLANG = r"""
import json, sys
from sglang.srt.layers.quantization import modelopt_quant as mq
classes = [c for c in (getattr(mq, n, None) for n in ("ModelOptFp8Config", "ModelOptFp4Config",
                                                     "ModelOptMixedPrecisionConfig")) if c is not None]
ok = []
for algo in json.loads(sys.argv[1]):
    for cls in classes:
        try:
            cls.from_config({"quantization": {"quant_algo": algo, "exclude_modules": [], "group_size": 16,
                                              "kv_cache_quant_algo": "FP8", "quantized_layers": {}}})
            ok.append(algo)
            break
        except Exception:
            pass
print(json.dumps({"algos": ok}))
"""


def _run(code: str, arg) -> dict:
    out = subprocess.run([PY, "-c", code, json.dumps(arg)], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_modelopt_lists_and_kv_schemes_match():
    got = _run(_VLLM, CANDIDATE_KV_BITS)
    assert set(got["algos"]) == MODELOPT_QUANT_ALGOS[Engine.VLLM]
    assert set(got["kv_algos"]) == MODELOPT_KV_CACHE_QUANT_ALGOS[Engine.VLLM]
    assert {tuple(s) for s in got["kv_schemes"]} == KV_CACHE_SCHEMES[Engine.VLLM]


def test_sglang_modelopt_algorithms_match():
    got = _run(_SGLANG, CANDIDATE_ALGOS)
    assert set(got["algos"]) == MODELOPT_QUANT_ALGOS[Engine.SGLANG]
