"""Oracle: qtool.engines.accepts' tables against the engines' own code (vLLM 0.33.0, SGLang 0.5.23).

Runs only when QTOOL_ENGINES_PYTHON names a python with both engines (CONTRIBUTING.md); CI never has it.
accepts_runner.py reads the lists the engines keep as data and feeds every candidate value to the engines'
own parsers where the list is code; each table here must equal what the engine accepts among the candidates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qtool.engines import Engine
from qtool.engines.accepts import (
    COMPRESSED_TENSORS_SCHEMES,
    FLOAT4,
    FLOAT8,
    INT4,
    INT8,
    KV_CACHE_SCHEMES,
    LAYER_TYPES,
    MODELOPT_KV_CACHE_QUANT_ALGOS,
    MODELOPT_QUANT_ALGOS,
)

pytestmark = pytest.mark.engines
PY = os.environ.get("QTOOL_ENGINES_PYTHON")
RUNNER = Path(__file__).with_name("accepts_runner.py")

SPECS = [FLOAT4, FLOAT8, INT4, INT8]
CANDIDATES = {
    "algos": sorted(
        MODELOPT_QUANT_ALGOS[Engine.VLLM]
        | MODELOPT_QUANT_ALGOS[Engine.SGLANG]
        | {"INT3", "INT4_AWQ", "W4A8_AWQ", "FP4", "MXFP4", "INT8_SQ", "NVFP4_AWQ"}
    ),
    "kv_algos": ["FP8", "NVFP4", "INT8", "INT4", "FP4"],
    "specs": [list(s) for s in SPECS],
    "layer_types": ["full_attention", "linear_attention", "attention", "mamba", "sliding_attention"],
}


@pytest.fixture(scope="module")
def engines() -> dict:
    """What both engines accept among CANDIDATES (one run: importing them takes a minute)."""
    out = subprocess.run(
        [PY, str(RUNNER), json.dumps(CANDIDATES)], capture_output=True, text=True, timeout=1200, check=False
    )
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
    assert out.returncode == 0
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pairs(got: list[str]) -> set:
    return {(tuple(w), None if a is None else tuple(a)) for w, a in map(json.loads, got)}


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG], ids=["vllm", "sglang"])
def test_modelopt_quant_algos_match(engines, engine):
    got = engines[engine.value]
    assert {a.upper() for a in got["quant_algos"]} == MODELOPT_QUANT_ALGOS[engine]
    if engine is Engine.VLLM:
        assert set(got["quant_algos_list"]) == MODELOPT_QUANT_ALGOS[engine]


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG], ids=["vllm", "sglang"])
def test_kv_cache_settings_match(engines, engine):
    got = engines[engine.value]
    assert set(got["kv_algos"]) == MODELOPT_KV_CACHE_QUANT_ALGOS[engine]
    assert {tuple(s) for s in got["kv_schemes_modelopt"]} == KV_CACHE_SCHEMES[engine]
    assert {tuple(s) for s in got["kv_schemes_ct"]} == KV_CACHE_SCHEMES[engine]


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG], ids=["vllm", "sglang"])
def test_compressed_tensors_schemes_match(engines, engine):
    assert _pairs(engines[engine.value]["schemes"]) == COMPRESSED_TENSORS_SCHEMES[engine]


def test_layer_types_match(engines):
    assert set(engines["vllm"]["layer_types"]) == LAYER_TYPES[Engine.VLLM]
    assert engines["sglang"]["layer_types_read"] is False and LAYER_TYPES[Engine.SGLANG] is None
    assert set(engines["sglang"]["decoder_layer_types"]) == {"attention", "linear_attention"}
